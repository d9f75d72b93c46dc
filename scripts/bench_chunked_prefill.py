"""Chunked prefill and the decode cadence (issue 49 item 4): what running requests wait while a long prompt is
admitted, and what shorter decode chunks cost in tokens/s, variants compared in one run over one Generator.

Scenario, per variant (prefill chunk C or whole prompts; decode chunk of `--cadences` steps): `--running`
requests (prompts of `--running-prompt` tokens) start and decode for `--warm-steps` Engine steps, then one prompt of
`--long-prompt` tokens arrives; every request runs to its end. Measured from each request's deliveries
(Request.deliveries, host clock, after the step that returned them):
- `gap`: time between two deliveries to a running request (what a streaming client waits between arrivals), p50
  and p99 over the steps from the long prompt's arrival to its first token (`window_*`: the steps that prefilled
  it) and over the whole run;
- `itl`: the report's per-token inter-token latency (a delivery's gap / its tokens, once per token);
- `ttft_long_s`: the long prompt's time to first token; `steps_long`: Engine steps its prefill spanned;
  `window_step_prefill_ms_p50` / `window_step_decode_ms_p50`: what one of those steps spent prefilling / decoding.
Each variant runs `--repeats` times after its untimed run: gaps pooled, times' medians.
Throughput, per cadence: `--running` requests of `--decode-tokens` new tokens with nothing else arriving; tokens/s
= decode tokens / (step wall time - prefill time), so host syncs and step overhead count.
Before timing, every variant runs once untimed (its programs compile) and its greedy tokens are checked against
the reference variant (whole prompts, cadence page_size): `same_tokens` per row; a variant that differs is
reported, not hidden.

An intermediate chunk is not waited for (no logits), so on an asynchronous device its time shows in the decode
chunk dispatched after it (window_step_decode_ms), not in window_step_prefill_ms; the gaps are wall time either way.

CPU, the tiny random preset (docs/benchmarks/chunked_prefill.json; ~4 minutes; SmolLM2-135M ran ~1 s a decode step
on a shared 2-core machine, too slow for the grid):
  python -m scripts.bench_chunked_prefill --model tiny --page 64 --token-budget 512 --running 2 \
    --running-prompt 256 --long-prompt 4096 --chunk 512 --warm-steps 1 --decode-tokens 256 --out docs/benchmarks
CPU check of the script: python -m scripts.bench_chunked_prefill --small --out /tmp/chunked
H200 (a later session): python -m scripts.bench_chunked_prefill --model qwen2.5-coder-0.5b --long-prompt 32768 \
  --running-prompt 1024 --chunk 2048 --max-context 36864 --dtype bfloat16 --out docs/benchmarks
JSON to <out>/chunked_prefill.json (bench_meta.Results: device, jax version, commit, date), PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _load(args):
    """-> (model, prompt ids: running prompts, the long prompt, the throughput prompts)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)
    if args.model in ("tiny",):
        from ulacache_jax.models import LlamaModel, get_preset
        model = LlamaModel(get_preset(args.model), dtype=dtype, rngs=nnx.Rngs(0))
        V = model.config.vocab_size
        ids = rng.integers(0, V, args.long_prompt + args.running * args.running_prompt).tolist()
    else:
        from ulacache_jax.models import from_pretrained, load_tokenizer
        from scripts.bench_e2e import real_text_ids
        model = from_pretrained(args.model, dtype=dtype)
        ids = real_text_ids(load_tokenizer(args.model), args.long_prompt + args.running * args.running_prompt)
    long_ = ids[:args.long_prompt]
    rest = ids[args.long_prompt:]
    running = [rest[i * args.running_prompt:(i + 1) * args.running_prompt] for i in range(args.running)]
    return model, running, long_


def _gaps(req, steps: range | None = None) -> tuple[list[float], list[float]]:
    """A request's delivery gaps and per-token latencies (gap / tokens, once per token) for the deliveries made
    by Engine steps in `steps` (None: all); its first token (from prefill) starts the first gap."""
    gaps, itl = [], []
    for (t0, _, _), (t1, n, step) in zip(req.deliveries, req.deliveries[1:]):
        if (steps is None or step in steps) and n > 0:
            gaps.append(t1 - t0)
            itl.extend([(t1 - t0) / n] * n)
    return gaps, itl


