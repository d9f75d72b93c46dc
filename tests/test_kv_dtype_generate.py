"""Quantised K/V pages through the library on a tiny model: fp8 pages (CacheConfig.kv_dtype) and a second codec
defined in this file alone (int8 with a scale per page and KV head, jnp only), each run through `generate` and
checked against model-dtype pages by the decode step's logits.

Tolerance: a codec's decoded value of an element is within 2**-4 of it relatively for e4m3 (3 mantissa bits; int8
with a per-page amax scale is finer for all but the page's smallest values), so no attention output, and no logit
downstream of it, moves by more than that fraction of its scale when the error does not compound across the two
layers; the tests hold the logits' relative L2 error below 2**-4 and check that it is not zero (the pages really
are quantised)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from ulacache_jax import generate
from ulacache_jax.cache.codec import ScaledCodec
from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generation import Generator, default_cache_config
from ulacache_jax.runtime.sampling import SamplingArrays, row_keys
from ulacache_jax.models import LlamaModel, get_preset

REL_TOL = 2.0**-4


@dataclasses.dataclass(frozen=True)
class Int8Pages(ScaledCodec):
    """int8 codes, a float32 scale per page and KV head (amax / 127), rounded to nearest: a page format the
    library does not ship, defined here alone."""
    dtype: str = "int8"
    max_code: float = 127.0

    def to_codes(self, y):
        return jnp.round(y).astype(jnp.int8)


@pytest.fixture(scope="module")
def model():
    return LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))


def prompts():
    rng = np.random.default_rng(0)
    doc = [int(t) for t in rng.integers(0, 256, 100)]
    return [doc + [int(t) for t in rng.integers(0, 256, n)] for n in (5, 23)]


def cache_config(model, **kw):
    # budget of 4 pages of 16: 100+ token prompts select pages, so fetches and the PB-LRU run too
    return default_cache_config(model.config, num_seqs=2, max_tokens=192, page_size=16, token_budget=64, **kw)


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def step_logits(model, cfg, ps):
    """Prefill every prompt into its own slot, then: the next step's logits [S, V]; one greedy decode chunk of
    page_size steps (crossing a page boundary, so its chunk end flushes a page through the codec); the next step's
    logits again, and the chunk's tokens."""
    gen = Generator(model, cfg, attention="sparse")
    slots = [gen.admit(len(p) + 40) for p in ps]
    last = []
    for s, p in zip(slots, ps):
        gen.prefill(s, p)
        last.append(p[-1])
    S = cfg.max_seqs
    tok = np.zeros(S, np.int32)
    tok[slots] = last
    first = np.asarray(gen.next_logits(tok))[slots]
    done = np.ones(S, bool)
    done[slots] = False
    remaining = np.where(done, 0, 100).astype(np.int32)
    keys = row_keys(jnp.zeros(S, jnp.uint32), jnp.zeros(S, jnp.int32))
    sampling = SamplingArrays.fill(S)                             # greedy
    out, _, _ = gen.decode_chunk(jnp.asarray(tok), jnp.asarray(done), jnp.asarray(remaining), keys, sampling,
                                 jnp.full(8, -1, jnp.int32))      # no stop ids
    out = np.asarray(out)[slots]
    tok[slots] = out[:, -1]
    return first, np.asarray(gen.next_logits(tok))[slots], out, gen


@pytest.mark.parametrize("codec", ["float8_e4m3fn", pytest.param(Int8Pages(), marks=pytest.mark.slow)],
                         ids=["fp8", "int8"])
def test_quantised_pages_keep_the_decode_logits(model, codec):
    ps = prompts()
    base = cache_config(model)
    quant = dataclasses.replace(base, **({"kv_dtype": codec} if isinstance(codec, str) else {"page_codec": codec}))
    f0, f1, fout, _ = step_logits(model, base, ps)
    q0, q1, qout, gen = step_logits(model, quant, ps)
    state, host = gen.cache.state, gen.cache.host
    want = jnp.dtype(quant.codec.storage_dtype("float32"))
    assert state.pool_k.dtype == want and host.k.dtype == want and host.ks.dtype == jnp.float32
    assert state.ring_k.dtype == jnp.float32                      # the tail ring keeps the model's dtype
    err0 = rel_l2(q0, f0)
    assert 0 < err0 < REL_TOL, err0
    if (qout == fout).all():                                      # same tokens fed: the same step to compare
        err1 = rel_l2(q1, f1)
        assert 0 < err1 < REL_TOL, err1


def test_generate_with_fp8_pages(model):
    ps = prompts()
    cfg = cache_config(model)
    base = generate(model, ps, max_new_tokens=12, cache_config=cfg, attention="sparse")
    fp8 = generate(model, ps, max_new_tokens=12, cache_config=cfg, attention="sparse", kv_dtype="float8_e4m3fn")
    assert [len(t) for t in fp8] == [12, 12]
    # the first token comes from the prefill (unquantised K/V, no stored prefix yet for the first prompt)
    assert fp8[0][0] == base[0][0]
    eng = Engine(model, cfg, attention="sparse", kv_dtype="float8_e4m3fn")
    assert eng.gen.config.kv_dtype == "float8_e4m3fn"


