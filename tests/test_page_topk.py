import numpy as np
import pytest
import jax.numpy as jnp

from ulacache_jax.pallas_kernels import on_gpu
from ulacache_jax.pallas_kernels.page_topk import ref_top_k, top_k, top_k_pallas


def check(s, k, interpret=True):
    v, i = top_k_pallas(jnp.asarray(s, jnp.float32), k, interpret=interpret)
    rv, ri = ref_top_k(jnp.asarray(s, jnp.float32), k)
    # the kernel returns a -0.0 score as is (and a denormal where XLA on CPU flushes it): equal as values
    v = jnp.where(v == 0, jnp.float32(0), v)
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


def hard_scores(p: int = 300):
    """[14, p] float32 rows that stress the threshold search: ties at every k, neighbours one ulp apart (the k-th
    key and the next differ in the lowest bit only), denormals, signed zeros, infinities, every bit pattern."""
    rng = np.random.default_rng(3)
    ulps = lambda lo, n: np.arange(lo, lo + n, dtype=np.uint32).view(np.float32)   # n consecutive floats from lo
    one, m_one = np.float32(1).view(np.uint32), np.float32(-1).view(np.uint32)
    rows = [
        np.full(p, 1.5),                                               # all equal
        rng.choice([-1, -0.0, 0.0, 1], p),                             # signed zeros between +-1
        rng.choice([-np.inf, np.inf], p),                              # infinities only
        rng.choice([-np.inf, 2.0, np.inf], p),
        rng.permutation(ulps(one, p)),                                 # all distinct, one ulp apart
        rng.permutation(ulps(m_one, p)),                               # the same below -1 (keys flipped)
        ulps(one, 4)[rng.integers(0, 4, p)],                           # ties on one-ulp steps
        ulps(0, 8)[rng.integers(0, 8, p)] * rng.choice([-1, 1], p),    # the smallest denormals, +-, and +-0
        rng.permutation(ulps(0x7FFFFF - p // 2, p)),                   # largest denormals / smallest normals
        rng.integers(0, 2**32, p, dtype=np.uint32).view(np.float32),   # any bit pattern (NaNs replaced below)
        np.where(np.arange(p) % 2, np.float32(np.finfo(np.float32).max), -np.finfo(np.float32).max),
        rng.integers(-3, 4, p),                                        # many ties at the threshold
        np.where(np.arange(p) < 40, 7.0, 0.0),                         # 40 ties above zeros
        np.r_[np.full(p - 5, -np.inf), [1.0, -0.0, 1.0, 0.0, -np.inf]],  # the few real pages at the end
    ]
    s = np.stack([np.asarray(r, np.float32) for r in rows])
    return np.where(np.isnan(s), np.float32(0.5), s)


@pytest.mark.parametrize("k", [1, 32, 300])
def test_ties_infinities_signed_zero_and_hard_rows(k):
    """k = 1, k = P and k between, over both row sets in one call (one compile); the rows are 300 long (padded
    to 512)."""
    check(np.concatenate([adversarial_scores(), hard_scores()]), k)


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu(), reason="needs a GPU: runs the kernel compiled")
@pytest.mark.parametrize("case", ["random-decode-shape", "random-odd", "adversarial", "hard"])
def test_compiled_matches_lax_top_k(case):
    """The same checks with the Triton kernel compiled (the decode's default top-k on GPU)."""
    rng = np.random.default_rng(7)
    if case == "random-decode-shape":
        check(rng.standard_normal((256, 4224)), 32, interpret=False)  # B=32 x 8 groups at 256K, budget 2048
    elif case == "random-odd":
        check(rng.standard_normal((5, 257)), 64, interpret=False)
    elif case == "adversarial":
        check(adversarial_scores(), 32, interpret=False)
    else:
        for k in (1, 32, 300):
            check(hard_scores(), k, interpret=False)


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
