"""The cache path: forward_with_cache / per-layer API with caller-owned attention functions must reproduce the
dense full forward (prefill, then token-by-token decode)."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ulacache_jax import models
from ulacache_jax.models import LlamaModel, dense_attention

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def _rel(a, b):
    # numpy, not jnp: XLA's CPU max reduction may drop NaN (it returned -inf here), which would hide a leak.
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    return float(np.abs(a - b).max() / np.abs(b).max())


def append_attn(cache, q, k, v, meta, layer_idx, *, sliding_window):
    """Plain dict cache {layer: (k [B, S, K, D], v [B, S, K, D])}: append the new tokens' k/v, attend over all.
    meta: positions [B, T] of the new tokens (the cache holds positions 0..S-1)."""
    if layer_idx in cache:
        k = jnp.concatenate([cache[layer_idx][0], k], axis=1)
        v = jnp.concatenate([cache[layer_idx][1], v], axis=1)
    b, s = k.shape[:2]
    k_positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    out = dense_attention(q, k, v, meta, k_positions, sliding_window=sliding_window)
    return {**cache, layer_idx: (k, v)}, out


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_mistral"])
def test_append_cache_prefill_then_decode_matches_full_forward(name):
    model = models.from_pretrained(FIXTURES / name, dtype=jnp.float32)
    # 14 of the 24 tokens: every decode step has new shapes (a compile each), so keep the step count small.
    input_ids = jnp.asarray(np.load(FIXTURES / name / "reference.npz")["input_ids"])[:, :14]  # [B, T]
    b, t = input_ids.shape
    full = model(input_ids)  # [B, T, V]
    attn = functools.partial(append_attn, sliding_window=model.config.sliding_window)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    # Eager, not jitted: the dict grows every step, so each step has new shapes either way.
    prefill = 9  # > mistral's window of 8, so decode steps drop keys from the window
    pre_ids, pre_pos = input_ids[:, :prefill], positions[:, :prefill]
    cache, logits = model.forward_with_cache({}, pre_ids, pre_pos, pre_pos, attn)  # meta = positions
    steps = [logits]
    for i in range(prefill, t):
        ids, pos = input_ids[:, i : i + 1], positions[:, i : i + 1]
        cache, logits = model.forward_with_cache(cache, ids, pos, pos, attn)
        steps.append(logits)
    assert set(cache) == set(range(model.config.num_layers))
    assert cache[0][0].shape == (b, t, model.config.num_kv_heads, model.config.head_dim)
    assert _rel(jnp.concatenate(steps, axis=1), full) <= 1e-5


def fixed_cache_attn(cache, q, k, v, meta, layer_idx, *, sliding_window):
    """Fixed-capacity cache {"k": [L x [B, S, K, D]], "v": ...}: one compile serves every decode step.
    meta: {"start": int32 scalar, write offset of the new tokens; "positions": [B, T]}."""
    start, t = meta["start"], q.shape[1]
    k_all = jax.lax.dynamic_update_slice(cache["k"][layer_idx], k, (0, start, 0, 0))  # [B, S, K, D]
    v_all = jax.lax.dynamic_update_slice(cache["v"][layer_idx], v, (0, start, 0, 0))
    b, s = k_all.shape[:2]
    slot = jnp.arange(s)
    k_positions = jnp.broadcast_to(slot, (b, s))
    k_valid = jnp.broadcast_to(slot < start + t, (b, s))
    out = dense_attention(
        q, k_all, v_all, meta["positions"], k_positions, sliding_window=sliding_window, k_valid=k_valid
    )
    cache = {
        "k": [k_all if i == layer_idx else x for i, x in enumerate(cache["k"])],
        "v": [v_all if i == layer_idx else x for i, x in enumerate(cache["v"])],
    }
    return cache, out


def test_jitted_fixed_cache_decode_compiles_once():
    config = models.get_preset("tiny")
    model = LlamaModel(config, dtype=jnp.float32, rngs=nnx.Rngs(7))
    b, t, capacity, prefill = 2, 12, 16, 5
    input_ids = jax.random.randint(jax.random.key(0), (b, t), 0, config.vocab_size)
    full = model(input_ids)
    attn = functools.partial(fixed_cache_attn, sliding_window=None)
    kv_shape = (b, capacity, config.num_kv_heads, config.head_dim)
    # NaN-filled empty slots also check that masked slots cannot leak into the output.
    cache = {
        "k": [jnp.full(kv_shape, jnp.nan) for _ in range(config.num_layers)],
        "v": [jnp.full(kv_shape, jnp.nan) for _ in range(config.num_layers)],
    }
    num_traces = 0

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(model, cache, ids, start):  # ids [B, T]
        nonlocal num_traces
        num_traces += 1
        positions = jnp.broadcast_to(start + jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        return model.forward_with_cache(cache, ids, positions, {"start": start, "positions": positions}, attn)

    cache, logits = step(model, cache, input_ids[:, :prefill], jnp.int32(0))
    steps = [logits]
    for i in range(prefill, t):
        cache, logits = step(model, cache, input_ids[:, i : i + 1], jnp.int32(i))
        steps.append(logits)
    assert num_traces == 2  # one prefill shape, one decode shape
    assert _rel(jnp.concatenate(steps, axis=1), full) <= 1e-5


def test_per_layer_api_matches_full_forward():
    """A generate loop driving the layers itself: embed -> (qkv, attention, finish) per layer -> logits."""
    model = models.from_pretrained(FIXTURES / "tiny_qwen2", dtype=jnp.float32)
    input_ids = jnp.asarray(np.load(FIXTURES / "tiny_qwen2" / "reference.npz")["input_ids"])
    b, t = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    x = model.embed(input_ids)  # [B, T, E]
    for layer in model.layers:
        q, k, v = layer.qkv(x, positions)
        assert q.shape == (b, t, model.config.num_heads, model.config.head_dim)
        assert k.shape == v.shape == (b, t, model.config.num_kv_heads, model.config.head_dim)
        x = layer.finish(x, dense_attention(q, k, v, positions, positions))
    np.testing.assert_allclose(model.logits(x), model(input_ids), rtol=0, atol=1e-6)
    # Logits of the last row only, as a prefill would ask for them.
    np.testing.assert_allclose(model.logits(x[:, -1:]), model(input_ids)[:, -1:], rtol=0, atol=1e-6)


def test_layer_signature_cache_x_meta():
    """Layers are (cache, x, meta) -> (cache, y); the attn_fn sees post-RoPE q/k/v in the model dtype."""
    model = LlamaModel(models.get_preset("tiny-gqa8"), dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    seen = []

    def attn(cache, q, k, v, meta, layer_idx):
        seen.append((layer_idx, q.shape, k.shape, q.dtype, k.dtype, v.dtype))
        return cache + 1, jnp.zeros_like(q)

    x = model.embed(jnp.zeros((1, 3), jnp.int32))
    positions = jnp.zeros((1, 3), jnp.int32)
    cache, y = model.layers[1](0, x, "meta", positions=positions, attn_fn=attn, layer_idx=1)
    assert cache == 1 and y.shape == x.shape and y.dtype == jnp.bfloat16
    assert seen == [(1, (1, 3, 8, 128), (1, 3, 1, 128), jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)]
