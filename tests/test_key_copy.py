"""The compressed key copy (CacheConfig.key_channels, key_copy.py; the "topchan" rule of issue 19).

Checked against references written from the raw keys: the copy a cache holds after ingest + decode steps (and
flushes) equals each flushed token's key at its sequence's channels, the channels are those of largest energy over
the first ingested block; page mass equals an independent numpy softmax over the true logits when every channel is
kept; selections equal that reference's top-k; generate / Engine run end to end (tiny model, sparse): a covering
budget equals dense, shared prefixes and speculative decoding give the tokens of a plain run."""
import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.cache.select import key_copy
from ulacache_jax.cache.select import quest as selection
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.decode_layer import plan_layer
from cache_steps import assert_covering_budget_equals_dense, ingest_and_decode, tiny_model

QPK = 2          # query heads per KV head
PAGE, C, D = 8, 4, 16


def test_config_checks_and_footprint():
    c = CacheConfig.preset("tiny", key_channels=4)
    base = CacheConfig.preset("tiny")
    assert base.key_channels == 0 and base.footprint()["key_copy"] == 0
    per = c.num_layers * c.groups_per_rank * c.max_seqs * c.kv_heads_per_group
    assert c.footprint()["key_copy"] == per * (c.max_context * 4 + 4) * 4
    for bad in (-1, 17, True, 2.0):
        with pytest.raises(ValueError, match=r"key_channels = .* must be an int in \[0, head_dim = 16\]"):
            CacheConfig.preset("tiny", key_channels=bad)


def test_no_copy_no_leaves():
    """key_channels = 0: the state holds no key-copy arrays at all (not zero-size ones), so a cache without the
    copy compiles and donates exactly the buffers it did before the option existed."""
    from ulacache_jax.cache import state as cache_state
    st, _ = cache_state.init(CacheConfig.preset("tiny"))
    assert st.sel is None
    assert all(x.size > 0 for x in jax.tree.leaves(st))
    st4, _ = cache_state.init(CacheConfig.preset("tiny", key_channels=4))
    assert st4.sel.kc.shape[-1] == 4 and len(jax.tree.leaves(st4)) == len(jax.tree.leaves(st)) + 2


def test_pick_channels_and_compress():
    k = np.zeros((1, 5, 1, 6), np.float32)
    k[0, :, 0, 4] = 3.0            # largest energy
    k[0, :, 0, 1] = 2.0
    k[0, 4, 0, 2] = 100.0          # only on a dead token: must not count
    live = np.array([[True, True, True, True, False]])
    ch = np.asarray(key_copy.pick_channels(jnp.asarray(k), jnp.asarray(live), 3))
    assert ch.tolist() == [[[4, 1, 0]]]                    # then the ties (all 0) by lower index
    none = np.asarray(key_copy.pick_channels(jnp.asarray(k), jnp.zeros((1, 5), bool), 3))
    assert none.tolist() == [[[0, 1, 2]]]
    got = np.asarray(key_copy.compress(jnp.asarray(k), jnp.asarray(ch)))
    np.testing.assert_array_equal(got, k[..., [4, 1, 0]])


def np_page_mass(q, keys, flushed, page):
    """Independent reference: q [H, D] one sequence's query heads of one KV head group (all its heads), keys
    [T, D] the KV head's keys (g = 1) -> [P] the summed per-head softmax weight of each flushed page's tokens."""
    n = flushed * page
    s = q @ keys[:n].T / np.sqrt(q.shape[-1])                                        # [H, n]
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return w.sum(0).reshape(flushed, page).sum(-1)


