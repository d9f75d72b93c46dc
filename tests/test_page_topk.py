import numpy as np
import pytest
import jax.numpy as jnp

from ulacache_jax.pallas_kernels.page_topk import ref_top_k, top_k, top_k_pallas


def check(s, k):
    v, i = top_k_pallas(jnp.asarray(s, jnp.float32), k, interpret=True)
    rv, ri = ref_top_k(jnp.asarray(s, jnp.float32), k)
    np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))


@pytest.mark.parametrize("rows,p,k", [(3, 100, 32), (2, 64, 64), (4, 257, 5), (1, 1, 1), (2, 4224, 32)])
def test_matches_lax_top_k_on_random_scores(rows, p, k):
    check(np.random.default_rng(p + k).standard_normal((rows, p)), k)


def test_ties_infinities_and_signed_zero():
    rng = np.random.default_rng(0)
    s = rng.integers(-3, 4, (4, 300)).astype(np.float32)              # many exact ties
    s[0, :] = 0.0
    s[0, ::3] = -0.0                                                   # -0.0 and +0.0 tie, lower index first
    s[1, 10:] = -np.inf                                               # fewer real candidates than k
    s[2, [5, 77, 299]] = np.inf                                        # always-kept pages
    s[3, :] = -np.inf                                                  # nothing selectable at all
    check(s, 32)


def test_leading_axes_and_dispatch():
    s = np.random.default_rng(1).standard_normal((2, 3, 50)).astype(np.float32)
    v, i = top_k(jnp.asarray(s), 7, impl="pallas")
    rv, ri = top_k(jnp.asarray(s), 7, impl="ref")
    assert v.shape == (2, 3, 7) and i.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
    with pytest.raises(ValueError, match="k = 51 must be in"):
        top_k_pallas(jnp.asarray(s), 51, interpret=True)
    with pytest.raises(ValueError, match="impl = 'fast'"):
        top_k(jnp.asarray(s), 3, impl="fast")
