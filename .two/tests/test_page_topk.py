import numpy as np
import pytest
import jax.numpy as jnp

from ulacache_jax import selection
from ulacache_jax.pallas_kernels import on_gpu
from ulacache_jax.pallas_kernels.page_topk import launch_chunks, ref_select_pages, select_pages_pallas, select_top_pages


def check(s, flushed, k, *, sink=0, recent=0, groups=1, interpret=True, chunks=(1, 4)):
    """The kernel (one launch, and in two stages with each row in 4 chunks) against the reference, bit for bit;
    returns the ids."""
    s, fl = jnp.asarray(s, jnp.float32), jnp.asarray(flushed, jnp.int32)
    want = np.asarray(ref_select_pages(s, fl, k, sink=sink, recent=recent, groups=groups))
    for c in chunks:
        got = np.asarray(select_pages_pallas(s, fl, k, sink=sink, recent=recent, groups=groups, interpret=interpret,
                                             chunks=c))
        np.testing.assert_array_equal(got, want, err_msg=f"chunks = {c}")
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
@pytest.mark.parametrize("case", ["random-decode-shape", "random-b1", "random-odd", "hard"])
def test_compiled_matches_reference(case):
    """The same checks with the Triton kernels compiled (the decode's default selection on GPU; two stages too)."""
    rng = np.random.default_rng(7)
    if case == "random-decode-shape":        # B = 32 x 8 groups at 256K, budget 2048, page 64
        check(rng.standard_normal((256, 4224)), rng.integers(0, 4225, 32), 32, sink=1, recent=2, groups=8,
              interpret=False)
    elif case == "random-b1":                # B = 1 x 8 groups at 256K: the shape two stages are for
        check(rng.standard_normal((8, 4224)), [4224], 32, sink=1, recent=2, groups=8, interpret=False,
              chunks=(1, 4, 8, 16, 32))
    elif case == "random-odd":
        check(rng.standard_normal((6, 257)), rng.integers(0, 258, 3), 64, sink=1, recent=2, groups=2,
              interpret=False)
    else:
        s, cases = hard_cases()
        for k in (1, 32, 300):
            for fl, sink, recent in cases:
                if sink + recent <= k:
                    check(s, fl, k, sink=sink, recent=recent, interpret=False)


@pytest.mark.parametrize("p,k,chunks", [(4224, 32, 8), (4224, 32, 64), (300, 300, 16), (257, 5, 3), (64, 64, 2)])
def test_two_stages_match_the_reference(p, k, chunks):
    """Chunk widths that do not divide the row, chunks narrower than k (every page of a chunk passes), a last chunk
    of a few pages, ties across chunk borders, forced pages in the first and last chunks, short rows."""
    rng = np.random.default_rng(p * k + chunks)
    s = rng.integers(-2, 3, (4, p)).astype(np.float32)                  # ties everywhere, across chunk borders
    s[1] = rng.standard_normal(p)
    s[2, ::3] = -0.0
    fl = np.array([p, 3], np.int32)                                     # full rows, and rows of 3 candidates
    for sink, recent in ((0, 0), (1, 2)):
        if sink + recent <= k:
            got = check(s, fl, k, sink=sink, recent=recent, groups=2, chunks=(chunks,))
            np.testing.assert_array_equal(got, numpy_select(s, np.repeat(fl, 2), k, sink, recent))


def test_launch_chunks_fill_the_gpu_at_small_batches_only():
    """The decode's shapes at 256K (4224 pages): batch 1 (8 rows) in 16 chunks of 512 pages, batch 3 in 4 of 2048;
    at 128 rows or more, or rows of 512 pages or fewer, one launch."""
    assert launch_chunks(8, 4224) == 16 and launch_chunks(24, 4224) == 4 and launch_chunks(64, 4224) == 2
    assert launch_chunks(128, 4224) == 1 and launch_chunks(256, 8192) == 1
    assert launch_chunks(8, 512) == 1 and launch_chunks(1, 1) == 1 and launch_chunks(1, 1025) == 4


def test_dispatch_in_chunks_matches_the_reference():
    """select_top_pages at a batch-1 shape long enough to run in chunks (2 rows of 2100 pages: 8 chunks of 512, the last of 52)."""
    rng = np.random.default_rng(5)
    s = jnp.asarray(rng.integers(-3, 4, (1, 2, 2100)).astype(np.float32))              # ties across chunk borders
    fl = jnp.asarray([2000], jnp.int32)
    assert launch_chunks(2, 2100) == 8
    a = select_top_pages(s, fl, 40, sink=1, recent=2, impl="pallas")
    b = select_top_pages(s, fl, 40, sink=1, recent=2, impl="ref")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
    with pytest.raises(ValueError, match="chunks = 0 must be"):
        select_pages_pallas(s2, jnp.zeros(6, jnp.int32), 5, interpret=True, chunks=0)
    with pytest.raises(ValueError, match="impl = 'fast'"):
        select_top_pages(jnp.asarray(s), fl, 3, impl="fast")
