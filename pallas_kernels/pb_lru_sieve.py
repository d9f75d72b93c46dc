"""The PB-LRU recency sieve as Pallas (Triton lowering) kernels: one program owns one bucket.

`access(slots, hi, lo, valid, now)` equals `ref_access` (sort based, below) bit for bit: same frames, hit flags,
evictions and new slots (DESIGN.md section 5). Arrays in, arrays out: `slots` is one rank's (tag_hi, tag_lo,
stamp), each [B, S] (uint32, uint32, int32; stamp -1 = empty), and an access returns (new slots, (frame, hit,
evicted, evicted_hi, evicted_lo, fill)), each [N]; `ulacache_jax.cache.pb_lru` wraps them in its state types and checks
arguments. The per-bucket work needs no locks or atomics:
requests are grouped by bucket first, so every slot and every request is written by exactly one program.

1. Grouping: requests are placed bucket by bucket (invalid ones last) into `sorder` (original index), `shi`,
   `slo`, bucket b owning positions [start_b, end_b), in original order inside each bucket.
   - "scan" (default while N * B <= SCAN_MAX_WORK; the decode's, `sieve_geometry` keeps it there where it can):
     inside the sieve kernel, one launch in all. Program b reads all N requests twice: start_b = valid requests
     of buckets < b, then its own requests written in original order into its region (`_scan_group`). No sort,
     no atomics, no other launch; O(N * B) work in all, so large N * B use the sort.
   - "sort" (`group_requests`): jnp, an int32 sort of bucket << nbits | index, a scatter-add histogram and a
     cumsum (`bstart`); its cost is the XLA sort, independent of B. The decode's where a pool is too large for the
     scan's bound and N > RANK_FAST_REQUESTS (`sieve_geometry`: page 16 at 128K x 3 and 1/16, 12288 requests).
   - "rank" (`group_requests`): jnp, the same order without a sort: each request's place is its bucket's start
     plus the count of earlier requests in its bucket (an N x N compare-count fused into one reduction). The
     decode's past the scan's bound up to RANK_FAST_REQUESTS (page 16 at 128K x 3 and 1/32, 6144 requests), where
     it beat the sort; past that its quadratic count loses.
2. Sieve, grid (B + 1,): program b < B owns bucket b (S slots, frames b*S .. b*S+S-1), program B writes the
   outputs of invalid requests.
   Fast path (the bucket's slots fit one chunk, S <= T, and its requests fit one chunk, R <= C; chosen per
   program at run time): everything in registers. [C, T] compares find hits; [C, C] compares find each LID's
   first appearance and ranks the distinct misses by it; candidates (slots not hit) are taken in levels: the
   smallest stamp m above the previous level, then the slots with stamp m in slot order (cumsum); the miss of
   rank j fills the slot of rank j ([C, T] match) and reports the LID it displaced. A level costs two
   reductions; levels = distinct stamps among the chosen slots (one on a cold pool, a few for clocks of recent
   steps, at most the number of misses). Memory traffic: the bucket's slots and requests in, results out.
   General path (any R and S): the same steps over request chunks of C and slot chunks of T with dynamic
   loops, handing data between phases through scratch outputs and block barriers (`debug_barrier`): first
   appearance and miss ranks are all-pairs counts over the bucket (O(R^2) compares), misses go to a per-bucket
   list by rank, and when S > T hit and filled slots are marked with stamp -2 in the state until the end.

Work per bucket: O(R * S + R^2 + levels * S) compares, so buckets must be many and small for speed (B of
the order of the SM count or more); B = 1 is correct but one program scans every slot: a global LRU's speed is
measured with the sort-based reference (DESIGN.md section 5).
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import next_pow2, on_gpu
from .lid_hash import bucket_bits

Slots = tuple[jax.Array, jax.Array, jax.Array]                           # tag_hi, tag_lo, stamp: [B, S] each
Access = tuple[jax.Array, ...]  # frame, hit, evicted, evicted_hi, evicted_lo, fill: [N] each

EMPTY_STAMP = -1
EMPTY_TAG = np.uint32(0xFFFFFFFF)  # an empty slot never matches: lookups also require stamp >= 0

MARK = -2                 # stamp of a slot hit or filled in this batch (general path with S > T, until the end)
NONE = 2**31 - 1          # "no stamp": larger than any stamp (now <= 2**31 - 2)
BIG = 2**31 - 1           # "no request index"
TILE_ELEMS = 16384        # largest [C, T], [C, C] or [C, D] compare tile (8 warps: 64 elements per thread)
GROUPINGS = ("scan", "sort", "rank")
RANK_MAX_REQUESTS = 16384  # the "rank" grouping's N x N count: 2.7e8 compares at this N, quadratic past it
# choose_config's "rank" past the scan's bound while N <= this: at 6144 requests into 4096 buckets the rank count
# beat the sort's XLA sorts, at 12288 its N x N count lost to them (docs/BENCHMARKS.md, PB-LRU sieve, page 16)
RANK_FAST_REQUESTS = 6144
SCAN_MAX_WORK = 1 << 23  # "scan" grouping while N * B <= 2**23 (8K requests x 1024 buckets): each program reads all N
MIN_BUCKETS = 128        # sieve_geometry's fewest buckets: about one program per SM of the H200 (132)
MIN_SLOTS = 32           # ... unless a bucket would hold fewer slots than this (small pools keep larger buckets)
# sieve_geometry's largest slot chunk: buckets of up to 512 slots, not the kernel's 1024. At the decode's pools of
# 1/4 of the KV (8B shape, 1/32 budgets: 1024 requests into 262,144 frames, 1536 into 393,216) 512-slot chunks
# took 11.9 / 28.4 us against 23.2 / 47.1 with the 1024-slot chunks of half as many buckets, and no measured
# decode-sized access was slower with them (docs/BENCHMARKS.md, the PB-LRU sieve)
GEOMETRY_SLOT_CHUNK = 512


@dataclasses.dataclass(frozen=True)
class SieveConfig:
    """Static launch parameters (chunks are powers of two)."""
    req_chunk: int        # C: requests handled together; the fast path needs a bucket's requests <= C
    slot_chunk: int       # T: slots handled together; the bucket stays in registers when S <= T
    num_warps: int
    grouping: str = "scan"    # "scan" (in the sieve kernel), "sort" or "rank" (jnp, `group_requests`): module docstring
    fast_path: bool = True    # registers-only path for buckets with R <= C and S <= T

    def __post_init__(self):
        if self.grouping not in GROUPINGS:
            raise ValueError(f"grouping = {self.grouping!r} must be one of {GROUPINGS}")
        for name in ("req_chunk", "slot_chunk", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} = {v} must be a power of two >= 1")


def _bucket_load_chunk(num_requests: int, num_buckets: int) -> int:
    """Request chunk that holds a bucket's load almost always: mean + 4 sigma of a Poisson, to a power of two."""
    mean = num_requests / num_buckets
    return next_pow2(int(mean + 4 * math.sqrt(mean) + 1))


