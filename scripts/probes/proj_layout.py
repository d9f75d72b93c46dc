"""Probe (issue 21): the decode's weight reads at B = 1 and 3 by projection layout, on the 8B shape.

The decode profile at c7c200b spends 120 of a sparse layer's 200 us at 256K x 1 in XLA's gemm fusions, all of
them weight reads (436 MB a layer): the q projection and the k / v projections ran as two launches (12.2 us gemm +
5.7 us reduce) at B = 1, one at B = 3; gate and up ~31 us each (~3.8 TB/s). This probe times, per layout, the
GPU's own event time (profiler) of the projections of one layer, each checked against the separate einsums:
separate q / k / v (the model today) against one concatenated qkv weight, separate gate / up against one [2F, E]
weight, and the down projection, with a read ceiling (a sum over 1 GiB) measured in the same run.
Device command (repo root): PYTHONPATH=$PWD python3 scripts/probes/proj_layout.py --out $OUT
"""
from __future__ import annotations

import argparse
import os
import statistics

import jax
import jax.numpy as jnp

from scripts.bench_meta import Results, device_events, run_meta, read_ceiling

E, H, KV, D, F = 4096, 32, 8, 128, 14336   # Llama-3.1-8B


def variants(key):
    ks = jax.random.split(key, 6)
    w = lambda k, s: (jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16)
    wq, wk, wv = w(ks[0], (H, D, E)), w(ks[1], (KV, D, E)), w(ks[2], (KV, D, E))
    wg, wu, wd = w(ks[3], (F, E)), w(ks[4], (F, E)), w(ks[5], (E, F))
    wqkv = jnp.concatenate([wq.reshape(H * D, E), wk.reshape(KV * D, E), wv.reshape(KV * D, E)])
    wgu = jnp.concatenate([wg, wu])

    def qkv_sep(x):
        return (jnp.einsum("BTE,HDE->BTHD", x, wq), jnp.einsum("BTE,KDE->BTKD", x, wk),
                jnp.einsum("BTE,KDE->BTKD", x, wv))

    def qkv_cat(x):
        y = jnp.einsum("BTE,NE->BTN", x, wqkv)
        b, t = x.shape[:2]
        return (y[..., :H * D].reshape(b, t, H, D), y[..., H * D:(H + KV) * D].reshape(b, t, KV, D),
                y[..., (H + KV) * D:].reshape(b, t, KV, D))

    def mlp_sep(x):
        return jnp.einsum("BTF,EF->BTE", jax.nn.silu(jnp.einsum("BTE,FE->BTF", x, wg)) * jnp.einsum(
            "BTE,FE->BTF", x, wu), wd)

    def mlp_cat(x):
        gu = jnp.einsum("BTE,NE->BTN", x, wgu)
        return jnp.einsum("BTF,EF->BTE", jax.nn.silu(gu[..., :F]) * gu[..., F:], wd)

    nbytes = dict(qkv=2 * (H + 2 * KV) * D * E, mlp=2 * 3 * F * E)
    return dict(qkv=(qkv_sep, qkv_cat), mlp=(mlp_sep, mlp_cat)), nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--commit", default=None, help="git commit of the code (the device copy has no .git)")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    ceiling = read_ceiling()
    fns, nbytes = variants(jax.random.PRNGKey(0))
    res = Results(os.path.join(a.out, "proj_layout.json"), run_meta(a.commit),   # rewritten after every row
                  read_ceiling_tb_s=ceiling / 1e12)
    for b in (1, 3):
        x = (jax.random.normal(jax.random.PRNGKey(b), (b, 1, E), jnp.float32)).astype(jnp.bfloat16)
        for part, (sep, cat) in fns.items():
            ref = jax.jit(sep)(x)
            for name, f in (("separate", sep), ("concatenated", cat)):
                jf = jax.jit(f)
                out = jf(x)
                err = max(float(jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32))))
                          for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
                times = [device_events(lambda: jf(x), a.reps) for _ in range(3)]
                us = statistics.median(t.busy_ns for t in times) / 1e3
                row = dict(batch=b, part=part, layout=name, max_abs_err=err, device_us=us,
                           launches=times[0].events, tb_s=nbytes[part] / us / 1e6,
                           of_read_ceiling=nbytes[part] / us / 1e6 / (ceiling / 1e12),
                           kernels={k: v / 1e3 for k, v in times[0].by_name.items()})
                print(row, flush=True)
                res.add(row)
    print(f"read ceiling {ceiling / 1e12:.2f} TB/s")
    print(f"{'B':>2s} {'part':4s} {'layout':13s} {'us':>7s} {'launch':>6s} {'TB/s':>6s} {'x ceil':>6s} {'err':>8s}")
    for r in res.rows:
        print(f"{r['batch']:2d} {r['part']:4s} {r['layout']:13s} {r['device_us']:7.2f} {r['launches']:6d} "
              f"{r['tb_s']:6.2f} {r['of_read_ceiling']:6.2f} {r['max_abs_err']:8.2e}")


if __name__ == "__main__":
    main()
