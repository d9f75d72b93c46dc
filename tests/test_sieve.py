"""The Pallas PB-LRU sieve against the sort-based reference, bit for bit (interpret mode on CPU; the `gpu` test
runs it compiled at realistic size). Shapes are few and fixed so the suite compiles each kernel once."""
import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.cache import pb_lru
from ulacache_jax.pallas_kernels import pb_lru_sieve as sv
from pb_lru_model import py_bucket

ON_GPU = jax.default_backend() == "gpu"


def words(x):
    x = np.asarray(x, np.uint64)
    return (jnp.asarray((x >> np.uint64(32)).astype(np.uint32)),
            jnp.asarray((x & np.uint64(0xFFFFFFFF)).astype(np.uint32)))


def kernel_access(state, hi, lo, valid, now, config=None):
    """The kernel on a PBLRUState (it takes and returns arrays)."""
    slots, out = sv.access((state.tag_hi, state.tag_lo, state.stamp), hi, lo, valid, now, config=config)
    return pb_lru.PBLRUState(*slots), pb_lru.AccessOut(*out)


def assert_same(ref, got, what=""):
    (s_r, o_r), (s_k, o_k) = ref, got
    for name in ("tag_hi", "tag_lo", "stamp"):
        np.testing.assert_array_equal(np.asarray(getattr(s_k, name)), np.asarray(getattr(s_r, name)),
                                      err_msg=f"state.{name} {what}")
    for name in ("frame", "hit", "evicted", "evicted_hi", "evicted_lo", "fill"):
        np.testing.assert_array_equal(np.asarray(getattr(o_k, name)), np.asarray(getattr(o_r, name)),
                                      err_msg=f"out.{name} {what}")


def assert_frames_consistent(lids, valid, out):
    """Two distinct LIDs never get one frame; one LID never gets two frames."""
    frame = np.asarray(out.frame)
    by_frame, by_lid = {}, {}
    for x, v, f in zip(lids.tolist(), np.asarray(valid).tolist(), frame.tolist()):
        if not v:
            assert f == -1
            continue
        assert by_lid.setdefault(x, f) == f, "one LID, two frames"
        if f >= 0:
            assert by_frame.setdefault(f, x) == x, "two LIDs, one frame"


def run_both(nb, ns, batches, nows, config=None):
    """Kernel and reference side by side over a trace; returns the last outputs."""
    s_r = s_k = pb_lru.init(nb, ns)
    for t, ((lids, valid), now) in enumerate(zip(batches, nows)):
        hi, lo = words(lids)
        v = jnp.asarray(valid)
        now = jnp.int32(now)
        ref = pb_lru.ref_access(s_r, hi, lo, v, now)
        got = kernel_access(s_k, hi, lo, v, now, config=config)
        assert_same(ref, got, f"at step {t}")
        assert_frames_consistent(lids, valid, got[1])
        (s_r, o_r), (s_k, _) = ref, got
    return o_r


def random_trace(rng, n, universe, steps, p_invalid=0.15):
    """Batches drawn with replacement from a universe of LIDs: duplicates, recurring pages, invalid entries."""
    pool = rng.integers(0, 2**63, universe, dtype=np.uint64)
    out = []
    for _ in range(steps):
        lids = pool[rng.integers(0, universe, n)]
        out.append((lids, rng.random(n) >= p_invalid))
    return out