def choose_config(num_requests: int, num_buckets: int, slots_per_bucket: int, *, max_slot_chunk: int = 1024,
                  tile_elems: int = TILE_ELEMS, num_warps: int | None = None,
                  grouping: str | None = None) -> SieveConfig:
    """T covers the bucket when it can; C covers a bucket's request count (mean + 4 sigma of a Poisson load)
    when the [C, T] and [C, C] tiles fit the budget."""
    t = min(next_pow2(slots_per_bucket), max_slot_chunk)
    want = _bucket_load_chunk(num_requests, num_buckets)
    cap = max(8, min(tile_elems // t, int(math.isqrt(tile_elems)), 128))
    c = max(8, min(want, cap, next_pow2(num_requests)))
    if num_warps is None:
        # 8 warps for big [C, T] tiles, except square-ish ones with C >= 64: at (C, T) = (64, 256), 8K requests,
        # 4 warps took 52 us against 73 us with 8 (docs/BENCHMARKS.md, PB-LRU sieve); (32, 512) was only
        # measured with 8 warps and keeps them
        num_warps = 4 if c * max(c, t) <= 4096 or (c >= 64 and c * t <= 16384) else 8
    if grouping is None:  # the scan costs O(N * B) hash evaluations in all, the rank N x N compares, the sort a
        # fixed XLA sort
        if num_requests * num_buckets <= SCAN_MAX_WORK:
            grouping = "scan"
        else:
            grouping = "rank" if num_requests <= RANK_FAST_REQUESTS else "sort"
    return SieveConfig(req_chunk=c, slot_chunk=t, num_warps=num_warps, grouping=grouping)


def sieve_geometry(num_frames: int, num_requests: int, *, min_buckets: int = MIN_BUCKETS) -> tuple[int, int]:
    """(num_buckets, slots_per_bucket) for a pool of about `num_frames` frames accessed `num_requests` at a time:
    the fewest buckets, from `min_buckets` up (fewer while a bucket would hold under MIN_SLOTS slots), with which
    an access stays on the kernel's fast path (a bucket's load, mean + 4 sigma of a Poisson, fits one request chunk
    and its slots one slot chunk of at most GEOMETRY_SLOT_CHUNK) and groups requests inside the kernel
    (N * B <= SCAN_MAX_WORK). When no bucket count satisfies both (a pool too large for buckets of
    GEOMETRY_SLOT_CHUNK slots at N * B <= SCAN_MAX_WORK: 6144 requests into 1.57M frames, page 16 at 128K x 3), the
    fewest buckets on the fast path with the requests grouped in jnp (`choose_config`'s rank or sort): neither
    grows with the bucket count, while the earlier fallback, buckets of 64 slots, launched 8x the programs (32768
    there). Failing that too, buckets of 64 slots (the general path handles any load).
    Why not fewer, larger buckets (closer to a global LRU): a program's compare tiles grow with its bucket, and
    below about one program per SM the launch takes longer, not shorter (256 requests into 16384 frames: 32 buckets
    15.9 us, 128 buckets 4.2 us on the H200), while on SmolLM2's selection trace PB-LRU's hit rate barely moves
    with the bucket count at a fixed pool (97.9% at 8 buckets, 97.4% at 128: docs/BENCHMARKS.md, the sieve's
    bucket count)."""
    if num_frames < 1 or num_requests < 1:
        raise ValueError(f"num_frames = {num_frames} and num_requests = {num_requests} must be >= 1")
    first = 1
    while first * 2 <= min_buckets and first * 2 * MIN_SLOTS <= num_frames:
        first *= 2
    for grouping in ("scan", "jnp"):  # first the kernel's own grouping, then choose_config's jnp one (sort or rank)
        b = first
        while b <= num_frames:
            s = -(-num_frames // b)
            cfg = choose_config(num_requests, b, s, max_slot_chunk=GEOMETRY_SLOT_CHUNK)
            if (s <= cfg.slot_chunk and _bucket_load_chunk(num_requests, b) <= cfg.req_chunk
                    and cfg.req_chunk * max(cfg.req_chunk, cfg.slot_chunk) <= TILE_ELEMS
                    and (cfg.grouping == "scan" or grouping == "jnp")):
                return b, s
            b *= 2
    b = next_pow2(-(-num_frames // 64))
    return b, -(-num_frames // b)


def scanned_slots(num_buckets: int, slots_per_bucket: int, num_requests: int) -> int:
    """The slots a bucket's scan covers under `choose_config`: `slots_per_bucket` rounded up to whole slot chunks
    (T, a power of two; the kernel masks the lanes past the bucket's end). The sieve's time follows those lanes, not
    the bucket's slots (docs/BENCHMARKS.md, the decode's sieve by bucket count), so a pool may take the slots up to
    this count for no sieve time."""
    t = choose_config(num_requests, num_buckets, slots_per_bucket).slot_chunk
    return -(-slots_per_bucket // t) * t


def pool_slots(num_buckets: int, slots_per_bucket: int, num_requests: int, max_frames: int) -> int:
    """The slots a bucket of a pool gets: `scanned_slots` (the slot chunks the sieve scans anyway), but no more
    than `max_frames` frames in all (a pool never needs more than one frame per KV page)."""
    return min(scanned_slots(num_buckets, slots_per_bucket, num_requests), -(-max_frames // num_buckets))


def _barrier(interpret: bool):
    if not interpret:  # interpret mode runs one thread: nothing to order
        plgpu.debug_barrier()


def _gather(ref, idx, mask, other, size):
    # masked lanes point past the end: never touched compiled; dropped/clamped-then-replaced in interpret mode
    return plgpu.load(ref.at[jnp.where(mask, idx, size)], mask=mask, other=other)


def _scatter(ref, idx, val, mask, size):
    plgpu.store(ref.at[jnp.where(mask, idx, size)], val, mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Sort grouping (jnp), for large N x B
# ----------------------------------------------------------------------------------------------------------------
def _log2(num_buckets: int) -> int:
    return num_buckets.bit_length() - 1  # a power of two (checked at the library boundary)


def _key_bits(n: int) -> int:
    return max(1, (n - 1).bit_length())


def group_requests(hi, lo, valid, num_buckets: int, by: str = "sort"):
    """The "sort" and "rank" groupings: (sorder [N] int32, shi [N] uint32, slo [N] uint32, bstart [B + 2] int32),
    requests grouped by bucket (invalid ones last), in original order inside each bucket; bucket b owns grouped
    positions [bstart[b], bstart[b + 1]). Both give the same order: "sort" by an XLA sort; "rank" places each
    request at its bucket's start plus the count of earlier requests in its bucket, an N x N compare-count that
    XLA fuses into one reduction, then a scatter (no sort launch: XLA's sort of a few thousand keys runs in a
    couple of thread blocks)."""
    n, nb = hi.shape[0], num_buckets
    bkt = jnp.where(valid, bucket_bits(hi, lo, _log2(nb)), nb)
    idx = jnp.arange(n, dtype=jnp.int32)
    counts = jnp.zeros((nb + 2,), jnp.int32).at[bkt].add(1)
    bstart = jnp.cumsum(counts) - counts
    if by == "rank":
        if n > RANK_MAX_REQUESTS:
            raise ValueError(f"the rank grouping takes at most RANK_MAX_REQUESTS = {RANK_MAX_REQUESTS} requests "
                             f"(its work is N x N), got {n}: group them by the sort")
        earlier = (bkt[None, :] == bkt[:, None]) & (idx[None, :] < idx[:, None])          # [N, N]
        rank = jnp.sum(earlier, axis=1, dtype=jnp.int32)
        sorder = jnp.zeros((n,), jnp.int32).at[bstart[bkt] + rank].set(idx, unique_indices=True)
    else:
        bits = _key_bits(n)
        if (nb + 1) << bits <= 2**31:  # one int32 key: bucket << bits | index
            sorder = lax.sort(bkt * jnp.int32(1 << bits) + idx) & jnp.int32((1 << bits) - 1)
        else:
            _, sorder = lax.sort((bkt, idx), num_keys=2)
    return sorder, hi[sorder], lo[sorder], bstart


# ----------------------------------------------------------------------------------------------------------------
# Sieve kernel (one program per bucket)
# ----------------------------------------------------------------------------------------------------------------
def _scan_group(hi_ref, lo_ref, valid_ref, sorder_ref, shi_ref, slo_ref, b, *, n, nb, q):
    """Program b's share of the "scan" grouping: [start, end) of bucket b in the grouped order, and its requests
    written there in original order. start = valid requests of buckets < b (B: the invalid tail after every
    valid one), so each program finds its region alone and only ever writes inside it."""
    bits = _log2(nb)
    iq = jnp.arange(q, dtype=jnp.int32)
    u0 = np.uint32(0)

    def bucket(i):
        idx = i * q + iq
        m = idx < n
        h = plgpu.load(hi_ref.at[pl.ds(i * q, q)], mask=m, other=u0)
        l = plgpu.load(lo_ref.at[pl.ds(i * q, q)], mask=m, other=u0)
        v = plgpu.load(valid_ref.at[pl.ds(i * q, q)], mask=m, other=False)
        return idx, m, jnp.where(v, bucket_bits(h, l, bits), nb), h, l

    def count(i, c):
        _, m, bk, _, _ = bucket(i)
        return c[0] + jnp.sum((m & (bk < b)).astype(jnp.int32)), c[1] + jnp.sum((m & (bk == b)).astype(jnp.int32))

    nq = -(-n // q)
    start, size = lax.fori_loop(0, nq, count, (jnp.int32(0), jnp.int32(0)))

    def place(i, cnt):
        idx, m, bk, h, l = bucket(i)
        sel = m & (bk == b)
        si = sel.astype(jnp.int32)
        pos = start + cnt + jnp.cumsum(si) - si
        _scatter(sorder_ref, pos, idx, sel, n)
        _scatter(shi_ref, pos, h, sel, n)
        _scatter(slo_ref, pos, l, sel, n)
        return cnt + jnp.sum(si)

    lax.fori_loop(0, nq, place, jnp.int32(0))
    return start, start + size


def _sieve_kernel(*refs, n, nb, ns, cfg: SieveConfig, interpret):
    # grouping "scan": hi_ref, lo_ref [N] uint32, valid_ref [N] bool (caller's order) are the inputs; this program
    #   groups its own bucket's requests first (`_scan_group`) into the scratch outputs sorder_ref, shi_ref, slo_ref
    # grouping "sort": sorder_ref [N] int32, shi_ref, slo_ref [N] uint32 are inputs, requests grouped by bucket
    #   (original index, LID); bstart_ref [>= B + 2] int32: bucket b owns grouped positions [bstart[b], bstart[b+1])
    # now_ref [1] int32
    # th_ref, tl_ref [F] uint32, ts_ref [F] int32: the state, aliased to the inputs (read and written here)
    # outputs, caller's order: frame_ref [N] int32, hit_ref, ev_ref [N] bool, evh_ref, evl_ref [N] uint32,
    #   fill_ref [N] bool (the request filled a frame: first appearance of a missing LID that got a slot)
    # scratch (general path): sframe_ref [N] int32 by original index: frame of the request's own LID (hit or
    #   filled slot, else -1); by grouped position: sfo_ref [N] int32 original index of the LID's first
    #   appearance, sflag_ref [N] int32 1 on first appearances of missing LIDs; by bucket region and miss rank:
    #   mhi_ref, mlo_ref [N] uint32 and morig_ref [N] int32 the miss of each rank
    b = pl.program_id(0)
    if cfg.grouping == "scan":
        (hi_ref, lo_ref, valid_ref, now_ref, _th_in, _tl_in, _ts_in, th_ref, tl_ref, ts_ref, frame_ref, hit_ref,
         ev_ref, evh_ref, evl_ref, fill_ref, sframe_ref, sfo_ref, sflag_ref, mhi_ref, mlo_ref, morig_ref,
         sorder_ref, shi_ref, slo_ref) = refs
        start, end = _scan_group(hi_ref, lo_ref, valid_ref, sorder_ref, shi_ref, slo_ref, b, n=n, nb=nb,
                                 q=min(next_pow2(n), 256 * cfg.num_warps))
        _barrier(interpret)
    else:
        (sorder_ref, shi_ref, slo_ref, bstart_ref, now_ref, _th_in, _tl_in, _ts_in, th_ref, tl_ref, ts_ref,
         frame_ref, hit_ref, ev_ref, evh_ref, evl_ref, fill_ref, sframe_ref, sfo_ref, sflag_ref, mhi_ref, mlo_ref,
         morig_ref) = refs
        start, end = bstart_ref[b], bstart_ref[b + 1]
    C, T = cfg.req_chunk, cfg.slot_chunk
    D = max(C, min(1024, TILE_ELEMS // C))  # other requests compared per step of the all-pairs loops
    nt = -(-ns // T)
    resident = nt == 1
    fast_ok = cfg.fast_path and resident and C * max(C, T) <= TILE_ELEMS
    iT = jnp.arange(T, dtype=jnp.int32)
    u0 = np.uint32(0)
    empty = jnp.full((C,), EMPTY_TAG, jnp.uint32)
    barrier = partial(_barrier, interpret)

    def load_reqs(p0, width, limit, lids=True):
        """Grouped positions [p0, p0 + width), mask (< limit), original indices and LIDs."""
        p = p0 + jnp.arange(width, dtype=jnp.int32)
        pm = p < limit
        orig = plgpu.load(sorder_ref.at[pl.ds(p0, width)], mask=pm, other=0)
        if not lids:
            return p, pm, orig
        h = plgpu.load(shi_ref.at[pl.ds(p0, width)], mask=pm, other=u0)
        l = plgpu.load(slo_ref.at[pl.ds(p0, width)], mask=pm, other=u0)
        return p, pm, orig, h, l

    def write_outputs(orig, pm, frame, hit, evd, evh, evl, fl):
        _scatter(frame_ref, orig, frame, pm, n)
        _scatter(hit_ref, orig, hit, pm, n)
        _scatter(ev_ref, orig, evd, pm, n)
        _scatter(evh_ref, orig, evh, pm, n)
        _scatter(evl_ref, orig, evl, pm, n)
        _scatter(fill_ref, orig, fl, pm, n)

    @pl.when(b == nb)
    def _invalid():  # here start = the invalid tail's first position, end = N
        def body(rc, carry):
            _, pm, orig = load_reqs(start + rc * C, C, n, lids=False)
            false = jnp.zeros((C,), jnp.bool_)
            write_outputs(orig, pm, jnp.full((C,), -1, jnp.int32), false, false, empty, empty, false)
            return carry

        lax.fori_loop(0, (n - start + C - 1) // C, body, jnp.int32(0))

    @pl.when(b < nb)
    def _bucket():
        nrc = (end - start + C - 1) // C
        base = b * ns
        now = now_ref[0]
        smask = iT < ns
        if resident:  # the bucket's slots stay in registers from here to the final store
            th = plgpu.load(th_ref.at[pl.ds(base, T)], mask=smask, other=u0)
            tl = plgpu.load(tl_ref.at[pl.ds(base, T)], mask=smask, other=u0)
            ts = plgpu.load(ts_ref.at[pl.ds(base, T)], mask=smask, other=-1)
            occ = smask & (ts >= 0)

        def levels(cand, k):
            """[T] miss rank given to each slot (-1: none): the first k candidates by (stamp, slot)."""
            def cond(c):
                taken, m, _ = c
                return (taken < k) & (m < NONE)

            def body(c):
                taken, prev, srank = c
                m = jnp.min(jnp.where(cand & (ts > prev), ts, NONE))
                sel = cand & (ts == m)
                si = sel.astype(jnp.int32)
                rank = taken + jnp.cumsum(si) - si
                return taken + jnp.sum(si), m, jnp.where(sel & (rank < k), rank, srank)

            init = (jnp.int32(0), jnp.int32(MARK), jnp.full((T,), -1, jnp.int32))
            return lax.while_loop(cond, body, init)[2]

        def fast():
            _, pm, orig, h, l = load_reqs(start, C, end)
            m = (h[:, None] == th[None, :]) & (l[:, None] == tl[None, :]) & occ[None, :] & pm[:, None]   # [C, T]
            hs = jnp.max(jnp.where(m, iT[None, :], -1), axis=1)
            hit = hs >= 0
            shit = jnp.sum(m.astype(jnp.int32), axis=0) > 0
            same = (h[:, None] == h[None, :]) & (l[:, None] == l[None, :]) & pm[:, None] & pm[None, :]  # [C, C]
            before = orig[None, :] < orig[:, None]  # [c, c']: request c' came first
            first = pm & ~hit & (jnp.sum((same & before).astype(jnp.int32), axis=1) == 0)
            rank = jnp.sum((first[None, :] & before).astype(jnp.int32), axis=1)
            # rank of the LID's first appearance, for every request of a missing LID (-1 for hits)
            mrank = jnp.max(jnp.where(same & first[None, :], rank[None, :], -1), axis=1)
            srank = levels(smask & ~shit, jnp.sum(first.astype(jnp.int32)))
            g = (mrank[:, None] == srank[None, :]) & (mrank >= 0)[:, None]                              # [C, T]
            slot = jnp.where(hit, hs, jnp.max(jnp.where(g, iT[None, :], -1), axis=1))
            f = g & first[:, None]  # fills, on the first appearances only
            w = f & (ts >= 0)[None, :]
            evd = jnp.sum(w.astype(jnp.int32), axis=1) > 0
            evh = jnp.where(evd, jnp.sum(jnp.where(w, th[None, :], u0), axis=1), EMPTY_TAG)
            evl = jnp.where(evd, jnp.sum(jnp.where(w, tl[None, :], u0), axis=1), EMPTY_TAG)
            fl = jnp.sum(f.astype(jnp.int32), axis=1) > 0  # this request took a slot
            write_outputs(orig, pm, jnp.where(slot >= 0, base + slot, -1), hit, evd, evh, evl, fl)
            filled = jnp.sum(f.astype(jnp.int32), axis=0) > 0
            plgpu.store(th_ref.at[pl.ds(base, T)], jnp.sum(jnp.where(f, h[:, None], u0), axis=0), mask=filled)
            plgpu.store(tl_ref.at[pl.ds(base, T)], jnp.sum(jnp.where(f, l[:, None], u0), axis=0), mask=filled)
            plgpu.store(ts_ref.at[pl.ds(base, T)], jnp.full((T,), now, jnp.int32), mask=shit | filled)

        def lookup(h, l, pm):
            """[C] slot of each request's LID in the bucket (-1: none); [T] int32 hits per slot (resident)."""
            if resident:
                m = (h[:, None] == th[None, :]) & (l[:, None] == tl[None, :]) & occ[None, :] & pm[:, None]
                return jnp.max(jnp.where(m, iT[None, :], -1), axis=1), jnp.sum(m.astype(jnp.int32), axis=0)

            def tbody(tc, hs):
                s = tc * T + iT
                sm = s < ns
                cth = plgpu.load(th_ref.at[pl.ds(base + tc * T, T)], mask=sm, other=u0)
                ctl = plgpu.load(tl_ref.at[pl.ds(base + tc * T, T)], mask=sm, other=u0)
                cts = plgpu.load(ts_ref.at[pl.ds(base + tc * T, T)], mask=sm, other=-1)
                cocc = sm & (cts != -1)  # a MARK (hit earlier in this batch) is still occupied
                m = (h[:, None] == cth[None, :]) & (l[:, None] == ctl[None, :]) & cocc[None, :] & pm[:, None]
                return jnp.maximum(hs, jnp.max(jnp.where(m, s[None, :], -1), axis=1))

            return lax.fori_loop(0, nt, tbody, jnp.full((C,), -1, jnp.int32)), None

        def general():
            # ---- A1: hits; first appearance (smallest original index of the LID in the bucket) ------------
            def a1(rc, carry):
                k, shit = carry
                p, pm, orig, h, l = load_reqs(start + rc * C, C, end)
                hs, shit_c = lookup(h, l, pm)
                hit = hs >= 0

                def allpairs(d, fo):
                    _, pm2, orig2, h2, l2 = load_reqs(start + d * D, D, end)
                    eq = (h[:, None] == h2[None, :]) & (l[:, None] == l2[None, :]) & pm2[None, :]
                    return jnp.minimum(fo, jnp.min(jnp.where(eq, orig2[None, :], BIG), axis=1))

                fo = lax.fori_loop(0, (end - start + D - 1) // D, allpairs, orig)
                first = pm & ~hit & (fo == orig)
                _scatter(sframe_ref, orig, jnp.where(hit, base + hs, -1), pm, n)
                plgpu.store(sfo_ref.at[pl.ds(start + rc * C, C)], fo, mask=pm)
                plgpu.store(sflag_ref.at[pl.ds(start + rc * C, C)], first.astype(jnp.int32), mask=pm)
                false = jnp.zeros((C,), jnp.bool_)
                _scatter(hit_ref, orig, hit, pm, n)
                _scatter(ev_ref, orig, false, pm, n)
                _scatter(evh_ref, orig, empty, pm, n)
                _scatter(evl_ref, orig, empty, pm, n)
                _scatter(fill_ref, orig, false, pm, n)  # set by `fill` (phase B, after the barriers) on fills
                if resident:
                    shit = shit + shit_c
                else:  # later chunks may read a MARK or the old stamp here: both count as occupied
                    _scatter(ts_ref, base + hs, jnp.full((C,), MARK, jnp.int32), hit, nb * ns)
                return k + jnp.sum(first.astype(jnp.int32)), shit

            k, shit = lax.fori_loop(0, nrc, a1, (jnp.int32(0), jnp.zeros((T,), jnp.int32)))
            barrier()

            # ---- A2: rank of each missing LID by first appearance; the bucket's miss list ------------------
            def a2(rc, carry):
                p, pm, orig, h, l = load_reqs(start + rc * C, C, end)
                first = plgpu.load(sflag_ref.at[pl.ds(start + rc * C, C)], mask=pm, other=0) > 0

                def allpairs(d, rank):
                    p2, pm2, orig2 = load_reqs(start + d * D, D, end, lids=False)
                    f2 = plgpu.load(sflag_ref.at[pl.ds(start + d * D, D)], mask=pm2, other=0) > 0
                    before = f2[None, :] & (orig2[None, :] < orig[:, None])
                    return rank + jnp.sum(before.astype(jnp.int32), axis=1)

                rank = lax.fori_loop(0, (end - start + D - 1) // D, allpairs, jnp.zeros((C,), jnp.int32))
                _scatter(mhi_ref, start + rank, h, first, n)
                _scatter(mlo_ref, start + rank, l, first, n)
                _scatter(morig_ref, start + rank, orig, first, n)
                return carry

            lax.fori_loop(0, nrc, a2, jnp.int32(0))
            barrier()

            # ---- B: candidates by (stamp, slot) in levels; fill -------------------------------------------
            def fill(s, ch, rank, old_stamp, old_h, old_l):
                """Slots s [T] (mask ch) take the misses of rank `rank`; report what they displaced."""
                j = start + rank
                nh = _gather(mhi_ref, j, ch, u0, n)
                nl = _gather(mlo_ref, j, ch, u0, n)
                org = _gather(morig_ref, j, ch, 0, n)
                _scatter(sframe_ref, org, base + s, ch, n)
                was = old_stamp >= 0
                _scatter(ev_ref, org, was, ch, n)
                _scatter(evh_ref, org, jnp.where(was, old_h, EMPTY_TAG), ch, n)
                _scatter(evl_ref, org, jnp.where(was, old_l, EMPTY_TAG), ch, n)
                _scatter(fill_ref, org, jnp.ones((T,), jnp.bool_), ch, n)
                return nh, nl

            if resident:
                srank = levels(smask & (shit == 0), k)
                filled = srank >= 0
                nh, nl = fill(iT, filled, srank, ts, th, tl)
                plgpu.store(th_ref.at[pl.ds(base, T)], nh, mask=filled)
                plgpu.store(tl_ref.at[pl.ds(base, T)], nl, mask=filled)
                plgpu.store(ts_ref.at[pl.ds(base, T)], jnp.full((T,), now, jnp.int32), mask=(shit > 0) | filled)
            else:
                def lcond(c):
                    taken, m = c
                    return (taken < k) & (m < NONE)

                def lbody(c):
                    taken, prev = c

                    def minbody(tc, m):
                        sm = (tc * T + iT) < ns
                        cts = plgpu.load(ts_ref.at[pl.ds(base + tc * T, T)], mask=sm, other=MARK)
                        return jnp.minimum(m, jnp.min(jnp.where(sm & (cts >= -1) & (cts > prev), cts, NONE)))

                    m = lax.fori_loop(0, nt, minbody, jnp.int32(NONE))

                    def selbody(tc, cnt):
                        s = tc * T + iT
                        sm = s < ns
                        cts = plgpu.load(ts_ref.at[pl.ds(base + tc * T, T)], mask=sm, other=MARK)
                        sel = sm & (cts >= -1) & (cts == m)
                        si = sel.astype(jnp.int32)
                        rank = cnt + jnp.cumsum(si) - si
                        ch = sel & (rank < k)
                        cth = plgpu.load(th_ref.at[pl.ds(base + tc * T, T)], mask=ch, other=u0)
                        ctl = plgpu.load(tl_ref.at[pl.ds(base + tc * T, T)], mask=ch, other=u0)
                        nh, nl = fill(s, ch, rank, cts, cth, ctl)
                        plgpu.store(th_ref.at[pl.ds(base + tc * T, T)], nh, mask=ch)
                        plgpu.store(tl_ref.at[pl.ds(base + tc * T, T)], nl, mask=ch)
                        plgpu.store(ts_ref.at[pl.ds(base + tc * T, T)], jnp.full((T,), MARK, jnp.int32), mask=ch)
                        return cnt + jnp.sum(si)

                    taken = lax.fori_loop(0, nt, selbody, taken)
                    barrier()
                    return taken, m

                lax.while_loop(lcond, lbody, (jnp.int32(0), jnp.int32(MARK)))
            barrier()

            # ---- C: every request takes the frame of its LID's first appearance -----------------------------
            def cbody(rc, carry):
                p, pm, orig = load_reqs(start + rc * C, C, end, lids=False)
                fo = plgpu.load(sfo_ref.at[pl.ds(start + rc * C, C)], mask=pm, other=0)
                _scatter(frame_ref, orig, _gather(sframe_ref, fo, pm, -1, n), pm, n)
                if not resident:  # every hit or filled slot is the own frame of some request of this bucket
                    own = _gather(sframe_ref, orig, pm, -1, n)
                    _scatter(ts_ref, own, jnp.full((C,), now, jnp.int32), pm & (own >= 0), nb * ns)
                return carry

            lax.fori_loop(0, nrc, cbody, jnp.int32(0))

        if fast_ok:
            lax.cond(end - start <= C, fast, general)
        else:
            general()


def sieve_call(slots: Slots, requests, now, cfg: SieveConfig, interpret: bool) -> tuple[Slots, Access]:
    """The sieve kernel: (new slots, access outputs). `requests` is (hi, lo, valid) in the caller's order when
    cfg.grouping == "scan" (the kernel groups them itself), else grouped requests from `group_requests`."""
    tag_hi, tag_lo, stamp = slots
    nb, ns = stamp.shape
    nf, n = nb * ns, requests[0].shape[0]
    scan = cfg.grouping == "scan"
    if len(requests) != (3 if scan else 4):
        raise ValueError(f"grouping {cfg.grouping!r} takes {3 if scan else 4} request arrays, got {len(requests)}")
    kernel = partial(_sieve_kernel, n=n, nb=nb, ns=ns, cfg=cfg, interpret=interpret)
    sds = jax.ShapeDtypeStruct
    out_shape = (sds((nf,), jnp.uint32), sds((nf,), jnp.uint32), sds((nf,), jnp.int32),          # state
                 sds((n,), jnp.int32), sds((n,), jnp.bool_), sds((n,), jnp.bool_),                # frame hit ev
                 sds((n,), jnp.uint32), sds((n,), jnp.uint32), sds((n,), jnp.bool_),               # ev_hi ev_lo fill
                 sds((n,), jnp.int32), sds((n,), jnp.int32), sds((n,), jnp.int32),                 # scratch
                 sds((n,), jnp.uint32), sds((n,), jnp.uint32), sds((n,), jnp.int32))
    if scan:  # + the grouped requests (sorder, shi, slo), scratch written by the kernel
        out_shape += (sds((n,), jnp.int32), sds((n,), jnp.uint32), sds((n,), jnp.uint32))
    k = len(requests) + 1  # position of the first state input
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(nb + 1,), interpret=interpret,
        input_output_aliases={k: 0, k + 1: 1, k + 2: 2},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
    )(*requests, jnp.reshape(now, (1,)).astype(jnp.int32),
      tag_hi.reshape(nf), tag_lo.reshape(nf), stamp.reshape(nf))
    th, tl, ts = (a.reshape(nb, ns) for a in outs[:3])
    return (th, tl, ts), tuple(outs[3:9])


@partial(jax.jit, static_argnames=("config", "interpret"))
def access(slots: Slots, hi, lo, valid, now, *, config: SieveConfig | None = None,
           interpret: bool | None = None) -> tuple[Slots, Access]:
    """Batched PB-LRU access by the kernel (no argument checks; `ulacache_jax.cache.pb_lru.access` checks).
    slots: (tag_hi, tag_lo, stamp) [B, S]; hi, lo [N] uint32, valid [N] bool, now int32 scalar. Returns (new
    slots, (frame [N] int32, hit [N] bool, evicted [N] bool, evicted_hi, evicted_lo [N] uint32, fill [N] bool)).
    Compiled on GPU, interpret mode elsewhere (or as `interpret` says). The slots are updated in place when the
    caller donates them (otherwise XLA copies them once for the aliased kernel)."""
    nb, ns = slots[2].shape
    n = hi.shape[0]
    if interpret is None:
        interpret = not on_gpu()
    if n == 0:
        e, f = jnp.zeros((0,), jnp.uint32), jnp.zeros((0,), bool)
        return tuple(slots), (jnp.zeros((0,), jnp.int32), f, f, e, e, f)
    cfg = config or choose_config(n, nb, ns)
    now = jnp.asarray(now, jnp.int32)
    if cfg.grouping == "scan":
        return sieve_call(slots, (hi, lo, valid), now, cfg, interpret)
    return sieve_call(slots, group_requests(hi, lo, valid, nb, by=cfg.grouping), now, cfg, interpret)


@jax.jit
def ref_access(slots: Slots, hi, lo, valid, now) -> tuple[Slots, Access]:
    """The reference of `access`, in jnp (same arguments and results). Sort based (no [N, S] compare matrix),
    so it also serves pools of a million frames with B = 1 (a global LRU)."""
    tag_hi, tag_lo, stamp = slots
    nb, ns = stamp.shape
    nf, n = nb * ns, hi.shape[0]
    req_bucket = bucket_bits(hi, lo, _log2(nb))                                  # [N] int32

    # 1. Hits and duplicates in one sort of slots and requests by (dead, hi, lo, id): ids [0, F) are slots,
    #    [F, F + N) requests, so a resident LID's slot heads its run and the first request of a missing LID does.
    occupied = stamp.reshape(nf) >= 0
    dead = jnp.concatenate([~occupied, ~valid]).astype(jnp.int32)               # [F+N]
    key_hi = jnp.concatenate([tag_hi.reshape(nf), hi])
    key_lo = jnp.concatenate([tag_lo.reshape(nf), lo])
    ids = jnp.arange(nf + n, dtype=jnp.int32)
    s_dead, s_hi, s_lo, s_id = lax.sort((dead, key_hi, key_lo, ids), num_keys=4)
    pos = jnp.arange(nf + n, dtype=jnp.int32)
    run_start = jnp.concatenate([jnp.ones((1,), bool),
                                 (s_dead[1:] != s_dead[:-1]) | (s_hi[1:] != s_hi[:-1]) | (s_lo[1:] != s_lo[:-1])])
    head = lax.cummax(jnp.where(run_start, pos, 0))                               # [F+N] run head position
    head_id = s_id[head]
    is_req = s_id >= nf
    req_of = jnp.where(is_req, s_id - nf, n)                                      # n = dropped
    hit = jnp.zeros(n, bool).at[req_of].set(head_id < nf, mode="drop") & valid   # [N]
    first = jnp.zeros(n, jnp.int32).at[req_of].set(head_id - nf, mode="drop")     # [N] first occurrence (misses)
    hit_frame = jnp.zeros(n, jnp.int32).at[req_of].set(head_id, mode="drop")      # [N] slot id when hit

    # 2. Rank each distinct missing LID within its bucket by first appearance.
    idx = jnp.arange(n, dtype=jnp.int32)
    is_first_miss = valid & ~hit & (first == idx)
    mkey = jnp.where(is_first_miss, req_bucket, nb)
    s_mkey, s_midx = lax.sort((mkey, idx), num_keys=2)
    bucket_start = jnp.searchsorted(s_mkey, jnp.arange(nb + 1, dtype=jnp.int32), side="left")
    s_rank = jnp.arange(n, dtype=jnp.int32) - bucket_start[jnp.minimum(s_mkey, nb)]
    rank = jnp.zeros(n, jnp.int32).at[s_midx].set(s_rank)                        # [N] (meaningful on first misses)

    # 3. Candidates of each bucket: slots not hit in this batch, by (stamp, slot); empty slots (stamp -1) first.
    hit_slot = jnp.zeros(nf, jnp.int32).at[jnp.where(hit, hit_frame, nf)].set(1, mode="drop").reshape(nb, ns)
    slot_idx = jnp.broadcast_to(jnp.arange(ns, dtype=jnp.int32), (nb, ns))
    _, _, cand = lax.sort((hit_slot, stamp, slot_idx), dimension=1, num_keys=3)  # [B, S]
    num_cand = ns - hit_slot.sum(axis=1)                                         # [B]

    # 4. Fill: the r-th distinct miss of bucket b takes cand[b, r] when r < num_cand[b]. `fits` is also the `fill`
    #    output: exactly one request per filled frame (the LID's first), so a caller fetches each frame once.
    fits = is_first_miss & (rank < num_cand[req_bucket])
    fill_frame = req_bucket * ns + cand[req_bucket, jnp.minimum(rank, ns - 1)]
    fill_frame = jnp.where(fits, fill_frame, -1)                                  # [N], on first misses only
    frame = jnp.where(hit, hit_frame, fill_frame[first])
    frame = jnp.where(valid, frame, -1)

    safe = jnp.maximum(fill_frame, 0)
    flat_hi, flat_lo, flat_stamp = tag_hi.reshape(nf), tag_lo.reshape(nf), stamp.reshape(nf)
    evicted = fits & (flat_stamp[safe] >= 0)
    evicted_hi = jnp.where(evicted, flat_hi[safe], EMPTY_TAG)
    evicted_lo = jnp.where(evicted, flat_lo[safe], EMPTY_TAG)

    # 5. New slots: hit slots and filled slots get stamp `now`; filled slots take their new tags.
    touched = jnp.where(hit, hit_frame, jnp.where(fits, fill_frame, nf))
    new_stamp = flat_stamp.at[touched].set(now, mode="drop")
    put = jnp.where(fits, fill_frame, nf)
    new_hi = flat_hi.at[put].set(hi, mode="drop")
    new_lo = flat_lo.at[put].set(lo, mode="drop")
    new = (new_hi.reshape(nb, ns), new_lo.reshape(nb, ns), new_stamp.reshape(nb, ns))
    return new, (frame, hit, evicted, evicted_hi, evicted_lo, fits)
