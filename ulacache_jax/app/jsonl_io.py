"""Files of the `ulacache generate` run that lose nothing: input read as bytes and decoded line by line, output
held under an exclusive lock, written in whole lines (flushed and fsynced per batch of results), repaired and
compacted atomically on `--resume`, side files (report, plot) written to a temp file and renamed.

Why each piece:
- Input as bytes, split on b"\\n": one invalid UTF-8 byte fails its own line (by number), not the whole file, and
  `str.splitlines` would also split inside a JSON string at U+2028 or \\x1c. A UTF-8 BOM is dropped, so the first
  request keeps its `{`.
- The lock is `fcntl.flock` on a side file `<output>.lock` holding the holder's pid: a second run on the same output
  fails at once and names it. The side file (not the output itself) because `--resume` replaces the output by a
  rename, which would leave a lock on the old inode.
- A batch of result lines goes out in one write; if the write fails (a full disk), the file is truncated back to
  its last whole line, so the JSONL always parses.
- `--resume` keys results by id and by the settings fingerprint stored in each record (`settings`); the file is
  rewritten (temp + fsync + rename) to drop a torn last line and error records a later success supersedes.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import pathlib
import signal
import stat
import tempfile

BOM = b"\xef\xbb\xbf"
SETTINGS_FIELD = "settings"


class OutputError(Exception):
    """An output path that cannot be used, a held lock, a failed write: reported on stderr, never a traceback."""


# ---- input ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class InputLine:
    number: int            # 1-based line number in the file
    text: str | None       # None when the bytes are not UTF-8
    error: str | None = None


def split_lines(data: bytes) -> list[InputLine]:
    """File bytes -> one InputLine per line (a BOM at the start dropped; a trailing \\r dropped; invalid UTF-8
    fails only its line, with the byte's position in the line)."""
    if data.startswith(BOM):
        data = data[len(BOM):]
    out = []
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    for n, raw in enumerate(parts, start=1):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        try:
            out.append(InputLine(n, raw.decode("utf-8")))
        except UnicodeDecodeError as e:
            out.append(InputLine(n, None, f"invalid UTF-8: byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the "
                                          f"line ({e.reason})"))
    return out


def lone_surrogate(text: str) -> str | None:
    """A message naming the first lone surrogate in `text` (JSON allows "\\ud800"; UTF-8 cannot encode it), or
    None when `text` is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"lone surrogate U+{ord(text[e.start]):04X} at character {e.start} (not valid Unicode text)"
    return None


# ---- paths ------------------------------------------------------------------------------------------------------
def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when `a` and `b` are (or resolve to, through symlinks, `..` or hard links) one file."""
    pa, pb = pathlib.Path(a), pathlib.Path(b)
    if os.path.realpath(pa) == os.path.realpath(pb):
        return True
    try:
        return pa.exists() and pb.exists() and os.path.samefile(pa, pb)
    except OSError:
        return False


def _probe_writable(folder: pathlib.Path, name: str) -> None:
    """Create and remove a temp file in `folder` (permission bits say nothing about read-only mounts or ACLs);
    OutputError '<name> is not writable' otherwise."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".ulacache-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputError(f"{name} is not writable ({e.strerror})") from None


def real_path(path: str | os.PathLike) -> pathlib.Path:
    """The file `path` names, through symlinks and `..`: what is locked, written and replaced (a symlink to the
    output locks and writes its target, and a repair or a report replaces the target, not the link)."""
    return pathlib.Path(os.path.realpath(path))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular_target(path: str | os.PathLike, what: str) -> None:
    """Refuse an existing target (through symlinks) that is not a regular file: a device, FIFO, socket or folder
    would be replaced by a regular file (atomic rename) or block / stop the run. A dangling symlink passes: its
    target is created."""
    p = pathlib.Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return
    except OSError as e:
        raise OutputError(f"{what} {path}: cannot stat it ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        real = real_path(p)
        via = f" (through the symlink, {real})" if str(real) != os.path.abspath(p) else ""
        raise OutputError(f"{what} {path} is {_kind(st.st_mode)}{via}, not a regular file: name a file to write")


def check_writable_file(path: str | os.PathLike, what: str) -> pathlib.Path:
    """Refuse, before any work, a file path that cannot be written: its folder missing or not a folder, the folder
    or an existing file not writable, the path a folder, a device, a FIFO or a socket. Symlinks are followed (the
    target is what gets written). Probes by creating a temp file (permission bits say nothing to root or on a
    read-only mount)."""
    check_regular_target(path, what)
    p = real_path(path)
    parent = p.parent
    if not parent.exists():
        raise OutputError(f"{what} {path}: folder {parent} does not exist")
    if not parent.is_dir():
        raise OutputError(f"{what} {path}: {parent} is not a folder")
    _probe_writable(parent, f"{what} {path}: folder {parent}")
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputError(f"{what} {path} exists and is not writable")
    return p


def check_writable_dir(path: str | os.PathLike, what: str) -> pathlib.Path:
    """Refuse a folder (created if its parent exists) that cannot be written: for checkpoint and cache dirs."""
    p = pathlib.Path(path)
    if p.exists() and not p.is_dir():
        raise OutputError(f"{what} {path} is not a folder")
    if not p.exists():
        if not p.parent.is_dir():
            raise OutputError(f"{what} {path}: folder {p.parent} does not exist")
        try:
            p.mkdir()
        except OSError as e:
            raise OutputError(f"{what} {path}: cannot create it ({e.strerror})") from None
    _probe_writable(p, f"{what} {path}")
    return p


def _fsync_dir(folder: pathlib.Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write) -> None:
    """Write a file through `write(tmp_path)` into a temp file beside `path`, fsync it, rename it over `path`:
    a reader (or a crash) sees the old file or the new one, never half of one. A symlink is written through (its
    target replaced, the link kept); an existing target that is not a regular file is refused (OutputError)."""
    check_regular_target(path, "the target")
    p = real_path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp" + p.suffix, dir=p.parent or ".")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if p.exists():
            os.chmod(tmp, p.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(p.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda tmp: pathlib.Path(tmp).write_bytes(data))


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


# ---- the lock ---------------------------------------------------------------------------------------------------
class OutputLock:
    """An exclusive, non-blocking flock on `<output>.lock` (holding the pid), for the whole run. Second holders
    fail at once with the first one's pid. The lock file is removed on release. `flag` names the option the
    path came from in errors (the output file, or a checkpoint folder)."""

    def __init__(self, output: str | os.PathLike, flag: str = "--output"):
        # keyed by the real file: a run on `out.jsonl` and one on a symlink to it (or `d/../out.jsonl`) share a lock
        real = real_path(output)
        self.path = real.with_name(real.name + ".lock")
        self.output = pathlib.Path(output)
        self.flag = flag
        self._fd: int | None = None

    def acquire(self) -> "OutputLock":
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise OutputError(f"{self.flag} {self.output}: cannot create the lock file {self.path} "
                                  f"({e.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_pid(fd)
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    who = f"pid {holder}" if holder else "another process"
                    raise OutputError(f"{self.flag} {self.output} is in use by another ulacache run ({who}; lock file "
                                      f"{self.path}): wait for it to finish, or choose another {self.flag}") from None
                raise OutputError(f"{self.flag} {self.output}: cannot lock {self.path} ({e.strerror})") from None
            # the holder before us may have removed the file after we opened it: lock the file that is there now
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)   # closing drops the flock
        self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        raw = os.pread(fd, 32, 0).decode().strip()
        return int(raw) if raw else None
    except (OSError, ValueError):
        return None


# ---- output records ---------------------------------------------------------------------------------------------
def settings_fingerprint(settings: dict) -> str:
    """16 hex digits naming a run's settings (model, dtype, sampling defaults, limits): records with equal
    fingerprints came from runs whose outputs may be mixed in one file."""
    raw = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


@dataclasses.dataclass
class ExistingOutput:
    """What an output file holds, for --resume."""
    records: list[dict]                 # parsed records, in file order
    torn_tail: bytes = b""              # a last line cut short (no newline, or not JSON): dropped by the repair
    bad_lines: list[int] = dataclasses.field(default_factory=list)   # earlier lines that are not records

    def other_settings(self, fingerprint: str) -> list[dict]:
        return [r for r in self.records if r.get(SETTINGS_FIELD) != fingerprint]


def read_output(path: str | os.PathLike) -> ExistingOutput:
    p = pathlib.Path(path)
    if not p.exists():
        return ExistingOutput([])
    data = p.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()                   # b"" when the file ends with a newline
    recs, bad = [], []
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        obj = _parse_record(raw)
        if obj is None:
            if n == len(lines) and not tail:
                tail = raw + b"\n"       # the last line is garbage: torn by a crash that wrote its newline later
                continue
            bad.append(n)
        else:
            recs.append(obj)
    if tail.strip():
        obj = _parse_record(tail)
        if obj is not None and b"\n" not in tail:
            # a complete record lacking only its newline: keep it
            recs.append(obj)
            tail = b""
    return ExistingOutput(recs, tail if tail.strip() else b"", bad)


def _parse_record(raw: bytes) -> dict | None:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(obj, dict) or not ("finish_reason" in obj or is_batch_record(obj)):
        return None
    return obj


def is_batch_record(r: dict) -> bool:
    """An OpenAI Batch API output line ({"id", "custom_id", "response", "error"}), written for a batch input."""
    return "custom_id" in r and "response" in r and "error" in r


def record_id(r: dict):
    """The input id a result record answers: "custom_id" of a batch record, else "id"."""
    return r.get("custom_id") if is_batch_record(r) else r.get("id")


def record_ok(r: dict) -> bool:
    """Whether a record is a success: a batch record whose response has status 200, else finish_reason not error."""
    if is_batch_record(r):
        resp = r.get("response")
        return r.get("error") is None and isinstance(resp, dict) and resp.get("status_code") == 200
    return r.get("finish_reason") != "error"


def record_error(r: dict) -> str:
    """A failed record's message ("" for a success)."""
    if not is_batch_record(r):
        return str(r.get("error") or "")
    if isinstance(r.get("error"), dict):
        return str(r["error"].get("message") or "")
    body = (r.get("response") or {}).get("body") or {}
    return str((body.get("error") or {}).get("message") or "") if isinstance(body, dict) else ""


def compact(records: list[dict]) -> list[dict]:
    """The records that count, in file order: per id its first success; an error record only while nothing
    supersedes it: a success of its id (on its line, or on any line unless the error is about a duplicate id,
    which concerns its own line), or a later error of the same id and line; an id-less error (a line that was not
    even JSON) gives way to any later record of its line."""
    def key(r):
        return json.dumps(record_id(r), sort_keys=True)

    ok = [record_ok(r) for r in records]
    success_lines: dict[str, set] = {}
    last_of_line: dict = {}                 # line -> index of its last record
    last_error: dict = {}                   # (id, line) -> index of its last error record
    for i, (r, good) in enumerate(zip(records, ok)):
        if good:
            success_lines.setdefault(key(r), set()).add(r.get("line"))
        else:
            last_error[(key(r), r.get("line"))] = i
        last_of_line[r.get("line")] = i
    out, seen_ok = [], set()
    for i, (r, good) in enumerate(zip(records, ok)):
        if good:
            if key(r) in seen_ok:
                continue
            seen_ok.add(key(r))
        elif record_id(r) is None:
            if last_of_line[r.get("line")] > i:
                continue
        else:
            lines = success_lines.get(key(r), set())
            if r.get("line") in lines or (lines and not record_error(r).startswith("duplicate")):
                continue
            if last_error[(key(r), r.get("line"))] > i:
                continue
        out.append(r)
    return out


def encode_records(records: list[dict]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in records)


def rewrite_output(path: str | os.PathLike, records: list[dict]) -> None:
    """Replace the output by `records` (--resume's repair and compaction), atomically: a failure (a full disk, a
    read-only mount, a folder we may not write) leaves the file as it was and is an OutputError naming it."""
    try:
        atomic_write_bytes(path, encode_records(records))
    except OSError as e:
        raise OutputError(f"--output {path}: --resume cannot rewrite it ({e.strerror or e}); the file is "
                          "unchanged: free some space (or make its folder writable) and rerun") from None


class ResultWriter:
    """Appends whole result lines to the (locked) output: one write per batch, then fsync. A failed write (a full
    disk) truncates the file back to its last whole line and raises OutputError. SIGINT/SIGTERM are held off
    during the write, so an interrupt never lands mid-line."""

    def __init__(self, path: str | os.PathLike, *, append: bool):
        self.path = pathlib.Path(path)
        check_regular_target(path, "--output")
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        try:
            self._fd = os.open(self.path, flags, 0o666)
        except OSError as e:
            raise OutputError(f"--output {path}: cannot open it ({e.strerror})") from None
        self.lines_written = 0

    def write_batch(self, records: list[dict]) -> None:
        if not records:
            return
        data = memoryview(encode_records(records))
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            start = os.lseek(self._fd, 0, os.SEEK_END)
            try:
                while data:
                    n = os.write(self._fd, data)
                    data = data[n:]
                os.fsync(self._fd)
            except OSError as e:
                try:
                    os.ftruncate(self._fd, start)   # drop the partial line: the file ends on a whole line again
                except OSError:
                    pass
                raise OutputError(f"cannot write to --output {self.path} ({e.strerror}); the results written "
                                  "before are intact: free some space and rerun with --resume") from None
            self.lines_written += len(records)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
