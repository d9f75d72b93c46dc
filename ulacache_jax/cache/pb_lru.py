"""Parallel bucketed LRU (PB-LRU): one rank's frame-choice state and its reference batch access.

Exact batch semantics (DESIGN.md section 5), which the Pallas sieve (`impl="pallas"`) reproduces bit for bit:
- a valid request whose LID is held by a slot of its bucket is a hit; the slot's stamp becomes `now`;
  duplicates of one LID in a batch share the frame and the hit flag;
- the distinct missing LIDs of a bucket, in order of first appearance, take the bucket's candidate slots in
  order: the slots not hit in this batch, by (stamp ascending, slot ascending); empty slots have stamp -1 so
  they come first. A filled slot reports the LID it displaced. Misses past the candidates get frame -1
  (served from the host tier this step, not cached). Exactly one request per filled frame reports `fill`: the
  missing LID's first appearance (lowest index), so a caller fetches each new frame once;
- frame id = bucket * slots_per_bucket + slot; num_buckets = 1 is exactly a global LRU.

Both implementations live in `pallas_kernels/pb_lru_sieve.py` (the kernel and its sort-based jnp reference, arrays
in and arrays out); this module holds the state types, checks arguments, and wraps their arrays.
"""
from __future__ import annotations

import dataclasses
import heapq
from functools import partial

import numpy as np
import jax
import jax.numpy as jnp

from ulacache_jax.cache import lid as lid_mod
from ulacache_jax.pallas_kernels import pb_lru_sieve
from ulacache_jax.pallas_kernels.pb_lru_sieve import EMPTY_STAMP, EMPTY_TAG  # noqa: F401  (part of this module's API)


