"""Carries a model file to a machine without registry access (the GPU machine) in parts of at most 55 MiB.

    python -m scripts.gguf_parts split FILE OUTDIR [--part-mib N]   # OUTDIR/<name>.part000 ... + manifest.json
                                                        # (N <= 55, default 55: a device call carries 64 MiB with
                                                        # the working tree, so a larger tree needs smaller parts)
    python -m scripts.gguf_parts join PARTSDIR OUTFILE  # OUTFILE may be a folder (or end in /): the file keeps
                                                        # its name there

The manifest lists every part's name, size and sha256 and the whole file's size and sha256; `join` checks all
of them and writes nothing at OUTFILE unless the whole file verifies. Neither command replaces a file that is
already there: one that verifies is kept (the command succeeds), anything else is refused. Standard library
only: it runs under the GPU machine's bare Python.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable

MAX_PART_BYTES = 55 << 20  # 55 MiB
MANIFEST = "manifest.json"
_CHUNK = 8 << 20  # bytes per read
_FORMAT = 1  # manifest format version


class PartsError(Exception):
    """A split or join that was refused or failed; the message says what and where."""


def sha256_file(file: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def split_file(file: str | os.PathLike, outdir: str | os.PathLike, *, part_size: int = MAX_PART_BYTES,
               log: Callable[[str], object] = print) -> dict:
    """Cuts `file` into `outdir/<name>.partNNN` of at most `part_size` bytes and writes `outdir/manifest.json`
    (last, so a manifest means a complete split); returns the manifest. An existing manifest there that
    verifies against its parts and describes this very file is kept; any other manifest or part is refused."""
    file, outdir = pathlib.Path(file), pathlib.Path(outdir)
    if not 0 < part_size <= MAX_PART_BYTES:
        raise PartsError(f"part size {part_size} outside 1 .. {MAX_PART_BYTES}")
    if not file.is_file():
        raise PartsError(f"{file} is not a file")
    outdir.mkdir(parents=True, exist_ok=True)
    if (outdir / MANIFEST).exists():
        manifest = verify_parts(outdir)
        size, sha = file.stat().st_size, sha256_file(file)
        if (manifest["size"], manifest["sha256"]) != (size, sha):
            raise PartsError(f"{outdir / MANIFEST} describes another file ({manifest['size']:,} bytes, sha256 "
                             f"{manifest['sha256']}; {file} has {size:,} bytes, sha256 {sha}): left as it is")
        log(f"{outdir} already holds verified parts of {file}")
        return manifest
    clash = sorted(p.name for p in outdir.iterdir() if p.name.startswith(f"{file.name}.part"))
    if clash:
        raise PartsError(f"{outdir} already holds {', '.join(clash[:3])}{' ...' if len(clash) > 3 else ''} "
                         f"without a manifest: remove them or pick another folder")
    whole = hashlib.sha256()
    parts = []
    with open(file, "rb") as src:
        while True:
            data = src.read(part_size)
            if not data and parts:
                break
            name = f"{file.name}.part{len(parts):03d}"
            with open(outdir / name, "xb") as out:  # x: never replaces a file
                out.write(data)
            whole.update(data)
            parts.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            if len(data) < part_size:
                break
    manifest = {"format": _FORMAT, "file": file.name, "size": sum(p["size"] for p in parts),
                "sha256": whole.hexdigest(), "part_size": part_size, "parts": parts}
    _write_new(outdir / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    log(f"split {file} ({manifest['size']:,} bytes, sha256 {manifest['sha256']}) into {len(parts)} parts "
        f"in {outdir}")
    return manifest


def read_manifest(partsdir: str | os.PathLike) -> dict:
    """`partsdir/manifest.json`, its fields checked for type and its names for being plain file names."""
    path = pathlib.Path(partsdir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise PartsError(f"cannot read {path}: {err}") from None
    try:
        ok = (manifest["format"] == _FORMAT and _plain_name(manifest["file"]) and _count(manifest["size"])
              and _hex64(manifest["sha256"]) and isinstance(manifest["parts"], list) and manifest["parts"]
              and all(_plain_name(p["name"]) and _count(p["size"]) and _hex64(p["sha256"])
                      for p in manifest["parts"])
              and sum(p["size"] for p in manifest["parts"]) == manifest["size"])
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise PartsError(f"{path} is not a valid manifest (format {_FORMAT})")
    return manifest


def verify_parts(partsdir: str | os.PathLike) -> dict:
    """The manifest of `partsdir` once every part has its size and sha256 and together they hash to the
    whole file's sha256; PartsError naming the first that does not."""
    partsdir = pathlib.Path(partsdir)
    manifest = read_manifest(partsdir)
    whole = hashlib.sha256()
    for part in manifest["parts"]:
        for chunk in _read_part(partsdir, part):
            whole.update(chunk)
    _check_whole(manifest, whole.hexdigest(), partsdir / MANIFEST)
    return manifest


