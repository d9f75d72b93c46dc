"""The one resolver of kernel choices (ulacache_jax/cache/kernel_choice.py) against its table (docs/KERNELS.md): every
cell of the table, on CPU and for simulated GPU platforms (Hopper and not, bf16 and fp32), the conditions listed
under the table, and that a backend resolves once, at construction, and its program runs what was resolved."""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import pytest

from ulacache_jax.cache.decode_layer import DecodeOptions
from ulacache_jax.runtime.generator import default_cache_config
from ulacache_jax.cache.kernel_choice import (TOPK_MAX_PAGES, Platform, ResolvedKernels, is_resolved, resolve,
                                        resolved_options)
from ulacache_jax.models import get_preset

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "KERNELS.md")
COLUMNS = {  # table header -> (platform, dtype of queries and cache)
    "GPU Hopper bf16": (Platform("gpu", hopper=True), "bfloat16"),
    "GPU Hopper fp32": (Platform("gpu", hopper=True), "float32"),
    "GPU other bf16": (Platform("gpu"), "bfloat16"),
    "GPU other fp32": (Platform("gpu"), "float32"),
    "CPU": (Platform("cpu"), "bfloat16"),
}


def table() -> dict[str, dict[str, str]]:
    """docs/KERNELS.md's table: ResolvedKernels field -> {column header: implementation}."""
    lines = [l for l in open(DOC).read().splitlines() if l.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        field = cells[header.index("field")].strip("`")
        rows[field] = {h: cells[header.index(h)].strip("`") for h in COLUMNS}
    return rows


def llama_cache(dtype: str, **overrides):
    """The table's case: a Llama-3.1-8B cache (head_dim 128, page 64, one KV head per group) at 4K tokens."""
    mc = get_preset("llama-3.1-8b")
    return mc, default_cache_config(mc, num_seqs=2, max_tokens=4096, dtype=dtype, **overrides)


def resolve_for(column: str, options=DecodeOptions(), **overrides) -> ResolvedKernels:
    platform, dtype = COLUMNS[column]
    mc, cfg = llama_cache(dtype, **overrides)
    return resolve(options, cfg, platform, query_dtype=dtype, query_heads_per_kv=mc.num_queries_per_kv)


def test_table_has_every_choice():
    assert set(table()) == {f.name for f in dataclasses.fields(ResolvedKernels)}


@pytest.mark.parametrize("column", list(COLUMNS))
def test_resolver_matches_the_table(column):
    got = resolve_for(column)
    for field, cells in table().items():
        assert getattr(got, field) == cells[column], (field, column)


@pytest.mark.gpu
def test_the_current_platform_matches_its_column():
    """On the machine running the tests (CPU in CI; on the H200, in `make test-gpu`, its Hopper column)."""
    p = Platform.current()
    assert p == Platform.of(jax.devices()[0])
    column = "CPU" if not p.gpu else ("GPU Hopper bf16" if p.hopper else "GPU other bf16")
    mc, cfg = llama_cache("bfloat16")
    got = resolve(DecodeOptions(), cfg, p, query_dtype="bfloat16", query_heads_per_kv=mc.num_queries_per_kv)
    assert {f: getattr(got, f) for f in table()} == {f: c[column] for f, c in table().items()}


@pytest.mark.parametrize("why,overrides,options,query", [
    ("fused fetch reads the host pool", {}, DecodeOptions(fused_fetch=True), {}),
    ("two KV heads per group", dict(kv_heads_per_group=2), DecodeOptions(), {}),
    ("page 16", dict(page_size=16), DecodeOptions(), {}),
    ("more than 64 query rows per KV head", {}, DecodeOptions(), dict(query_heads_per_kv=128)),
    ("bf16 queries over an fp32 cache", dict(dtype="float32"), DecodeOptions(), dict(query_dtype="bfloat16")),
])
def test_mosaic_only_where_it_applies(why, overrides, options, query):
    mc, cfg = llama_cache("bfloat16")
    cfg = dataclasses.replace(cfg, **overrides)
    q = dict(query_dtype=cfg.dtype, query_heads_per_kv=mc.num_queries_per_kv) | query
    assert resolve(options, cfg, Platform("gpu", hopper=True), **q).attention == "pallas", why
    assert resolve(DecodeOptions(), llama_cache("bfloat16")[1], Platform("gpu", hopper=True), query_dtype="bfloat16",
                   query_heads_per_kv=4).attention == "mosaic"


def test_topk_kernel_only_for_rows_it_was_timed_at():
    mc, cfg = llama_cache("bfloat16")
    gpu = Platform("gpu", hopper=True)
    at_cap = dataclasses.replace(cfg, max_pages_per_seq=TOPK_MAX_PAGES, host_pages=cfg.host_pages * 4)
    past = dataclasses.replace(cfg, max_pages_per_seq=TOPK_MAX_PAGES + 1, host_pages=cfg.host_pages * 8)
    assert resolve(DecodeOptions(), at_cap, gpu).topk == "pallas"
    assert resolve(DecodeOptions(), past, gpu).topk == "ref"
    assert resolve(DecodeOptions(topk="pallas"), past, gpu).topk == "pallas"        # forced: as given


def test_forced_choices_pass_and_unknown_names_fail():
    forced = DecodeOptions(attention="pallas", sieve="ref", scores="ref", topk="ref", copy="ref")
    got = resolve_for("GPU Hopper bf16", forced)
    assert (got.attention, got.sieve, got.scores, got.topk, got.copy) == ("pallas", "ref", "ref", "ref", "ref")
    assert resolve_for("CPU", DecodeOptions(attention="pallas")).attention == "pallas"       # interpret mode
    with pytest.raises(ValueError, match="attention = 'fast'"):
        resolve_for("CPU", DecodeOptions(attention="fast"))
    with pytest.raises(ValueError, match="sieve = 'mosaic'"):
        resolve_for("CPU", DecodeOptions(sieve="mosaic"))


def test_decode_options_carry_the_resolution():
    got = resolve_for("GPU Hopper bf16", DecodeOptions(fused_fetch=False, softcap=30.0))
    opts = got.decode_options(DecodeOptions(softcap=30.0))
    assert is_resolved(opts) and opts.attention == "mosaic" and opts.softcap == 30.0
    assert not is_resolved(DecodeOptions())
    # trace-time resolution for direct callers: the current platform, the queries' dtype and GQA ratio
    mc, cfg = llama_cache("bfloat16")
    q = jnp.zeros((cfg.max_seqs, 1, mc.num_heads, mc.head_dim), jnp.bfloat16)
    assert resolved_options(opts, cfg, q) is opts
    want = resolve(DecodeOptions(), cfg, Platform.current(), query_dtype="bfloat16", query_heads_per_kv=4)
    assert resolved_options(DecodeOptions(), cfg, q) == want.decode_options(DecodeOptions())


def test_platform_of_a_device():
    assert Platform.of(jax.devices("cpu")[0]) == Platform("cpu")

    class H200:
        platform, compute_capability = "gpu", "9.0"

    class A100:
        platform, compute_capability = "gpu", "8.0"
    assert Platform.of(H200()) == Platform("gpu", hopper=True) and Platform.of(A100()) == Platform("gpu")


@pytest.mark.gpu
def test_a_backend_resolves_once_at_construction(monkeypatch):
    """Generator -> make_backend resolves the kernels for the mesh's platform, once; the program's ops carry them
    (prefill and dense attention included), and decoding does not resolve again."""
    from flax import nnx
    from ulacache_jax.runtime import backends
    from ulacache_jax.cache import kernel_choice
    from ulacache_jax.runtime.generator import Generator
    from ulacache_jax.models import LlamaModel

    calls = []
    real = kernel_choice.resolve
    monkeypatch.setattr(backends, "resolve", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    mc = get_preset("tiny")
    model = LlamaModel(mc, dtype=jnp.float32, rngs=nnx.Rngs(0))
    for attention in ("sparse", "dense"):
        cfg = default_cache_config(mc, num_seqs=2, max_tokens=64, page_size=16)
        gen = Generator(model, cfg, attention=attention)
        k = gen.backend.ops.kernels
        assert k == resolve(DecodeOptions(), cfg, Platform.current(), query_dtype=jnp.float32,
                            query_heads_per_kv=mc.num_queries_per_kv)
        assert is_resolved(gen.backend.ops.options) and gen.program.ops is gen.backend.ops
    assert calls == [Platform.current()] * 2