# (num_buckets, slots_per_bucket, requests per batch, distinct LIDs, config)
SMALL = sv.SieveConfig(req_chunk=8, slot_chunk=4, num_warps=4)
CASES = {
    "global_lru_B1": (1, 16, 48, 40, None),
    "one_slot_per_bucket": (16, 1, 48, 40, None),
    "overflow_small_pool": (4, 4, 64, 100, None),       # fast path: one chunk of requests per bucket
    "odd_slots": (2, 3, 40, 20, None),
    # slots in two chunks of 4 (state MARK path) and requests in chunks of 8 (all-pairs across chunks)
    "chunked_slots_and_requests": (4, 8, 96, 60, SMALL),
    "many_requests_per_bucket": (2, 64, 160, 300, sv.SieveConfig(req_chunk=8, slot_chunk=16, num_warps=4)),
    # resident slots, some buckets over the request chunk: fast and general path in one launch
    "fast_and_general_mixed": (4, 16, 48, 60, sv.SieveConfig(req_chunk=16, slot_chunk=16, num_warps=4)),
    "general_path_only": (4, 16, 48, 60, sv.SieveConfig(req_chunk=16, slot_chunk=16, num_warps=4, fast_path=False)),
    # the explicit configs above group in the kernel ("scan", the default); the same shapes grouped by the sort
    "sort_grouping_chunked": (4, 8, 96, 60, dataclasses.replace(SMALL, grouping="sort")),
    "sort_grouping_mixed": (4, 16, 48, 60, sv.SieveConfig(req_chunk=16, slot_chunk=16, num_warps=4, grouping="sort")),
    # more requests than one scan chunk (256 x num_warps): the grouping scan loops and carries its counts
    "scan_several_chunks": (8, 16, 1500, 900, sv.SieveConfig(req_chunk=64, slot_chunk=16, num_warps=1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference_step_by_step(case):
    nb, ns, n, universe, cfg = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    batches = random_trace(rng, n, universe, steps=6)
    nows = [0, 1, 1, 4, 2, 9]  # a repeated and a decreasing clock: the semantics do not assume monotone time
    run_both(nb, ns, batches, nows, config=cfg)


def scatter_lead(out, valid, num_frames):
    """The first request (lowest index) of each filled frame, by a scatter-min over the frames: what the decode
    computed before the access reported `fill`."""
    frame, hit = jnp.asarray(out.frame), jnp.asarray(out.hit)
    n, nf = frame.shape[0], num_frames
    idx = jnp.arange(n, dtype=jnp.int32)
    ff = jnp.asarray(valid) & ~hit & (frame >= 0)
    fr = jnp.where(ff, frame, nf)
    first = jnp.full((nf,), n, jnp.int32).at[fr].min(idx, mode="drop")
    return np.asarray(ff & (first[jnp.minimum(fr, nf - 1)] == idx))


def adversarial_trace(rng, nb, ns, n):
    """Batches built to break a per-LID "first" flag: rows copying other rows (sharers, verification rows),
    duplicates inside a row, one LID everywhere, a bucket overflowed by LIDs that also repeat, all invalid."""
    pool = rng.integers(0, 2**63, 3 * n, dtype=np.uint64)
    width = 8
    rows = n // width
    out = list(random_trace(rng, n, n, steps=2))
    base = pool[rng.integers(0, n, width)]
    base[3] = base[0]                                                     # a duplicate inside the row
    copied = np.concatenate([rng.permutation(base) if r % 2 else base for r in range(rows)])
    copied = np.concatenate([copied, pool[:n - len(copied)]])
    out.append((copied, rng.random(n) >= 0.1))
    out.append((np.full(n, pool[1]), np.arange(n) % 3 != 0))                   # one LID, first request invalid
    hot = lids_in_bucket(rng, 0, nb, ns + 3)                                   # more new LIDs than bucket 0 holds
    over = np.concatenate([hot, hot[::-1], pool[2 * n:2 * n + n - 2 * len(hot)]])
    out.append((over, np.ones(n, bool)))
    out.append((np.concatenate([rng.permutation(hot), pool[n:2 * n - len(hot)]]), np.ones(n, bool)))
    out.append((pool[:n], np.zeros(n, bool)))                                  # all invalid
    out.append((copied[::-1].copy(), np.ones(n, bool)))
    return out


@pytest.mark.parametrize("case", ["global_lru_B1", "overflow_small_pool", "chunked_slots_and_requests",
                                  "fast_and_general_mixed", "general_path_only", "sort_grouping_chunked"])
def test_fill_is_the_first_request_of_each_filled_frame(case):
    # `fill` (kernel == reference, bit for bit) equals the scatter-min formulation on every step, and duplicates
    # of filled and of overflowed LIDs both occur in the trace
    nb, ns, n, _, cfg = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)) + 1)
    s_r = s_k = pb_lru.init(nb, ns)
    seen_dup_fill = seen_dup_overflow = False
    for t, (lids, valid) in enumerate(adversarial_trace(rng, nb, ns, n)):
        hi, lo = words(lids)
        v, now = jnp.asarray(valid), jnp.int32(t)
        ref = pb_lru.ref_access(s_r, hi, lo, v, now)
        got = kernel_access(s_k, hi, lo, v, now, config=cfg)
        assert_same(ref, got, f"at step {t}")
        (s_r, out), (s_k, _) = ref, got
        fill = np.asarray(out.fill)
        np.testing.assert_array_equal(fill, scatter_lead(out, valid, nb * ns), err_msg=f"step {t}")
        frame, hit = np.asarray(out.frame), np.asarray(out.hit)
        filled = valid & ~hit & (frame >= 0)
        assert len(set(frame[filled].tolist())) == fill.sum()
        seen_dup_fill |= bool(filled.sum() > fill.sum())
        overflow = valid & ~hit & (frame < 0)
        seen_dup_overflow |= len(set(lids[overflow].tolist())) < overflow.sum()
        if not valid.any():
            assert not fill.any()
    assert seen_dup_fill and seen_dup_overflow


