"""Flax NNX decoder for the Llama family (Llama 2/3/3.1, Qwen2, Mistral).

Weights keep Hugging Face's [out, in] layout with the head axis split out (q_proj [H, D, E], o_proj [E, H, D]),
so loading a checkpoint is a reshape (a view) plus a dtype cast, never a transpose copy, and tensor-parallel
sharding can split the H / K / F axes directly.

Attention is pluggable. Each decoder layer computes post-RoPE q, k, v and hands them to an attention function
(`attention.AttnFn`): `cache, out = attn_fn(cache, q, k, v, meta, layer_idx)`. The full forward
(`model(input_ids)`) uses dense causal attention with no cache; `forward_with_cache` threads a caller-owned
cache through the layers, each of the form `(cache, x, meta) -> (cache, y)`. Everything here is traceable
under `jax.jit` (the layer loop is a Python loop, unrolled at trace time; modules are pytrees in flax >= 0.12).
Einsum axis letters: see attention.py.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import AttnFn, Cache, dense_attention
from .config import ModelConfig, rope_inv_freq


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
    # Variance-preserving normal init; only random presets (tests, demos) ever see it, real weights are loaded.
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5).astype(dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))  # [E]
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # x [..., E] -> [..., E] in x's dtype
        # Like transformers: normalize in float32, cast back, then scale (the order matters in bf16).
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


def apply_rope(
    x: jax.Array,  # [B, T, N, D]
    positions: jax.Array,  # [B, T] int
    inv_freq: jax.Array,  # [D // 2] float32
) -> jax.Array:  # [B, T, N, D] in x's dtype
    """Rotate-half RoPE (the layout of HF Llama checkpoints: pairs are (i, i + D/2)), angles in float32."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, D/2]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, N, D/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """GQA projections + RoPE; the attention itself is the caller's attn_fn."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        e, h, k, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nnx.Param(_init(rngs, (h, d, e), e, dtype))  # [H, D, E]
        self.k_proj = nnx.Param(_init(rngs, (k, d, e), e, dtype))  # [K, D, E]
        self.v_proj = nnx.Param(_init(rngs, (k, d, e), e, dtype))  # [K, D, E]
        self.o_proj = nnx.Param(_init(rngs, (e, h, d), h * d, dtype))  # [E, H, D]
        if config.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((h, d), dtype))  # [H, D]
            self.k_bias = nnx.Param(jnp.zeros((k, d), dtype))  # [K, D]
            self.v_bias = nnx.Param(jnp.zeros((k, d), dtype))  # [K, D]
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.o_bias = nnx.Param(jnp.zeros((e,), dtype)) if config.attention_out_bias else None  # [E]
        # Static (part of the graph, not the state): a tuple of Python floats becomes a constant under jit.
        self.inv_freq = rope_inv_freq(config)  # [D // 2]

    def qkv(
        self, x: jax.Array, positions: jax.Array  # x [B, T, E] (normed), positions [B, T]
    ) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [B, T, H, D], k/v [B, T, K, D], post-RoPE
        q = jnp.einsum("BTE,HDE->BTHD", x, self.q_proj[...])
        k = jnp.einsum("BTE,KDE->BTKD", x, self.k_proj[...])
        v = jnp.einsum("BTE,KDE->BTKD", x, self.v_proj[...])
        if self.q_bias is not None:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def out(self, attn_out: jax.Array) -> jax.Array:  # [B, T, H, D] -> [B, T, E]
        y = jnp.einsum("BTHD,EHD->BTE", attn_out.astype(self.o_proj.dtype), self.o_proj[...])
        return y if self.o_bias is None else y + self.o_bias[...]


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Gate and up are one param [2, F, E] (checkpoints' gate_proj and up_proj
    stacked by the loaders), read by one matmul: at decode's few rows the projections are weight reads, and XLA's
    one fused gemm over both reads them faster than two (scripts/probes/proj_layout.py, docs/BENCHMARKS.md)."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        e, f = config.hidden_size, config.intermediate_size
        gate, up = _init(rngs, (f, e), e, dtype), _init(rngs, (f, e), e, dtype)  # [F, E] each
        self.gate_up_proj = nnx.Param(jnp.stack([gate, up]))  # [2, F, E]: gate, up
        self.down_proj = nnx.Param(_init(rngs, (e, f), f, dtype))  # [E, F]

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, E] -> [B, T, E]
        gu = jnp.einsum("BTE,CFE->BTCF", x, self.gate_up_proj[...])  # [B, T, 2, F]
        return jnp.einsum("BTF,EF->BTE", jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1], self.down_proj[...])


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, rngs)

    def qkv(
        self, x: jax.Array, positions: jax.Array  # x [B, T, E] residual stream, positions [B, T]
    ) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [B, T, H, D], k/v [B, T, K, D], post-RoPE
        """First half of the layer: pre-attention norm, projections, RoPE."""
        return self.self_attn.qkv(self.input_layernorm(x), positions)

    def finish(self, x: jax.Array, attn_out: jax.Array) -> jax.Array:
        """Second half: x [B, T, E] (the layer's input), attn_out [B, T, H, D] -> layer output [B, T, E]."""
        h = x + self.self_attn.out(attn_out)
        return h + self.mlp(self.post_attention_layernorm(h))

    def __call__(
        self,
        cache: Cache,
        x: jax.Array,  # [B, T, E]
        meta: Any,
        *,
        positions: jax.Array,  # [B, T] int
        attn_fn: AttnFn,
        layer_idx: int,
    ) -> tuple[Cache, jax.Array]:  # (cache, [B, T, E])
        q, k, v = self.qkv(x, positions)
        cache, attn_out = attn_fn(cache, q, k, v, meta, layer_idx)
        return cache, self.finish(x, attn_out)


