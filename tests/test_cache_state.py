"""Tiered store: admission, capacity errors, prefill ingestion, write-through, release."""
import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.state import tail_frame, check_fits
from ulacache_jax.cache import state as cache_state
from ulacache_jax.runtime.sequences import CacheManager, CapacityError
from cache_steps import jitted_flush
from ulacache_jax.pallas_kernels import page_copy


def cfg(**kw):
    base = dict(num_layers=2, num_kv_heads=4, kv_heads_per_group=2, head_dim=8, max_seqs=3, max_pages_per_seq=8,
                page_size=4, num_buckets=2, slots_per_bucket=4, host_pages=96, token_budget=16, dtype="float32")
    return CacheConfig(**{**base, **kw})


def leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_config_validation_names_the_limit():
    with pytest.raises(ValueError, match="token_budget = 10 must be a multiple of page_size = 4"):
        cfg(token_budget=10)
    with pytest.raises(ValueError, match="num_groups = 32 exceeds 16"):
        cfg(num_kv_heads=32, kv_heads_per_group=1)
    with pytest.raises(ValueError, match="power of two"):
        cfg(num_buckets=3)
    with pytest.raises(ValueError, match="sink_pages \\+ recent_pages"):
        cfg(sink_pages=3, recent_pages=3)


def test_refuses_pools_that_do_not_fit_before_allocating():
    with pytest.raises(ValueError, match="host pool needs .* GiB .* only 0.00 GiB"):
        check_fits(cfg(), host_bytes=1024)