def lids_in_bucket(rng, bucket, nb, count):
    out = []
    while len(out) < count:
        x = int(rng.integers(0, 2**63, dtype=np.uint64))
        if py_bucket(x, nb) == bucket:
            out.append(x)
    return np.array(out, np.uint64)


def test_full_bucket_hits_and_overflow():
    # bucket 0 of a 4 x 4 pool: fill it, then hit all 4 slots while 3 new LIDs (one duplicated) miss:
    # no slot is a candidate, so the misses overflow to frame -1; other buckets fill normally.
    nb, ns, n = 4, 4, 48
    rng = np.random.default_rng(7)
    old, new = lids_in_bucket(rng, 0, nb, 4), lids_in_bucket(rng, 0, nb, 3)
    other = lids_in_bucket(rng, 1, nb, 2)
    pad = lambda a: (np.concatenate([a, np.zeros(n - len(a), np.uint64)]),
                     np.arange(n) < len(a))
    step1 = np.concatenate([old, old[:2]])
    step2 = np.concatenate([new[:1], old, new, other, old[3:], other[:1]])
    batches = [pad(step1), pad(step2)]
    out = run_both(nb, ns, batches, [3, 4])
    f, hit = np.asarray(out.frame), np.asarray(out.hit)
    assert (f[[0, 5, 6, 7]] == -1).all() and not hit[[0, 5, 6, 7]].any()        # the new LIDs overflow
    assert hit[1:5].all() and sorted(f[1:5].tolist()) == [0, 1, 2, 3]          # the old LIDs hit bucket 0
    assert (f[8:10] >= ns).all() and f[10] == f[4] and f[11] == f[8]           # duplicates share frames
    assert not np.asarray(out.evicted).any()


def test_eviction_order_is_stamp_then_slot():
    # one bucket of 4 slots filled at clocks 5, 5, 2, 7 (slots 0..3); two new LIDs evict slot 2 (stamp 2),
    # then slot 0 (stamp 5, lower slot than slot 1)
    nb, ns, n = 1, 4, 8
    rng = np.random.default_rng(3)
    a = rng.integers(0, 2**63, 6, dtype=np.uint64)
    pad = lambda x: (np.concatenate([x, np.zeros(n - len(x), np.uint64)]), np.arange(n) < len(x))
    batches = [pad(a[:2]), pad(a[2:3]), pad(a[3:4]), pad(a[4:6])]
    out = run_both(nb, ns, batches, [5, 2, 7, 8])
    assert np.asarray(out.frame)[:2].tolist() == [2, 0]
    ev = np.asarray(out.evicted_hi).astype(np.uint64) << np.uint64(32) | np.asarray(out.evicted_lo)
    assert np.asarray(out.evicted)[:2].all() and ev[:2].tolist() == [int(a[2]), int(a[0])]


def test_all_invalid_and_single_request():
    nb, ns = 4, 4
    state = pb_lru.init(nb, ns)
    hi, lo = words(np.array([1, 2, 3], np.uint64))
    new, out = kernel_access(state, hi, lo, jnp.zeros(3, bool), jnp.int32(1))
    assert np.asarray(out.frame).tolist() == [-1, -1, -1] and not np.asarray(out.hit).any()
    np.testing.assert_array_equal(np.asarray(new.stamp), np.asarray(state.stamp))
    ref = pb_lru.ref_access(state, hi[:1], lo[:1], jnp.ones(1, bool), jnp.int32(1))
    assert_same(ref, kernel_access(state, hi[:1], lo[:1], jnp.ones(1, bool), jnp.int32(1)))


def test_dispatch_through_pb_lru_and_release():
    # impl="pallas" through the public entry point, with holes left by release() in the middle of buckets
    nb, ns, n = 4, 4, 48
    rng = np.random.default_rng(11)
    s_r = s_k = pb_lru.init(nb, ns)
    for t, (lids, valid) in enumerate(random_trace(rng, n, 40, steps=4)):
        if t == 2:
            seq = int(lids[0]) >> 44
            s_r, s_k = pb_lru.release(s_r, seq), pb_lru.release(s_k, seq)
        hi, lo = words(lids)
        ref = pb_lru.access(s_r, hi, lo, jnp.asarray(valid), t, impl="ref")
        got = pb_lru.access(s_k, hi, lo, jnp.asarray(valid), t, impl="pallas")
        assert_same(ref, got, f"at step {t}")
        (s_r, _), (s_k, _) = ref, got


