"""Chunked prefill and the decode cadence (issue 49 item 4): a prompt prefilled a chunk at a time across Engine
steps, decode chunks of the running requests between its chunks, gives the tokens a whole prefill gives (sparse
and dense, shared prefixes on and off); decode chunks shorter than a page give the tokens page-long chunks give
(greedy and seeded sampling) and deliver them that often; a half-prefilled request survives a checkpoint; bad
options are refused before anything changes.

Tiny float32 model, CPU, 2 slots, context 256, page 16, token budget 64 (4 pages: the prompts of 46-150 tokens
exercise sparse selection), chunks of 32 tokens (a 150-token prompt takes 5)."""
import dataclasses

import numpy as np
import pytest
from flax import nnx

from ulacache_jax.runtime import checkpoint
from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generation import Generator, default_cache_config
from ulacache_jax.models import LlamaModel, get_preset

P = 16
CHUNK = 32
# the prefill's token and two whole decode chunks of P steps: a run compiles the P-step decode program alone (a
# shorter last chunk compiles its own)
MAX_NEW = 33


@pytest.fixture(scope="module")
def model_cfg():
    mc = get_preset("tiny")
    model = LlamaModel(mc, rngs=nnx.Rngs(0))
    # Quest: chunking's mechanics; the labels' calibration window (a first chunk must hold it) is checked below
    cfg = default_cache_config(mc, num_seqs=2, max_tokens=256, page_size=P, token_budget=64, key_channels=0)
    return model, cfg


@pytest.fixture(scope="module")
def gens(model_cfg):
    model, cfg = model_cfg
    return {kind: Generator(model, cfg, attention=kind) for kind in ("sparse", "dense")}


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    doc = [int(t) for t in rng.integers(0, 256, 100)]
    short = [int(t) for t in rng.integers(0, 256, 46)]
    long_ = [int(t) for t in rng.integers(0, 256, 150)]
    # the third starts with the second's first 6 pages: with shared prefixes on it attaches them, then prefills
    # the rest in chunks that attend over attached pages and its own earlier chunk
    return [short, doc + [int(t) for t in rng.integers(0, 256, 50)], doc + [int(t) for t in rng.integers(0, 256, 70)],
            long_]


def _run(gen, prompts, params, **kw):
    eng = Engine(generator=gen, **kw)
    ids = [eng.add_request(p, s) for p, s in zip(prompts, params)]
    while eng.has_unfinished():
        eng.step()
    reqs = [eng.get(i) for i in ids]
    for r in reqs:
        assert r.finish_reason == "length", r.error
    return eng, reqs


def _seq(gen, field: str, slot: int) -> int:
    """A sparse cache's per-sequence counter (length, flushed) of `slot`, rank 0."""
    return int(np.asarray(getattr(gen.cache.state.seqs, field)).reshape(-1, gen.config.max_seqs)[0, slot])


@pytest.mark.parametrize("kind", ["sparse", "dense"])
@pytest.mark.parametrize("prefix", [False, True])
def test_chunked_prefill_gives_whole_prefill_tokens(gens, prompts, kind, prefix):
    gen = gens[kind]
    params = [SamplingParams(max_new_tokens=MAX_NEW)] * len(prompts)
    _, whole = _run(gen, prompts, params, prefix_cache=prefix)
    if prefix:
        gen.prefixes.index.clear()          # the chunked run must attach and prefill as the whole run did
    eng, chunked = _run(gen, prompts, params, prefix_cache=prefix, prefill_chunk_tokens=CHUNK)
    for w, c in zip(whole, chunked):
        assert c.tokens == w.tokens
    if prefix:
        assert eng.prefix_stats().hit_tokens >= 6 * P           # the third prompt attached the doc's pages
    assert sum(rec.prefills for rec in eng.timeline) == len(prompts)
    assert sum(rec.prefill_tokens for rec in eng.timeline) == sum(map(len, prompts))
    # while a request decoded, no step prefilled more than one chunk (counted with the attached pages when shared)
    assert prefix or all(rec.prefill_tokens <= CHUNK for rec in eng.timeline if rec.prefill_tokens and rec.live_slots
               and rec.prefills < rec.live_slots)
    assert eng.num_running == 0 and not eng.prefilling_ids


