"""Sparse decode attention: the Pallas kernel (interpret mode on CPU, compiled on GPU) against the jnp reference,
and the reference against plain dense causal attention.

Adversarial inputs throughout: frame tables are random permutations with the attended pages in random slots,
every frame that no slot references is NaN, tokens past the length in a partial page are NaN, and the frame ids
of skipped slots are garbage (negative or past the pool)."""
from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.pallas_kernels import page_copy
from ulacache_jax.pallas_kernels import sparse_decode_attention as sda

ON_GPU = jax.devices()[0].platform == "gpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}  # relative L2 error; bf16: P is rounded before the PV product


def rel_err(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    assert np.isfinite(a).all(), "non-finite output"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_case(seed, *, lens, nq=1, ng=2, g=1, r=4, d=32, page=8, slots=None, dtype=jnp.float32, extra_frames=7,
              select=None):
    """Random case. Returns a dict with the kernel arguments plus the dense K/V [B, T, KV, D] they were cut from.

    lens: lengths per sequence; select: None = all pages of each sequence, or a number of pages per (b, group)
    chosen at random (the last page always in)."""
    rng = np.random.default_rng(seed)
    b = len(lens)
    kv = ng * g
    h = kv * r
    t_max = max(max(lens), 1)
    n_pages = -(-t_max // page)
    slots = slots or n_pages + 1
    dense_k = rng.standard_normal((b, n_pages * page, kv, d)).astype(np.float32)
    dense_v = rng.standard_normal((b, n_pages * page, kv, d)).astype(np.float32)
    for i, n in enumerate(lens):  # garbage past each length: it must never reach the output
        dense_k[i, n:] = np.nan
        dense_v[i, n:] = np.nan
    chosen = []
    for i, n in enumerate(lens):
        pages_i = -(-n // page)
        for grp in range(ng):
            if select is None or pages_i <= select:
                sel = list(range(pages_i))
            else:
                sel = sorted(rng.choice(pages_i - 1, select - 1, replace=False).tolist()) + [pages_i - 1]
            chosen.append((i, grp, sel))
    num_used = sum(len(s) for _, _, s in chosen)
    nf = num_used + extra_frames
    perm = rng.permutation(nf)
    pool_k = np.full((nf, page, g, d), np.nan, np.float32)   # unreferenced frames are NaN
    pool_v = np.full((nf, page, g, d), np.nan, np.float32)
    frame = rng.integers(-5, 10 * nf, (b, ng, slots)).astype(np.int32)  # garbage in skipped slots
    start = np.full((b, ng, slots), -1, np.int32)
    c = 0
    for i, grp, sel in chosen:
        where = rng.permutation(slots)[:len(sel)]
        for slot, p in zip(where, sel):
            f = perm[c]
            c += 1
            frame[i, grp, slot] = f
            start[i, grp, slot] = p * page
            pool_k[f] = dense_k[i, p * page:(p + 1) * page, grp * g:(grp + 1) * g]
            pool_v[f] = dense_v[i, p * page:(p + 1) * page, grp * g:(grp + 1) * g]
    q = rng.standard_normal((b, nq, h, d)).astype(np.float32)
    return dict(q=jnp.asarray(q, dtype), pool_k=jnp.asarray(pool_k, dtype), pool_v=jnp.asarray(pool_v, dtype),
                page_frame=jnp.asarray(frame), page_start=jnp.asarray(start),
                seq_len=jnp.asarray(np.asarray(lens, np.int32)), dense_k=dense_k, dense_v=dense_v, unused=perm[c:])


def args_of(case):
    return [case[k] for k in ("q", "pool_k", "pool_v", "page_frame", "page_start", "seq_len")]


def dense_attention(q, k, v, lens, softcap=None):
    """Plain causal attention on the concatenated K/V: q [B, Q, H, D], k/v [B, T, KV, D] (NaN past lens)."""
    b, nq, h, d = q.shape
    t = k.shape[1]
    lens = np.asarray(lens)
    k = np.nan_to_num(k)
    v = np.nan_to_num(v)
    qpos = lens[:, None] - nq + np.arange(nq)[None]                        # [B, Q]
    mask = np.arange(t)[None, None, :] <= qpos[:, :, None]                 # [B, Q, T]
    mask &= np.arange(t)[None, None, :] < lens[:, None, None]
    if softcap is None:
        out = jax.nn.dot_product_attention(jnp.asarray(q, jnp.float32), jnp.asarray(k), jnp.asarray(v),
                                           mask=jnp.asarray(mask[:, None]))
        out = np.asarray(out, np.float64)
    else:
        kv = k.shape[2]
        qq = np.asarray(q, np.float64).reshape(b, nq, kv, h // kv, d)
        s = np.einsum("bqjrd,btjd->bqjrt", qq, k.astype(np.float64)) / np.sqrt(d)
        s = softcap * np.tanh(s / softcap)
        s = np.where(mask[:, :, None, None], s, -np.inf)
        m = s.max(-1, keepdims=True)
        p = np.exp(s - np.where(np.isfinite(m), m, 0))
        out = np.einsum("bqjrt,btjd->bqjrd", p, v.astype(np.float64)) / np.maximum(p.sum(-1), 1e-300)[..., None]
        out = out.reshape(b, nq, h, d)
    # rows that see nothing (length 0) are zeros by contract
    return np.where((qpos >= 0)[:, :, None, None], out, 0.0)


# ----------------------------------------------------------------------------------------------------------------
# kernel vs reference (interpret mode on CPU)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nq,r,g,dtype,softcap,tuning", [
    (1, 1, 1, jnp.float32, None, dict(num_splits=2, pages_per_block=2)),
    (1, 4, 1, jnp.bfloat16, None, dict(num_splits=1, pages_per_block=1)),
    (3, 8, 1, jnp.float32, 5.0, dict(num_splits=4, pages_per_block=1)),
    (1, 4, 2, jnp.float32, None, dict(num_splits=2, pages_per_block=2)),
    (3, 4, 2, jnp.bfloat16, 5.0, dict(num_splits=2, pages_per_block=4)),
    (1, 8, 1, jnp.bfloat16, None, None),
])
def test_kernel_matches_ref(nq, r, g, dtype, softcap, tuning):
    # lengths 0, 1, odd, page-aligned, and a sparse selection (not every page of the longest sequence)
    case = make_case(10 * nq + r + g, lens=[0, 1, 21, 32, 45], nq=nq, r=r, g=g, dtype=dtype, select=4,
                     slots=7)
    out = sda.sparse_decode_attention(*args_of(case), softcap=softcap, impl="pallas", tuning=tuning)
    ref = sda.ref_sparse_decode_attention(*args_of(case), softcap=softcap)
    assert out.dtype == dtype and out.shape == case["q"].shape
    assert rel_err(out, ref) < TOL[dtype]
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # seq_len 0: zeros


@pytest.mark.parametrize("nq,r,g", [(1, 4, 1), (3, 1, 2)])
def test_all_pages_equals_dense(nq, r, g):
    lens = [1, 7, 8, 29, 40]
    case = make_case(3 + nq, lens=lens, nq=nq, r=r, g=g, slots=6)
    want = dense_attention(np.asarray(case["q"]), case["dense_k"], case["dense_v"], lens)
    ref = sda.ref_sparse_decode_attention(*args_of(case))
    out = sda.sparse_decode_attention(*args_of(case), impl="pallas", tuning=dict(num_splits=2, pages_per_block=2))
    assert rel_err(ref, want) < 1e-5
    assert rel_err(out, want) < 1e-5


def test_softcap_ref_equals_dense():
    lens = [5, 24, 30]
    case = make_case(5, lens=lens, nq=2, r=2)
    want = dense_attention(np.asarray(case["q"]), case["dense_k"], case["dense_v"], lens, softcap=3.0)
    assert rel_err(sda.ref_sparse_decode_attention(*args_of(case), softcap=3.0), want) < 1e-5


def test_slot_order_does_not_matter():
    case = make_case(7, lens=[19, 40], r=4, slots=8)
    perm = np.random.default_rng(1).permutation(8)
    a = sda.sparse_decode_attention(*args_of(case), impl="pallas", tuning=dict(num_splits=2, pages_per_block=1))
    case2 = dict(case, page_frame=case["page_frame"][:, :, perm], page_start=case["page_start"][:, :, perm])
    b = sda.sparse_decode_attention(*args_of(case2), impl="pallas", tuning=dict(num_splits=2, pages_per_block=1))
    assert rel_err(a, b) < 1e-6


def test_auto_is_ref_on_cpu():
    if ON_GPU:
        pytest.skip("on GPU auto runs the kernel")
    case = make_case(8, lens=[3, 17], r=2)
    np.testing.assert_array_equal(np.asarray(sda.sparse_decode_attention(*args_of(case))),
                                  np.asarray(sda.ref_sparse_decode_attention(*args_of(case))))


def test_mosaic_applies_to_resident_half_precision_pages():
    # what the Mosaic kernel serves (which kernel runs is kernel_choice's: tests/test_kernel_choice.py)
    q = jnp.zeros((4, 1, 64, 128), jnp.bfloat16)                  # [B, Q, H, D]: 8 query rows per kv head
    pool = jnp.zeros((16, 64, 1, 128), jnp.bfloat16)               # [F, t, g, D]
    assert sda._mosaic_applies(q, pool, 8, None, False)
    assert not sda._mosaic_applies(q, pool, 8, None, True)                          # fused fetch reads the host
    assert not sda._mosaic_applies(q.astype(jnp.float32), pool.astype(jnp.float32), 8, None, False)
    assert not sda._mosaic_applies(jnp.zeros((4, 2, 512, 128), jnp.bfloat16), pool, 8, None, False)  # 128 rows


def test_bad_shapes_raise():
    case = make_case(9, lens=[3, 17], r=2)
    a = args_of(case)
    with pytest.raises(ValueError):
        sda.sparse_decode_attention(a[0][:, :, :3], *a[1:])        # H not a multiple of KV
    with pytest.raises(ValueError):
        sda.sparse_decode_attention(*a[:5], a[5][:1])               # seq_len of the wrong batch
    with pytest.raises(ValueError):
        sda.sparse_decode_attention(*a, page_src=jnp.full(a[3].shape, 2, jnp.int32))  # host read, no host pool


@pytest.mark.parametrize("nq,r,softcap,splits", [(1, 8, None, 3), (3, 4, 5.0, 2), (1, 1, None, 1)])
def test_mosaic_wrapper_packing_and_merge(nq, r, softcap, splits):
    # the Mosaic kernel has no CPU interpreter (no wgmma there); its jnp stand-in checks the packing of query rows,
    # the padded splits, the clipping of garbage frames and the log-sum-exp merge
    case = make_case(40 + r, lens=[0, 1, 21, 32, 45], nq=nq, r=r, dtype=jnp.float32, select=4, slots=7)
    a = args_of(case)
    got = sda._mosaic_attention(*a, scale=1 / np.sqrt(a[0].shape[-1]), softcap=softcap, num_splits=splits,
                                max_concurrent_steps=2, use_ref=True)
    assert rel_err(got, sda.ref_sparse_decode_attention(*a, softcap=softcap)) < 1e-5


def test_mosaic_tuning_pads_little():
    for b, k in ((8, 18), (8, 34), (8, 66), (32, 66), (1, 5), (1, 34), (3, 34), (1, 66)):
        t = sda.default_mosaic_tuning(b, 8, k)
        s, steps = t["num_splits"], -(-k // t["num_splits"])
        assert 1 <= s <= k and steps * s - k <= max(1, k // 10)
        assert -(-k // (s - 1)) > steps if s > 1 else True          # one split fewer would take a step more
    # the decode's 34 slots (32 selected + 2 tail pages) at batch 1: 17 splits of 2 steps, nothing padded
    assert sda.default_mosaic_tuning(1, 8, 34)["num_splits"] == 17


# ----------------------------------------------------------------------------------------------------------------
# host pool: zero-copy reads (2) and the fused fill (3)
# ----------------------------------------------------------------------------------------------------------------
def host_case(seed, dtype=jnp.float32, g=1, nq=1):
    """Some attended pages missing from HBM: their frames hold NaN, the host pool holds the true page."""
    case = make_case(seed, lens=[0, 13, 40, 33], nq=nq, g=g, r=2, dtype=dtype, slots=7)
    rng = np.random.default_rng(seed + 100)
    start = np.asarray(case["page_start"])
    frame = np.asarray(case["page_frame"])
    used = start >= 0
    src = np.where(used, rng.choice([1, 2, 3], size=start.shape, p=[0.4, 0.3, 0.3]), 0).astype(np.int32)
    n_host = 64
    host_page = rng.permutation(n_host)[: src.size].reshape(src.shape).astype(np.int32) if src.size <= n_host else None
    host_page = rng.integers(0, n_host, src.shape).astype(np.int32) if host_page is None else host_page
    host_page = np.where(src >= 2, host_page, -7).astype(np.int32)   # garbage where unused
    pool_k = np.array(case["pool_k"], np.float32)
    pool_v = np.array(case["pool_v"], np.float32)
    host_k = np.full((n_host,) + pool_k.shape[1:], np.nan, np.float32)
    host_v = np.full((n_host,) + pool_v.shape[1:], np.nan, np.float32)
    miss = src >= 2
    host_k[host_page[miss]] = pool_k[frame[miss]]
    host_v[host_page[miss]] = pool_v[frame[miss]]
    # copies: on CPU jnp.asarray may share the numpy buffer, and pool_k is overwritten next
    true_k, true_v = jnp.asarray(pool_k.copy(), dtype), jnp.asarray(pool_v.copy(), dtype)
    pool_k[frame[miss]] = np.nan                                       # not in HBM yet
    pool_v[frame[miss]] = np.nan
    return dict(case, pool_k=jnp.asarray(pool_k, dtype), pool_v=jnp.asarray(pool_v, dtype),
                host_k=jnp.asarray(host_k, dtype), host_v=jnp.asarray(host_v, dtype),
                page_host=jnp.asarray(host_page), page_src=jnp.asarray(src), true_k=true_k, true_v=true_v)


def host_kwargs(c):
    return dict(host_k=c["host_k"], host_v=c["host_v"], page_host=c["page_host"], page_src=c["page_src"])


@pytest.mark.parametrize("g,nq,dtype", [(1, 1, jnp.float32), (2, 3, jnp.bfloat16)])
def test_host_reads_and_fused_fill(g, nq, dtype):
    c = host_case(11 + g, dtype=dtype, g=g, nq=nq)
    a = args_of(c)
    resident = sda.ref_sparse_decode_attention(a[0], c["true_k"], c["true_v"], *a[3:])
    ref_out, ref_k, ref_v = sda.ref_sparse_decode_attention(*a, **host_kwargs(c), store_misses=True)
    out, new_k, new_v = sda.sparse_decode_attention(*a, **host_kwargs(c), store_misses=True, impl="pallas",
                                                    tuning=dict(num_splits=2, pages_per_block=2))
    assert rel_err(ref_out, resident) < 1e-6
    assert rel_err(out, ref_out) < TOL[dtype]
    # the fill wrote exactly the src == 3 frames (with their host page) and nothing else
    src, frame = np.asarray(c["page_src"]), np.asarray(c["page_frame"])
    stored = np.zeros(c["pool_k"].shape[0], bool)
    stored[frame[src == 3]] = True
    as_bits = lambda x: np.asarray(x).view(np.uint16 if dtype == jnp.bfloat16 else np.uint32)
    for new, ref_new, old, true in ((new_k, ref_k, c["pool_k"], c["true_k"]), (new_v, ref_v, c["pool_v"], c["true_v"])):
        np.testing.assert_array_equal(as_bits(new), as_bits(ref_new))
        np.testing.assert_array_equal(as_bits(new)[~stored], as_bits(old)[~stored])
        np.testing.assert_array_equal(as_bits(new)[stored], as_bits(true)[stored])
    # without store_misses, 3 reads like 2 and only the output comes back
    out2 = sda.sparse_decode_attention(*a, **host_kwargs(c), impl="pallas",
                                       tuning=dict(num_splits=1, pages_per_block=4))
    assert rel_err(out2, ref_out) < TOL[dtype]


def test_fetch_then_resident_attention_equals_host_reads():
    # the separate-fetch alternative to the fused fill: page_copy.fetch moves the missed pages into their frames,
    # after which all-resident attention equals the answer that read them from the host pool
    c = host_case(21)
    src, frame, hp = np.asarray(c["page_src"]), np.asarray(c["page_frame"]), np.asarray(c["page_host"])
    miss = src >= 2
    fr = np.concatenate([frame[miss], [-1, -1]]).astype(np.int32)      # two skipped requests
    hpg = np.concatenate([hp[miss], [3, 5]]).astype(np.int32)
    got = page_copy.fetch([c["pool_k"], c["pool_v"]], [c["host_k"], c["host_v"]], jnp.asarray(hpg), jnp.asarray(fr),
                          impl="pallas")
    a = args_of(c)
    out = sda.ref_sparse_decode_attention(a[0], got[0], got[1], *a[3:])
    assert rel_err(out, sda.ref_sparse_decode_attention(a[0], c["true_k"], c["true_v"], *a[3:])) < 1e-6


# ----------------------------------------------------------------------------------------------------------------
# compiled on the GPU at a realistic size
# ----------------------------------------------------------------------------------------------------------------
@gpu
@needs_gpu
@pytest.mark.parametrize("nq,dtype", [(1, jnp.bfloat16), (3, jnp.bfloat16), (1, jnp.float32)])
def test_gpu_realistic(nq, dtype):
    # B=4, H=64, KV=8, D=128, page 64: 2048-token budget over sequences of up to 20K tokens
    case = make_case(31, lens=[0, 1000, 20000, 12345], nq=nq, ng=8, r=8, d=128, page=64, slots=34, select=34,
                     dtype=dtype)
    ref = sda.ref_sparse_decode_attention(*args_of(case))
    ref_cap = sda.ref_sparse_decode_attention(*args_of(case), softcap=30.0)
    impls = ["pallas"] + (["mosaic"] if dtype != jnp.float32 else [])
    for impl in impls:
        out = sda.sparse_decode_attention(*args_of(case), impl=impl)
        assert rel_err(out, ref) < TOL[dtype], impl
        out = sda.sparse_decode_attention(*args_of(case), softcap=30.0, impl=impl)
        assert rel_err(out, ref_cap) < TOL[dtype], impl


@gpu
@needs_gpu
def test_gpu_fused_fill_from_pinned_host():
    from ulacache_jax.cache.state import host_sharding
    c = host_case(41, dtype=jnp.bfloat16)
    a = args_of(c)
    hs = host_sharding()
    kw = host_kwargs(c)
    ref_out, ref_k, ref_v = sda.ref_sparse_decode_attention(*a, **kw, store_misses=True)  # device copies
    kw["host_k"] = jax.device_put(c["host_k"], hs)
    kw["host_v"] = jax.device_put(c["host_v"], hs)
    run = jax.jit(lambda pk, pv, hk, hv: sda.sparse_decode_attention(
        a[0], pk, pv, *a[3:], host_k=hk, host_v=hv, page_host=kw["page_host"], page_src=kw["page_src"],
        store_misses=True), donate_argnums=(0, 1))
    out, new_k, new_v = run(jnp.array(c["pool_k"]), jnp.array(c["pool_v"]), kw["host_k"], kw["host_v"])
    assert rel_err(out, ref_out) < TOL[jnp.bfloat16]
    np.testing.assert_array_equal(np.asarray(new_k).view(np.uint16), np.asarray(ref_k).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(new_v).view(np.uint16), np.asarray(ref_v).view(np.uint16))
    assert kw["host_k"].sharding.memory_kind == hs.memory_kind
