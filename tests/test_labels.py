"""Label channels (CacheConfig.label_bits, select/labels.py; issue 48): whole rotary pairs, int8 / int4 codes with a
scale per page and channel, scored by the page-lse kernel that dequantises in registers.

Checked against references written from the raw keys: the codes a cache holds after ingest + decode steps (and
flushes) dequantise to each flushed token's key at its sequence's pair channels within half a quantisation step;
the channels are whole pairs of largest key energy over the first block, or an offline table's, kept for life and
restored on release; the kernel equals its jnp reference on random and adversarial codes (all-zero channels, the
extreme codes); generate with a covering budget gives dense's tokens at 8 and 4 bits."""
import dataclasses
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.select import labels
from ulacache_jax.pallas_kernels import page_lse as pk
from cache_steps import assert_covering_budget_equals_dense, copied, ingest_and_decode, jitted_flush, tiny_model

PAGE, C, D = 8, 4, 16


def test_config_checks_and_footprint():
    base = CacheConfig.preset("tiny", key_channels=8)
    c8 = CacheConfig.preset("tiny", key_channels=8, label_bits=8)
    c4 = CacheConfig.preset("tiny", key_channels=8, label_bits=4)
    assert (base.rule, c8.rule, c4.rule) == ("key_copy", "labels", "labels")
    assert c4.footprint()["key_copy"] < c8.footprint()["key_copy"] < base.footprint()["key_copy"]
    for bad, msg in ((dict(label_bits=2), r"label_bits = 2 must be 0, 4 or 8"),
                     (dict(key_channels=3, label_bits=8), r"even key_channels >= 2 .* it is 3"),
                     (dict(key_channels=0, label_bits=8), r"even key_channels >= 2 .* it is 0"),
                     (dict(key_channels=4, channel_table=((0, 1, 8, 9),)), r"channel_table .* needs label_bits"),
                     (dict(key_channels=4, label_bits=8, channel_table=[[[0, 1, 8, 9]]]), r"channel_table shape")):
        with pytest.raises(ValueError, match=msg):
            CacheConfig.preset("tiny", **bad)


def test_quantize_roundtrip_and_adversarial_values():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, PAGE, 2, 6)).astype(np.float32) * rng.uniform(0.01, 30, 6).astype(np.float32)
    x[1, :, :, 2] = 0.0                                        # an all-zero channel: scale 0, codes 0, value 0
    x[2, 0, 0, 0] = 1e4                                        # one outlier sets its page-channel's scale
    for bits in (8, 4):
        codes, scale = labels.quantize(jnp.asarray(x), bits)
        assert codes.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
        assert codes.shape == (3, PAGE, 2, 6 if bits == 8 else 3) and scale.shape == (3, 2, 6)
        back = np.asarray(labels.dequantize(codes, scale, bits))
        step = np.asarray(scale, np.float32)[:, None]                                   # [3, 1, 2, 6]
        # half a step of rounding, plus the bf16 scale's relative error (2^-8) on the largest code
        assert (np.abs(back - x) <= step * (0.5 + labels.QMAX[bits] * 2 ** -8) + 1e-6).all()
        assert (back[1, :, :, 2] == 0).all()
        np.testing.assert_array_equal(np.asarray(pk.ref_dequant(codes, scale, bits)), back)


def test_huge_keys_saturate_and_stay_finite_on_the_tensor_cores():
    """A 4-bit page channel whose keys pass 57,000 gets the largest scale (labels.SCALE_MAX4): its values saturate
    at +-7 x 8192 instead of overflowing float16 in the tensor-core kernel, which stays finite and equal to its
    reference; 8-bit labels keep the exact scale."""
    x = np.zeros((4, 16, 1, 32), np.float32)                                        # [P, T, g, C]
    x[:, :, :, :] = np.random.default_rng(1).standard_normal(x.shape)
    x[1, 3, 0, 5] = 1e6
    codes, scale = labels.quantize(jnp.asarray(x), 4)
    assert float(scale[1, 0, 5]) == labels.SCALE_MAX4 and float(scale[0, 0, 5]) < 1.0
    assert float(labels.quantize(jnp.asarray(x), 8)[1][1, 0, 5]) > 7000.0
    back = np.asarray(labels.dequantize(codes, scale, 4))
    assert back[1, 3, 0, 5] == 7 * labels.SCALE_MAX4
    kc, sc = codes[None, None, None], scale[None, None, None]                      # S = L = G = 1
    q = jnp.asarray(np.random.default_rng(2).standard_normal((1, 1, 1, 4, 32)) * 1e-3, jnp.float32)
    got = np.asarray(pk.label_lse_mma(kc, q, layer=0, scale=sc, interpret=True))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, pk.ref_page_lse(kc, q, layer=0, scale=sc, bits=4, f16_queries=True),
                               rtol=1e-5, atol=1e-4)


