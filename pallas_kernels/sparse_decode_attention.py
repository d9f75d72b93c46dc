"""Sparse decode attention over a paged KV pool (DESIGN.md section 2, step 4).

Each (sequence, KV-head group) attends over its own list of pages, named by frame id in ONE page pool (the
PB-LRU frames and the tail ring live in the same pool, see `ulacache_jax.cache.state`). A page missing from HBM
can instead be read zero-copy from the host pool (`pinned_host` on GPU) and, optionally, stored into its new
frame in the same pass (the fused fill), so a miss crosses PCIe exactly once.

Axis alphabet: B batch, Q queries per sequence (1, or 1 + draft length), H query heads, KV kv heads of this rank,
G groups, g kv heads per group (KV = G * g), r query heads per kv head (H = KV * r), K attended page slots per
(b, group), F pool frames, P host pages, t tokens of a page, D head dim, S page splits, M = Q * r query rows of one
kv head.

Two kernels (their times and bandwidth against the copy ceiling: docs/BENCHMARKS.md, sparse decode attention):
- Mosaic GPU (`impl="mosaic"`, the library's choice on Hopper where it applies: ulacache_jax/cache/kernel_choice.py):
  one CTA per (b, kv head, split);
  the split's K and V pages stream into shared memory by TMA (`emit_pipeline` over the frame table, 2 deep), and
  per page S = q @ K^T and O += P @ V run on the tensor cores (wgmma, the kv head's Q * r query rows padded to 64),
  online softmax in registers. The faster of the two on Hopper; resident pages only, bf16/f16, g = 1, Q * r <= 64.
- Triton lowering (`impl="pallas"`, every feature): one program per (b, kv head, split) walks its slice of the
  slots `pages_per_block` pages at a time: one masked gather load of those pages' K and V rows by frame id
  (skipped slots and tokens past the length make no memory traffic), one `dot` for the M query rows, online
  softmax. It is the one that reads a `pinned_host` operand in place, so it serves misses (page_src 2/3, the
  fused fill), fp32, g > 1 and long drafts.
Both write per-split partials, merged by log-sum-exp in XLA (about 1-3% of the bytes).

Scaled pages (an fp8 or int8 page format, ulacache_jax/cache/codec.py): `k_scale`, `v_scale` [F, 1, g, 1] float32,
one per pool page and KV head; the page's value is code * scale. The Triton kernel reads the codes (half of bf16's
bytes for fp8) and dequantises in registers: codes are converted to the queries' dtype for the dots (exact: e4m3
and int8 codes are bf16 values), the K scale multiplies the logits of the page's columns and the V scale the
probabilities of its columns before P @ V, so no dequantised tile is formed. Pages of the second source (host_k /
host_v: the host pool, or a scaled codec's tail ring kept in the model's dtype) are unscaled. The Mosaic kernel takes
unscaled pages only.

`ref_sparse_decode_attention` is the same function in plain jnp (gather the pages, mask, softmax), obvious
rather than fast. `impl="auto"` runs the Triton kernel on GPU and the reference elsewhere (the plain default of
direct calls; which kernel the decode runs is decided by ulacache_jax/cache/kernel_choice.py); `impl="pallas"` forces
the Triton kernel (interpret mode on CPU). The Mosaic kernel has no CPU interpreter (jax's Mosaic GPU interpreter has
no wgmma); its jnp stand-in `_ref_mosaic_partials` tests its packing and merge on CPU, and it is checked against
the reference on the GPU (tests marked gpu, and the benchmark before timing).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

from . import next_pow2, on_gpu, on_hopper


ANY = pl.BlockSpec(memory_space=None)  # the whole array, left where it is (HBM or pinned_host)
NEG_INIT = -1e30  # finite start of the running max: an all-masked row keeps m = NEG_INIT, l = 0 and never NaNs
NUM_SMS_H200 = 132
IMPLS = ("auto", "pallas", "mosaic", "ref")  # pallas = the Triton-lowering kernel (every feature)


# ----------------------------------------------------------------------------------------------------------------
# argument checking and defaults shared by kernel and reference
# ----------------------------------------------------------------------------------------------------------------
def _check_scales(pool_k, k_scale, v_scale, store_misses):
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale go together")
    if k_scale is None:
        return
    want = (pool_k.shape[0], 1, pool_k.shape[2], 1)
    if k_scale.shape != want or v_scale.shape != want:
        raise ValueError(f"k_scale / v_scale must be [F, 1, g, 1] = {list(want)} (one per pool page and KV head), "
                         f"got {k_scale.shape} / {v_scale.shape}")
    if store_misses:
        raise ValueError("store_misses with scaled pages: the fused fill stores unscaled host pages only")


def _check(q, pool_k, pool_v, page_frame, page_start, seq_len, host_k, host_v, page_host, page_src):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, Q, H, D], got {q.shape}")
    b, nq, h, d = q.shape
    if pool_k.ndim != 4 or pool_k.shape != pool_v.shape:
        raise ValueError(f"pool_k/pool_v must both be [F, page, g, D], got {pool_k.shape} and {pool_v.shape}")
    _, page, g, dk = pool_k.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) and the pool ({dk}) differ")
    if page_frame.ndim != 3 or page_frame.shape != page_start.shape or page_frame.shape[0] != b:
        raise ValueError(f"page_frame/page_start must be [B, G, K] with B = {b}, got {page_frame.shape}, "
                         f"{page_start.shape}")
    ng = page_frame.shape[1]
    kv = ng * g
    if h % kv:
        raise ValueError(f"H = {h} query heads is not a multiple of KV = G * g = {ng} * {g}")
    if seq_len.shape != (b,):
        raise ValueError(f"seq_len must be [B] = [{b}], got {seq_len.shape}")
    if page_src is not None and page_src.shape != page_frame.shape:
        raise ValueError(f"page_src must be [B, G, K] like page_frame, got {page_src.shape}")
    if host_k is not None or host_v is not None or page_host is not None:
        if host_k is None or host_v is None or page_host is None:
            raise ValueError("host_k, host_v and page_host go together")
        if host_k.shape != host_v.shape or host_k.shape[1:] != pool_k.shape[1:]:
            raise ValueError(f"host pool pages {host_k.shape} / {host_v.shape} do not match the pool's {pool_k.shape}")
        if page_host.shape != page_frame.shape:
            raise ValueError(f"page_host must be [B, G, K] like page_frame, got {page_host.shape}")
    elif page_src is not None and not isinstance(page_src, jax.core.Tracer) and bool(jnp.any(page_src >= 2)):
        raise ValueError("page_src asks for host reads (2 or 3) but no host pool was given")
    return b, nq, h, d, page, g, ng, kv


def _default_src(page_start, page_src):
    if page_src is None:
        return jnp.where(page_start >= 0, 1, 0).astype(jnp.int32)
    return page_src.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------------------------------------------
def ref_sparse_decode_attention(q, pool_k, pool_v, page_frame, page_start, seq_len, *, host_k=None, host_v=None,
                                page_host=None, page_src=None, scale=None, softcap=None, impl="ref",
                                store_misses=False, k_scale=None, v_scale=None):
    """Plain-jnp sparse decode attention; same contract as `sparse_decode_attention` (impl is ignored).

    q [B, Q, H, D]; pool_k/v [F, t, g, D]; page_frame, page_start, page_host, page_src [B, G, K] int32;
    seq_len [B] int32; host_k/v [P, t, g, D]; k_scale/v_scale [F, 1, g, 1] float32 (scaled pool pages: value =
    code * scale). Returns out [B, Q, H, D] (and new pool_k, pool_v if store_misses).
    """
    del impl
    b, nq, h, d, page, g, ng, kv = _check(q, pool_k, pool_v, page_frame, page_start, seq_len, host_k, host_v,
                                          page_host, page_src)
    _check_scales(pool_k, k_scale, v_scale, store_misses)
    r = h // kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    src = _default_src(page_start, page_src)
    nf = pool_k.shape[0]
    frame = jnp.clip(page_frame, 0, nf - 1)
    k_pages = pool_k[frame]  # [B, G, K, t, g, D]
    v_pages = pool_v[frame]
    if k_scale is not None:  # dequantised in float32: value = code * (page, head) scale
        k_pages = k_pages.astype(jnp.float32) * k_scale[frame]
        v_pages = v_pages.astype(jnp.float32) * v_scale[frame]
    if host_k is not None:
        hidx = jnp.clip(page_host, 0, host_k.shape[0] - 1)
        from_host = (src >= 2)[..., None, None, None]
        k_pages = jnp.where(from_host, host_k[hidx], k_pages)
        v_pages = jnp.where(from_host, host_v[hidx], v_pages)
    pos = page_start[..., None] + jnp.arange(page, dtype=jnp.int32)       # [B, G, K, t]
    used = ((src != 0) & (page_start >= 0))[..., None] & (pos < seq_len[:, None, None, None])  # [B, G, K, t]
    qpos = seq_len[:, None] - nq + jnp.arange(nq, dtype=jnp.int32)        # [B, Q]
    # visible[b, q, G, K, t]: the page is attended and the token is at or before the query's own position
    visible = used[:, None] & (pos[:, None] <= qpos[:, :, None, None, None])

    qf = q.astype(jnp.float32).reshape(b, nq, ng, g, r, d)
    kf = k_pages.astype(jnp.float32)
    vf = jnp.where(used[..., None, None], v_pages.astype(jnp.float32), 0.0)   # garbage past the length stays out
    s = jnp.einsum("bqGjrd,bGKtjd->bqGjrKt", qf, kf, precision=lax.Precision.HIGHEST) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    vis = visible[:, :, :, None, None]                                      # [B, Q, G, 1, 1, K, t]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=(-2, -1), keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=(-2, -1))                                           # [B, Q, G, g, r]
    o = jnp.einsum("bqGjrKt,bGKtjd->bqGjrd", p, vf, precision=lax.Precision.HIGHEST)
    o = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = o.reshape(b, nq, h, d).astype(q.dtype)
    if not store_misses:
        return out
    if host_k is None:
        return out, pool_k, pool_v
    store = (src == 3).reshape(-1)
    tgt = jnp.where(store, page_frame.reshape(-1), nf)                     # out of range -> dropped
    hidx = jnp.clip(page_host, 0, host_k.shape[0] - 1).reshape(-1)
    new_k = pool_k.at[tgt].set(host_k[hidx], mode="drop")
    new_v = pool_v.at[tgt].set(host_v[hidx], mode="drop")
    return out, new_k, new_v


# ----------------------------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------------------------
def _attn_kernel(*refs, nq, r, g, d, page, npb, nblk, scale, softcap, has_host, store, fp32, scaled):
    """One program = one (b, kv head, split).

    frame_ref, start_ref [B, G, Kp] int32 (whole tables); src_ref, hidx_ref [B, G, Kp] (host variant only);
    len_ref [B] int32; q_ref [Mp, D] (this kv head's M query rows, zero-padded to Mp);
    k_ref, v_ref [F, t, g, D] pool (HBM); ks_ref, vs_ref [F, 1, g, 1] f32 its page scales (scaled pages only);
    hk_ref, hv_ref [P, t, g, D] host pool (pinned_host on GPU, read in
    place: no XLA op touches it, since XLA ops on a pinned_host operand fail or run on the host), or a scaled
    codec's tail ring (unscaled);
    outputs: o_ref [Mp, D] f32 unnormalised partial, m_ref, l_ref [Mp] f32 running max and sum;
    ko_ref, vo_ref [F, t, g, D] the pool again as outputs, aliased to k_ref / v_ref (fused fill only): the pool
    is passed once, since an operand that is both read and aliased makes XLA copy the whole pool first.
    """
    it = iter(refs)
    frame_ref, start_ref = next(it), next(it)
    src_ref, hidx_ref = (next(it), next(it)) if has_host else (None, None)
    len_ref, q_ref, k_ref, v_ref = next(it), next(it), next(it), next(it)
    ks_ref, vs_ref = (next(it), next(it)) if scaled else (None, None)
    hk_ref, hv_ref = (next(it), next(it)) if has_host else (None, None)
    o_ref, m_ref, l_ref = next(it), next(it), next(it)
    ko_ref, vo_ref = (next(it), next(it)) if store else (None, None)

    b, kvh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    grp, jj = kvh // g, kvh % g
    mp = q_ref.shape[0]
    blk = npb * page
    length = len_ref[b]
    rows = jnp.arange(mp, dtype=jnp.int32)
    # row i*r + x is query i (0..Q-1) of this kv head; it sits at position length - Q + i; padding rows see nothing
    row_pos = jnp.where(rows < nq * r, length - nq + rows // r, -1)
    q = q_ref[...]
    prec = lax.Precision.HIGHEST if fp32 else None
    tok_in_page = jnp.arange(page, dtype=jnp.int32)
    shp = (npb, page, d)
    # gather indices [npb, t, D], all arrays (interpret mode discharges only all-array or all-slice indexers)
    tok_idx = jnp.broadcast_to(tok_in_page[None, :, None], shp)
    head_idx = jnp.broadcast_to(jj, shp) if g > 1 else jnp.zeros(shp, jnp.int32)
    col_idx = jnp.broadcast_to(jnp.arange(d, dtype=jnp.int32)[None, None, :], shp)

    def idx(frames):
        return jnp.broadcast_to(frames[:, None, None], shp), tok_idx, head_idx, col_idx

    def pages(ref, frames, mask):
        mask = jnp.broadcast_to(mask, shp)
        if jnp.dtype(ref.dtype).itemsize == 1:
            # fp8 pages: Triton's masked load cannot cast an integer `other` to f8E4M3FN (the H200 refused it), so
            # masked lanes load undefined bytes and are zeroed after the load
            return jnp.where(mask, pltriton.load(ref.at[idx(frames)], mask=mask), jnp.zeros((), ref.dtype))
        return pltriton.load(ref.at[idx(frames)], mask=mask, other=0)

    def body(i, carry):
        acc, m_run, l_run = carry
        off = (split * nblk + i) * npb
        fr = frame_ref[b, grp, pl.ds(off, npb)]                      # [npb]
        st = start_ref[b, grp, pl.ds(off, npb)]                      # [npb]
        if has_host:
            src = src_ref[b, grp, pl.ds(off, npb)]
            use = (src != 0) & (st >= 0)
            from_pool = use & (src == 1)
            from_host = use & (src >= 2)
        else:
            use = st >= 0
            from_pool = use
        pos = st[:, None] + tok_in_page[None, :]                     # [npb, t]
        tok_ok = use[:, None] & (pos < length)                       # [npb, t] real tokens of attended pages
        # masked-off lanes make no memory traffic: skipped slots and tokens past the length cost nothing
        k = pages(k_ref, jnp.where(from_pool, fr, 0), (from_pool[:, None] & tok_ok)[:, :, None])   # [npb, t, D]
        v = pages(v_ref, jnp.where(from_pool, fr, 0), (from_pool[:, None] & tok_ok)[:, :, None])
        if scaled:
            # codes -> the queries' dtype (exact for e4m3 / int8 codes); the page scales [npb] are applied to the
            # logits and the probabilities of each page's columns below (1 for pages of the second source)
            k, v = k.astype(q.dtype), v.astype(q.dtype)
            sc_idx = (jnp.where(from_pool, fr, 0), jnp.zeros((npb,), jnp.int32),
                      jnp.broadcast_to(jj, (npb,)).astype(jnp.int32), jnp.zeros((npb,), jnp.int32))
            ksc = pltriton.load(ks_ref.at[sc_idx], mask=from_pool, other=1.0)        # [npb] f32
            vsc = pltriton.load(vs_ref.at[sc_idx], mask=from_pool, other=1.0)
            ksc = jnp.broadcast_to(ksc[:, None], (npb, page)).reshape(1, blk)       # per column
            vsc = jnp.broadcast_to(vsc[:, None], (npb, page)).reshape(1, blk)
        if has_host:
            hp = jnp.where(from_host, hidx_ref[b, grp, pl.ds(off, npb)], 0)
            hmask = from_host[:, None, None]                         # whole page: it may also be stored
            kh = pages(hk_ref, hp, hmask)
            vh = pages(hv_ref, hp, hmask)
            if store:
                do = from_host & (src == 3)
                # masked-off lanes point past the pool: no access on GPU, dropped by interpret mode's scatter
                dst = idx(jnp.where(do, fr, ko_ref.shape[0]))
                smask = jnp.broadcast_to(do[:, None, None], shp)
                pltriton.store(ko_ref.at[dst], kh, mask=smask)
                pltriton.store(vo_ref.at[dst], vh, mask=smask)
            k = jnp.where(hmask, kh.astype(k.dtype), k)
            v = jnp.where(hmask, vh.astype(v.dtype), v)
        k = k.reshape(blk, d)
        v = v.reshape(blk, d)
        ok = tok_ok.reshape(1, blk)
        v = jnp.where(ok.reshape(blk, 1), v, jnp.zeros_like(v))     # where, not multiply: 0 * NaN = NaN
        s = pltriton.dot(q, k, trans_b=True, precision=prec) * scale       # [Mp, blk] f32
        if scaled:
            s = s * ksc
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        vis = ok & (pos.reshape(1, blk) <= row_pos[:, None])         # [Mp, blk]
        s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m_run, jnp.max(s, axis=1))
        corr = jnp.exp(m_run - m_new)
        p = jnp.exp(s - m_new[:, None])                              # masked: exp(-inf) = 0
        l_new = corr * l_run + jnp.sum(p, axis=1)
        pw = p * vsc if scaled else p                                # V's page scale on its columns' weights
        pv = pltriton.dot(pw.astype(v.dtype), v, precision=prec)           # [Mp, D] f32
        return corr[:, None] * acc + pv, m_new, l_new

    init = (jnp.zeros((mp, d), jnp.float32), jnp.full((mp,), NEG_INIT, jnp.float32), jnp.zeros((mp,), jnp.float32))
    acc, m_run, l_run = lax.fori_loop(0, nblk, body, init)
    o_ref[...] = acc
    m_ref[...] = m_run
    l_ref[...] = l_run


def default_tuning(batch: int, num_kv: int, num_slots: int, page: int, has_host: bool = False,
                   itemsize: int = 2) -> dict:
    """Splits and pages per step for the shapes at hand (the launch sweep: docs/BENCHMARKS.md).

    Enough programs to cover the 132 SMs a few times over, and splits no shorter than a couple of steps. A step
    holds its K and V tiles in registers (npb * page * D * 2 bytes each, 64 registers per thread for one 64-token
    page at 4 warps); the host variant holds a pool and a host tile of each, so it steps one page at a time."""
    npb = 2 if page >= 64 else max(1, 128 // page)
    if has_host or itemsize > 2:
        npb = max(1, npb // 2)
    return dict(num_splits=split_count(batch, num_kv, -(-num_slots // npb)), pages_per_block=npb, num_warps=4,
                num_stages=2)


def split_count(batch: int, num_kv: int, steps: int) -> int:
    """Splits of one (b, KV head)'s walk of `steps` loop steps: enough programs to cover the 132 SMs a few times
    over, splits no shorter than two steps, at most 16 (a power of two)."""
    want = max(1, -(-2 * NUM_SMS_H200 // (batch * num_kv)))
    return max(1, min(next_pow2(want), next_pow2(max(1, max(1, steps) // 2)), 16))


def query_rows(q, num_kv: int):
    """q [B, Q, H, D] -> (qr [B, KV, Mp, D], m_rows = Q * r, Mp): each KV head's query rows (query i, head j * r + x
    -> row i * r + x), zero-padded to Mp = max(16, the next power of two) rows (tl.dot wants >= 16 rows)."""
    b, nq, h, d = q.shape
    r = h // num_kv
    m_rows = nq * r
    mp = max(16, next_pow2(m_rows))
    qr = q.reshape(b, nq, num_kv, r, d).transpose(0, 2, 1, 3, 4).reshape(b, num_kv, m_rows, d)
    if mp != m_rows:
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, mp - m_rows), (0, 0)))
    return qr, m_rows, mp


def pad_last(x, pad: int, fill):
    """x [B, G, K] -> int32 [B, G, K + pad], the new slots `fill`."""
    x = x.astype(jnp.int32)
    return jnp.pad(x, ((0, 0), (0, 0), (0, pad)), constant_values=fill) if pad else x


def partial_outputs(b: int, kv: int, ns: int, mp: int, d: int):
    """(out_shape, out_specs) of a split kernel's per-split partials on the grid (b, KV head, split): o [B, KV, S,
    Mp, D] unnormalised, m / l [B, KV, S, Mp] running max and sum, all float32 (merged by `merge_splits`)."""
    out_shape = [jax.ShapeDtypeStruct((b, kv, ns, mp, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv, ns, mp), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv, ns, mp), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, None, mp, d), lambda i, j, s: (i, j, s, 0, 0)),
                 pl.BlockSpec((None, None, None, mp), lambda i, j, s: (i, j, s, 0)),
                 pl.BlockSpec((None, None, None, mp), lambda i, j, s: (i, j, s, 0))]
    return out_shape, out_specs


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "store_misses", "interpret", "num_splits",
                                              "pages_per_block", "num_warps", "num_stages"))
def _pallas_attention(q, pool_k, pool_v, page_frame, page_start, seq_len, host_k, host_v, page_host, page_src,
                      k_scale=None, v_scale=None, *, scale, softcap, store_misses, interpret, num_splits,
                      pages_per_block, num_warps, num_stages):
    b, nq, h, d = q.shape
    nf, page, g, _ = pool_k.shape
    ng, nslot = page_frame.shape[1:]
    kv = ng * g
    r = h // kv
    qr, m_rows, mp = query_rows(q, kv)
    npb, ns = pages_per_block, num_splits
    nblk = -(-nslot // (ns * npb))
    pad = ns * nblk * npb - nslot
    has_host = host_k is not None
    store = bool(store_misses and has_host)

    def padk(x, fill):
        return pad_last(x, pad, fill)

    frame = padk(page_frame, 0)
    start = padk(page_start, -1)
    pk, pv = pool_k, pool_v
    args = [frame, start]
    in_specs = [ANY, ANY]
    if has_host:
        src = padk(_default_src(page_start, page_src), 0)
        args += [src, padk(page_host, 0)]
        in_specs += [ANY, ANY]
    pool_at = len(args) + 2
    args += [seq_len.astype(jnp.int32), qr, pk, pv]
    in_specs += [ANY, pl.BlockSpec((None, None, mp, d), lambda i, j, s: (i, j, 0, 0)), ANY, ANY]
    scaled = k_scale is not None
    if scaled:
        args += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
        in_specs += [ANY, ANY]
    if has_host:
        args += [host_k, host_v]
        in_specs += [ANY, ANY]
    out_shape, out_specs = partial_outputs(b, kv, ns, mp, d)
    aliases = {}
    if store:
        aliases = {pool_at: 3, pool_at + 1: 4}
        out_shape += [jax.ShapeDtypeStruct(pk.shape, pk.dtype), jax.ShapeDtypeStruct(pv.shape, pv.dtype)]
        out_specs += [ANY, ANY]
    kernel = functools.partial(_attn_kernel, nq=nq, r=r, g=g, d=d, page=page, npb=npb, nblk=nblk, scale=scale,
                               softcap=softcap, has_host=has_host, store=store, fp32=q.dtype == jnp.float32,
                               scaled=scaled)
    outs = pl.pallas_call(
        kernel, grid=(b, kv, ns), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases, interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="sparse_decode_attention")(*args)
    o, m, l = outs[:3]
    out = merge_splits(o, m, l, m_rows=m_rows, nq=nq, r=r).astype(q.dtype)
    if not store_misses:
        return out
    if not store:
        return out, pool_k, pool_v
    return out, outs[3], outs[4]


def merge_splits(o, m, l, *, m_rows: int, nq: int, r: int):
    """The log-sum-exp merge of per-split partials: o [B, KV, S, Mp, D] unnormalised, m / l [B, KV, S, Mp] running
    max and sum -> [B, Q, H, D] float32 (the first m_rows = Q * r of the Mp rows are real; row i * r + x is query i,
    head j * r + x of KV head j). An empty split (l = 0) has no weight; a row that saw nothing is 0."""
    b, kv, _, _, d = o.shape
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)
    l_all = jnp.sum(w * l, axis=2)                                    # [B, KV, Mp]
    o_all = jnp.sum(jnp.where(l[..., None] > 0, w[..., None] * o, 0.0), axis=2)  # [B, KV, Mp, D]
    out = jnp.where(l_all[..., None] > 0, o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None], 0.0)
    return out[:, :, :m_rows].reshape(b, kv, nq, r, d).transpose(0, 2, 1, 3, 4).reshape(b, nq, kv * r, d)


# ----------------------------------------------------------------------------------------------------------------
# Mosaic GPU variant (all-resident pages only): TMA page walk + wgmma
# ----------------------------------------------------------------------------------------------------------------
MOSAIC_ROWS = 64  # wgmma wants 64 rows: the kv head's Q * r query rows, zero-padded


def mosaic_applies(query_dtype, cache_dtype, *, head_dim: int, page_size: int, kv_heads_per_group: int,
                   query_rows: int, reads_host: bool) -> bool:
    """What the Mosaic variant serves, from static facts: bf16/f16 queries and pages of the same dtype, one kv head
    per group, head_dim % 64 == 0 (at most 256), page % 64 == 0, at most MOSAIC_ROWS query rows (Q * r) per kv
    head, and no host reads (TMA from pinned_host is not probed). The Triton kernel covers the rest."""
    q, c = jnp.dtype(query_dtype), jnp.dtype(cache_dtype)
    return (q in (jnp.bfloat16, jnp.float16) and c == q and kv_heads_per_group == 1 and not reads_host
            and head_dim % 64 == 0 and head_dim <= 256 and page_size % 64 == 0 and query_rows <= MOSAIC_ROWS)


def default_mosaic_tuning(batch: int, num_kv: int, num_slots: int) -> dict:
    """Splits: about two CTAs per SM, with at most ~10% padded slots (a padded slot still costs its TMA copy); then
    the fewest splits that keep that many steps a CTA, so the slots often divide evenly: no pad launches before the
    kernel (34 slots, batch 1 x 8 kv heads: 17 splits of 2 steps, where 18 padded two slots for the same 2 steps)."""
    target = max(1, -(-2 * NUM_SMS_H200 // (batch * num_kv)))
    best = 1
    for sp in range(1, min(target, num_slots) + 1):
        if -(-num_slots // sp) * sp - num_slots <= max(1, num_slots // 10):
            best = sp
    return dict(num_splits=-(-num_slots // -(-num_slots // best)), max_concurrent_steps=2)


def _mosaic_partials(q4, pk, pv, frame, start, seq_len, *, nq, r, scale, softcap, num_splits, max_concurrent_steps):
    """Mosaic GPU kernel: one CTA (one warpgroup) per (b, kv head, split).

    q4 [B, KV, 64, D] (query rows, zero-padded); pk, pv [F, t, D] pool (g = 1); frame, start [B, KV, Kp] int32
    (Kp = S * steps; frames clipped in range); seq_len [B]. Returns o [B, KV, S, 64, D] (normalised partial, q dtype)
    and lse [B, KV, S, 64] f32 (-inf where a row saw nothing). Pages stream through shared memory by TMA
    (emit_pipeline over the frame table, `max_concurrent_steps` deep); per page S = q @ K^T and O += P @ V on the
    tensor cores (wgmma), online softmax in registers. V rows past the length (and of skipped slots) are zeroed in
    shared memory first, since garbage there may be NaN and 0 * NaN would poison P @ V."""
    b, kv, mrows, d = q4.shape
    page = pk.shape[1]
    steps = frame.shape[2] // num_splits
    dtype = q4.dtype
    tr = (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128))
    nconc = max(1, min(max_concurrent_steps, steps))
    wg = plgpu.Layout.WGMMA

    def body(q_g, frame_g, start_g, len_g, pk_g, pv_g, o_g, lse_g, q_s, lse_s, bar):
        bi, hi, si = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
        plgpu.copy_gmem_to_smem(q_g.at[bi, hi], q_s, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        length = len_g[bi]
        base = si * steps
        rows = plgpu.broadcasted_iota(jnp.int32, (mrows, page), 0, layout=wg)
        cols = plgpu.broadcasted_iota(jnp.int32, (mrows, page), 1, layout=wg)
        acc0 = plgpu.layout_cast(jnp.zeros((mrows, d), jnp.float32), wg)
        m0 = plgpu.layout_cast(jnp.full((mrows,), NEG_INIT, jnp.float32), wg.reduce(1))
        l0 = plgpu.layout_cast(jnp.zeros((mrows,), jnp.float32), wg.reduce(1))

        def step(idx, k_s, v_s, carry):
            acc, m_i, l_i = carry
            st = start_g[bi, hi, base + idx[0]]

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_s, k_s.T)
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((mrows, page), jnp.float32)) * scale
            if softcap is not None:
                s = softcap * jnp.tanh(s * (1.0 / softcap))
            pos = cols + st
            # row i * r + x is query i, at position length - Q + i: it sees pos <= that, i.e. row >= (pos - length
            # + Q) * r (no integer division on fragmented arrays)
            vis = (pos < length) & (st >= 0) & (rows < nq * r) & (rows >= (pos - length + nq) * r)
            s = jnp.where(vis, s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp(m_i - m_new)
            p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_new = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            @pl.when((st < 0) | (st + page > length))
            def _zero_rows_past_length():
                v = plgpu.load(v_s, layout=wg)
                vr = plgpu.broadcasted_iota(jnp.int32, (page, d), 0, layout=wg)
                v_s[...] = jnp.where((vr + st < length) & (st >= 0), v, jnp.zeros_like(v))
                plgpu.commit_smem()

            def pv_(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(dtype), v_s)

            acc = pl.run_state(pv_)(plgpu.ACC.init(acc))
            return acc, m_new, l_new

        spec = lambda: plgpu.BlockSpec((None, page, d), lambda j: (frame_g[bi, hi, base + j], 0, 0), transforms=tr)
        acc, m_i, l_i = plgpu.emit_pipeline(step, grid=(steps,), max_concurrent_steps=nconc, in_specs=[spec(), spec()],
                                            init_carry=(acc0, m0, l0))(pk_g, pv_g)
        seen = l_i > 0
        inv = 1.0 / jnp.where(seen, l_i, 1.0)
        q_s[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)   # q_s is free now: reuse it
        lse_s[...] = jnp.where(seen, m_i + jnp.log(jnp.where(seen, l_i, 1.0)), -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_s, o_g.at[bi, hi, si])
        plgpu.copy_smem_to_gmem(lse_s, lse_g.at[bi, hi, si])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((b, kv, num_splits, mrows, d), dtype),
                        jax.ShapeDtypeStruct((b, kv, num_splits, mrows), jnp.float32)),
        grid=(b, kv, num_splits), grid_names=("b", "h", "s"),
        scratch_types=[plgpu.SMEM((mrows, d), dtype, transforms=tr), plgpu.SMEM((mrows,), jnp.float32),
                       plgpu.Barrier(num_arrivals=1, num_barriers=1)],
    )(q4, frame, start, seq_len, pk, pv)


def _ref_mosaic_partials(q4, pk, pv, frame, start, seq_len, *, nq, r, scale, softcap, num_splits,
                         max_concurrent_steps):
    """What `_mosaic_partials` computes, in jnp (the Mosaic interpreter has no wgmma on CPU): lets CPU tests check
    the wrapper's packing and merge."""
    del max_concurrent_steps
    b, kv, mrows, d = q4.shape
    page = pk.shape[1]
    steps = frame.shape[2] // num_splits
    sh = (b, kv, num_splits, steps)
    st = start.reshape(sh)
    kk = pk[frame].reshape(sh + (page, d)).astype(jnp.float32)
    vv = pv[frame].reshape(sh + (page, d)).astype(jnp.float32)
    pos = st[..., None] + jnp.arange(page)                                # [B, KV, S, steps, t]
    ok = (st[..., None] >= 0) & (pos < seq_len[:, None, None, None, None])
    vv = jnp.where(ok[..., None], vv, 0.0)
    s = jnp.einsum("bhmd,bhsjtd->bhsmjt", q4.astype(jnp.float32), kk, precision=lax.Precision.HIGHEST) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    rows = jnp.arange(mrows)[:, None, None]
    vis = ok[:, :, :, None] & (rows < nq * r) & (rows >= (pos[:, :, :, None] - seq_len[:, None, None, None, None, None]
                                                          + nq) * r)
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=(-2, -1))
    p = jnp.where(vis, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None, None]), 0.0)
    l = p.sum(axis=(-2, -1))
    o = jnp.einsum("bhsmjt,bhsjtd->bhsmd", p, vv, precision=lax.Precision.HIGHEST)
    o = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return o.astype(q4.dtype), lse


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "num_splits", "max_concurrent_steps", "use_ref"))
def _mosaic_attention(q, pool_k, pool_v, page_frame, page_start, seq_len, *, scale, softcap, num_splits,
                      max_concurrent_steps, use_ref=False):
    b, nq, h, d = q.shape
    nf, page, _, _ = pool_k.shape
    kv, nslot = page_frame.shape[1:]
    r = h // kv
    m_rows = nq * r
    steps = -(-nslot // num_splits)
    pad = steps * num_splits - nslot
    frame = jnp.clip(page_frame.astype(jnp.int32), 0, nf - 1)           # a skipped slot's frame may be garbage
    start = page_start.astype(jnp.int32)
    if pad:
        frame = jnp.pad(frame, ((0, 0), (0, 0), (0, pad)), mode="edge")
        start = jnp.pad(start, ((0, 0), (0, 0), (0, pad)), constant_values=-1)
    q4 = q.reshape(b, nq, kv, r, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, m_rows, d)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, MOSAIC_ROWS - m_rows), (0, 0)))
    fn = _ref_mosaic_partials if use_ref else _mosaic_partials
    o, lse = fn(q4, pool_k.reshape(nf, page, d), pool_v.reshape(nf, page, d), frame, start, seq_len.astype(jnp.int32),
                nq=nq, r=r, scale=scale, softcap=softcap, num_splits=num_splits,
                max_concurrent_steps=max_concurrent_steps)
    # log-sum-exp merge over the splits, of the real query rows only (the padding rows up to MOSAIC_ROWS are
    # dropped first: the merge reads m_rows of each split's 64 rows, not all of them)
    o, lse = o[:, :, :, :m_rows], lse[:, :, :, :m_rows]                  # [B, KV, splits, M, D], [B, KV, splits, M]
    top = jnp.max(lse, axis=2, keepdims=True)
    w = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0))               # -inf (nothing seen) -> 0
    den = jnp.sum(w, axis=2)                                               # [B, KV, M]
    num = jnp.sum(jnp.where(w[..., None] > 0, w[..., None] * o.astype(jnp.float32), 0.0), axis=2)
    out = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    return out.reshape(b, kv, nq, r, d).transpose(0, 2, 1, 3, 4).reshape(b, nq, h, d).astype(q.dtype)


