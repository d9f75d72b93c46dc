"""Engine: continuous batching over Generator slots gives generate()'s greedy tokens, queues on full slots and a
full host pool, fails impossible requests alone, and honours per-request sampling and stop ids.

One Generator (one compile) is shared by every test: tiny preset, 2 slots, context 256 tokens, page 16, token
budget 64 (4 pages: prompts of 40-120 tokens exercise sparse selection), host pool of 96 pages (two sequences of
200 tokens, 52 pages each, do not fit together)."""
import numpy as np
import pytest
from flax import nnx

from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generation import Generator, default_cache_config, generate
from ulacache_jax.models import LlamaModel, get_preset

LENS = (40, 100, 50, 120, 70)   # prefill buckets 64 and 128 only
# the prefill's token and three whole decode chunks of page_size (16) steps: every chunk runs the 16-step program
# (a shorter last chunk compiles its own)
MAX_NEW = 49


@pytest.fixture(scope="module")
def setup():
    mc = get_preset("tiny")
    model = LlamaModel(mc, rngs=nnx.Rngs(0))
    cfg = default_cache_config(mc, num_seqs=2, max_tokens=256, page_size=16, token_budget=64, host_pages=96)
    gen = Generator(model, cfg)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in LENS]
    return model, cfg, gen, prompts


@pytest.fixture(scope="module")
def reference(setup):
    model, cfg, _, prompts = setup
    return generate(model, prompts, max_new_tokens=MAX_NEW, cache_config=cfg, attention="sparse")


def test_continuous_batching_matches_generate(setup, reference):
    _, cfg, gen, prompts = setup
    news = [MAX_NEW, 5, 33, MAX_NEW, 17]          # different lengths: requests finish at different chunks
    eng = Engine(generator=gen)
    reqs = eng.run(prompts, [SamplingParams(max_new_tokens=n) for n in news])
    for r, ref, n in zip(reqs, reference, news):
        assert r.finish_reason == "length", r.error
        assert r.tokens == ref[:n]
    tl = eng.timeline
    # 5 requests, 2 slots: the first step fills both slots and the rest wait ...
    assert tl[0].prefills == 2 and tl[0].queued == 3
    # ... and later requests are prefilled in steps where another request keeps decoding
    assert any(r.index > 0 and r.prefills and r.live_slots > r.prefills for r in tl)
    assert max(r.running for r in tl) <= cfg.max_seqs
    assert not eng.has_unfinished() and eng.num_running == 0
    assert sorted(gen.cache.alloc.free_slots) == list(range(cfg.max_seqs))   # every slot released
    gen.prefixes.index.evict(10**9)        # stored prefixes (on by default) keep host pages until evicted
    assert gen.cache.alloc.num_free == cfg.host_pages
    tot = eng.stats_totals()
    assert tot["hits"] + tot["misses"] > 0 and tot["fetched"] == tot["misses"]


def test_stream_yields_every_token_in_order(setup, reference):
    _, _, gen, prompts = setup
    eng = Engine(generator=gen)
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts[:3]]
    got = {i: [] for i in ids}
    for rid, tok in eng.stream():
        got[rid].append(tok)
    for i, ref in zip(ids, reference):
        assert got[i] == ref[:12] == eng.get(i).tokens
    eng2 = Engine(generator=gen)
    a = eng2.add_request(prompts[0], SamplingParams(max_new_tokens=17))
    b = eng2.add_request(prompts[2], SamplingParams(max_new_tokens=9))
    assert list(eng2.stream_request(a)) == reference[0][:17]
    while eng2.has_unfinished():
        eng2.step()
    assert eng2.get(b).tokens == reference[2][:9]


