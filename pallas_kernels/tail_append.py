"""The tail append as one Pallas kernel: new tokens' K/V written into their tail-ring pages and, for a decode step,
each page's key summary (per-dim min and max of K) updated, in one launch instead of four XLA scatters.

Why: a decode layer appends one token per sequence before it selects; XLA emits a scatter for each of K, V, the
min and the max summary (four launches of a few microseconds each on the per-layer critical path, docs/
BENCHMARKS.md, decode profile). Here one program owns one (sequence, row, group): it reads its frame, offset and
sub-page as scalars and writes the [g, D] rows in place (every output is aliased to its input, so only the
addressed rows are written, never a whole pool).

Layouts (the cache state's, ulacache_jax/cache/state.py; R = the rank axis, indexed 0 here: each rank's state
is local under shard_map):
- pool_k, pool_v [R, F, page, g, D]; kmin, kmax [R, S, L, G, nsub, g, D].
- k, v [S, Q, G, g, D] (Q rows per sequence: 1 for a decode step, K + 1 for speculative leases);
- frame [S, Q, G] int32: the destination frame, out of [0, F) = skip (a dead slot, a row past nrows);
- off [S, Q] int32: the token's row in its page;
- sub [S] int32 (decode only): the summary sub-page, out of [0, nsub) = skip; first [S] int32: 1 where the token
  starts its sub-page (the summary is reset to it, not min/max-ed with the page's previous tokens).
Contract: the valid (frame, off) pairs of one call are distinct (one writer per row), as the tail ring gives.
The reference is the XLA scatter form (`ref_tail_append`); the two agree bit for bit (min and max are exact,
written as compare + select in both: `summary_min`).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from . import pick_impl, on_gpu
from .page_copy import _ANY, _out_struct   # whole operands addressed by index; aliased outputs' types


def _append_kernel(*refs, layer: int, num_frames: int, nsub: int, rows: int, groups: int, summaries: bool):
    # refs: frame [S*Q*G], off [S*Q], (sub [S], first [S]), k, v [S, Q, G, g, D], then the aliased inputs (never
    # read: the outputs alias them) and the outputs pool_k, pool_v [R, F, page, g, D], (kmin, kmax [R, S, L, G,
    # nsub, g, D]).
    n_out = 4 if summaries else 2
    frame_ref, off_ref = refs[0], refs[1]
    i = 2
    if summaries:
        sub_ref, first_ref = refs[2], refs[3]
        i = 4
    k_ref, v_ref = refs[i], refs[i + 1]
    outs = refs[-n_out:]
    s, q, gi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f = frame_ref[(s * rows + q) * groups + gi]
    o = off_ref[s * rows + q]
    k = k_ref[s, q, gi]                                                       # [g, D]
    v = v_ref[s, q, gi]

    @pl.when((f >= 0) & (f < num_frames))
    def _ring():
        outs[0][0, f, o] = k
        outs[1][0, f, o] = v

    if summaries:
        p = sub_ref[s]
        reset = first_ref[s] != 0

        @pl.when((p >= 0) & (p < nsub))
        def _summary():
            lo = outs[2][0, s, layer, gi, p]                                  # [g, D]
            hi = outs[3][0, s, layer, gi, p]
            outs[2][0, s, layer, gi, p] = summary_min(lo, k, reset)
            outs[3][0, s, layer, gi, p] = summary_max(hi, k, reset)


def summary_min(old, k, reset):
    """The min summary after token k: k where it resets the sub-page, else min(old, k) as compare + select, so
    XLA and Triton agree bit for bit (their `minimum`s differ on NaN and on -0.0 vs +0.0: `minimum` compiled in
    the kernel did not match XLA's on the H200): a NaN on either side stays NaN, a tie keeps the old value."""
    return jnp.where(reset | (k < old) | (k != k), k, old)


def summary_max(old, k, reset):
    """The max summary after token k: as `summary_min` with the order reversed."""
    return jnp.where(reset | (k > old) | (k != k), k, old)


def _check(pool_k, k, frame, off, kmin, sub):
    S, Q, G, g, D = k.shape
    if pool_k.ndim != 5 or pool_k.shape[-2:] != (g, D) or pool_k.dtype != k.dtype:
        raise ValueError(f"tail_append: pool {pool_k.shape} {pool_k.dtype} does not take rows {k.shape[-2:]} "
                         f"{k.dtype} (expected [R, F, page, {g}, {D}] of the rows' dtype)")
    if frame.shape != (S, Q, G) or off.shape != (S, Q):
        raise ValueError(f"tail_append: frame {frame.shape} / off {off.shape} must be {(S, Q, G)} / {(S, Q)}")
    if kmin is not None and (Q != 1 or sub.shape != (S,) or kmin.shape[1] != S or kmin.shape[3] != G
                             or kmin.shape[-2:] != (g, D)):
        raise ValueError(f"tail_append: summaries need one row a sequence and kmin [R, {S}, L, {G}, nsub, {g}, "
                         f"{D}], got Q = {Q}, kmin {kmin.shape}, sub {sub.shape}")


def tail_append_pallas(pool_k, pool_v, k, v, frame, off, kmin=None, kmax=None, sub=None, first=None, *,
                       layer: int = 0, interpret: bool | None = None):
    """Write rows k, v [S, Q, G, g, D] into pool_k, pool_v [R, F, page, g, D] at (frame [S, Q, G], off [S, Q]) of
    rank 0, and with kmin/kmax (Q = 1) update layer `layer`'s summaries at sub-page sub [S] (reset where first [S]).
    Returns (pool_k, pool_v) or (pool_k, pool_v, kmin, kmax); every output aliases its input (donate them, or
    call inside the jit that owns them)."""
    _check(pool_k, k, frame, off, kmin, sub)
    S, Q, G, g, D = k.shape
    if interpret is None:
        interpret = not on_gpu()
    summaries = kmin is not None
    idx = [frame.reshape(-1).astype(jnp.int32), off.reshape(-1).astype(jnp.int32)]
    if summaries:
        idx += [sub.astype(jnp.int32), first.astype(jnp.int32)]
    targets = [pool_k, pool_v] + ([kmin, kmax] if summaries else [])
    n_in = len(idx) + 2
    body = functools.partial(_append_kernel, layer=layer, num_frames=pool_k.shape[1],
                             nsub=kmin.shape[4] if summaries else 0, rows=Q, groups=G, summaries=summaries)
    kwargs = {} if interpret else {"compiler_params": pltr.CompilerParams(num_warps=1, num_stages=1)}
    out = pl.pallas_call(
        body, grid=(S, Q, G), interpret=interpret, name="tail_append",
        out_shape=[_out_struct(t) for t in targets],
        in_specs=[_ANY] * (n_in + len(targets)), out_specs=[_ANY] * len(targets),
        input_output_aliases={n_in + a: a for a in range(len(targets))}, **kwargs,
    )(*idx, k, v, *targets)
    return tuple(out)


def ref_tail_append(pool_k, pool_v, k, v, frame, off, kmin=None, kmax=None, sub=None, first=None, *,
                    layer: int = 0):
    """The reference: XLA scatters with the kernel's skipping rule (same signature and result)."""
    _check(pool_k, k, frame, off, kmin, sub)
    S, Q, G, g, D = k.shape
    F = pool_k.shape[1]
    fr = jnp.where((frame >= 0) & (frame < F), frame, F)                                # [S, Q, G], F = dropped
    offs = jnp.broadcast_to(off[..., None], (S, Q, G))
    pool_k = pool_k.at[0, fr, offs].set(k, mode="drop")
    pool_v = pool_v.at[0, fr, offs].set(v, mode="drop")
    if kmin is None:
        return pool_k, pool_v
    nsub = kmin.shape[4]
    s = jnp.arange(S)[:, None]
    gi = jnp.arange(G)[None, :]
    pg = jnp.broadcast_to(jnp.where((sub >= 0) & (sub < nsub), sub, nsub)[:, None], (S, G))  # nsub = dropped
    reset = (first != 0)[:, None, None, None]
    kq = k[:, 0]                                                                     # [S, G, g, D]
    old_min = kmin[0, s, layer, gi, jnp.minimum(pg, nsub - 1)]                       # [S, G, g, D]
    old_max = kmax[0, s, layer, gi, jnp.minimum(pg, nsub - 1)]
    kmin = kmin.at[0, s, layer, gi, pg].set(summary_min(old_min, kq, reset), mode="drop")
    kmax = kmax.at[0, s, layer, gi, pg].set(summary_max(old_max, kq, reset), mode="drop")
    return pool_k, pool_v, kmin, kmax


def kernel_applies(g: int, head_dim: int) -> bool:
    """Triton blocks are powers of two: a [g, D] row block needs both to be."""
    return g & (g - 1) == 0 and head_dim & (head_dim - 1) == 0


def tail_append(pool_k, pool_v, k, v, frame, off, kmin=None, kmax=None, sub=None, first=None, *, layer: int = 0,
                impl: str = "auto"):
    """impl: 'pallas' (the kernel; interpret mode off GPU), 'ref' (XLA scatters) or 'auto' (the kernel on GPU).
    Rows whose [g, D] block is not a power of two in each dim take the reference."""
    if pick_impl(impl) == "ref" or not kernel_applies(k.shape[3], k.shape[4]):
        return ref_tail_append(pool_k, pool_v, k, v, frame, off, kmin, kmax, sub, first, layer=layer)
    return tail_append_pallas(pool_k, pool_v, k, v, frame, off, kmin, kmax, sub, first, layer=layer)
