"""RULER-style long-context tasks (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", arXiv 2404.06654; our own code and wording): prompts sized by a tokenizer, scored by string match.

    fn = haystacks.haystack_fn("pydoc", tok)                  # or "noise", "austen", "essays", a list of documents
    p = make("niah_multikey", haystack_text_fn=fn, num_tokens=4000, depth=0.5, seed=7, tokenizer=tok)
    p.text            # the user message: instruction, context, then the question (the caller applies the chat template)
    score(p, answer)  # fraction of p.answers found in the answer, case-insensitive (RULER's string_match_all)
    for task, context, depth, seed in grid(TASKS, (4096, 8192), (0.1, 0.5, 0.9), 16, seed=0): ...

Tasks (TASK_SPECS holds their defaults, RULER's; `spec=` overrides):
- niah_single: one needle "The special magic number for <key> is: <7 digits>." at `depth`; asks its number.
- niah_multikey: that needle plus 3 distractor needles (other keys, other numbers) at seeded random depths.
- niah_multivalue: one key stated 4 times with 4 numbers; all 4 must be returned.
- niah_multiquery: 4 keys, one number each; all 4 asked in one question.
- vt: variable tracking: "VAR ABCDE = 12345." then 4 hops "VAR FGHIJ = VAR ABCDE." ...; asks every variable that holds
  the value (the 5 names).
- cwe: common-word extraction: a numbered list in which 10 words occur `freq_common` times and the rest
  `freq_uncommon` times; asks the 10. Not a haystack task: its length is the list's (its words are the haystack's
  own words where the haystack has enough, made-up ones past them; haystack_text_fn may be None).
Depth (a fraction of the context's characters, 0 = first, 1 = last): the answered needles sit at the sentence
boundaries nearest to `depth` (several of them spread evenly over a band of `band` around it, kept inside [0, 1]; in
order for vt's chain). cwe has no depth (None).
Length: `num_tokens` bounds the user message, `len(tokenizer.encode(text))`: never above, and within 2% below
unless one haystack sentence is longer than that (the haystack is cut between sentences). Pass the context less the
chat template's tokens and the answer's. A needle's key and number occur nowhere else in the context (drawn again
when the haystack holds them).
Determinism: the same (task, num_tokens, depth, seed, spec) and haystack give the same text. grid's seeds depend on
(seed, task, context, prompt index), not on depth: one prompt index has the same haystack window and needles at
every depth (depth curves compare like with like), nor on which other tasks or contexts a grid lists.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import re
from collections.abc import Callable, Sequence

import numpy as np

from scripts import haystacks

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe")

LENGTH_SLACK = 0.02          # a prompt lands in [num_tokens * (1 - LENGTH_SLACK), num_tokens]
MAX_FILL_STEPS = 16


@dataclasses.dataclass(frozen=True)
class Prompt:
    task: str
    context: int                 # the nominal length asked for (num_tokens)
    depth: float | None          # None for cwe
    seed: int
    text: str                    # the user message
    answers: tuple[str, ...]
    prompt_tokens: int           # len(tokenizer.encode(text))


@dataclasses.dataclass(frozen=True)
class NiahSpec:
    num_keys: int = 1            # keys with needles (multikey: the asked key and num_keys - 1 distractors)
    num_values: int = 1          # needles (numbers) per asked key
    num_queries: int = 1         # keys asked (the first num_queries keys; the rest are distractors)
    band: float = 0.1            # the asked needles spread over this fraction of the context around depth
    value_digits: int = 7


@dataclasses.dataclass(frozen=True)
class VtSpec:
    num_chains: int = 1          # the asked chain and num_chains - 1 distractor chains (other values)
    num_hops: int = 4            # assignments after the first: num_hops + 1 variables a chain
    band: float = 0.5            # the asked chain spreads over this fraction of the context around depth
    name_letters: int = 5
    value_digits: int = 5


@dataclasses.dataclass(frozen=True)
class CweSpec:
    num_common: int = 10
    # (freq_common, freq_uncommon) pairs, first choice first: the first whose common words alone take at most half
    # of num_tokens (RULER's 30/3 needs ~1.2K tokens for the 300 common entries; short prompts use smaller counts)
    freqs: tuple[tuple[int, int], ...] = ((30, 3), (20, 2), (10, 2), (6, 1), (3, 1), (2, 1))


TASK_SPECS = {
    "niah_single": NiahSpec(),
    "niah_multikey": NiahSpec(num_keys=4),
    "niah_multivalue": NiahSpec(num_values=4),
    "niah_multiquery": NiahSpec(num_keys=4, num_queries=4),
    "vt": VtSpec(),
    "cwe": CweSpec(),
}

NIAH_INSTRUCTION = ("The text below hides one or more special magic numbers, each stated for a key. Find them and "
                    "remember them: a question about them follows the text.")
NIAH_NEEDLE = "The special magic number for {key} is: {value}."
NIAH_QUESTION_ONE = "What is the special magic number for {key} in the text above? Answer with the number only."
NIAH_QUESTION_VALUES = ("List every special magic number for {key} in the text above (there is more than one). "
                        "Answer with the numbers only.")
NIAH_QUESTION_KEYS = ("What are the special magic numbers for {keys} in the text above? Answer with the number for "
                      "each key.")
VT_INSTRUCTION = ("The text below hides chains of variable assignments (VAR NAME = value). Follow them: a question "
                  "about them follows the text.")
VT_FIRST = "VAR {name} = {value}."
VT_HOP = "VAR {name} = VAR {prev}."
VT_QUESTION = ("Which variables in the text above are assigned the value {value}, directly or through other "
               "variables? Answer with all of their names only.")
CWE_INSTRUCTION = "Below is a numbered list of words. A few of the words occur many more times than the others."
CWE_QUESTION = "What are the {n} most common words in the list above? Answer with the {n} words only."

# needle keys are "<adjective>-<noun>" (RULER draws its keys from English word lists the same way): 4096 keys
KEY_ADJECTIVES = (
    "amber", "ancient", "brave", "breezy", "bright", "broad", "calm", "clever", "cosy", "crimson", "curious", "dusty",
    "eager", "early", "faint", "fancy", "fierce", "fluffy", "frozen", "gentle", "gilded", "glad", "golden", "grand",
    "hollow", "humble", "icy", "idle", "jolly", "keen", "lively", "lofty", "lucky", "mellow", "misty", "modest",
    "narrow", "nimble", "noble", "odd", "pale", "plain", "polite", "proud", "quiet", "rapid", "rare", "rosy",
    "rustic", "sandy", "scarlet", "shiny", "silent", "silver", "sleepy", "slender", "smooth", "snowy", "solemn",
    "steady", "sturdy", "sunny", "tidy", "velvet",
)
KEY_NOUNS = (
    "acorn", "anchor", "apron", "badger", "banner", "barrel", "basket", "beacon", "blossom", "bottle", "bucket",
    "button", "cabin", "candle", "canoe", "carpet", "castle", "cellar", "chimney", "cloak", "clover", "compass",
    "cottage", "cradle", "curtain", "dolphin", "drum", "falcon", "feather", "fiddle", "garden", "glacier", "goblet",
    "harbor", "helmet", "island", "kettle", "ladder", "lantern", "meadow", "mirror", "mitten", "orchard", "otter",
    "paddle", "parcel", "pebble", "pepper", "pillow", "puzzle", "quilt", "raven", "ribbon", "saddle", "scarf",
    "spoon", "teapot", "thimble", "thistle", "trumpet", "tulip", "violin", "walnut", "wagon",
)
PSEUDO_CONSONANTS = "bdfgklmnprstvz"
PSEUDO_VOWELS = "aeiou"


def count_tokens(tokenizer: haystacks.TokenizerLike, text: str) -> int:
    return haystacks.count_tokens(tokenizer, text)


# ---- the public API ---------------------------------------------------------------------------------------------
def make(task: str, *, haystack_text_fn: Callable[[int, int], str] | None, num_tokens: int, depth: float | None,
         seed: int, tokenizer: haystacks.TokenizerLike, spec=None) -> Prompt:
    """One prompt of `task` (TASKS). haystack_text_fn(num_tokens, seed) -> text of at most that many tokens, whole
    sentences, a shorter one for the same seed a prefix of a longer one (haystacks.haystack_fn). spec: a
    NiahSpec / VtSpec / CweSpec replacing TASK_SPECS[task]."""
    if task not in TASK_SPECS:
        raise ValueError(f"unknown task {task!r}: one of {', '.join(TASKS)}")
    spec = TASK_SPECS[task] if spec is None else spec
    if task == "cwe":
        return _make_cwe(spec, haystack_text_fn, num_tokens, seed, tokenizer)
    if depth is None or not 0.0 <= depth <= 1.0:
        raise ValueError(f"{task}: depth {depth!r} is not a fraction in [0, 1]")
    if haystack_text_fn is None:
        raise ValueError(f"{task} is a haystack task: pass haystack_text_fn (haystacks.haystack_fn)")
    draw = _draw_niah if task.startswith("niah") else _draw_vt
    hay_full = haystack_text_fn(num_tokens, seed)
    forbidden = hay_full
    for _ in range(4):
        instruction, placements, question, answers, unique = draw(spec, np.random.default_rng(seed), depth, forbidden)
        build = functools.partial(_niah_text, instruction, placements, question)
        text, n, hay = _fill(build, haystack_text_fn, num_tokens, seed, tokenizer, hay_full)
        if not any(u in hay for u in unique):
            return Prompt(task, num_tokens, depth, seed, text, tuple(answers), n)
        forbidden += "\n" + hay   # a haystack_text_fn whose shorter windows are not prefixes: draw again
    raise RuntimeError(f"{task}: could not draw needles absent from the haystack (seed {seed})")


def score(prompt: Prompt, output_text: str) -> float:
    """The fraction of prompt.answers that occur in output_text, case-insensitive (RULER's string_match_all)."""
    out = output_text.lower()
    return sum(a.lower() in out for a in prompt.answers) / len(prompt.answers)


def prompt_seed(seed: int, task: str, context: int, index: int) -> int:
    """A prompt's seed from the run's: a hash, so a cell's prompts do not depend on what else a grid lists."""
    digest = hashlib.sha256(f"{seed}/{task}/{context}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def grid(tasks: Sequence[str], contexts: Sequence[int], depths: Sequence[float], num_prompts: int,
         seed: int) -> list[tuple[str, int, float | None, int]]:
    """(task, context, depth, prompt seed) for every cell and prompt; cwe has one depth, None."""
    out = []
    for task in tasks:
        if task not in TASK_SPECS:
            raise ValueError(f"unknown task {task!r}: one of {', '.join(TASKS)}")
        for context in contexts:
            for depth in (None,) if task == "cwe" else depths:
                out += [(task, int(context), depth, prompt_seed(seed, task, int(context), i))
                        for i in range(num_prompts)]
    return out


# ---- needles ----------------------------------------------------------------------------------------------------
def band_depths(depth: float, band: float, count: int) -> list[float]:
    """`count` fractions evenly over a band of width `band` centred on depth, shifted to lie inside [0, 1]."""
    if count == 1:
        return [depth]
    band = min(band, 1.0)
    lo = min(max(depth - band / 2, 0.0), 1.0 - band)
    return [lo + band * i / (count - 1) for i in range(count)]


def insert_needles(haystack: str, placements: Sequence[tuple[float, str]]) -> str:
    """`haystack` with each (fraction, sentence) of placements at the sentence boundary nearest to that fraction of
    its characters; sentences at one boundary keep their order in placements."""
    sents = haystacks.split_sentences(haystack)
    ends = np.cumsum([0] + [len(s) for s in sents])
    at: dict[int, list[str]] = {}
    for frac, sentence in placements:
        at.setdefault(int(np.argmin(np.abs(ends - frac * ends[-1]))), []).append(sentence)
    out: list[str] = []
    for i in range(len(sents) + 1):
        for sentence in at.get(i, ()):
            prev = out[-1] if out else ""
            if prev and not prev[-1].isspace():
                out.append(" ")
            out.append(sentence + ("\n" if prev.endswith("\n") else " "))
        if i < len(sents):
            out.append(sents[i])
    return "".join(out).strip()


def _niah_text(instruction: str, placements: Sequence[tuple[float, str]], question: str, hay: str) -> str:
    """The user message of a haystack task: instruction, the haystack with its needles, the question."""
    return f"{instruction}\n\n{insert_needles(hay, placements)}\n\n{question}"


def _draw_numbers(rng, count: int, digits: int, forbidden: str) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        value = str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
        if value not in forbidden and value not in out:
            out.append(value)
    return out


def _draw_keys(rng, count: int, forbidden: str) -> list[str]:
    forbidden = forbidden.lower()
    out: list[str] = []
    while len(out) < count:
        key = f"{KEY_ADJECTIVES[rng.integers(len(KEY_ADJECTIVES))]}-{KEY_NOUNS[rng.integers(len(KEY_NOUNS))]}"
        if key not in forbidden and key not in out:
            out.append(key)
    return out


def _draw_niah(spec: NiahSpec, rng, depth: float, forbidden: str):
    """-> (instruction, placements, question, answers, strings that must not occur in the haystack)."""
    if not 1 <= spec.num_queries <= spec.num_keys or spec.num_values < 1:
        raise ValueError(f"bad NiahSpec {spec}")
    keys = _draw_keys(rng, spec.num_keys, forbidden)
    asked = keys[:spec.num_queries]
    values = _draw_numbers(rng, spec.num_queries * spec.num_values + spec.num_keys - spec.num_queries,
                           spec.value_digits, forbidden)
    answered = [(key, values[i * spec.num_values + j]) for i, key in enumerate(asked) for j in range(spec.num_values)]
    distractors = list(zip(keys[spec.num_queries:], values[len(answered):]))
    order = rng.permutation(len(answered))       # the asked needles' order in the text: not the question's
    placements = [(frac, NIAH_NEEDLE.format(key=answered[k][0], value=answered[k][1]))
                  for frac, k in zip(band_depths(depth, spec.band, len(answered)), order)]
    placements += [(float(rng.random()), NIAH_NEEDLE.format(key=k, value=v)) for k, v in distractors]
    placements.sort(key=lambda p: p[0])
    if spec.num_queries > 1:
        question = NIAH_QUESTION_KEYS.format(keys=", ".join(asked[:-1]) + " and " + asked[-1])
    elif spec.num_values > 1:
        question = NIAH_QUESTION_VALUES.format(key=asked[0])
    else:
        question = NIAH_QUESTION_ONE.format(key=asked[0])
    return NIAH_INSTRUCTION, placements, question, [v for _, v in answered], keys + values


def _draw_vt(spec: VtSpec, rng, depth: float, forbidden: str):
    letters = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    names: list[str] = []
    while len(names) < spec.num_chains * (spec.num_hops + 1):
        name = "".join(rng.choice(letters, spec.name_letters))
        if name not in forbidden and name not in names and name not in VT_INSTRUCTION:
            names.append(name)
    values = _draw_numbers(rng, spec.num_chains, spec.value_digits, forbidden)
    placements = []
    for c in range(spec.num_chains):
        chain = names[c * (spec.num_hops + 1):(c + 1) * (spec.num_hops + 1)]
        statements = [VT_FIRST.format(name=chain[0], value=values[c])]
        statements += [VT_HOP.format(name=b, prev=a) for a, b in itertools.pairwise(chain)]
        fracs = (band_depths(depth, spec.band, len(statements)) if c == 0
                 else sorted(float(x) for x in rng.random(len(statements))))
        placements += list(zip(fracs, statements))
    placements.sort(key=lambda p: p[0])      # stable: a chain's statements stay in order at one boundary
    answers = names[:spec.num_hops + 1]
    return VT_INSTRUCTION, placements, VT_QUESTION.format(value=values[0]), answers, names + values


# ---- length -----------------------------------------------------------------------------------------------------
def _fill(build: Callable[[str], str], haystack_text_fn, num_tokens: int, seed: int, tokenizer,
          hay: str) -> tuple[str, int, str]:
    """The longest build(window) of at most num_tokens tokens that a few windows reach, starting from `hay` (the
    window of num_tokens): each next window gets what the last prompt's tokens past its haystack's leave (not
    additive: needles split the haystack's sentences), until the prompt lands in [num_tokens * (1 - LENGTH_SLACK),
    num_tokens] or a window size repeats. -> (text, tokens, haystack)."""
    floor = num_tokens - int(num_tokens * LENGTH_SLACK)
    best = None
    tried: set[int] = set()
    for _ in range(MAX_FILL_STEPS):
        text = build(hay)
        n = count_tokens(tokenizer, text)
        if n <= num_tokens and (best is None or n > best[1]):
            best = (text, n, hay)
        if best is not None and best[1] >= floor:
            break
        want = num_tokens - (n - count_tokens(tokenizer, hay))
        if want in tried or want < 0:
            break
        tried.add(want)
        hay = haystack_text_fn(want, seed)
    if best is None:
        text = build("")
        n = count_tokens(tokenizer, text)
        if n > num_tokens:
            raise ValueError(f"{num_tokens} tokens cannot hold the task's instruction, needles and question ({n})")
        best = (text, n, "")
    return best


# ---- cwe --------------------------------------------------------------------------------------------------------
def _pseudo_words(rng, count: int, taken: set[str], batch: int = 4096) -> list[str]:
    """Made-up words of 2-3 consonant-vowel syllables, none in `taken`, drawn in batches of `batch` (so the first k
    of a longer call equal a shorter call's)."""
    syllables = np.array([c + v for c in PSEUDO_CONSONANTS for v in PSEUDO_VOWELS], dtype=object)
    out: list[str] = []
    seen = set(taken)
    while len(out) < count:
        picks, lengths = rng.integers(len(syllables), size=(batch, 3)), rng.integers(2, 4, size=batch)
        for row, length in zip(syllables[picks], lengths):
            word = "".join(row[:length])
            if word not in seen and len(out) < count:
                seen.add(word)
                out.append(word)
    return out


def cwe_vocabulary(text: str, count: int, seed: int) -> list[str]:
    """`count` distinct lower-case words: the words of `text` (letters only, 3-12 of them) in seeded order, then
    made-up ones; a shorter call's list is a prefix of a longer one's."""
    rng = np.random.default_rng([seed, 1])
    words = list(dict.fromkeys(w.lower() for w in re.findall(r"(?<![\w'-])[A-Za-z]{3,12}(?![\w'-])", text)))
    words = [words[i] for i in rng.permutation(len(words))][:count]
    return words + _pseudo_words(rng, count - len(words), set(words))


def _make_cwe(spec: CweSpec, haystack_text_fn, num_tokens: int, seed: int, tokenizer) -> Prompt:
    text = haystack_text_fn(num_tokens, seed) if haystack_text_fn is not None else ""
    common = cwe_vocabulary(text, spec.num_common, seed)
    rare: list[str] = []
    question = CWE_QUESTION.format(n=spec.num_common)

    def build(fc: int, fu: int, n: int) -> str:
        words = common * fc + rare[:n] * fu
        order = np.random.default_rng([seed, n]).permutation(len(words))
        listing = "\n".join(f"{i + 1}. {words[k]}" for i, k in enumerate(order))
        return f"{CWE_INSTRUCTION}\n\n{listing}\n\n{question}"

    for fc, fu in spec.freqs:
        if count_tokens(tokenizer, build(fc, fu, 0)) <= num_tokens // 2:
            break
    if fc <= fu:
        raise ValueError(f"cwe: freq_common {fc} must exceed freq_uncommon {fu}")
    # an entry ("12. word") is 2+ tokens: at most num_tokens / (2 fu) uncommon words fit
    rare = cwe_vocabulary(text, spec.num_common + num_tokens // (2 * fu) + 1, seed)[spec.num_common:]
    memo: dict[int, int] = {}

    def tokens(n: int) -> int:
        if n not in memo:
            memo[n] = count_tokens(tokenizer, build(fc, fu, n))
        return memo[n]

    if tokens(0) > num_tokens:
        raise ValueError(f"cwe: {num_tokens} tokens cannot hold {spec.num_common} words {fc} times each "
                         f"({tokens(0)} tokens)")
    per_entry = max(1.0, tokens(0) / (spec.num_common * fc))
    n = haystacks.largest_fit(tokens, num_tokens, int((num_tokens - tokens(0)) / (per_entry * fu)), len(rare))
    return Prompt("cwe", num_tokens, None, seed, build(fc, fu, n), tuple(common), tokens(n))
