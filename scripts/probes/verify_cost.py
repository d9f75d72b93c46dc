"""Probe: why one speculative verification costs ~30 plain decode steps at the 8B shape (bench_speculative
--step-cost). Times a plain decode chunk and one verification (K + 1 rows) on a synthetic cache, lists the copies
of large buffers in the compiled verification program, and (--patched) repeats with verify_batched's lax.cond
(staging overflow once vs row by row) replaced by its `once` branch, to see whether the cond costs the copies.

python scripts/probes/verify_cost.py [--context 32768] [--layers 8] [--patched]
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import sys
import time



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--patched", action="store_true", help="(trees before the fix) verify_batched's cond -> once")
    ap.add_argument("--preset", default="llama-3.1-8b")
    args = ap.parse_args()
    import numpy as np
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from scripts.bench_decode import bench_config, synthetic_fill_sparse
    from scripts.bench_speculative import plain_step_ms
    from ulacache_jax.cache import decode_layer
    if args.patched:
        src = inspect.getsource(decode_layer.verify_batched)
        new = src.replace("jax.lax.cond(fits, once, row_by_row, ", "once(")
        assert new != src, "cond not found"
        exec(compile(new, decode_layer.__file__, "exec"), decode_layer.__dict__)
    from ulacache_jax.runtime.generator import Generator
    from ulacache_jax.models import LlamaModel, get_preset
    from ulacache_jax.runtime.sampling import row_keys
    from ulacache_jax.runtime.speculative.rules import next_flush
    mc = dataclasses.replace(get_preset(args.preset), num_layers=args.layers)
    model = LlamaModel(mc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    ctx, page, K = args.context, 64, args.k
    ns = argparse.Namespace(chunks=8, budget=2048)
    cfg = bench_config(mc, "sparse", 1, ctx, ns, kv_fraction=0.5, page=page)
    if hasattr(cfg, "verify_rows"):                   # the cache's overflow frames sized for K + 1 rows
        cfg = dataclasses.replace(cfg, verify_rows=K + 1)
    gen = Generator(model, cfg, attention="sparse")
    S = cfg.max_seqs
    slots = [gen.admit(ctx + (ns.chunks + 1) * page)]
    synthetic_fill_sparse(gen.cache, slots, ctx, seed=1, chunk=min(ctx, 32768))
    live = np.arange(S) < 1
    plain_ms, sampling = plain_step_ms(gen, live, chunks=3)
    L = ctx + 3 * page
    b = next_flush(ctx, L, page)
    rows = np.where(live, min(K + 1, b - L), 0).astype(np.int32)
    rng = np.random.default_rng(0)
    bk = gen.backend
    vt = []
    for i in range(5):
        tokens = rng.integers(0, mc.vocab_size, (S, K + 1)).astype(np.int32)
        keys = row_keys(jnp.arange(S, dtype=jnp.uint32), jnp.full(S, 100 + i, jnp.uint32))
        a = jax.device_put((tokens, rows, np.full(S, b, np.int32), keys, sampling, jnp.zeros(())), gen.replicated)
        if i == 0:
            txt = gen.program.verify(K + 1).lower(gen.params, bk.cache, bk.host, *a).compile().as_text()
        t = time.perf_counter()
        bk.cache, bk.host, out, n_new, *_ = gen.program.verify(K + 1)(gen.params, bk.cache, bk.host, *a)
        np.asarray(n_new)
        vt.append(time.perf_counter() - t)
    verify_ms = 1e3 * float(np.median(vt[1:]))
    pool = bk.cache.pool_k.shape
    host = bk.host.k.shape
    print(f"pool_k {pool} host_k {host}")
    big = []
    for line in txt.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+)\[([\d,]*)\]\{[^}]*\} (copy|fusion|conditional|custom-call)\b", line)
        if not m:
            continue
        n = int(np.prod([int(x) for x in m.group(3).split(",") if x])) if m.group(3) else 1
        if n * 2 >= 64 << 20 and ("copy" in m.group(1) or m.group(4) in ("copy", "conditional")):
            big.append(f"  {m.group(1)} {m.group(2)}[{m.group(3)}] {m.group(4)} {line.strip()[-90:]}")
    print(f"== patched={args.patched} ctx={ctx} layers={args.layers} K={K}: plain step {plain_ms:.3f} ms, "
          f"verify {verify_ms:.3f} ms (ratio {verify_ms / plain_ms:.1f}); large copies in verify: {len(big)}")
    print("\n".join(big[:20]))


if __name__ == "__main__":
    main()