def test_queue_waits_for_host_pages_and_bad_requests_fail_alone(setup, reference):
    _, cfg, gen, prompts = setup
    eng = Engine(generator=gen, prefix_cache=False)   # b would attach a's pages: no wait for host pages
    big = SamplingParams(max_new_tokens=80)       # 120 + 80 = 200 tokens = 13 pages x 4 (layer, group) = 52 pages
    a = eng.add_request(prompts[3], big)
    b = eng.add_request(prompts[3], big)          # 104 > 96 host pages: must wait although a slot is free
    bad_long = eng.add_request(list(range(1, 200)) + list(range(100)), SamplingParams(max_new_tokens=4))  # 299 > 256
    bad_empty = eng.add_request([], SamplingParams())
    bad_vocab = eng.add_request([5, 9999], SamplingParams())
    bad_param = eng.add_request(prompts[0], SamplingParams(temperature=-1.0))
    outs = eng.step()
    failed = {o.request_id: o for o in outs if o.finish_reason == "error"}
    assert set(failed) == {bad_long, bad_empty, bad_vocab, bad_param}
    assert "context limit" in failed[bad_long].error
    assert "empty" in failed[bad_empty].error and "9999" in failed[bad_vocab].error
    assert "temperature" in failed[bad_param].error
    assert eng.timeline[0].running == 1 and eng.timeline[0].queued == 1
    assert eng.get(b).status == "queued"
    while eng.has_unfinished():
        eng.step()
    assert eng.get(a).tokens == eng.get(b).tokens and len(eng.get(a).tokens) == 80
    assert eng.get(a).tokens[:MAX_NEW] == reference[3]
    assert eng.get(b).t_admitted >= eng.get(a).t_finished   # admitted only once a's host pages were freed
    # capping: prompt + max_new_tokens past the context limit generates up to the limit
    eng2 = Engine(generator=gen)
    r = eng2.get(eng2.add_request(list(range(250)), SamplingParams(max_new_tokens=100)))
    assert r.capped and r.max_new_tokens == cfg.max_context - 250


def test_per_request_sampling_and_stop_ids(setup, reference):
    _, _, gen, prompts = setup
    ref = reference[1]
    j = next(i for i in range(5, len(ref)) if ref[i] not in ref[:i])    # a token first produced at position j
    params = [   # 2 slots: the first two run together, then the last two
        SamplingParams(max_new_tokens=MAX_NEW, stop_ids=(ref[j],)),                 # stops at position j
        SamplingParams(max_new_tokens=MAX_NEW),                                     # greedy
        SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=7),            # sampled
        SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_k=1, seed=3),   # top_k 1 = greedy
    ]

    def run():
        eng = Engine(generator=gen, seed=11)
        return eng.run([prompts[1]] * 4, params)

    st, g, s, k1 = run()
    assert st.finish_reason == "stop" and st.tokens == ref[:j + 1]
    # the greedy request ran beside the one that stops at a token it also produces: it is not affected
    assert g.tokens == ref and g.finish_reason == "length"
    assert k1.tokens == ref
    assert s.tokens != ref and len(s.tokens) == MAX_NEW
    _, g2, s2, _ = run()
    assert s2.tokens == s.tokens and g2.tokens == g.tokens    # same engine seed and order: same tokens


def test_sampling_params_validation():
    sp = SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        sp.check(258)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0).check(258)
    with pytest.raises(ValueError, match="stop id"):
        SamplingParams(stop_ids=(300,)).check(258)
    SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=1, stop_ids=(257,)).check(258)


def test_sampled_tokens_depend_only_on_the_request_seed(setup):
    """A seeded request draws the same tokens alone or beside other requests (per-slot keys)."""
    _, _, gen, prompts = setup
    mine = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.95, seed=1234)
    other = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=99)
    alone = Engine(generator=gen, seed=0).run([prompts[2]], [mine])[0]
    # beside another request, in the second slot this time, and with another engine seed
    mixed = Engine(generator=gen, seed=5).run([prompts[4], prompts[2]], [other, mine])[1]
    assert alone.tokens == mixed.tokens and len(alone.tokens) == MAX_NEW
