"""Shared prefixes (issue 24): many questions over one long document, with and without sharing, in one run.

Rows (each mode of each document in its own process: its compiles, HBM and pinned host pool are its own):
- `8b:<tokens>`: the Llama-3.1-8B shape with random bf16 weights, a random document of <tokens> ids and random
  questions of 16-200 ids (sparse: 16 copies of a 128K document's K/V do not fit a 128 GiB host, nor HBM dense);
- `smollm2:<tokens>`: SmolLM2-135M-Instruct, a real document (this Python's standard-library sources, as
  bench_e2e) and real questions about it, sparse and dense;
- `tiny:<tokens>`: the tiny random preset (CPU checks of the script; --small), with Quest's selection: a short
  document is under the tokens the default rule's online channels calibrate on, which a shared prefix must cover.
Every mode runs the same requests through one Engine: `--questions` prompts (document + question), `--max-new`
greedy tokens each, over `--slots` sequence slots. The cache of both modes is the same: HBM for every slot, a host
pool of `--host-docs` documents plus every slot's own pages, so without sharing fewer documents' K/V fit at once
and requests queue for host pages (that is the point of sharing); `--host-docs 0` sizes it for every slot's whole
sequence (what the cache would need without sharing).
Per row: time to the last answer (wall, compilation included, and the part spent in steps that compiled),
prompt tokens prefilled (computed) and attached, host bytes (the pool's peak in use, and its size), and whether
the answers equal those without sharing. Each mode runs `--passes` documents one after
another through its engine: the row's own fields are the first pass (every program compiles there), `warm` lists
the later ones (another document of the same length, nothing compiles: what a running server pays per document). JSON row by row to <out>/prefix.json (bench_meta.Results).

H200 (one call per mode keeps each under 10 minutes):
  python scripts/bench_prefix.py --rows 8b:130816 --modes on --out docs/benchmarks
  python scripts/bench_prefix.py --rows 8b:130816 --modes off --append --out docs/benchmarks
  python scripts/bench_prefix.py --rows smollm2:8192 --append --out docs/benchmarks
CPU check: python scripts/bench_prefix.py --small --out /tmp/prefix
Rows also carry decode's page hits, misses and pages fetched over PCIe (sparse). The PNG is drawn where matplotlib
is installed (not on the GPU machine): `python scripts/bench_prefix.py --png docs/benchmarks/prefix.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from scripts.bench_meta import add_common_args

SMALL_ROWS = "tiny:480,smollm2:256"
FULL_ROWS = "8b:130816,smollm2:8192"
QUESTIONS = ("What does the function defined above return?", "Which arguments are optional?",
             "Where is the error raised, and why?", "Summarise the module's purpose in one sentence.",
             "Which class is the base of the others?", "How is the default value chosen?",
             "What happens when the input is empty?", "Name two functions that call each other.",
             "Is any of this thread-safe?", "What would break if the cache were removed?",
             "Which names are private?", "Give the signature of the longest function.",
             "What does the first comment say?", "Which exceptions are caught?",
             "How many public functions are there?", "What is the last line about?")


def _document(kind: str, tokens: int, args):
    """-> (model, [document ids] one per pass (distinct documents), question id lists)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    rng = np.random.default_rng(0)
    if kind == "smollm2":
        from scripts.bench_e2e import real_text_ids
        from ulacache_jax.models import from_pretrained, load_tokenizer
        dtype = jnp.float32 if args.small else jnp.bfloat16
        model = from_pretrained(args.model, dtype=dtype)
        tok = load_tokenizer(args.model)
        text = real_text_ids(tok, tokens * args.passes)
        docs = [text[i * tokens:(i + 1) * tokens] for i in range(args.passes)]
        qs = [tok.encode("\n\nQuestion: " + QUESTIONS[i % len(QUESTIONS)] + "\nAnswer:") for i in range(args.questions)]
        return model, docs, qs
    from ulacache_jax.models import LlamaModel, get_preset
    preset = {"8b": "llama-3.1-8b", "tiny": "tiny"}[kind]
    dtype = jnp.float32 if kind == "tiny" else jnp.bfloat16
    model = LlamaModel(get_preset(preset), dtype=dtype, rngs=nnx.Rngs(0))
    V = model.config.vocab_size
    docs = [rng.integers(0, V, tokens).tolist() for _ in range(args.passes)]
    qs = [rng.integers(0, V, int(n)).tolist() for n in rng.integers(16, 201 if kind == "8b" else 41, args.questions)]
    return model, docs, qs


