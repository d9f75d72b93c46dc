"""The one resolver of kernel choices: which implementation runs each step of the decode and the prefill.

`DecodeOptions` names what the caller asks for per step ('auto' or a forced implementation); `resolve` turns it,
with the cache config and the platform, into `ResolvedKernels`, where every choice is concrete. A backend calls it
once, when it is built (`backends.make_backend`), and its ops carry the result into the one program; code that
drives `decode_layer` directly with 'auto' options gets the same rules at trace time (`resolved_options`).
The kernels themselves (pallas_kernels/) decide nothing: they take an implementation name and report what they
can serve (`sparse_decode_attention.mosaic_applies`). docs/KERNELS.md is the table of these rules (which kernel
runs where and why, with the measurement each rests on); tests/test_kernel_choice.py checks this module against
it row by row.

Implementation names: 'pallas' = the Pallas kernel (Triton lowering; interpret mode off GPU), 'mosaic' = the
Mosaic GPU attention kernel (Hopper), 'ref' = the plain jnp reference, 'cudnn' = jax.nn.dot_product_attention's
cuDNN flash attention, 'xla' = the jnp attention (models.attention.dense_attention).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.pallas_kernels import next_pow2
from ulacache_jax.pallas_kernels.sparse_decode_attention import mosaic_applies

# Choices a caller may force, per step ('auto' = decided here).
ATTENTION_IMPLS = ("auto", "mosaic", "pallas", "ref")
KERNEL_IMPLS = ("auto", "pallas", "ref")
DENSE_IMPLS = ("auto", "cudnn", "xla", "pallas")
# The longest padded score row the top-k kernel was compiled and timed at on a GPU (a row lives in one program's
# registers); 8200 pages = 128K tokens at page 16 pads to 16384, where the kernel beat lax.top_k in the whole
# decode step (BENCHMARKS.md). Longer rows take lax.top_k.
TOPK_MAX_PAGES = 16384
HALF_DTYPES = ("bfloat16", "float16")  # what cuDNN's flash attention and the Mosaic kernel take


@dataclasses.dataclass(frozen=True)
class Platform:
    """What the choices depend on about the device: jax's platform name ('gpu', 'cpu', 'tpu') and whether it is a
    Hopper GPU (sm_90: wgmma and TMA, what the Mosaic GPU kernel is written for)."""
    name: str
    hopper: bool = False

    @property
    def gpu(self) -> bool:
        return self.name == "gpu"

    @staticmethod
    def of(device) -> "Platform":
        """The platform of a jax device (the first device of a backend's mesh)."""
        name = "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
        cc = str(getattr(device, "compute_capability", ""))
        return Platform(name, hopper=name == "gpu" and cc.split(".")[0] == "9")

    @staticmethod
    def current() -> "Platform":
        """The platform of the default backend's first device."""
        if jax.default_backend() != "gpu":
            return Platform(jax.default_backend())
        return Platform.of(jax.devices()[0])


@dataclasses.dataclass(frozen=True)
class ResolvedKernels:
    """Every kernel choice, concrete (no 'auto'): one backend's, made once when it is built."""
    attention: str          # sparse decode attention: 'mosaic', 'pallas' (Triton) or 'ref'
    sieve: str              # PB-LRU access: 'pallas' or 'ref'
    scores: str             # Quest page scores: 'pallas' or 'ref'
    topk: str               # page top-k: 'pallas' (radix select) or 'ref' (lax.top_k)
    copy: str               # page copies between tiers (fetch, flush, ingest): 'pallas' or 'ref'
    prefill_attention: str  # causal attention over a prompt: 'cudnn' or 'xla'
    dense_attention: str    # the dense baseline's decode attention: 'cudnn', 'xla' or 'pallas' (fp8 pages)

    def decode_options(self, options):
        """`options` (a DecodeOptions) with this resolution's choices in place of its 'auto's."""
        return dataclasses.replace(options, attention=self.attention, sieve=self.sieve, scores=self.scores,
                                   topk=self.topk, copy=self.copy, dense_attention=self.dense_attention)


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} = {value!r} must be one of {allowed}")


