"""select -> sieve -> fetch -> attend over the cache, against dense attention on the same K/V."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.cache.select import quest as selection
from ulacache_jax.cache.config import TAIL_PAGES, CacheConfig
from ulacache_jax.cache.state import overflow_frame
from ulacache_jax.cache.decode_layer import DecodeOptions, attend_layer, plan_layer
from ulacache_jax.models.attention import dense_attention
from ulacache_jax.runtime.sequences import CacheManager
from cache_steps import copied, jitted_flush

QPK = 2  # query heads per KV head


def setup(lengths, *, token_budget, buckets=4, slots=8, kvg=1, seed=0):
    c = CacheConfig(num_layers=2, num_kv_heads=2, kv_heads_per_group=kvg, head_dim=16, max_seqs=len(lengths),
                    max_pages_per_seq=32, page_size=8, num_buckets=buckets, slots_per_bucket=slots, host_pages=512,
                    token_budget=token_budget, dtype="float32", sink_pages=1, recent_pages=1)
    m = CacheManager(c)
    rng = np.random.default_rng(seed)
    kv = []
    for n in lengths:
        slot = m.admit(n + 8)
        k = rng.standard_normal((2, n, 2, 16)).astype(np.float32)
        v = rng.standard_normal((2, n, 2, 16)).astype(np.float32)
        m.ingest(slot, jnp.asarray(k), jnp.asarray(v), n)
        kv.append((k, v))
    return c, m, kv, rng


def dense_ref(q, k, v):
    """q [1, 1, H, D], k/v [T, KV, D] -> [1, 1, H, D] attention over all T tokens."""
    T = k.shape[0]
    return dense_attention(q, jnp.asarray(k)[None], jnp.asarray(v)[None], jnp.asarray([[T - 1]]),
                           jnp.arange(T)[None])


@pytest.mark.parametrize("fused", [False, True])
def test_covering_budget_equals_dense(fused):
    lengths = [37, 1, 64, 20]
    c, m, kv, rng = setup(lengths, token_budget=128)
    step = jax.jit(lambda s, h, q, k, v, pos, live: attend_layer(s, h, 1, q, k, v, pos, live,
                                                                  options=DecodeOptions(fused_fetch=fused)))
    S = len(lengths)
    q = rng.standard_normal((S, 1, 2 * QPK, 16)).astype(np.float32)
    kn = rng.standard_normal((S, 2, 16)).astype(np.float32)
    vn = rng.standard_normal((S, 2, 16)).astype(np.float32)
    pos = jnp.asarray(lengths, jnp.int32)
    state, out, stats = step(m.state, m.host, jnp.asarray(q), jnp.asarray(kn), jnp.asarray(vn), pos,
                             jnp.ones(S, bool))
    for s, n in enumerate(lengths):
        k = np.concatenate([kv[s][0][1], kn[s][None]], 0)
        v = np.concatenate([kv[s][1][1], vn[s][None]], 0)
        want = dense_ref(jnp.asarray(q[s:s + 1]), k, v)
        scale = float(jnp.abs(want).max())
        np.testing.assert_allclose(np.asarray(out[s:s + 1]), np.asarray(want), atol=1e-4 * scale, rtol=0)
    assert int(stats.misses) == 2 * sum(n // 8 for n in lengths)   # every flushed page of both groups, once
    # the second access of the same pages hits
    state, out2, stats2 = step(state, m.host, jnp.asarray(q), jnp.asarray(kn), jnp.asarray(vn), pos,
                               jnp.ones(S, bool))
    assert int(stats2.hits) == int(stats.misses) - int(stats.overflow) and int(stats2.misses) == int(stats.overflow)
    np.testing.assert_allclose(np.asarray(out2), np.asarray(out), atol=1e-6)


def test_small_budget_attends_exactly_the_selected_pages_through_evictions():
    lengths = [120, 97]
    c, m, kv, rng = setup(lengths, token_budget=32, buckets=2, slots=3)  # 6 frames for 2x4 requests: overflow
    step = jax.jit(lambda s, h, q, k, v, pos, live: attend_layer(s, h, 0, q, k, v, pos, live))
    state, overflowed = m.state, 0
    for it in range(3):
        q = rng.standard_normal((2, 1, 2 * QPK, 16)).astype(np.float32)
        kn = np.zeros((2, 2, 16), np.float32)
        pos = jnp.asarray(lengths, jnp.int32)
        state, out, stats = step(state, m.host, jnp.asarray(q), jnp.asarray(kn), jnp.asarray(kn), pos,
                                 jnp.ones(2, bool))
        # expected: the same selection computed independently, attention over those pages + tail
        scores = selection.ref_page_scores(jnp.asarray(q), state.kmin[0, :, 0], state.kmax[0, :, 0])
        sel = np.asarray(selection.select_pages(scores, state.seqs.flushed, select_pages=4, sink_pages=1,
                                                recent_pages=1))
        for s, n in enumerate(lengths):
            k = np.concatenate([kv[s][0][0], kn[s][None]], 0)
            v = np.concatenate([kv[s][1][0], kn[s][None]], 0)
            for g in range(2):
                pages = sorted(set(int(p) for p in sel[s, g] if p >= 0) | {n // 8})
                toks = np.concatenate([np.arange(p * 8, min(p * 8 + 8, n + 1)) for p in pages])
                want = dense_ref(jnp.asarray(q[s:s + 1, :, g * QPK:(g + 1) * QPK]), k[toks][:, g:g + 1],
                                 v[toks][:, g:g + 1])
                got = np.asarray(out[s:s + 1, :, g * QPK:(g + 1) * QPK])
                np.testing.assert_allclose(got, np.asarray(want), atol=1e-4 * float(jnp.abs(want).max()), rtol=0)
        assert int(stats.hits) + int(stats.misses) == 2 * 2 * 4
        overflowed += int(stats.overflow)
    assert overflowed > 0  # the overflow pages (staged in HBM overflow frames) were attended correctly above


def test_overflow_is_staged_in_hbm_and_attention_never_reads_the_host():
    lengths = [120, 97]
    c, m, kv, rng = setup(lengths, token_budget=32, buckets=2, slots=3)  # 6 frames for 2x4 requests
    q = jnp.asarray(rng.standard_normal((2, 1, 2 * QPK, 16)), jnp.float32)
    kn = jnp.zeros((2, 2, 16), jnp.float32)
    st, plan, stats = jax.jit(lambda s, h: plan_layer(s, h, 0, q, kn, kn, jnp.asarray(lengths, jnp.int32),
                                                      jnp.ones(2, bool)))(m.state, m.host)
    n_over = int(stats.overflow)
    assert n_over > 0
    src, frame = np.asarray(plan.src), np.asarray(plan.frame)
    assert set(np.unique(src)) <= {0, 1}                               # HBM or unused: no host reads
    staged = frame[(frame >= overflow_frame(c, 0)) & (src == 1)]
    # one overflow frame each: the slot's own (sequence, group, slot), inside the overflow region
    assert len(staged) == n_over and len(set(staged.tolist())) == n_over
    sel_frame, sel_src = frame[..., :-TAIL_PAGES], src[..., :-TAIL_PAGES]             # [S, G, K] the selected
    slot = np.arange(sel_frame.size).reshape(sel_frame.shape)
    over = (sel_frame >= overflow_frame(c, 0)) & (sel_src == 1)
    np.testing.assert_array_equal(sel_frame[over], overflow_frame(c, slot[over]))
    assert staged.max() < overflow_frame(c, c.overflow_frames)
    # the staged pages hold the selected pages' bytes (fetched from the host pool)
    np.testing.assert_array_equal(np.asarray(st.pool_k[0, staged]),
                                  np.asarray(m.host.k[0, plan.host_page[frame >= overflow_frame(c, 0)]]))
    # the vTLB does not record staged pages: they are not cached
    assert not np.isin(np.asarray(st.vtlb.frame), staged).any()


def test_top_k_kernel_makes_the_same_layer_steps():
    """The radix-select top-k (interpret mode) selects what lax.top_k does: same frames, hits, outputs, 3 steps."""
    lengths = [120, 97]
    c, m, kv, rng = setup(lengths, token_budget=32, buckets=2, slots=3)
    steps = {t: jax.jit(lambda s, h, q, k, v, pos, live, t=t: attend_layer(s, h, 0, q, k, v, pos, live,
                                                                             options=DecodeOptions(topk=t)))
             for t in ("ref", "pallas")}
    states = {t: m.state for t in steps}
    for it in range(3):
        q = jnp.asarray(rng.standard_normal((2, 1, 2 * QPK, 16)), jnp.float32)
        kn = jnp.zeros((2, 2, 16), jnp.float32)
        res = {t: steps[t](states[t], m.host, q, kn, kn, jnp.asarray(lengths, jnp.int32), jnp.ones(2, bool))
               for t in steps}
        states = {t: r[0] for t, r in res.items()}
        np.testing.assert_array_equal(np.asarray(states["ref"].vtlb.frame), np.asarray(states["pallas"].vtlb.frame))
        np.testing.assert_array_equal(np.asarray(res["ref"][1]), np.asarray(res["pallas"][1]))
        assert int(res["ref"][2].hits) == int(res["pallas"][2].hits)


def test_planted_needle_is_selected():
    c, m, kv, rng = setup([128], token_budget=32)
    q = np.zeros((1, 1, 2 * QPK, 16), np.float32)
    q[..., 3] = 5.0
    # plant a key aligned with q in page 7 of layer 0, group 0, re-ingest
    k, v = kv[0]
    k = k.copy()
    k[0, 7 * 8 + 2, 0, 3] = 50.0
    m.release(0)
    slot = m.admit(140)
    m.ingest(slot, jnp.asarray(k), jnp.asarray(v), 128)
    scores = selection.ref_page_scores(jnp.asarray(q), m.state.kmin[0, :, 0], m.state.kmax[0, :, 0])
    sel = np.asarray(selection.select_pages(scores, m.state.seqs.flushed, select_pages=4, sink_pages=1,
                                            recent_pages=1))
    assert 7 in sel[0, 0] and 0 in sel[0, 0] and 15 in sel[0, 0]


def test_flush_writes_completed_tail_pages_once():
    c, m, kv, rng = setup([15], token_budget=64)
    step = jax.jit(lambda s, h, q, k, v, pos, live: attend_layer(s, h, 0, q, k, v, pos, live))
    kn = rng.standard_normal((1, 2, 16)).astype(np.float32)
    q = np.zeros((1, 1, 4, 16), np.float32)
    state, _, _ = step(m.state, m.host, jnp.asarray(q), jnp.asarray(kn), jnp.asarray(kn), jnp.asarray([15]),
                       jnp.ones(1, bool))
    import dataclasses
    state = dataclasses.replace(state, seqs=dataclasses.replace(state.seqs, length=state.seqs.length + 1))
    state, host = jitted_flush(m)(state, m.host)
    assert int(state.seqs.flushed[0]) == 2
    hp = int(state.vtlb.host_page[0, 0, 0, 0, 1])
    np.testing.assert_array_equal(np.asarray(host.k[0, hp, 7, 0]), kn[0, 0])
    np.testing.assert_array_equal(np.asarray(host.k[0, hp, :7, 0]), kv[0][0][0, 8:15, 0])


def test_compiled_flush_writes_the_host_pool_in_place():
    """flush_tail hands the host pool to page_copy.flush with its rank axis (rank=0, indexed inside the kernel,
    the module's contract): the compiled, donated flush copies no host array. Slicing the rank out and stacking it
    back made XLA copy the whole pool (K and V, twice each) on every flush; on a GPU such a copy of a pinned_host
    array is a host-side transient the size of the pool."""
    c, m, _, _ = setup([15, 30], token_budget=64)
    txt = jitted_flush(m).lower(m.state, m.host).compile().as_text()
    assert copied(txt, [m.host.k, m.host.v]) == []