@pytest.mark.parametrize("impl", ["ref", "pallas"])
def test_page_mass_with_every_channel_is_the_true_attention_mass(impl):
    """With all D channels the copy's page mass is the true attention mass (the kernel in interpret mode too)."""
    rng = np.random.default_rng(0)
    S, G, P = 3, 2, 6
    keys = rng.standard_normal((S, G, P * PAGE, D)).astype(np.float32)
    chan = np.stack([rng.permutation(D) for _ in range(S * G)]).reshape(S, G, 1, D).astype(np.int32)
    kc = np.take_along_axis(keys[:, :, :, None, :], chan[:, :, None], axis=-1)      # [S, G, T, 1, D]
    kc = kc.reshape(S, 1, G, P, PAGE, 1, D)
    kc = np.concatenate([rng.standard_normal(kc.shape).astype(np.float32), kc], axis=1)   # layer 0: other keys
    q = rng.standard_normal((S, 1, G * QPK, D)).astype(np.float32) * 2
    flushed = np.array([6, 2, 0], np.int32)                                          # 0: nothing to rank
    got = np.asarray(key_copy.page_mass(jnp.asarray(kc), jnp.asarray(chan), jnp.asarray(q), jnp.asarray(flushed),
                                        layer=1, impl=impl))
    for s in range(S):
        assert np.isneginf(got[s, :, flushed[s]:]).all()
        for gi in range(G):
            if flushed[s]:
                want = np_page_mass(q[s, 0, gi * QPK:(gi + 1) * QPK], keys[s, gi], flushed[s], PAGE)
                np.testing.assert_allclose(got[s, gi, :flushed[s]], want, rtol=1e-5, atol=1e-6)


# ---- a cache built by ingest + decode steps, against the raw keys ---------------------------------------------------
def build(lengths, steps, *, token_budget=32, seed=0):
    """Ingest random K/V for each length, then `steps` decode steps of every layer, completed pages flushed after
    each step as the decode program does -> (config, state, host, raw K per sequence [L, T, KV, D], rng)."""
    c = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=D, max_seqs=len(lengths), max_pages_per_seq=32,
                    page_size=PAGE, num_buckets=4, slots_per_bucket=8, host_pages=512, token_budget=token_budget,
                    dtype="float32", sink_pages=1, recent_pages=1, key_channels=C)
    rng = np.random.default_rng(seed)
    _, state, host, ks = ingest_and_decode(c, lengths, steps, rng, qpk=QPK,
                                           key_scale=rng.uniform(0.2, 3.0, D).astype(np.float32))
    return c, state, host, ks, lengths, rng


@pytest.fixture(scope="module")
def built():
    return build([37, 61, 8], steps=13)


def test_copy_holds_every_flushed_key_at_the_first_blocks_channels(built):
    c, state, host, ks, lengths, rng = built
    assert state.sel.kc.shape == (1, 3, 2, 2, 32, PAGE, 1, C) and state.sel.chan.shape == (1, 3, 2, 2, 1, C)
    for s, (k, n0) in enumerate(zip(ks, lengths)):
        fl = int(state.seqs.flushed[s])
        assert fl == k.shape[1] // PAGE
        for l in range(2):
            for gi in range(2):
                energy = (k[l, :n0, gi] ** 2).sum(0)                                  # the ingested block's keys
                ch = np.asarray(state.sel.chan[0, s, l, gi, 0])
                assert ch.tolist() == np.argsort(-energy, kind="stable")[:C].tolist()
                copy = np.asarray(state.sel.kc[0, s, l, gi, :fl, :, 0]).reshape(fl * PAGE, C)
                np.testing.assert_array_equal(copy, k[l, :fl * PAGE, gi][:, ch])  # ingested and flushed pages


