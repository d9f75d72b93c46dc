"""One launch of a label page-lse kernel at the 8B shape (S=3, G=8, P=2048, T=64, C=32 at 4 bits, 4 query rows),
for Nsight Compute on a GPU machine whose runtime lets it read the counters:
    ncu --clock-control none -k regex:label --launch-count 1 --section LaunchStats --section Occupancy \
        --metrics sass__inst_executed_per_opcode --print-metric-instances details \
        python3 scripts/probes/label_ncu.py mma
Names: `kernel` (page_lse_pallas, the label kernel on the CUDA cores), `mma` (label_lse_mma, the tensor cores)."""
import argparse
import sys

import jax

import scripts.bench_labels as bl
from ulacache_jax.pallas_kernels import page_lse as pk


def main(names):
    a = argparse.Namespace(batch=3, layers=2, groups=8, pages=2048, page=64, kv_heads=1, channels=32, rows=4, bits=4)
    codes, scale, q = bl.make_inputs(jax.random.key(0), a, adversarial=False)
    fs = {"kernel": lambda: pk.page_lse_pallas(codes, q, layer=1, scale=scale, bits=4),
          "mma": lambda: pk.label_lse_mma(codes, q, layer=1, scale=scale)}
    for name in names:
        for _ in range(2):                 # the first call compiles; ncu's --launch-count picks the launches
            fs[name]().block_until_ready()
        print(name, "done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["mma"])
