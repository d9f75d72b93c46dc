"""Every Triton kernel lowers for an H200 on a machine without a GPU.

jax lowers a Pallas call to Triton IR at `jit(...).lower()` time; with an abstract H200 device
(`jax.sharding.use_abstract_mesh`) and `lowering_platforms=("cuda",)` that runs on CPU, so an unsupported primitive
or a bad block shape in a kernel fails here, in CI, instead of on the device. What this cannot see: Triton's own
compile to PTX and XLA's GPU compile (those run on the H200: `pytest -m gpu`).
"""
import pytest
import jax
import jax.numpy as jnp
from jax._src import mesh as mesh_lib

from ulacache_jax.cache import kernel_choice
from ulacache_jax.cache import pb_lru
from ulacache_jax.pallas_kernels import page_copy, pb_lru_sieve
from ulacache_jax.pallas_kernels import sparse_decode_attention as sda
from ulacache_jax.pallas_kernels.page_scores import page_scores_pallas
from ulacache_jax.pallas_kernels.sparse_decode_attention import _pallas_attention

TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture(autouse=True)
def _fresh_jit_caches():
    """Traces made here (GPU dispatch, interpret=False) must never be reused by a CPU test in this process."""
    yield
    jax.clear_caches()


def lower_for_h200(fn, *args) -> str:
    """StableHLO text of fn lowered for CUDA on an abstract H200 (no GPU needed)."""
    # Auto axis: the library runs without an explicit-sharding mesh (an Explicit axis, the default, types iotas
    # as sharded and refuses updates that mix them with unsharded operands)
    h200 = mesh_lib.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                 abstract_device=mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                                                         platform="cuda"))
    with jax.sharding.use_abstract_mesh(h200):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("block_pages,num_warps", [(None, None), (32, 4), (128, 8)])
def test_page_scores_lowers(block_pages, num_warps):
    S, L, G, P, g, D = 2, 2, 8, 256, 1, 128
    summ, q = spec((S, L, G, P, g, D), jnp.bfloat16), spec((S, G, g, D), jnp.float32)
    txt = lower_for_h200(lambda a, b, c, d: page_scores_pallas(a, b, c, d, layer=1, interpret=False,
                                                               block_pages=block_pages, num_warps=num_warps),
                         summ, summ, q, q)
    assert txt.count(TRITON_CALL) == 1


@pytest.mark.parametrize("grouping", pb_lru_sieve.GROUPINGS)
@pytest.mark.parametrize("nb,ns,n", [(128, 512, 8192), (16, 4096, 1024)])
def test_sieve_lowers(grouping, nb, ns, n):
    cfg = pb_lru_sieve.choose_config(n, nb, ns, grouping=grouping)
    state = jax.eval_shape(lambda: pb_lru.init(nb, ns))
    slots = (state.tag_hi, state.tag_lo, state.stamp)
    u = spec((n,), jnp.uint32)
    txt = lower_for_h200(lambda st, hi, lo, v, now: pb_lru_sieve.access(st, hi, lo, v, now, config=cfg,
                                                                         interpret=False),
                         slots, u, u, spec((n,), jnp.bool_), spec((), jnp.int32))
    assert txt.count(TRITON_CALL) >= 1


def test_page_copy_lowers():
    pool, host = spec((512, 64, 1, 128), jnp.bfloat16), spec((4096, 64, 1, 128), jnp.bfloat16)
    idx = spec((300,), jnp.int32)
    txt = lower_for_h200(lambda dk, dv, sk, sv, si, di: page_copy.copy_pages_pallas(
        [dk, dv], [sk, sv], si, di, interpret=False), pool, pool, host, host, idx, idx)
    assert txt.count(TRITON_CALL) == 1


@pytest.mark.parametrize("store_misses", [False, True])
def test_sparse_attention_triton_lowers(store_misses):
    B, H, KV, D, page, nslot, nf, nh = 4, 64, 8, 128, 64, 34, 2048, 8192
    q = spec((B, 1, H, D), jnp.bfloat16)
    pool, host = spec((nf, page, 1, D), jnp.bfloat16), spec((nh, page, 1, D), jnp.bfloat16)
    tab = spec((B, KV, nslot), jnp.int32)
    txt = lower_for_h200(lambda q, pk, pv, fr, st, sl, hk, hv, hp, src: _pallas_attention(
        q, pk, pv, fr, st, sl, hk, hv, hp, src, scale=D ** -0.5, softcap=None, store_misses=store_misses,
        interpret=False, num_splits=4, pages_per_block=2, num_warps=4, num_stages=2),
        q, pool, pool, tab, tab, spec((B,), jnp.int32), host, host, tab, tab)
    assert txt.count(TRITON_CALL) >= 1


