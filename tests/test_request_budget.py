"""Per-request token_budget and attention (SamplingParams; the Engine's per-slot budgets, quest.limit_pages): one
compiled program serves mixed budgets, a budget under the engine's cap selects exactly what an engine built with
that budget selects, a budget covering the context gives the dense tokens, and bad budgets are refused naming the
numbers.

Tiny preset, float32, page 16, context 256, cap 128 tokens (8 pages: sink 1 + recent 2 + 5 by score); prompts of
90-150 tokens go through selection at a budget of 64 (4 pages)."""
import re

import numpy as np
import pytest
import jax.numpy as jnp
from flax import nnx

from ulacache_jax.cache.select.quest import limit_pages, select_pages
from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generation import Generator, default_cache_config, generate
from ulacache_jax.runtime.speculative.rules import SpecConfig
from ulacache_jax.models import LlamaModel, get_preset

# the prefill's token and one whole decode chunk of page_size (16) steps: one decode program per engine (a
# shorter last chunk compiles its own)
NEW = 17


def test_limit_pages_equals_selecting_with_the_smaller_budget():
    rng = np.random.default_rng(0)
    B, G, P = 6, 2, 40
    scores = rng.normal(size=(B, G, P)).astype(np.float32)
    scores[0, 0, 5:9] = 1.25                               # ties: the lower page id first, as the top-k
    flushed = np.array([40, 33, 7, 12, 0, 25], np.int32)
    budget = np.array([4, 3, 12, 5, 8, 12], np.int32)
    K = 12
    sel = select_pages(jnp.asarray(scores), jnp.asarray(flushed), select_pages=K, sink_pages=1, recent_pages=2)
    got = np.asarray(limit_pages(sel, jnp.asarray(scores), jnp.asarray(flushed), jnp.asarray(budget),
                                 sink_pages=1, recent_pages=2))
    for b in range(B):
        ref = np.asarray(select_pages(jnp.asarray(scores[b:b + 1]), jnp.asarray(flushed[b:b + 1]),
                                      select_pages=int(budget[b]), sink_pages=1, recent_pages=2))[0]
        for g in range(G):
            assert sorted(p for p in got[b, g] if p >= 0) == sorted(p for p in ref[g] if p >= 0), (b, g)


@pytest.fixture(scope="module")
def setup():
    mc = get_preset("tiny")
    model = LlamaModel(mc, dtype=jnp.float32, rngs=nnx.Rngs(0))
    cfg = default_cache_config(mc, num_seqs=3, max_tokens=256, page_size=16, token_budget=128, verify_rows=3)
    gen = Generator(model, cfg, attention="sparse")
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (150, 90, 40)]
    return model, cfg, gen, prompts


def test_mixed_budgets_in_one_batch(setup):
    model, cfg, gen, prompts = setup
    params = [SamplingParams(max_new_tokens=NEW, token_budget=64), SamplingParams(max_new_tokens=NEW),
              SamplingParams(max_new_tokens=NEW, attention="dense")]
    together = Engine(generator=gen).run(prompts, params)
    assert all(r.finish_reason == "length" for r in together), [r.error for r in together]
    # each as it decodes alone
    for p, sp, r in zip(prompts, params, together):
        assert Engine(generator=gen).run([p], sp)[0].tokens == r.tokens
    # a budget of 64 under the cap of 128 selects what an engine built with a budget of 64 selects
    small = default_cache_config(model.config, num_seqs=1, max_tokens=256, page_size=16, token_budget=64)
    ref = generate(model, [prompts[0]], max_new_tokens=NEW, cache_config=small, attention="sparse")[0]
    assert together[0].tokens == ref
    # and it changes what the request attends: the engine's own budget gives other tokens
    assert Engine(generator=gen).run([prompts[0]], SamplingParams(max_new_tokens=NEW))[0].tokens != ref


def test_a_budget_covering_the_context_gives_the_dense_tokens(setup):
    model, cfg, gen, prompts = setup
    p = prompts[2]                                          # 40 + 17 = 57 tokens: a budget of 64 covers it
    covered = Engine(generator=gen).run([p, p], [SamplingParams(max_new_tokens=NEW, token_budget=64),
                                               SamplingParams(max_new_tokens=NEW, attention="dense")])
    assert covered[0].tokens == covered[1].tokens
    assert covered[1].tokens == generate(model, [p], max_new_tokens=NEW, attention="dense")[0]


def test_bad_budgets_are_refused_naming_the_numbers(setup):
    model, cfg, gen, prompts = setup
    eng = Engine(generator=gen)
    cases = {SamplingParams(token_budget=256): "token_budget = 256 exceeds the engine's token_budget 128",
             SamplingParams(token_budget=40): "token_budget = 40 must be a multiple of page_size = 16",
             SamplingParams(token_budget=32): ">= 48",
             SamplingParams(max_new_tokens=NEW, attention="dense"):
                 r"token_budget \(128\) >= the request's context \(167 tokens",
             SamplingParams(token_budget=64, attention="dense"): "give no token_budget"}
    for sp, msg in cases.items():
        r = eng.get(eng.add_request(prompts[0], sp))
        assert r.finish_reason == "error", sp
        assert re.search(msg, r.error), r.error
    spec = Engine(generator=gen, speculative=SpecConfig("ngram", 2))
    r = spec.get(spec.add_request(prompts[1], SamplingParams(token_budget=64)))
    assert "not supported with speculative decoding" in r.error
    ok = spec.add_request(prompts[1], SamplingParams(token_budget=128, attention="sparse"))   # the cap: neutral
    assert spec.get(ok).status == "queued"
    spec.abort(ok)
    spec.step()
    eng.step()
    dense = Engine(generator=Generator(model, cfg, attention="dense"))
    r = dense.get(dense.add_request(prompts[1], SamplingParams(token_budget=64)))
    assert "token_budget = 64 needs a sparse engine: this engine attends every token" in r.error
    assert dense.get(dense.add_request(prompts[1], SamplingParams(attention="dense"))).status == "queued"
