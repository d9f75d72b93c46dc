"""Probe (issue 21): PB-LRU's hit rate on a model's selection trace at the auto pool before and after the pool
took the sieve's padded slots (generator.default_cache_config, pb_lru_sieve.scanned_slots).

Before: `sieve_geometry(headroom x one step's selection frames)`; after: the same buckets with their slots rounded
up to the slots the sieve scans anyway, at most one frame per KV page. Replays the trace (`bench_quality.py --tasks ppl,trace --save-trace`)
through the reference access at both geometries and at headrooms 1, 1.25, 1.5 and 2; hit rates counted after the
same warm-up rows as selection_order_hits.py.

    python scripts/probes/pool_rounding_hits.py TRACE.npz [--out JSON]
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np



def main(argv=None):
    from scripts.bench_quality import pblru_hits, replay_probe_args, replay_rows
    from ulacache_jax.pallas_kernels.pb_lru_sieve import pool_slots, sieve_geometry
    a = replay_probe_args(argv, __doc__)
    sel, cc, step, warm, every, requests, lids, valid = replay_rows(a.trace)    # sel [steps, L, W, G, K]
    steps, L, W, G, K = sel.shape
    rows = []
    print("| headroom | before: frames (buckets x slots) | hit | after: frames | hit |")
    for h in (1.0, 1.25, 1.5, 2.0):
        nb, ns = sieve_geometry(int(np.ceil(h * step)), requests)
        ns2 = max(ns, pool_slots(nb, ns, requests, every))   # frames here are not capped at the pages first
        r = dict(headroom=h, buckets=nb, slots_before=ns, slots_after=ns2,
                 hit_before=pblru_hits(lids, valid, nb, ns, warm),
                 hit_after=pblru_hits(lids, valid, nb, ns2, warm) if ns2 != ns else None)
        r["hit_after"] = r["hit_before"] if r["hit_after"] is None else r["hit_after"]
        rows.append(r)
        print(f"| {h} | {nb * ns} ({nb} x {ns}; {nb * ns / step:.2f}x) | {r['hit_before']:.4f} | "
              f"{nb * ns2} ({nb} x {ns2}; {nb * ns2 / step:.2f}x) | {r['hit_after']:.4f} |", flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(dict(trace=os.path.basename(a.trace), steps=steps, layers=L, windows=W, groups=G, k=K,
                           step_frames=step, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
