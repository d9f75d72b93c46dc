import numpy as np
import pytest
import jax.numpy as jnp
from hypothesis import given, settings, strategies as st, HealthCheck

from ulacache_jax.cache import lid
from ulacache_jax.cache import pb_lru
from ulacache_jax.cache import vtlb
from pb_lru_model import PyPBLRU

PAGE = 4


def words(lids):
    a = np.asarray(lids, np.uint64)
    return (jnp.asarray((a >> np.uint64(32)).astype(np.uint32)), jnp.asarray((a & np.uint64(0xFFFFFFFF)).astype(np.uint32)))


def to_int(hi, lo):
    return (int(hi) << 32) | int(lo)


def make_lid(seq, layer, group, page):
    return (seq << 44) | (layer << 36) | (group << 32) | (page * PAGE)


def check_step(state, model, lids, valid, now, impl="ref"):
    hi, lo = words(lids)
    state, out = pb_lru.access(state, hi, lo, jnp.asarray(valid), now, impl=impl)
    frame, hit, evicted, ev_lid = model.access(lids, valid, now)
    np.testing.assert_array_equal(np.asarray(out.frame), frame)
    np.testing.assert_array_equal(np.asarray(out.hit), hit)
    np.testing.assert_array_equal(np.asarray(out.evicted), evicted)
    for i in np.flatnonzero(evicted):
        assert to_int(out.evicted_hi[i], out.evicted_lo[i]) == ev_lid[i]
    # fill: the first request of each missing LID that took a frame
    first = {}
    for i, (x, v) in enumerate(zip(lids, valid)):
        if v:
            first.setdefault(x, i)
    fill = [bool(v and not hit[i] and frame[i] >= 0 and first[x] == i) for i, (x, v) in enumerate(zip(lids, valid))]
    np.testing.assert_array_equal(np.asarray(out.fill), fill)
    check_state(state, model)
    # two distinct LIDs never share a frame
    f = np.asarray(out.frame)
    seen = {}
    for x, fr in zip(lids, f):
        if fr >= 0:
            assert seen.setdefault(fr, x) == x
    return state, out


def check_state(state, model):
    stamp = np.asarray(state.stamp)
    np.testing.assert_array_equal(stamp, np.asarray(model.stamp))
    th, tl = np.asarray(state.tag_hi), np.asarray(state.tag_lo)
    for b in range(model.nb):
        for s in range(model.ns):
            if stamp[b, s] >= 0:
                assert to_int(th[b, s], tl[b, s]) == model.tag[b][s]


traces = st.tuples(
    st.sampled_from([(1, 4), (1, 16), (2, 3), (4, 4), (8, 2), (16, 1)]),               # (buckets, slots)
    st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(0, 1), st.integers(0, 11),
                                st.booleans()), min_size=0, max_size=40), min_size=1, max_size=6))