def join_parts(partsdir: str | os.PathLike, outfile: str | os.PathLike, *,
               log: Callable[[str], object] = print) -> pathlib.Path:
    """Joins the parts in `partsdir` into `outfile` (or `outfile/<file>` when `outfile` is a folder or ends in
    a slash), checking every part and the whole; returns the path written. The file appears only once it
    verifies; an existing one is kept when it verifies and refused otherwise."""
    partsdir = pathlib.Path(partsdir)
    manifest = read_manifest(partsdir)
    out = pathlib.Path(outfile)
    if out.is_dir() or str(outfile).endswith(("/", os.sep)):  # a trailing slash names a folder, made if need be
        out = out / manifest["file"]
    expected = f"{manifest['size']:,} bytes, sha256 {manifest['sha256']}"
    if os.path.lexists(out):
        if not out.is_file():
            raise PartsError(f"{out} exists and is not a regular file: left as it is")
        size = out.stat().st_size
        sha = sha256_file(out) if size == manifest["size"] else None
        if sha != manifest["sha256"]:
            found = f"{size:,} bytes" + (f", sha256 {sha}" if sha else "")
            raise PartsError(f"{out} exists and is not this file (expected {expected}; found {found}): left as "
                             f"it is; move it away and join again")
        log(f"{out} is already there and verified ({expected})")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    tmp = pathlib.Path(tmp_name)
    try:
        whole = hashlib.sha256()
        with os.fdopen(fd, "wb") as dst:
            for part in manifest["parts"]:
                for chunk in _read_part(partsdir, part):
                    whole.update(chunk)
                    dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        _check_whole(manifest, whole.hexdigest(), partsdir / MANIFEST)
        os.chmod(tmp, 0o644)
        try:
            os.link(tmp, out)  # atomic, and cannot replace a file that appeared meanwhile
        except FileExistsError:
            raise PartsError(f"{out} appeared while joining: left as it is") from None
        except OSError:  # no hard links on this filesystem
            if os.path.lexists(out):
                raise PartsError(f"{out} appeared while joining: left as it is") from None
            os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"joined {len(manifest['parts'])} parts into {out} ({expected}, verified)")
    return out


def _read_part(partsdir: pathlib.Path, part: dict):
    """The bytes of one part, in chunks; PartsError unless it has the manifest's size and sha256. The part is
    read whole before its first chunk is handed on, so a bad part contributes nothing."""
    path = partsdir / part["name"]
    try:
        data = path.read_bytes()  # at most 55 MiB
    except OSError as err:
        raise PartsError(f"cannot read the part {path}: {err}") from None
    sha = hashlib.sha256(data).hexdigest()
    if len(data) != part["size"] or sha != part["sha256"]:
        raise PartsError(f"the part {path} has {len(data):,} bytes, sha256 {sha}; the manifest says "
                         f"{part['size']:,} bytes, sha256 {part['sha256']}")
    for i in range(0, len(data), _CHUNK):
        yield data[i:i + _CHUNK]


def _check_whole(manifest: dict, sha: str, manifest_path: pathlib.Path) -> None:
    if sha != manifest["sha256"]:
        raise PartsError(f"the parts each verify but together hash to sha256 {sha}; {manifest_path} says "
                         f"{manifest['sha256']}")


def _write_new(path: pathlib.Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.link(tmp, path)
    except FileExistsError:
        raise PartsError(f"{path} appeared meanwhile: left as it is") from None
    finally:
        os.unlink(tmp)


def _plain_name(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name \
        and "\0" not in name


def _count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _hex64(s) -> bool:
    return isinstance(s, str) and len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.gguf_parts", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("split", help=f"cut FILE into parts of at most {MAX_PART_BYTES >> 20} MiB + {MANIFEST}")
    sp.add_argument("file")
    sp.add_argument("outdir")
    sp.add_argument("--part-mib", type=int, default=MAX_PART_BYTES >> 20,
                    help=f"part size in MiB, 1 .. {MAX_PART_BYTES >> 20} (default): a device call carries the "
                         "working tree beside the part, 64 MiB in all")
    jp = sub.add_parser("join", help="join the parts of PARTSDIR into OUTFILE (a file, or a folder), verified")
    jp.add_argument("partsdir")
    jp.add_argument("outfile")
    args = ap.parse_args(argv)
    try:
        if args.command == "split":
            if not 1 <= args.part_mib <= MAX_PART_BYTES >> 20:
                raise PartsError(f"--part-mib {args.part_mib} outside 1 .. {MAX_PART_BYTES >> 20}")
            split_file(args.file, args.outdir, part_size=args.part_mib << 20)
        else:
            join_parts(args.partsdir, args.outfile)
    except PartsError as err:
        print(f"gguf_parts: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
