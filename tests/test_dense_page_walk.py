"""The dense baseline over fp8 pages without decoding them (runtime/backends.py: dense_page_walk): the attention
kernel walks each sequence's complete pages by frame with their scales and its page under construction from the
ring. Checked against the path it replaces (XLA decodes the cache, then the jnp attention) at adversarial
positions: a ring holding one token (the first of a page), a position in the last page, the very first token, a
dead slot, pages past a sequence's end that hold garbage (never read). Off GPU the kernel runs in interpret mode;
`pytest -m gpu` runs it compiled."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.cache.codec import codec_for
from ulacache_jax.cache.decode_layer import DecodeOptions
from ulacache_jax.cache.kernel_choice import Platform
from ulacache_jax.models import get_preset
from ulacache_jax.models.attention import dense_attention
from ulacache_jax.runtime.backends import DenseOps, dense_page_walk
from ulacache_jax.runtime.generation import default_cache_config

S, KV, H, D, P, NPAGES = 4, 2, 4, 64, 16, 4
T = P * NPAGES


def make_view(rng, dtype, pos):
    """Random K/V of every position in the model's dtype, encoded page by page (garbage past each position too:
    the kernel must not read it), and each sequence's page under construction (the one holding pos) in its ring,
    as DenseOps._append_scaled leaves them -> the layer's six arrays (DenseCache.layer)."""
    codec = codec_for("float8_e4m3fn")
    k = jnp.asarray(rng.standard_normal((S, T, KV, D)) * rng.uniform(0.1, 8.0, (S, NPAGES * P, KV, 1)), dtype)
    v = jnp.asarray(rng.standard_normal((S, T, KV, D)), dtype)
    enc = codec.encode(k.reshape(S, NPAGES, P, KV, D), v.reshape(S, NPAGES, P, KV, D), dtype)
    cur = np.asarray(pos) // P
    rk = jnp.stack([k[s, c * P:(c + 1) * P] for s, c in enumerate(cur)])             # [S, P, KV, D]
    rv = jnp.stack([v[s, c * P:(c + 1) * P] for s, c in enumerate(cur)])
    return enc.k.reshape(S, T, KV, D), enc.v.reshape(S, T, KV, D), enc.ks, enc.vs, rk, rv


def xla_path(view, q, pos, live, dtype):
    """What DenseOps.attend computes with dense_attention 'xla': the decoded cache, then the jnp attention."""
    cfg = default_cache_config(get_preset("tiny"), num_seqs=S, max_tokens=T, page_size=P, dtype=jnp.dtype(dtype).name,
                               kv_dtype="float8_e4m3fn")
    ops = DenseOps.build(DecodeOptions(dense_attention="xla"), cfg, Platform("cpu"))
    ck, cv = ops._decoded(view, pos)
    kpos = jnp.broadcast_to(jnp.arange(T)[None], (S, T))
    seen = jnp.where(live, pos + 1, 0)
    return dense_attention(q, ck, cv, pos[:, None], kpos, k_valid=kpos < seen[:, None])


def check_against_the_decoded_cache(dtype, seed, walk):
    """walk(view, q, pos, live) -> out: equal to the decoded-cache path on the live slots, at the first token of
    page 2 (the ring holds one token), the last position, the very first token, beside a dead slot."""
    rng = np.random.default_rng(seed)
    pos = jnp.asarray([2 * P, T - 1, 0, 37], jnp.int32)
    live = jnp.asarray([True, True, True, False])
    view = make_view(rng, dtype, pos)
    q = jnp.asarray(rng.standard_normal((S, 1, H, D)) * 2.0, dtype)
    want = np.asarray(xla_path(view, q, pos, live, dtype), np.float32)[:3]
    got = np.asarray(walk(view, q, pos, live), np.float32)[:3]
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", ["pallas", "ref"])
def test_page_walk_equals_the_decoded_cache(dtype, impl):
    check_against_the_decoded_cache(dtype, 0, lambda *a: dense_page_walk(*a, page_size=P, impl=impl))


