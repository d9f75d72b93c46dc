import numpy as np
import pytest
import jax.numpy as jnp

from ulacache_jax.cache.select import quest as selection
from ulacache_jax.pallas_kernels import on_gpu
from ulacache_jax.pallas_kernels.page_topk import ref_select_pages, select_pages_pallas, select_top_pages


def check(s, flushed, k, *, sink=0, recent=0, groups=1, interpret=True):
    """The kernel against the reference, bit for bit; returns the ids."""
    s, fl = jnp.asarray(s, jnp.float32), jnp.asarray(flushed, jnp.int32)
    got = np.asarray(select_pages_pallas(s, fl, k, sink=sink, recent=recent, groups=groups, interpret=interpret))
    want = np.asarray(ref_select_pages(s, fl, k, sink=sink, recent=recent, groups=groups))
    np.testing.assert_array_equal(got, want)
    return got


def numpy_select(s, flushed, k, sink, recent):
    """An independent oracle (rows without denormals): the library's selection rule in numpy, winners by score
    (stable: lower page first among ties), then listed by page, -1 for winners that are not candidates."""
    out = []
    for row, fl in zip(np.asarray(s, np.float32), flushed):
        p = np.arange(len(row))
        x = np.nan_to_num(row, nan=0.0, posinf=3e38, neginf=-3e38).astype(np.float32)
        x = np.where((p < sink) | (p >= fl - recent), np.float32(np.inf), x)
        x = np.where(p < fl, x, np.float32(-np.inf)) + np.float32(0)     # -0.0 -> +0.0
        win = np.sort(np.argsort(-x, kind="stable")[:k])
        out.append(np.where(x[win] > -np.inf, win, -1))
    return np.stack(out)


@pytest.mark.parametrize("rows,p,k,groups", [(3, 100, 32, 1), (2, 64, 64, 2), (4, 257, 5, 2), (1, 1, 1, 1),
                                             (2, 4224, 32, 2)])