class LlamaModel(nnx.Module):
    """Decoder-only LM. `model(input_ids)` -> logits [B, T, V] (float32) with dense causal attention."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.config = config
        e, v = config.hidden_size, config.vocab_size
        # Unit-variance embeddings, as the first RMSNorm rescales anyway.
        self.embed_tokens = nnx.Param(_init(rngs, (v, e), 1, dtype))  # [V, E]
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(e, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else nnx.Param(_init(rngs, (v, e), e, dtype))  # [V, E]

    @property
    def dtype(self):
        return self.embed_tokens.dtype

    def embed(self, input_ids: jax.Array) -> jax.Array:  # [B, T] int -> [B, T, E] model dtype
        return jnp.take(self.embed_tokens[...], input_ids, axis=0)

    def logits(self, h: jax.Array) -> jax.Array:
        """Final norm + LM head: h [B, T, E] (last layer's output) -> logits [B, T, V] float32.

        Call it on the rows you need only (e.g. h[:, -1:]): at a 128K vocab the full [B, T, V] float32
        tensor of a long prefill is far larger than the model's activations."""
        w = self.embed_tokens if self.lm_head is None else self.lm_head  # [V, E]
        return jnp.einsum("BTE,VE->BTV", self.norm(h), w[...], preferred_element_type=jnp.float32)

    def run_layers(
        self,
        cache: Cache,
        x: jax.Array,  # [B, T, E] embedded tokens
        positions: jax.Array,  # [B, T] int
        meta: Any,
        attn_fn: AttnFn,
    ) -> tuple[Cache, jax.Array]:  # (cache, h [B, T, E] before the final norm)
        for i, layer in enumerate(self.layers):
            cache, x = layer(cache, x, meta, positions=positions, attn_fn=attn_fn, layer_idx=i)
        return cache, x

    def forward_with_cache(
        self,
        cache: Cache,
        input_ids: jax.Array,  # [B, T] int
        positions: jax.Array,  # [B, T] int, absolute positions of these tokens (RoPE)
        meta: Any,
        attn_fn: AttnFn,
    ) -> tuple[Cache, jax.Array]:  # (cache, logits [B, T, V] float32)
        cache, h = self.run_layers(cache, self.embed(input_ids), positions, meta, attn_fn)
        return cache, self.logits(h)

    def __call__(
        self,
        input_ids: jax.Array,  # [B, T] int
        positions: jax.Array | None = None,  # [B, T] int; default 0..T-1 in every row
    ) -> jax.Array:  # logits [B, T, V] float32
        """Full forward, no cache. The mask is by position (key pos <= query pos, within the sliding window),
        so custom positions also define which tokens see which."""
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        attn = functools.partial(_dense_attn_fn, sliding_window=self.config.sliding_window)
        _, logits = self.forward_with_cache(None, input_ids, positions, positions, attn)
        return logits


def _dense_attn_fn(cache, q, k, v, positions, layer_idx, *, sliding_window):
    """attn_fn for the cacheless full forward: q [B, T, H, D], k/v [B, T, K, D]; meta is the positions [B, T]
    of the tokens themselves, which are both the queries and the keys."""
    del layer_idx
    return cache, dense_attention(q, k, v, positions, positions, sliding_window=sliding_window)
