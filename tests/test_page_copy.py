"""fetch / flush page copies: Pallas kernels (interpret mode on CPU, compiled on the GPU) against the jnp references.

Adversarial cases: -1 and out-of-range entries skipped, NaN in pages nobody addresses, permuted indices, odd counts
(padding to pages_per_program), non-power-of-two page shapes (tiled), K and V in one launch, a leading rank axis,
donation under jit (never np.asarray a donated array), bf16 / fp32 / fp16. Comparisons are bit exact (copies)."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.pallas_kernels import page_copy as pc

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


def _bits(x):
    """Bit pattern of a float array (NaN-safe exact comparison)."""
    x = np.array(x, copy=True)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _pages(rng, n, shape, dtype):
    x = rng.standard_normal((n,) + shape).astype(np.float32)
    x[rng.random(n) < 0.2] = np.nan  # NaN pages must be copied as bits, and never leak elsewhere
    return jnp.asarray(x, dtype)


def _indices(rng, n, size, n_valid):
    idx = np.full(n, -1, np.int32)
    pos = rng.permutation(n)[:n_valid]
    idx[pos] = rng.permutation(size)[:n_valid]
    return idx


def _case(rng, *, dtype, shape, num_src, num_dst, n, n_valid):
    src = _pages(rng, num_src, shape, dtype)
    dst = _pages(rng, num_dst, shape, dtype)
    src_idx = _indices(rng, n, num_src, n_valid)
    dst_idx = _indices(rng, n, num_dst, n_valid)
    # out-of-range entries must be skipped too
    if n > 2:
        src_idx[0], dst_idx[1] = num_src + 3, num_dst
    return src, dst, jnp.asarray(src_idx), jnp.asarray(dst_idx)


def _expect(dst, src, src_idx, dst_idx):
    out = np.array(dst, copy=True)
    s = np.array(src, copy=True)  # a copy: a numpy view of a jax array blocks its later donation
    for i, j in zip(np.asarray(src_idx), np.asarray(dst_idx)):
        if 0 <= i < src.shape[0] and 0 <= j < dst.shape[0]:
            out[j] = s[i]
    return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("ppp", [1, 3, 4])
def test_fetch_kernel_matches_ref(dtype, ppp):
    rng = np.random.default_rng(hash((str(dtype), ppp)) % 2**32)
    host, pool, hidx, fidx = _case(rng, dtype=dtype, shape=(8, 2, 16), num_src=40, num_dst=24, n=13, n_valid=9)
    want = _expect(pool, host, hidx, fidx)
    ref = pc.ref_fetch(pool, host, hidx, fidx)
    got = jax.jit(lambda p, h, a, b: pc.fetch(p, h, a, b, impl="pallas", pages_per_program=ppp),
                  donate_argnums=0)(jnp.array(pool), host, hidx, fidx)
    np.testing.assert_array_equal(_bits(ref), _bits(want))
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_flush_kernel_matches_ref(dtype):
    rng = np.random.default_rng(1)
    src, host, sidx, hidx = _case(rng, dtype=dtype, shape=(8, 1, 32), num_src=16, num_dst=50, n=11, n_valid=7)
    want = _expect(host, src, sidx, hidx)
    np.testing.assert_array_equal(_bits(pc.ref_flush(host, src, sidx, hidx)), _bits(want))
    got = pc.flush_donated(jnp.array(host), src, sidx, hidx, impl="pallas", pages_per_program=2)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_non_pow2_page_is_tiled():
    # 3 heads x 48 dims x 8 rows: Triton needs power-of-two blocks, so the page is copied as several tiles
    tiles = pc.page_tiles((8, 3, 48), 4, max_tile_bytes=256)
    cover = np.zeros((8, 3, 48), int)
    for (r0, rs), (h0, hs), (d0, ds) in tiles:
        assert all(v & (v - 1) == 0 for v in (rs, hs, ds)) and rs * hs * ds * 4 <= 256
        cover[r0:r0 + rs, h0:h0 + hs, d0:d0 + ds] += 1
    assert (cover == 1).all()
    rng = np.random.default_rng(2)
    host, pool, hidx, fidx = _case(rng, dtype=jnp.float32, shape=(8, 3, 48), num_src=9, num_dst=7, n=5, n_valid=4)
    got = pc.fetch(pool, host, hidx, fidx, impl="pallas")
    np.testing.assert_array_equal(_bits(got), _bits(_expect(pool, host, hidx, fidx)))


def test_all_invalid_and_empty_change_nothing():
    rng = np.random.default_rng(3)
    host, pool, _, _ = _case(rng, dtype=jnp.bfloat16, shape=(4, 1, 8), num_src=6, num_dst=5, n=4, n_valid=0)
    minus = jnp.full((7,), -1, jnp.int32)
    np.testing.assert_array_equal(_bits(pc.fetch(pool, host, minus, minus, impl="pallas")), _bits(pool))
    empty = jnp.zeros((0,), jnp.int32)
    np.testing.assert_array_equal(_bits(pc.fetch(pool, host, empty, empty, impl="pallas")), _bits(pool))
    np.testing.assert_array_equal(_bits(pc.flush(host, pool, empty, empty, impl="ref")), _bits(host))


def test_kv_lists_one_launch():
    rng = np.random.default_rng(4)
    hk, pk, hidx, fidx = _case(rng, dtype=jnp.bfloat16, shape=(8, 1, 16), num_src=20, num_dst=12, n=6, n_valid=5)
    hv = _pages(rng, 20, (8, 1, 16), jnp.bfloat16)
    pv = _pages(rng, 12, (8, 1, 16), jnp.bfloat16)
    got = pc.fetch_donated([jnp.array(pk), jnp.array(pv)], [hk, hv], hidx, fidx, impl="pallas")
    ref = pc.ref_fetch([pk, pv], [hk, hv], hidx, fidx)
    for g, r, p, h in zip(got, ref, (pk, pv), (hk, hv)):
        np.testing.assert_array_equal(_bits(g), _bits(_expect(p, h, hidx, fidx)))
        np.testing.assert_array_equal(_bits(r), _bits(g))


@pytest.mark.parametrize("impl", ["ref", "pallas"])
def test_rank_axis(impl):
    rng = np.random.default_rng(5)
    R, shape = 3, (4, 2, 8)
    host = jnp.stack([_pages(rng, 10, shape, jnp.float32) for _ in range(R)])
    pool = jnp.stack([_pages(rng, 6, shape, jnp.float32) for _ in range(R)])
    hidx = jnp.asarray([4, -1, 9, 0], jnp.int32)
    fidx = jnp.asarray([5, 1, 0, -1], jnp.int32)
    want = np.array(pool, copy=True)
    want[1] = _expect(pool[1], host[1], hidx, fidx)
    traced = jax.jit(lambda p, h, a, b, r: pc.fetch(p, h, a, b, rank=r, impl=impl))(pool, host, hidx, fidx, 1)
    np.testing.assert_array_equal(_bits(traced), _bits(want))
    static = pc.fetch(pool, host, hidx, fidx, rank=1, impl=impl)
    np.testing.assert_array_equal(_bits(static), _bits(want))
    # flush of a batch without rank axis into rank 2 of the host pool
    batch = _pages(rng, 3, shape, jnp.float32)
    sidx = jnp.asarray([2, 0, -1], jnp.int32)
    hidx2 = jnp.asarray([7, 3, 1], jnp.int32)
    got = pc.flush_donated(jnp.array(host), batch, sidx, hidx2, rank=2, impl=impl)
    want = np.array(host, copy=True)
    want[2] = _expect(host[2], batch, sidx, hidx2)
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("impl", ["ref", "pallas"])
def test_round_trip_prefill_flush_evict_fetch(impl):
    """Pages made in HBM are flushed to the host pool, their frames overwritten (evicted), fetched back into other
    frames: the bytes come back exactly. Every array is donated along the way and never viewed by numpy."""
    rng = np.random.default_rng(6)
    shape, F, H, n = (8, 1, 16), 16, 64, 10
    dt = jnp.bfloat16
    pages = _pages(rng, n, shape, dt)                      # "prefill" output, in HBM
    want = np.array(pages, copy=True)
    host = jnp.zeros((H, *shape), dt)
    pool = jnp.zeros((F, *shape), dt)
    host_pages = jnp.asarray(rng.permutation(H)[:n].astype(np.int32))
    frames = jnp.asarray(rng.permutation(F)[:n].astype(np.int32))
    pool = pc.flush_donated(pool, pages, jnp.arange(n, dtype=jnp.int32), frames, impl=impl)  # into frames
    host = pc.flush_donated(host, pool, frames, host_pages, impl=impl)                     # write-through
    junk = _pages(rng, F, shape, dt)
    pool = pc.flush_donated(pool, junk, jnp.arange(F, dtype=jnp.int32), jnp.arange(F, dtype=jnp.int32), impl=impl)
    new_frames = jnp.asarray(rng.permutation(F)[:n].astype(np.int32))
    pool = pc.fetch_donated(pool, host, host_pages, new_frames, impl=impl)
    got = jnp.take(pool, new_frames, axis=0)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_donation_in_step():
    """A jitted step that donates both pool and host and calls fetch then flush: no external-reference error, and
    the results are fresh arrays."""
    rng = np.random.default_rng(7)
    shape = (4, 1, 8)
    host = _pages(rng, 12, shape, jnp.float32)
    pool = _pages(rng, 8, shape, jnp.float32)
    want_pool = _expect(pool, host, np.array([3, 5]), np.array([0, 7]))
    want_host = _expect(host, pool, np.array([0, 7]), np.array([9, 11]))  # flush reads the pool as passed in
    step = jax.jit(lambda p, h, i, f: (pc.fetch(p, h, i, f, impl="pallas"),
                                       pc.flush(h, p, f, i + 6, impl="pallas")), donate_argnums=(0, 1))
    new_pool, new_host = step(pool, host, jnp.asarray([3, 5], jnp.int32), jnp.asarray([0, 7], jnp.int32))
    assert pool.is_deleted() and host.is_deleted()
    np.testing.assert_array_equal(_bits(new_pool), _bits(want_pool))
    np.testing.assert_array_equal(_bits(new_host), _bits(want_host))


def test_bad_shapes_raise():
    a = jnp.zeros((4, 2, 1, 8))
    with pytest.raises(ValueError, match="does not match"):
        pc.fetch(a, jnp.zeros((4, 2, 1, 16)), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), impl="ref")
    with pytest.raises(ValueError, match="1-D and equal"):
        pc.fetch(a, a, jnp.zeros(2, jnp.int32), jnp.zeros(1, jnp.int32), impl="ref")
    with pytest.raises(ValueError, match="impl"):
        pc.fetch(a, a, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), impl="triton")


# --- compiled, on pinned_host (the H200) ---

def _pinned():
    dev = jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("ppp", [1, 4])
def test_gpu_pinned_round_trip(dtype, ppp):
    rng = np.random.default_rng(8)
    shape, F, H, n = (64, 1, 128), 256, 1024, 200
    src = _pages(rng, n, shape, dtype)
    want = np.array(src, copy=True)
    host = jax.device_put(jnp.zeros((H, *shape), dtype), _pinned())
    host_pages = jnp.asarray(rng.permutation(H)[:n].astype(np.int32))
    host = pc.flush_donated(host, src, jnp.arange(n, dtype=jnp.int32), host_pages, pages_per_program=ppp)
    assert host.sharding.memory_kind == "pinned_host"
    pool = jnp.zeros((F, *shape), dtype)
    frames = _indices(rng, 256, F, n)
    hidx = np.full(256, -1, np.int32)
    hidx[frames >= 0] = np.asarray(host_pages)[: int((frames >= 0).sum())]
    pool = pc.fetch_donated(pool, host, jnp.asarray(hidx), jnp.asarray(frames), pages_per_program=ppp)
    assert host.sharding.memory_kind == "pinned_host"
    got = np.array(jnp.take(pool, jnp.asarray(frames[frames >= 0]), axis=0))
    # the page flushed to host_pages[k] is src[k]
    k_of = {int(h): k for k, h in enumerate(np.asarray(host_pages))}
    exp = want[[k_of[int(h)] for h in hidx[frames >= 0]]]
    np.testing.assert_array_equal(_bits(got), _bits(exp))


@gpu
@needs_gpu
def test_gpu_kernel_matches_ref_on_device_memory():
    rng = np.random.default_rng(9)
    host, pool, hidx, fidx = _case(rng, dtype=jnp.bfloat16, shape=(64, 2, 128), num_src=300, num_dst=100, n=77,
                                   n_valid=60)
    ref = pc.ref_fetch(pool, host, hidx, fidx)
    got = pc.fetch(pool, host, hidx, fidx)
    np.testing.assert_array_equal(_bits(got), _bits(ref))
