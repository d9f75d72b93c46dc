"""The label rule's page scoring alone (pallas_kernels/page_lse.py, bits 4 / 8): the per-page log-sum-exp kernel at
several launch shapes beside its jnp reference, one layer of one decode step.

Shape (default: the Llama-8B decode of the labels rule): S=3 sequences x G=8 groups x g=1 KV head x H=4 query rows,
P=2048 pages of T=64 tokens (128K tokens), C=32 label channels (D/4, the frontier's pick) at 4 bits (Cs=16 code
bytes a token) or 8 bits; the codes array holds --layers layers so the kernel indexes a real layer, and so do the
scales [S, L, G, P, g, C] bf16. Variants: `ref` (ref_page_lse, XLA), `kernel` (one program a block of block_pages
pages, the default launch, at every --blocks x --warps; default block 1 at 1 warp, its own default) and `span`
(pages_per_program: one program loops over the blocks of a span of pages, at every --spans x --warps, block_pages
--span-block; none by default) and, at 4 bits, `mma` (label_lse_mma: the tensor-core kernel at every --mma-spans x
--mma-warps x --mma-stages). Every variant is checked before it is timed, against ref_page_lse (float32, rtol 1e-4,
atol 1e-3 on the lse; `mma` against ref_page_lse(f16_queries=True), its own arithmetic, recording its largest
relative error against the exact lse) on random inputs and on adversarial ones (a page of zero codes with zero
scales, a page of the extreme codes +-7 / +-127 at a large scale, one query row 100x the others); the reference
itself is checked against float64 numpy on the first (sequence, group). A variant that fails a check is recorded
with ok=false and not timed. Time = median over --reps of a chain of up to --calls calls, each call's queries
depending on the previous result (nothing hoisted but what does not depend on the queries: XLA may hoist the
reference's dequantisation), the calls unrolled in one jit (bench_meta.time_chain: no loop step between them, as
between a decode step's layers); the kernel's own time (kernel_us) from the profiler's GPU events beside it. Bytes = what one call must read: the layer's codes + bf16 scales + float32 queries;
GB/s and the fraction of the HBM read ceiling (read_ceiling, measured in the same run) follow from them.

Run (GPU): PYTHONPATH=. python3 -m scripts.bench_labels --out DIR [--bits 8] [--commit SHA]
           -> DIR/labels.json, DIR/labels.png (--bits 8 writes labels_8bit.*); or `bash scripts/bench_gpu.sh labels`.
Tiny (CPU, interpret mode, the tests): PYTHONPATH=. python3 -m scripts.bench_labels --tiny --out DIR
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import jax
import jax.numpy as jnp

from scripts.bench_meta import (Results, add_common_args, device_events, pyplot, read_ceiling, run_meta,
                                save_figure, time_chain)
from ulacache_jax.pallas_kernels import on_gpu
from ulacache_jax.pallas_kernels import page_lse as pk
from ulacache_jax.cache.select.labels import QMAX     # the labels' largest code magnitude

RTOL, ATOL = 1e-4, 1e-3
TINY = dict(batch=1, groups=2, rows=4, pages=16, page=16, channels=32, layers=2, calls=2, reps=2,
            blocks=[1, 4], warps=[4], spans=[4, 16], span_block=2, mma_spans=[8], mma_warps=[4], mma_stages=[2])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=3, help="S sequences")
    p.add_argument("--groups", type=int, default=8, help="G groups (KV heads / g)")
    p.add_argument("--kv-heads", type=int, default=1, help="g KV heads per group")
    p.add_argument("--rows", type=int, default=4, help="H query rows per KV head")
    p.add_argument("--pages", type=int, default=2048, help="P pages per sequence")
    p.add_argument("--page", type=int, default=64, help="T tokens per page")
    p.add_argument("--channels", type=int, default=32, help="C label channels")
    p.add_argument("--bits", type=int, default=4, choices=[4, 8])
    p.add_argument("--layers", type=int, default=2, help="layers in the codes array (the last is scored)")
    p.add_argument("--calls", type=int, default=16, help="most calls a timed chain")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--blocks", type=int, nargs="*", default=[1], help="block_pages of the kernel rows")
    p.add_argument("--warps", type=int, nargs="*", default=[1], help="num_warps of the kernel and span rows")
    p.add_argument("--spans", type=int, nargs="*", default=[],
                   help="pages_per_program of the span rows (those dividing P)")
    p.add_argument("--mma-spans", type=int, nargs="*", default=[16, 32, 64],
                   help="pages_per_program of the tensor-core rows (4-bit labels; label_lse_mma)")
    p.add_argument("--mma-warps", type=int, nargs="*", default=[1], help="num_warps of the tensor-core rows")
    p.add_argument("--mma-stages", type=int, nargs="*", default=[2, 3], help="num_stages of the tensor-core rows")
    p.add_argument("--span-block", type=int, default=0,
                   help="block_pages of the span rows; 0: the kernel's default (BLOCK_ELEMS)")
    p.add_argument("--tiny", action="store_true", help="small shapes for CPU interpret mode (the tests): "
                   + ", ".join(f"{k}={v}" for k, v in TINY.items()))
    return add_common_args(p, files="labels.json, labels.png (labels_8bit.* at --bits 8)")


def make_inputs(key, a, *, adversarial: bool):
    """Codes [S, L, G, P, T, g, Cs] (int8, or uint8 two 4-bit codes a byte stored + 8), scales [S, L, G, P, g, C] bf16
    (every layer's, as the cache passes them),
    queries [S, G, g, H, C] float32. Adversarial: page 0 zero codes and zero scales, page 1 the extreme codes
    (alternating sign by token) at scale 16, query row 0 of every KV head 100x the others."""
    S, L, G, P, T, g, C, H = a.batch, a.layers, a.groups, a.pages, a.page, a.kv_heads, a.channels, a.rows
    cs = C if a.bits == 8 else C // 2
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (S, L, G, P, T, g, cs)
    if a.bits == 8:
        codes = jax.random.randint(k1, shape, -127, 128, jnp.int32).astype(jnp.int8)
    else:
        codes = jax.random.randint(k1, shape, 0, 256, jnp.int32).astype(jnp.uint8)
    scale = jax.random.uniform(k2, (S, L, G, P, g, C), jnp.float32, 0.0, 0.3)
    q = jax.random.normal(k3, (S, G, g, H, C), jnp.float32)
    if not adversarial:
        return codes, scale.astype(jnp.bfloat16), q
    top = QMAX[a.bits]
    if a.bits == 8:
        zero, hi, lo = 0, top, -top
    else:
        zero, hi, lo = 8 | 8 << 4, (top + 8) | (top + 8) << 4, (8 - top) | (8 - top) << 4
    sign = (jnp.arange(T) % 2)[:, None, None]                                          # [T, 1, 1]
    codes = codes.at[:, :, :, 0].set(zero)
    codes = codes.at[:, :, :, 1].set(jnp.where(sign, hi, lo).astype(codes.dtype))
    scale = scale.at[:, :, :, 0].set(0.0).at[:, :, :, 1].set(16.0)
    q = q.at[:, :, :, 0].multiply(100.0)
    return codes, scale.astype(jnp.bfloat16), q


def numpy_lse(codes, scale, q, layer: int, bits: int):
    """float64 page lse of the first (sequence, group): [g * H, P], the reference's own check."""
    c = np.asarray(codes[0, layer, 0])                                                 # [P, T, g, Cs]
    if bits == 8:
        v = c.astype(np.float64)
    else:
        b = c.astype(np.int64)
        v = np.concatenate([(b & 15) - 8, (b >> 4) - 8], axis=-1).astype(np.float64)   # [P, T, g, C]
    k = v * np.asarray(scale[0, layer, 0], np.float64)[:, None]                        # [P, T, g, C]
    logit = np.einsum("ptic,ihc->ihpt", k, np.asarray(q[0, 0], np.float64))           # [g, H, P, T]
    m = logit.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logit - m).sum(-1, keepdims=True)))[..., 0]               # [g, H, P]
    return lse.reshape(-1, lse.shape[-1])


