"""Prefill memory is linear in the context at every dtype (issue 47): one decoder layer's prefill as the program
runs it (projections + RoPE in token chunks, the jnp path's blocked attention, output projection and MLP) at
Qwen2.5-Coder-0.5B's layer shape, compiled (not run) at two contexts: XLA's temporaries grow at most ~linearly.
Before the blocked attention this path materialised the whole float32 score matrix (56 GiB at 32K)."""
import dataclasses

import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from ulacache_jax.models import get_preset
from ulacache_jax.models.llama import DecoderLayer
from ulacache_jax.runtime.program import PREFILL_CHUNK, _token_chunks, prefill_attention


def qwen05_layer_config():
    """Qwen2.5-Coder-0.5B-Instruct's layer: hidden 896, 14 query / 2 KV heads of 64, MLP 4864, q/k/v biases."""
    return dataclasses.replace(get_preset("qwen2.5-72b"), hidden_size=896, num_heads=14, num_kv_heads=2,
                               head_dim=64, intermediate_size=4864, num_layers=1)


def temp_bytes(layer, T: int, dtype) -> int | None:
    graphdef, params = nnx.split(layer)

    def run(params, x):
        block = nnx.merge(graphdef, params)
        pos = jnp.arange(T, dtype=jnp.int32)[None]
        C = min(T, PREFILL_CHUNK)
        q, k, v = _token_chunks(block.qkv, C, x, pos)
        return _token_chunks(block.finish, C, x, prefill_attention(q, k, v, T, "xla"))

    x = jax.ShapeDtypeStruct((1, T, layer.input_layernorm.weight.shape[0]), dtype)
    mem = jax.jit(run).lower(params, x).compile().memory_analysis()
    return None if mem is None else mem.temp_size_in_bytes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefill_layer_temporaries_grow_linearly(dtype):
    c = qwen05_layer_config()
    layer = DecoderLayer(c, dtype, nnx.Rngs(0))
    small, big = temp_bytes(layer, 4096, dtype), temp_bytes(layer, 8192, dtype)
    if small is None:
        pytest.skip("this backend's compiled memory_analysis reports nothing")
    dense_scores = c.num_heads * 8192 * 8192 * 4                 # the score matrix the old path held at 8K
    assert big <= 2.5 * small, (small, big)
    assert big < dense_scores / 8, (big, dense_scores)
