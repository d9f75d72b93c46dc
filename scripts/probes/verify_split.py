"""Exact mode's dense verification (runtime/backends.verify_attention) for one layer at the Llama-8B shape, with the
committed keys cut into pieces (8 and 16 by default: split-K over cuDNN's flash kernel), and by the decode kernel over the cache's frames (verify_walk): each checked against the first, then timed as a chain of calls in one jit (bench_meta.time_chain); GB/s of the K/V read against
the read ceiling measured in the same run. A diagnostic for choosing VERIFY_CHUNK (bench_exact times the cycle).
Run (GPU): PYTHONPATH=. python3 -m scripts.probes.verify_split [--batch 2] [--context 131072] [--rows 5]"""
import argparse

import numpy as np
import jax
import jax.numpy as jnp

from scripts.bench_meta import read_ceiling, time_chain
from ulacache_jax.runtime.backends import verify_attention, verify_splits, verify_walk


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--rows", type=int, default=5)
    p.add_argument("--splits", type=int, nargs="*", default=[8, 16])
    a = p.parse_args(argv)
    S, T, Q, H, KV, D = a.batch, a.context, a.rows, 32, 8, 128
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (S, Q, H, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (S, T, KV, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (S, T, KV, D), jnp.bfloat16)
    kn = jax.random.normal(ks[3], (S, Q, KV, D), jnp.bfloat16)
    vn = jax.random.normal(ks[4], (S, Q, KV, D), jnp.bfloat16)
    pos = jnp.full((S,), T - Q - 3, jnp.int32)
    qpos = pos[:, None] + jnp.arange(Q)[None, :]
    s_ = jnp.arange(S)[:, None]
    k, v = k.at[s_, qpos].set(kn), v.at[s_, qpos].set(vn)          # the rows' own K/V in the cache (the walk reads it)
    ceiling = read_ceiling(1 << 30)
    nbytes = 2 * S * int(pos[0]) * KV * D * 2
    base = None
    print(f"S={S} T={T} Q={Q}: {nbytes / 1e9:.2f} GB of K/V a call, read ceiling {ceiling / 1e12:.2f} TB/s, "
          f"default splits {verify_splits(T)}")
    print("| verification | max err vs first | us | GB/s | of read |\n|---|---|---|---|---|")
    for c in a.splits:
        f = jax.jit(lambda q, c=c: verify_attention(q, k, v, kn, vn, pos, implementation="cudnn", splits=c))
        out = np.asarray(f(q), np.float32)
        base = out if base is None else base
        err = float(np.max(np.abs(out - base)))
        sec, _ = time_chain(lambda x, f=f: x + f(x) * 1e-3, q, target_s=0.01, reps=5, max_n=8)
        print(f"| cuDNN, {c} pieces | {err:.3g} | {sec * 1e6:.0f} | {nbytes / sec / 1e9:.0f} | "
              f"{nbytes / sec / ceiling:.2f} |", flush=True)
    f = jax.jit(lambda q: verify_walk(q, k, v, pos, page_size=64))
    err = float(np.max(np.abs(np.asarray(f(q), np.float32) - base)))
    sec, _ = time_chain(lambda x: x + f(x) * 1e-3, q, target_s=0.01, reps=5, max_n=8)
    print(f"| walk (Triton decode kernel) | {err:.3g} | {sec * 1e6:.0f} | {nbytes / sec / 1e9:.0f} | "
          f"{nbytes / sec / ceiling:.2f} |", flush=True)


if __name__ == "__main__":
    main()
