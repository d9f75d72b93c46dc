"""The page format (ulacache_jax/cache/codec.py): the fp8 codec against a numpy reference (ml_dtypes' e4m3) on
random and adversarial pages, the config's byte accounting, and the attention kernel reading fp8 pages (interpret
mode on CPU; compiled against its reference on a GPU)."""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.cache.codec import Fp8Codec, ModelCodec, Pages
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.pallas_kernels import sparse_decode_attention as sda

ON_GPU = jax.devices()[0].platform == "gpu"
E4M3_MAX = 448.0
TINY = np.finfo(np.float32).tiny


def np_encode(x):
    """The reference e4m3 encoding of pages x [..., page, g, D] float32: denormal inputs are zeros; scale =
    amax / 448 per (page, head), at least float32's smallest normal; codes = x / scale clipped to +-448, rounded to
    nearest even by ml_dtypes."""
    x = np.where(np.abs(x) < TINY, np.float32(0), x).astype(np.float32)
    amax = np.abs(x).max(axis=(-3, -1), keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    scale = np.maximum(scale, TINY).astype(np.float32)
    codes = np.clip(x / scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale


def check_round_trip(x):
    """Encode x with the library's fp8 codec; compare codes and scales with the numpy reference and the decoded
    values with e4m3's error bound: half a unit in the last place of 3 mantissa bits (2**-4 relative) in the
    normal range, half the smallest subnormal step (2**-10 x scale) below it, plus float32's smallest normal for
    denormal inputs (zeros by the codec's rule)."""
    codec = Fp8Codec()
    xj = jnp.asarray(x)
    enc = codec.encode(xj, -xj, "float32")
    assert enc.k.dtype == jnp.float8_e4m3fn and enc.ks.dtype == jnp.float32
    assert enc.ks.shape == x.shape[:-3] + (1, x.shape[-2], 1)
    codes, scale = np_encode(x)
    np.testing.assert_allclose(np.asarray(enc.ks), scale, rtol=1e-6, atol=0)
    got = np.asarray(enc.k).astype(np.float32)
    want = codes.astype(np.float32)
    np.testing.assert_array_equal(got, want)
    k, v = codec.decode(enc, jnp.float32)
    k, v = np.asarray(k), np.asarray(v)
    bound = 2.0**-4 * np.abs(x) * (1 + 1e-6) + 2.0**-10 * scale + TINY
    assert np.all(np.abs(k - x) <= bound), float(np.max(np.abs(k - x) - bound))
    np.testing.assert_array_equal(v, -k)     # the codec is symmetric: V rounds as K does
    assert np.isfinite(k).all()
    return k, scale


def test_fp8_round_trip_random():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 5, 16, 2, 32)) * rng.uniform(0.01, 30, (3, 5, 1, 2, 1))).astype(np.float32)
    k, _ = check_round_trip(x)
    # the typical error is far below the bound: e4m3 has 3 mantissa bits (relative RMS about 2**-4 / sqrt(3))
    assert np.linalg.norm(k - x) / np.linalg.norm(x) < 0.04


def test_fp8_round_trip_adversarial():
    page = np.zeros((4, 16, 2, 32), np.float32)                    # [pages, page, g, D]
    page[1] = 3.0e4                                                # past e4m3's 448: the scale brings it in
    page[1, ::3] = -1.0e6
    page[2] = 1e-40                                                # float32 denormals: zeros
    page[2, 0, 0, 0] = -3e-38                                      # and one tiny normal: its own scale
    rng = np.random.default_rng(1)
    page[3] = rng.standard_normal((16, 2, 32))
    page[3, 5, 1, 7] = 1e3                                         # one outlier in this page's head 1
    k, scale = check_round_trip(page)
    np.testing.assert_array_equal(k[0], 0.0)                       # zeros stay zeros, scale 1
    np.testing.assert_array_equal(scale[0], 1.0)
    np.testing.assert_array_equal(k[2].reshape(-1)[1:], 0.0)
    assert k[2, 0, 0, 0] == pytest.approx(-3e-38, rel=2.0**-4)
    np.testing.assert_allclose(k[1], page[1], rtol=2.0**-4)        # huge values: relative error only
    assert k[3, 5, 1, 7] == pytest.approx(1e3, rel=2.0**-4)
    # head 0 of the outlier's page keeps its own scale: the outlier costs head 1's small values only
    assert scale[3, 0, 0, 0] < scale[3, 0, 1, 0] / 100
    np.testing.assert_allclose(k[3, :, 0], page[3, :, 0], rtol=2.0**-4, atol=2.0**-10 * scale[3, 0, 0, 0])