def test_token_attention_triton_lowers():
    from ulacache_jax.pallas_kernels.token_decode_attention import _pallas_tokens
    B, H, G, D, page, N, nf = 3, 32, 8, 128, 16, 4096 + 32, 4096
    pool = spec((nf, page, 1, D), jnp.bfloat16)
    lst = spec((B, G, N), jnp.int32)
    txt = lower_for_h200(lambda q, pk, pv, fr, rw, pos, sl: _pallas_tokens(
        q, pk, pv, fr, rw, pos, sl, scale=D ** -0.5, softcap=None, interpret=False, num_splits=4,
        tokens_per_block=64, num_warps=4, num_stages=2),
        spec((B, 1, H, D), jnp.bfloat16), pool, pool, lst, lst, lst, spec((B,), jnp.int32))
    assert txt.count(TRITON_CALL) == 1


@pytest.mark.parametrize("options,triton,mosaic", [
    (dict(), 6, 1),                                     # tail append, scores, top-k, sieve, fetch, tail flush; Mosaic
    (dict(fused_fetch=True), 6, 0),                     # no fetch launch: Triton attention reads misses from host
    (dict(topk="ref"), 5, 1),                           # lax.top_k instead of the top-k kernel
    (dict(attention="pallas"), 7, 0),                   # Triton attention for Mosaic's
    (dict(attention="mosaic"), 6, 1),
    (dict(copy="ref"), 4, 1),                           # XLA for the append and the fetch (the flush keeps its kernel)
])
def test_decode_layer_lowers_with_gpu_dispatch(monkeypatch, options, triton, mosaic):
    """One layer's decode as the GPU runs it (impl="auto" picks the kernels), default and forced kernels."""
    from ulacache_jax.cache.state import init as init_state
    from ulacache_jax.cache.config import CacheConfig
    from ulacache_jax.cache.decode_layer import DecodeOptions, attend_layer, flush_tail

    cfg = CacheConfig(num_layers=2, num_kv_heads=8, head_dim=128, max_seqs=2, max_pages_per_seq=256, page_size=64,
                      kv_heads_per_group=1, dtype="bfloat16", num_buckets=16, slots_per_bucket=64,
                      host_pages=2 * 2 * 8 * 256, token_budget=1024, sink_pages=1, recent_pages=2)
    state, host = jax.eval_shape(lambda: init_state(cfg, check=False))
    S = cfg.max_seqs
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(sda, "on_hopper", lambda: True)       # lowered for the H200 (sm_90) from a CPU machine
    monkeypatch.setattr(kernel_choice.Platform, "current", staticmethod(lambda: kernel_choice.Platform("gpu", True)))

    def layer(st, hp, q, kn, pos, live):
        st, out, stats = attend_layer(st, hp, 1, q, kn, kn, pos, live, options=DecodeOptions(**options))
        return flush_tail(st, hp), out

    txt = lower_for_h200(layer, state, host, spec((S, 1, 64, 128), jnp.bfloat16), spec((S, 8, 128), jnp.bfloat16),
                         spec((S,), jnp.int32), spec((S,), jnp.bool_))
    assert (txt.count(TRITON_CALL), txt.count("custom_call @mosaic_gpu")) == (triton, mosaic)


def test_sparse_attention_mosaic_lowers(monkeypatch):
    """The Mosaic GPU attention kernel (what the decode runs on Hopper for resident pages) lowers too."""
    from ulacache_jax.pallas_kernels.sparse_decode_attention import sparse_decode_attention
    B, H, KV, D, page, nslot, nf = 4, 64, 8, 128, 64, 34, 2048
    q, pool = spec((B, 1, H, D), jnp.bfloat16), spec((nf, page, 1, D), jnp.bfloat16)
    tab = spec((B, KV, nslot), jnp.int32)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(sda, "on_hopper", lambda: True)
    txt = lower_for_h200(lambda q, pk, pv, fr, st, sl: sparse_decode_attention(q, pk, pv, fr, st, sl, impl="mosaic"),
                         q, pool, pool, tab, tab, spec((B,), jnp.int32))
    assert "custom_call @mosaic_gpu" in txt and TRITON_CALL not in txt


