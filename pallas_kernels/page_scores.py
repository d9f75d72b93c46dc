"""Quest page scores as a Pallas kernel: it reads only the page summaries (DESIGN.md section 2, step 2).

score[s, j, p] = sum_{kv head i of group j} kmax[s, l, j, p, i] . qpos[s, j, i] + kmin[s, l, j, p, i] . qneg[s, j, i]
where qpos / qneg are the sums over the group's query heads of relu(q) and min(q, 0) (see
`ulacache_jax.selection`: this is exactly the Quest bound summed over the heads). One program per
(sequence, group, block of pages); the layer is a static index into the full summary arrays, so no per-layer
slice of the summaries is materialised before the kernel reads it.
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


@functools.partial(jax.jit, static_argnames=("layer", "interpret", "block_pages", "num_warps"))
def page_scores_pallas(kmin, kmax, qpos, qneg, *, layer: int, interpret: bool = False,
                       block_pages: int | None = None, num_warps: int | None = None):
    """kmin, kmax [S, L, G, P, g, D]; qpos, qneg [S, G, g, D] float32 -> scores [S, G, P] float32 for `layer`.
    block_pages (a power of two dividing P) and num_warps: launch shape (defaults: the largest block <= 16
    dividing P, DEFAULT_WARPS warps; see _block_pages)."""
    S, L, G, P, g, D = kmin.shape
    bp = block_pages or _block_pages(P)
    num_warps = num_warps or DEFAULT_WARPS
    if P % bp:
        raise ValueError(f"block_pages = {bp} must divide the page count {P}")
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = pltr.CompilerParams(num_warps=num_warps)
    summ = pl.BlockSpec((None, None, None, bp, g, D), lambda s, j, b: (s, layer, j, b, 0, 0))
    qspec = pl.BlockSpec((None, None, g, D), lambda s, j, b: (s, j, 0, 0))
    return pl.pallas_call(
        _scores_kernel, grid=(S, G, P // bp), interpret=interpret,
        in_specs=[summ, summ, qspec, qspec],
        out_specs=pl.BlockSpec((None, None, bp), lambda s, j, b: (s, j, b)),
        out_shape=jax.ShapeDtypeStruct((S, G, P), jnp.float32),
        name="quest_page_scores", **kwargs)(kmin, kmax, qpos.astype(jnp.float32), qneg.astype(jnp.float32))


def ref_page_scores(kmin, kmax, qpos, qneg, *, layer: int):
    """Plain jnp reference of `page_scores_pallas`."""
    mx = kmax[:, layer].astype(jnp.float32)
    mn = kmin[:, layer].astype(jnp.float32)
    return jnp.einsum("sjpid,sjid->sjp", mx, qpos) + jnp.einsum("sjpid,sjid->sjp", mn, qneg)


def page_scores(kmin, kmax, qpos, qneg, *, layer: int, impl: str = "auto", launch: tuple[int, int] | None = None):
    """impl: 'auto' (kernel on GPU, reference elsewhere), 'pallas' (kernel; interpret mode off GPU) or 'ref'.
    launch: (block_pages, num_warps) for the kernel; None keeps page_scores_pallas's defaults. A block that does
    not divide the page count falls back to the default block (page counts differ between configs)."""
    if pick_impl(impl) == "ref":
        return ref_page_scores(kmin, kmax, qpos, qneg, layer=layer)
    bp, nw = launch or (None, None)
    if bp is not None and kmin.shape[3] % bp:
        bp = None
    return page_scores_pallas(kmin, kmax, qpos, qneg, layer=layer, interpret=not on_gpu(), block_pages=bp,
                              num_warps=nw)
