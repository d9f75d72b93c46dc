"""Per-token selection (CacheConfig.token_shortlist; decode_layer.token_list / tail_tokens, the token attention
kernel): the decode selects token_shortlist x the budget's pages and attends the budget's tokens of largest label
mass among them.

Checked against references written from what the cache holds: the tokens a plan lists are the sink and recent pages'
and then the heaviest of the shortlist by a numpy softmax over the dequantised labels, with the tail pages' tokens
after them; a covering budget gives dense's tokens through generate; speculative verification (each row's own
token selection) gives the plain run's greedy tokens; bad settings are refused by name."""
import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.decode_layer import plan_layer
from ulacache_jax.cache.select import labels
from cache_steps import assert_covering_budget_equals_dense, ingest_and_decode, tiny_model

PAGE, C, D, QPK = 8, 4, 16, 2


def config(**kw):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=D, max_seqs=3, max_pages_per_seq=32, page_size=PAGE,
                num_buckets=4, slots_per_bucket=16, host_pages=512, token_budget=32, dtype="float32", sink_pages=1,
                recent_pages=1, key_channels=C, label_bits=4, token_shortlist=2)
    return CacheConfig(**{**base, **kw})


def test_config_checks_and_sizes():
    c = config()
    assert c.select_pages == 4 and c.shortlist_pages == 8
    assert c.overflow_frames == c.max_seqs * c.groups_per_rank * 8
    assert config(token_shortlist=0).shortlist_pages == 4
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"token_shortlist = .* must be an int >= 0"):
            config(token_shortlist=bad)
    with pytest.raises(ValueError, match=r"token_shortlist = 2 ranks single tokens: the rule 'quest'"):
        config(key_channels=0, label_bits=0)
    with pytest.raises(ValueError, match=r"token_shortlist = 2 reads pages in the model's dtype: kv_dtype"):
        config(kv_dtype="float8_e4m3fn", dtype="bfloat16")


def _decoded(c, seed=3):
    """The cache after 13 decode steps of three sequences (one shorter than a page): the same contents for every
    config of one geometry but the pool's (the K/V and queries come from `seed`)."""
    rng = np.random.default_rng(seed)
    lengths = [37, 61, 8]
    _, state, host, ks = ingest_and_decode(c, lengths, 13, rng, qpk=QPK,
                                           key_scale=rng.uniform(0.2, 3.0, D).astype(np.float32))
    return state, host, jnp.asarray([k.shape[1] for k in ks], jnp.int32)


def _plans(c, qs, seed=3):
    state, host, pos = _decoded(c, seed)
    S = pos.shape[0]
    plan_fn = jax.jit(lambda st, h, q: plan_layer(st, h, 0, q, None, None, pos, jnp.ones(S, bool), append=False))
    return state, pos, [plan_fn(state, host, q)[1] for q in qs]


def _mass(c, state, s, gi, pages, q):
    """numpy token mass of `pages` (the labels dequantised, each query head's softmax over their tokens, summed)
    -> (tokens [n * PAGE], mass, forced) in the order of `pages`."""
    vals = np.asarray(labels.dequantize(state.sel.kc[0, s, 0, gi, jnp.asarray(pages)],
                                        state.sel.ksc[0, s, 0, gi, jnp.asarray(pages)], 4))
    ch = np.asarray(state.sel.chan[0, s, 0, gi, 0])
    qh = np.asarray(q[s, 0, gi * QPK:(gi + 1) * QPK])[:, ch] / np.sqrt(D)   # [QPK, C]
    logit = qh @ vals.reshape(-1, C).T                                       # [QPK, n * PAGE]
    p = np.exp(logit - logit.max(1, keepdims=True))
    fl = int(state.seqs.flushed[s])
    tok = np.asarray([pg * PAGE + r for pg in pages for r in range(PAGE)])
    forced = np.repeat([(pg < c.sink_pages) or (pg >= fl - c.recent_pages) for pg in pages], PAGE)
    return tok, (p / p.sum(1, keepdims=True)).sum(0), forced


def _heaviest(tok, mass, forced, n):
    order = np.lexsort((-mass, ~forced))                                     # forced first, then mass
    return tok[order[:n]]


