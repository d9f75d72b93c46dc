"""The int32 PB-LRU clock (issue 23, part 4): decode chunks wind it back (`cache_state.rebase_clock`) before it
wraps. A generator whose clock starts just below the rebase point (the rebase lands mid-decode) or just below
2**31 must produce the same tokens, put every page in the same frame, hold the same tags, and keep the same
recency order (stamps shifted by one constant) as a generator starting from 0, chunk by chunk."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ulacache_jax.cache.state import CLOCK_REBASE_AT, rebase_clock
from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generation import Generator, default_cache_config
from ulacache_jax.models import LlamaModel, get_preset


@pytest.fixture(scope="module")
def setup():
    model = LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (37, 70, 5)]
    # a small pool (evictions happen) and a budget below the context: the PB-LRU decisions matter
    cfg = default_cache_config(model.config, num_seqs=3, max_tokens=160, page_size=8, token_budget=32,
                               num_buckets=4, slots_per_bucket=6)
    return model, prompts, cfg


def _run_recording(model, cfg, prompts, start_clock: int):
    """Greedy run of 40 tokens; after every decode chunk: (frames, tag_hi, tag_lo, stamps, clock)."""
    gen = Generator(model, cfg)
    gen.cache.state = dataclasses.replace(gen.cache.state, clock=jnp.int32(start_clock))
    seen = []
    chunk = gen.decode_chunk_with        # the Engine's call for every decode chunk

    def recording(*args, **kw):
        out = chunk(*args, **kw)
        st = gen.cache.state
        seen.append((np.asarray(st.vtlb.frame), np.asarray(st.pb.tag_hi), np.asarray(st.pb.tag_lo),
                     np.asarray(st.pb.stamp), int(st.clock)))
        return out

    gen.decode_chunk_with = recording
    tokens = [r.tokens for r in Engine(generator=gen).run(prompts, SamplingParams(max_new_tokens=40))]
    return tokens, seen, gen


def test_rebase_is_a_no_op_below_the_threshold_and_winds_back_above(setup):
    model, _, cfg = setup
    st = Generator(model, cfg).cache.state
    low = dataclasses.replace(st, clock=jnp.int32(CLOCK_REBASE_AT - 1))
    assert int(rebase_clock(low).clock) == CLOCK_REBASE_AT - 1
    high = dataclasses.replace(st, clock=jnp.int32(2**31 - 1))
    assert 0 < int(rebase_clock(high).clock) < CLOCK_REBASE_AT


@pytest.fixture(scope="module")
def from_zero(setup):
    model, prompts, cfg = setup
    return _run_recording(model, cfg, prompts, 0)


@pytest.mark.parametrize("where", ["rebase-mid-decode", "near-2^31"])
def test_decode_across_the_clock_rebase_matches_from_zero(setup, from_zero, where):
    model, prompts, cfg = setup
    ta, sa, ga = from_zero
    # mid-decode: the clock reaches the rebase point after the second chunk, so the third one winds it back
    start = CLOCK_REBASE_AT - sa[1][-1] if where == "rebase-mid-decode" else 2**31 - 50
    tb, sb, gb = _run_recording(model, cfg, prompts, start)
    assert ta == tb
    assert len(sa) == len(sb) >= 4
    assert int(ga.stats.misses) > 0 and int(ga.stats.hits) == int(gb.stats.hits)
    rebased = False
    for i, ((fa, ha, la, pa, ca), (fb, hb, lb, pb, cb)) in enumerate(zip(sa, sb)):
        np.testing.assert_array_equal(fa, fb, err_msg=f"frames differ after chunk {i}")
        np.testing.assert_array_equal(ha, hb, err_msg=f"tag_hi differs after chunk {i}")
        np.testing.assert_array_equal(la, lb, err_msg=f"tag_lo differs after chunk {i}")
        filled = pa >= 0
        np.testing.assert_array_equal(filled, pb >= 0, err_msg=f"empty slots differ after chunk {i}")
        # the same recency order: every stamp moved by the same number of ticks as the clock
        assert set(np.unique(pb[filled] - pa[filled])) <= {cb - ca}, i
        assert 0 <= cb < 2**31 - 1
        rebased |= cb < start
    assert rebased                                  # the rebase did happen inside this decode
    assert 0 < sb[-1][-1] < CLOCK_REBASE_AT
    assert start + sa[-1][-1] > CLOCK_REBASE_AT     # unrebased, the clock would have ended past the threshold
    if where == "rebase-mid-decode":
        assert sb[1][-1] == CLOCK_REBASE_AT and sb[2][-1] < CLOCK_REBASE_AT