def test_page_walk_reads_no_page_past_the_position():
    """Pages past a sequence's position hold NaN codes and scales: the walk's output stays finite and unchanged."""
    rng = np.random.default_rng(1)
    pos = jnp.asarray([P + 3, P - 1, 2 * P, 5], jnp.int32)
    live = jnp.ones(S, bool)
    view = make_view(rng, jnp.float32, pos)
    q = jnp.asarray(rng.standard_normal((S, 1, H, D)), jnp.float32)
    base = np.asarray(dense_page_walk(view, q, pos, live, page_size=P, impl="pallas"))
    ck, cv, cks, cvs, rk, rv = view
    past = (jnp.arange(T)[None, :] // P) > (pos[:, None] // P)                        # [S, T]
    pg_past = (jnp.arange(NPAGES)[None, :]) >= (pos[:, None] // P)                    # the ring's page too
    nan8 = jnp.asarray(jnp.nan, ck.dtype)
    bad = (jnp.where(past[..., None, None], nan8, ck), jnp.where(past[..., None, None], nan8, cv),
           jnp.where(pg_past[:, :, None, None, None], jnp.nan, cks),
           jnp.where(pg_past[:, :, None, None, None], jnp.nan, cvs), rk, rv)
    got = np.asarray(dense_page_walk(bad, q, pos, live, page_size=P, impl="pallas"))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, base)


def test_resolver_walks_scaled_dense_pages_on_gpu_only():
    mc = get_preset("llama-3.1-8b")
    fp8 = default_cache_config(mc, num_seqs=2, max_tokens=4096, dtype="bfloat16", kv_dtype="float8_e4m3fn")
    bf16 = dataclasses.replace(fp8, kv_dtype="auto")
    from ulacache_jax.cache.kernel_choice import resolve
    gpu = Platform("gpu", hopper=True)
    assert resolve(DecodeOptions(), fp8, gpu, query_dtype="bfloat16").dense_attention == "pallas"
    assert resolve(DecodeOptions(), bf16, gpu, query_dtype="bfloat16").dense_attention == "cudnn"
    assert resolve(DecodeOptions(), fp8, Platform("cpu")).dense_attention == "xla"
    assert resolve(DecodeOptions(dense_attention="xla"), fp8, gpu).dense_attention == "xla"     # forced: as given
    with pytest.raises(ValueError, match="dense_attention = 'pallas' walks a scaled page format"):
        resolve(DecodeOptions(dense_attention="pallas"), bf16, gpu)
    with pytest.raises(ValueError, match="dense_attention"):
        resolve(DecodeOptions(dense_attention="flash"), fp8, gpu)


@pytest.mark.gpu
def test_page_walk_compiled_on_the_gpu():
    """The Triton kernel compiled (the machine's GPU) against the decoded cache, at the 8B's head shape."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    check_against_the_decoded_cache(jnp.bfloat16, 2, jax.jit(lambda *a: dense_page_walk(*a, page_size=P,
                                                                                          impl="pallas")))


def test_generate_dense_fp8_through_the_page_walk():
    """`generate(attention="dense", kv_dtype="float8_e4m3fn")` with the page walk forced (interpret mode here; the
    GPU's default) gives the tokens of the decoded-cache path, prefill, ring and page completions included."""
    from flax import nnx
    from ulacache_jax import generate
    from ulacache_jax.models import LlamaModel
    model = LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    doc = [int(t) for t in rng.integers(0, 256, 100)]
    ps = [doc + [int(t) for t in rng.integers(0, 256, n)] for n in (5, 23)]
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=192, page_size=16)
    # 17 tokens: the prefill's and one whole decode chunk, crossing a page boundary in both sequences
    kw = dict(max_new_tokens=17, cache_config=cfg, attention="dense", kv_dtype="float8_e4m3fn")
    walk = generate(model, ps, options=DecodeOptions(dense_attention="pallas"), **kw)
    decoded = generate(model, ps, options=DecodeOptions(dense_attention="xla"), **kw)
    assert walk == decoded and all(len(t) == 17 for t in walk)