@partial(jax.tree_util.register_dataclass, data_fields=["tag_hi", "tag_lo", "stamp"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PBLRUState:
    tag_hi: jax.Array  # [B, S] uint32  hi word of the LID held by each slot
    tag_lo: jax.Array  # [B, S] uint32  lo word
    stamp: jax.Array   # [B, S] int32   clock of the last hit or fill; -1 = empty

    @property
    def num_buckets(self) -> int:
        return self.stamp.shape[-2]

    @property
    def slots_per_bucket(self) -> int:
        return self.stamp.shape[-1]

    @property
    def num_frames(self) -> int:
        return self.num_buckets * self.slots_per_bucket


@partial(jax.tree_util.register_dataclass,
         data_fields=["frame", "hit", "evicted", "evicted_hi", "evicted_lo", "fill"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class AccessOut:
    frame: jax.Array       # [N] int32   frame of the request's page; -1 for invalid or overflow
    hit: jax.Array         # [N] bool    the page was resident before this batch
    evicted: jax.Array     # [N] bool    on the first occurrence of a missing LID whose fill displaced a LID
    evicted_hi: jax.Array  # [N] uint32  the displaced LID (EMPTY_TAG where evicted is False)
    evicted_lo: jax.Array  # [N] uint32
    fill: jax.Array        # [N] bool    the first occurrence of a missing LID that took a frame (one per new frame)


def init(num_buckets: int, slots_per_bucket: int) -> PBLRUState:
    """An empty PB-LRU of num_buckets (a power of two) x slots_per_bucket frames."""
    lid_mod.log2_buckets(num_buckets)
    if isinstance(slots_per_bucket, bool) or not isinstance(slots_per_bucket, (int, np.integer)) \
            or slots_per_bucket < 1:
        raise ValueError(f"slots_per_bucket = {slots_per_bucket!r} must be an int >= 1")
    if num_buckets * slots_per_bucket >= 2**31:
        raise ValueError(f"num_frames = {num_buckets} x {slots_per_bucket} must be < 2**31 (int32 frame ids)")
    shape = (num_buckets, slots_per_bucket)
    return PBLRUState(tag_hi=jnp.full(shape, EMPTY_TAG, jnp.uint32), tag_lo=jnp.full(shape, EMPTY_TAG, jnp.uint32),
                      stamp=jnp.full(shape, EMPTY_STAMP, jnp.int32))


def _check_access_args(state: PBLRUState, hi, lo, valid, now) -> None:
    if not isinstance(state, PBLRUState):
        raise TypeError(f"state must be a PBLRUState, got {type(state).__name__}")
    if state.stamp.ndim != 2:
        raise ValueError(f"state must be one rank's [B, S] PB-LRU, got stamp shape {state.stamp.shape}")
    for name, x, dt in (("hi", hi, jnp.uint32), ("lo", lo, jnp.uint32), ("valid", valid, jnp.bool_)):
        if jnp.ndim(x) != 1:
            raise ValueError(f"{name} must be 1-D [N], got shape {jnp.shape(x)}")
        if jnp.result_type(x) != dt:
            raise TypeError(f"{name} must be {jnp.dtype(dt).name}, got {jnp.result_type(x)}")
    if not (jnp.shape(hi) == jnp.shape(lo) == jnp.shape(valid)):
        raise ValueError(f"hi, lo and valid must share one shape, got {jnp.shape(hi)}, {jnp.shape(lo)}, "
                         f"{jnp.shape(valid)}")
    if jnp.ndim(now) != 0 or not jnp.issubdtype(jnp.result_type(now), jnp.integer):
        raise TypeError(f"now must be an integer scalar, got {jnp.result_type(now)} of shape {jnp.shape(now)}")
    if not isinstance(now, jax.core.Tracer) and not (0 <= int(now) < 2**31 - 1):
        raise ValueError(f"now = {int(now)} must be in [0, 2**31 - 2] (stamps are int32, -1 means empty)")


def access(state: PBLRUState, hi, lo, valid, now, impl: str = "ref") -> tuple[PBLRUState, AccessOut]:
    """One batch of page requests at clock `now`. hi, lo [N] uint32; valid [N] bool; now int scalar >= 0.

    impl: "ref" (vectorised jnp, any backend) or "pallas" (one program per bucket; interpret mode on CPU)."""
    _check_access_args(state, hi, lo, valid, now)
    if impl not in ("ref", "pallas"):
        raise ValueError(f"impl = {impl!r} must be 'ref' or 'pallas'")
    fn = ref_access if impl == "ref" else _kernel_access
    return fn(state, jnp.asarray(hi), jnp.asarray(lo), jnp.asarray(valid), jnp.asarray(now, jnp.int32))


def _wrap(slots, out) -> tuple[PBLRUState, AccessOut]:
    return PBLRUState(*slots), AccessOut(*out)


def _slots(state: PBLRUState):
    return state.tag_hi, state.tag_lo, state.stamp


def ref_access(state: PBLRUState, hi, lo, valid, now) -> tuple[PBLRUState, AccessOut]:
    """Sort-based reference of `access` (jitted; no argument checks; see `access`)."""
    return _wrap(*pb_lru_sieve.ref_access(_slots(state), hi, lo, valid, now))


def _kernel_access(state: PBLRUState, hi, lo, valid, now) -> tuple[PBLRUState, AccessOut]:
    return _wrap(*pb_lru_sieve.access(_slots(state), hi, lo, valid, now))


def rebase(state: PBLRUState, offset) -> PBLRUState:
    """Every stamp moved `offset` ticks back (int32 scalar >= 0), clamped at 0; empty slots stay empty. Order among
    slots younger than `offset` ticks is unchanged; older ones tie at 0, and ties break by slot index (section 5),
    so the clock can be wound back before int32 overflows without changing recent recency order."""
    off = jnp.asarray(offset, jnp.int32)
    stamp = jnp.where(state.stamp >= 0, jnp.maximum(state.stamp - off, 0), state.stamp)
    return PBLRUState(tag_hi=state.tag_hi, tag_lo=state.tag_lo, stamp=stamp)


def release(state: PBLRUState, seq) -> PBLRUState:
    """Empty every slot whose tag belongs to sequence `seq` (an int or int32 scalar)."""
    if not isinstance(seq, jax.core.Tracer):
        lid_mod.check_field("seq", np.asarray(seq))
    return release_traced(state, jnp.asarray(seq, jnp.uint32))


@jax.jit
def release_traced(state: PBLRUState, seq) -> PBLRUState:
    """`release` without its range check, for a traced uint32 `seq` (vmapped over ranks: sequences.release_device)."""
    mine = (state.stamp >= 0) & ((state.tag_hi >> np.uint32(12)) == seq)
    return PBLRUState(tag_hi=jnp.where(mine, EMPTY_TAG, state.tag_hi),
                      tag_lo=jnp.where(mine, EMPTY_TAG, state.tag_lo),
                      stamp=jnp.where(mine, EMPTY_STAMP, state.stamp))


def belady_hit_rate(trace, valid, capacity: int, warmup: int) -> float:
    """Belady's MIN, the clairvoyant bound an LRU is measured against: trace [steps, N] page ids (any ints), valid
    [steps, N] bool; over the flattened request sequence (step by step, in request order), on a miss with a full
    cache evict the page whose next use is farthest. Duplicates inside a step count as hits, as in PB-LRU. Hit
    rate over the requests of steps >= warmup. Plain Python (a study tool, not a kernel)."""
    seq = trace[valid]
    step_of = np.repeat(np.arange(trace.shape[0]), valid.sum(axis=1))
    n = len(seq)
    nxt = np.full(n, np.iinfo(np.int64).max, np.int64)
    last = {}
    for i in range(n - 1, -1, -1):
        x = int(seq[i])
        nxt[i] = last.get(x, np.iinfo(np.int64).max)
        last[x] = i
    cached, heap = {}, []  # page -> its next use; max-heap of (-next use, page) with lazy deletion
    hits = total = 0
    for i in range(n):
        x = int(seq[i])
        counted = step_of[i] >= warmup
        total += counted
        if x in cached:
            hits += counted
        elif len(cached) >= capacity:
            while True:
                nu, y = heapq.heappop(heap)
                if cached.get(y) == -nu:
                    del cached[y]
                    break
        cached[x] = int(nxt[i])
        heapq.heappush(heap, (-int(nxt[i]), x))
    return hits / max(total, 1)