def test_long_prompt_interleaves_with_decode(gens, prompts):
    """A running request keeps getting a decode chunk every step while a long prompt is admitted in chunks."""
    gen = gens["sparse"]
    eng = Engine(generator=gen, prefix_cache=False, prefill_chunk_tokens=CHUNK, decode_chunk_steps=4)
    a = eng.add_request(prompts[0], SamplingParams(max_new_tokens=64))
    eng.step()                                                  # a prefilled, its first 4 decode steps
    b = eng.add_request(prompts[3], SamplingParams(max_new_tokens=8))
    got_a = len(eng.get(a).tokens)
    chunks = 0
    while not eng.get(b).tokens:
        outs = {o.request_id: o for o in eng.step()}
        rec = eng.timeline[-1]
        assert rec.prefill_tokens <= CHUNK and rec.decode_steps == 4
        assert len(outs[a].new_tokens) == 4                     # a's tokens arrive every step, 4 at a time
        if not eng.get(b).tokens:
            assert eng.prefilling_ids == [b]
        chunks += 1
    assert chunks == -(-len(prompts[3]) // CHUNK)
    assert len(eng.get(a).tokens) == got_a + 4 * chunks
    while eng.has_unfinished():
        eng.step()
    _, ref = _run(gen, [prompts[0], prompts[3]], [SamplingParams(max_new_tokens=64), SamplingParams(max_new_tokens=8)],
                  prefix_cache=False)
    assert eng.get(a).tokens == ref[0].tokens and eng.get(b).tokens == ref[1].tokens


@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_decode_cadence_keeps_tokens(gens, prompts, kind):
    """Chunks of 4 or 1 steps give the tokens chunks of a page give, greedy and seeded, and deliver them that
    often; a slot flushes only at its own flush points (every page_size steps from its prefill)."""
    gen = gens[kind]
    # lengths of 2 pages + 4 or 2 pages of decode steps: the page-long run's last chunks take 4 steps, the program
    # the cadence-4 run compiles anyway
    params = [SamplingParams(max_new_tokens=37), SamplingParams(max_new_tokens=37, temperature=0.9, seed=3),
              SamplingParams(max_new_tokens=33, temperature=1.2, top_k=30), SamplingParams(max_new_tokens=37)]
    _, ref = _run(gen, prompts, params, prefix_cache=False)
    for cadence in (4, 1) if kind == "sparse" else (4,):
        eng = Engine(generator=gen, prefix_cache=False, decode_chunk_steps=cadence)
        ids = [eng.add_request(p, s) for p, s in zip(prompts, params)]
        eng.step()
        if kind == "sparse":
            # the 46-token prompt's page 2 completed at its second decode step; its flush point is 16 steps on
            slot = eng.get(ids[0]).slot
            assert _seq(gen, "length", slot) == 46 + cadence
            assert _seq(gen, "flushed", slot) == 46 // P
        while eng.has_unfinished():
            for out in eng.step():          # a step's decode chunk, and the first token where it was prefilled
                assert len(out.new_tokens) <= cadence + (len(eng.get(out.request_id).tokens) == len(out.new_tokens))
        assert all(rec.decode_steps <= cadence for rec in eng.timeline)
        for i, r in zip(ids, ref):
            assert eng.get(i).tokens == r.tokens, (cadence, i)


def test_checkpoint_of_a_half_prefilled_request(gens, prompts, tmp_path):
    """Saved while its prompt is partly prefilled, a request is restored as queued at the head of the queue and
    prefilled again; with decode chunks of 4 the running one is saved between flush points (phase) and continues
    as the uninterrupted run (dense: exact)."""
    gen = gens["dense"]
    params = [SamplingParams(max_new_tokens=40, temperature=0.7, seed=11), SamplingParams(max_new_tokens=20),
              SamplingParams(max_new_tokens=10)]
    ps = [prompts[0], prompts[3], prompts[1]]
    kw = dict(prefix_cache=False, prefill_chunk_tokens=CHUNK, decode_chunk_steps=4)
    _, ref = _run(gen, ps, params, **kw)
    a = Engine(generator=gen, **kw)
    ids = [a.add_request(ps[0], params[0])]
    a.step()                                        # the first decodes: the next prompts are chunked
    ids += [a.add_request(p, s) for p, s in zip(ps[1:], params[1:])]
    a.step()
    assert a.prefilling_ids == [ids[1]] and a.get(ids[1]).status == "running" and not a.get(ids[1]).tokens
    assert a.queued_ids == [ids[2]] and a.slots.phase[a.get(ids[0]).slot] != 0
    a.save(tmp_path)
    saved = {r.request_id: r for r in checkpoint.read(tmp_path).requests}
    assert saved[ids[1]].status == "queued" and saved[ids[0]].phase == a.slots.phase[a.get(ids[0]).slot]
    for i in ids:
        a.abort(i)
    assert not a.prefilling_ids and a.num_running == 0
    b = Engine(generator=gen, **kw)
    ck = b.restore(tmp_path)
    assert ck.queue == [ids[1], ids[2]] and b.queued_ids == [ids[1], ids[2]]
    while b.has_unfinished():
        b.step()
    for i, r in zip(ids, ref):
        assert b.get(i).finish_reason == "length" and b.get(i).tokens == r.tokens


def test_abort_of_a_half_prefilled_request_frees_its_slot(gens, prompts):
    gen = gens["sparse"]
    eng = Engine(generator=gen, prefix_cache=False, prefill_chunk_tokens=CHUNK)
    a = eng.add_request(prompts[0], SamplingParams(max_new_tokens=40))
    eng.step()
    b = eng.add_request(prompts[3], SamplingParams(max_new_tokens=8))
    eng.step()
    assert eng.prefilling_ids == [b]
    eng.abort(b)
    assert not eng.prefilling_ids and eng.get(b).finish_reason == "stop"
    eng.abort(a)
    eng.step()
    assert sorted(gen.cache.alloc.free_slots) == [0, 1] and gen.cache.alloc.num_free == gen.config.host_pages


def test_bad_options_are_refused_before_anything_changes(gens, model_cfg):
    gen = gens["sparse"]
    had = gen.prefixes is not None
    for bad in (24, 48, 0, 8, True, 32.0):
        with pytest.raises(ValueError, match="prefill_chunk_tokens"):
            Engine(generator=gen, prefix_cache=not had, prefill_chunk_tokens=bad)
    for bad in (3, 32, 0, -4, True):
        with pytest.raises(ValueError, match="decode_chunk_steps"):
            Engine(generator=gen, prefix_cache=not had, decode_chunk_steps=bad)
    assert (gen.prefixes is not None) == had                   # the refused engines left the generator as it was
    model, cfg = model_cfg
    # online label channels come from a prompt's first min(1024, context) = 256 tokens: a first chunk holds them
    kc = Generator(model, dataclasses.replace(cfg, key_channels=8, label_bits=4), attention="sparse")
    with pytest.raises(ValueError, match="prefill_chunk_tokens = 32 is under the 256 tokens"):
        Engine(generator=kc, prefill_chunk_tokens=CHUNK)
    Engine(generator=kc, prefill_chunk_tokens=256)
    Engine(generator=kc, decode_chunk_steps=4)                  # the cadence is any rule's


def test_short_prompt_overtakes_a_long_one_being_prefilled(model_cfg, prompts):
    """A short prompt queued behind a long one being prefilled in chunks starts at the next step (the fewest
    tokens left go first) instead of after the long one's last chunk; the long one, passed over once, goes first
    in the next step, so it is delayed by one step, never starved; every request's tokens are unchanged."""
    model, cfg = model_cfg
    gen = Generator(model, dataclasses.replace(cfg, max_seqs=3, host_pages=cfg.host_pages * 3 // 2),
                    attention="sparse")
    eng = Engine(generator=gen, prefix_cache=False, prefill_chunk_tokens=CHUNK, decode_chunk_steps=4)
    short_c = prompts[0][:20]
    params = [SamplingParams(max_new_tokens=64), SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8)]
    a = eng.add_request(prompts[0], params[0])
    eng.step()                                                  # a decodes from here on: the per-step budget holds
    b = eng.add_request(prompts[3], params[1])
    eng.step()                                                  # b's first chunk
    assert eng.prefilling_ids == [b] and eng.timeline[-1].prefill_tokens == CHUNK
    c = eng.add_request(short_c, params[2])
    eng.step()                                                  # c (20 tokens) before b's 118 left
    assert eng.get(c).tokens and not eng.get(b).tokens and eng.prefilling_ids == [b]
    left = len(prompts[3]) - CHUNK
    eng.step()                                                  # b, passed over, goes first
    assert eng.timeline[-1].prefill_tokens == CHUNK and eng.prefilling_ids == [b]
    steps = 0
    while not eng.get(b).tokens:
        eng.step()
        steps += 1
    assert steps == -(-(left - CHUNK) // CHUNK)                 # one chunk a step from there on
    while eng.has_unfinished():
        eng.step()
    # the reference at the same cadence (its own program; chunks of 4 give page-long chunks' tokens:
    # test_decode_cadence_keeps_tokens), so the overtaking is all that differs
    _, ref = _run(gen, [prompts[0], prompts[3], short_c], params, prefix_cache=False, decode_chunk_steps=4)
    assert [eng.get(i).tokens for i in (a, b, c)] == [r.tokens for r in ref]
