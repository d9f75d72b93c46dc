"""Page selection as one Pallas kernel: candidate masking + a radix top-k per row, winners in page order.

XLA's top-k over one layer's page scores costs as much as the sieve and the vTLB update together (docs/
BENCHMARKS.md, layer stages), and the masking before it (sink / recent pages forced, unflushed pages out, padding)
and the ordering after it were XLA ops of their own. Here one program owns one (sequence, group) row:
1. `candidate_scores`: NaN -> 0, +-inf clamped to +-3e38, the first `sink` and last `recent` flushed pages -> +inf,
   pages at or past `flushed` (and the padding) -> -inf; the reference runs the same function;
2. each score becomes an order-preserving uint32 key (sign flip; -0.0 is folded into +0.0 first, so equal floats
   get equal keys);
3. the k-th largest key T is found bit by bit from the top (32 passes of a count over the row, in registers);
4. the selected set is every key > T plus the lowest-index keys == T up to k (the same tie rule as `lax.top_k`),
   compacted by a prefix sum and stored in page order: page ids, -1 where a winner is not a candidate (-inf: the
   row has fewer than k flushed pages).
Why page order and not score order: nothing downstream needs the scores' order (attention sums over the pages; the
sieve serves a bucket's misses in order of appearance, which decides only who is cached when a bucket overflows),
and sorting the k winners by score was three more XLA ops a layer. The reference `ref_select_pages` is `lax.top_k`
over the same candidate scores, its winners sorted by page: the kernel's result exactly.
Axis alphabet: R rows, P pages (Pp: the row padded to a power of two; the load masks the padding), k winners (kp:
padded to a power of two; stores past k are masked).
A row lives in one program's registers: which row lengths the decode sends here (and which to `lax.top_k`) is
decided by ulacache_jax/cache/kernel_choice.py.
"""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import next_pow2, on_gpu, pick_impl

BIG = np.float32(3e38)   # finite stand-in for +-inf scores, so forced pages (+inf) and non-candidates (-inf) stay apart


def candidate_scores(x, p, flushed, num_pages: int, *, sink: int, recent: int):
    """x [..., N] float32 scores of pages p [N] int32 (N >= num_pages; lanes p >= num_pages are padding); flushed
    [..., 1] int32 -> [..., N] float32: what the top-k ranks. Shared by the kernel and the reference, so both rank
    bit-identical values. Comparisons only (no `nan_to_num`): the same ops lower in Triton and XLA."""
    s = jnp.where(x != x, np.float32(0), x)                                  # NaN -> 0
    s = jnp.where(s == np.inf, BIG, jnp.where(s == -np.inf, -BIG, s))       # +-inf -> +-3e38
    keep = (p < sink) | (p >= flushed - recent)
    s = jnp.where(keep, np.float32(np.inf), s)
    return jnp.where((p < flushed) & (p < num_pages), s, np.float32(-np.inf))


def _sort_keys(x):
    """float32 -> uint32 whose unsigned order is the float order (-inf lowest, +inf highest; -0.0 == +0.0)."""
    # -0.0 -> +0.0 by a select: `x + 0.0` did it compiled, but XLA simplified it away in interpret mode
    bits = lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    neg = (bits >> np.uint32(31)) == np.uint32(1)
    return jnp.where(neg, ~bits, bits | np.uint32(0x80000000))


def _select_kernel(s_ref, fl_ref, i_ref, *, k: int, kp: int, pp: int, n: int, sink: int, recent: int):
    # s_ref [Pp] float32 (one row; lanes >= n are masked loads: undefined, then -inf); fl_ref [] int32 (the row's
    # flushed pages); i_ref [kp] int32: the k winners' page ids in page order, -1 for a non-candidate
    idx = jnp.arange(pp, dtype=jnp.int32)
    x = candidate_scores(s_ref[...], idx, fl_ref[...], n, sink=sink, recent=recent)
    key = _sort_keys(x)

    def bit(b, t):  # the largest t with count(key >= t) >= k, built from the top bit down
        cand = t | (np.uint32(1) << (np.uint32(31) - b.astype(jnp.uint32)))
        return jnp.where(jnp.sum((key >= cand).astype(jnp.int32)) >= k, cand, t)

    t = lax.fori_loop(0, 32, bit, jnp.uint32(0))
    gt = key > t
    eq = (key == t).astype(jnp.int32)
    need = k - jnp.sum(gt.astype(jnp.int32))                       # ties to take, lowest index first
    sel = gt | ((eq == 1) & (jnp.cumsum(eq) - eq < need))
    si = sel.astype(jnp.int32)
    pos = jnp.where(sel, jnp.cumsum(si) - si, kp)                  # masked lanes point past the end
    plgpu.store(i_ref.at[pos], jnp.where(x > -np.inf, idx, -1), mask=sel)


