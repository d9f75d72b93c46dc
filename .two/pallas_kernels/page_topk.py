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
decided by ulacache_jax/kernel_choice.py.
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


def _winners(key, k: int):
    """key [N] uint32 -> sel [N] bool, exactly k lanes (k <= N): every key above the k-th largest key T, then the
    lowest-index keys equal to T (lax.top_k's tie rule). T is found bit by bit from the top: 32 passes of a count."""
    def bit(b, t):  # the largest t with count(key >= t) >= k, built from the top bit down
        cand = t | (np.uint32(1) << (np.uint32(31) - b.astype(jnp.uint32)))
        return jnp.where(jnp.sum((key >= cand).astype(jnp.int32)) >= k, cand, t)

    t = lax.fori_loop(0, 32, bit, jnp.uint32(0))
    gt = key > t
    eq = (key == t).astype(jnp.int32)
    need = k - jnp.sum(gt.astype(jnp.int32))                       # ties to take, lowest index first
    return gt | ((eq == 1) & (jnp.cumsum(eq) - eq < need))


def _page_winners(s, idx, flushed, n: int, k: int, end: int, *, sink: int, recent: int):
    """s [W] float32 loaded scores of pages idx [W] (lanes idx >= n: masked loads, undefined) -> (x candidate
    scores, sel the k winners, pos each winner's output slot in page order, `end` for the other lanes)."""
    x = candidate_scores(s, idx, flushed, n, sink=sink, recent=recent)
    sel = _winners(_sort_keys(x), k)
    si = sel.astype(jnp.int32)
    return x, sel, jnp.where(sel, jnp.cumsum(si) - si, end)


def _launch(width: int, num_warps: int | None, interpret: bool) -> dict:
    """pallas_call kwargs of a kernel whose program holds `width` scores: 8 warps from 4096 lanes, else 4."""
    if interpret:
        return {}
    return dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps or (8 if width >= 4096 else 4),
                                                     num_stages=1))


def _select_kernel(s_ref, fl_ref, i_ref, *, k: int, kp: int, pp: int, n: int, sink: int, recent: int):
    # s_ref [Pp] float32 (one row; lanes >= n are masked loads: undefined, then -inf); fl_ref [] int32 (the row's
    # flushed pages); i_ref [kp] int32: the k winners' page ids in page order, -1 for a non-candidate
    idx = jnp.arange(pp, dtype=jnp.int32)
    x, sel, pos = _page_winners(s_ref[...], idx, fl_ref[...], n, k, kp, sink=sink, recent=recent)
    plgpu.store(i_ref.at[pos], jnp.where(x > -np.inf, idx, -1), mask=sel)   # masked lanes point past the end


# ---- two stages: a row split into chunks over many programs, then one program per row over the chunks' winners --
# Exact: a page among the row's k winners is among its chunk's k winners (fewer pages beat it inside its chunk than
# in the row), so the row's winners are the k winners of the union, and the union, laid out chunk after chunk with
# each chunk's winners in page order, is in page order: the lowest-index tie rule picks the same pages.
def _chunk_kernel(s_ref, fl_ref, xs_ref, is_ref, *, k1: int, w: int, n: int, sink: int, recent: int):
    # s_ref [W] float32 (row i's pages c*W .. c*W + W - 1; lanes past n masked); fl_ref [] int32; xs_ref, is_ref
    # [k1]: the chunk's k1 winners' candidate scores and page ids in page order (k1 <= W: every slot written)
    idx = pl.program_id(1) * w + jnp.arange(w, dtype=jnp.int32)
    x, sel, pos = _page_winners(s_ref[...], idx, fl_ref[...], n, k1, k1, sink=sink, recent=recent)
    plgpu.store(xs_ref.at[pos], x, mask=sel)
    plgpu.store(is_ref.at[pos], idx, mask=sel)


def _merge_kernel(xs_ref, is_ref, i_ref, *, k: int, kp: int, m: int, mp: int):
    # xs_ref, is_ref [Mp] (one row's M chunk winners, in page order; lanes past m masked: -inf); i_ref [kp]: the k
    # winners' page ids in page order, then -1 for winners that are not candidates (as `_select_kernel`: the
    # non-candidates of a row are its pages past `flushed`, all after its candidates)
    lane = jnp.arange(mp, dtype=jnp.int32)
    x = jnp.where(lane < m, xs_ref[...], np.float32(-np.inf))
    sel = _winners(_sort_keys(x), k)
    real = sel & (x > -np.inf)
    fill = sel & ~real
    ri, fi = real.astype(jnp.int32), fill.astype(jnp.int32)
    pos = jnp.where(real, jnp.cumsum(ri) - ri, jnp.where(fill, jnp.sum(ri) + jnp.cumsum(fi) - fi, kp))
    plgpu.store(i_ref.at[pos], jnp.where(real, is_ref[...], -1), mask=sel)