def test_selection_is_the_top_mass_pages_of_the_copy(built):
    c, state, host, ks, lengths, rng = built
    S = len(ks)
    pos = jnp.asarray([k.shape[1] for k in ks], jnp.int32)
    plan_fn = jax.jit(lambda st, h, q: plan_layer(st, h, 0, q, None, None, pos, jnp.ones(S, bool), append=False))
    K = c.select_pages
    for _ in range(4):
        q = jnp.asarray(rng.standard_normal((S, 1, 2 * QPK, D)) * 2, jnp.float32)
        _, plan, _ = plan_fn(state, host, q)
        start = np.asarray(plan.start)[:, :, :K]
        got = [[sorted(int(x) // PAGE for x in start[s, gi] if x >= 0) for gi in range(2)] for s in range(S)]
        scores = np.full((S, 2, c.max_pages_per_seq), -np.inf, np.float32)
        for s in range(S):
            fl = int(state.seqs.flushed[s])
            for gi in range(2):
                ch = np.asarray(state.sel.chan[0, s, 0, gi, 0])
                qh = np.asarray(q[s, 0, gi * QPK:(gi + 1) * QPK])[:, ch] * np.sqrt(C / D)   # logits / sqrt(D)
                scores[s, gi, :fl] = np_page_mass(qh, ks[s][0, :, gi][:, ch], fl, PAGE)
        sel = np.asarray(selection.select_pages(jnp.asarray(scores), state.seqs.flushed, select_pages=K,
                                                sink_pages=c.sink_pages, recent_pages=c.recent_pages))
        assert got == [[sorted(int(p) for p in sel[s, gi] if p >= 0) for gi in range(2)] for s in range(S)]


def test_a_released_slot_forgets_its_channels(built):
    from ulacache_jax.runtime.sequences import release_device
    c, state, host, ks, lengths, rng = built
    st = release_device(state, 1)
    assert (np.asarray(st.sel.chan[:, 1]) == np.arange(C)).all()
    np.testing.assert_array_equal(np.asarray(st.sel.chan[:, 0]), np.asarray(state.sel.chan[:, 0]))


# ---- end to end: generate / Engine, tiny model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_generate_covering_budget_equals_dense(model):
    assert_covering_budget_equals_dense(model, key_channels=8)


@pytest.mark.slow
def test_engine_small_budget_and_speculative(model):
    """Budget 4 pages of 16 (prompts of 100+ tokens select pages): the key copy runs through the Engine; greedy
    speculative decoding (verification scores each row from the copy) gives the plain run's tokens. Shared prefixes
    are on, but the 96-token shared prefix is under the window the online channels come from (the first
    min(1024, context) = 192 tokens), so it is prefilled, not attached (an attached prefix would change the tokens a
    sequence picks its channels from)."""
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    from ulacache_jax.runtime.speculative.rules import SpecConfig
    rng = np.random.default_rng(2)
    doc = [int(t) for t in rng.integers(0, 256, 100)]
    prompts = [doc + [int(t) for t in rng.integers(0, 256, n)] for n in (5, 23)]
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=192, page_size=16, token_budget=64,
                               key_channels=8, verify_rows=4)
    params = SamplingParams(max_new_tokens=16)
    outs = {}
    gen = Generator(model, cfg, attention="sparse")
    for name, kw in (("plain", {}), ("spec", dict(speculative=SpecConfig("ngram", 3)))):
        eng = Engine(generator=gen, **kw)
        assert gen.prefixes is not None
        reqs = eng.run(prompts, params)
        assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
        assert eng.prefix_stats().lookups == 2 and eng.prefix_stats().hits == 0
        outs[name] = [r.tokens for r in reqs]
    assert outs["spec"] == outs["plain"]
    quest = Engine(generator=Generator(model, dataclasses.replace(cfg, key_channels=0), attention="sparse"))
    assert [r.tokens for r in quest.run(prompts, params)] != outs["plain"]     # the copy selected other pages


@pytest.mark.gpu
def test_on_the_gpu_copy_selection_and_covering_budget(model):
    """The same checks compiled on the GPU (the decode's Pallas sieve / attention / copy kernels around the key
    copy's XLA scoring): the copy and channels after ingest + decode + flushes, the selection against the numpy
    reference, and a covering budget equal to dense through generate (float32)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    b = build([37, 61, 8], steps=13, seed=5)
    test_copy_holds_every_flushed_key_at_the_first_blocks_channels(b)
    test_selection_is_the_top_mass_pages_of_the_copy(b)
    test_generate_covering_budget_equals_dense(model)
