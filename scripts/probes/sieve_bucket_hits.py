"""Probe (issue 21): PB-LRU's hit rate on a model's selection trace against the bucket count, at a fixed pool.

Why: `sieve_geometry` used to take the fewest buckets on the sieve's fast path (the closest to a global LRU), which
made a small pool's sieve slow (fewer programs, larger compare tiles: docs/BENCHMARKS.md, the sieve's bucket
count). This replays the trace (`bench_quality.py --tasks ppl,trace --save-trace`) through the reference access
at the library's pool for headrooms 1, 1.5 and 2 (`default_cache_config`'s frames: sieve_geometry, slots rounded
to the scanned slots, at most one frame per page) split into 1, 2, 4, 8 and 16 times the old geometry's buckets;
hit rates counted after the same warm-up rows as the other replay probes.

    python scripts/probes/sieve_bucket_hits.py TRACE.npz [--out JSON]
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
    rows = []
    print("| headroom | pool frames | buckets x slots | hit |")
    for h in (1.0, 1.5, 2.0):
        # the fewest fast-path buckets, as sieve_geometry chose before its 128-bucket floor (bbb1589)
        nb, ns = sieve_geometry(int(np.ceil(h * step)), requests, min_buckets=1)
        frames = nb * pool_slots(nb, ns, requests, every)
        for f in (1, 2, 4, 8, 16):
            b = nb * f
            s = -(-frames // b)
            r = dict(headroom=h, frames=frames, buckets=b, slots=s, hit=pblru_hits(lids, valid, b, s, warm))
            rows.append(r)
            print(f"| {h} | {frames} | {b} x {s} | {r['hit']:.4f} |", flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(dict(trace=os.path.basename(a.trace), shape_steps_layers_windows_groups_k=list(sel.shape),
                           step_frames=step, every_page=every, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