def _two_stage(s, flushed, k: int, *, sink: int, recent: int, groups: int, w: int, interpret: bool,
               num_warps: int | None):
    """`select_pages_pallas` as a chunk stage (grid rows x chunks of w pages, w a power of two) and a merge stage
    (grid rows)."""
    r, p = s.shape
    nc = -(-p // w)                                                  # chunks that hold pages
    k1 = min(next_pow2(k), w)                                        # a power of two: the output blocks tile
    m = nc * k1
    mp, kp = next_pow2(m), next_pow2(k)
    xs, ids = pl.pallas_call(
        functools.partial(_chunk_kernel, k1=k1, w=w, n=p, sink=sink, recent=recent), grid=(r, nc),
        interpret=interpret,
        in_specs=[pl.BlockSpec((None, w), lambda i, c: (i, c)), pl.BlockSpec((None,), lambda i, c: (i // groups,))],
        out_specs=[pl.BlockSpec((None, k1), lambda i, c: (i, c))] * 2,
        out_shape=[jax.ShapeDtypeStruct((r, m), jnp.float32), jax.ShapeDtypeStruct((r, m), jnp.int32)],
        name="page_top_k_chunks", **_launch(w, num_warps, interpret),
    )(s, flushed)
    return pl.pallas_call(
        functools.partial(_merge_kernel, k=k, kp=kp, m=m, mp=mp), grid=(r,), interpret=interpret,
        in_specs=[pl.BlockSpec((None, mp), lambda i: (i, 0))] * 2,
        out_specs=pl.BlockSpec((None, kp), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((r, k), jnp.int32), name="page_top_k_merge", **_launch(mp, num_warps, interpret),
    )(xs, ids)


def _check(s, flushed, k: int, sink: int, recent: int, groups: int):
    """The arguments both `select_pages_pallas` and `ref_select_pages` take, refused the same way by both."""
    r, p = s.shape
    if flushed.shape != (r // groups,) or r % groups:
        raise ValueError(f"flushed has shape {flushed.shape}: it must be [{r} rows // groups = {groups}]")
    if not 1 <= k <= p:
        raise ValueError(f"k = {k} must be in [1, {p}] (the pages of a row)")
    if sink < 0 or recent < 0:
        raise ValueError(f"sink = {sink} and recent = {recent} must be >= 0")


@functools.partial(jax.jit, static_argnames=("k", "sink", "recent", "groups", "interpret", "num_warps", "chunks"))
def select_pages_pallas(s, flushed, k: int, *, sink: int = 0, recent: int = 0, groups: int = 1,
                        interpret: bool = False, num_warps: int | None = None, chunks: int = 1):
    """s [R, P] float32 scores; flushed [R // groups] int32 candidate pages, one value for each `groups` consecutive
    rows (a sequence's KV-head groups share it; read in place, not broadcast) -> [R, k] int32 page ids in page
    order, -1 where the row has fewer than k candidates: exactly `ref_select_pages`.
    chunks > 1: two launches, each row split into `chunks` chunks of a power-of-two width whose winners one program
    per row then merges (the same result); for few rows of many pages, where one program per row leaves most of the
    GPU idle. `select_top_pages` (the decode's entry) picks the count by `launch_chunks`."""
    r, p = s.shape
    _check(s, flushed, k, sink, recent, groups)
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks = {chunks!r} must be an int >= 1")
    w = next_pow2(-(-p // chunks))                                   # chunk width: a power of two
    if w < p:
        return _two_stage(s.astype(jnp.float32), flushed.astype(jnp.int32), k, sink=sink, recent=recent,
                          groups=groups, w=w, interpret=interpret, num_warps=num_warps)
    pp, kp = next_pow2(p), next_pow2(k)
    # a block wider than the row (pp > p) or than the output (kp > k): Pallas masks the loads and stores past the
    # array (interpret mode pads), so no XLA pad or slice runs around the kernel
    return pl.pallas_call(
        functools.partial(_select_kernel, k=k, kp=kp, pp=pp, n=p, sink=sink, recent=recent), grid=(r,),
        interpret=interpret,
        in_specs=[pl.BlockSpec((None, pp), lambda i: (i, 0)), pl.BlockSpec((None,), lambda i: (i // groups,))],
        out_specs=pl.BlockSpec((None, kp), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((r, k), jnp.int32), name="page_top_k", **_launch(pp, num_warps, interpret),
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


def launch_chunks(rows: int, pages: int, *, programs: int = 128, min_width: int = 512) -> int:
    """The chunks a row is split into (`select_pages_pallas`'s `chunks`) for `rows` rows of `pages` pages: enough
    that rows x chunks reaches about `programs` programs (the H200 has 132 SMs; one program per row leaves most of
    them idle at small batches), in chunks at least `min_width` pages wide (the kernel's power-of-two width; narrower chunks grow the merge stage's row:
    k winners a chunk). The rule fits bench_gpu.sh select-small's times (docs/BENCHMARKS.md, page top-k)."""
    c = 1
    while rows * c * 2 <= programs and next_pow2(-(-pages // (c * 2))) >= min_width:
        c *= 2
    return c


def select_top_pages(s, flushed, k: int, *, sink: int = 0, recent: int = 0, impl: str = "ref"):
    """s [B, G, P] scores; flushed [B] int32 -> [B, G, k] int32 (see the module docstring). impl: 'ref'
    (lax.top_k), 'pallas' (the kernel, in `launch_chunks` chunks a row; interpret mode off GPU) or 'auto' (the
    kernel on GPU, lax.top_k elsewhere)."""
    B, G, p = s.shape
    fn = ref_select_pages if pick_impl(impl) == "ref" else functools.partial(
        select_pages_pallas, interpret=not on_gpu(), chunks=launch_chunks(B * G, p))
    return fn(s.reshape(B * G, p), flushed, k, sink=sink, recent=recent, groups=G).reshape(B, G, k)
