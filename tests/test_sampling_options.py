"""Sampling options past temperature / top-p / top-k (sampling.py, the Engine): min-p, presence / frequency /
repetition penalties and raw logprobs, each against a numpy reference; neutral values leave greedy tokens as they
were; a request's tokens do not depend on its batch neighbours; bad values are refused naming the value; the
options the speculative engine cannot make exact are refused; a checkpoint restores them.

The Engine tests share one Generator (tiny preset, float32, 4 slots, context 128, page 16, the default token budget
covering the context: the decode attends every token, so the full forward without a cache is the reference)."""
import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generation import Generator, default_cache_config, generate
from ulacache_jax.runtime.requests import RequestError
from ulacache_jax.runtime.sampling import (MAX_LOGPROBS, PenaltyState, SamplingArrays, penalize, sample,
                                           token_logprobs, truncated_sorted)
from ulacache_jax.runtime.speculative.rules import SpecConfig
from ulacache_jax.models import LlamaModel, get_preset

NEW = 12


# ---- numpy references -------------------------------------------------------------------------------------------
def np_penalize(logits, counts, seen, rep, freq, pres):
    """One row: HF / vLLM repetition penalty over prompt + generated, then OpenAI frequency and presence."""
    x = logits.astype(np.float64).copy()
    hit = seen | (counts > 0)
    x[hit] = np.where(x[hit] > 0, x[hit] / rep, x[hit] * rep)
    return x - freq * counts - pres * (counts > 0)


