import numpy as np
import pytest
import jax.numpy as jnp

from ulacache_jax.pallas_kernels import on_gpu
from ulacache_jax.pallas_kernels.page_topk import ref_top_k, top_k, top_k_pallas


def check(s, k, interpret=True):
    v, i = top_k_pallas(jnp.asarray(s, jnp.float32), k, interpret=interpret)
    rv, ri = ref_top_k(jnp.asarray(s, jnp.float32), k)
    np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))


@pytest.mark.parametrize("rows,p,k", [(3, 100, 32), (2, 64, 64), (4, 257, 5), (1, 1, 1), (2, 4224, 32)])
def test_matches_lax_top_k_on_random_scores(rows, p, k):
    check(np.random.default_rng(p + k).standard_normal((rows, p)), k)


def adversarial_scores():
    rng = np.random.default_rng(0)
    s = rng.integers(-3, 4, (4, 300)).astype(np.float32)              # many exact ties
    s[0, :] = 0.0
    s[0, ::3] = -0.0                                                   # -0.0 and +0.0 tie, lower index first
    s[1, 10:] = -np.inf                                               # fewer real candidates than k
    s[2, [5, 77, 299]] = np.inf                                        # always-kept pages
    s[3, :] = -np.inf                                                  # nothing selectable at all
    return s


def test_ties_infinities_and_signed_zero():
    check(adversarial_scores(), 32)


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu(), reason="needs a GPU: runs the kernel compiled")
@pytest.mark.parametrize("case", ["random-decode-shape", "random-odd", "adversarial"])
def test_compiled_matches_lax_top_k(case):
    """The same checks with the Triton kernel compiled (the decode's default top-k on GPU)."""
    rng = np.random.default_rng(7)
    if case == "random-decode-shape":
        check(rng.standard_normal((256, 4224)), 32, interpret=False)         # B=32 x 8 groups at 256K, budget 2048
    elif case == "random-odd":
        check(rng.standard_normal((5, 257)), 64, interpret=False)
    else:
        check(adversarial_scores(), 32, interpret=False)


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
