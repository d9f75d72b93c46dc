"""Probe (temporary): one launch each of the label page-lse kernels at the 8B shape, for ncu."""
import argparse, sys
import jax, jax.numpy as jnp
import scripts.bench_labels as bl
from ulacache_jax.pallas_kernels import page_lse as pk
a = argparse.Namespace(batch=3, layers=2, groups=8, pages=2048, page=64, kv_heads=1, channels=32, rows=4, bits=4)
codes, scale, q = bl.make_inputs(jax.random.key(0), a, adversarial=False)
fs = {"kernel": lambda: pk.page_lse_pallas(codes, q, layer=1, scale=scale, bits=4),
      "mma": lambda: pk.label_lse_mma(codes, q, layer=1, scale=scale, pages_per_program=32, num_warps=1,
                                      num_stages=2),
      "asm": lambda: pk.label_lse_mma(codes, q, layer=1, scale=scale, pages_per_program=32, num_warps=1,
                                      num_stages=2, asm=True)}
for name in sys.argv[1:]:
    fs[name]().block_until_ready()
    fs[name]().block_until_ready()
    print(name, "done", flush=True)
