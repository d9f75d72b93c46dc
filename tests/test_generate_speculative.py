"""generate sizes the cache for its own options (issue 51): speculative decoding with the default cache (no
hand-built CacheConfig) runs, sparse and dense, and its greedy tokens equal plain greedy decoding (float32)."""
import numpy as np
import pytest
from flax import nnx

import ulacache_jax
from ulacache_jax.models import LlamaModel, get_preset


@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_generate_speculative_with_the_default_cache(attention):
    model = LlamaModel(get_preset("tiny"), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (70, 93)]
    # 17 tokens: the prefill's and one page of decode steps, one plain decode program (a shorter last chunk
    # compiles its own)
    kw = dict(max_new_tokens=17, attention=attention, token_budget=32, page_size=16)
    plain = ulacache_jax.generate(model, prompts, **kw)
    spec = ulacache_jax.generate(model, prompts, speculative=ulacache_jax.SpecConfig("ngram", num_tokens=4), **kw)
    assert spec == plain