def _check(s, flushed, k: int, sink: int, recent: int, groups: int):
    """The arguments both `select_pages_pallas` and `ref_select_pages` take, refused the same way by both."""
    r, p = s.shape
    if flushed.shape != (r // groups,) or r % groups:
        raise ValueError(f"flushed has shape {flushed.shape}: it must be [{r} rows // groups = {groups}]")
    if not 1 <= k <= p:
        raise ValueError(f"k = {k} must be in [1, {p}] (the pages of a row)")
    if sink < 0 or recent < 0:
        raise ValueError(f"sink = {sink} and recent = {recent} must be >= 0")


@functools.partial(jax.jit, static_argnames=("k", "sink", "recent", "groups", "interpret", "num_warps"))
def select_pages_pallas(s, flushed, k: int, *, sink: int = 0, recent: int = 0, groups: int = 1,
                        interpret: bool = False, num_warps: int | None = None):
    """s [R, P] float32 scores; flushed [R // groups] int32 candidate pages, one value for each `groups` consecutive
    rows (a sequence's KV-head groups share it; read in place, not broadcast) -> [R, k] int32 page ids in page
    order, -1 where the row has fewer than k candidates: exactly `ref_select_pages`."""
    r, p = s.shape
    _check(s, flushed, k, sink, recent, groups)
    pp, kp = next_pow2(p), next_pow2(k)
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps or (8 if pp >= 4096 else 4),
                                                         num_stages=1)
    # a block wider than the row (pp > p) or than the output (kp > k): Pallas masks the loads and stores past the
    # array (interpret mode pads), so no XLA pad or slice runs around the kernel
    return pl.pallas_call(
        functools.partial(_select_kernel, k=k, kp=kp, pp=pp, n=p, sink=sink, recent=recent), grid=(r,),
        interpret=interpret,
        in_specs=[pl.BlockSpec((None, pp), lambda i: (i, 0)), pl.BlockSpec((None,), lambda i: (i // groups,))],
        out_specs=pl.BlockSpec((None, kp), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((r, k), jnp.int32), name="page_top_k", **kwargs,
    )(s.astype(jnp.float32), flushed.astype(jnp.int32))


def ref_select_pages(s, flushed, k: int, *, sink: int = 0, recent: int = 0, groups: int = 1):
    """The reference: `lax.top_k` (XLA's) over `candidate_scores` with -0.0 folded into +0.0 (equal scores tie,
    lowest page first; XLA's top-k alone ranks +0.0 above -0.0), the winners sorted by page. Arguments as
    `select_pages_pallas`."""
    r, p = s.shape
    _check(s, flushed, k, sink, recent, groups)
    fl = jnp.repeat(flushed.astype(jnp.int32), groups)[:, None]                      # [R, 1]
    x = candidate_scores(s.astype(jnp.float32), jnp.arange(p, dtype=jnp.int32), fl, p, sink=sink, recent=recent)
    v, i = lax.top_k(jnp.where(x == 0, jnp.float32(0), x), k)   # a select, not `+ 0.0`, which XLA may simplify away
    i, v = lax.sort((i.astype(jnp.int32), v), dimension=1, num_keys=1)
    return jnp.where(v > -jnp.inf, i, -1)


def select_top_pages(s, flushed, k: int, *, sink: int = 0, recent: int = 0, impl: str = "ref"):
    """s [B, G, P] scores; flushed [B] int32 -> [B, G, k] int32 (see the module docstring). impl: 'ref'
    (lax.top_k), 'pallas' (the kernel; interpret mode off GPU) or 'auto' (the kernel on GPU, lax.top_k
    elsewhere)."""
    B, G, p = s.shape
    fn = ref_select_pages if pick_impl(impl) == "ref" else functools.partial(select_pages_pallas,
                                                                               interpret=not on_gpu())
    return fn(s.reshape(B * G, p), flushed, k, sink=sink, recent=recent, groups=G).reshape(B, G, k)
