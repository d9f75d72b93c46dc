"""The log-sum-exp merge of split attention partials as one Pallas kernel (Triton lowering).

The Mosaic decode attention splits each (sequence, kv head)'s pages over CTAs (about two a SM) and writes one
partial a split: o normalised within the split, lse its log-sum-exp. XLA merged them in three launches (the
weights, their sum, the weighted sum with the cast), each latency-bound on the decode's per-layer path
(docs/BENCHMARKS.md, decode profile). Here one program merges the splits of one (sequence, kv head, chunk of query
rows) in registers and writes its rows straight into the [B, Q, H, D] output (row i * r + x of kv head j is query
i, head j * r + x), so neither a slice nor a transpose follows it.

Layout (axis letters as in sparse_decode_attention.py): o [B, KV, SP, MR, D] in the query dtype, lse [B, KV, SP,
MR] float32, with SP >= splits a power of two and MR >= M = Q * r query rows a power of two (the Mosaic kernel's
64 wgmma rows). Splits past `splits` are padding the partials kernel never writes: whatever they hold, NaN
included, gets no weight. Rows past M are never stored.
Numerics are the reference's (`ref_merge_splits`) up to the order of the float32 sums over splits.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from . import next_pow2, on_gpu
from .page_copy import _ANY   # the output, written by computed index

TILE_ELEMS = 16384  # the [SP, rows, D] float32 tile a program holds (4 warps: 128 elements a thread)
NUM_WARPS = 4


def ref_merge_splits(o, lse, *, splits: int, nq: int, r: int):
    """out [B, Q, KV * r, D] in o's dtype: the splits' partials weighted by exp(lse - max lse), renormalised; a row
    no split saw (every lse -inf) is 0."""
    b, kv, _, _, d = o.shape
    m = nq * r
    o, lse = o[:, :, :splits, :m], lse[:, :, :splits, :m]                  # [B, KV, S, M, D], [B, KV, S, M]
    top = jnp.max(lse, axis=2, keepdims=True)
    w = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0))               # -inf (nothing seen) -> 0
    den = jnp.sum(w, axis=2)                                               # [B, KV, M]
    num = jnp.sum(jnp.where(w[..., None] > 0, w[..., None] * o.astype(jnp.float32), 0.0), axis=2)
    out = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    return out.reshape(b, kv, nq, r, d).transpose(0, 2, 1, 3, 4).reshape(b, nq, kv * r, d).astype(o.dtype)


def _merge_kernel(o_ref, lse_ref, out_ref, *, splits: int, nq: int, r: int, kv: int, rows: int, d: int):
    # o_ref [SP, rows, D], lse_ref [SP, rows] (this program's block); out_ref [B * Q * KV * r * D] (whole output)
    b, j, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    sp = lse_ref.shape[0]
    real = jax.lax.broadcasted_iota(jnp.int32, (sp, rows), 0) < splits
    lse = jnp.where(real, lse_ref[...], -jnp.inf)                           # [SP, rows]
    top = jnp.max(lse, axis=0)                                             # [rows]
    w = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0)[None, :])      # padding and -inf -> 0
    den = jnp.sum(w, axis=0)                                               # [rows]
    o = o_ref[...].astype(jnp.float32)                                     # [SP, rows, D]
    num = jnp.sum(jnp.where(w[:, :, None] > 0, w[:, :, None] * o, 0.0), axis=0)   # [rows, D]
    out = jnp.where(den[:, None] > 0, num / jnp.where(den > 0, den, 1.0)[:, None], 0.0)
    m = c * rows + jnp.arange(rows, dtype=jnp.int32)                       # query rows of kv head j
    dst = ((b * nq + m // r) * (kv * r) + j * r + m % r) * d               # [rows]: out[b, i, j * r + x, 0]
    idx = dst[:, None] + jnp.arange(d, dtype=jnp.int32)[None, :]           # [rows, D]
    ok = jnp.broadcast_to((m < nq * r)[:, None], (rows, d))
    size = out_ref.shape[0]
    # masked lanes point past the end: never touched compiled, dropped in interpret mode
    pltr.store(out_ref.at[jnp.where(ok, idx, size)], out.astype(out_ref.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("splits", "nq", "r", "interpret"))
def _merge_pallas(o, lse, *, splits: int, nq: int, r: int, interpret: bool):
    b, kv, sp, mr, d = o.shape
    m = nq * r
    rows = max(1, min(next_pow2(m), TILE_ELEMS // (sp * d)))
    body = functools.partial(_merge_kernel, splits=splits, nq=nq, r=r, kv=kv, rows=rows, d=d)
    out = pl.pallas_call(
        body, grid=(b, kv, -(-m // rows)), interpret=interpret, name="merge_splits",
        in_specs=[pl.BlockSpec((None, None, sp, rows, d), lambda i, j, c: (i, j, 0, c, 0)),
                  pl.BlockSpec((None, None, sp, rows), lambda i, j, c: (i, j, 0, c))],
        out_specs=_ANY, out_shape=jax.ShapeDtypeStruct((b * nq * kv * r * d,), o.dtype),
        compiler_params=None if interpret else pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    )(o, lse)
    return out.reshape(b, nq, kv * r, d)


def merge_splits(o, lse, *, splits: int, nq: int, r: int, impl: str = "auto"):
    """out [B, Q, KV * r, D] (o's dtype) from per-split partials o [B, KV, SP, MR, D] and lse [B, KV, SP, MR]
    float32 (module docstring). impl: "auto" (the kernel on GPU, the reference elsewhere), "pallas" (the kernel;
    interpret mode off GPU), "ref"."""
    if impl not in ("auto", "pallas", "ref"):
        raise ValueError(f"impl = {impl!r} must be 'auto', 'pallas' or 'ref'")
    b, kv, sp, mr, d = o.shape
    if lse.shape != o.shape[:4] or lse.dtype != jnp.float32:
        raise ValueError(f"merge_splits: lse {lse.shape} {lse.dtype} must be {o.shape[:4]} float32")
    if not 1 <= splits <= sp or nq * r > mr or nq < 1 or r < 1:
        raise ValueError(f"merge_splits: splits = {splits} must be in [1, {sp}] and nq * r = {nq} * {r} at most the "
                         f"{mr} partial rows")
    pow2 = not (sp & (sp - 1) or mr & (mr - 1) or d & (d - 1))       # the kernel's blocks are powers of two
    if impl == "auto":
        impl = "pallas" if on_gpu() and pow2 else "ref"
    if impl == "ref":
        return ref_merge_splits(o, lse, splits=splits, nq=nq, r=r)
    if not pow2:
        raise ValueError(f"merge_splits: the kernel needs powers of two for SP, MR and D, got {o.shape}")
    return _merge_pallas(o, lse, splits=splits, nq=nq, r=r, interpret=not on_gpu())
