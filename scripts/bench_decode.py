"""End-to-end decode benchmark: UlaCache sparse decode vs the dense HBM baseline with the same model.

Llama-3.1-8B shape with RANDOM bf16 weights. The KV cache is a SYNTHETIC fill made on the device (random K/V with
distinct bytes per sequence, written through the real ingestion path into the pinned host pool and summaries for
sparse; straight into HBM for dense), not a prefill. Random weights make selections without temporal locality,
so hit rates at small HBM pools are worst cases.

Per context, same run: decode tokens/s and per-token latency (p50/p99 over chunks of page_size steps: tokens are
produced on the device in chunks, one host sync per chunk, so the per-token figure is chunk time / steps), for
each batch, sparse vs dense; each side also as a fraction of its own bytes floor (weights + bytes read per step,
at the HBM copy bandwidth measured in this run). Writes JSON + PNG to docs/benchmarks/ (or --out).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import time

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx


def copy_bandwidth(nbytes=4 << 30) -> float:
    """HBM copy ceiling in bytes/s (read + write counted), median of 10."""
    x = jnp.ones(nbytes // 2, jnp.bfloat16)
    f = jax.jit(lambda a: a * 1)
    f(x).block_until_ready()
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 2 * nbytes / float(np.median(ts))


def synthetic_fill_sparse(gen, slots, ctx, seed):
    """Random K/V (distinct per sequence, made on the device) through the real ingestion path."""
    c = gen.config
    m = gen.cache
    chunk = min(ctx, 8192)
    mk = jax.jit(lambda key: jax.random.normal(key, (c.num_layers, chunk, c.num_kv_heads, c.head_dim), c.jnp_dtype))
    for i, slot in enumerate(slots):
        for start in range(0, ctx, chunk):
            k = mk(jax.random.key(seed * 1_000_003 + i * 7919 + start))
            v = mk(jax.random.key(seed * 1_000_003 + i * 7919 + start + 1))
            m.state, m.host = m._ingest(m.state, m.host, slot, k, v, start, ctx)


def synthetic_fill_dense(gen, batch, ctx, seed):
    c = gen.config
    shape = gen.dense.k.shape
    fill = jax.jit(lambda key: jax.random.normal(key, shape, c.jnp_dtype), out_shardings=None)
    from ulacache_jax.generation import DenseCache
    gen.dense = DenseCache(fill(jax.random.key(seed)), fill(jax.random.key(seed + 1)))
    gen.dense_len = jnp.where(jnp.arange(c.max_seqs) < batch, ctx, 0).astype(jnp.int32)


def run_side(model, mc, attention, batch, ctx, args, copy_bw):
    from ulacache_jax.generation import Generator, default_cache_config
    from ulacache_jax.sampling import SamplingArrays, row_keys
    page = 64
    frames_full = batch * mc.num_layers * mc.num_kv_heads * (args.budget // page)
    kw = {}
    if attention == "sparse":
        slots = 64
        frames = max(slots, int(frames_full * args.hbm_fraction))
        kw = dict(num_buckets=1 << max(0, (frames // slots - 1).bit_length()), slots_per_bucket=slots)
    cfg = default_cache_config(mc, num_seqs=batch, max_tokens=ctx + args.steps * page + page, page_size=page,
                               token_budget=args.budget, dtype="bfloat16", **kw)
    if attention == "dense":
        cfg = dataclasses.replace(cfg, max_pages_per_seq=(ctx + (args.chunks + 1) * page) // page + 1)
    from ulacache_jax.decode_layer import DecodeOptions
    gen = Generator(model, cfg, attention=attention, options=DecodeOptions(sieve=args.sieve))
    S = cfg.max_seqs
    if attention == "sparse":
        slots_ = [gen.admit(ctx + (args.chunks + 1) * page) for _ in range(batch)]
        synthetic_fill_sparse(gen, slots_, ctx, seed=batch)
    else:
        synthetic_fill_dense(gen, batch, ctx, seed=batch)
    tok = jnp.zeros(S, jnp.int32)
    done = jnp.arange(S) >= batch
    rem = jnp.full(S, 1 << 30, jnp.int32)
    sampling = SamplingArrays.fill(S)
    stops = jnp.asarray([-1], jnp.int32)
    t0 = time.perf_counter()
    out, _, _ = gen.decode_chunk(tok, done, rem, row_keys(jnp.arange(S, dtype=jnp.uint32), jnp.zeros(S, jnp.uint32)),
                                 sampling, stops)
    out.block_until_ready()
    compile_s = time.perf_counter() - t0
    times = []
    gen.stats = type(gen.stats).zeros()
    for i in range(args.chunks):
        t = time.perf_counter()
        out, _, _ = gen.decode_chunk(tok, done, rem, row_keys(jnp.arange(S, dtype=jnp.uint32),
                                                                   jnp.full(S, i + 1, jnp.uint32)), sampling, stops)
        np.asarray(out)
        times.append(time.perf_counter() - t)
    per_tok = np.asarray(times) / page
    st = gen.stats
    hits, misses = int(st.hits), int(st.misses)
    # bytes floor per decode step: weights + KV bytes read (dense: whole context; sparse: attended pages + summaries)
    wbytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    kv_tok = 2 * mc.num_kv_heads * mc.head_dim * 2 * mc.num_layers          # K+V bytes per token, all layers
    if attention == "dense":
        step_bytes = wbytes + batch * (ctx + args.chunks * page / 2) * kv_tok
    else:
        attended = min(ctx, args.budget + 2 * page)
        summ = batch * (ctx // page) * 2 * mc.num_kv_heads * mc.head_dim * 2 * mc.num_layers
        step_bytes = wbytes + batch * attended * kv_tok + summ
    floor_s = step_bytes / copy_bw
    row = dict(attention=attention, batch=batch, context=ctx, budget=args.budget, page=page,
               hbm_fraction=args.hbm_fraction if attention == "sparse" else 1.0,
               tokens_per_s=batch / float(np.median(per_tok)), p50_token_ms=1e3 * float(np.median(per_tok)),
               p99_token_ms=1e3 * float(np.percentile(per_tok, 99)), compile_s=compile_s,
               floor_token_ms=1e3 * floor_s, fraction_of_floor=floor_s / float(np.median(per_tok)),
               hit_rate=hits / max(1, hits + misses) if attention == "sparse" else None, chunks=args.chunks)
    del gen
    return row


def write_json(out, res):
    with open(os.path.join(out, "decode.json"), "w") as f:
        json.dump(res, f, indent=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32, help="fewer layers for a quick check")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--hbm-fraction", type=float, default=1.0, help="PB-LRU frames / pages a full step selects")
    p.add_argument("--sides", default="sparse,dense")
    p.add_argument("--rows", default=None, help="explicit side:context:batch list, e.g. sparse:32768:1,dense:32768:1")
    p.add_argument("--sieve", default="auto", help="PB-LRU impl for the sparse side: auto, ref or pallas")
    p.add_argument("--commit", default=None, help="commit id to record (git may be unavailable on the device)")
    p.add_argument("--out", default="docs/benchmarks")
    args = p.parse_args(argv)
    from ulacache_jax.bench_meta import git_commit
    from ulacache_jax.models import LlamaModel, get_preset
    mc = dataclasses.replace(get_preset("llama-3.1-8b"), num_layers=args.layers)
    model = LlamaModel(mc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    copy_bw = copy_bandwidth()
    rows = []
    if args.rows:
        plan = [(side, int(ctx), int(b)) for side, ctx, b in (r.split(":") for r in args.rows.split(","))]
    else:
        plan = [(side, ctx, b) for ctx in map(int, args.contexts.split(",")) for b in map(int, args.batches.split(","))
                for side in args.sides.split(",")]
    commit = args.commit or git_commit()
    os.makedirs(args.out, exist_ok=True)
    for side, ctx, b in plan:
        try:
            rows.append(run_side(model, mc, side, b, ctx, args, copy_bw))
        except Exception as e:  # an OOM at one size must not lose the others
            rows.append(dict(attention=side, batch=b, context=ctx, error=f"{type(e).__name__}: {e}"[:300]))
        print(json.dumps(rows[-1]), flush=True)
        write_json(args.out, dict(commit=commit, rows=rows, partial=True))
    res = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, commit=commit,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(), copy_tb_s=copy_bw / 1e12,
               model=f"llama-3.1-8b shape, {args.layers} layers, random bf16 weights", sieve=args.sieve,
               kv="synthetic fill on device (random, distinct per sequence), not a prefill", rows=rows)
    write_json(args.out, res)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for side in ("sparse", "dense"):
            pts = [(f"{r['context'] // 1024}K b{r['batch']}", r["tokens_per_s"]) for r in rows
                   if r.get("attention") == side and "tokens_per_s" in r]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=side)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"decode, {res['model']}\n{res['device']}, synthetic KV", fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "decode.png"), dpi=100)
    except Exception as e:
        print("plot failed:", e)
    print(f"\ncopy ceiling {copy_bw / 1e12:.2f} TB/s")
    print(f"{'side':7s} {'ctx':>7s} {'B':>3s} {'tok/s':>9s} {'p50 ms':>8s} {'p99 ms':>8s} {'floor%':>7s} {'hit':>6s}")
    for r in rows:
        if "error" in r:
            print(f"{r['attention']:7s} {r['context']:7d} {r['batch']:3d}  ERROR {r['error'][:80]}")
            continue
        hr = "" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        print(f"{r['attention']:7s} {r['context']:7d} {r['batch']:3d} {r['tokens_per_s']:9.1f} {r['p50_token_ms']:8.2f} "
              f"{r['p99_token_ms']:8.2f} {100 * r['fraction_of_floor']:6.1f}% {hr:>6s}")
    return res


if __name__ == "__main__":
    main()