def test_prefill_ingest_summaries_ring_and_write_through():
    c = cfg()
    m = CacheManager(c)
    rng = np.random.default_rng(0)
    T = 14                                    # 3 complete pages + a partial one
    k = rng.standard_normal((c.num_layers, T, c.num_kv_heads, c.head_dim)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    slot = m.admit(T + 6)
    m.ingest(slot, jnp.asarray(k), jnp.asarray(v), T, chunk=8)   # two chunks
    st = m.state
    assert int(st.seqs.length[slot]) == T and int(st.seqs.flushed[slot]) == 3
    kk = k.reshape(c.num_layers, T, 2, 2, c.head_dim)          # [L, T, G, g, D]
    hp = np.asarray(st.vtlb.host_page[0, slot])
    hk, hv = np.asarray(m.host.k[0]), np.asarray(m.host.v[0])
    for l in range(c.num_layers):
        for g in range(2):
            for p in range(4):
                toks = kk[l, p * 4:min(T, p * 4 + 4), g]
                np.testing.assert_array_equal(np.asarray(st.kmin[0, slot, l, g, p]), toks.min(0))
                np.testing.assert_array_equal(np.asarray(st.kmax[0, slot, l, g, p]), toks.max(0))
                if p < 3:   # complete pages are in the host pool
                    np.testing.assert_array_equal(hk[hp[l, g, p]], toks.transpose(0, 1, 2))
                    np.testing.assert_array_equal(hv[hp[l, g, p]], v.reshape(kk.shape)[l, p * 4:p * 4 + 4, g])
                else:       # the partial page is in the tail ring
                    f = int(tail_frame(c, slot, l, g, p))
                    np.testing.assert_array_equal(np.asarray(st.pool_k[0, f, :2]), toks)


def test_flush_then_fetch_round_trip():
    c = cfg()
    m = CacheManager(c)
    rng = np.random.default_rng(1)
    slot = m.admit(16)
    k = rng.standard_normal((c.num_layers, 8, c.num_kv_heads, c.head_dim)).astype(np.float32)
    m.ingest(slot, jnp.asarray(k), jnp.asarray(k), 7)          # page 1 partial, in the ring
    # complete page 1 in the ring by hand, then flush it
    f = int(tail_frame(c, slot, 1, 0, 1))
    page = rng.standard_normal((4, 2, c.head_dim)).astype(np.float32)
    st = m.state
    st = dataclasses.replace(st, pool_k=st.pool_k.at[0, f].set(page),
                             seqs=dataclasses.replace(st.seqs, length=st.seqs.length.at[slot].set(8)))
    st, host = jitted_flush(m)(st, m.host)
    assert int(st.seqs.flushed[slot]) == 2
    hp = int(st.vtlb.host_page[0, slot, 1, 0, 1])
    np.testing.assert_array_equal(np.asarray(host.k[0, hp]), page)
    # evict-and-fetch: copy the host page into an arbitrary PB-LRU frame
    pool = page_copy.fetch(st.pool_k[0], host.k[0], jnp.asarray([hp, -1]), jnp.asarray([5, 6]))
    np.testing.assert_array_equal(np.asarray(pool[5]), page)
    np.testing.assert_array_equal(np.asarray(pool[6]), np.asarray(st.pool_k[0, 6]))


def test_capacity_errors_leave_state_unchanged():
    c = cfg()
    m = CacheManager(c)
    with pytest.raises(CapacityError, match="needs 9 pages, over max_pages_per_seq = 8 by 1"):
        m.admit(33)
    a = m.admit(32)                                      # 2 layers x 2 groups x 8 pages = 32 host pages
    b = m.admit(32)
    m.admit(4)                                           # the third and last slot
    snap = jax.tree.map(np.asarray, m.state)
    free = (m.alloc.num_free, list(m.alloc.free_slots))
    with pytest.raises(CapacityError, match="all max_seqs = 3 sequence slots are in use"):
        m.admit(4)
    assert leaves_equal(snap, m.state) and free == (m.alloc.num_free, list(m.alloc.free_slots))
    m.release(a)
    m.release(b)
    assert m.alloc.num_free == c.host_pages - 4
    with pytest.raises(ValueError, match="slot 0 is not admitted"):
        m.release(a)


def test_host_pool_exhaustion_message_and_no_change():
    c = cfg(host_pages=40)
    m = CacheManager(c)
    m.admit(32)                                          # 32 of 40 pages
    snap = jax.tree.map(np.asarray, m.state)
    free = (m.alloc.num_free, list(m.alloc.free_slots))
    with pytest.raises(CapacityError, match="needs 12 host pages but only 8 of host_pages = 40 are free \\(short by 4\\)"):
        m.admit(12)
    assert leaves_equal(snap, m.state) and free == (m.alloc.num_free, list(m.alloc.free_slots))


def test_admit_release_restores_fresh_state():
    c = cfg()
    m = CacheManager(c)
    fresh = jax.tree.map(np.asarray, m.state)
    rng = np.random.default_rng(2)
    slot = m.admit(20)
    k = rng.standard_normal((c.num_layers, 16, c.num_kv_heads, c.head_dim)).astype(np.float32)
    m.ingest(slot, jnp.asarray(k), jnp.asarray(k), 16)
    m.release(slot)
    st = m.state
    for name in ("pb", "vtlb", "seqs", "kmin", "kmax", "clock"):
        assert leaves_equal(getattr(fresh, name), getattr(st, name)), name
    assert m.alloc.num_free == c.host_pages and sorted(m.alloc.free_slots) == [0, 1, 2]

def test_host_limit_default_and_env(monkeypatch):
    monkeypatch.delenv(cache_state.HOST_LIMIT_ENV, raising=False)
    assert cache_state.xla_host_limit_bytes() == 64 * 2**30
    monkeypatch.setenv(cache_state.HOST_LIMIT_ENV, "200")
    assert cache_state.xla_host_limit_bytes() == 200 * 2**30
    monkeypatch.setenv(cache_state.HOST_LIMIT_ENV, "lots")
    with pytest.raises(ValueError, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB = 'lots'"):
        cache_state.xla_host_limit_bytes()

def test_raise_host_limit_respects_user_setting(monkeypatch):
    monkeypatch.setenv(cache_state.HOST_LIMIT_ENV, "70")
    assert cache_state.raise_host_limit() is None
    monkeypatch.delenv(cache_state.HOST_LIMIT_ENV)
    monkeypatch.setattr(cache_state, "pinnable_host_bytes", lambda: 250 * 2**30)
    assert cache_state.raise_host_limit(0.9) == 225
    assert cache_state.xla_host_limit_bytes() == 225 * 2**30
    monkeypatch.delenv(cache_state.HOST_LIMIT_ENV)
    monkeypatch.setattr(cache_state, "pinnable_host_bytes", lambda: 16 * 2**30)  # never below XLA's default
    assert cache_state.raise_host_limit(0.9) == 64