def test_sparse_attention_mosaic_lowers_under_shard_map(monkeypatch):
    """TP decode runs the attention per rank under shard_map: the Mosaic kernel (the Hopper default) lowers there,
    one launch per rank over that rank's heads and pool (2 ranks on an abstract H200 mesh)."""
    from jax.sharding import PartitionSpec as P
    B, H, KV, D, page, nslot, nf = 4, 64, 8, 128, 64, 34, 2048
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(sda, "on_hopper", lambda: True)
    mesh = mesh_lib.AbstractMesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                                 abstract_device=mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                                                         platform="cuda"))
    rank = jax.shard_map(lambda q, pk, pv, fr, st, sl: sda.sparse_decode_attention(q, pk[0], pv[0], fr, st, sl,
                                                                                    impl="mosaic"),
                         mesh=mesh, in_specs=(P(None, None, "tp"), P("tp"), P("tp"), P(None, "tp"), P(None, "tp"), P()),
                         out_specs=P(None, None, "tp"))
    pool, tab = spec((2, nf, page, 1, D), jnp.bfloat16), spec((B, KV, nslot), jnp.int32)   # [R, F, t, g, D]
    with jax.sharding.use_abstract_mesh(mesh):
        txt = jax.jit(rank).trace(spec((B, 1, H, D), jnp.bfloat16), pool, pool, tab, tab,
                                  spec((B,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("custom_call @mosaic_gpu") == 1 and TRITON_CALL not in txt


def test_page_select_lowers_to_one_launch_without_pad_or_sort():
    """The candidate masking, the top-k and the page order are all in the kernel: no XLA pad before it (the
    block masks the row's padding) and no sort after it."""
    from ulacache_jax.pallas_kernels.page_topk import select_pages_pallas
    txt = lower_for_h200(lambda s, f: select_pages_pallas(s, f, 32, sink=1, recent=2, groups=8, interpret=False),
                         spec((256, 4224), jnp.float32), spec((32,), jnp.int32))
    assert txt.count(TRITON_CALL) == 1
    assert "stablehlo.sort" not in txt and "stablehlo.pad" not in txt


@pytest.mark.parametrize("tp", [1, 2])
def test_ingest_passes_the_host_pool_to_the_flush_kernel_only(monkeypatch, tp):
    """Prefill ingestion writes complete pages through with one flush launch per rank that indexes the rank inside
    the kernel: no XLA slice, reshape or stack of the pinned_host pool (XLA may run those as host copies of the
    whole pool; the ingest once sliced and stacked it)."""
    from ulacache_jax.cache.state import init as init_state
    from ulacache_jax.cache.config import CacheConfig
    from ulacache_jax.runtime.sequences import ingest_chunk

    cfg = CacheConfig(num_layers=2, num_kv_heads=8, head_dim=128, max_seqs=2, max_pages_per_seq=64, page_size=64,
                      kv_heads_per_group=1, dtype="bfloat16", num_buckets=16, slots_per_bucket=64,
                      host_pages=2 * 2 * 8 * 64, token_budget=1024, sink_pages=1, recent_pages=2, tp=tp)
    state, host = jax.eval_shape(lambda: init_state(cfg, check=False))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    kv = spec((2, 1024, 8, 128), jnp.bfloat16)
    txt = lower_for_h200(lambda st, hp, k, v: ingest_chunk(st, hp, 1, k, v, 0, 1000)[1], state, host, kv, kv)
    assert txt.count(TRITON_CALL) == tp
    pool_type = "tensor<" + "x".join(map(str, host.k.shape)) + "xbf16>"
    # every op that reads a pool-shaped value is the flush kernel (or the function's return)
    readers = [ln.strip() for ln in txt.splitlines() if pool_type in ln and "= " in ln and "custom_call" not in ln
               and "sharding_constraint" not in ln]
    assert not [ln for ln in readers if any(op in ln for op in ("slice", "reshape", "concatenate", "broadcast"))], readers