@pytest.mark.parametrize("n,nb,universe,invalid", [(1, 4, 3, 0.0), (300, 8, 40, 0.3), (257, 1, 1000, 0.5),
                                                     (1024, 256, 5000, 0.1), (64, 16, 64, 1.0)])
def test_rank_grouping_equals_sort_grouping(n, nb, universe, invalid):
    """Same order, grouped copies and bucket starts from both jnp groupings (duplicates, every request in one
    bucket, all invalid, buckets left empty): the kernel gets identical inputs, so the sort's kernel cases cover
    the rank's."""
    rng = np.random.default_rng(n + nb)
    lids = rng.integers(0, universe, n).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15 % 2**61)
    hi, lo = jnp.asarray((lids >> np.uint64(32)).astype(np.uint32)), jnp.asarray(lids.astype(np.uint32))
    valid = jnp.asarray(rng.random(n) >= invalid)
    a = sv.group_requests(hi, lo, valid, nb, by="sort")
    b = sv.group_requests(hi, lo, valid, nb, by="rank")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert sorted(np.asarray(b[0]).tolist()) == list(range(n))


def test_rank_grouping_refuses_more_requests_than_its_bound():
    n = sv.RANK_MAX_REQUESTS + 1
    z = jnp.zeros((n,), jnp.uint32)
    with pytest.raises(ValueError, match=f"RANK_MAX_REQUESTS = {sv.RANK_MAX_REQUESTS} requests .* got {n}"):
        sv.group_requests(z, z, jnp.ones((n,), bool), 64, by="rank")


def test_config_refuses_unknown_grouping_and_chunks():
    with pytest.raises(ValueError, match="grouping = 'atomic'"):
        sv.SieveConfig(req_chunk=8, slot_chunk=4, num_warps=4, grouping="atomic")
    with pytest.raises(ValueError, match="slot_chunk = 12"):
        sv.SieveConfig(req_chunk=8, slot_chunk=12, num_warps=4)


def test_choose_config_bounds():
    for n, nb, ns in [(8192, 256, 256), (8192, 16, 65536), (1, 1, 1), (262144, 1024, 1024)]:
        c = sv.choose_config(n, nb, ns)
        assert c.slot_chunk & (c.slot_chunk - 1) == 0 and c.req_chunk & (c.req_chunk - 1) == 0
        assert c.slot_chunk <= 1024 and c.req_chunk * c.slot_chunk <= sv.TILE_ELEMS
        assert c.fast_path
        past_scan = "rank" if n <= sv.RANK_FAST_REQUESTS else "sort"
        assert c.grouping == ("scan" if n * nb <= sv.SCAN_MAX_WORK else past_scan)
    assert sv.choose_config(8192, 1024, 64).grouping == "scan"
    assert sv.choose_config(262144, 1024, 1024).grouping == "sort"
    # past the scan's bound: the rank count up to RANK_FAST_REQUESTS requests (where it was measured faster), the
    # sort beyond; an explicit grouping is kept
    assert sv.choose_config(sv.RANK_FAST_REQUESTS, 4096, 384).grouping == "rank"
    assert sv.choose_config(sv.RANK_FAST_REQUESTS + 1, 4096, 384).grouping == "sort"
    assert sv.choose_config(6144, 4096, 384, grouping="sort").grouping == "sort"
    assert sv.RANK_FAST_REQUESTS <= sv.RANK_MAX_REQUESTS


def decode_trace(rng, n, steps, churn=0.1):
    """A hot set of n distinct LIDs, churn of it replaced each step, requested in a new order each step."""
    hot = rng.choice(2**40, n, replace=False).astype(np.uint64)
    out = []
    for _ in range(steps):
        k = int(churn * n)
        hot[rng.choice(n, k, replace=False)] = rng.integers(2**40, 2**62, k, dtype=np.uint64)
        out.append((rng.permutation(hot), np.ones(n, bool)))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the kernel compiled")
@pytest.mark.parametrize("nb,ns", [(256, 256), (1024, 1024), (16, 4096)])
@pytest.mark.parametrize("grouping", sv.GROUPINGS)
def test_compiled_realistic_size(nb, ns, grouping):
    # 8K requests per step (one layer of a 32-sequence decode step), 64K- and 1M-frame pools
    rng = np.random.default_rng(nb)
    batches = decode_trace(rng, 8192, steps=4)
    cfg = dataclasses.replace(sv.choose_config(8192, nb, ns), grouping=grouping)
    run_both(nb, ns, batches, [1, 2, 3, 4], config=cfg)


