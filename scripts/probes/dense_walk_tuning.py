"""Probe: launch shapes of the dense fp8 page walk (runtime/backends.dense_page_walk) at one layer of the 8B shape.

    python -m scripts.probes.dense_walk_tuning --batch 3 --context 131072

Random e4m3 codes with unit scales in the dense cache's layout ([S, T, KV, D] codes, each sequence's last page in
its bf16 ring), 4 query heads a KV head; each launch (--pages a step x --splits x --warps, 2 stages) is checked against
the walk's jnp reference first, then timed (median wall time of 20 calls, each synced), beside the read ceiling of
the same machine (bench_meta.read_ceiling). Prints a table; writes nothing (the decode rows are bench_decode's).
"""
from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
import jax
import jax.numpy as jnp

from scripts.bench_meta import read_ceiling
from ulacache_jax.runtime.backends import dense_page_walk


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--context", type=int, default=131072)
    # each launch compiles for seconds on the GPU: a few at a time (18 did not finish in 200 s on an H100)
    ap.add_argument("--pages", type=int, nargs="+", default=[1, 2], help="pages a step (pages_per_block)")
    ap.add_argument("--splits", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    args = ap.parse_args(argv)
    S, T, KV, H, D, P = args.batch, args.context, 8, 32, 128, 64
    key = jax.random.key(0)
    ck = jax.random.normal(key, (S, T, KV, D), jnp.bfloat16).astype(jnp.float8_e4m3fn)
    cv = jax.random.normal(jax.random.fold_in(key, 1), (S, T, KV, D), jnp.bfloat16).astype(jnp.float8_e4m3fn)
    sc = jnp.ones((S, T // P, 1, KV, 1), jnp.float32)
    rk = jax.random.normal(jax.random.fold_in(key, 2), (S, P, KV, D), jnp.bfloat16)
    q = jax.random.normal(jax.random.fold_in(key, 3), (S, 1, H, D), jnp.bfloat16)
    pos = jnp.full((S,), T - 1, jnp.int32)
    live = jnp.ones((S,), bool)
    view = (ck, cv, sc, sc, rk, rk)
    nbytes = 2 * ck.size
    ceil = read_ceiling(4 << 30)

    def run(impl, tuning=None):
        return jax.jit(lambda q: dense_page_walk(view, q, pos, live, page_size=P, impl=impl, tuning=tuning))

    want = np.asarray(run("ref")(q), np.float32)
    print(f"read ceiling {ceil / 1e12:.2f} TB/s; codes {nbytes / 1e6:.0f} MB a layer", flush=True)
    rows = []
    for npb, splits, warps, stages in itertools.product(args.pages, args.splits, args.warps, (2,)):
        tuning = dict(pages_per_block=npb, num_splits=splits, num_warps=warps, num_stages=stages)
        try:
            f = run("pallas", tuning)
            got = np.asarray(f(q), np.float32)
            ok = bool(np.allclose(got, want, atol=3e-2, rtol=3e-2))
            ts = []
            for _ in range(20):
                t = time.perf_counter()
                f(q).block_until_ready()
                ts.append(time.perf_counter() - t)
            us = 1e6 * float(np.median(ts))
            rows.append((npb, splits, warps, stages, ok, us, nbytes / (us * 1e-6) / ceil))
        except Exception as e:  # a launch that does not compile is reported, not fatal
            rows.append((npb, splits, warps, stages, False, float("nan"), str(e)[:60]))
        print("measured", rows[-1], flush=True)       # each launch as it is measured: a cut run keeps them
    print("| pages/step | splits | warps | stages | check | us | fraction of read ceiling |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (np.isnan(r[5]), r[5])):            # failed launches last
        print("| " + " | ".join(f"{x:.1f}" if isinstance(x, float) and x > 1 else
                                (f"{x:.3f}" if isinstance(x, float) else str(x)) for x in r) + " |")


if __name__ == "__main__":
    main()
