import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.cache.select import quest as selection
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
        got = page_scores(kmin, kmax, q, layer=layer, impl="pallas")
        want = ref_page_scores(kmin, kmax, qpos, qneg, layer=layer)
        tol = 1e-4 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
        # the reference is the Quest bound written the long way: sum_h sum_d max(q*kmin, q*kmax)
        qh = np.asarray(q).reshape(S, G, g, r, D)
        mn, mx = np.asarray(kmin[:, layer], np.float32), np.asarray(kmax[:, layer], np.float32)
        quest = np.maximum(qh[:, :, None] * mn[:, :, :, :, None], qh[:, :, None] * mx[:, :, :, :, None]).sum((3, 4, 5))
        np.testing.assert_allclose(np.asarray(want), quest, rtol=1e-4, atol=1e-3)


def pallas_operands(jaxpr):
    """The operands of the first pallas_call in a jaxpr (looking inside jit calls, not inside kernels)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return eqn.invars
        inner = eqn.params.get("jaxpr")
        if inner is not None:
            found = pallas_operands(getattr(inner, "jaxpr", inner))
            if found is not None:
                return found
    return None


@pytest.mark.parametrize("g,r,nq,split", [(1, 4, 1, 1), (2, 2, 1, 1), (1, 8, 2, 1), (1, 4, 1, 2), (1, 3, 1, 1),
                                         (1, 4, 3, 1)])
def test_queries_folded_in_the_kernel_or_before_it(g, r, nq, split):
    """The decode passes q itself: the kernel folds a group's query heads (powers of two: one launch, no XLA
    reductions before it); other shapes (r = 3 as SmolLM2's 9 heads over 3 kv heads, 3 query rows) are folded
    before the kernel. Both match the reference on the folded queries."""
    from ulacache_jax.pallas_kernels.page_scores import folds_in_kernel, page_scores_pallas
    rng = np.random.default_rng(g * 100 + r * 10 + nq + split)
    S, L, G, P, D = 2, 2, 2, 32, 16
    kmin = jnp.asarray(rng.standard_normal((S, L, G, P * split, g, D)), jnp.float32)
    kmax = kmin + jnp.abs(jnp.asarray(rng.standard_normal(kmin.shape), jnp.float32))
    q = jnp.asarray(rng.standard_normal((S, nq, G * g * r, D)), jnp.bfloat16)
    qpos, qneg = selection.fold_queries(q, G, g)
    want = np.asarray(ref_page_scores(kmin, kmax, qpos, qneg, layer=1, split=split))
    got = np.asarray(page_scores(kmin, kmax, q, layer=1, impl="pallas", split=split))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    inside = folds_in_kernel(q.shape, G, g)
    assert inside == (r & (r - 1) == 0 and nq & (nq - 1) == 0)
    closed = jax.make_jaxpr(lambda q: page_scores(kmin, kmax, q, layer=1, impl="pallas", split=split))(q)
    assert (q.shape in [tuple(v.aval.shape) for v in pallas_operands(closed.jaxpr)]) == inside  # q itself, unfolded
    if not inside:
        with pytest.raises(ValueError, match="cannot be folded in the kernel"):
            page_scores_pallas(kmin, kmax, q=q, layer=1, interpret=True)
    with pytest.raises(ValueError, match="either the folded queries"):
        page_scores_pallas(kmin, kmax, qpos, qneg, q=q, layer=1, interpret=True)


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


# ---- sub-page summaries (CacheConfig.summary_split): a page scores the max of its sub-pages' bounds -------------
def quest_long_way(q, kmin, kmax, layer, split):
    """numpy: q [S, 1, H, D], summaries [S, L, G, P * split, g, D] -> [S, G, P]: sum_h sum_d max(q*min, q*max) per
    sub-page, max over each page's sub-pages."""
    S, L, G, PS, g, D = kmin.shape
    qh = np.asarray(q, np.float32).reshape(S, G, g, -1, D)                                # [S, G, g, r, D]
    mn, mx = np.asarray(kmin[:, layer], np.float32), np.asarray(kmax[:, layer], np.float32)  # [S, G, PS, g, D]
    b = np.maximum(qh[:, :, None] * mn[:, :, :, :, None], qh[:, :, None] * mx[:, :, :, :, None]).sum((3, 4, 5))
    return b.reshape(S, G, PS // split, split).max(-1)


@pytest.mark.parametrize("split,g,P,dtype", [(2, 1, 24, jnp.float32), (2, 2, 16, jnp.bfloat16),
                                             (4, 1, 32, jnp.float32), (2, 1, 64, jnp.bfloat16)])
def test_split_kernel_matches_reference_and_half_page_bound(split, g, P, dtype):
    rng = np.random.default_rng(P + g + split)
    S, L, G, D, r = 2, 3, 2, 16, 4
    k = rng.standard_normal((S, L, G, P * split, 8 // split, g, D)).astype(np.float32)   # 8 tokens a page
    kmin, kmax = jnp.asarray(k.min(4), dtype), jnp.asarray(k.max(4), dtype)
    kmin = kmin.at[1, 0, 0, 3].set(jnp.nan)                               # garbage in another layer must not leak
    q = jnp.asarray(rng.standard_normal((S, 1, G * g * r, D)), jnp.float32)
    qpos, qneg = selection.fold_queries(q, G, g)
    tol = 1e-4 if dtype == jnp.float32 else 1e-2
    for layer in (1, 2):
        got = page_scores(kmin, kmax, q, layer=layer, impl="pallas", split=split)
        want = ref_page_scores(kmin, kmax, qpos, qneg, layer=layer, split=split)
        assert got.shape == want.shape == (S, G, P)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(want), quest_long_way(q, kmin, kmax, layer, split), rtol=1e-4,
                                   atol=1e-3)
        # the page-level reference (selection.ref_page_scores) agrees
        sel_ref = selection.ref_page_scores(q, kmin[:, layer], kmax[:, layer], split=split)
        np.testing.assert_allclose(np.asarray(sel_ref), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_split_launch_shapes_and_errors():
    from ulacache_jax.pallas_kernels.page_scores import page_scores_pallas
    rng = np.random.default_rng(8)
    S, L, G, P, g, D, split = 2, 2, 2, 32, 1, 16, 2
    kmin = jnp.asarray(rng.standard_normal((S, L, G, P * split, g, D)), jnp.float32)
    kmax = kmin + jnp.abs(jnp.asarray(rng.standard_normal(kmin.shape), jnp.float32))
    q = jnp.asarray(rng.standard_normal((S, 1, 8, D)), jnp.float32)
    qpos, qneg = selection.fold_queries(q, G, g)
    want = np.asarray(ref_page_scores(kmin, kmax, qpos, qneg, layer=1, split=split))
    for bp in (1, 8, 32):
        got = page_scores_pallas(kmin, kmax, qpos, qneg, layer=1, interpret=True, block_pages=bp, num_warps=2,
                                 split=split)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # a launch block that does not divide the page count (not the summary count) falls back to the default
    got = page_scores(kmin, kmax, q, layer=1, impl="pallas", launch=(64, 2), split=split)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block_pages = 64 must divide the page count 32"):
        page_scores_pallas(kmin, kmax, qpos, qneg, layer=1, interpret=True, block_pages=64, split=split)
    with pytest.raises(ValueError, match="split = 3 must be a power of two >= 1 dividing the summary count 64"):
        page_scores_pallas(kmin, kmax, qpos, qneg, layer=1, interpret=True, split=3)
    with pytest.raises(ValueError, match="split = 3 must be a power of two"):
        ref_page_scores(kmin, kmax, qpos, qneg, layer=1, split=3)


def test_split_adversarial_ties_sentinels_and_masked_pages():
    """Integer-valued summaries (every sum exact, so kernel and reference agree bit for bit): tied pages and tied
    sub-pages, a partial tail page whose unfilled sub-page carries ingestion's (finfo.max, -finfo.max) sentinel, a
    page whose every sub-page is a sentinel (score -inf), and pages past the flushed count. Kernel scores equal the
    reference exactly, the sentinel never wins its page's max, and the selections are equal."""
    from ulacache_jax.pallas_kernels.page_scores import page_scores_pallas
    rng = np.random.default_rng(11)
    S, L, G, P, g, D, split = 2, 2, 2, 16, 1, 16, 2
    big = np.finfo(np.float32).max
    lo = rng.integers(-3, 3, (S, L, G, P * split, g, D)).astype(np.float32)
    hi = lo + rng.integers(0, 3, lo.shape).astype(np.float32)
    lo[:, :, :, 2:4] = lo[:, :, :, 6:8]                      # page 1 ties page 3 (both sub-pages)
    hi[:, :, :, 2:4] = hi[:, :, :, 6:8]
    lo[:, :, :, 9], hi[:, :, :, 9] = lo[:, :, :, 8], hi[:, :, :, 8]   # page 4's sub-pages tie each other
    lo[0, :, :, 11], hi[0, :, :, 11] = big, -big             # page 5 of seq 0: partial, second sub-page unfilled
    lo[1, :, :, 12:14], hi[1, :, :, 12:14] = big, -big       # page 6 of seq 1: no token at all
    kmin, kmax = jnp.asarray(lo), jnp.asarray(hi)
    q = jnp.asarray(rng.integers(-2, 3, (S, 1, 4 * G, D)), jnp.float32)
    q = q.at[..., 0].set(1.0)                                # qpos > 0 in some dim: a sentinel bound is ~-big
    qpos, qneg = selection.fold_queries(q, G, g)
    want = np.asarray(ref_page_scores(kmin, kmax, qpos, qneg, layer=1, split=split))
    for bp in (None, 4):
        got = np.asarray(page_scores_pallas(kmin, kmax, qpos, qneg, layer=1, interpret=True, block_pages=bp,
                                            split=split))
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(want[:, :, 1], want[:, :, 3])
    sub = np.asarray(ref_page_scores(kmin, kmax, qpos, qneg, layer=1, split=1))        # every sub-page's bound
    np.testing.assert_array_equal(want[0, :, 5], sub[0, :, 10])                        # the filled half decides
    assert (sub[0, :, 11] < -1e37).all() and np.isneginf(want[1, :, 6]).all()
    for flushed in ([16, 16], [6, 9], [0, 3]):
        fl = jnp.asarray(flushed, jnp.int32)
        a = selection.select_pages(jnp.asarray(got), fl, select_pages=5, sink_pages=1, recent_pages=1)
        b = selection.select_pages(jnp.asarray(want), fl, select_pages=5, sink_pages=1, recent_pages=1)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert all(p < f for s, f in enumerate(flushed) for p in np.asarray(a)[s].reshape(-1) if p >= 0)


def test_split_one_is_the_per_page_program():
    """split = 1 (the default) traces the per-page kernel and reference, op for op."""
    rng = np.random.default_rng(1)
    kmin = jnp.asarray(rng.standard_normal((2, 2, 2, 16, 1, 16)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 16)), jnp.float32)
    def per_page(mn, mx, q):     # the per-page reference as it reads without sub-pages
        qp, qn = selection.fold_queries(q, 2, 1)
        mx, mn = mx[:, 1].astype(jnp.float32), mn[:, 1].astype(jnp.float32)
        return jnp.einsum("sjpid,sjid->sjp", mx, qp) + jnp.einsum("sjpid,sjid->sjp", mn, qn)
    a = jax.make_jaxpr(per_page)(kmin, kmin, q)
    b = jax.make_jaxpr(lambda *x: page_scores(*x, layer=1, impl="ref", split=1))(kmin, kmin, q)
    assert str(a) == str(b)
    jp = str(jax.make_jaxpr(lambda *x: page_scores(*x, layer=1, impl="pallas"))(kmin, kmin, q))
    assert "quest_page_scores" in jp and "quest_page_scores_split" not in jp


def test_split_kernel_lowers_for_h200():
    """The split kernel lowers to one Triton call for an abstract H200 (no GPU: see test_gpu_lowering.py)."""
    from jax._src import mesh as mesh_lib
    from ulacache_jax.pallas_kernels.page_scores import page_scores_pallas
    h200 = mesh_lib.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                 abstract_device=mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                                                         platform="cuda"))
    summ = jax.ShapeDtypeStruct((2, 2, 8, 256 * 2, 1, 128), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((2, 8, 1, 128), jnp.float32)
    try:
        with jax.sharding.use_abstract_mesh(h200):
            txt = jax.jit(lambda a, b, c, d: page_scores_pallas(a, b, c, d, layer=1, interpret=False, split=2)).trace(
                summ, summ, q, q).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        jax.clear_caches()      # GPU-dispatch traces must not be reused by a CPU test in this process
    assert txt.count("__gpu$xla.gpu.triton") == 1 and "quest_page_scores_split" in txt


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("split", [1, 2])
def test_kernel_compiled_on_gpu(split):
    S, L, G, P, g, D = 8, 4, 8, 2048, 1, 128
    key = jax.random.key(0)
    kmin = jax.random.normal(key, (S, L, G, P * split, g, D), jnp.bfloat16)
    kmax = kmin + 1
    q = jax.random.normal(key, (S, 1, 64, D), jnp.float32)
    qpos, qneg = selection.fold_queries(q, G, g)
    got = page_scores(kmin, kmax, q, layer=2, impl="pallas", split=split)
    want = ref_page_scores(kmin, kmax, qpos, qneg, layer=2, split=split)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-1)
    if split > 1:   # with a page count the default block does not reach (fewer than 16 pages)
        got = page_scores(kmin[:, :, :, :24], kmax[:, :, :, :24], q, layer=1, impl="pallas", split=split)
        want = ref_page_scores(kmin[:, :, :, :24], kmax[:, :, :, :24], qpos, qneg, layer=1, split=split)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-1)