def test_sieve_geometry_fewest_buckets_on_the_fast_path():
    def fast(n, b, s):
        c = sv.choose_config(n, b, s, max_slot_chunk=sv.GEOMETRY_SLOT_CHUNK)
        mean = n / b
        return (s <= c.slot_chunk and int(mean + 4 * np.sqrt(mean) + 1) <= c.req_chunk
                and c.req_chunk * max(c.req_chunk, c.slot_chunk) <= sv.TILE_ELEMS and c.grouping == "scan")

    for frames, n in [(8192, 256), (262144, 8192), (917504, 1792), (32768, 8192), (100, 3), (262144, 256),
                      (393216, 768), (4320, 96)]:
        b, s = sv.sieve_geometry(frames, n)
        assert b & (b - 1) == 0 and b * s >= frames and (b - 1) * s < frames + b
        assert fast(n, b, s), (frames, n, b, s)
        # the floor: MIN_BUCKETS, fewer only while a bucket would hold under MIN_SLOTS slots
        floor = min(sv.MIN_BUCKETS, max(1, 1 << (frames // sv.MIN_SLOTS).bit_length() - 1))
        assert b >= floor, (frames, n, b)
        assert b == floor or not fast(n, b // 2, -(-frames // (b // 2))), (frames, n, b)  # fewest such buckets
        b1, s1 = sv.sieve_geometry(frames, n, min_buckets=1)          # no floor: the fewest on the fast path
        assert fast(n, b1, s1) and (b1 == 1 or not fast(n, b1 // 2, -(-frames // (b1 // 2)))), (frames, n, b1)
    # the decode's pools: the 8B's auto pool at B = 1 (1.5 x 8192 frames) in 128 buckets, not 32 (the sieve took
    # 4.2 us there against 15.9 on the H200); pools of 1/4 of the KV take buckets of at most 512 slots, twice as
    # many as the kernel's 1024-slot chunk allows (1024 requests into 262,144 frames: 11.9 us against 23.2, H100)
    assert sv.sieve_geometry(12288, 256) == (128, 96)
    assert sv.sieve_geometry(262144, 256) == (512, 512) and sv.sieve_geometry(393216, 768) == (1024, 384)
    assert sv.sieve_geometry(262144, 1024) == (512, 512) and sv.sieve_geometry(393216, 1536) == (1024, 384)
    assert sv.sieve_geometry(100, 3) == (2, 50)                       # 32-slot buckets at least
    # no bucket count keeps both (65536 requests exceed the scan's N x B bound): 64-slot buckets
    assert sv.sieve_geometry(65536, 65536) == (1024, 64)
    # a pool too large for 512-slot buckets under the scan's bound (page 16, 128K x 3, pool 1/4: 6144 requests into
    # 1.57M frames): the fewest fast-path buckets with a jnp grouping (the rank count there; the sort at 12288
    # requests, 1/16), not 32768 buckets of 48 slots
    for n, grouping in ((6144, "rank"), (12288, "sort")):
        b, s = sv.sieve_geometry(1572864, n)
        cfg = sv.choose_config(n, b, s, max_slot_chunk=sv.GEOMETRY_SLOT_CHUNK)
        assert (b, s) == (4096, 384) and cfg.grouping == grouping and s <= cfg.slot_chunk <= sv.GEOMETRY_SLOT_CHUNK
    with pytest.raises(ValueError, match="num_frames = 0"):
        sv.sieve_geometry(0, 8)


def test_scanned_slots_are_whole_slot_chunks():
    """A bucket is scanned in whole slot chunks: 288 slots as 512 lanes, 1536 as two chunks of 1024; a power of
    two up to the chunk is its own scan. Those are the slots the default pool takes (generator)."""
    assert sv.scanned_slots(128, 288, 768) == 512 and sv.scanned_slots(64, 384, 512) == 512
    assert sv.scanned_slots(256, 1536, 768) == 2048 and sv.scanned_slots(64, 256, 512) == 256
    for b, s, n in ((128, 288, 768), (16, 270, 96), (512, 768, 768), (1024, 384, 8192)):
        got = sv.scanned_slots(b, s, n)
        assert got >= s and got % sv.choose_config(n, b, s).slot_chunk == 0
        assert sv.choose_config(n, b, got) == sv.choose_config(n, b, s)      # the same launch: no sieve cost
