import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax import selection
from ulacache_jax.pallas_kernels.page_scores import page_scores, ref_page_scores


@pytest.mark.parametrize("g,P,dtype", [(1, 24, jnp.float32), (2, 16, jnp.bfloat16), (1, 64, jnp.bfloat16)])
def test_kernel_matches_reference_and_quest_bound(g, P, dtype):
    rng = np.random.default_rng(P + g)
    S, L, G, D, r = 2, 3, 2, 16, 4
    k = rng.standard_normal((S, L, G, P, 8, g, D)).astype(np.float32)     # 8 tokens a page
    kmin, kmax = jnp.asarray(k.min(4), dtype), jnp.asarray(k.max(4), dtype)
    kmin = kmin.at[1, 0, 0, 3].set(jnp.nan)                               # garbage in another layer must not leak
    q = jnp.asarray(rng.standard_normal((S, 1, G * g * r, D)), jnp.float32)
    qpos, qneg = selection.fold_queries(q, G, g)
    for layer in (1, 2):
        got = page_scores(kmin, kmax, qpos, qneg, layer=layer, impl="pallas")
        want = ref_page_scores(kmin, kmax, qpos, qneg, layer=layer)
        tol = 1e-4 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
        # the reference is the Quest bound written the long way: sum_h sum_d max(q*kmin, q*kmax)
        qh = np.asarray(q).reshape(S, G, g, r, D)
        mn, mx = np.asarray(kmin[:, layer], np.float32), np.asarray(kmax[:, layer], np.float32)
        quest = np.maximum(qh[:, :, None] * mn[:, :, :, :, None], qh[:, :, None] * mx[:, :, :, :, None]).sum((3, 4, 5))
        np.testing.assert_allclose(np.asarray(want), quest, rtol=1e-4, atol=1e-3)


def test_launch_shape_does_not_change_scores():
    from ulacache_jax.pallas_kernels.page_scores import page_scores_pallas
    rng = np.random.default_rng(7)
    S, L, G, P, g, D = 2, 2, 2, 32, 1, 16
    kmin = jnp.asarray(rng.standard_normal((S, L, G, P, g, D)), jnp.float32)
    kmax = kmin + jnp.abs(jnp.asarray(rng.standard_normal(kmin.shape), jnp.float32))
    q = jnp.asarray(rng.standard_normal((S, 1, 8, D)), jnp.float32)
    qpos, qneg = selection.fold_queries(q, G, g)
    want = np.asarray(ref_page_scores(kmin, kmax, qpos, qneg, layer=1))
    for bp in (1, 8, 32):
        got = page_scores_pallas(kmin, kmax, qpos, qneg, layer=1, interpret=True, block_pages=bp, num_warps=2)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block_pages = 12 must divide the page count 32"):
        page_scores_pallas(kmin, kmax, qpos, qneg, layer=1, interpret=True, block_pages=12)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_kernel_compiled_on_gpu():
    S, L, G, P, g, D = 8, 4, 8, 2048, 1, 128
    key = jax.random.key(0)
    kmin = jax.random.normal(key, (S, L, G, P, g, D), jnp.bfloat16)
    kmax = kmin + 1
    q = jax.random.normal(key, (S, 1, 64, D), jnp.float32)
    qpos, qneg = selection.fold_queries(q, G, g)
    got = page_scores(kmin, kmax, qpos, qneg, layer=2, impl="pallas")
    want = ref_page_scores(kmin, kmax, qpos, qneg, layer=2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-1)
