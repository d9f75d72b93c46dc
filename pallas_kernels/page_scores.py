"""Quest page scores as a Pallas kernel: it reads only the page summaries (DESIGN.md section 2, step 2).

score[s, j, p] = sum_{kv head i of group j} kmax[s, l, j, p, i] . qpos[s, j, i] + kmin[s, l, j, p, i] . qneg[s, j, i]
where qpos / qneg are the sums over the group's query heads of relu(q) and min(q, 0) (see
`ulacache_jax.cache.select.quest`: this is exactly the Quest bound summed over the heads). One program per
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


def _query_sums(q_refs, g: int, fold: int):
    """The group's query sums as [1, g * D] float32 rows (qpos, qneg). fold = 0: q_refs = (qpos_ref, qneg_ref) [g, D],
    folded before the kernel; fold = r: q_refs = (q_ref,) [Q, g * r, D], this sequence's query rows of the group's
    g * r query heads, folded here (relu / min(., 0) summed over rows and each kv head's r heads, as
    `fold_queries`), which saves the decode the XLA reductions before the launch."""
    if not fold:
        qpos_ref, qneg_ref = q_refs
        d = qpos_ref.shape[-1]
        return qpos_ref[...].reshape(1, g * d), qneg_ref[...].reshape(1, g * d)
    (q_ref,) = q_refs
    nq, _, d = q_ref.shape
    x = q_ref[...].astype(jnp.float32).reshape(nq, g, fold, d)
    qpos = jnp.sum(jnp.sum(jnp.maximum(x, 0.0), axis=2), axis=0)                        # [g, D]
    qneg = jnp.sum(jnp.sum(jnp.minimum(x, 0.0), axis=2), axis=0)
    return qpos.reshape(1, g * d), qneg.reshape(1, g * d)


def _scores_kernel(kmin_ref, kmax_ref, *refs, fold: int):
    # kmin_ref, kmax_ref [p, g, D] (this sequence, layer, group, page block); refs: the query refs
    # (`_query_sums`), then out_ref [p]
    *q_refs, out_ref = refs
    p, g, d = kmin_ref.shape
    kmax = kmax_ref[...].astype(jnp.float32).reshape(p, g * d)
    kmin = kmin_ref[...].astype(jnp.float32).reshape(p, g * d)
    qpos, qneg = _query_sums(q_refs, g, fold)
    out_ref[...] = jnp.sum(kmax * qpos + kmin * qneg, axis=1)


def _split_scores_kernel(kmin_ref, kmax_ref, *refs, split: int, g: int, fold: int):
    # kmin_ref, kmax_ref [p, split * g * D] (this sequence, layer, group, page block: the page's sub-pages side by
    # side); refs: the query refs (`_query_sums`), then out_ref [p]: the max over sub-pages of each sub-page's bound
    *q_refs, out_ref = refs
    p, w = kmin_ref.shape
    gd = w // split
    qpos, qneg = _query_sums(q_refs, g, fold)
    best = None
    for h in range(split):
        kmax = kmax_ref[:, pl.ds(h * gd, gd)].astype(jnp.float32)                  # [p, g * D]
        kmin = kmin_ref[:, pl.ds(h * gd, gd)].astype(jnp.float32)
        sc = jnp.sum(kmax * qpos + kmin * qneg, axis=1)                             # [p]
        best = sc if best is None else jnp.maximum(best, sc)
    out_ref[...] = best


def folds_in_kernel(q_shape: tuple[int, ...], groups: int, kv_heads_per_group: int) -> bool:
    """Whether `page_scores_pallas` can fold queries q [S, Q, H, D] itself: its block of one group's query heads
    ([Q, H / groups, D]) and the kv heads' split of it must be powers of two (Triton blocks)."""
    _, nq, h, d = q_shape
    hpg = h // groups
    r = hpg // kv_heads_per_group
    pow2 = lambda n: n >= 1 and n & (n - 1) == 0
    return h % groups == 0 and hpg % kv_heads_per_group == 0 and all(pow2(n) for n in (nq, hpg, r, d))


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
def page_scores_pallas(kmin, kmax, qpos=None, qneg=None, *, q=None, layer: int, interpret: bool = False,
                       block_pages: int | None = None, num_warps: int | None = None, split: int = 1):
    """kmin, kmax [S, L, G, P * split, g, D]; qpos, qneg [S, G, g, D] float32 (the folded queries) or, instead, q
    [S, Q, H, D] (folded inside the kernel; `folds_in_kernel` must hold) -> scores [S, G, P] float32 for `layer`
    (split > 1: the max over each page's sub-pages). block_pages (a power of two dividing P) and num_warps: launch
    shape (defaults: the largest block <= 16 dividing P, DEFAULT_WARPS warps; see _block_pages)."""
    S, L, G, PS, g, D = kmin.shape
    P = _check_split(PS, split)
    bp = block_pages or _block_pages(P)
    num_warps = num_warps or DEFAULT_WARPS
    if P % bp:
        raise ValueError(f"block_pages = {bp} must divide the page count {P}")
    if (q is None) == (qpos is None or qneg is None):
        raise ValueError("give either the folded queries (qpos, qneg) or q, not both or neither")
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = pltr.CompilerParams(num_warps=num_warps)
    if q is None:
        fold, queries = 0, (qpos.astype(jnp.float32), qneg.astype(jnp.float32))
        qspecs = [pl.BlockSpec((None, None, g, D), lambda s, j, b: (s, j, 0, 0))] * 2
    else:
        if not folds_in_kernel(q.shape, G, g):
            raise ValueError(f"q of shape {q.shape} cannot be folded in the kernel for {G} groups of {g} kv heads "
                             "(a group's query heads and rows must be powers of two): pass qpos, qneg")
        nq, hpg = q.shape[1], q.shape[2] // G
        fold, queries = hpg // g, (q,)
        qspecs = [pl.BlockSpec((None, nq, hpg, D), lambda s, j, b: (s, 0, j, 0))]
    out_spec = pl.BlockSpec((None, None, bp), lambda s, j, b: (s, j, b))
    out_shape = jax.ShapeDtypeStruct((S, G, P), jnp.float32)
    if split > 1:
        view = (S, L, G, P, split * g * D)                                          # row-major: a free reshape
        summ = pl.BlockSpec((None, None, None, bp, split * g * D), lambda s, j, b: (s, layer, j, b, 0))
        return pl.pallas_call(
            functools.partial(_split_scores_kernel, split=split, g=g, fold=fold), grid=(S, G, P // bp),
            interpret=interpret, in_specs=[summ, summ, *qspecs], out_specs=out_spec, out_shape=out_shape,
            name="quest_page_scores_split", **kwargs)(kmin.reshape(view), kmax.reshape(view), *queries)
    summ = pl.BlockSpec((None, None, None, bp, g, D), lambda s, j, b: (s, layer, j, b, 0, 0))
    return pl.pallas_call(
        functools.partial(_scores_kernel, fold=fold), grid=(S, G, P // bp), interpret=interpret,
        in_specs=[summ, summ, *qspecs], out_specs=out_spec, out_shape=out_shape,
        name="quest_page_scores", **kwargs)(kmin, kmax, *queries)


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


def fold_queries(q, num_groups: int, kv_heads_per_group: int):
    """q [B, Q, H, D] -> (qpos, qneg) [B, G, g, D] fp32: sums over query positions and the query heads of each KV
    head of relu(q) and min(q, 0) (the folded queries the kernel and the reference score with)."""
    B, Q, H, D = q.shape
    kv = num_groups * kv_heads_per_group
    qf = q.astype(jnp.float32).reshape(B, Q, num_groups, kv_heads_per_group, H // kv, D)
    return jnp.maximum(qf, 0).sum(axis=(1, 4)), jnp.minimum(qf, 0).sum(axis=(1, 4))


def page_scores(kmin, kmax, q, *, layer: int, impl: str = "auto", launch: tuple[int, int] | None = None,
                split: int = 1):
    """kmin, kmax [S, L, G, P * split, g, D]; q [S, Q, H, D] -> scores [S, G, P] float32 of `layer`.
    impl: 'auto' (kernel on GPU, reference elsewhere), 'pallas' (kernel; interpret mode off GPU) or 'ref'. The
    kernel folds the queries itself where `folds_in_kernel` holds (one launch, no XLA reductions before it), else
    they are folded first (`fold_queries`). launch: (block_pages, num_warps) for the kernel; None keeps
    page_scores_pallas's defaults. A block that does not divide the page count falls back to the default block
    (page counts differ between configs). split: sub-page summaries per page (CacheConfig.summary_split)."""
    G, g = kmin.shape[2], kmin.shape[4]
    if pick_impl(impl) == "ref":
        return ref_page_scores(kmin, kmax, *fold_queries(q, G, g), layer=layer, split=split)
    bp, nw = launch or (None, None)
    if bp is not None and (kmin.shape[3] // split) % bp:
        bp = None
    kw = dict(layer=layer, interpret=not on_gpu(), block_pages=bp, num_warps=nw, split=split)
    if folds_in_kernel(q.shape, G, g):
        return page_scores_pallas(kmin, kmax, q=q, **kw)
    return page_scores_pallas(kmin, kmax, *fold_queries(q, G, g), **kw)