def test_generate_through_a_codec_defined_here_with_shared_prefixes(model):
    """The int8 codec of this file through the Engine with the prefix cache on: the second prompt attaches the
    first's stored pages (read back through the codec's decode) and both run to their length."""
    ps = prompts()
    # Quest: its prefix is shorter than the window the default labels calibrate on online (so it would not attach)
    cfg = dataclasses.replace(cache_config(model, key_channels=0), page_codec=Int8Pages())
    eng = Engine(generator=Generator(model, cfg, attention="sparse"), prefix_cache=True)
    reqs = eng.run(ps, SamplingParams(max_new_tokens=12))
    assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
    assert eng.prefix_stats().hits >= 1
    assert eng.gen.cache.host.k.dtype == jnp.int8
    out = generate(model, ps, max_new_tokens=12, cache_config=cfg, attention="sparse")
    assert [len(t) for t in out] == [12, 12]


def test_dense_fp8_equals_sparse_fp8_at_a_covering_budget(model):
    """The dense baseline stores the same page format (a page encoded once complete, the page under construction
    in the model's dtype), so with a budget covering every page the sparse cache's fp8 tokens are dense's fp8
    tokens exactly, shared prefixes on (generate's default: the second prompt attaches / copies the first's)."""
    from ulacache_jax.runtime.backends import DenseBackend
    ps = prompts()
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=192, page_size=16)
    assert cfg.select_pages * cfg.page_size >= 192
    # 17 tokens: the prefill's and one whole decode chunk (a shorter last chunk would compile a program of its own)
    dense = generate(model, ps, max_new_tokens=17, cache_config=cfg, attention="dense", kv_dtype="float8_e4m3fn")
    sparse = generate(model, ps, max_new_tokens=17, cache_config=cfg, attention="sparse", kv_dtype="float8_e4m3fn")
    assert dense == sparse
    fp8 = dataclasses.replace(cfg, kv_dtype="float8_e4m3fn", dtype="bfloat16")
    bf16 = dataclasses.replace(cfg, dtype="bfloat16")
    assert DenseBackend.footprint(fp8)["hbm_detail"]["dense_kv"] < 0.52 * DenseBackend.footprint(bf16)["hbm_bytes"]


@pytest.mark.slow
def test_speculative_greedy_with_fp8_pages_gives_the_plain_tokens(model):
    """Verification rows read the same page format as a plain step (the ring in the model's dtype, flushed pages
    encoded once complete, whenever they flush), so greedy speculative decoding keeps the plain fp8 tokens."""
    from ulacache_jax.runtime.speculative.rules import SpecConfig
    ps = prompts()
    cfg = dataclasses.replace(cache_config(model), verify_rows=4, kv_dtype="float8_e4m3fn")
    params = SamplingParams(max_new_tokens=16)
    plain = [r.tokens for r in Engine(generator=Generator(model, cfg, attention="sparse"), prefix_cache=False)
             .run(ps, params)]
    spec = [r.tokens for r in Engine(generator=Generator(model, cfg, attention="sparse"), prefix_cache=False,
                                     speculative=SpecConfig("ngram", 3)).run(ps, params)]
    assert spec == plain


def test_cli_kv_dtype(tmp_path):
    """`ulacache generate --kv-dtype float8_e4m3fn`: the run's cache stores fp8 pages (the report's cache config and
    page bytes say so) and the option is part of the --resume fingerprint (it changes outputs)."""
    import contextlib
    import io
    import json
    from ulacache_jax.app import cli, resume
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "prompt": "x" * 90}) + "\n")
    argv = ["generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
            "--report", str(tmp_path / "report.json"), "--model", "tiny", "--page-size", "16", "--token-budget",
            "64", "--max-seqs", "1", "--max-context", "256", "--max-new-tokens", "8", "--no-progress",
            "--stop-ids", "none", "--compile-cache", "off", "--attention", "sparse", "--kv-dtype", "float8_e4m3fn"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    assert rc == 0, err.getvalue()
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["cache_config"]["kv_dtype"] == "float8_e4m3fn"
    assert rep["cache"]["page_bytes"] == 16 * 1 * rep["cache_config"]["head_dim"] + 4   # e4m3 codes + one scale
    assert "kv_dtype float8_e4m3fn" in out.getvalue() + err.getvalue()
    row = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])
    assert row["completion_tokens"] == 8
    args = cli.build_parser().parse_args(argv[:-2])
    assert resume.run_settings(args) != resume.run_settings(cli.build_parser().parse_args(argv))
