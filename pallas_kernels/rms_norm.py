"""Residual add + RMSNorm as one Pallas kernel (Triton lowering) for the few rows of a decode step.

Why: XLA runs `h = x + delta; y = weight * rmsnorm(h)` as three launches at decode (the add, the sum of squares,
the scaling), each latency-bound at a few rows, twice a layer (docs/BENCHMARKS.md, decode profile). Here one
program owns one row: it reads x, delta and the weight once and writes h and y, one launch in all.

Numerics are the model's RMSNorm (transformers' order): h = x + delta rounded to x's dtype, normalised in float32,
cast back to x's dtype, then scaled by the weight in that dtype. Only the float32 sum of squares is reduced in
another order than XLA's, so outputs agree with `ref_add_rms_norm` to float32 rounding before the final cast.

Layout: x, delta [N, E] (rows flattened by the caller), weight [E]. A row of E elements is one block of
next_pow2(E) lanes; when E is not a power of two (SmolLM2: 576) the lanes past E are masked on every load and
store (gathers by index, so no lane ever addresses the next row).
`impl="auto"` runs the kernel on GPU for up to MAX_ROWS rows (decode and verification) and the reference
elsewhere: a long prefill's rows are bandwidth-bound, where XLA's fusions are already at their floor.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from . import next_pow2, on_gpu
from .page_copy import _ANY   # whole operands, addressed by row inside the kernel

MAX_ROWS = 256     # rows up to which impl="auto" takes the kernel: a decode step's sequences x query rows
NUM_WARPS = 4      # 128 threads over a row of 4096 lanes: 32 a thread


def ref_add_rms_norm(x, delta, weight, eps: float):
    """(h, y): h = x + delta (x where delta is None) in x's dtype, y = weight * (h normalised in float32, cast back
    to h's dtype); x, delta [..., E], weight [E]."""
    h = x if delta is None else x + delta
    h32 = h.astype(jnp.float32)
    y = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
    return h, weight * y.astype(h.dtype)


def _norm_kernel(*refs, n: int, e: int, lanes: int, eps: float, has_delta: bool):
    # refs: x [N * E], (delta [N * E]), weight [E], then the outputs (h [N * E] when has_delta), y [N * E]
    if has_delta:
        x_ref, d_ref, w_ref, h_ref, y_ref = refs
    else:
        x_ref, w_ref, y_ref = refs
    row = pl.program_id(0)
    cols = jnp.arange(lanes, dtype=jnp.int32)
    full = lanes == e
    mask = None if full else cols < e

    # masked lanes point past the operand's end: never touched compiled, dropped in interpret mode (a lane
    # pointing into the row instead would race the real lane's store there)
    def load(ref, base, size):
        if full:
            return ref[pl.ds(base, e)]
        return pltr.load(ref.at[jnp.where(mask, base + cols, size)], mask=mask, other=0)

    def store(ref, base, val):   # outputs are all [N * E]
        if full:
            ref[pl.ds(base, e)] = val
        else:
            pltr.store(ref.at[jnp.where(mask, base + cols, n * e)], val, mask=mask)

    base, size = row * e, n * e
    h = load(x_ref, base, size)                                                      # [lanes] x dtype
    if has_delta:
        h = h + load(d_ref, base, size)
        store(h_ref, base, h)
    h32 = h.astype(jnp.float32)
    ms = jnp.sum(h32 * h32) / e                       # masked lanes loaded as 0: they add nothing
    y = (h32 * jax.lax.rsqrt(ms + eps)).astype(h.dtype)
    store(y_ref, base, load(w_ref, 0, e) * y)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _add_rms_norm_pallas(x, delta, weight, *, eps: float, interpret: bool):
    shape, e = x.shape, x.shape[-1]
    n = x.size // e
    has_delta = delta is not None
    flat = [x.reshape(-1)] + ([delta.reshape(-1)] if has_delta else []) + [weight]
    out = jax.ShapeDtypeStruct((n * e,), x.dtype)
    body = functools.partial(_norm_kernel, n=n, e=e, lanes=next_pow2(e), eps=eps, has_delta=has_delta)
    body.__name__ = "add_rms_norm" if has_delta else "rms_norm"    # the kernel's name in profiles
    res = pl.pallas_call(
        body, grid=(n,), interpret=interpret, name=body.__name__,
        out_shape=[out, out] if has_delta else [out],
        in_specs=[_ANY] * len(flat), out_specs=[_ANY] * (2 if has_delta else 1),
        compiler_params=None if interpret else pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    )(*flat)
    h, y = (res[0], res[1]) if has_delta else (x.reshape(-1), res[0])
    return h.reshape(shape), y.reshape(shape)


def add_rms_norm(x, delta, weight, eps: float, *, impl: str = "auto"):
    """(h, y) = (x + delta, weight * RMSNorm(x + delta)) in one launch; delta None: (x, weight * RMSNorm(x)).

    x, delta [..., E] (same shape and dtype), weight [E] (the kernel needs x's dtype). impl: "auto" (the kernel on GPU for up to
    MAX_ROWS rows, else the reference), "pallas" (the kernel; interpret mode off GPU), "ref"."""
    if impl not in ("auto", "pallas", "ref"):
        raise ValueError(f"impl = {impl!r} must be 'auto', 'pallas' or 'ref'")
    e = x.shape[-1]
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"add_rms_norm: delta {delta.shape} {delta.dtype} must match x {x.shape} {x.dtype}")
    if weight.shape != (e,):
        raise ValueError(f"add_rms_norm: weight {weight.shape} must be ({e},), the last axis of x {x.shape}")
    rows = x.size // max(e, 1)
    if impl == "auto":
        impl = "pallas" if on_gpu() and 0 < rows <= MAX_ROWS and weight.dtype == x.dtype else "ref"
    if impl == "ref" or x.size == 0:
        return ref_add_rms_norm(x, delta, weight, eps)
    if weight.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: the kernel scales in x's dtype {x.dtype}; weight is {weight.dtype}")
    return _add_rms_norm_pallas(x, delta, weight, eps=float(eps), interpret=not on_gpu())
