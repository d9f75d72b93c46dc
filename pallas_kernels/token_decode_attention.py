"""Decode attention over a list of single tokens per (sequence, KV-head group), read by (frame, row) from the pool.

Per-token selection (CacheConfig.token_shortlist) keeps the page as the unit of the pool (the sieve, the vTLB,
fetch and flush move pages) but attends only the budget's tokens of largest estimated mass inside the shortlisted
pages: teacher-forced perplexity at 32K is within 1% of dense at 1/16 of the context this way, where whole pages of
16 lose 3% (docs/BENCHMARKS.md, per-token selection). The page kernel (sparse_decode_attention.py) would read every
row of every shortlisted page; this one reads only the listed rows, so the K/V bytes a step are the budget's.

Axis alphabet: B batch, Q queries per sequence, H query heads, G groups, g KV heads per group (KV = G * g), r query
heads per KV head, N listed tokens per (b, group), F pool frames, t rows of a page, D head dim, n tokens a block,
S splits, M = Q * r query rows of one KV head.

Each listed token is (frame, row, position): pool_k[frame, row, head] is its key; position -1 marks an unused entry.
Query i of Q sits at position seq_len - Q + i and sees the listed tokens at or before it (a decode step lists only
tokens it may see; verification rows share nothing, each is its own sequence row here).

The Triton kernel (`impl="pallas"`): one program per (b, KV head, split) walks its slice of the list `n` tokens at
a time: one masked gather of those rows' K and V (unused entries make no memory traffic), one `dot` for the M query
rows, online softmax; per-split partials are merged by log-sum-exp (sparse_decode_attention.merge_splits).
`ref_token_decode_attention` is the same function in plain jnp.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import on_gpu, pick_impl
from .sparse_decode_attention import ANY, NEG_INIT, merge_splits, pad_last, partial_outputs, query_rows, split_count


def _check(q, pool_k, pool_v, tok_frame, tok_row, tok_pos, seq_len):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, Q, H, D], got {q.shape}")
    b, _, h, d = q.shape
    if pool_k.ndim != 4 or pool_k.shape != pool_v.shape or pool_k.shape[-1] != d:
        raise ValueError(f"pool_k/pool_v must both be [F, t, g, D = {d}], got {pool_k.shape} and {pool_v.shape}")
    if tok_frame.ndim != 3 or tok_frame.shape[0] != b or tok_row.shape != tok_frame.shape \
            or tok_pos.shape != tok_frame.shape:
        raise ValueError(f"tok_frame/tok_row/tok_pos must be [B = {b}, G, N] alike, got {tok_frame.shape}, "
                         f"{tok_row.shape}, {tok_pos.shape}")
    kv = tok_frame.shape[1] * pool_k.shape[2]
    if h % kv:
        raise ValueError(f"H = {h} query heads is not a multiple of KV = G * g = {kv}")
    if seq_len.shape != (b,):
        raise ValueError(f"seq_len must be [B] = [{b}], got {seq_len.shape}")


def ref_token_decode_attention(q, pool_k, pool_v, tok_frame, tok_row, tok_pos, seq_len, *, scale=None,
                               softcap=None):
    """Plain-jnp token decode attention; the contract of `token_decode_attention`."""
    _check(q, pool_k, pool_v, tok_frame, tok_row, tok_pos, seq_len)
    b, nq, h, d = q.shape
    nf, page, g, _ = pool_k.shape
    ng = tok_frame.shape[1]
    r = h // (ng * g)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    fr, rw = jnp.clip(tok_frame, 0, nf - 1), jnp.clip(tok_row, 0, page - 1)
    k = pool_k[fr, rw].astype(jnp.float32)                                      # [B, G, N, g, D]
    used = tok_pos >= 0                                                         # [B, G, N]
    v = jnp.where(used[..., None, None], pool_v[fr, rw].astype(jnp.float32), 0.0)
    qpos = seq_len[:, None] - nq + jnp.arange(nq, dtype=jnp.int32)             # [B, Q]
    vis = used[:, None] & (tok_pos[:, None] <= qpos[:, :, None, None])          # [B, Q, G, N]
    qf = q.astype(jnp.float32).reshape(b, nq, ng, g, r, d)
    s = jnp.einsum("bqGjrd,bGNjd->bqGjrN", qf, k, precision=lax.Precision.HIGHEST) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    vis = vis[:, :, :, None, None, :]                                           # [B, Q, G, 1, 1, N]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(vis, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = jnp.sum(p, axis=-1)                                                   # [B, Q, G, g, r]
    o = jnp.einsum("bqGjrN,bGNjd->bqGjrd", p, v, precision=lax.Precision.HIGHEST)
    o = jnp.where(den[..., None] > 0, o / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    return o.reshape(b, nq, h, d).astype(q.dtype)


def _token_kernel(frame_ref, row_ref, pos_ref, len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, nq, r, g, d,
                  n, nblk, scale, softcap, fp32):
    """One program = one (b, KV head, split). frame_ref, row_ref, pos_ref [B, G, Np] int32 (whole lists); len_ref
    [B]; q_ref [Mp, D] this KV head's query rows (zero-padded); k_ref, v_ref [F, t, g, D] the pool; outputs o_ref
    [Mp, D] f32 unnormalised partial, m_ref, l_ref [Mp] running max and sum."""
    b, kvh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    grp, jj = kvh // g, kvh % g
    mp = q_ref.shape[0]
    length = len_ref[b]
    rows = jnp.arange(mp, dtype=jnp.int32)
    row_pos = jnp.where(rows < nq * r, length - nq + rows // r, -1)            # padding rows see nothing
    q = q_ref[...]
    prec = lax.Precision.HIGHEST if fp32 else None
    shp = (n, d)
    col = jnp.broadcast_to(jnp.arange(d, dtype=jnp.int32)[None, :], shp)
    head = jnp.broadcast_to(jj, shp) if g > 1 else jnp.zeros(shp, jnp.int32)

    def body(i, carry):
        acc, m_run, l_run = carry
        off = (split * nblk + i) * n
        fr = frame_ref[b, grp, pl.ds(off, n)]                                   # [n]
        rw = row_ref[b, grp, pl.ds(off, n)]
        pos = pos_ref[b, grp, pl.ds(off, n)]
        use = pos >= 0
        mask = jnp.broadcast_to(use[:, None], shp)
        at = (jnp.broadcast_to(jnp.where(use, fr, 0)[:, None], shp), jnp.broadcast_to(jnp.where(use, rw, 0)[:, None],
                                                                                        shp), head, col)
        # unused entries are masked lanes: no memory traffic
        k = pltriton.load(k_ref.at[at], mask=mask, other=0)                     # [n, D]
        v = pltriton.load(v_ref.at[at], mask=mask, other=0)
        s = pltriton.dot(q, k, trans_b=True, precision=prec) * scale            # [Mp, n] f32
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        vis = use[None, :] & (pos[None, :] <= row_pos[:, None])                 # [Mp, n]
        s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m_run, jnp.max(s, axis=1))
        corr = jnp.exp(m_run - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = corr * l_run + jnp.sum(p, axis=1)
        pv = pltriton.dot(p.astype(v.dtype), v, precision=prec)                 # [Mp, D] f32
        return corr[:, None] * acc + pv, m_new, l_new

    init = (jnp.zeros((mp, d), jnp.float32), jnp.full((mp,), NEG_INIT, jnp.float32), jnp.zeros((mp,), jnp.float32))
    acc, m_run, l_run = lax.fori_loop(0, nblk, body, init)
    o_ref[...] = acc
    m_ref[...] = m_run
    l_ref[...] = l_run


def default_tuning(batch: int, num_kv: int, num_tokens: int) -> dict:
    """Tokens a block and splits: 64 rows a gather (a 64 x D tile of K and of V in registers, as the page kernel's
    block of 64 tokens), and enough programs to cover the SMs a few times, splits no shorter than two blocks."""
    n = 64
    return dict(num_splits=split_count(batch, num_kv, -(-num_tokens // n)), tokens_per_block=n, num_warps=4,
                num_stages=2)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "interpret", "num_splits", "tokens_per_block",
                                              "num_warps", "num_stages"))
def _pallas_tokens(q, pool_k, pool_v, tok_frame, tok_row, tok_pos, seq_len, *, scale, softcap, interpret,
                   num_splits, tokens_per_block, num_warps, num_stages):
    b, nq, h, d = q.shape
    _, _, g, _ = pool_k.shape
    ng, ntok = tok_frame.shape[1:]
    kv = ng * g
    r = h // kv
    qr, m_rows, mp = query_rows(q, kv)
    n, ns = tokens_per_block, num_splits
    nblk = -(-ntok // (ns * n))
    pad = ns * nblk * n - ntok
    out_shape, out_specs = partial_outputs(b, kv, ns, mp, d)
    kernel = functools.partial(_token_kernel, nq=nq, r=r, g=g, d=d, n=n, nblk=nblk, scale=scale, softcap=softcap,
                               fp32=q.dtype == jnp.float32)
    o, m, l = pl.pallas_call(
        kernel, grid=(b, kv, ns),
        in_specs=[ANY, ANY, ANY, ANY, pl.BlockSpec((None, None, mp, d), lambda i, j, s: (i, j, 0, 0)), ANY, ANY],
        out_specs=out_specs, out_shape=out_shape, interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="token_decode_attention")(pad_last(tok_frame, pad, 0), pad_last(tok_row, pad, 0),
                                       pad_last(tok_pos, pad, -1),
                                       seq_len.astype(jnp.int32), qr, pool_k, pool_v)
    return merge_splits(o, m, l, m_rows=m_rows, nq=nq, r=r).astype(q.dtype)


def token_decode_attention(q, pool_k, pool_v, tok_frame, tok_row, tok_pos, seq_len, *, scale=None, softcap=None,
                           impl="auto", tuning=None):
    """Decode attention of q over each (sequence, group)'s listed tokens, read by (frame, row) from one pool.

    q          [B, Q, H, D]  queries; head h uses KV head h // (H // KV), KV = G * g; KV head j is in group j // g.
    pool_k/v   [F, t, g, D]  the HBM page pool (unscaled pages: the model's dtype).
    tok_frame, tok_row [B, G, N] int32 each token's frame and row in it; tok_pos [B, G, N] int32 its position,
               -1 = unused entry. The set matters, not the order; a token must be listed once.
    seq_len    [B] int32     query i of Q sits at position seq_len - Q + i and sees listed positions <= its own.
    Returns out [B, Q, H, D] in q.dtype (float32 accumulation). impl: 'auto' (the Triton kernel on GPU, the
    reference elsewhere), 'pallas' (the kernel; interpret mode off GPU) or 'ref'. `tuning` overrides
    `default_tuning` (num_splits, tokens_per_block, num_warps, num_stages)."""
    _check(q, pool_k, pool_v, tok_frame, tok_row, tok_pos, seq_len)
    d = q.shape[-1]
    scale = float(1.0 / math.sqrt(d) if scale is None else scale)
    softcap = None if softcap is None else float(softcap)
    if pick_impl(impl) == "ref":
        return ref_token_decode_attention(q, pool_k, pool_v, tok_frame, tok_row, tok_pos, seq_len, scale=scale,
                                          softcap=softcap)
    tune = default_tuning(q.shape[0], tok_frame.shape[1] * pool_k.shape[2], tok_frame.shape[2])
    tune.update(tuning or {})
    return _pallas_tokens(q, pool_k, pool_v, tok_frame, tok_row, tok_pos, seq_len, scale=scale, softcap=softcap,
                          interpret=not on_gpu(), **tune)
