"""Quest page scores as a Pallas kernel: it reads only the page summaries (DESIGN.md section 2, step 2).

score[s, j, p] = sum_{kv head i of group j} kmax[s, l, j, p, i] . qpos[s, j, i] + kmin[s, l, j, p, i] . qneg[s, j, i]
where qpos / qneg are the sums over the group's query heads of relu(q) and min(q, 0) (see
`ulacache_jax.selection`: this is exactly the Quest bound summed over the heads). One program per
(sequence, group, block of pages); the layer is a static index into the full summary arrays, so no per-layer
slice of the summaries is materialised before the kernel reads it.
With split > 1 sub-page summaries per page (CacheConfig.summary_split; summaries [S, L, G, P * split, g, D], sub-page
p * split + h the h-th of page p), each sub-page gets the same bound and a page scores the max over its sub-pages:
score[s, j, p] = max_h bound(sub-page p * split + h). The kernel reads the summaries as the free row-major view
[S, L, G, P, split * g * D], so a block still covers whole pages and each program takes the max over `split`
static slices of its rows; split = 1 runs the per-page kernel unchanged.
Axis alphabet: S sequences, L layers, G groups, P pages, g kv heads per group, D head dim, p pages of a block.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from . import on_gpu, pick_impl


DEFAULT_WARPS = 8  # with 16-page blocks: the fastest launch shape (docs/BENCHMARKS.md, score launch sweep)


def _scores_kernel(kmin_ref, kmax_ref, qpos_ref, qneg_ref, out_ref):
    # kmin_ref, kmax_ref [p, g, D] (this sequence, layer, group, page block); qpos_ref, qneg_ref [g, D]; out_ref [p]
    p, g, d = kmin_ref.shape
    kmax = kmax_ref[...].astype(jnp.float32).reshape(p, g * d)
    kmin = kmin_ref[...].astype(jnp.float32).reshape(p, g * d)
    qpos = qpos_ref[...].reshape(1, g * d)
    qneg = qneg_ref[...].reshape(1, g * d)
    out_ref[...] = jnp.sum(kmax * qpos + kmin * qneg, axis=1)


def _split_scores_kernel(kmin_ref, kmax_ref, qpos_ref, qneg_ref, out_ref, *, split: int):
    # kmin_ref, kmax_ref [p, split * g * D] (this sequence, layer, group, page block: the page's sub-pages side by
    # side); qpos_ref, qneg_ref [g, D]; out_ref [p]: the max over sub-pages of each sub-page's bound
    p, w = kmin_ref.shape
    gd = w // split
    qpos = qpos_ref[...].reshape(1, gd)
    qneg = qneg_ref[...].reshape(1, gd)
    best = None
    for h in range(split):
        kmax = kmax_ref[:, pl.ds(h * gd, gd)].astype(jnp.float32)                  # [p, g * D]
        kmin = kmin_ref[:, pl.ds(h * gd, gd)].astype(jnp.float32)
        sc = jnp.sum(kmax * qpos + kmin * qneg, axis=1)                             # [p]
        best = sc if best is None else jnp.maximum(best, sc)
    out_ref[...] = best


def pad_page_count(num_pages: int, multiple: int = 128) -> int:
    """num_pages rounded up to a multiple of `multiple`, so the default score block (_block_pages) stays at 16
    pages: an odd-ish count such as 4098 would make 2-page blocks, 2049 programs per sequence and group."""
    return -(-num_pages // multiple) * multiple


def _block_pages(num_pages: int, cap: int = 16) -> int:
    """Largest power of two dividing num_pages, at most cap (Triton blocks are powers of two). cap 16 with 8
    warps is the fastest launch of scripts/bench_select.py's sweep; 128-page blocks spill registers (2 x 128 x 128
    fp32 values per program)."""
    b = 1
    while b * 2 <= cap and num_pages % (b * 2) == 0:
        b *= 2
    return b


def _check_split(num_summaries: int, split: int) -> int:
    """-> pages P of summaries [.., P * split, ..]; a split that is not a power of two dividing the count is refused."""
    if not (isinstance(split, int) and split >= 1 and split & (split - 1) == 0 and num_summaries % split == 0):
        raise ValueError(f"split = {split!r} must be a power of two >= 1 dividing the summary count {num_summaries}")
    return num_summaries // split


@functools.partial(jax.jit, static_argnames=("layer", "interpret", "block_pages", "num_warps", "split"))
def page_scores_pallas(kmin, kmax, qpos, qneg, *, layer: int, interpret: bool = False,
                       block_pages: int | None = None, num_warps: int | None = None, split: int = 1):
    """kmin, kmax [S, L, G, P * split, g, D]; qpos, qneg [S, G, g, D] float32 -> scores [S, G, P] float32 for
    `layer` (split > 1: the max over each page's sub-pages). block_pages (a power of two dividing P) and num_warps:
    launch shape (defaults: the largest block <= 16 dividing P, DEFAULT_WARPS warps; see _block_pages)."""
    S, L, G, PS, g, D = kmin.shape
    P = _check_split(PS, split)
    bp = block_pages or _block_pages(P)
    num_warps = num_warps or DEFAULT_WARPS
    if P % bp:
        raise ValueError(f"block_pages = {bp} must divide the page count {P}")
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = pltr.CompilerParams(num_warps=num_warps)
    qspec = pl.BlockSpec((None, None, g, D), lambda s, j, b: (s, j, 0, 0))
    if split > 1:
        view = (S, L, G, P, split * g * D)                                          # row-major: a free reshape
        summ = pl.BlockSpec((None, None, None, bp, split * g * D), lambda s, j, b: (s, layer, j, b, 0))
        return pl.pallas_call(
            functools.partial(_split_scores_kernel, split=split), grid=(S, G, P // bp), interpret=interpret,
            in_specs=[summ, summ, qspec, qspec],
            out_specs=pl.BlockSpec((None, None, bp), lambda s, j, b: (s, j, b)),
            out_shape=jax.ShapeDtypeStruct((S, G, P), jnp.float32),
            name="quest_page_scores_split", **kwargs)(kmin.reshape(view), kmax.reshape(view),
                                                      qpos.astype(jnp.float32), qneg.astype(jnp.float32))
    summ = pl.BlockSpec((None, None, None, bp, g, D), lambda s, j, b: (s, layer, j, b, 0, 0))
    return pl.pallas_call(
        _scores_kernel, grid=(S, G, P // bp), interpret=interpret,
        in_specs=[summ, summ, qspec, qspec],
        out_specs=pl.BlockSpec((None, None, bp), lambda s, j, b: (s, j, b)),
        out_shape=jax.ShapeDtypeStruct((S, G, P), jnp.float32),
        name="quest_page_scores", **kwargs)(kmin, kmax, qpos.astype(jnp.float32), qneg.astype(jnp.float32))


def ref_page_scores(kmin, kmax, qpos, qneg, *, layer: int, split: int = 1):
    """Plain jnp reference of `page_scores_pallas`: every sub-page's bound, then (split > 1) the max over each
    page's `split` sub-pages."""
    mx = kmax[:, layer].astype(jnp.float32)
    mn = kmin[:, layer].astype(jnp.float32)
    sc = jnp.einsum("sjpid,sjid->sjp", mx, qpos) + jnp.einsum("sjpid,sjid->sjp", mn, qneg)
    if split == 1:
        return sc
    S, G, PS = sc.shape
    return sc.reshape(S, G, _check_split(PS, split), split).max(axis=-1)


def page_scores(kmin, kmax, qpos, qneg, *, layer: int, impl: str = "auto", launch: tuple[int, int] | None = None,
                split: int = 1):
    """impl: 'auto' (kernel on GPU, reference elsewhere), 'pallas' (kernel; interpret mode off GPU) or 'ref'.
    launch: (block_pages, num_warps) for the kernel; None keeps page_scores_pallas's defaults. A block that does
    not divide the page count falls back to the default block (page counts differ between configs).
    split: sub-page summaries per page (CacheConfig.summary_split); kmin, kmax [S, L, G, P * split, g, D]."""
    if pick_impl(impl) == "ref":
        return ref_page_scores(kmin, kmax, qpos, qneg, layer=layer, split=split)
    bp, nw = launch or (None, None)
    if bp is not None and (kmin.shape[3] // split) % bp:
        bp = None
    return page_scores_pallas(kmin, kmax, qpos, qneg, layer=layer, interpret=not on_gpu(), block_pages=bp,
                              num_warps=nw, split=split)