def scenario(gen, running, long_, chunk, cadence, args, repeats: int) -> dict:
    """Running requests decode, the long prompt arrives after warm steps; every request to its end. `repeats`
    runs (0: one untimed run, its programs compile), their gaps pooled, their times' medians."""
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    win_gaps, win_itl, all_gaps, all_itl, ttft, pre_s, dec_s = [], [], [], [], [], [], []
    for _ in range(max(repeats, 1)):
        eng = Engine(generator=gen, prefix_cache=False, prefill_chunk_tokens=chunk, decode_chunk_steps=cadence)
        sp = SamplingParams(max_new_tokens=args.running_new, stop_ids=())
        ids = [eng.add_request(p, sp) for p in running]
        for _ in range(args.warm_steps):
            eng.step()
        step_long = len(eng.timeline)
        lid = eng.add_request(long_, SamplingParams(max_new_tokens=args.long_new, stop_ids=()))
        while eng.has_unfinished():
            eng.step()
        long_req = eng.get(lid)
        reqs = [eng.get(i) for i in ids]
        first_step = long_req.deliveries[0][2]
        # the window: the steps from the long prompt's arrival to its first token, which prefilled it (the
        # running requests' deliveries of those steps come after their prefill work)
        window = range(step_long, first_step + 1)
        for r in reqs:
            g, i = _gaps(r, window)
            win_gaps += g
            win_itl += i
            g, i = _gaps(r)
            all_gaps += g
            all_itl += i
        ttft.append(long_req.t_first_token - long_req.t_added)
        pre_s += [eng.timeline[k].prefill_s for k in window]
        dec_s += [eng.timeline[k].decode_s for k in window]
    ms = lambda x: None if x is None else 1e3 * x
    return dict(
        chunk=chunk, cadence=cadence, timed=repeats > 0, repeats=repeats,
        window_gap_p50_ms=ms(_pct(win_gaps, 50)), window_gap_p99_ms=ms(_pct(win_gaps, 99)),
        window_gap_max_ms=ms(max(win_gaps, default=None)),
        window_itl_p50_ms=ms(_pct(win_itl, 50)), window_itl_p99_ms=ms(_pct(win_itl, 99)),
        window_step_prefill_ms_p50=ms(_pct(pre_s, 50)), window_step_decode_ms_p50=ms(_pct(dec_s, 50)),
        gap_p50_ms=ms(_pct(all_gaps, 50)), gap_p99_ms=ms(_pct(all_gaps, 99)),
        itl_p50_ms=ms(_pct(all_itl, 50)), itl_p99_ms=ms(_pct(all_itl, 99)),
        ttft_long_s=statistics.median(ttft), steps_long=first_step - step_long + 1,
        window_deliveries=len(win_gaps),
        tokens=[r.tokens for r in reqs] + [long_req.tokens],
        errors=[r.error for r in reqs + [long_req] if r.finish_reason == "error"])


