"""Label channels: a low-bit copy of a few calibrated channels of every flushed key, scored as attention mass.

The key copy (key_copy.py) keeps C channels of every flushed key in the model's dtype and scores each page by the
softmax mass its tokens would get from the group's queries over those channels. Labels are the same selection
with two changes that cut the bytes the scorer reads each step (Double Sparsity, arXiv 2408.07092):
- **Which channels** (`CacheConfig.label_channels`): rotary position embedding in the rotate-half layout mixes
  channel d with channel d + D/2, so a channel's share of q.k only holds together with its partner. Channels are
  picked as whole pairs, C/2 pairs of the largest pair score. The score is either an offline table (mean |q_d|
  times mean |k_d| per layer and KV head over calibration text, scripts/calibrate_labels.py, passed in as
  `CacheConfig.channel_table`) or, online, the key energy per pair of each prompt's first tokens
  (key_copy.CALIB_TOKENS).
- **How many bits** (`CacheConfig.label_bits`): 8 (int8) or 4 (two channels a byte: channel j in the low nibble,
  channel j + C/2 in the high one), symmetric, with one scale per page and channel (a bf16 scale per page and
  channel is 2 bytes per 64 tokens, 1/32 of a byte a token at page 64; a per-token scale would add 50% at 4 bits).

Arrays (one rank's view; the state holds a leading rank axis):
- codes [S, L, G, P, page, g, Cs]: int8 (Cs = C) at 8 bits, uint8 (Cs = C / 2) at 4 bits.
- scale [S, L, G, P, g, C] bfloat16: each page's step per channel (0 for an all-zero channel).
Both live in `CacheState.sel` (a key_copy.KeyCopyState: kc the codes, ksc the scales); the rule is `Labels`, the
key copy's rule with these three differences (channels, codes, scales).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ulacache_jax.cache.select.key_copy import KeyCopy
from ulacache_jax.pallas_kernels.page_lse import ref_dequant

QMAX = {8: 127, 4: 7}
# The library's default selection (runtime/generator.default_cache_config): labels of DEFAULT_CHANNELS channels
# (at most half the head dimension) at DEFAULT_BITS bits, 16 bytes a token and KV head. Chosen on the quality /
# speed frontier (docs/BENCHMARKS.md, issue 48): they keep the needles dense finds at 1/32 of a 32K context where
# Quest loses most, and decode faster than dense at the 8B shape at the same ratio.
DEFAULT_CHANNELS = 32
DEFAULT_BITS = 4
# The largest 4-bit scale: a code as quantize writes it (|v| <= 7) times 8192 (exact in bfloat16 and float16) is
# 57,344, under float16's largest finite value, so it stays finite in the tensor-core kernel's float16 operand
# (page_lse.label_lse_mma). Only a channel whose keys pass 57,000 in magnitude on a page meets it; its values
# saturate at +-7 x 8192 there instead of overflowing to inf.
SCALE_MAX4 = 8192.0


def default_channels(head_dim: int) -> int:
    """The default label channel count for a head dimension: DEFAULT_CHANNELS, at most half of it (whole rotary
    pairs, so even, and at least one pair)."""
    return max(2, min(DEFAULT_CHANNELS, head_dim // 4 * 2))


def resolve_bits(label_bits, key_channels: int) -> int:
    """Label bits as the CLI takes them: 'auto' is DEFAULT_BITS with channels and 0 (no labels) with Quest
    (key_channels 0); an int as given."""
    if label_bits != "auto":
        return label_bits
    return DEFAULT_BITS if key_channels else 0


def code_channels(num_channels: int, bits: int) -> int:
    """The last axis of the stored copy: C values, or C / 2 bytes at 4 bits."""
    return num_channels // 2 if bits == 4 else num_channels


def code_dtype(bits: int, copy_dtype):
    """The stored copy's dtype: the model's (bits 0, the key copy), int8 or packed uint8."""
    return {0: copy_dtype, 8: jnp.int8, 4: jnp.uint8}[bits]


def pair_channels(score, num_channels: int):
    """score [..., D] a channel's share of q.k (>= 0) -> [..., C] int32 sorted: the C / 2 rotary pairs (d, d + D/2)
    of the largest summed score, both members of each (ties: lower pair first). C must be even."""
    D = score.shape[-1]
    half = D // 2
    pair = score[..., :half] + score[..., half:]                                        # [..., D/2]
    top = jax.lax.top_k(pair, num_channels // 2)[1].astype(jnp.int32)                   # [..., C/2]
    return jnp.sort(jnp.concatenate([top, top + half], axis=-1), axis=-1)


def pick_pairs(k, live, num_channels: int):
    """Online calibration from a block of keys: k [..., T, g, D]; live [..., T] bool -> [..., g, C] int32, the
    pairs of largest key energy (sum over live tokens of k_d^2 + k_{d+D/2}^2)."""
    kf = jnp.where(live[..., None, None], k.astype(jnp.float32), 0.0)
    return pair_channels(jnp.sum(kf * kf, axis=-3), num_channels)


def quantize(x, bits: int):
    """x [..., T, g, C] one page's channel values (T the page's tokens) -> (codes [..., T, g, Cs], scale
    [..., g, C] bfloat16). Symmetric per page and channel: scale = max_t |x| / qmax, codes = round(x / scale). At
    4 bits channel j and j + C/2 share byte j (low, high nibble), each stored + 8 so a byte is two values in
    [1, 15], and the scale is at most SCALE_MAX4 (larger values saturate at +-7 steps)."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-3)                                                # [..., g, C]
    step = amax / QMAX[bits]
    scale = (jnp.minimum(step, SCALE_MAX4) if bits == 4 else step).astype(jnp.bfloat16)
    sf = scale.astype(jnp.float32)[..., None, :, :]                                    # [..., 1, g, C]
    q = jnp.clip(jnp.round(xf / jnp.where(sf > 0, sf, 1.0)), -QMAX[bits], QMAX[bits]).astype(jnp.int32)
    if bits == 8:
        return q.astype(jnp.int8), scale
    half = x.shape[-1] // 2
    packed = (q[..., :half] + 8) | ((q[..., half:] + 8) << 4)
    return packed.astype(jnp.uint8), scale