def pad8(n: int) -> int:
    """n rounded up to a multiple of 8 (at least 8): the random traces' batch sizes, so the jitted access, vTLB
    update and translate compile once per multiple instead of once per length (each compile costs ~0.1 s; 25
    traces of up to 6 batches of 0-40 requests compiled some 250 programs). Other lengths: the explicit tests below
    (batches of 2, 3 and 4) and tests/test_sieve.py."""
    return max(8, -(-n // 8) * 8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces)
def test_ref_matches_python_model(trace):
    (nb, ns), batches = trace
    state, model = pb_lru.init(nb, ns), PyPBLRU(nb, ns)
    table = vtlb.init(4, 2, 2, 12, PAGE)
    for now, batch in enumerate(batches):
        lids = [make_lid(s, l, g, p) for s, l, g, p, _ in batch]
        valid = [v for *_, v in batch]
        pad = pad8(len(lids)) - len(lids)          # invalid requests: neither the model nor the sieve takes them
        lids, valid = lids + [0] * pad, valid + [False] * pad
        state, out = check_step(state, model, lids, valid, now)
        table = vtlb.apply_access(table, *words(lids), out)
        check_vtlb_invariant(table, state)
    if batches[0]:
        seq = batches[0][0][0]
        state = pb_lru.release(state, seq)
        model.release(seq)
        check_state(state, model)


def check_vtlb_invariant(table, state):
    """vtlb[lid].frame == f  <=>  tag[f] == lid, both ways."""
    frames = np.asarray(table.frame)
    stamp, th, tl = (np.asarray(a).reshape(-1) for a in (state.stamp, state.tag_hi, state.tag_lo))
    held = {}
    for f in np.flatnonzero(stamp >= 0):
        held[f] = to_int(th[f], tl[f])
    for (s, l, g, p), f in np.ndenumerate(frames):
        if f >= 0:
            assert held.get(f) == make_lid(s, l, g, p), (s, l, g, p, f)
    for f, x in held.items():
        s, l, g, t = x >> 44, (x >> 36) & 0xFF, (x >> 32) & 0xF, x & 0xFFFFFFFF
        assert frames[s, l, g, t // PAGE] == f
    # translate agrees (the held LIDs padded with copies of the first to a multiple of 8: see pad8)
    if held:
        lids = list(held.values())
        n = len(lids)
        res, fr, _ = vtlb.translate(table, *words(lids + lids[:1] * (pad8(n) - n)))
        assert bool(np.all(np.asarray(res)))
        np.testing.assert_array_equal(np.asarray(fr)[:n], list(held.keys()))


def test_duplicates_overflow_and_eviction_explicit():
    # B = 1, 2 slots: global LRU. Requests A A B C (3 distinct misses, 2 slots) -> C overflows.
    state = pb_lru.init(1, 2)
    A, B, C = make_lid(0, 0, 0, 0), make_lid(0, 0, 0, 1), make_lid(1, 0, 0, 0)
    hi, lo = words([A, A, B, C])
    state, out = pb_lru.access(state, hi, lo, jnp.ones(4, bool), 0)
    assert out.frame.tolist() == [0, 0, 1, -1] and out.hit.tolist() == [False] * 4
    assert not bool(out.evicted.any())
    # now C (miss) and B (hit): C evicts A (A is the LRU candidate; B is hit so not a candidate)
    hi, lo = words([C, B])
    state, out = pb_lru.access(state, hi, lo, jnp.ones(2, bool), 1)
    assert out.frame.tolist() == [0, 1] and out.hit.tolist() == [False, True]
    assert out.evicted.tolist() == [True, False] and to_int(out.evicted_hi[0], out.evicted_lo[0]) == A
    # invalid requests never touch state
    state2, out = pb_lru.access(state, hi, lo, jnp.zeros(2, bool), 2)
    assert out.frame.tolist() == [-1, -1] and np.array_equal(state2.stamp, state.stamp)


def test_large_batch_runs():
    # a few hundred thousand requests against a 64K-frame pool, sort based (no [N, S] matrix)
    rng = np.random.default_rng(0)
    n = 200_000
    x = rng.integers(0, 2**40, n, dtype=np.uint64)
    state = pb_lru.init(64, 1024)
    state, out = pb_lru.access(state, *words(x), jnp.ones(n, bool), 0)
    f = np.asarray(out.frame)
    assert (f >= 0).sum() <= 64 * 1024 and len(np.unique(f[f >= 0])) == len(np.unique(x[f >= 0]))


def test_bad_inputs():
    state = pb_lru.init(4, 4)
    hi = jnp.zeros(3, jnp.uint32)
    with pytest.raises(ValueError, match="power of two"):
        pb_lru.init(3, 4)
    with pytest.raises(ValueError, match="slots_per_bucket"):
        pb_lru.init(4, 0)
    with pytest.raises(TypeError, match="uint32"):
        pb_lru.access(state, hi.astype(jnp.int32), hi, jnp.ones(3, bool), 0)
    with pytest.raises(TypeError, match="bool"):
        pb_lru.access(state, hi, hi, jnp.ones(3, jnp.int32), 0)
    with pytest.raises(ValueError, match="share one shape"):
        pb_lru.access(state, hi, hi[:2], jnp.ones(3, bool), 0)
    with pytest.raises(ValueError, match="1-D"):
        pb_lru.access(state, hi.reshape(3, 1), hi.reshape(3, 1), jnp.ones((3, 1), bool), 0)
    with pytest.raises(ValueError, match="now = -1"):
        pb_lru.access(state, hi, hi, jnp.ones(3, bool), -1)
    with pytest.raises(ValueError, match="impl"):
        pb_lru.access(state, hi, hi, jnp.ones(3, bool), 0, impl="cuda")
    with pytest.raises(ValueError, match="'seq'"):
        pb_lru.release(state, 2**20)
    table = vtlb.init(2, 1, 1, 4, PAGE)
    with pytest.raises(ValueError, match="outside the vTLB"):
        vtlb.translate(table, *lid.pack(np.array([5]), np.array([0]), np.array([0]), np.array([0])))
    with pytest.raises(ValueError, match="max_seqs"):
        vtlb.init(0, 1, 1, 4, PAGE)


def test_rebase_keeps_recent_order_and_empties():
    stamp = jnp.asarray([[-1, 0, 5, 9], [10, 11, -1, 3]], jnp.int32)
    s = pb_lru.PBLRUState(tag_hi=jnp.zeros((2, 4), jnp.uint32), tag_lo=jnp.zeros((2, 4), jnp.uint32), stamp=stamp)
    r = pb_lru.rebase(s, 6)
    np.testing.assert_array_equal(np.asarray(r.stamp), [[-1, 0, 0, 3], [4, 5, -1, 0]])


def test_trace_from_a_rebased_clock_equals_trace_from_zero():
    # the same trace at clock t and at clock t + 2**31 - 64 with the cache's rebase before every step: every
    # output and the final tags are identical (stamps differ by the constant offset the rebase leaves)
    from ulacache_jax.cache import state as cache_state
    rng = np.random.default_rng(3)
    universe = rng.integers(0, 2**40, 300, dtype=np.uint64)
    a = b = pb_lru.init(8, 4)
    clock_b = 2**31 - 64
    for t in range(120):
        x = universe[rng.integers(0, 300, 24)]
        hi, lo = (jnp.asarray((x >> np.uint64(32)).astype(np.uint32)),
                  jnp.asarray((x & np.uint64(0xFFFFFFFF)).astype(np.uint32)))
        valid = jnp.asarray(rng.random(24) < 0.9)
        # wind b's clock back as the decode does (at/keep scaled down so it happens inside this trace)
        off = clock_b - 40 if clock_b >= 100 else 0
        b, clock_b = pb_lru.rebase(b, off), clock_b - off
        a, out_a = pb_lru.ref_access(a, hi, lo, valid, jnp.int32(t))
        b, out_b = pb_lru.ref_access(b, hi, lo, valid, jnp.int32(clock_b))
        clock_b += 1
        for f in ("frame", "hit", "evicted", "evicted_hi", "evicted_lo", "fill"):
            np.testing.assert_array_equal(np.asarray(getattr(out_a, f)), np.asarray(getattr(out_b, f)), err_msg=f)
    np.testing.assert_array_equal(np.asarray(a.tag_lo), np.asarray(b.tag_lo))
    with pytest.raises(ValueError, match="keep"):
        cache_state.rebase_clock(None, at=10, keep=20)


def test_belady_hit_rate_by_hand():
    """Requests 1,2 | 3,1 | 1,2 with room for 2 pages: 3 evicts 2 (next used last), so 1 hits twice."""
    trace = np.array([[1, 2], [3, 1], [1, 2]])
    valid = np.ones_like(trace, bool)
    assert pb_lru.belady_hit_rate(trace, valid, 2, warmup=0) == pytest.approx(2 / 6)
    assert pb_lru.belady_hit_rate(trace, valid, 2, warmup=1) == pytest.approx(2 / 4)   # rows >= 1 counted
    valid[1, 1] = False                                    # the second request for 1 not made: one hit left
    assert pb_lru.belady_hit_rate(trace, valid, 2, warmup=0) == pytest.approx(1 / 5)