def throughput(gen, running, cadence, args) -> dict:
    """Decode tokens/s of the running requests alone at this cadence: the median of `--repeats` runs after an
    untimed one that compiles."""
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    sp = SamplingParams(max_new_tokens=args.decode_tokens, stop_ids=())
    runs = []
    for timed in [False] + [True] * max(args.repeats, 1):
        eng = Engine(generator=gen, prefix_cache=False, decode_chunk_steps=cadence)
        reqs = eng.run(running, [sp] * len(running))
        tl = [r for r in eng.timeline if r.decode_steps]
        wall = sum(r.t_end - r.t_start - r.prefill_s for r in tl)
        toks = sum(r.decode_tokens for r in tl)
        if timed:
            runs.append(dict(cadence=cadence, decode_tokens=toks, wall_s=wall, tokens_per_s=toks / wall,
                             step_ms_p50=1e3 * statistics.median(r.decode_s / r.decode_steps for r in tl),
                             tokens=[r.tokens for r in reqs]))
    out = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
    out["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    return out


def plot(res: dict, path: str) -> str | None:
    """Delivery gaps (p50 / p99 while the long prompt is admitted) per variant, and tokens/s per cadence."""
    try:
        from scripts.bench_meta import pyplot, save_figure
        plt = pyplot()
    except ImportError:
        return None
    rows = [r for r in res["rows"] if r.get("kind") == "scenario" and r.get("timed")]
    tps = [r for r in res["rows"] if r.get("kind") == "throughput"]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    labels = [f"{'chunk ' + str(r['chunk']) if r['chunk'] else 'whole'}\ncadence {r['cadence']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["window_gap_p50_ms"] or 0 for r in rows], width=0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [r["window_gap_p99_ms"] or 0 for r in rows], width=0.4, label="p99")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("running requests' delivery gap (ms)")
    ax.set_title(f"while a {res['meta'].get('long_prompt')}-token prompt is admitted", fontsize=8)
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.bar([str(r["cadence"]) for r in tps], [r["tokens_per_s"] for r in tps], color="C2")
    ax.set_xlabel("decode chunk (steps)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{res['meta'].get('running')} requests decoding", fontsize=8)
    fig.suptitle(f"chunked prefill and decode cadence, {res['meta'].get('model')} on {res['meta'].get('device')} "
                 "(bench_chunked_prefill.py)", fontsize=9)
    return save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    from scripts.bench_meta import add_common_args
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, files="chunked_prefill.json, chunked_prefill.png", model="smollm2-135m", dtype="float32")
    p.add_argument("--attention", default="sparse", choices=("sparse", "dense"))
    p.add_argument("--running", type=int, default=2, help="requests decoding when the long prompt arrives")
    p.add_argument("--running-prompt", type=int, default=128)
    p.add_argument("--running-new", type=int, default=None, help="their new tokens (default: enough to outlast the "
                   "long prompt's admission)")
    p.add_argument("--long-prompt", type=int, default=2048)
    p.add_argument("--long-new", type=int, default=8)
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk tokens of the chunked variants")
    p.add_argument("--cadences", default="64,8", help="decode chunk steps; the first is the reference's")
    p.add_argument("--warm-steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each variant (gaps pooled, medians)")
    p.add_argument("--decode-tokens", type=int, default=128, help="new tokens a request in the throughput runs")
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--max-context", type=int, default=None, help="default: long prompt + its new tokens, rounded up")
    p.add_argument("--small", action="store_true", help="CPU check: tiny preset, page 16, long prompt 256, chunk 32")
    p.add_argument("--png", default=None, metavar="JSON", help="draw JSON's PNG beside it (no run) and exit")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.png:
        with open(args.png) as f:
            print(plot(json.load(f), os.path.splitext(args.png)[0] + ".png"))
        return
    if args.small:
        args.model, args.page, args.token_budget = "tiny", 16, 64
        args.long_prompt, args.chunk, args.running_prompt, args.decode_tokens = 256, 32, 40, 32
        args.cadences = "16,4"
    cadences = [int(c) for c in args.cadences.split(",")]
    if args.running_new is None:
        # the running requests decode through the long prompt's admission (whole, or one chunk a step) and after
        args.running_new = cadences[0] * (args.warm_steps + 1 + -(-args.long_prompt // args.chunk))
    from scripts.bench_meta import Results, git_commit, run_meta
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    model, running, long_ = _load(args)
    ctx = args.max_context or max(args.long_prompt + args.long_new, args.running_prompt + max(
        args.running_new, args.decode_tokens)) + args.page
    cfg = default_cache_config(model.config, num_seqs=args.running + 1, max_tokens=ctx, page_size=args.page,
                               token_budget=args.token_budget, dtype=model.dtype)
    gen = Generator(model, cfg, attention=args.attention)
    commit = args.commit or git_commit()
    path = os.path.join(args.out, "chunked_prefill.json")
    os.makedirs(args.out, exist_ok=True)
    res = Results(path, run_meta(commit, model=args.model, attention=gen.attention, running=args.running,
                                 running_prompt=args.running_prompt, running_new=args.running_new,
                                 long_prompt=args.long_prompt, long_new=args.long_new, page_size=args.page,
                                 token_budget=cfg.token_budget, max_context=cfg.max_context), settings=vars(args))
    variants = [(None, cadences[0]), (args.chunk, cadences[0])] + [(c, k) for k in cadences[1:]
                                                                   for c in (None, args.chunk)]
    ref = None
    for chunk, cadence in variants:
        for timed in (False, True):            # untimed first: every program of the variant compiles there
            t0 = time.perf_counter()
            row = scenario(gen, running, long_, chunk, cadence, args, args.repeats if timed else 0)
            row.update(kind="scenario", wall_s=time.perf_counter() - t0)
            if ref is None:
                ref = row["tokens"]
            row["same_tokens"] = row["tokens"] == ref
            if timed:
                res.add({k: v for k, v in row.items() if k != "tokens"})
                res.save()
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    ref_tp = None
    for cadence in cadences:
        row = throughput(gen, running, cadence, args)
        ref_tp = ref_tp or row["tokens"]
        row.update(kind="throughput", same_tokens=row.pop("tokens") == ref_tp)
        res.add(row)
        res.save()
        print(json.dumps(row), flush=True)
    print(plot(json.load(open(path)), os.path.splitext(path)[0] + ".png"))
    print(f"\n{'variant':24s} {'gap p50':>9s} {'gap p99':>9s} {'gap max':>9s} {'itl p50':>9s} {'itl p99':>9s} "
          f"{'ttft long':>9s} {'steps':>5s} same")
    for r in res.rows:
        if r["kind"] == "scenario":
            name = f"{'chunk ' + str(r['chunk']) if r['chunk'] else 'whole'}, cadence {r['cadence']}"
            print(f"{name:24s} {r['window_gap_p50_ms']:9.1f} {r['window_gap_p99_ms']:9.1f} "
                  f"{r['window_gap_max_ms']:9.1f} {r['window_itl_p50_ms']:9.2f} {r['window_itl_p99_ms']:9.2f} {r['ttft_long_s']:9.2f} "
                  f"{r['steps_long']:5d} {r['same_tokens']}")
        else:
            print(f"cadence {r['cadence']:3d}: {r['tokens_per_s']:.1f} decode tokens/s (step p50 "
                  f"{r['step_ms_p50']:.1f} ms) same {r['same_tokens']}")


if __name__ == "__main__":
    main()
