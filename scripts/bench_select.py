"""Page selection of one layer (issue 5, deliverable 1): Quest page scores and the top-k, launch variants timed
side by side in one run.

Shapes: B sequences x KV=8 groups (one KV head each) x P pages of 64 tokens, D=128, bf16 summaries (kmin, kmax),
one layer; q [B, 1, 64, 128]. Score variants: the Pallas kernel at several (block_pages, num_warps) and the jnp
einsum reference; each is checked against the reference (fp32, rtol 1e-4) before timing, and its bandwidth over
the summary bytes is reported as a fraction of the HBM copy bandwidth measured in the same run. Top-k variants
over the [B, KV, P] scores (k = budget / 64): lax.top_k, a two-stage top-k (per 128-page block, then over the
block winners) and the radix-select kernel (pallas_kernels/page_topk.py), checked for the same selected set. Time = median over reps of a jitted loop of `--calls` calls
(each call's query depends on the previous result, so no call is hoisted) / calls.

Run (H200): python3 scripts/bench_select.py --out DIR [--commit SHA]   -> DIR/select.json, DIR/select.png
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from scripts.bench_meta import Results, add_common_args, copy_ceiling, median_seconds, pyplot, run_meta, save_figure
from ulacache_jax.pallas_kernels import on_gpu, page_scores as ps
from ulacache_jax.pallas_kernels.page_topk import select_pages_pallas
from ulacache_jax.cache.select.quest import fold_queries

KV, H, D = 8, 64, 128


def loop_time(f, x0, calls: int, reps: int) -> float:
    """Median seconds per call of f over a chained fori_loop (f(x) -> scalar fed back into x)."""
    @jax.jit
    def run(x):
        def body(i, c):
            return c + f(x + (c * 1e-30).astype(x.dtype))
        return lax.fori_loop(0, calls, body, jnp.float32(0))

    return median_seconds(lambda: run(x0), reps, per_call=calls).median_s


def two_stage_top_k(s, k: int, block: int = 128):
    """Top-k of s [..., P] (P a multiple of block): top-k inside each block, then over the block winners. The
    same set as lax.top_k when values are distinct (every global winner is among its block's top k)."""
    *lead, P = s.shape
    v, i = lax.top_k(s.reshape(*lead, P // block, block), min(k, block))
    i = i + (jnp.arange(P // block) * block)[:, None]
    v2, j = lax.top_k(v.reshape(*lead, -1), k)
    return v2, jnp.take_along_axis(i.reshape(*lead, -1), j, axis=-1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--pages", type=int, default=4224, help="pages per sequence (256K tokens + room, 128-multiple)")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    return add_common_args(p, files="select.json, select.png")


def main(argv=None):
    a = build_parser().parse_args(argv)
    B, P = a.batch, a.pages
    gpu = on_gpu()
    keys = jax.random.split(jax.random.key(0), 3)
    kmin = jax.random.normal(keys[0], (B, 1, KV, P, 1, D), jnp.bfloat16)
    kmax = kmin + jnp.abs(jax.random.normal(keys[1], kmin.shape, jnp.bfloat16))
    q = jax.random.normal(keys[2], (B, 1, H, D), jnp.bfloat16)
    summ_bytes = 2 * kmin.size * 2
    bw = copy_ceiling(1 << 30 if gpu else 1 << 24)
    res = Results(os.path.join(a.out, "select.json"), run_meta(a.commit),
                  shapes=dict(B=B, KV=KV, P=P, D=D, budget=a.budget), copy_tb_s=bw / 1e12)

    def scores_fn(impl, bp=None, nw=None):
        def f(qq):
            qpos, qneg = fold_queries(qq, KV, 1)
            if impl == "ref":
                return ps.ref_page_scores(kmin, kmax, qpos, qneg, layer=0)
            return ps.page_scores_pallas(kmin, kmax, qpos, qneg, layer=0, interpret=not gpu,
                                         block_pages=bp, num_warps=nw)
        return f

    # the check's reference in numpy on the host (fp32): no XLA compile before the first row (a first H200 slot
    # printed nothing in 75 s); the jnp reference is timed last, as one more variant
    qpos, qneg = (np.asarray(x) for x in fold_queries(q, KV, 1))
    f32 = lambda x: np.asarray(x[:, 0, :, :, 0].astype(jnp.float32))                   # [B, KV, P, D]
    ref = np.einsum("sjpd,sjd->sjp", f32(kmax), qpos[:, :, 0]) + np.einsum("sjpd,sjd->sjp", f32(kmin), qneg[:, :, 0])
    print(f"reference ready: scores {ref.shape}", flush=True)
    variants = [("pallas", bp, nw) for bp in a.blocks for nw in a.warps] + [("ref", None, None)]
    for impl, bp, nw in variants:
        row = dict(kind="scores", impl=impl, block_pages=bp, num_warps=nw)
        try:
            f = scores_fn(impl, bp, nw)
            got = np.asarray(jax.jit(f)(q))
            row["ok"] = bool(np.allclose(got, ref, rtol=1e-4, atol=1e-3 * np.abs(ref).max()))
            sec = loop_time(lambda x: f(x)[:, :, 0].sum(), q, a.calls, a.reps)
            row.update(us=sec * 1e6, tb_s=summ_bytes / sec / 1e12, fraction_of_copy=summ_bytes / sec / bw)
        except Exception as e:  # one launch shape failing must not lose the others
            row["error"] = repr(e)[:300]
        res.add(row)
        print(json.dumps(row), flush=True)

    k = a.budget // 64
    sc = jnp.asarray(ref)
    want = np.sort(np.asarray(lax.top_k(sc, k)[1]), axis=-1)

    def radix(s):
        """The selection kernel with every page a candidate and none forced: the plain top-k (ids in page order),
        returned twice to match (values, ids): the timed sum reads the first output."""
        b, g, p = s.shape
        ids = select_pages_pallas(s.reshape(b * g, p), jnp.full(b * g, p, jnp.int32), k, interpret=not gpu)
        return ids.reshape(b, g, k), ids.reshape(b, g, k)

    for name, fn in (("lax.top_k", lambda s: lax.top_k(s, k)), ("two_stage", lambda s: two_stage_top_k(s, k)),
                     ("pallas_radix", radix)):
        row = dict(kind="top_k", impl=name, k=k)
        try:
            got = np.sort(np.asarray(jax.jit(fn)(sc)[1]), axis=-1)
            row["ok"] = bool((got == want).all())
            sec = loop_time(lambda x: fn(x)[0][:, :, 0].sum(), sc, a.calls, a.reps)
            row["us"] = sec * 1e6
        except Exception as e:  # the radix kernel's first GPU compile must not lose the other rows
            row["error"] = repr(e)[:300]
        res.add(row)
        print(json.dumps(row), flush=True)
    plot(res, os.path.join(a.out, "select.png"))
    print(f"\nB={B} KV={KV} P={P} D={D}: summaries {summ_bytes / 1e9:.3f} GB, copy {bw / 1e12:.2f} TB/s")
    print("| kind | variant | us | TB/s | of copy | check |\n|---|---|---|---|---|---|")
    for r in res.rows:
        v = variant_name(r, " ")
        if "error" in r:
            print(f"| {r['kind']} | {v} | ERROR {r['error'][:80]} |")
        else:
            print(f"| {r['kind']} | {v} | {r['us']:.1f} | {r.get('tb_s', float('nan')):.2f} | "
                  f"{r.get('fraction_of_copy', float('nan')):.2f} | {r['ok']} |")
    return res


def variant_name(r, sep: str) -> str:
    """A row's variant for the table (sep ' ') and the plot's labels (sep newline): impl and launch shape."""
    return r["impl"] + (f"{sep}bp={r['block_pages']} w={r['num_warps']}" if r.get("block_pages") else "")


def plot(res: Results, path):
    plt = pyplot()
    rows = [r for r in res.rows if "us" in r]
    labels = [variant_name(r, "\n") for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows)), 4))
    ax.bar(range(len(rows)), [r["us"] for r in rows],
           color=["tab:blue" if r["kind"] == "scores" else "tab:orange" for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=90)
    ax.set_ylabel("us per call")
    s = res.extra["shapes"]
    ax.set_title(f"page scores (blue) and top-k (orange), B={s['B']} P={s['P']}, {res.meta['device']}", fontsize=9)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
