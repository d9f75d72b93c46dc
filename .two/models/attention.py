"""Dense causal attention (the reference and the full-forward path) and the attention-function contract.

Axis alphabet for einsum strings in models/: B batch, T query tokens, S key tokens, E hidden (embed), H query
heads, K kv heads, G queries per kv head (H = K * G), D head dim, F MLP hidden, V vocab.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp

Cache = TypeVar("Cache")

# attn_fn(cache, q, k, v, meta, layer_idx) -> (cache, out)
#   q   [B, T, H, D]  post-RoPE queries, model dtype
#   k,v [B, T, K, D]  post-RoPE keys / values of the T new tokens, model dtype
#   meta              whatever the caller passed to forward_with_cache (page tables, lengths, ...)
#   layer_idx         Python int, the decoder layer index (static under jit)
#   out [B, T, H, D]  attention output, any float dtype (the model casts it to its dtype)
# The function owns the cache: it stores k/v and attends over whatever history it keeps.
AttnFn = Callable[[Cache, jax.Array, jax.Array, jax.Array, Any, int], tuple[Cache, jax.Array]]


def dense_attention(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [B, S, K, D]
    v: jax.Array,  # [B, S, K, D]
    q_positions: jax.Array,  # [B, T] int
    k_positions: jax.Array,  # [B, S] int
    *,
    sliding_window: int | None = None,
    k_valid: jax.Array | None = None,  # [B, S] bool, False for empty cache slots
) -> jax.Array:  # [B, T, H, D] in q's dtype
    """Grouped-query attention with a position-based causal mask: query t sees key s iff
    k_pos[s] <= q_pos[t] (and q_pos[t] - k_pos[s] < sliding_window). Scores and softmax in float32."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)  # [B, T, K, G, D]
    scores = jnp.einsum("BTKGD,BSKD->BKGTS", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
    mask = k_positions[:, None, :] <= q_positions[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        mask &= q_positions[:, :, None] - k_positions[:, None, :] < sliding_window
    if k_valid is not None:
        mask &= k_valid[:, None, :]
        # Empty cache slots may hold garbage (NaN in freed pages); a zero probability times NaN is still NaN.
        v = jnp.where(k_valid[:, :, None, None], v, jnp.zeros((), v.dtype))
    # A finite fill (not -inf) keeps a fully masked row (padding) at a uniform softmax instead of NaN.
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, K, G, T, S]
    out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)