def resolve(options, config: CacheConfig, platform: Platform, *, query_dtype=None,
            query_heads_per_kv: int = 1) -> ResolvedKernels:
    """The kernels `options` (a DecodeOptions) resolve to for a cache of `config` on `platform`.

    query_dtype: the queries' dtype (the model's; default the cache's); query_heads_per_kv: query heads per KV head
    (the model's GQA ratio): the Mosaic attention and cuDNN take half precision only, and the Mosaic kernel at most
    64 query rows per KV head. Forced choices are returned as given (checked against the names each step knows).
    'auto' rules (docs/KERNELS.md): on GPU the Pallas kernels, with the Mosaic attention on Hopper where it
    applies (half precision, one KV head per group, head_dim and page a multiple of 64, pages resident: not the
    fused fetch, which reads the host pool), the top-k kernel for score rows up to TOPK_MAX_PAGES padded pages,
    cuDNN for prefill and dense decode attention in half precision, except that a dense cache of scaled pages (fp8)
    is walked page by page by the Triton attention kernel, which dequantises in registers (XLA would write the
    decoded cache and cuDNN read it again); off GPU the jnp references."""
    _check("attention", options.attention, ATTENTION_IMPLS)
    _check("dense_attention", options.dense_attention, DENSE_IMPLS)
    for name in ("sieve", "scores", "topk", "copy"):
        _check(name, getattr(options, name), KERNEL_IMPLS)
    c = config
    qdt = jnp.dtype(c.dtype if query_dtype is None else query_dtype).name
    gpu = platform.gpu
    kernel = "pallas" if gpu else "ref"

    def pick(value: str, auto: str) -> str:
        return auto if value == "auto" else value

    if options.fused_fetch and not c.codec.ring_in_pool:
        raise ValueError(f"fused_fetch with kv_dtype = {c.codec.name!r}: the attention kernel's second page source "
                         "serves that codec's tail ring (cache/codec.py), so misses cannot also be read from the host "
                         "pool in the same pass; use the separate fetch (fused_fetch=False)")
    # pages stored in another dtype than the queries' (fp8) or read from a second source (a scaled codec's ring)
    # take the Triton kernel: the Mosaic kernel reads one pool of the queries' dtype
    mosaic = platform.hopper and mosaic_applies(qdt, c.storage_dtype, head_dim=c.head_dim, page_size=c.page_size,
                                                kv_heads_per_group=c.kv_heads_per_group,
                                                query_rows=query_heads_per_kv,
                                                reads_host=options.fused_fetch or not c.codec.ring_in_pool)
    topk = kernel if next_pow2(c.max_pages_per_seq) <= TOPK_MAX_PAGES else "ref"
    flash = "cudnn" if gpu and qdt in HALF_DTYPES else "xla"
    dense = pick(options.dense_attention, "pallas" if gpu and c.codec.scaled else flash)
    if dense == "pallas" and not c.codec.scaled:
        raise ValueError(f"dense_attention = 'pallas' walks a scaled page format's pages (kv_dtype "
                         f"'float8_e4m3fn'); this cache stores kv_dtype {c.kv_dtype!r}: use 'auto', 'cudnn' or 'xla'")
    return ResolvedKernels(
        attention=pick(options.attention, "mosaic" if gpu and mosaic else kernel),
        sieve=pick(options.sieve, kernel), scores=pick(options.scores, kernel), topk=pick(options.topk, topk),
        copy=pick(options.copy, kernel), prefill_attention=flash, dense_attention=dense)


def is_resolved(options) -> bool:
    """Whether every kernel choice of `options` is concrete (none left 'auto')."""
    return "auto" not in (options.attention, options.sieve, options.scores, options.topk, options.copy,
                          options.dense_attention)


def resolved_options(options, config: CacheConfig, q):
    """`options` with its 'auto's resolved for queries q [S, Q, Hr, D] on the current platform: the same rules at
    trace time for code that calls decode_layer directly (a backend's options are resolved already)."""
    if is_resolved(options):
        return options
    per_kv = max(1, q.shape[2] // (config.groups_per_rank * config.kv_heads_per_group))
    return resolve(options, config, Platform.current(), query_dtype=q.dtype,
                   query_heads_per_kv=q.shape[1] * per_kv).decode_options(options)