def test_random_scores_match_reference_and_numpy(rows, p, k, groups):
    rng = np.random.default_rng(p + k)
    s = rng.standard_normal((rows, p)).astype(np.float32)
    s[0, ::7] = np.nan                                                   # NaN scores count as 0
    s[-1, ::5] = np.inf                                                  # +inf is clamped below forced pages
    fl = rng.integers(0, p + 1, rows // groups).astype(np.int32)
    fl[0] = p                                                            # every page a candidate
    for sink, recent in ((0, 0), (1, 2)):
        if sink + recent <= k:
            got = check(s, fl, k, sink=sink, recent=recent, groups=groups)
            np.testing.assert_array_equal(got, numpy_select(s, np.repeat(fl, groups), k, sink, recent))


@pytest.mark.parametrize("p,k", [(4224, 32), (8000, 40), (300, 200), (2112, 128)])
def test_ties_in_long_rows(p, k):
    """Long rows (4224 pages pad to 8192 lanes) full of integer ties (the lowest-index tie rule over thousands of
    equal keys), every tie in the row's second half, forced pages at both ends, and short rows whose candidates end
    in the middle or near the start."""
    rng = np.random.default_rng(p + k)
    s = rng.integers(-2, 3, (4, p)).astype(np.float32)
    s[1] = rng.standard_normal(p)
    s[2, p // 2:] = 2.0                                                # every tie in the second half
    fl = np.array([p, p - 130, 3, 4097 if p > 4097 else p // 2], np.int32)
    for sink, recent in ((0, 0), (1, 2)):
        got = check(s, fl, k, sink=sink, recent=recent)
        np.testing.assert_array_equal(got, numpy_select(s, fl, k, sink, recent))


def adversarial_scores():
    rng = np.random.default_rng(0)
    s = rng.integers(-3, 4, (4, 300)).astype(np.float32)              # many exact ties
    s[0, :] = 0.0
    s[0, ::3] = -0.0                                                   # -0.0 and +0.0 tie, lower index first
    s[1, 10:] = -np.inf                                               # few real scores
    s[2, [5, 77, 299]] = np.inf                                        # clamped to 3e38, below forced pages
    s[3, :] = -np.inf
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
        rng.integers(0, 2**32, p, dtype=np.uint32).view(np.float32),   # any bit pattern, NaNs included
        np.where(np.arange(p) % 2, np.float32(np.finfo(np.float32).max), -np.finfo(np.float32).max),
        rng.integers(-3, 4, p),                                        # many ties at the threshold
        np.where(np.arange(p) < 40, 7.0, 0.0),                         # 40 ties above zeros
        np.r_[np.full(p - 5, -np.inf), [1.0, -0.0, 1.0, 0.0, -np.inf]],  # the few real scores at the end
    ]
    return np.stack([np.asarray(r, np.float32) for r in rows])


def hard_cases():
    """(scores [18, 300], flushed per row for each case, sink, recent): every page a candidate, no forced pages
    (the plain top-k); random flushed counts (some below k) with sink and recent pages forced."""
    s = np.concatenate([adversarial_scores(), hard_scores()])
    fl = np.random.default_rng(5).integers(0, 301, len(s)).astype(np.int32)
    fl[:3] = (0, 1, 31)
    return s, [(np.full(len(s), 300, np.int32), 0, 0), (fl, 1, 2)]


@pytest.mark.parametrize("k", [1, 32, 300])
def test_ties_infinities_signed_zero_hard_rows_and_short_rows(k):
    """k = 1, k = P and k between; the rows are 300 long (padded to 512 in the kernel's block)."""
    s, cases = hard_cases()
    for fl, sink, recent in cases:
        if sink + recent <= k:
            got = check(s, fl, k, sink=sink, recent=recent)
            n = np.minimum(fl, k)[:, None]
            assert ((got >= 0) == (np.arange(k)[None] < n)).all()         # ids first, then -1s, min(flushed, k)
            assert all((np.diff(r[r >= 0]) > 0).all() for r in got)        # page order


def test_forced_pages_win_and_short_rows_take_every_candidate():
    s = np.full((1, 40), -5.0, np.float32)
    s[0, 20:30] = 9.0                                                  # the best unforced pages
    got = check(s, [35], 8, sink=2, recent=3)[0]                        # forced: 0, 1 and 32, 33, 34
    np.testing.assert_array_equal(got, [0, 1, 20, 21, 22, 32, 33, 34])
    got = check(s, [6], 8, sink=2, recent=3)[0]                         # fewer candidates than k: all, then -1
    np.testing.assert_array_equal(got, [0, 1, 2, 3, 4, 5, -1, -1])


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu(), reason="needs a GPU: runs the kernel compiled")
@pytest.mark.parametrize("case", ["random-decode-shape", "long-ties", "random-odd", "hard"])
def test_compiled_matches_reference(case):
    """The same checks with the Triton kernel compiled (the decode's default selection on GPU)."""
    rng = np.random.default_rng(7)
    if case == "random-decode-shape":        # B = 32 x 8 groups at 256K, budget 2048, page 64
        check(rng.standard_normal((256, 4224)), rng.integers(0, 4225, 32), 32, sink=1, recent=2, groups=8,
              interpret=False)
        # B = 3 x 8 groups at 128K, page 16, budget 1/32: 8200 pages pad to 16384 lanes, the longest row taken
        check(rng.standard_normal((24, 8200)), rng.integers(0, 8201, 3), 256, sink=1, recent=2, groups=8,
              interpret=False)
    elif case == "long-ties":                # 128K rows (2112 pages, masked past them in 4096 lanes), longer rows
        for p, k in ((2112, 32), (6000, 40), (8000, 64), (16384, 512)):
            s = rng.integers(-2, 3, (8, p)).astype(np.float32)                   # thousands of exact ties
            s[1::2] = rng.standard_normal((4, p))
            check(s, [p, p - 130, 3, 4097 % p], k, sink=1, recent=2, groups=2, interpret=False)
    elif case == "random-odd":
        check(rng.standard_normal((6, 257)), rng.integers(0, 258, 3), 64, sink=1, recent=2, groups=2,
              interpret=False)
    else:
        s, cases = hard_cases()
        for k in (1, 32, 300):
            for fl, sink, recent in cases:
                if sink + recent <= k:
                    check(s, fl, k, sink=sink, recent=recent, interpret=False)


def test_dispatch_leading_axes_and_errors():
    s = np.random.default_rng(1).standard_normal((2, 3, 50)).astype(np.float32)
    fl = jnp.asarray([50, 20], jnp.int32)
    a = selection.select_pages(jnp.asarray(s), fl, select_pages=7, sink_pages=1, recent_pages=2, impl="pallas")
    b = selection.select_pages(jnp.asarray(s), fl, select_pages=7, sink_pages=1, recent_pages=2, impl="ref")
    assert a.shape == (2, 3, 7) and a.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    s2 = jnp.asarray(s.reshape(6, 50))
    with pytest.raises(ValueError, match="k = 51 must be in"):
        select_pages_pallas(s2, jnp.zeros(6, jnp.int32), 51, interpret=True)
    with pytest.raises(ValueError, match="flushed has shape"):
        select_pages_pallas(s2, jnp.zeros(4, jnp.int32), 5, groups=2, interpret=True)
    with pytest.raises(ValueError, match="flushed has shape"):
        ref_select_pages(s2, jnp.zeros(4, jnp.int32), 5, groups=2)
    with pytest.raises(ValueError, match="impl = 'fast'"):
        select_top_pages(jnp.asarray(s), fl, 3, impl="fast")
