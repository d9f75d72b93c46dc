"""Speculative decoding (issue 22) against plain decoding, in one run: the same Generator, prompts and greedy
parameters through the Engine with and without `speculative=`.

Tasks (copy-heavy, long context; the document is real text: this interpreter's standard-library sources, a
different file offset per batch row):
- `continue`: the document, then its first `--echo` tokens again: the model continues the copy (induction);
- `quote`: a chat: the document, then "Repeat the first 30 lines of the document above exactly.";
- `fresh`: a chat asking for a short story (little to copy: drafts mostly rejected; speculation's cost when it
  does not help);
- `sampled`: `fresh` sampled at temperature 1 (each request seeded): the text stays original, so the n-gram
  lookup's drafts are mostly rejected: the back-off's worst case. Its outputs are not compared with plain (a
  speculative sampler draws from the same distribution, not the same tokens).
Per (task, batch, method): greedy outputs are compared with the plain run's first (`match`: all tokens equal;
`match_tokens`: the share of tokens before the first difference; float32 matches exactly, bfloat16 rounds K + 1-row
matmuls differently), then `--reps` timed runs: decode tok/s (the Engine timeline's decode tokens / decode seconds;
prefill excluded), wall tok/s (the whole run, prefill included), speedup over plain, acceptance rate (accepted /
proposed drafts) and tokens per verification. Medians over the reps. Rows go to --out (a folder: speculative.json,
one row at a time, bench_meta.Results) as they finish.

--step-cost: the cost of one verification of K + 1 rows against one plain decode step, on the Llama-3.1-8B shape
(random bf16 weights, a synthetic --step-context cache filled through the real ingestion path, drafts random so
all rejected: the worst case), K from --step-ks, B from --step-batches: plain_step_ms (a 64-step chunk / 64),
verify_ms (one verification, host sync included, as the Engine runs it), ratio = the tokens a verification must
yield to break even.

--small: the tiny random model, short prompts, float32, dense unless --attention sparse, on CPU (a check of the
script; with --step-cost, the tiny shape at 1K).
--deterministic: SpecConfig(deterministic=True) for every speculative row, and per K a row of method "none" (plain
decoding through the K + 1-row verification program: its speedup and match are against plain, i.e. the mode's cost
and plain's own bf16 drift from it); the speculative rows' speedup and match are then against that row.
--per-step: ngram speculation one verification per Engine step (SpecDecoder.chunk_steps = 0) instead of the device
chunk (Program.spec_chunk), to compare the two.
`verifications` counts every verification (one-row steps of a chunk where no slot drafted included);
`verifications_per_chunk` = verifications / device chunks.
On the H200: python scripts/bench_speculative.py --out docs/benchmarks     (-> speculative.json)
         and: python scripts/bench_speculative.py --step-cost --out docs/benchmarks  (-> speculative_step.json)
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import pathlib
import statistics
import sys
import time

from scripts.bench_meta import Results, add_common_args, run_meta


def doc_ids(tokenizer, n: int, offset: int) -> list[int]:
    """n token ids of real text (standard-library sources) starting `offset` tokens in."""
    import sysconfig
    lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in ("argparse.py", "inspect.py", "typing.py", "dataclasses.py", "functools.py", "subprocess.py",
                 "tarfile.py", "pathlib.py", "datetime.py", "email/message.py", "logging/__init__.py"):
        f = lib / name
        if f.exists():
            ids.extend(tokenizer.encode(f.read_text(encoding="utf-8")))
        if len(ids) >= n + offset:
            return ids[offset:offset + n]
    raise RuntimeError(f"only {len(ids)} tokens of standard-library text under {lib}; need {n + offset}")


def make_prompts(task: str, tokenizer, batch: int, doc_tokens: int, echo: int, vocab: int) -> list:
    if tokenizer is None:                  # --small: random ids, a repeated span
        import numpy as np
        out = []
        for b in range(batch):
            doc = np.random.default_rng(b).integers(0, vocab, doc_tokens).tolist()
            out.append(doc + doc[:echo] if task not in ("fresh", "sampled") else doc)
        return out
    out = []
    for b in range(batch):
        doc = doc_ids(tokenizer, doc_tokens, offset=b * doc_tokens // 2)
        if task == "continue":
            out.append(doc + doc[:echo])
        elif task == "quote":
            text = tokenizer.decode(doc)
            out.append([{"role": "user", "content": text + "\n\nRepeat the first 30 lines of the document above "
                                                         "exactly, nothing else."}])
        elif task in ("fresh", "sampled"):
            text = tokenizer.decode(doc)
            out.append([{"role": "user", "content": text + "\n\nForget the document. Write a short original story "
                                                         "about a lighthouse keeper."}])
        else:
            raise ValueError(f"task {task!r}")
    return out


def task_temperature(task: str) -> float:
    """The sampling temperature of a task: 1 for `sampled`, greedy for the others."""
    return 1.0 if task == "sampled" else 0.0


def run_engine(gen, prompts, max_new: int, tokenizer, spec, per_step: bool = False, temperature: float = 0.0):
    """One Engine run over `gen` -> (token lists, decode tokens, decode s, wall s, spec counters or None).
    temperature > 0: request i is sampled with seed i (the same draws in every run of a task)."""
    import inspect
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    # every run prefills its prompts whole: attached shared prefixes round differently from a prefill in bf16
    kw = {"prefix_cache": False} if "prefix_cache" in inspect.signature(Engine).parameters else {}
    eng = Engine(generator=gen, tokenizer=tokenizer, speculative=spec, **kw)
    if per_step and eng.spec is not None and hasattr(eng.spec, "chunk_steps"):
        eng.spec.chunk_steps = 0
    t0 = time.perf_counter()
    if temperature > 0:
        reqs = eng.run(prompts, [SamplingParams(max_new_tokens=max_new, stop_ids=(), temperature=temperature, seed=i)
                                 for i in range(len(prompts))])
    else:
        reqs = eng.run(prompts, SamplingParams(max_new_tokens=max_new, stop_ids=()))
    wall = time.perf_counter() - t0
    for r in reqs:
        if r.finish_reason == "error":
            raise RuntimeError(r.error)
    dec_tokens = sum(r.decode_tokens for r in eng.timeline)
    dec_s = sum(r.decode_s for r in eng.timeline)
    sp = eng.spec
    counters = None if sp is None else dict(proposed=sp.proposed, accepted=sp.accepted, steps=sp.steps,
                                            chunks=getattr(sp, "chunks", 0))
    return [r.tokens for r in reqs], dec_tokens, dec_s, wall, counters


def match_share(a: list[list[int]], b: list[list[int]]) -> float:
    tot = same = 0
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        same += n
        tot += max(len(x), len(y))
    return same / max(tot, 1)


def deterministic_plain(args, res, gen, prompts, tokenizer, task, B, K, temp, plain_tokens, plain_dec, plain_wall):
    """--deterministic's baseline: method "none" with K (plain decoding through the K + 1-row verification), its
    row against plain added to `res` -> (tokens, decode tok/s, wall tok/s)."""
    from ulacache_jax.runtime.speculative.rules import SpecConfig
    spec = SpecConfig("none", K, deterministic=True)
    out = run_engine(gen, prompts, args.max_new, tokenizer, spec, temperature=temp)[0]                  # compiles
    runs = [run_engine(gen, prompts, args.max_new, tokenizer, spec, temperature=temp) for _ in range(args.reps)]
    dec = statistics.median(t / s for _, t, s, _, _ in runs)
    wall = statistics.median(sum(map(len, o)) / w for o, _, _, w, _ in runs)
    res.add(dict(task=task, batch=B, method="none", num_tokens=K, dtype=args.dtype, deterministic=True,
                 decode_tok_s=dec, wall_tok_s=wall, speedup=dec / plain_dec, wall_speedup=wall / plain_wall,
                 match=out == plain_tokens if temp == 0 else None,
                 match_tokens=match_share(out, plain_tokens) if temp == 0 else None, temperature=temp,
                 acceptance=0.0, new_tokens=sum(map(len, out))))
    print(json.dumps(res.rows[-1]), flush=True)
    return out, dec, wall


def plain_step_ms(gen, live, chunks: int):
    """A plain decode step of `gen`'s live slots (live [S] bool): the median of chunks - 1 timed page_size-step chunks
    (the first compiles) / page_size, host sync included -> (ms, the SamplingArrays used)."""
    import numpy as np
    import jax.numpy as jnp
    from ulacache_jax.runtime.sampling import SamplingArrays, row_keys
    S = gen.config.max_seqs
    tok, done = jnp.zeros(S, jnp.int32), jnp.asarray(~live)
    rem, sampling, stops = jnp.full(S, 1 << 30, jnp.int32), SamplingArrays.fill(S), jnp.asarray([-1], jnp.int32)
    times = []
    for i in range(chunks):
        t = time.perf_counter()
        out, _, _ = gen.decode_chunk(tok, done, rem, row_keys(jnp.arange(S, dtype=jnp.uint32),
                                                               jnp.full(S, i, jnp.uint32)), sampling, stops)
        np.asarray(out)
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times[1:])) / gen.config.page_size, sampling


def step_cost(args, res) -> None:
    """--step-cost rows (module docstring)."""
    import numpy as np
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from scripts.bench_decode import bench_config, synthetic_fill_sparse
    from ulacache_jax.runtime.generator import Generator
    from ulacache_jax.models import LlamaModel, get_preset
    from ulacache_jax.runtime.sampling import row_keys
    from ulacache_jax.runtime.speculative.rules import next_flush
    preset = "tiny" if args.small else "llama-3.1-8b"
    mc = get_preset(preset)
    model = LlamaModel(mc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    ctx, page, ks = args.step_context, 64, [int(k) for k in args.step_ks.split(",")]
    reps = max(args.reps, 3) * 4
    ns = argparse.Namespace(chunks=4 + (max(ks) + 1) * (reps + 1) * len(ks) // page + 2, budget=args.token_budget)
    for B in [int(b) for b in args.step_batches.split(",")]:
        cfg = dataclasses.replace(bench_config(mc, "sparse", B, ctx, ns, kv_fraction=0.5, page=page),
                                  verify_rows=max(ks) + 1)      # overflow frames for K + 1 rows (as Engine sizes them)
        gen = Generator(model, cfg, attention="sparse")
        S = cfg.max_seqs
        slots = [gen.admit(ctx + (ns.chunks + 1) * page) for _ in range(B)]
        synthetic_fill_sparse(gen.cache, slots, ctx, seed=B, chunk=min(ctx, 32768))
        live = np.arange(S) < B
        plain_ms, sampling = plain_step_ms(gen, live, chunks=4)
        L = ctx + 4 * page
        rng = np.random.default_rng(0)
        for K in ks:
            vt = []
            for i in range(reps + 1):
                b = next_flush(ctx, L, page)
                rows = np.where(live, min(K + 1, b - L), 0).astype(np.int32)
                tokens = rng.integers(0, mc.vocab_size, (S, K + 1)).astype(np.int32)
                keys = row_keys(jnp.arange(S, dtype=jnp.uint32), jnp.full(S, 100 + i, jnp.uint32))
                a = jax.device_put((tokens, rows, np.full(S, b, np.int32), keys, sampling, jnp.zeros(())),
                                   gen.replicated)
                t = time.perf_counter()
                bk = gen.backend
                bk.cache, bk.host, out, n_new, *_ = gen.program.verify(K + 1)(gen.params, bk.cache, bk.host, *a)
                n_new = np.asarray(n_new)
                if i and rows[0] == K + 1:                    # the first compiles; cut rows are not counted
                    vt.append(time.perf_counter() - t)
                L += int(n_new[0])
            verify_ms = 1e3 * float(np.median(vt))
            row = dict(kind="step_cost", model=preset, context=ctx, batch=B, num_tokens=K, plain_step_ms=plain_ms,
                       verify_ms=verify_ms, ratio=verify_ms / plain_ms, reps=len(vt))
            res.add(row)
            print(json.dumps(row), flush=True)
        del gen, bk, out, n_new, a            # this batch's host pool is freed before the next batch's is made
        gc.collect()


def plot(rows: list[dict], path: str) -> str | None:
    """Decode tokens/s over plain per (task, batch): one bar per speculative variant (device chunk or one
    verification a step), acceptance printed on each bar. None where matplotlib is missing (the GPU machine):
    `--png` draws it later. Step-cost rows are not drawn."""
    try:
        from scripts.bench_meta import pyplot, save_figure
        plt = pyplot()
    except ImportError:
        return None
    spec = [r for r in rows if r.get("method", "plain") != "plain" and "speedup" in r]
    if not spec:
        return None
    cells = sorted({(r["task"], r["batch"]) for r in spec}, key=lambda c: (c[1], c[0]))

    gates = {r["min_drafts_per_slot"] for r in spec if r.get("min_drafts_per_slot") is not None}  # older rows: none
    dtypes = {r.get("dtype", "bfloat16") for r in spec}

    def variant(r):
        # Everything that tells two rows of one (task, batch) cell apart, so none hides another.
        g = r.get("min_drafts_per_slot")
        gate = f" gate {g:g}" if len(gates) > 1 and g is not None else ""
        dt = f" {r.get('dtype', 'bfloat16')}" if len(dtypes) > 1 else ""
        path = "per step" if r.get("per_step") else "chunk"
        return f"{r['method']} K={r['num_tokens']} {path}{gate}{dt}"
    variants = sorted({variant(r) for r in spec})
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(cells)), 3.6))
    for j, v in enumerate(variants):
        labelled = False
        for i, cell in enumerate(cells):
            r = next((r for r in reversed(spec) if (r["task"], r["batch"]) == cell and variant(r) == v), None)
            if r is None:
                continue
            x = i + j * width
            ax.bar(x, r["speedup"], width=width, color=f"C{j}", label=None if labelled else v)
            labelled = True
            ax.text(x, r["speedup"], f"{r['acceptance']:.0%}", ha="center", va="bottom", fontsize=6)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))])
    ax.set_xticklabels([f"{t}\nB={b}" for t, b in cells], fontsize=7)
    ax.set_ylabel("decode tok/s / plain")
    ax.legend(fontsize=6)
    ax.set_title("speculative decoding vs plain, same run (label: draft acceptance)", fontsize=9)
    return save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # bfloat16: the serving dtype the speedups are quoted in (--small switches to float32 for exact CPU checks)
    add_common_args(p, files="speculative.json (--step-cost: speculative_step.json) and its PNG",
                    model="smollm2-135m", dtype="bfloat16")
    p.add_argument("--tasks", default=None, help="continue, quote, fresh, sampled (default: all four; --small: "
                   "continue)")
    p.add_argument("--batches", default=None, help="batch sizes, comma separated (default 1,4,16; --small: 1)")
    p.add_argument("--methods", default="ngram", help="ngram and/or draft (draft: --draft-model)")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--num-tokens", default="4", help="K values, comma separated")
    p.add_argument("--min-drafts", default=None,
                   help="SpecConfig.min_drafts_per_slot values, comma separated (the batch gate; default: its default)")
    p.add_argument("--doc-tokens", type=int, default=6144)
    p.add_argument("--echo", type=int, default=64, help="tokens of the document repeated at its end (continue)")
    p.add_argument("--max-new", type=int, default=None, help="new tokens a request (default 256; --small: 24)")
    p.add_argument("--attention", default=None, help="sparse or dense (default: sparse; --small: dense)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--reps", type=int, default=None, help="timed runs (default 3; --small: 1)")
    p.add_argument("--require-match", action="store_true", help="fail when a greedy output differs from plain")
    p.add_argument("--step-cost", action="store_true", help="verification vs plain step cost (8B shape)")
    p.add_argument("--step-context", type=int, default=131072)
    p.add_argument("--step-ks", default="2,4,8")
    p.add_argument("--step-batches", default="1,4")
    p.add_argument("--per-step", action="store_true", help="ngram: one verification per step, not device chunks")
    p.add_argument("--deterministic", action="store_true",
                   help="SpecConfig(deterministic=True), compared with method 'none' (docstring)")
    p.add_argument("--small", action="store_true", help="tiny random model, short prompts, float32 (CPU check)")
    p.add_argument("--append", action="store_true", help="keep the rows already in --out (one call per batch size)")
    p.add_argument("--png", default=None, metavar="JSON", help="draw JSON's PNG beside it (no run) and exit")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    out_json = os.path.join(args.out, "speculative_step.json" if args.step_cost else "speculative.json")
    if args.png:
        with open(args.png) as f:
            print(plot(json.load(f)["rows"], os.path.splitext(args.png)[0] + ".png"))
        return
    if args.small and args.step_cost:
        args.step_context, args.step_ks, args.step_batches, args.reps = 1024, "2", "1", args.reps or 1
    elif args.small:
        args.doc_tokens, args.echo, args.dtype = 96, 32, "float32"
        args.max_new = args.max_new or 24
        args.batches, args.page_size, args.token_budget = args.batches or "1", 16, 64
        args.tasks = args.tasks or "continue"
        args.reps = args.reps or 1
        args.num_tokens = "3"
        args.attention = args.attention or "dense"         # dense: the cheapest compile (tests cover sparse)
    args.attention = args.attention or "sparse"
    args.tasks = args.tasks or "continue,quote,fresh,sampled"
    bad = [t for t in args.tasks.split(",") if t not in ("continue", "quote", "fresh", "sampled")]
    if bad:
        p.error(f"--tasks: unknown {bad} (continue, quote, fresh, sampled)")
    args.batches = args.batches or "1,4,16"
    args.max_new = args.max_new or 256
    args.reps = args.reps or 3

    from ulacache_jax.cache.state import raise_host_limit
    raise_host_limit()
    import jax.numpy as jnp
    from flax import nnx
    from ulacache_jax.runtime.generator import Generator, default_cache_config
    from ulacache_jax.runtime.speculative.rules import SpecConfig

    if args.step_cost:
        res = Results(out_json, run_meta(args.commit, kind="step_cost", token_budget=args.token_budget))
        if args.append and os.path.exists(out_json):
            with open(out_json) as f:
                res.rows = json.load(f).get("rows", [])
        step_cost(args, res)
        return
    dtype = jnp.dtype(args.dtype)
    if args.small:
        from ulacache_jax.models import LlamaModel, get_preset
        model, tokenizer = LlamaModel(get_preset("tiny"), dtype=dtype, rngs=nnx.Rngs(0)), None
    else:
        from ulacache_jax.models import from_pretrained, load_tokenizer
        model, tokenizer = from_pretrained(args.model, dtype=dtype), load_tokenizer(args.model)
    draft = None
    if "draft" in args.methods.split(","):
        if not args.draft_model:
            raise SystemExit("--methods draft needs --draft-model")
        from ulacache_jax.models import from_pretrained
        draft = from_pretrained(args.draft_model, dtype=dtype)
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.num_tokens.split(",")]
    gates = [None] if args.min_drafts is None else [float(g) for g in args.min_drafts.split(",")]
    res = Results(out_json, run_meta(args.commit, model="tiny" if args.small else args.model, dtype=args.dtype,
                                     attention=args.attention, doc_tokens=args.doc_tokens, max_new=args.max_new,
                                     page_size=args.page_size, token_budget=args.token_budget, reps=args.reps))
    if args.append and os.path.exists(out_json):
        with open(out_json) as f:
            res.rows = json.load(f).get("rows", [])
    for B in batches:
        longest = args.doc_tokens + args.echo + 256 + args.max_new
        cfg = default_cache_config(model.config, num_seqs=B, max_tokens=longest, page_size=args.page_size,
                                   token_budget=args.token_budget, dtype=dtype,
                                   verify_rows=max(int(k) for k in args.num_tokens.split(",")) + 1)
        gen = Generator(model, cfg, attention=args.attention)
        for task in args.tasks.split(","):
            prompts = make_prompts(task, tokenizer, B, args.doc_tokens, args.echo, model.config.vocab_size)
            temp = task_temperature(task)
            plain_tokens, *_ = run_engine(gen, prompts, args.max_new, tokenizer, None, temperature=temp)  # compiles
            plain = [run_engine(gen, prompts, args.max_new, tokenizer, None, temperature=temp)
                     for _ in range(args.reps)]
            plain_dec = statistics.median(t / s for _, t, s, _, _ in plain)
            plain_wall = statistics.median(sum(map(len, o)) / w for o, _, _, w, _ in plain)
            res.add(dict(task=task, batch=B, method="plain", num_tokens=0, dtype=args.dtype, decode_tok_s=plain_dec,
                         wall_tok_s=plain_wall, new_tokens=sum(map(len, plain_tokens))))
            print(json.dumps(res.rows[-1]), flush=True)
            det_plain = {}       # --deterministic: K -> (tokens, decode tok/s, wall tok/s) of method "none"
            for method, K, gate in [(m, k, g) for m in args.methods.split(",") for k in ks for g in gates]:
                ref_tokens, ref_dec, ref_wall = plain_tokens, plain_dec, plain_wall
                if args.deterministic:
                    if K not in det_plain:
                        det_plain[K] = deterministic_plain(args, res, gen, prompts, tokenizer, task, B, K, temp,
                                                           plain_tokens, plain_dec, plain_wall)
                    ref_tokens, ref_dec, ref_wall = det_plain[K]
                spec = SpecConfig(method, K, draft_model=draft if method == "draft" else None,
                                  deterministic=args.deterministic,
                                  **({} if gate is None else {"min_drafts_per_slot": gate}))
                first = run_engine(gen, prompts, args.max_new, tokenizer, spec, args.per_step,
                                   temperature=temp)                                          # compiles
                out = first[0]
                same = out == ref_tokens if temp == 0 else None              # sampled: not comparable token-wise
                if args.require_match and same is False:
                    raise SystemExit(f"{task} B={B} {method} K={K}: greedy output differs from plain "
                                     f"(match share {match_share(out, ref_tokens):.3f})")
                runs = [run_engine(gen, prompts, args.max_new, tokenizer, spec, args.per_step,
                                   temperature=temp) for _ in range(args.reps)]
                dec = statistics.median(t / s for _, t, s, _, _ in runs)
                wall = statistics.median(sum(map(len, o)) / w for o, _, _, w, _ in runs)
                c = runs[-1][4]
                row = dict(task=task, batch=B, method=method, num_tokens=K, dtype=args.dtype,
                           decode_tok_s=dec, wall_tok_s=wall,
                           min_drafts_per_slot=spec.min_drafts_per_slot, deterministic=args.deterministic,
                           speedup=dec / ref_dec, wall_speedup=wall / ref_wall, match=same,
                           match_tokens=match_share(out, ref_tokens) if temp == 0 else None,
                           temperature=temp,
                           acceptance=c["accepted"] / max(c["proposed"], 1),
                           tokens_per_step=runs[-1][1] / max(c["steps"], 1) / B,
                           verifications=c["steps"], device_chunks=c["chunks"], per_step=args.per_step,
                           verifications_per_chunk=c["steps"] / c["chunks"] if c["chunks"] else None,
                           proposed=c["proposed"], accepted=c["accepted"],
                           new_tokens=sum(map(len, out)))
                res.add(row)
                print(json.dumps(row), flush=True)
    plot(res.rows, os.path.splitext(out_json)[0] + ".png")
    print(f"\n{'task':9s} {'B':>3s} {'method':7s} {'K':>2s} {'dec tok/s':>10s} {'speedup':>7s} "
          f"{'accept':>6s} {'v/call':>6s} {'match':>6s} {'gate':>4s}")
    for r in res.rows:
        vpc = r.get("verifications_per_chunk")
        vpc = "" if vpc is None else f"{vpc:.2f}"
        print(f"{r['task']:9s} {r['batch']:3d} {r['method']:7s} {r['num_tokens']:2d} "
              f"{r['decode_tok_s']:10.1f} {r.get('speedup', 1.0):7.2f} {r.get('acceptance', 0.0):6.2f} {vpc:>6s} "
              f"{str(r.get('match', '')):>6s} {r.get('min_drafts_per_slot') or '':>4}")


if __name__ == "__main__":
    main()