def dequantize(codes, scale, bits: int):
    """codes [..., T, g, Cs], scale [..., g, C] -> [..., T, g, C] float32 (the inverse of quantize up to
    rounding): the kernel file's reference, so the cache and the kernel's check read codes one way."""
    return ref_dequant(codes, scale, bits)


@dataclasses.dataclass(frozen=True)
class Labels(KeyCopy):
    """The key copy at `bits` 8 / 4 with whole rotary pairs (module docstring); `table` as the key copy's."""
    bits: int = 8
    name: ClassVar[str] = "labels"

    @classmethod
    def from_config(cls, config) -> "Labels":
        return cls(channels=config.key_channels, table=config.channel_table, bits=config.label_bits)

    def check(self, config):
        super().check(config)
        if self.bits not in (4, 8) or self.channels % 2 or config.head_dim % 2:
            raise ValueError(f"Labels: bits = {self.bits} must be 4 or 8 with an even channels = {self.channels} "
                             f"(whole rotary pairs)")

    def pick(self, k, live, num_channels):
        return pick_pairs(k, live, num_channels)

    def encode(self, x, dtype):
        return quantize(x, self.bits)

    def code_shape_dtype(self, config):
        return code_channels(self.channels, self.bits), code_dtype(self.bits, config.jnp_dtype)

    def step_bytes(self, *, context, num_layers, kv_heads, head_dim, itemsize, page_size):
        """bits / 8 bytes a channel and token, plus a 2-byte scale per page and channel."""
        return context * num_layers * kv_heads * self.channels * (self.bits / 8 + 2 / page_size)
