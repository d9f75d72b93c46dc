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


def blocked_attention(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [B, S, K, D]
    v: jax.Array,  # [B, S, K, D]
    q_positions: jax.Array,  # [B, T] int
    k_positions: jax.Array,  # [B, S] int
    *,
    sliding_window: int | None = None,
    k_valid: jax.Array | None = None,  # [B, S] bool, False for empty cache slots
    block_q: int = 512,
    block_k: int = 512,
) -> jax.Array:  # [B, T, H, D] in q's dtype
    """`dense_attention` (same arguments, masks and result) computed a block of queries against a block of keys
    at a time with an online softmax, so no [T, S] score matrix ever exists.

    Why: dense_attention materialises the [B, K, G, T, S] float32 scores; a 32K-token prompt of Qwen2.5-0.5B
    (H = 14, T = S = 32768) needs 32768**2 * 14 * 4 B = 56 GiB per layer and fails. Here the temporaries are one
    [B, K, G, block_q, block_k] float32 score tile plus float32 accumulators [B, K, G, block_q, D], and the
    inputs and output (padded to block multiples): memory linear in the context, at every dtype.

    How: an outer loop over query blocks; for each, a loop over all key blocks keeping per query row a running
    max m, a running sum l of exp(score - m), and a float32 accumulator of exp(score - m) @ V, rescaled by
    exp(m_old - m_new) whenever the max grows. A key block that no query of the block can see (every key
    position after the block's last query position, outside the sliding window, or invalid/padding) is skipped
    with lax.cond: causal prefill does about half the tile work. Masking is by positions, so unsorted positions
    (cache slots) are fine; the skip test only gets less effective.

    Fully masked query rows (no visible key, e.g. padding): dense_attention's finite fill gives them a uniform
    softmax over all S keys, i.e. the mean of V with invalid slots zeroed. Such rows see no key here (l = 0),
    so the same mean is computed directly and returned for them: the result matches dense on every row.

    T and S are padded up to block multiples (padded keys masked out, padded query rows dropped); the blocks
    shrink to T and S when those are smaller (decode, T = 1, uses one query block of 1 row).
    """
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    g = h // kv
    bq, bk = min(block_q, t), min(block_k, s)
    num_q_blocks, num_k_blocks = -(-t // bq), -(-s // bk)
    tp, sp = num_q_blocks * bq, num_k_blocks * bk
    fill = jnp.finfo(jnp.float32).min
    scale = d**-0.5

    # keys a query may ever see: real (not block padding) and valid; v zeroed elsewhere (NaN in freed pages
    # times a zero probability is still NaN)
    k_ok = jnp.ones((b, s), bool) if k_valid is None else k_valid.astype(bool)  # [B, S]
    if k_valid is not None:
        v = jnp.where(k_ok[:, :, None, None], v, jnp.zeros((), v.dtype))
    # what dense gives a fully masked row: the uniform average over all S keys (invalid ones zeroed)
    # (dense rounds the probability 1/S to v's dtype before the float32 sum; so does this)
    v_mean = jnp.sum(v, axis=1, dtype=jnp.float32) * jnp.asarray(1.0 / s, v.dtype).astype(jnp.float32)  # [B, K, D]

    q_pad = jnp.pad(q.reshape(b, t, kv, g, d), ((0, 0), (0, tp - t), (0, 0), (0, 0), (0, 0)))  # [B, Tp, K, G, D]
    qpos_pad = jnp.pad(q_positions, ((0, 0), (0, tp - t)))  # [B, Tp]
    k_pad = jnp.pad(k, ((0, 0), (0, sp - s), (0, 0), (0, 0)))  # [B, Sp, K, D]
    v_pad = jnp.pad(v, ((0, 0), (0, sp - s), (0, 0), (0, 0)))  # [B, Sp, K, D]
    kpos_pad = jnp.pad(k_positions, ((0, 0), (0, sp - s)))  # [B, Sp]
    kok_pad = jnp.pad(k_ok, ((0, 0), (0, sp - s)))  # [B, Sp], False on padding

    # Block-skip table [num_q_blocks, num_k_blocks]: key block j can matter to query block i iff some usable key
    # in it is at or before the last query position (and, with a window, after the first one minus the window).
    # Taken over the whole batch, so it is conservative; the per-element mask below stays exact.
    pos_dtype = jnp.promote_types(q_positions.dtype, k_positions.dtype)
    big, small = jnp.iinfo(pos_dtype).max, jnp.iinfo(pos_dtype).min
    q_real = (jnp.arange(tp) < t)[None, :]  # [1, Tp]
    qpos_blocks = qpos_pad.astype(pos_dtype).reshape(b, num_q_blocks, bq)
    q_real_blocks = jnp.broadcast_to(q_real, (b, tp)).reshape(b, num_q_blocks, bq)
    q_max = jnp.where(q_real_blocks, qpos_blocks, small).max(axis=(0, 2))  # [num_q_blocks]
    q_min = jnp.where(q_real_blocks, qpos_blocks, big).min(axis=(0, 2))  # [num_q_blocks]
    kpos_blocks = kpos_pad.astype(pos_dtype).reshape(b, num_k_blocks, bk)
    kok_blocks = kok_pad.reshape(b, num_k_blocks, bk)
    k_min = jnp.where(kok_blocks, kpos_blocks, big).min(axis=(0, 2))  # [num_k_blocks]
    k_max = jnp.where(kok_blocks, kpos_blocks, small).max(axis=(0, 2))  # [num_k_blocks]
    # [num_q_blocks, num_k_blocks]; a key block with no usable key has k_min = big, so it is never needed
    needed = k_min[None, :] <= q_max[:, None]
    if sliding_window is not None:
        # the smallest q - k over the two blocks; all-unusable key blocks are already False above
        needed &= q_min[:, None] - k_max[None, :] < sliding_window

    def query_block(i):  # -> [B, bq, H, D] in q's dtype
        q_blk = jax.lax.dynamic_slice_in_dim(q_pad, i * bq, bq, axis=1)  # [B, bq, K, G, D]
        qpos = jax.lax.dynamic_slice_in_dim(qpos_pad, i * bq, bq, axis=1)  # [B, bq]

        def key_block(j, carry):
            def visit(carry):
                m, l, acc = carry  # [B, K, G, bq], [B, K, G, bq], [B, K, G, bq, D] float32
                k_blk = jax.lax.dynamic_slice_in_dim(k_pad, j * bk, bk, axis=1)  # [B, bk, K, D]
                v_blk = jax.lax.dynamic_slice_in_dim(v_pad, j * bk, bk, axis=1)  # [B, bk, K, D]
                kpos = jax.lax.dynamic_slice_in_dim(kpos_pad, j * bk, bk, axis=1)  # [B, bk]
                kok = jax.lax.dynamic_slice_in_dim(kok_pad, j * bk, bk, axis=1)  # [B, bk]
                scores = jnp.einsum("BTKGD,BSKD->BKGTS", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
                mask = (kpos[:, None, :] <= qpos[:, :, None]) & kok[:, None, :]  # [B, bq, bk]
                if sliding_window is not None:
                    mask &= qpos[:, :, None] - kpos[:, None, :] < sliding_window
                mask = mask[:, None, None]  # [B, 1, 1, bq, bk]
                scores = jnp.where(mask, scores, fill)
                m_new = jnp.maximum(m, scores.max(axis=-1))
                # masked keys contribute exactly 0 (not exp(fill - fill) = 1): fully masked rows keep l = 0
                p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)  # [B, K, G, bq, bk]
                rescale = jnp.exp(m - m_new)  # 0 when m was still the fill and a real score arrived
                l = l * rescale + p.sum(axis=-1)
                pv = jnp.einsum("BKGTS,BSKD->BKGTD", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
                return m_new, l, acc * rescale[..., None] + pv

            return jax.lax.cond(needed[i, j], visit, lambda c: c, carry)

        init = (
            jnp.full((b, kv, g, bq), fill, jnp.float32),
            jnp.zeros((b, kv, g, bq), jnp.float32),
            jnp.zeros((b, kv, g, bq, d), jnp.float32),
        )
        _, l, acc = jax.lax.fori_loop(0, num_k_blocks, key_block, init)
        seen = l > 0  # [B, K, G, bq]
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], v_mean[:, :, None, None, :])
        return jnp.einsum("BKGTD->BTKGD", out).reshape(b, bq, h, d).astype(q.dtype)

    blocks = jax.lax.map(query_block, jnp.arange(num_q_blocks))  # [num_q_blocks, B, bq, H, D]
    out = jnp.moveaxis(blocks, 0, 1).reshape(b, tp, h, d)
    return out[:, :t]