def test_model_codec_is_the_identity():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 8, 1, 16)), jnp.bfloat16)
    enc = ModelCodec().encode(x, x, "bfloat16")
    assert enc.ks is None and enc.arrays() == [enc.k, enc.v]
    np.testing.assert_array_equal(np.asarray(enc.k, np.float32), np.asarray(x, np.float32))
    assert Pages.of(enc.arrays()) == enc


def test_config_bytes_and_validation():
    base = CacheConfig.preset("tiny", dtype="bfloat16")
    fp8 = dataclasses.replace(base, kv_dtype="float8_e4m3fn")
    assert base.page_bytes == 8 * 1 * 16 * 2
    assert fp8.page_bytes == 8 * 1 * 16 * 1 + 4                   # codes + one float32 scale per KV head
    fb, f8 = base.footprint(), fp8.footprint()
    assert f8["host"] == base.footprint()["host"] // 2 + 2 * base.host_pages * 4
    assert f8["tail"] == fb["tail"]                                # the ring stays in the model's dtype
    assert f8["frames"] < fb["frames"] * 0.6
    with pytest.raises(ValueError, match="kv_dtype = 'int4'"):
        CacheConfig.preset("tiny", kv_dtype="int4")
    with pytest.raises(ValueError, match="page_codec"):
        CacheConfig.preset("tiny", kv_dtype="float8_e4m3fn", page_codec=Fp8Codec())
    with pytest.raises(ValueError, match="must be a ModelCodec"):
        CacheConfig.preset("tiny", page_codec="fp8")


