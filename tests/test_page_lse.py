"""The key copy's page log-sum-exp kernel (pallas_kernels/page_lse.py) against its reference and numpy: random and
adversarial inputs (large logits, one dominant token, bf16 copies, rows that are not a power of two, other layers
holding garbage), every launch shape; interpret mode here, compiled under the gpu marker."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.pallas_kernels.page_lse import page_lse, page_lse_pallas, ref_page_lse


def np_lse(kc, qc, layer):
    """kc [S, L, G, P, T, g, C], qc [S, G, g, H, C] -> [S, G, g * H, P] in float64."""
    k = np.asarray(kc, np.float64)[:, layer]                                          # [S, G, P, T, g, C]
    logit = np.einsum("sjptic,sjihc->sjihpt", k, np.asarray(qc, np.float64))
    m = logit.max(-1, keepdims=True)
    out = (m + np.log(np.exp(logit - m).sum(-1, keepdims=True)))[..., 0]              # [S, G, g, H, P]
    S, G, g, H, P = out.shape
    return out.reshape(S, G, g * H, P)


@pytest.mark.parametrize("g,H,P,T,C,dtype", [
    (1, 3, 24, 16, 16, jnp.float32),      # SmolLM2's rows (3 query heads a KV head), a page count of 8-page blocks
    (1, 4, 8, 64, 32, jnp.bfloat16),      # the 8B shape's rows and page, copy in bf16
    (2, 6, 16, 16, 8, jnp.float32),       # two KV heads a group; 6 rows = 3 verification rows x 2 heads
])
def test_kernel_matches_reference_and_numpy(g, H, P, T, C, dtype):
    rng = np.random.default_rng(P + H)
    S, L, G = 2, 3, 2
    kc = jnp.asarray(rng.standard_normal((S, L, G, P, T, g, C)), dtype)
    kc = kc.at[0, 0].set(jnp.nan)                              # garbage in another layer must not leak
    qc = jnp.asarray(rng.standard_normal((S, G, g, H, C)) * 0.7, jnp.float32)
    for layer in (1, 2):
        got = np.asarray(page_lse(kc, qc, layer=layer, impl="pallas"))
        want = np.asarray(ref_page_lse(kc, qc, layer=layer))
        assert got.shape == (S, G, g * H, P)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(want, np_lse(jnp.asarray(kc, jnp.float32), qc, layer), rtol=1e-5, atol=1e-5)


def test_adversarial_logits_stay_finite_and_exact():
    """Logits up to +-1200 (exp overflows without the max shift), one dominant token a page, equal keys (ties)."""
    rng = np.random.default_rng(3)
    S, L, G, P, T, g, C, H = 1, 1, 1, 16, 16, 1, 16, 2
    kc = rng.standard_normal((S, L, G, P, T, g, C)).astype(np.float32)
    kc[0, 0, 0, 3, 5] = 40.0                                    # one token far above the rest of its page
    kc[0, 0, 0, 7] = 1.0                                        # a page of identical keys: lse = logit + log T
    qc = np.zeros((S, G, g, H, C), np.float32)
    qc[..., 0, :] = 1.875                                       # large logits: the 40s token reaches 1200
    qc[..., 1, :] = -qc[..., 0, :]                              # and their negatives
    got = np.asarray(page_lse(jnp.asarray(kc), jnp.asarray(qc), layer=0, impl="pallas"))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np_lse(kc, qc, 0), rtol=1e-5, atol=1e-4)
    same = float(kc[0, 0, 0, 7, 0, 0, :] @ qc[0, 0, 0, 0])
    np.testing.assert_allclose(got[0, 0, 0, 7], same + np.log(T), rtol=1e-6)


def test_launch_shapes_agree_and_bad_input_is_named():
    rng = np.random.default_rng(5)
    S, L, G, P, T, g, C, H = 2, 2, 2, 32, 16, 1, 16, 4
    kc = jnp.asarray(rng.standard_normal((S, L, G, P, T, g, C)), jnp.float32)
    qc = jnp.asarray(rng.standard_normal((S, G, g, H, C)), jnp.float32)
    want = np.asarray(ref_page_lse(kc, qc, layer=1))
    for bp in (1, 4, 32):
        got = page_lse_pallas(kc, qc, layer=1, interpret=True, block_pages=bp)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block_pages = 3"):
        page_lse_pallas(kc, qc, layer=1, interpret=True, block_pages=3)
    with pytest.raises(ValueError, match=r"qc shape \(2, 2, 1, 4, 8\)"):
        page_lse(kc, qc[..., :8], layer=1)
    # a copy of 12 channels cannot be a Triton block: the kernel refuses it, page_lse takes the reference
    k12, q12 = kc[..., :12], qc[..., :12]
    with pytest.raises(ValueError, match="copy channels = 12"):
        page_lse_pallas(k12, q12, layer=0, interpret=True)
    np.testing.assert_allclose(np.asarray(page_lse(k12, q12, layer=0, impl="pallas")),
                               np.asarray(ref_page_lse(k12, q12, layer=0)), rtol=1e-6)


def test_spanning_programs_over_the_key_copy():
    """pages_per_program on the key copy (bits 0): programs that loop over 2, 4 or all 8 blocks equal the
    one-block launch and the reference, large logits included; a span the page count cannot split is refused."""
    rng = np.random.default_rng(9)
    S, L, G, P, T, g, C, H = 2, 2, 1, 16, 16, 2, 8, 2
    kc = rng.standard_normal((S, L, G, P, T, g, C)).astype(np.float32)
    kc[:, 1, :, 5, 3] = 40.0                                    # one dominant token in a page
    kc, qc = jnp.asarray(kc), jnp.asarray(rng.standard_normal((S, G, g, H, C)) * 2, jnp.float32)
    want = np.asarray(ref_page_lse(kc, qc, layer=1))
    for span in (None, 4, 8, P):
        got = page_lse_pallas(kc, qc, layer=1, interpret=True, block_pages=2, pages_per_program=span)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="pages_per_program = 12 must be a multiple of block_pages = 2 dividing "
                                         "the page count 16"):
        page_lse_pallas(kc, qc, layer=1, interpret=True, block_pages=2, pages_per_program=12)


@pytest.mark.gpu
def test_compiled_kernel_on_the_gpu():
    """The compiled kernel (not interpret mode) at SmolLM2's and the 8B shape's rows, bf16 and float32 copies."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(11)
    for (P, T, C, H, dtype) in ((512, 16, 16, 3, jnp.float32), (2048, 64, 32, 4, jnp.bfloat16),
                                (2048, 64, 16, 20, jnp.bfloat16)):
        kc = jnp.asarray(rng.standard_normal((3, 2, 2, P, T, 1, C)), dtype)
        qc = jnp.asarray(rng.standard_normal((3, 2, 1, H, C)) * 0.5, jnp.float32)
        got = np.asarray(page_lse(kc, qc, layer=1))
        np.testing.assert_allclose(got, np.asarray(ref_page_lse(kc, qc, layer=1)), rtol=1e-4, atol=1e-4)