def np_kept(logits, temperature, min_p, top_k, top_p):
    """One row: the token ids a sampled draw may return (temperature, min-p, top-k, then top-p renormalized)."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-x, kind="stable")
    keep = p[order] >= min_p * p.max()
    if top_k:
        keep[top_k:] = False
    q = np.where(keep, p[order], 0.0)
    q /= q.sum()
    before = np.cumsum(q) - q
    keep &= before < top_p
    return set(order[keep].tolist())


def np_log_softmax(x):
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def assert_same_logprobs(a, b):
    """Equal ids; values to float32 rounding (a prompt prefilled whole or after a shared prefix from the prefix
    cache differs in the last bits)."""
    assert [(t.token_id, [i for i, _ in t.top]) for t in a] == [(t.token_id, [i for i, _ in t.top]) for t in b]
    np.testing.assert_allclose([[t.logprob] + [v for _, v in t.top] for t in a],
                               [[t.logprob] + [v for _, v in t.top] for t in b], atol=1e-5)


# ---- the functions ------------------------------------------------------------------------------------------------
def test_penalize_matches_reference_per_row():
    rng = np.random.default_rng(0)
    S, V = 5, 64
    logits = rng.normal(0, 3, (S, V)).astype(np.float32)
    counts = rng.integers(0, 3, (S, V)) * (rng.random((S, V)) < 0.3)
    seen = rng.random((S, V)) < 0.2
    rep = np.array([1.0, 1.3, 0.7, 1.0, 2.0], np.float32)
    freq = np.array([0.0, 0.5, -0.4, 2.0, 0.0], np.float32)
    pres = np.array([0.0, -1.0, 0.3, 0.0, 1.5], np.float32)
    params = SamplingArrays.fill(S)
    params = dataclasses.replace(params, repetition=jnp.asarray(rep), frequency=jnp.asarray(freq),
                                 presence=jnp.asarray(pres))
    got = np.asarray(penalize(jnp.asarray(logits), PenaltyState(jnp.asarray(counts, jnp.int32), jnp.asarray(seen)),
                              params))
    for s in range(S):
        ref = np_penalize(logits[s], counts[s], seen[s], rep[s], freq[s], pres[s])
        np.testing.assert_allclose(got[s], ref, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[0], logits[0])          # a neutral row is unchanged bit for bit


def test_truncation_with_min_p_matches_reference():
    rng = np.random.default_rng(1)
    S, V = 6, 50
    logits = rng.normal(0, 2, (S, V)).astype(np.float32)
    temperature = np.array([1.0, 0.7, 1.5, 1.0, 1.0, 2.0], np.float32)
    min_p = np.array([0.0, 0.1, 0.3, 0.05, 1.0, 0.2], np.float32)
    top_k = np.array([0, 0, 10, 0, 0, 5], np.int32)
    top_p = np.array([1.0, 1.0, 0.9, 0.5, 1.0, 1.0], np.float32)
    params = dataclasses.replace(SamplingArrays.fill(S), temperature=jnp.asarray(temperature),
                                 min_p=jnp.asarray(min_p), top_k=jnp.asarray(top_k), top_p=jnp.asarray(top_p))
    order, srt = (np.asarray(a) for a in truncated_sorted(jnp.asarray(logits), params))
    for s in range(S):
        got = set(order[s][np.isfinite(srt[s])].tolist())
        assert got == np_kept(logits[s], temperature[s], min_p[s], top_k[s], top_p[s]), s
    # min_p = 1 keeps the argmax alone: sampling at temperature 1 is greedy
    keys = jax.vmap(jax.random.key)(jnp.arange(S, dtype=jnp.uint32))
    drawn = np.asarray(sample(jnp.asarray(logits), keys, params))
    assert drawn[4] == logits[4].argmax()


def test_token_logprobs_are_the_raw_log_softmax():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2, (3, 40)).astype(np.float32)
    toks = np.array([3, 17, 39], np.int32)
    lp, ids, top = (np.asarray(a) for a in token_logprobs(jnp.asarray(logits), jnp.asarray(toks), 5))
    for s in range(3):
        ref = np_log_softmax(logits[s])
        np.testing.assert_allclose(lp[s], ref[toks[s]], atol=1e-5)
        np.testing.assert_array_equal(ids[s], np.argsort(-ref, kind="stable")[:5])
        np.testing.assert_allclose(top[s], ref[ids[s]], atol=1e-5)


@pytest.mark.parametrize("field,value,needle", [
    ("min_p", 1.5, "min_p = 1.5"), ("min_p", -0.1, "min_p = -0.1"), ("min_p", float("nan"), "min_p = nan"),
    ("presence_penalty", 2.5, "presence_penalty = 2.5"), ("frequency_penalty", -3.0, "frequency_penalty = -3.0"),
    ("repetition_penalty", 0.0, "repetition_penalty = 0.0"), ("repetition_penalty", "1", "repetition_penalty = '1'"),
    ("logprobs", MAX_LOGPROBS + 1, f"logprobs = {MAX_LOGPROBS + 1}"), ("logprobs", -1, "logprobs = -1"),
    ("logprobs", True, "logprobs = True"), ("token_budget", 0, "token_budget = 0"),
    ("attention", "full", "attention = 'full'")])
def test_bad_values_are_refused_naming_them(field, value, needle):
    with pytest.raises(RequestError, match=needle.replace("[", r"\[").replace("+", r"\+")):
        SamplingParams(**{field: value}).check(258)


# ---- through the Engine -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup():
    mc = get_preset("tiny")
    model = LlamaModel(mc, dtype=jnp.float32, rngs=nnx.Rngs(0))
    cfg = default_cache_config(mc, num_seqs=4, max_tokens=128, page_size=16, verify_rows=3)
    gen = Generator(model, cfg, attention="sparse")
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 40, n))) for n in (37, 20, 50)]   # few ids: repeats to penalize
    return model, gen, prompts


def full_logits(model, ids):
    """Logits [len(ids), V] of the cacheless full forward (padded to a power of two: causal, padding cannot leak)."""
    T = 1 << (len(ids) - 1).bit_length()
    return np.asarray(jax.jit(model.__call__)(jnp.asarray([list(ids) + [0] * (T - len(ids))]))[0, :len(ids)])


PENALIZED = SamplingParams(max_new_tokens=NEW, repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.5)
MINP = SamplingParams(max_new_tokens=NEW, temperature=1.0, min_p=0.4, seed=11)
LOGPROBS = SamplingParams(max_new_tokens=NEW, logprobs=3)


@pytest.fixture(scope="module")
def mixed(setup):
    """Three requests with different options decoding together, and a greedy one beside them."""
    _, gen, prompts = setup
    eng = Engine(generator=gen)
    ids = [eng.add_request(p, s) for p, s in zip(prompts + [prompts[0]], [PENALIZED, MINP, LOGPROBS,
                                                                          SamplingParams(max_new_tokens=NEW)])]
    outs = {}
    while eng.has_unfinished():
        for ev in eng.step():
            outs.setdefault(ev.request_id, []).append(ev)
    return [eng.get(i) for i in ids], [outs[i] for i in ids]


def test_penalized_greedy_matches_reference(setup, mixed):
    model, _, prompts = setup
    req = mixed[0][0]
    assert req.finish_reason == "length" and len(req.tokens) == NEW
    ids, seen = list(prompts[0]), np.zeros(model.config.vocab_size, bool)
    seen[prompts[0]] = True
    counts = np.zeros(model.config.vocab_size, np.int64)
    logits = full_logits(model, prompts[0] + req.tokens[:-1])
    changed = 0
    for j, t in enumerate(req.tokens):
        x = np_penalize(logits[len(ids) - 1], counts, seen, 1.4, 0.5, 0.6)
        top2 = np.sort(x)[-2:]
        if top2[1] - top2[0] > 1e-4:                 # a near tie may flip on float rounding: skip it
            assert t == int(x.argmax()), j
        changed += int(x.argmax()) != int(logits[len(ids) - 1].argmax())
        counts[t] += 1
        ids.append(t)
    assert changed > 0                               # the penalties did change some greedy choice


def test_min_p_draws_stay_in_the_kept_set(setup, mixed):
    model, _, prompts = setup
    req = mixed[0][1]
    assert len(req.tokens) == NEW
    logits = full_logits(model, prompts[1] + req.tokens[:-1])
    n = len(prompts[1])
    for j, t in enumerate(req.tokens):
        p = np.exp(np_log_softmax(logits[n - 1 + j]))
        assert p[t] >= 0.4 * p.max() * (1 - 1e-4), j


def test_logprobs_are_the_model_logprobs_and_stream_aligned(setup, mixed):
    model, _, prompts = setup
    (req, evs) = mixed[0][2], mixed[1][2]
    assert len(req.logprobs) == len(req.tokens) == NEW
    logits = full_logits(model, prompts[2] + req.tokens[:-1])
    n = len(prompts[2])
    for j, (t, lp) in enumerate(zip(req.tokens, req.logprobs)):
        ref = np_log_softmax(logits[n - 1 + j])
        assert lp.token_id == t and len(lp.top) == 3
        np.testing.assert_allclose(lp.logprob, ref[t], atol=2e-4)
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(ref)[::-1][:3], atol=2e-4)
        assert lp.top[0][0] == t                     # greedy: the sampled token is the best one
    streamed = [lp for ev in evs for lp in ev.new_logprobs]
    assert [lp.token_id for lp in streamed] == [t for ev in evs for t in ev.new_tokens] == req.tokens
    assert all(not r.logprobs for r in (mixed[0][0], mixed[0][1], mixed[0][3]))   # only where asked for


def test_a_request_does_not_depend_on_its_neighbours(setup, mixed):
    _, gen, prompts = setup
    together = mixed[0]
    for p, sp, got in zip(prompts + [prompts[0]], [PENALIZED, MINP, LOGPROBS, SamplingParams(max_new_tokens=NEW)],
                          together):
        alone = Engine(generator=gen).run([p], sp)[0]
        assert alone.tokens == got.tokens
        assert_same_logprobs(alone.logprobs, got.logprobs)


def test_neutral_options_leave_greedy_unchanged(setup, mixed):
    model, gen, prompts = setup
    plain = generate(model, [prompts[0]], max_new_tokens=NEW, cache_config=gen.config, attention="sparse")[0]
    assert mixed[0][3].tokens == plain            # decoded in the penalty + logprobs program beside the others
    neutral = dataclasses.replace(SamplingParams(max_new_tokens=NEW), min_p=0.0, presence_penalty=0.0,
                                  frequency_penalty=0.0, repetition_penalty=1.0, logprobs=0)
    r = Engine(generator=gen).run([prompts[0]], neutral)[0]
    assert r.tokens == plain and all(lp.top == () for lp in r.logprobs)


def test_generate_takes_the_options(setup, mixed):
    model, gen, prompts = setup
    out = generate(model, [prompts[0]], max_new_tokens=NEW, cache_config=gen.config, attention="sparse",
                   repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.5)
    assert out[0] == mixed[0][0].tokens
    (toks, lps), = generate(model, [prompts[2]], max_new_tokens=NEW, cache_config=gen.config, attention="sparse",
                            logprobs=3)
    assert toks == mixed[0][2].tokens
    assert_same_logprobs(lps, mixed[0][2].logprobs)
    with pytest.raises(ValueError, match="min_p = 2"):
        generate(model, [prompts[0]], max_new_tokens=2, min_p=2)


def test_speculative_refuses_what_it_cannot_make_exact(setup):
    _, gen, prompts = setup
    eng = Engine(generator=gen, speculative=SpecConfig("ngram", 2))
    bad = [eng.add_request(prompts[0], PENALIZED), eng.add_request(prompts[0], LOGPROBS)]
    ok = eng.add_request(prompts[0], MINP)             # min-p is part of the distribution the drafts are tested on
    assert "repetition_penalty are not supported with speculative decoding" in eng.get(bad[0]).error
    assert "logprobs = 3 is not supported with speculative decoding" in eng.get(bad[1]).error
    assert eng.get(ok).status == "queued" and eng.get(ok).error is None
    eng.abort(ok)
    assert {ev.request_id for ev in eng.step()} == set(bad) | {ok}


def test_checkpoint_restores_penalties_and_logprobs(setup, tmp_path):
    _, gen, prompts = setup
    # 33 tokens: the first and two whole chunks of 16 (a shorter last chunk would compile a program of its own)
    params = [dataclasses.replace(PENALIZED, max_new_tokens=33), dataclasses.replace(LOGPROBS, max_new_tokens=33)]
    ps = [prompts[0], prompts[2]]
    ref = Engine(generator=gen).run(ps, params)
    a = Engine(generator=gen)
    ids = [a.add_request(p, s) for p, s in zip(ps, params)]
    a.step()                                         # the first token and one chunk of 16: 16 tokens to go
    assert all(len(a.get(i).tokens) == 17 for i in ids)
    a.save(tmp_path)
    for i in ids:
        a.abort(i)
    b = Engine(generator=gen)
    b.restore(tmp_path)
    assert_same_logprobs(b.get(ids[1]).logprobs, ref[1].logprobs[:17])
    while b.has_unfinished():
        b.step()
    assert b.get(ids[0]).tokens == ref[0].tokens
    assert b.get(ids[1]).tokens == ref[1].tokens
    assert_same_logprobs(b.get(ids[1]).logprobs, ref[1].logprobs)


def test_jsonl_lines_take_the_options():
    from ulacache_jax.app import batch_lines, cli, resume
    from ulacache_jax.models import ByteTokenizer
    import json
    good = {"id": 1, "prompt": "hello", "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.2, "logprobs": 2, "token_budget": 32, "attention": "sparse"}
    lines = [json.dumps(good), json.dumps({"id": 2, "prompt": "x", "min_p": 3}),
             json.dumps({"id": 3, "prompt": "x", "logprobs": 99}),
             json.dumps({"id": 4, "prompt": "x", "attention": "everything"})]
    recs, errs, _, _ = batch_lines.parse_input(lines, tokenizer=ByteTokenizer(), vocab_size=258, limit=64,
                                       defaults=SamplingParams(max_new_tokens=4))
    sp = recs[0].sampling
    assert (sp.min_p, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.logprobs,
            sp.token_budget, sp.attention) == (0.1, 0.5, -0.5, 1.2, 2, 32, "sparse")
    msgs = {e.line: e.error for e in errs}
    # the line parser is the server's (app/openai_protocol.py): the field quoted, its value and its range
    assert "'min_p' = 3 must be a number >= 0.0 and <= 1.0" in msgs[2]
    assert "'logprobs' = 99 must be an integer in [0, 20]" in msgs[3]
    assert "'attention' = 'everything' must be \"sparse\", \"dense\" or null" in msgs[4]
    args = cli.build_parser().parse_args(["generate", "--input", "i", "--output", "o", "--min-p", "0.2",
                                          "--repetition-penalty", "1.1", "--logprobs", "1"])
    assert (args.min_p, args.repetition_penalty, args.logprobs) == (0.2, 1.1, 1)
    assert resume.run_settings(args)["min_p"] == 0.2