# ---- the attention kernel over fp8 pages ---------------------------------------------------------------------
def fp8_case(seed, *, lens, ng=2, g=1, r=4, d=32, page=8, slots=6, ring_pages=2, dtype=jnp.float32):
    """Random pages, each (b, group) attending up to `slots - ring_pages` pool pages (fp8 codes + scales, NaN in
    unreferenced frames and in the codes of skipped slots) and its last `ring_pages` pages from a ring in the
    queries' dtype (the second source, src 2). Returns the kernel's arguments and the decoded pool (float32)."""
    rng = np.random.default_rng(seed)
    b = len(lens)
    nf, nring = 40, b * ng * ring_pages + 3
    x = (rng.standard_normal((2, nf, page, g, d)) * rng.uniform(0.1, 8, (2, nf, 1, g, 1))).astype(np.float32)
    enc = Fp8Codec().encode(jnp.asarray(x[0]), jnp.asarray(x[1]), "float32")
    ring_k = jnp.asarray(rng.standard_normal((nring, page, g, d)), dtype)
    ring_v = jnp.asarray(rng.standard_normal((nring, page, g, d)), dtype)
    frame = rng.integers(-3, 3 * nf, (b, ng, slots)).astype(np.int32)   # garbage in skipped slots
    start = np.full((b, ng, slots), -1, np.int32)
    src = np.zeros((b, ng, slots), np.int32)
    host = np.full((b, ng, slots), -1, np.int32)
    perm, rperm = rng.permutation(nf), rng.permutation(nring)
    c = rc = 0
    for i, n in enumerate(lens):
        pages = -(-n // page)
        for grp in range(ng):
            order = rng.permutation(slots)
            for j, p in enumerate(range(pages)):
                s = order[j]
                start[i, grp, s] = p * page
                if p >= pages - ring_pages:                     # the newest pages: from the ring
                    src[i, grp, s], host[i, grp, s] = 2, rperm[rc]
                    rc += 1
                else:
                    src[i, grp, s], frame[i, grp, s] = 1, perm[c]
                    c += 1
    q = jnp.asarray(rng.standard_normal((b, 1, ng * g * r, d)), dtype)
    return dict(q=q, pool_k=enc.k, pool_v=enc.v, page_frame=jnp.asarray(frame), page_start=jnp.asarray(start),
                seq_len=jnp.asarray(np.asarray(lens, np.int32)), host_k=ring_k, host_v=ring_v,
                page_host=jnp.asarray(host), page_src=jnp.asarray(src), k_scale=enc.ks, v_scale=enc.vs)


def run_attn(case, **kw):
    c = dict(case)
    return sda.sparse_decode_attention(c.pop("q"), c.pop("pool_k"), c.pop("pool_v"), c.pop("page_frame"),
                                       c.pop("page_start"), c.pop("seq_len"), **c, **kw)


@pytest.mark.parametrize("lens,g", [((33, 1, 16), 1), ((40, 9), 2)])
def test_kernel_reads_fp8_pages_like_its_reference(lens, g):
    case = fp8_case(3, lens=lens, g=g, slots=6)
    ref = run_attn(case, impl="ref")
    out = run_attn(case, impl="pallas")                      # interpret mode on CPU
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
    # and the reference with scales is attention over the decoded pages (unscaled)
    k, v = Fp8Codec().decode(Pages(case["pool_k"], case["pool_v"], case["k_scale"], case["v_scale"]), jnp.float32)
    plain = run_attn(dict(case, pool_k=k, pool_v=v, k_scale=None, v_scale=None), impl="ref")
    np.testing.assert_allclose(np.asarray(ref), np.asarray(plain), rtol=1e-5, atol=1e-5)


def test_kernel_refuses_bad_scales():
    case = fp8_case(4, lens=(20,))
    with pytest.raises(ValueError, match=r"\[F, 1, g, 1\]"):
        run_attn(dict(case, k_scale=case["k_scale"][:, 0]), impl="ref")
    with pytest.raises(ValueError, match="go together"):
        run_attn(dict(case, v_scale=None), impl="ref")
    with pytest.raises(ValueError, match="mosaic"):
        run_attn(case, impl="mosaic")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("g", [1, 2])
def test_kernel_compiled_reads_fp8_pages_like_its_reference(g):
    """Compiled (Triton) on the GPU, bf16 queries and ring, fp8 pool: the dequantisation in registers lowers and
    matches the reference within bf16's rounding of P before P @ V."""
    case = fp8_case(5, lens=(200, 64, 1), g=g, d=128, page=64, slots=8, dtype=jnp.bfloat16)
    ref = np.asarray(run_attn(case, impl="ref"), np.float32)
    out = np.asarray(run_attn(case, impl="pallas"), np.float32)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1.5e-2


def test_cost_model_counts_the_page_format_bytes():
    """The cost model reads a stored K/V element at the page format's bytes (CacheConfig.page_bytes per element):
    fp8 halves dense's cache and sparse's PCIe bytes; the weights stay at the model's dtype."""
    from ulacache_jax.models import get_preset
    from ulacache_jax.runtime.cost_model import CostModel
    mc, cm = get_preset("llama-3.1-8b"), CostModel()
    fp8 = CacheConfig.preset("llama-3.1-8b", kv_dtype="float8_e4m3fn")
    isz = fp8.page_bytes / (fp8.page_size * fp8.kv_heads_per_group * fp8.head_dim)
    assert 1 < isz < 1.001
    shape = dict(batch=8, context=2**17, token_budget=2048, page_size=64, itemsize=2)
    w = cm.weight_bytes(mc, 2)
    kv16 = cm.dense_hbm_bytes(mc, max_seqs=8, max_context=2**17, itemsize=2) - w
    kv8 = cm.dense_hbm_bytes(mc, max_seqs=8, max_context=2**17, itemsize=2, kv_itemsize=isz) - w
    assert kv8 == pytest.approx(kv16 * isz / 2)
    s16, s8 = cm.step_terms("sparse", mc, **shape), cm.step_terms("sparse", mc, kv_itemsize=isz, **shape)
    assert s8["pcie"] == pytest.approx(s16["pcie"] * isz / 2)
    assert cm.tokens_per_s("dense", mc, kv_itemsize=isz, **shape) > cm.tokens_per_s("dense", mc, **shape)