def test_plan_lists_the_heaviest_tokens_of_the_shortlist():
    """The plan's tokens: the sink and recent pages', then the heaviest of the 3 x budget pages it lists by a numpy
    softmax over their dequantised labels; the tail pages' tokens after them."""
    S = 3
    rng = np.random.default_rng(11)
    qs = [jnp.asarray(rng.standard_normal((S, 1, 2 * QPK, D)) * 2, jnp.float32) for _ in range(3)]
    c = config(token_shortlist=3)
    state, pos, plans = _plans(c, qs)
    K, N = c.shortlist_pages, c.token_budget
    assert K == 12
    for q, plan in zip(qs, plans):
        tok_pos = np.asarray(plan.tok_pos)
        assert tok_pos.shape == (S, 2, N + 2 * PAGE) and np.asarray(plan.start).shape[-1] == K + 2
        for s in range(S):
            fl = int(state.seqs.flushed[s])
            for gi in range(2):
                pages = [int(x) // PAGE for x in np.asarray(plan.start)[s, gi, :K] if x >= 0]
                assert len(pages) == min(fl, K)
                tok, mass, forced = _mass(c, state, s, gi, pages, q)
                want = _heaviest(tok, mass, forced, N)
                got = tok_pos[s, gi, :N]
                assert set(got[got >= 0].tolist()) == set(want.tolist())
                tail = tok_pos[s, gi, N:]
                assert set(tail[tail >= 0].tolist()) == set(range(fl * PAGE, int(pos[s]) + 1))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_generate_covering_budget_equals_dense(model):
    assert_covering_budget_equals_dense(model, key_channels=8, label_bits=4, token_shortlist=2)


def test_engine_small_budget_speculative_equals_plain_and_tokens_differ_from_pages(model):
    """Budget 4 pages of 16 (prompts of 100+ tokens): per-token selection runs through the Engine; greedy
    speculative decoding (verification lists each row's tokens from its own query) gives the plain run's tokens;
    whole-page selection at the same budget gives other tokens (the token lists are what is attended)."""
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    from ulacache_jax.runtime.speculative.rules import SpecConfig
    rng = np.random.default_rng(2)
    doc = [int(t) for t in rng.integers(0, 256, 100)]
    prompts = [doc + [int(t) for t in rng.integers(0, 256, n)] for n in (5, 23)]
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=192, page_size=16, token_budget=64,
                               key_channels=8, label_bits=4, token_shortlist=2, verify_rows=4)
    params = SamplingParams(max_new_tokens=16)
    outs = {}
    gen = Generator(model, cfg, attention="sparse")
    for name, kw in (("plain", {}), ("spec", dict(speculative=SpecConfig("ngram", 3)))):
        reqs = Engine(generator=gen, **kw).run(prompts, params)
        assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
        outs[name] = [r.tokens for r in reqs]
    assert outs["spec"] == outs["plain"]
    pages = Engine(generator=Generator(model, dataclasses.replace(cfg, token_shortlist=0),
                                                                attention="sparse"))
    assert [r.tokens for r in pages.run(prompts, params)] != outs["plain"]


def test_two_stage_lists_its_second_stage_tokens():
    """A TwoStage rule selects tokens through its second stage (`tokens`, `score_tokens`): with a shortlist that
    holds every page it is the labels alone, so the plans list the same tokens; a Quest second stage (pages only)
    is refused by name."""
    from ulacache_jax.cache.select import two_stage
    S = 3
    rng = np.random.default_rng(5)
    qs = [jnp.asarray(rng.standard_normal((S, 1, 2 * QPK, D)) * 2, jnp.float32)]
    plain = config(token_shortlist=3)
    staged = two_stage.configure(plain, 8)        # 8 x 4 budget pages >= the 32 pages a sequence may hold
    assert staged.selection.tokens and staged.shortlist_pages == plain.shortlist_pages
    state, host, pos = _decoded(plain)
    live = jnp.ones(S, bool)
    # the same cache read under either rule: a Quest-first TwoStage keeps its second stage's state as is
    plan = jax.jit(lambda st, h, q: plan_layer(st, h, 0, q, None, None, pos, live, append=False)[1])
    a, b = (plan(dataclasses.replace(state, config=c), host, qs[0]) for c in (plain, staged))
    np.testing.assert_array_equal(np.asarray(a.tok_pos), np.asarray(b.tok_pos))
    from ulacache_jax.cache.select.quest import Quest
    with pytest.raises(ValueError, match=r"token_shortlist = 2 ranks single tokens"):
        config(key_channels=0, label_bits=0, selection=two_stage.TwoStage(Quest(), keep_pages=8))
