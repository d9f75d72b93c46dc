"""Top-k page selection as a Pallas kernel: a radix select per row instead of XLA's sort-based top-k.

XLA's top-k over one layer's page scores costs as much as the sieve and the vTLB update together (docs/
BENCHMARKS.md, layer stages). Here one program owns one row:
1. each score becomes an order-preserving uint32 key (sign flip; -0.0 is folded into +0.0 first, so equal floats
   get equal keys);
2. the k-th largest key T is found bit by bit from the top (32 passes of a count over the row, in registers);
3. the selected set is every key > T plus the lowest-index keys == T up to k (the same tie rule as `lax.top_k`),
   compacted by a prefix sum and scattered to the output in index order.
The k winners are then sorted by (score descending, index ascending) in XLA (k values a row), so the result is
exactly `ref_top_k`'s (`lax.top_k` over scores with -0.0 folded into +0.0): same values, indices and order.
Axis alphabet: R rows, P pages (Pp: padded to a power of two with -inf, never chosen before a real page), k
winners (kp: padded to a power of two).
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


def _sort_keys(x):
    """float32 -> uint32 whose unsigned order is the float order (-inf lowest, +inf highest; -0.0 == +0.0)."""
    # -0.0 -> +0.0 by a select: `x + 0.0` did it compiled, but XLA simplified it away in interpret mode
    bits = lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    neg = (bits >> np.uint32(31)) == np.uint32(1)
    return jnp.where(neg, ~bits, bits | np.uint32(0x80000000))


def _topk_kernel(s_ref, v_ref, i_ref, *, k: int, kp: int, pp: int):
    # s_ref [Pp] float32 (one row); v_ref [kp] float32, i_ref [kp] int32: the k winners in index order
    x = s_ref[...]
    key = _sort_keys(x)
    idx = jnp.arange(pp, dtype=jnp.int32)

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
    plgpu.store(v_ref.at[pos], x, mask=sel)
    plgpu.store(i_ref.at[pos], idx, mask=sel)


@functools.partial(jax.jit, static_argnames=("k", "interpret", "num_warps"))
def top_k_pallas(s, k: int, *, interpret: bool = False, num_warps: int | None = None):
    """s [..., P] float32 (no NaN) -> (values [..., k], indices [..., k] int32), exactly `lax.top_k(s, k)`."""
    *lead, p = s.shape
    if not 1 <= k <= p:
        raise ValueError(f"k = {k} must be in [1, {p}] (the last axis)")
    rows = int(np.prod(lead)) if lead else 1
    pp, kp = next_pow2(p), next_pow2(k)
    x = jnp.pad(s.reshape(rows, p).astype(jnp.float32), ((0, 0), (0, pp - p)), constant_values=-jnp.inf)
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps or (8 if pp >= 4096 else 4),
                                                         num_stages=1)
    v, i = pl.pallas_call(
        functools.partial(_topk_kernel, k=k, kp=kp, pp=pp), grid=(rows,), interpret=interpret,
        in_specs=[pl.BlockSpec((None, pp), lambda r: (r, 0))],
        out_specs=[pl.BlockSpec((None, kp), lambda r: (r, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((rows, kp), jnp.float32), jax.ShapeDtypeStruct((rows, kp), jnp.int32)],
        name="page_top_k", **kwargs)(x)
    v, i = v[:, :k], i[:, :k]
    # lax.top_k's order: score descending, lower index first among equal scores (k values a row: cheap)
    neg, i = lax.sort((-v, i), dimension=1, num_keys=2)
    return (-neg).reshape(*lead, k), i.reshape(*lead, k)


def ref_top_k(s, k: int):
    """The reference: `lax.top_k` (XLA's) with -0.0 folded into +0.0 first, so equal scores tie, lowest index
    first. Why: XLA's top-k ranks +0.0 above -0.0 (a total order), which the kernel's keys do not."""
    s = s.astype(jnp.float32)
    v, i = lax.top_k(jnp.where(s == 0, jnp.float32(0), s), k)  # a select, not `+ 0.0`, which XLA may simplify away
    return v, i.astype(jnp.int32)


def top_k(s, k: int, *, impl: str = "ref"):
    """impl: 'ref' (lax.top_k), 'pallas' (the kernel; interpret mode off GPU) or 'auto' (the kernel on GPU,
    lax.top_k elsewhere)."""
    if pick_impl(impl) == "ref":
        return ref_top_k(s, k)
    return top_k_pallas(s, k, interpret=not on_gpu())
