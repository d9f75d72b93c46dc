"""Does the order of a step's selected pages change PB-LRU's hit rate? (issue 21: the page top-k lists its
winners in page order instead of score order, which drops a sort a layer.)

Order matters to the sieve only when a bucket has more misses than free candidate slots: the misses are served in
order of appearance (DESIGN.md section 5), so score order caches the best-scored pages first and page order the
lowest pages. This replays one selection trace recorded in score order (`bench_quality.py --tasks ppl,trace
--save-trace` before the change) twice, as recorded and with each row's pages sorted by id, through PB-LRU at the
library's geometry and the pools of bench_quality's trace study, and prints both hit rates.

    python scripts/probes/selection_order_hits.py TRACE.npz [--out JSON]
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np



def page_order(sel):
    """sel [..., K] page ids, -1 unused (last) -> the same ids sorted ascending per row, -1s still last."""
    big = np.iinfo(np.int32).max
    s = np.sort(np.where(sel < 0, big, sel), axis=-1)
    return np.where(s == big, -1, s).astype(sel.dtype)


def main(argv=None):
    from scripts.bench_quality import load_selection_trace, pblru_hits, replay_probe_args, trace_lids
    from ulacache_jax.pallas_kernels.pb_lru_sieve import sieve_geometry
    a = replay_probe_args(argv, __doc__)
    sel, cc, lib, warm, _ = load_selection_trace(a.trace)              # sel [steps, L, W, G, K]
    steps, L, W, G, K = sel.shape
    rows = []
    for name, frames in [("default", lib)] + [(f"default x{m}", int(lib * m)) for m in (1.25, 1.5, 2)]:
        nb, ns = sieve_geometry(frames, W * G * K)
        r = dict(pool=name, frames=nb * ns, geometry=[nb, ns])
        for order, s in (("score", sel), ("page", page_order(sel))):
            lids, valid = trace_lids(s, cc["page_size"])
            r[order] = pblru_hits(lids, valid, nb, ns, warm)
        rows.append(r)
        print(f"| {name} | {nb * ns} ({nb} x {ns}) | {r['score']:.4f} | {r['page']:.4f} |", flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(dict(trace=os.path.basename(a.trace), steps=steps, layers=L, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
