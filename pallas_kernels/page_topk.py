"""Top-k page selection as a Pallas kernel: a radix select per row instead of XLA's sort-based top-k.

XLA's top-k over one layer's page scores costs as much as the sieve and the vTLB update together (docs/
BENCHMARKS.md, layer stages). Here one program owns one row:
1. each score becomes an order-preserving uint32 key (sign flip; -0.0 is folded into +0.0 first, so equal floats
   get equal keys);
2. the k-th largest key T is found from the top, `bits` bits a pass (32 / bits passes, in registers): a pass counts
   count(key >= T | d << s) for every digit d of `bits` bits at once, two 16-bit counters packed in a uint32, in
   ONE block reduction. Why: the passes run one after another and each reduction ends in a cross-warp barrier;
   the price is 2^bits - 1 compares an element a pass instead of one (scripts/probes/topk_variants.py times it);
3. the selected set is every key > T plus the lowest-index keys == T up to k (the same tie rule as `lax.top_k`),
   compacted by ONE prefix sum (counts of keys > T and == T packed in a uint32) and scattered to the output in
   index order.
bits = 1 runs the first version (`_topk_kernel_1bit`: 32 one-bit passes, one sum a pass, two prefix sums), kept
to time against the packed passes (scripts/probes/topk_variants.py); bits >= 2 runs `_topk_kernel`.
The k winners are then sorted by (score descending, index ascending) in XLA (k values a row), so the result is
exactly `ref_top_k`'s (`lax.top_k` over scores with -0.0 folded into +0.0): same values (bit for bit for bits >= 2;
the first version returns a -0.0 score as -0.0), indices and order.
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


def _topk_kernel_1bit(s_ref, v_ref, i_ref, *, k: int, kp: int, pp: int):
    # the first version (bits = 1): remove it, and `bits`, once the probe has picked the packed passes or not
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


_LO16, _HI1 = np.uint32(0xFFFF), np.uint32(1 << 16)  # packed counters: one in the low, one in the high 16 bits


def _radix_pass(key, t, above, s, *, w: int, k: int):
    """The next w bits of the k-th largest key, from one block reduction.

    key [Pp] uint32. t: the threshold so far (bits below s + w zero; count(key >= t) >= k). above: count(key >=
    t + 2^(s + w)), the keys above t's bucket (< k). Returns (t | D << s, count(key >= t + (D + 1) << s)), D the
    largest digit with count(key >= t | D << s) >= k."""
    r = 1 << max(w - 1, 0)  # rows: the 2^w - 1 digits d >= 1 two to a row (2 r fields, one spare); r a power of two
    d = lax.broadcasted_iota(jnp.int32, (r, 1), 0).astype(jnp.uint32) + np.uint32(1)   # [r, 1] digits d, d + r
    # key >= c as key > c - 1 (c >= 1): the spare field (digit 2^w) compares against the largest uint32, so it
    # counts nothing (no key is 0xFFFFFFFF: that is a NaN's)
    lo = (t | (d << s)) - np.uint32(1)                                                   # [r, 1]
    hi = jnp.where(d + r < (1 << w), (t | ((d + r) << s)) - np.uint32(1), np.uint32(0xFFFFFFFF))   # [r, 1]
    kk = key[None, :]                                                                    # [1, Pp]
    packed = (kk > lo).astype(jnp.uint32) + jnp.where(kk > hi, _HI1, np.uint32(0))      # [r, Pp]
    tot = jnp.sum(packed, axis=1)     # [r]: fields <= Pp <= 2^15, so neither 16-bit counter carries over
    n_lo, n_hi = tot & _LO16, tot >> np.uint32(16)                                       # [r] n_d, n_{d + r}
    # the counts fall as d grows: D = how many reach k, and the largest count below k, n_{D + 1} (`above` when D is
    # the top digit), counts the keys above the new bucket
    digit = jnp.sum((n_lo >= k).astype(jnp.uint32) + (n_hi >= k).astype(jnp.uint32))
    below = jnp.maximum(jnp.where(n_lo < k, n_lo, np.uint32(0)), jnp.where(n_hi < k, n_hi, np.uint32(0)))
    return t | (digit << s), jnp.maximum(above, jnp.max(below))


def _topk_kernel(s_ref, v_ref, i_ref, *, k: int, kp: int, pp: int, bits: int):
    # s_ref [Pp] float32 (one row); v_ref [kp] float32, i_ref [kp] int32: the k winners in index order
    x = s_ref[...]
    x = jnp.where(x == 0, jnp.float32(0), x)      # [Pp]: -0.0 comes out as +0.0, as from `ref_top_k`, bit for bit
    key = _sort_keys(x)                                                                  # [Pp] uint32
    idx = jnp.arange(pp, dtype=jnp.int32)

    def step(i, carry):  # pass i: bits 32 - bits (i + 1) .. 32 - bits i - 1
        return _radix_pass(key, *carry, np.uint32(32 - bits) - i.astype(jnp.uint32) * np.uint32(bits), w=bits, k=k)

    t, above = lax.fori_loop(0, 32 // bits, step, (jnp.uint32(0), jnp.uint32(0)))
    if 32 % bits:  # the lowest 32 mod bits bits: one narrower pass
        t, above = _radix_pass(key, t, above, np.uint32(0), w=32 % bits, k=k)
    # now above = count(key > t) < k <= count(key >= t)
    gt, eq = key > t, key == t                                                           # [Pp]
    need = np.uint32(k) - above                                    # ties to take, lowest index first
    u = gt.astype(jnp.uint32) + jnp.where(eq, _HI1, np.uint32(0))  # [Pp]: one prefix sum counts both
    before = jnp.cumsum(u) - u                                     # [Pp] exclusive: keys > t, == t before each
    n_gt, n_eq = before & _LO16, before >> np.uint32(16)
    sel = gt | (eq & (n_eq < need))
    pos = jnp.where(sel, (n_gt + jnp.minimum(n_eq, need)).astype(jnp.int32), kp)    # masked lanes point past the end
    plgpu.store(v_ref.at[pos], x, mask=sel)
    plgpu.store(i_ref.at[pos], idx, mask=sel)


@functools.partial(jax.jit, static_argnames=("k", "interpret", "num_warps", "bits"))
def top_k_pallas(s, k: int, *, interpret: bool = False, num_warps: int | None = None, bits: int = 1):
    """s [..., P] float32 (no NaN) -> (values [..., k], indices [..., k] int32), exactly `lax.top_k(s, k)`.
    bits: threshold bits resolved a pass (1: the first kernel; 2..8: packed passes)."""
    *lead, p = s.shape
    if not 1 <= k <= p:
        raise ValueError(f"k = {k} must be in [1, {p}] (the last axis)")
    rows = int(np.prod(lead)) if lead else 1
    pp, kp = next_pow2(p), next_pow2(k)
    if not 1 <= bits <= 8 or (bits > 1 and pp > 1 << 15):  # 16-bit counters; 2^(bits - 1) rows of Pp in registers
        raise ValueError(f"bits = {bits} must be in [1, 8], and 1 for rows over 32768 (P = {p})")
    kernel = (functools.partial(_topk_kernel_1bit, k=k, kp=kp, pp=pp) if bits == 1 else
              functools.partial(_topk_kernel, k=k, kp=kp, pp=pp, bits=bits))
    x = jnp.pad(s.reshape(rows, p).astype(jnp.float32), ((0, 0), (0, pp - p)), constant_values=-jnp.inf)
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps or (8 if pp >= 4096 else 4),
                                                         num_stages=1)
    v, i = pl.pallas_call(
        kernel, grid=(rows,), interpret=interpret,
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