def _mosaic_applies(q, pool_k, num_kv: int, host_k, store_misses) -> bool:
    """mosaic_applies for these arrays: q [B, Q, H, D]; pool_k [F, t, g, D]; num_kv = KV."""
    _, nq, h, d = q.shape
    _, page, g, _ = pool_k.shape
    return mosaic_applies(q.dtype, pool_k.dtype, head_dim=d, page_size=page, kv_heads_per_group=g,
                          query_rows=nq * (h // num_kv), reads_host=host_k is not None or bool(store_misses))


def sparse_decode_attention(q, pool_k, pool_v, page_frame, page_start, seq_len, *, host_k=None, host_v=None,
                            page_host=None, page_src=None, scale=None, softcap=None, impl="auto",
                            store_misses=False, tuning=None, k_scale=None, v_scale=None):
    """Decode attention of q over each (sequence, group)'s own pages, read by frame from one pool.

    q          [B, Q, H, D]   queries; head h uses kv head h // (H // KV), KV = G * g; kv head j is in group j // g.
    pool_k/v   [F, t, g, D]   HBM page pool (selected frames and the tail ring alike).
    page_frame [B, G, K] int32 frame of each attended page; page_start [B, G, K] int32 position of its first
               token, -1 = unused slot. The set of pages matters, not their order.
    seq_len    [B] int32      query i of Q sits at position seq_len - Q + i and sees positions <= its own.
    host_k/v   [P, t, g, D]   optional host pool (pinned_host on GPU); page_host [B, G, K] int32 host page index.
    page_src   [B, G, K] int32 0 skip, 1 pool[page_frame], 2 host[page_host] (zero-copy), 3 host[page_host] and
               store it into pool[page_frame] (only with store_misses=True; without it 3 reads like 2).
               Default: 1 where page_start >= 0 else 0.
    k_scale/v_scale [F, 1, g, 1] float32, optional: pool pages stored as codes (fp8, int8) with a scale per page
               and KV head (value = code * scale), dequantised in the kernel; host pages are unscaled.
    Returns out [B, Q, H, D] in q.dtype (f32 accumulation); with store_misses=True also (pool_k, pool_v), aliased:
    call it under jit with the pools donated or XLA copies the whole pool first.
    impl: "auto" (the Triton kernel on GPU, the reference elsewhere), "pallas" (the Triton-lowering kernel;
    interpret mode on CPU), "mosaic" (the Mosaic GPU kernel: Hopper only, see `mosaic_applies`), "ref".
    `tuning` (optional dict) overrides `default_tuning` (pallas: num_splits, pages_per_block, num_warps,
    num_stages) or `default_mosaic_tuning` (mosaic: num_splits, max_concurrent_steps).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    b, nq, h, d, page, g, ng, kv = _check(q, pool_k, pool_v, page_frame, page_start, seq_len, host_k, host_v,
                                          page_host, page_src)
    _check_scales(pool_k, k_scale, v_scale, store_misses)
    if impl == "auto":
        impl = "pallas" if on_gpu() else "ref"
    if impl == "ref":
        return ref_sparse_decode_attention(q, pool_k, pool_v, page_frame, page_start, seq_len, host_k=host_k,
                                           host_v=host_v, page_host=page_host, page_src=page_src, scale=scale,
                                           softcap=softcap, store_misses=store_misses, k_scale=k_scale,
                                           v_scale=v_scale)
    if page_src is not None and host_k is None:
        # no host pool (2/3 were rejected by _check when concrete): fold the skips into page_start
        page_start = jnp.where(page_src != 0, page_start, -1)
        page_src = None
    scale = float(1.0 / math.sqrt(d) if scale is None else scale)
    softcap = None if softcap is None else float(softcap)
    if impl == "mosaic":
        if k_scale is not None:
            raise ValueError("impl='mosaic' reads unscaled pages only; scaled (fp8 / int8) pages take impl='pallas'")
        if not _mosaic_applies(q, pool_k, kv, host_k, store_misses):
            raise ValueError("impl='mosaic' needs bf16/f16, g = 1, Q * H / KV <= 64, D % 64 == 0, page % 64 == 0 "
                             "and no host pool; use impl='pallas'")
        if not on_hopper():
            raise NotImplementedError("impl='mosaic' needs a Hopper GPU (sm_90: wgmma; the Mosaic GPU interpreter "
                                      "has none on CPU): use impl='pallas' or 'ref'")
        tune = default_mosaic_tuning(b, kv, page_frame.shape[2])
        tune.update(tuning or {})
        out = _mosaic_attention(q, pool_k, pool_v, page_frame, page_start, seq_len, scale=scale, softcap=softcap,
                                **tune)
        return (out, pool_k, pool_v) if store_misses else out
    tune = default_tuning(b, kv, page_frame.shape[2], page, has_host=host_k is not None,
                          itemsize=jnp.dtype(pool_k.dtype).itemsize)
    tune.update(tuning or {})
    return _pallas_attention(q, pool_k, pool_v, page_frame, page_start, seq_len, host_k, host_v, page_host, page_src,
                             k_scale, v_scale, scale=scale, softcap=softcap, store_misses=bool(store_misses), interpret=not on_gpu(),
                             **tune)
