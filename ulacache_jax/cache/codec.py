"""The page format, defined once: how one K/V page of one (sequence, layer, group) is stored in the HBM frames and
the host pool. Every writer and reader of pool pages goes through the cache config's codec (`CacheConfig.codec`):
the tail append and the flush to the host pool (decode_layer), prefill ingestion (runtime/sequences), the prefix
attach (runtime/prefix_cache), the fetch (page_copy moves every array of `Pages` in one launch) and the attention
kernel (pallas_kernels/sparse_decode_attention dequantises a scaled page in registers).

A stored page is a `Pages` pytree: codes k, v [..., page, g, D] in the codec's storage dtype and, for a scaled
codec, scales ks, vs [..., 1, g, 1] float32 (one per page and KV head; the two singleton axes keep every array of a
page 3-D, so the page copies move scales exactly as they move pages, in the same launch). The host pool is a
`Pages` with a leading [R, H] (state.HostPool is this type).

Two codecs ship:
- `ModelCodec` (kv_dtype "auto"): the model's dtype, no scales; what the cache always stored.
- `Fp8Codec` (kv_dtype "float8_e4m3fn"): e4m3 codes with a float32 scale per page and KV head. Why that
  granularity: e4m3 keeps 3 mantissa bits at every magnitude in its normal range (2**-6 .. 448), so a scale only
  has to place a page's largest value at 448; one scale per (page, head) costs 4 bytes per 64 x 128 codes (0.05%)
  and is one scalar per page in the attention kernel, where a scale per token costs 4 bytes per 128 (3%) and a
  vector per page. Keys of one head share their magnitude along a page (a RoPE'd head's channels do not drift within
  64 tokens), so per-token scales would buy precision only for values 2**15 below their page's maximum (they fall
  into e4m3's subnormals). Per token, the alternative issue 50 asks to measure, was measured on SmolLM2 past 8K
  (scripts/studies/kv_dtype_quality.py's fp8_per_token cells, BENCHMARKS.md) and bought nothing, so it is not
  built: it would let the tail append encode each token into the pool (no model-dtype ring) at 32x the scale bytes.

Where a page is encoded: a scaled codec needs all of a page's tokens to choose its scale, so its tail ring (the
unflushed pages) stays in the model's dtype, in its own array (`ring_in_pool` False), and a page is encoded once,
at its flush (or at ingestion for a complete prompt page). That also gives the selection rules the unquantised keys
at flush (Quest's summaries, the key copy, the labels). The attention kernel reads the ring as its second page
source (unscaled). A codec without scales stores the ring in the pool, as it always did.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

KV_DTYPES = ("auto", "float8_e4m3fn")   # CacheConfig.kv_dtype: the model's dtype, or e4m3 with scales


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "ks", "vs"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Pages:
    """Stored pages (the host pool, a batch of encoded pages): k, v [..., page, g, D] codes; ks, vs [..., 1, g, 1]
    float32 per-page scales of a scaled codec, None otherwise (None is no leaf: an unscaled pool's programs are the
    ones they were before scales existed)."""
    k: jax.Array
    v: jax.Array
    ks: jax.Array | None = None
    vs: jax.Array | None = None

    def arrays(self) -> list:
        """Every array of the pages, in one order: what a page copy moves in one launch."""
        return [self.k, self.v] + ([self.ks, self.vs] if self.ks is not None else [])

    @staticmethod
    def of(arrays) -> "Pages":
        """The inverse of `arrays`."""
        return Pages(*arrays)


@dataclasses.dataclass(frozen=True)
class ModelCodec:
    """Pages in the model's dtype, no scales: the default, what the cache always stored."""
    name = "auto"

    @property
    def scaled(self) -> bool:
        """Whether pages carry per-page scales (ks, vs)."""
        return False

    @property
    def ring_in_pool(self) -> bool:
        """Whether the tail ring lives in the pool, encoded token by token (a codec without scales), or in its own
        array in the model's dtype, encoded at flush (a page's scale needs all of its tokens)."""
        return not self.scaled

    def storage_dtype(self, model_dtype) -> jnp.dtype:
        return jnp.dtype(model_dtype)

    def encode(self, k, v, model_dtype) -> Pages:
        """k, v [..., page, g, D] (any float dtype) -> Pages of the same leading shape."""
        dt = self.storage_dtype(model_dtype)
        return Pages(k.astype(dt), v.astype(dt))

    def decode(self, pages: Pages, dtype):
        """Pages -> (k, v) [..., page, g, D] in `dtype`."""
        return pages.k.astype(dtype), pages.v.astype(dtype)

    def code_bytes(self, model_dtype) -> int:
        return self.storage_dtype(model_dtype).itemsize

    def page_bytes(self, page_size: int, kv_heads: int, head_dim: int, model_dtype) -> int:
        """Bytes of one stored K (or V) page of one group: its codes and its scales."""
        return page_size * kv_heads * head_dim * self.code_bytes(model_dtype) + (4 * kv_heads if self.scaled else 0)

    def check(self, model_dtype) -> None:
        """Raise ValueError when this codec cannot store pages of `model_dtype`."""