def test_pair_channels_keep_whole_rotary_pairs():
    score = jnp.asarray([[0, 5, 1, 0, 0, 0, 4, 0],              # pairs (d, d+4): 0, 5, 5, 0 -> tie: pair 1 first
                         [9, 0, 0, 0, 0, 0, 0, 1]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(labels.pair_channels(score, 2)), [[1, 5], [0, 4]])
    np.testing.assert_array_equal(np.asarray(labels.pair_channels(score, 4)), [[1, 2, 5, 6], [0, 3, 4, 7]])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("g,H", [(1, 3), (2, 2)])
def test_kernel_equals_reference(bits, g, H):
    """The Pallas kernel (interpret mode here, compiled in the GPU test) against the jnp reference: random codes
    including the extreme ones, zero scales, every layer index."""
    rng = np.random.default_rng(bits + g)
    S, L, G, P, T, Cc = 2, 3, 2, 8, PAGE, 8
    cs = Cc if bits == 8 else Cc // 2
    if bits == 8:
        codes = jnp.asarray(rng.integers(-127, 128, (S, L, G, P, T, g, cs)), jnp.int8)
    else:
        codes = jnp.asarray(rng.integers(0, 256, (S, L, G, P, T, g, cs)), jnp.uint8)
    scale = rng.uniform(0, 0.3, (S, L, G, P, g, Cc)).astype(np.float32)
    scale[0, :, 0, 3] = 0.0
    scale = jnp.asarray(scale, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((S, G, g, H, Cc)), jnp.float32)
    for layer in range(L):
        want = pk.ref_page_lse(codes, q, layer=layer, scale=scale, bits=bits)
        for bp in (None, 4):
            got = pk.page_lse_pallas(codes, q, layer=layer, interpret=True, scale=scale, bits=bits, block_pages=bp)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_codes_become_floats_by_bits_exactly():
    """small_ints (the kernel's int-to-float by bits): every byte value, both nibbles and the int8 codes, equal
    the converted values exactly."""
    b = jnp.arange(256, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(pk.small_ints(b & 15, 8.0)), np.arange(256) % 16 - 8.0)
    np.testing.assert_array_equal(np.asarray(pk.small_ints(b >> 4, 8.0)), np.arange(256) // 16 - 8.0)
    i8 = jnp.arange(-128, 128, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(pk.small_ints(i8 + 128, 128.0)), np.arange(-128, 128, dtype=np.float32))


@pytest.mark.parametrize("bits", [8, 4])
def test_every_layers_scales_read_in_place(bits):
    """The cache passes every layer's scales [S, L, G, P, g, C] (the kernel indexes the layer: no per-layer slice
    is copied out); each layer's lse is the one of that layer's codes at that layer's scales (the labels dequantised
    by hand), and any other scale shape, one layer's included, is refused by name."""
    rng = np.random.default_rng(7 + bits)
    S, L, G, P, T, g, Cc, H = 1, 3, 2, 8, 16, 1, 32, 4
    cs = Cc if bits == 8 else Cc // 2
    codes = jnp.asarray(rng.integers(-127 if bits == 8 else 0, 128 if bits == 8 else 256, (S, L, G, P, T, g, cs)),
                        jnp.int8 if bits == 8 else jnp.uint8)
    scale = jnp.asarray(rng.uniform(0, 0.3, (S, L, G, P, g, Cc)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((S, G, g, H, Cc)), jnp.float32)
    for layer in range(L):
        k = pk.ref_dequant(codes[:, layer], scale[:, layer], bits)                      # [S, G, P, T, g, C]
        want = jax.nn.logsumexp(jnp.einsum("sjptic,sjihc->sjihpt", k, q, precision="highest"), axis=-1)
        want = want.reshape(S, G, g * H, P)
        np.testing.assert_allclose(pk.ref_page_lse(codes, q, layer=layer, scale=scale, bits=bits), want, rtol=1e-6)
        got = pk.page_lse_pallas(codes, q, layer=layer, interpret=True, scale=scale, bits=bits, block_pages=4)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for bad in (scale[:, :, :, :4], scale[:, 0]):
        with pytest.raises(ValueError, match=r"label scales of shape .* must be every layer's"):
            pk.page_lse_pallas(codes, q, layer=0, interpret=True, scale=bad, bits=bits)
    with pytest.raises(ValueError, match="label scales of shape None"):
        pk.page_lse(codes, q, layer=0, bits=bits)


def adversarial_labels(rng, bits, S, L, G, P, T, g, Cc, H):
    """Codes, bf16 scales and queries with the hard cases of a page-lse: a page of zero codes and zero scales (every
    logit 0: lse = log T), a page of the extreme codes (+-7 / +-127) at a large scale, one very large query row."""
    cs = Cc if bits == 8 else Cc // 2
    top = labels.QMAX[bits]
    if bits == 8:
        codes = rng.integers(-127, 128, (S, L, G, P, T, g, cs)).astype(np.int8)
        codes[:, :, :, 0] = 0
        codes[:, :, :, 1] = np.where(np.arange(T)[:, None, None] % 2, top, -top)
    else:
        codes = rng.integers(0, 256, (S, L, G, P, T, g, cs)).astype(np.uint8)
        codes[:, :, :, 0] = 8 | 8 << 4                                                # both nibbles hold 0
        hi, lo = (top + 8) | (top + 8) << 4, (8 - top) | (8 - top) << 4                # +7 / -7 in both nibbles
        codes[:, :, :, 1] = np.where(np.arange(T)[:, None, None] % 2, hi, lo)
    scale = rng.uniform(0, 0.3, (S, L, G, P, g, Cc)).astype(np.float32)
    scale[:, :, :, 0] = 0.0
    scale[:, :, :, 1] = 16.0
    q = rng.standard_normal((S, G, g, H, Cc)).astype(np.float32)
    q[:, :, :, 0] *= 100.0
    return jnp.asarray(codes), jnp.asarray(scale, jnp.bfloat16), jnp.asarray(q)


@pytest.mark.parametrize("bits", [8, 4])
def test_spanning_programs_equal_reference(bits):
    """pages_per_program (one program loops over several blocks of pages): every span from one block to all the
    pages equals the reference on random and adversarial labels, at every layer; a span that is not a multiple of
    the block or does not divide the page count is refused by name."""
    rng = np.random.default_rng(20 + bits)
    S, L, G, P, T, g, Cc, H = 1, 2, 2, 16, PAGE, 1, 8, 3
    codes, scale, q = adversarial_labels(rng, bits, S, L, G, P, T, g, Cc, H)
    for layer in range(L):
        want = np.asarray(pk.ref_page_lse(codes, q, layer=layer, scale=scale, bits=bits))
        np.testing.assert_allclose(want[..., 0], np.log(T), rtol=1e-6)                 # the zero page
        for bp, span in ((2, 2), (2, 4), (2, 8), (4, P), (1, P)):
            got = pk.page_lse_pallas(codes, q, layer=layer, interpret=True, scale=scale, bits=bits,
                                     block_pages=bp, pages_per_program=span)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    for bp, span in ((2, 6), (4, 2), (2, 32), (2, 0)):
        with pytest.raises(ValueError, match=rf"pages_per_program = {span} must be a multiple of block_pages = "
                                             rf"{bp} dividing the page count {P}"):
            pk.page_lse_pallas(codes, q, layer=0, interpret=True, scale=scale, bits=bits, block_pages=bp,
                               pages_per_program=span)


@pytest.mark.parametrize("bits", [8, 4])
def test_spanning_programs_lower_to_triton(bits):
    """The 8B shape's label kernel (the default launch, spans of 16 blocks and of all 2048 pages) lowers to one
    Triton call for an H200 without a GPU (test_gpu_lowering's abstract device): the
    in-kernel loop over blocks, its dynamic page slices and the bit casts are Triton-lowerable. Triton's compile to
    PTX runs only on the GPU."""
    from test_gpu_lowering import TRITON_CALL, lower_for_h200, spec
    S, L, G, P, T, g, H, Cc = 3, 2, 8, 2048, 64, 1, 4, 64
    cs = Cc if bits == 8 else Cc // 2
    args = (spec((S, L, G, P, T, g, cs), jnp.int8 if bits == 8 else jnp.uint8),
            spec((S, L, G, P, g, Cc), jnp.bfloat16), spec((S, G, g, H, Cc), jnp.float32))
    try:
        for bp, span in ((None, None), (4, 64), (4, P)):
            txt = lower_for_h200(lambda c, sc, q: pk.page_lse_pallas(
                c, q, layer=1, scale=sc, bits=bits, block_pages=bp, pages_per_program=span), *args)
            assert txt.count(TRITON_CALL) == 1
    finally:
        jax.clear_caches()      # the GPU traces (interpret=False) must not be reused by a CPU test


def exact_bound(codes, scale, q, layer):
    """The largest logit change 11-bit queries can make: 2^-10 x max over tokens of sum_c |k_c q_c|, per (s, group,
    row, page) [S, G, g * H, P]: the tensor-core kernel's lse stays within it of the exact lse."""
    k = jnp.abs(pk.ref_dequant(codes[:, layer], scale[:, layer], 4))                   # [S, G, P, T, g, C]
    mag = jnp.einsum("sjptic,sjihc->sjihpt", k, jnp.abs(q), precision="highest").max(-1)
    return np.asarray(mag.reshape(q.shape[0], q.shape[1], -1, k.shape[2])) * 2.0 ** -10


@pytest.mark.parametrize("g,H,T,span", [(1, 4, 16, None), (2, 3, 16, 4), (1, 20, 32, 2), (1, 1, 16, 16)])
def test_tensor_core_kernel_equals_its_reference(g, H, T, span):
    """label_lse_mma (interpret mode here, compiled in the GPU test): equal to ref_page_lse(f16_queries=True), its
    arithmetic, on random and adversarial labels at every layer and row count (pages side by side in the dot's
    columns at 1, 3 and 4 rows, one page a dot at 20), and within the 11-bit queries' bound of the exact lse."""
    rng = np.random.default_rng(g * 100 + H)
    S, L, G, P, Cc = 2, 2, 2, 16, 32
    for adv in (False, True):
        if adv:
            codes, scale, q = adversarial_labels(rng, 4, S, L, G, P, T, g, Cc, H)
        else:
            codes = jnp.asarray(rng.integers(0, 256, (S, L, G, P, T, g, Cc // 2)), jnp.uint8)
            scale = jnp.asarray(rng.uniform(0, 0.3, (S, L, G, P, g, Cc)), jnp.bfloat16)
            q = jnp.asarray(rng.standard_normal((S, G, g, H, Cc)), jnp.float32)
        for layer in range(L):
            got = np.asarray(pk.label_lse_mma(codes, q, layer=layer, scale=scale, interpret=True,
                                              pages_per_program=span))
            want = pk.ref_page_lse(codes, q, layer=layer, scale=scale, bits=4, f16_queries=True)
            np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-4)
            exact = np.asarray(pk.ref_page_lse(codes, q, layer=layer, scale=scale, bits=4))
            assert np.all(np.abs(got - exact) <= exact_bound(codes, scale, q, layer) + 1e-4)


def test_four_bit_labels_score_alike_on_every_path():
    """page_lse truncates 4-bit labels' queries on every path: the reference, the tensor-core kernel (taken where
    mma_fits) and the label kernel (a page of 8 tokens: Triton's dot needs 16) agree; 8-bit labels keep float32
    queries. Launches the tensor-core kernel cannot make are refused by name."""
    rng = np.random.default_rng(3)
    for T in (16, 8):
        codes = jnp.asarray(rng.integers(0, 256, (1, 2, 2, 8, T, 1, 16)), jnp.uint8)
        scale = jnp.asarray(rng.uniform(0, 0.3, (1, 2, 2, 8, 1, 32)), jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((1, 2, 1, 4, 32)) * 3, jnp.float32)
        assert pk.mma_fits(codes, q, 4) == (T == 16)
        ref = np.asarray(pk.page_lse(codes, q, layer=1, scale=scale, bits=4, impl="ref"))
        got = np.asarray(pk.page_lse(codes, q, layer=1, scale=scale, bits=4, impl="pallas"))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ref, pk.ref_page_lse(codes, q, layer=1, scale=scale, bits=4, f16_queries=True),
                                   rtol=1e-6)
        assert not np.allclose(ref, pk.ref_page_lse(codes, q, layer=1, scale=scale, bits=4), rtol=1e-7, atol=0)
    with pytest.raises(ValueError, match="page size and C / 2 code bytes of at least 16"):
        pk.label_lse_mma(codes, q, layer=0, scale=scale, interpret=True)
    codes16 = jnp.zeros((1, 2, 2, 8, 16, 1, 16), jnp.uint8)
    with pytest.raises(ValueError, match="pages_per_program = 6 must be a multiple of 4 pages dividing"):
        pk.label_lse_mma(codes16, q, layer=0, scale=scale, interpret=True, pages_per_program=6)
    assert pk.mma_span(8, 4) == 8 and pk.mma_span(2048, 4) == pk.MMA_SPAN and pk.mma_span(6, 4) is None


def test_tensor_core_kernel_lowers_to_triton():
    """At the 8B shape (C = 32 of 128 channels, 4 query rows, 2048 pages) the tensor-core kernel, its inline PTX
    unpacking included, lowers to one Triton call for an H200 without a GPU; Triton's PTX compile runs on the GPU
    (the GPU test)."""
    from test_gpu_lowering import TRITON_CALL, lower_for_h200, spec
    S, L, G, P, T, g, H, Cc = 3, 2, 8, 2048, 64, 1, 4, 32
    args = (spec((S, L, G, P, T, g, Cc // 2), jnp.uint8), spec((S, L, G, P, g, Cc), jnp.bfloat16),
            spec((S, G, g, H, Cc), jnp.float32))
    try:
        txt = lower_for_h200(lambda c, sc, q: pk.label_lse_mma(c, q, layer=1, scale=sc), *args)
        assert txt.count(TRITON_CALL) == 1
    finally:
        jax.clear_caches()


def label_config(bits, *, table=None, seqs=3):
    return CacheConfig(num_layers=2, num_kv_heads=2, head_dim=D, max_seqs=seqs, max_pages_per_seq=32,
                       page_size=PAGE, num_buckets=4, slots_per_bucket=8, host_pages=512, token_budget=32,
                       dtype="float32", sink_pages=1, recent_pages=1, key_channels=C, label_bits=bits,
                       channel_table=table)


def build(bits, *, table=None, lengths=(37, 61, 8), steps=13):
    c = label_config(bits, table=table, seqs=len(lengths))
    rng = np.random.default_rng(1)
    _, state, host, ks = ingest_and_decode(c, list(lengths), steps, rng, qpk=2,
                                           key_scale=rng.uniform(0.2, 3.0, D).astype(np.float32))
    return c, state, ks, list(lengths)


def test_flush_writes_the_labels_in_place():
    """A flush scatters the completed pages' codes and scales into the cache's [R, ...] arrays where they lie: the
    compiled flush (state donated) copies neither array. Slicing the rank axis out and adding it back made XLA copy
    every layer's codes twice a flush (at the 8B shape, 128K x 3: 3.2 GB of codes, a transient the size of the copy)."""
    m, state, host, _ = ingest_and_decode(label_config(4), [37, 61, 8], 1, np.random.default_rng(1))
    txt = jitted_flush(m).lower(state, host).compile().as_text()
    assert copied(txt, [state.sel.kc, state.sel.ksc]) == []


@pytest.mark.parametrize("bits", [8, 4])
def test_cache_holds_every_flushed_key_as_labels_of_the_first_blocks_pairs(bits):
    c, state, ks, lengths = build(bits)
    assert state.sel.ksc.shape == (1, 3, 2, 2, 32, 1, C) and state.sel.kc.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    for s, (k, n0) in enumerate(zip(ks, lengths)):
        fl = int(state.seqs.flushed[s])
        for l in range(2):
            for gi in range(2):
                kb = k[l, :n0, gi]                                                     # the first block's keys
                energy = (kb ** 2).sum(0)
                pair = energy[:D // 2] + energy[D // 2:]
                top = np.argsort(-pair, kind="stable")[:C // 2]
                want_ch = np.sort(np.concatenate([top, top + D // 2]))
                ch = np.asarray(state.sel.chan[0, s, l, gi, 0])
                assert ch.tolist() == want_ch.tolist()
                got = np.asarray(labels.dequantize(state.sel.kc[0, s, l, gi, :fl], state.sel.ksc[0, s, l, gi, :fl], bits))
                want = k[l, :fl * PAGE, gi][:, ch].reshape(fl, PAGE, 1, C)
                step = np.asarray(state.sel.ksc[0, s, l, gi, :fl], np.float32)[:, None]
                assert (np.abs(got - want) <= step * (0.5 + labels.QMAX[bits] * 2 ** -8) + 1e-5).all()


def test_offline_table_fixes_the_channels_for_life():
    from ulacache_jax.runtime.sequences import release_device
    table = [[[1, 3, 9, 11], [0, 2, 8, 10]], [[5, 6, 13, 14], [4, 7, 12, 15]]]       # [L][KV][C]
    c, state, ks, lengths = build(8, table=table)
    for s in range(len(lengths)):
        np.testing.assert_array_equal(np.asarray(state.sel.chan[0, s, :, :, 0]), np.asarray(table))
    st = release_device(state, 1)
    np.testing.assert_array_equal(np.asarray(st.sel.chan[0, 1, :, :, 0]), np.asarray(table))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("bits", [pytest.param(8, marks=pytest.mark.slow), 4])   # 4: the default
def test_generate_covering_budget_equals_dense(model, bits):
    assert_covering_budget_equals_dense(model, key_channels=8, label_bits=bits)


@pytest.mark.gpu
def test_on_the_gpu_kernel_equals_reference():
    """Compiled on the GPU: the label kernel (codes to floats by bits) at the 8B shape's group (g = 1, 4 query rows,
    C = 16, page 64), on random labels and on adversarial ones at C = 64; the tensor-core kernel (inline PTX) at
    C = 32 and 64, random and adversarial, and page_lse taking it."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(0)
    S, L, G, P, T, g, H, Cc = 2, 2, 8, 256, 64, 1, 4, 16
    for bits in (8, 4):
        cs = Cc if bits == 8 else Cc // 2
        codes = jnp.asarray(rng.integers(-127 if bits == 8 else 0, 128 if bits == 8 else 256,
                                         (S, L, G, P, T, g, cs)), jnp.int8 if bits == 8 else jnp.uint8)
        scale = jnp.asarray(rng.uniform(0, 0.1, (S, L, G, P, g, Cc)), jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((S, G, g, H, Cc)), jnp.float32)
        want = pk.ref_page_lse(codes, q, layer=1, scale=scale, bits=bits)
        got = pk.page_lse_pallas(codes, q, layer=1, scale=scale, bits=bits)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    for bits in (8, 4):   # adversarial labels at the 8B shape's channels (C = 64), the default launch
        codes, scale, q = adversarial_labels(rng, bits, S, L, G, P, T, g, 64, H)
        want = pk.ref_page_lse(codes, q, layer=1, scale=scale, bits=bits)
        got = pk.page_lse_pallas(codes, q, layer=1, scale=scale, bits=bits)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    for adv in (False, True):   # the tensor-core kernel (4 bits, C = 32 and 64), against its arithmetic's reference
        for Cc in (32, 64):
            if adv:
                codes, scale, q = adversarial_labels(rng, 4, S, L, G, P, T, g, Cc, H)
            else:
                codes = jnp.asarray(rng.integers(0, 256, (S, L, G, P, T, g, Cc // 2)), jnp.uint8)
                scale = jnp.asarray(rng.uniform(0, 0.1, (S, L, G, P, g, Cc)), jnp.bfloat16)
                q = jnp.asarray(rng.standard_normal((S, G, g, H, Cc)), jnp.float32)
            want = pk.ref_page_lse(codes, q, layer=1, scale=scale, bits=4, f16_queries=True)
            got = np.asarray(pk.label_lse_mma(codes, q, layer=1, scale=scale))
            np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(np.asarray(pk.page_lse(codes, q, layer=1, scale=scale, bits=4)), got,
                                       rtol=1e-6, atol=1e-6)


def test_offline_calibration_writes_a_table_the_lookup_finds(tmp_path):
    """scripts/calibrate_labels.py (tiny model): the table holds whole pairs per layer and KV head, named by the
    digest; models.calibration finds a GGUF's table by the file's sha256 and names the Cs it has; every channel
    (C = the head dim) is the identity table."""
    import json
    from scripts import calibrate_labels
    from ulacache_jax.models import calibration
    assert calibrate_labels.main(["--tiny", "--windows", "1", "--tokens", "32", "--channels", "4",
                                  "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "tiny-random-seed.json").read_text())
    tab = np.asarray(data["channels"]["4"])                                            # [L, KV, C]
    D = len(data["score"][0][0])
    assert tab.shape[2] == 4 and ((tab[..., :2] + D // 2) == tab[..., 2:]).all()       # pairs (d, d + D/2)
    score = np.asarray(data["score"])
    pair = score[..., :D // 2] + score[..., D // 2:]
    assert (np.sort(pair, -1)[..., -2:].sum(-1) <= np.take_along_axis(pair, tab[..., :2], -1).sum(-1) + 1e-6).all()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF fake model bytes")
    digest = calibration.file_digest(gguf)
    (tmp_path / f"{digest[:16]}.json").write_text(json.dumps(dict(data, model_digest=digest)))
    assert calibration.channel_table(str(gguf), 4, folder=tmp_path) == data["channels"]["4"]
    with pytest.raises(ValueError, match=r"tables for C = \[4\], not 8"):
        calibration.channel_table(str(gguf), 8, folder=tmp_path)
    every = calibration.channel_table(str(gguf), D, folder=tmp_path)                  # C = D: the identity
    assert np.asarray(every).shape == tab.shape[:2] + (D,) and (np.asarray(every) == np.arange(D)).all()
    assert calibration.channel_table(str(tmp_path / "missing.gguf"), 4, folder=tmp_path) is None


def test_shipped_tables_belong_to_a_preset_and_follow_their_own_scores():
    """Every table shipped in ulacache_jax/models/calibration is named by a pretrained preset's pinned sha256 (so the
    preset finds it without hashing its file), and each of its channel lists is exactly select/labels.pair_channels of
    the table's own recorded scores: whole rotary pairs, C / 2 of the largest pair score, per layer and KV head."""
    import json
    import jax.numpy as jnp
    from ulacache_jax.cache.select.labels import pair_channels
    from ulacache_jax.models import calibration
    from ulacache_jax.models.pretrained import PRETRAINED
    pinned = {getattr(m, "sha256", None): name for name, m in PRETRAINED.items()}
    files = sorted(calibration.FOLDER.glob("*.json"))
    assert len(files) >= 2
    for f in files:
        data = json.loads(f.read_text())
        assert f.stem == data["model_digest"][:16] and pinned.get(data["model_digest"]) == data["model"], f.name
        score = jnp.asarray(data["score"], jnp.float32)                                  # [L, KV, D]
        for c, tab in data["channels"].items():
            assert np.asarray(tab).shape == (*score.shape[:2], int(c)), (f.name, c)
            np.testing.assert_array_equal(np.asarray(tab), np.asarray(pair_channels(score, int(c))), err_msg=f.name)


@pytest.mark.parametrize("bits", [pytest.param(8, marks=pytest.mark.slow), 4])   # 4: the default
def test_offline_table_shares_prefixes(model, bits):
    """With an offline channel table the channels are fixed, so shared prefixes are allowed: an attached prefix holds
    the labels (codes and scales) the ingesting slot wrote, and the Engine's tokens with the prefix cache on equal
    those with it off (budget 4 pages of 16: pages are selected)."""
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    table = (((0, 1, 8, 9), (2, 3, 10, 11)), ((4, 5, 12, 13), (6, 7, 14, 15)))       # [L][KV][C], whole pairs
    rng = np.random.default_rng(5)
    doc = [int(t) for t in rng.integers(0, 256, 100)]
    prompts = [doc + [int(t) for t in rng.integers(0, 256, n)] for n in (5, 23)]
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=192, page_size=16, token_budget=64,
                               key_channels=4, label_bits=bits, channel_table=table)
    gen = Generator(model, cfg, attention="sparse")
    gen.set_prefix_cache(True)
    a, b = prompts
    sa = gen.admit(len(a) + 8, a)
    gen.prefill(sa, a)
    sb = gen.admit(len(b) + 8, b)
    gen.prefill(sb, b)
    assert gen.prefix_stats().hit_tokens == 6 * 16
    sel = gen.cache.state.sel
    for x in (sel.kc, sel.ksc):
        np.testing.assert_array_equal(np.asarray(x[:, sb, :, :, :6]), np.asarray(x[:, sa, :, :, :6]))
        assert np.asarray(x[:, sb, :, :, :6]).any()
    params = SamplingParams(max_new_tokens=12)
    outs = [[r.tokens for r in Engine(generator=Generator(model, cfg, attention="sparse"), prefix_cache=on)
             .run(prompts, params)] for on in (False, True)]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("window, hits", [(32, 6 * 16), (192, 0)])
def test_online_channels_share_prefixes_that_cover_their_window(model, window, hits):
    """Online channels come from a prompt's first `window` tokens: a shared prefix covering them (96 tokens >= 32)
    is attached, its channels picked from the attached keys as the owner's were from its own (the same tokens), so
    the sharer's channels, labels and tokens are those of a run without sharing; a shorter prefix (96 < 192) is
    prefilled instead."""
    from ulacache_jax.cache.select.labels import Labels
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    rng = np.random.default_rng(5)
    doc = [int(t) for t in rng.integers(0, 256, 100)]
    a, b = [doc + [int(t) for t in rng.integers(0, 256, n)] for n in (5, 23)]
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=192, page_size=16, token_budget=64,
                               key_channels=0, selection=Labels(channels=4, bits=4, window=window))
    assert cfg.selection_rule.calibration_tokens(cfg) == window
    gens = []
    for share in (True, False):
        gen = Generator(model, cfg, attention="sparse")
        gen.set_prefix_cache(share)
        for p in (a, b):
            gen.prefill(gen.admit(len(p) + 8, p), p)
        gens.append(gen)
    assert gens[0].prefix_stats().hit_tokens == hits
    on, off = (g.cache.state.sel for g in gens)
    np.testing.assert_array_equal(np.asarray(on.chan), np.asarray(off.chan))
    np.testing.assert_array_equal(np.asarray(on.chan[:, 0]), np.asarray(on.chan[:, 1]))   # same first 32 tokens
    for x, y in ((on.kc, off.kc), (on.ksc, off.ksc)):
        np.testing.assert_array_equal(np.asarray(x[:, :, :, :, :7]), np.asarray(y[:, :, :, :, :7]))
    if hits:
        params = SamplingParams(max_new_tokens=12)
        outs = [[r.tokens for r in Engine(generator=Generator(model, cfg, attention="sparse"), prefix_cache=on)
                 .run([a, b], params)] for on in (False, True)]
        assert outs[0] == outs[1]


def test_default_config_finds_the_shipped_table_by_the_weights_digest():
    """The default rule with a model whose config names its weights file (ModelConfig.file_sha256, set by
    from_pretrained for a preset): the table shipped for that file at the default C, its rows repeated where KV heads
    were replicated for TP; no digest, or one without a table: online channels. A bad digest is refused."""
    from ulacache_jax.models import ModelConfig, calibration
    from ulacache_jax.models.pretrained import PRETRAINED
    from ulacache_jax.runtime.generation import default_cache_config
    sha = PRETRAINED["smollm2-135m"].sha256
    mc = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64, file_sha256=sha)     # SmolLM2-135M's shapes
    want = calibration.channel_table("smollm2-135m", 32)
    cfg = default_cache_config(mc, num_seqs=1, max_tokens=512)
    assert (cfg.rule, cfg.key_channels, cfg.label_bits) == ("labels", 32, 4)
    assert np.asarray(cfg.channel_table).tolist() == want and cfg.selection_rule.calibration_tokens(cfg) == 0
    rep = default_cache_config(mc.replace(num_heads=18, num_kv_heads=6), num_seqs=1, max_tokens=512)
    assert np.asarray(rep.channel_table)[:, ::2].tolist() == want == np.asarray(rep.channel_table)[:, 1::2].tolist()
    for other in (None, "0" * 64):
        assert default_cache_config(mc.replace(file_sha256=other), num_seqs=1, max_tokens=512).channel_table is None
    assert default_cache_config(mc, num_seqs=1, max_tokens=512, key_channels=0).rule == "quest"
    assert ModelConfig.from_dict(mc.to_dict()) == mc
    with pytest.raises(ValueError, match="file_sha256"):
        mc.replace(file_sha256="abc")
