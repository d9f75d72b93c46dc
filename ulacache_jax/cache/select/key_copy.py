"""A compressed copy of every flushed key, resident in HBM, and the page selection that scores it.

Quest's per-page min/max bound (selection.py) ranks pages by an upper bound of one logit; on a trained model it
misses needles whose page is otherwise unremarkable (docs/BENCHMARKS.md, "A compressed copy of every key"). With
CacheConfig.key_channels = C > 0 the cache also keeps, for every token of every flushed page, C of its key's D
channels: those of largest energy (sum of k_d^2 over the keys the sequence's first prefill block holds), chosen
per (sequence, layer, KV head) when that block is written and fixed for the sequence's life. A page then scores the
attention mass it would get: each query head's softmax over the approximate logits q[chan] . k[chan] / sqrt(D) of
every flushed token, summed over the page's tokens and the group's query heads. The copy costs C / (2 D) of the
context's K + V bytes in HBM (16 of 128 channels: 6.25%) and is read in full every step.

Arrays (one rank's view inside the decode; the state holds a leading rank axis):
- kc [S, L, G, P, page, g, C]: the copy, page-major so a flush writes whole pages; tokens of pages at or past a
  sequence's `flushed` count are stale and never read (masked).
- chan [S, L, G, g, C] int32: the channel indices of each (sequence, layer, KV head).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ulacache_jax.cache.select import labels
from ulacache_jax.pallas_kernels.page_lse import page_lse


def pick_channels(k, live, num_channels: int):
    """k [..., T, g, D] keys; live [..., T] bool -> [..., g, C] int32: the C channels of largest energy over the
    live tokens (ties: lower index first). Where no token is live the energies tie: channels 0..C-1."""
    kf = jnp.where(live[..., None, None], k.astype(jnp.float32), 0.0)
    energy = jnp.sum(kf * kf, axis=-3)                                                  # [..., g, D]
    return jax.lax.top_k(energy, num_channels)[1].astype(jnp.int32)


def compress(k, chan):
    """k [..., T, g, D]; chan [..., g, C] -> [..., T, g, C]: each token's key at its KV head's channels."""
    idx = jnp.broadcast_to(chan[..., None, :, :], k.shape[:-1] + chan.shape[-1:])
    return jnp.take_along_axis(k, idx, axis=-1)


def page_mass(kc, chan, q, flushed, *, layer: int, impl: str = "auto", ksc=None, bits: int = 0):
    """Page scores of one layer from the key copy: the attention mass each flushed page would receive.

    kc [S, L, G, P, page, g, C] (the rank's copy, every layer); chan [S, G, g, C] int32 (this layer's channels);
    q [S, Q, Hr, D] (Hr query heads of this rank's G * g KV heads; the Q rows' masses are summed); flushed [S]
    int32 pages per sequence -> [S, G, P] float32, -inf on pages at or past `flushed`. Softmax per query head over
    the flushed tokens (the unflushed tail is always attended and not part of the ranking), summed over the page's
    tokens and the group's heads. The per-page log-sum-exp of the logits is pallas_kernels/page_lse.py (impl:
    'auto' = kernel on GPU); each head's normaliser over the pages and the sum are [.., P]-sized XLA ops.
    Labels (bits 8 or 4): kc holds codes and ksc [S, L, G, P, g, C] their scales (select/labels.py); the kernel
    dequantises in registers, so a step reads C * bits / 8 bytes a token."""
    S, L, G, P, page, g, _ = kc.shape
    C = chan.shape[-1]
    Q, Hr, D = q.shape[1], q.shape[2], q.shape[3]
    h = Hr // (G * g)
    qg = q.astype(jnp.float32).reshape(S, Q, G, g, h, D)
    idx = jnp.broadcast_to(chan[:, None, :, :, None, :], (S, Q, G, g, h, C))
    qc = jnp.take_along_axis(qg, idx, axis=-1) / jnp.sqrt(jnp.float32(D))              # [S, Q, G, g, h, C]
    qc = qc.transpose(0, 2, 3, 1, 4, 5).reshape(S, G, g, Q * h, C)                      # rows: (Q, h)
    lse = page_lse(kc, qc, layer=layer, impl=impl, scale=ksc, bits=bits)                # [S, G, g * Q * h, P]
    ok = jnp.arange(P)[None, None, None, :] < flushed[:, None, None, None]             # [S, 1, 1, P]
    lse = jnp.where(ok, lse, -jnp.inf)
    total = jax.nn.logsumexp(lse, axis=-1, keepdims=True)                              # each row's normaliser
    w = jnp.exp(lse - jnp.where(jnp.isfinite(total), total, 0.0))                       # 0 on masked pages
    return jnp.where(ok[:, :, 0], w.sum(axis=2), -jnp.inf)                              # [S, G, P]


def write_block(kc, chan, slot, layer0, page0, kp, live, first, *, ksc=None, bits: int = 0, fixed: bool = False):
    """The copy of a block of whole pages of one sequence, all ranks, at prefill ingestion.

    kc [R, S, L, G, P, page, g, C], chan [R, S, L, G, g, C] (the state's); kp [R, Lb, G, n, page, g, D] keys of
    pages [page0, page0 + n) of layers [layer0, layer0 + Lb) of `slot`; live [n, page] bool tokens that exist;
    first: traced bool, the sequence's first block: its channels are picked from this block's live keys (else the
    sequence's stored channels are kept). -> (kc, chan, ksc). Dead tokens' copies are written too: they lie at or
    past the sequence's length, in pages that are not flushed yet, and are never read before a flush rewrites them.
    Labels (bits 8 / 4): the channels are whole rotary pairs (labels.pick_pairs), the copy is quantised per page
    and channel, ksc [R, S, L, G, P, g, C] takes the scales. fixed: the channels come from an offline table and are
    never re-picked."""
    R, Lb, G, n, page, g, D = kp.shape
    C = chan.shape[-1]
    zero = jnp.zeros((), jnp.int32)
    at = (zero, jnp.asarray(slot, jnp.int32), jnp.asarray(layer0, jnp.int32), zero)
    flat = kp.reshape(R, Lb, G, n * page, g, D)
    old = jax.lax.dynamic_slice(chan, at + (zero, zero), (R, 1, Lb, G, g, C))[:, 0]      # [R, Lb, G, g, C]
    if fixed:
        ch = old
    else:
        pick = labels.pick_pairs if bits else pick_channels
        ch = jnp.where(first, pick(flat, live.reshape(-1), C), old)
    block = compress(flat, ch).reshape(R, 1, Lb, G, n, page, g, C)
    at_page = at + (jnp.asarray(page0, jnp.int32), zero, zero)
    if bits:
        codes, scale = labels.quantize(block, bits)                   # [R, 1, Lb, G, n, page, g, Cs], [.., n, g, C]
        kc = jax.lax.dynamic_update_slice(kc, codes, at_page + (zero,))
        ksc = jax.lax.dynamic_update_slice(ksc, scale, at_page)
    else:
        kc = jax.lax.dynamic_update_slice(kc, block.astype(kc.dtype), at_page + (zero,))
    return kc, jax.lax.dynamic_update_slice(chan, ch[:, None], at + (zero, zero)), ksc


def write_pages(kc, chan, s, l, g, page, kp, *, ksc=None, bits: int = 0):
    """The copy of single pages, one rank: tail pages at their flush. kc [S, L, G, P, page, g, Cs], chan
    [S, L, G, g, C]; s, l, g, page broadcastable index arrays (page = P: dropped) of shape I; kp [*I, page, g, D]
    -> (kc, ksc); labels (bits 8 / 4) quantise each page and write its scales into ksc [S, L, G, P, g, C]."""
    ch = chan[s, l, g]                                                                  # [*I, g, C]
    x = compress(kp, ch)                                                                # [*I, page, g, C]
    if not bits:
        return kc.at[s, l, g, page].set(x.astype(kc.dtype), mode="drop"), ksc
    codes, scale = labels.quantize(x, bits)
    return kc.at[s, l, g, page].set(codes, mode="drop"), ksc.at[s, l, g, page].set(scale, mode="drop")