@dataclasses.dataclass(frozen=True)
class ScaledCodec(ModelCodec):
    """Codes of `dtype` with a float32 scale per page and KV head: scale = amax / max_code over the page's tokens
    and channels of one head, codes = to_codes(x / scale) clipped to [-max_code, max_code]. A page of zeros gets
    scale 1 (codes 0). Inputs below float32's smallest normal (1.2e-38) are zeros: CPUs and GPUs flush denormals
    differently, and a page's scale must not depend on where it was encoded; a scale is at least that smallest
    normal, so it never flushes to zero either.
    Subclasses give `dtype`, `max_code` and `to_codes` (rounding: fp8's cast rounds to nearest even, an integer
    codec rounds explicitly)."""
    dtype: str = "float8_e4m3fn"
    max_code: float = 448.0

    @property
    def scaled(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return self.dtype

    def storage_dtype(self, model_dtype) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    def to_codes(self, y):
        """y [...] float32 in [-max_code, max_code] -> codes of the storage dtype."""
        return y.astype(self.dtype)

    def quantise(self, x):
        """x [..., page, g, D] -> (codes [..., page, g, D], scale [..., 1, g, 1] float32)."""
        tiny = jnp.finfo(jnp.float32).tiny
        x = x.astype(jnp.float32)
        x = jnp.where(jnp.abs(x) < tiny, 0.0, x)                  # denormals are zeros, on every device
        amax = jnp.max(jnp.abs(x), axis=(-3, -1), keepdims=True)
        scale = jnp.maximum(jnp.where(amax > 0, amax / self.max_code, 1.0), tiny)
        y = jnp.clip(x / scale, -self.max_code, self.max_code)
        return self.to_codes(y), scale

    def encode(self, k, v, model_dtype) -> Pages:
        kc, ks = self.quantise(k)
        vc, vs = self.quantise(v)
        return Pages(kc, vc, ks, vs)

    def decode(self, pages: Pages, dtype):
        return ((pages.k.astype(jnp.float32) * pages.ks).astype(dtype),
                (pages.v.astype(jnp.float32) * pages.vs).astype(dtype))


@dataclasses.dataclass(frozen=True)
class Fp8Codec(ScaledCodec):
    """e4m3 (float8_e4m3fn: no infinities, max 448) codes, a float32 scale per page and KV head."""
    dtype: str = "float8_e4m3fn"
    max_code: float = 448.0


def codec_for(kv_dtype: str, page_codec=None):
    """The codec a config names: `page_codec` if given (a codec object, e.g. a test's own), else by kv_dtype."""
    if page_codec is not None:
        if not isinstance(page_codec, ModelCodec):
            raise ValueError(f"page_codec = {page_codec!r} must be a ModelCodec (ulacache_jax/cache/codec.py)")
        return page_codec
    if kv_dtype == "auto":
        return ModelCodec()
    if kv_dtype == "float8_e4m3fn":
        return Fp8Codec()
    raise ValueError(f"kv_dtype = {kv_dtype!r} must be one of {KV_DTYPES}")
