"""Text at the library's edges and short answers: generate() and the Engine take text or chat prompts with a
tokenizer, stop at its end-of-turn ids by default and at stop strings; a request's last decode chunk runs only
the steps it needs (a power of two), with the same tokens; Engine.abort frees a request at once."""
import numpy as np
import pytest
import jax.numpy as jnp
from flax import nnx

from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generation import Generator, default_cache_config, generate
from ulacache_jax.models import ByteTokenizer, LlamaModel, get_preset

PROMPT = "The pages of a long context live in host memory"


@pytest.fixture(scope="module")
def setup():
    model = LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=128, page_size=16, token_budget=32)
    return model, cfg, Generator(model, cfg), ByteTokenizer()


def test_text_and_chat_prompts_give_the_text_of_the_id_path(setup):
    model, cfg, _, tok = setup
    chat = [{"role": "user", "content": "Where do the pages live?"}]
    texts = generate(model, [PROMPT, chat], max_new_tokens=20, tokenizer=tok, cache_config=cfg)
    ids = [tok.encode(PROMPT), tok.apply_chat_template(chat, add_generation_prompt=True)]
    # the default stop ids with a tokenizer are its end-of-text / end-of-turn ids
    ref = generate(model, ids, max_new_tokens=20, stop_ids=tok.eos_ids, cache_config=cfg)
    assert texts == [tok.decode(r) for r in ref]
    with pytest.raises(ValueError, match="needs a tokenizer"):
        generate(model, [PROMPT], max_new_tokens=2)
    with pytest.raises(ValueError, match="need a tokenizer"):
        generate(model, [[1, 2]], max_new_tokens=2, stop=["x"])


def test_stop_strings_cut_the_text_and_the_tokens(setup):
    model, cfg, gen, tok = setup
    free = Engine(generator=gen, tokenizer=tok).run([PROMPT], SamplingParams(max_new_tokens=30))[0]
    text = free.text
    assert text == tok.decode(free.tokens) and len(text) >= 12
    stop = text[8:11]
    cut = text[:text.index(stop)]
    r = Engine(generator=gen, tokenizer=tok).run([PROMPT], SamplingParams(max_new_tokens=30, stop=(stop,)))[0]
    assert r.finish_reason == "stop" and r.stop_reason == stop and r.text == cut
    assert r.tokens == free.tokens[:len(r.tokens)] and stop in tok.decode(r.tokens)
    assert stop not in tok.decode(r.tokens[:-1])                  # the fewest tokens that complete it
    assert generate(model, [PROMPT], max_new_tokens=30, tokenizer=tok, stop=[stop], cache_config=cfg,
                    attention="sparse") == [cut]


def test_last_chunk_runs_only_the_steps_left(setup):
    model, cfg, gen, _ = setup
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (30, 50)]
    full = Engine(generator=gen).run(prompts, SamplingParams(max_new_tokens=40))
    for n, steps in ((6, [8]), (21, [16, 4]), (40, [16, 16, 8])):
        eng = Engine(generator=gen)
        got = eng.run(prompts, SamplingParams(max_new_tokens=n))
        assert [r.tokens for r in got] == [r.tokens[:n] for r in full]
        assert [s.decode_steps for s in eng.timeline if s.decode_steps] == steps, n
    # one program per power of two the Engine ran (16, 8, 4), none per length; plus the plain page-long one the
    # Program builds at once (a jit wrapper, compiled only if called)
    assert gen.program._decode_for.cache_info().currsize <= 4
    with pytest.raises(ValueError, match="power of two"):
        gen.program.decode_steps(12)


def test_abort_frees_the_slot_at_once(setup):
    _, cfg, gen, _ = setup
    eng = Engine(generator=gen)
    a = eng.add_request([1] * 20, SamplingParams(max_new_tokens=100))
    b = eng.add_request([2] * 20, SamplingParams(max_new_tokens=100))
    c = eng.add_request([3] * 20, SamplingParams(max_new_tokens=5))      # queued: 2 slots
    eng.step()
    assert eng.num_running == 2 and eng.num_queued == 1
    eng.abort(a)
    eng.abort(c)
    assert eng.get(a).finish_reason == "stop" and eng.get(c).finish_reason == "stop" and eng.num_running == 1
    while eng.has_unfinished():
        eng.step()
    assert len(eng.get(b).tokens) == 100 and eng.get(c).tokens == []
    assert sorted(gen.cache.alloc.free_slots) == list(range(cfg.max_seqs))