def run_mode(kind: str, tokens: int, attention: str, share: bool, args) -> dict:
    import jax
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    model, docs, qs = _document(kind, tokens, args)
    doc = docs[0]
    longest = max(len(doc) + len(q) for q in qs) + args.max_new
    page = args.page
    pages_of = lambda n: -(-n // page)
    mc = model.config
    rule = dict(key_channels=0) if kind == "tiny" else {}
    base = default_cache_config(mc, num_seqs=args.slots, max_tokens=longest, page_size=page, dtype=model.dtype,
                                token_budget=args.token_budget, **rule)
    per_page = base.num_layers * base.groups_per_rank
    if args.host_docs:
        own = max(pages_of(len(q) + args.max_new) + 1 for q in qs)
        host_pages = per_page * (args.host_docs * pages_of(len(doc)) + args.slots * own)
        cfg = default_cache_config(mc, num_seqs=args.slots, max_tokens=longest, page_size=page, dtype=model.dtype,
                                   token_budget=args.token_budget, host_pages=min(host_pages, base.host_pages),
                                   **rule)
    else:
        cfg = base
    gen = Generator(model, cfg, attention=attention)
    eng = Engine(generator=gen, prefix_cache=share)
    alloc = gen.cache.alloc if gen.cache is not None else None
    host_bytes = lambda pages: pages * 2 * cfg.page_bytes * cfg.tp

    def one_pass(doc) -> dict:
        """All questions over `doc` through the engine: time to the last answer and what it computed and held.
        The first pass compiles every program; later passes (another document, the same engine) show what a
        running server pays for a new document."""
        prompts = [doc + q for q in qs]
        t_index, st0 = len(eng.timeline), eng.prefix_stats()
        if alloc is not None:
            alloc.peak_used = cfg.host_pages - alloc.num_free     # this pass's peak (stored prefixes count)
        t0 = time.perf_counter()
        reqs = eng.run(prompts, SamplingParams(max_new_tokens=args.max_new, stop_ids=()))
        wall = time.perf_counter() - t0
        timeline = eng.timeline[t_index:]
        st = eng.prefix_stats().minus(st0)
        prompt_tokens = sum(len(p) for p in prompts)
        counts = {k: sum(getattr(r, k) for r in timeline) for k in ("hits", "misses", "fetched")}
        return dict(
            time_to_last_answer_s=wall,
            compile_steps_s=sum(r.t_end - r.t_start for r in timeline if r.compiled),
            prefill_s=sum(r.prefill_s for r in timeline), decode_s=sum(r.decode_s for r in timeline),
            prompt_tokens=prompt_tokens, prefill_tokens_computed=prompt_tokens - st.hit_tokens,
            prefix_cache_hit_tokens=st.hit_tokens, prefix_hits=st.hits,
            host_bytes_peak=None if alloc is None else host_bytes(alloc.peak_used),
            host_bytes_saved=host_bytes(st.saved_host_pages),
            decode_page_hits=counts["hits"], decode_page_misses=counts["misses"],
            decode_pages_fetched=counts["fetched"],
            answers=[r.tokens for r in reqs], errors=[r.error for r in reqs if r.finish_reason == "error"])

    passes = [one_pass(d) for d in docs]
    return dict(
        model=kind, doc_tokens=len(doc), questions=len(qs), attention=attention, sharing=share,
        slots=args.slots, max_new=args.max_new, page_size=page, **passes[0],
        host_pool_bytes=None if alloc is None else host_bytes(cfg.host_pages),
        doc_host_bytes=host_bytes(per_page * pages_of(len(doc))) if alloc is not None else None,
        warm=passes[1:], device=str(jax.devices()[0].device_kind), jax=jax.__version__)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two answers differ (None: equal). bf16 rounding tends to part answers late
    and at near-tie logits; a wrong shared prefix would part them at the first token, every time."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def pairs(rows: list[dict]) -> list[dict]:
    """The with/without comparison of each (model, document, attention) that has both rows (the latest of each):
    speedup to the last answer, prefill tokens computed, host bytes at peak, answers equal."""
    latest = {}
    for r in rows:
        if "error" not in r:
            latest[(r["model"], r["doc_tokens"], r["attention"], r["sharing"])] = r
    out = []
    for (model, doc, attention, share), on in latest.items():
        off = latest.get((model, doc, attention, False))
        if not share or off is None:
            continue
        hb_on, hb_off = on.get("host_bytes_peak"), off.get("host_bytes_peak")
        out.append(dict(model=model, doc_tokens=doc, attention=attention, questions=on["questions"],
                        speedup_to_last_answer=off["time_to_last_answer_s"] / on["time_to_last_answer_s"],
                        prefill_tokens_computed=(on["prefill_tokens_computed"], off["prefill_tokens_computed"]),
                        host_bytes_peak=(hb_on, hb_off), host_bytes_peak_in_docs=None if not hb_on else
                        hb_on / on["doc_host_bytes"],
                        same_answers=sum(a == b for a, b in zip(on["answers"], off["answers"])),
                        first_difference=[first_difference(a, b) for a, b in zip(on["answers"], off["answers"])],
                        warm_speedup_to_last_answer=[b["time_to_last_answer_s"] / a["time_to_last_answer_s"]
                                                     for a, b in zip(on.get("warm", []), off.get("warm", []))],
                        warm_same_answers=[sum(x == y for x, y in zip(a["answers"], b["answers"]))
                                           for a, b in zip(on.get("warm", []), off.get("warm", []))]))
    return out


def plot(rows: list[dict], path: str) -> str | None:
    """Time to the last answer (first pass, compiles included, and the last warm pass: a running server's cost of
    a new document, hatched) and prompt tokens computed, with and without sharing, per (model, document,
    attention). None where matplotlib is missing (the GPU machine): `--png` draws it later."""
    try:
        from scripts.bench_meta import pyplot, save_figure
        plt = pyplot()
    except ImportError:
        return None
    ok = [r for r in rows if "error" not in r]
    keys = sorted({(r["model"], r["doc_tokens"], r["attention"]) for r in ok})
    if not keys:
        return None
    latest = {(r["model"], r["doc_tokens"], r["attention"], r["sharing"]): r for r in ok}
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, field, label in ((axes[0], "time_to_last_answer_s", "time to the last answer (s)"),
                             (axes[1], "prefill_tokens_computed", "prompt tokens prefilled")):
        bars = [(False, False), (True, False)] + ([(False, True), (True, True)] if ax is axes[0] else [])
        w = 0.8 / len(bars)
        for j, (share, warm) in enumerate(bars):
            rs = [latest.get(k + (share,), {}) for k in keys]
            vals = [((r.get("warm") or [{}])[-1] if warm else r).get(field, 0) or 0 for r in rs]
            ax.bar([i + w * j for i in range(len(keys))], vals, width=w, color="C1" if share else "C0",
                   hatch="//" if warm else None, edgecolor="white" if warm else None,
                   label=("sharing" if share else "no sharing") + (", warm pass" if warm else ""))
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(keys))])
        ax.set_xticklabels([f"{m} {d} tok\n{a}" for m, d, a in keys], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(f"{ok[0]['questions']} questions over one document: shared prefixes (bench_prefix.py)", fontsize=9)
    return save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=None, help=f"kind:tokens list (default {FULL_ROWS}; --small: {SMALL_ROWS})")
    p.add_argument("--attention", default=None,
                   help="sparse,dense (default: sparse for 8b rows, both for the others)")
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--passes", type=int, default=2, help="documents run one after another through one engine: the "
                   "first pass compiles, the next ones are a running server's cost of a new document (>= 1)")
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--slots", type=int, default=None, help="sequence slots (default: --questions)")
    p.add_argument("--host-docs", type=float, default=2, help="documents' worth of host pool beyond the slots' own "
                   "pages (0: every slot's whole sequence)")
    p.add_argument("--page", type=int, default=None, help="page size (default 64; 16 with --small)")
    p.add_argument("--token-budget", type=int, default=None, help="default 2048; 64 with --small")
    p.add_argument("--small", action="store_true", help=f"CPU check: rows {SMALL_ROWS}, 4 questions, 8 new tokens")
    p.add_argument("--row-timeout", type=float, default=1800)
    p.add_argument("--modes", default="on,off", help="on (sharing), off (no sharing) or both; one device call "
                   "per mode keeps each under a call limit (--append adds the rows to <out>/prefix.json)")
    p.add_argument("--append", action="store_true", help="keep the rows already in <out>/prefix.json")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--png", default=None, metavar="JSON", help="draw JSON's PNG beside it (no run) and exit")
    # --model is the smollm2 rows' model (the 8b rows are the preset's shape with random weights)
    return add_common_args(p, files="prefix.json, prefix.png", model="smollm2-135m")


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.png:
        with open(args.png) as f:
            print(plot(json.load(f)["rows"], os.path.splitext(args.png)[0] + ".png"))
        return
    if args.small:
        args.questions = min(args.questions, 4)
        args.max_new = min(args.max_new, 8)
    args.rows = args.rows or (SMALL_ROWS if args.small else FULL_ROWS)
    args.page = args.page or (16 if args.small else 64)
    args.token_budget = args.token_budget or (64 if args.small else 2048)
    args.slots = args.slots or args.questions
    if args.passes < 1:
        p.error(f"--passes {args.passes}: need at least 1")
    if args.one:
        kind, tokens, attention, share = args.one.split(":")
        print("ROW " + json.dumps(run_mode(kind, int(tokens), attention, share == "on", args)), flush=True)
        return
    from scripts.bench_meta import Results, git_commit, row_in_child, run_meta
    from ulacache_jax.cache.state import raise_host_limit
    raise_host_limit()
    commit = args.commit or git_commit()
    path = os.path.join(args.out, "prefix.json")
    res = Results(path, run_meta(commit), settings=vars(args))
    if args.append and os.path.exists(path):
        with open(path) as f:
            res.rows = json.load(f).get("rows", [])
    for spec in args.rows.split(","):
        kind, tokens = spec.split(":")
        kinds = args.attention or ("sparse" if kind == "8b" else "sparse,dense")
        for attention in kinds.split(","):
            for share in args.modes.split(","):
                cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{kind}:{tokens}:{attention}:{share}"]
                cmd += [a for a in (argv if argv is not None else sys.argv[1:])]
                row = row_in_child(cmd, args.row_timeout, model=kind, doc_tokens=int(tokens), attention=attention,
                                   sharing=share == "on")
                row["commit"] = commit
                res.add(row)
                res.extra["pairs"] = pairs(res.rows)
                res.save()
                print(json.dumps({k: v for k, v in row.items() if k not in ("answers", "warm")}), flush=True)
    plot(res.rows, os.path.splitext(path)[0] + ".png")
    for pr in res.extra.get("pairs", []):
        print(json.dumps(pr))
    print(f"\n{'model':8s} {'doc':>7s} {'attn':6s} {'share':5s} {'last answer s':>13s} {'computed':>9s} "
          f"{'host peak':>12s} {'warm passes: last answer s':>26s}")
    for r in res.rows:
        if "error" in r:
            print(f"{r['model']:8s} {r['doc_tokens']:7d} {r['attention']:6s} {str(r['sharing']):5s} "
                  f"ERROR {r['error'][-200:]}")
            continue
        hb = r.get("host_bytes_peak")
        print(f"{r['model']:8s} {r['doc_tokens']:7d} {r['attention']:6s} {str(r['sharing']):5s} "
              f"{r['time_to_last_answer_s']:13.2f} {r['prefill_tokens_computed']:9d} "
              f"{'-' if hb is None else f'{hb / 2**20:.1f} MiB':>12s} "
              f"{' '.join(f'{w['time_to_last_answer_s']:.2f}' for w in r.get('warm', [])):>26s}")


if __name__ == "__main__":
    main()