def variants(a) -> list[dict]:
    """The rows to run: the reference, the kernel at every valid (block_pages, num_warps), the span launch at every
    valid (pages_per_program, num_warps). Invalid launch shapes (not dividing P) are left out, not failed."""
    P = a.pages
    rows = [dict(impl="ref")]
    rows += [dict(impl="kernel", block_pages=bp, num_warps=w) for bp in a.blocks for w in a.warps
             if P % bp == 0 and bp & (bp - 1) == 0]
    sb = a.span_block or pk.default_block_pages(P, a.page, a.channels)
    rows += [dict(impl="span", block_pages=sb, pages_per_program=sp, num_warps=w) for sp in a.spans
             for w in a.warps if sp % sb == 0 and P % sp == 0]
    if a.bits == 4 and min(a.page, a.channels // 2) >= pk.MMA_MIN:
        pd = pk.mma_shape(a.rows)[1]
        rows += [dict(impl="mma", pages_per_program=sp, num_warps=w, num_stages=st) for sp in a.mma_spans
                 for w in a.mma_warps for st in a.mma_stages if sp % pd == 0 and P % sp == 0]
    return rows


def score_fn(v: dict, a, layer: int):
    """f(codes, scale, q) -> lse [S, G, g * H, P] of the variant."""
    if v["impl"] == "ref":
        return jax.jit(lambda c, s, q: pk.ref_page_lse(c, q, layer=layer, scale=s, bits=a.bits))
    if v["impl"] == "mma":
        return lambda c, s, q: pk.label_lse_mma(
            c, q, layer=layer, scale=s, interpret=not on_gpu(), pages_per_program=v["pages_per_program"],
            num_warps=v["num_warps"], num_stages=v["num_stages"])
    return lambda c, s, q: pk.page_lse_pallas(
        c, q, layer=layer, interpret=not on_gpu(), scale=s, bits=a.bits, block_pages=v["block_pages"],
        num_warps=v["num_warps"], pages_per_program=v.get("pages_per_program"))


def check(f, inputs, wants) -> dict:
    """Max errors of f against the reference outputs on every input set, and whether all are within tolerance."""
    out = dict(ok=True, max_abs_err=0.0, max_rel_err=0.0)
    for (codes, scale, q), want in zip(inputs, wants):
        got = np.asarray(f(codes, scale, q))
        err = np.abs(got - want)
        out["max_abs_err"] = max(out["max_abs_err"], float(np.nanmax(err)) if np.isfinite(got).all() else np.inf)
        out["max_rel_err"] = max(out["max_rel_err"], float(np.max(err / np.maximum(np.abs(want), 1e-30))))
        out["ok"] &= bool(got.shape == want.shape and np.allclose(got, want, rtol=RTOL, atol=ATOL))
    return out


def bytes_read(a) -> int:
    """What one call must read: one layer's codes, its bf16 scales and the float32 queries."""
    S, G, P, T, g, C, H = a.batch, a.groups, a.pages, a.page, a.kv_heads, a.channels, a.rows
    cs = C if a.bits == 8 else C // 2
    return S * G * P * T * g * cs + S * G * P * g * C * 2 + S * G * g * H * C * 4


def run_variant(v: dict, a, layer: int, inputs, wants, nbytes: int, ceiling: float) -> dict:
    row = dict(v)
    try:
        f = score_fn(v, a, layer)
        if v["impl"] == "ref":        # the reference against float64 numpy on (sequence 0, group 0)
            row.update(check(lambda c, s, q: f(c, s, q)[0, 0], inputs,
                             [numpy_lse(c, s, q, layer, a.bits) for c, s, q in inputs]))
        elif v["impl"] != "mma":
            row.update(check(f, inputs, wants))
        else:                         # 11-bit queries: checked against their own arithmetic's reference
            ref16 = jax.jit(lambda c, s, q: pk.ref_page_lse(c, q, layer=layer, scale=s, bits=a.bits,
                                                            f16_queries=True))
            row.update(check(f, inputs, [np.asarray(ref16(*x)) for x in inputs]))
            row["max_rel_err_vs_exact"] = max(float(np.max(np.abs(np.asarray(f(*x)) - w) /
                                                           np.maximum(np.abs(w), 1e-30)))
                                              for x, w in zip(inputs, wants))
        if not row["ok"]:
            return row
        codes, scale, q = inputs[0]
        sec, _ = time_chain(lambda c, x: c + jnp.sum(f(codes, scale, x + c * 1e-30)) * 1e-30, jnp.float32(0), q,
                            reps=a.reps, max_n=a.calls)
        row.update(us=sec * 1e6, bytes=nbytes, gb_s=nbytes / sec / 1e9, fraction_of_read=nbytes / sec / ceiling)
        row.update(kernel_time(f, codes, scale, q, nbytes, ceiling))
    except Exception as e:  # one launch shape failing to compile must not lose the others
        row.update(ok=False, error=repr(e)[:300])
    return row


def kernel_time(f, codes, scale, q, nbytes: int, ceiling: float) -> dict:
    """The Pallas kernel's own GPU time per call (the profiler's events named like the kernel: `label` or
    `key_copy`), apart from the call's glue (the query matrices, the output's layout): kernel_us and its fraction
    of the read ceiling; {} where the profiler gives no GPU events (CPU)."""
    g = jax.jit(f)
    jax.block_until_ready(g(codes, scale, q))
    dt = device_events(lambda: g(codes, scale, q), reps=5)
    ns = sum(t for name, t in (dt.by_name.items() if dt else ()) if "label" in name or "key_copy" in name)
    if not ns:
        return {}
    return dict(kernel_us=ns / 1e3, kernel_fraction_of_read=nbytes / (ns * 1e-9) / ceiling,
                call_events=dt.events)


def main(argv=None):
    a = build_parser().parse_args(argv)
    if a.tiny:
        for k, v in TINY.items():
            setattr(a, k, v)
    layer = a.layers - 1
    gpu = on_gpu()
    name = "labels" if a.bits == 4 else f"labels_{a.bits}bit"
    inputs = [make_inputs(jax.random.key(i), a, adversarial=adv) for i, adv in enumerate((False, True))]
    ref = jax.jit(lambda c, s, q: pk.ref_page_lse(c, q, layer=layer, scale=s, bits=a.bits))
    wants = [np.asarray(ref(*x)) for x in inputs]
    print(f"reference ready: lse {wants[0].shape}", flush=True)
    ceiling = read_ceiling(1 << 30 if gpu else 1 << 24)
    nbytes = bytes_read(a)
    shapes = dict(S=a.batch, G=a.groups, g=a.kv_heads, H=a.rows, P=a.pages, T=a.page, C=a.channels, bits=a.bits,
                  L=a.layers, layer=layer,
                  default_block_pages=pk.default_block_pages(a.pages, a.page, a.channels))
    res = Results(os.path.join(a.out, f"{name}.json"), run_meta(a.commit, interpret=not gpu), shapes=shapes,
                  bytes_per_call=nbytes, read_tb_s=ceiling / 1e12, rtol=RTOL, atol=ATOL)
    for v in variants(a):
        row = run_variant(v, a, layer, inputs, wants, nbytes, ceiling)
        if "pages_per_program" in row or "block_pages" in row:
            row["programs"] = a.batch * a.groups * a.pages // (row.get("pages_per_program") or row["block_pages"])
        res.add(row)
        print(json.dumps(row), flush=True)
    plot(res, os.path.join(a.out, f"{name}.png"))
    print_table(res, nbytes, ceiling)
    return res


def variant_name(r: dict, sep: str = " ") -> str:
    """A row's variant for the table (sep ' ') and the plot (sep newline): impl and launch shape."""
    if r["impl"] == "ref":
        return "ref"
    span = f"{sep}span={r['pages_per_program']}" if "pages_per_program" in r else ""
    if "num_stages" in r:       # the tensor-core kernel (and its deleted candidates in committed results)
        extra = (f" d={r['dots_per_step']}" if r.get("dots_per_step", 1) != 1 else "") + \
            (" hoist" if r.get("hoist_queries") else "")
        return f"{r['impl']}{span}{sep}w={r['num_warps']} st={r['num_stages']}{extra}"
    return f"{r['impl']}{span}{sep}bp={r['block_pages']} w={r['num_warps']}"


def plot(res: Results, path: str):
    """Bars of the fraction of the read ceiling per timed variant (kernel blue, span green, ref grey; rows of
    variants since deleted, kept in a committed result, orange)."""
    plt = pyplot()
    rows = [r for r in res.rows if "us" in r]
    color = dict(ref="tab:gray", kernel="tab:blue", span="tab:green", mma="tab:red")
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(rows)), 4))
    ax.bar(range(len(rows)), [r["fraction_of_read"] for r in rows],
           color=[color.get(r["impl"], "tab:orange") for r in rows])
    for i, r in enumerate(rows):
        ax.text(i, r["fraction_of_read"], f"{r['us']:.0f}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(rows)), [("" if "run" not in r else f"{r['run']} ") + variant_name(r, "\n")
                                     for r in rows], fontsize=6, rotation=90)
    ax.set_ylabel("fraction of HBM read ceiling (labels: us a call)")
    s = res.extra["shapes"]
    merged = any("run" in r for r in rows)          # a committed result of several runs: C and device per run
    ax.set_title(f"label page-lse, {s['bits']}-bit, S={s['S']} G={s['G']} H={s['H']} P={s['P']} T={s['T']} "
                 + ("(C and device per run: labels.json)" if merged else f"C={s['C']}, {res.meta['device']}"),
                 fontsize=8)
    save_figure(fig, path)


def print_table(res: Results, nbytes: int, ceiling: float):
    print(f"\n{res.extra['shapes']}: {nbytes / 1e6:.2f} MB a call, read ceiling {ceiling / 1e12:.2f} TB/s")
    print("| variant | programs | us | GB/s | of read | kernel us | kernel of read | check |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in res.rows:
        v, n = variant_name(r), r.get("programs", "")
        if "us" in r:
            k = (f"{r['kernel_us']:.1f} | {r['kernel_fraction_of_read']:.2f}" if "kernel_us" in r else "- | -")
            print(f"| {v} | {n} | {r['us']:.1f} | {r['gb_s']:.1f} | {r['fraction_of_read']:.2f} | {k} | ok |")
        else:
            print(f"| {v} | {n} | - | - | - | - | - | FAILED {r.get('error', '')[:80] or 'max abs err %.3g' % r['max_abs_err']} |")


if __name__ == "__main__":
    main()
