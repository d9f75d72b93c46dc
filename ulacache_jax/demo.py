"""`make demo` until batch inference lands: a short PB-LRU demonstration on a synthetic page trace."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from . import lid, pb_lru


def main() -> None:
    rng = np.random.default_rng(0)
    num_pages, steps, per_step = 4096, 64, 256
    hot = rng.choice(num_pages, 512, replace=False)  # a drifting hot set: selected pages recur across steps
    print("PB-LRU demo (synthetic trace: 4096 pages, 256 selections a step, 512-page hot set drifting)")
    for nb, ns in ((1, 1024), (16, 64), (128, 8)):
        state, hits, total = pb_lru.init(nb, ns), 0, 0
        for now in range(steps):
            hot[rng.integers(0, len(hot), 8)] = rng.integers(0, num_pages, 8)
            pages = np.where(rng.random(per_step) < 0.9, rng.choice(hot, per_step), rng.integers(0, num_pages, per_step))
            hi, lo = lid.pack(np.zeros_like(pages), np.zeros_like(pages), np.zeros_like(pages), pages * 64)
            state, out = pb_lru.access(state, hi, lo, jnp.ones(per_step, bool), now)
            if now >= steps // 4:  # skip warm-up
                hits, total = hits + int(out.hit.sum()), total + per_step
        print(f"  buckets={nb:4d} slots/bucket={ns:5d} frames={nb * ns}: hit rate {hits / total:.3f}")


if __name__ == "__main__":
    main()
