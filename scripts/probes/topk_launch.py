"""Probe (issue 21): the radix top-k kernel's device time by warps a program, at the decode's rows.

Each variant's kernel is timed alone under the profiler (the GPU's own event time, no harness ops), first checked
equal to `ref_select_pages`. At c7c200b it also compared the row read as power-of-two pieces (4096 + 128 lanes)
against one padded block: no difference (docs/BENCHMARKS.md), so the pieces were reverted and only warps remain.
Device command (repo root): PYTHONPATH=$PWD python3 scripts/probes/topk_launch.py --out $OUT
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics

import numpy as np
import jax
import jax.numpy as jnp

from ulacache_jax.pallas_kernels import page_topk
from scripts.bench_meta import Results, device_events, run_meta

ROWS = ((8, 4224, 32, "256K x 1"), (24, 2112, 32, "128K x 3"))   # (rows, pages, k, decode shape)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--commit", default=None, help="git commit of the code (the device copy has no .git)")
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    res = Results(os.path.join(a.out, "topk_launch.json"), run_meta(a.commit))   # rewritten after every row
    for r, p, k, shape in ROWS:
        groups = 8
        s = jnp.asarray(rng.standard_normal((r, p)).astype(np.float32))
        fl = jnp.full((r // groups,), p - 5, jnp.int32)
        ref = page_topk.ref_select_pages(s, fl, k, sink=1, recent=2, groups=groups)
        for w in a.warps:
            row = dict(shape=shape, rows=r, pages=p, k=k, warps=w)
            try:
                f = jax.jit(functools.partial(page_topk.select_pages_pallas, k=k, sink=1, recent=2, groups=groups,
                                              num_warps=w))
                row["exact"] = bool(np.array_equal(np.asarray(f(s, fl)), np.asarray(ref)))
                times = [device_events(lambda: f(s, fl), a.reps).by_name.get("page_top_k", float("nan")) / 1e3
                         for _ in range(3)]
                row["kernel_us"] = statistics.median(times)
            except Exception as e:  # noqa: BLE001  (a variant that does not compile is a result too)
                row["error"] = repr(e)[:300]
            print(row, flush=True)
            res.add(row)
    print(f"{'shape':10s} {'warps':>5s} {'exact':>6s} {'kernel us':>10s}")
    for x in res.rows:
        print(f"{x['shape']:10s} {x['warps']:5d} {str(x.get('exact', '-')):>6s} "
              f"{x.get('kernel_us', float('nan')):10.2f}")


if __name__ == "__main__":
    main()
