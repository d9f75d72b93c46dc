"""Exact mode (SpecConfig("sparse")): the model drafts with sparse attention on a UlaCache cache of its own and
dense attention verifies, so the tokens are dense decoding's. Tiny random model on CPU: prompts longer than the
token budget (the drafter really selects pages), the labels rule as well as Quest, float32 (greedy speculative
equals plain) and bfloat16 in deterministic mode; the drafter shares the target's parameters; the refusals."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from ulacache_jax.models import LlamaModel, get_preset
from ulacache_jax.runtime.cost_model import resolve_attention
from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generation import Generator, default_cache_config, generate
from ulacache_jax.runtime.speculative.decoder import drafter_config
from ulacache_jax.runtime.speculative.rules import SpecConfig, target_attention

K = 3
MAX_NEW = 32


@pytest.fixture(scope="module")
def setup():
    mc = get_preset("tiny")
    model = LlamaModel(mc, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (150, 230, 190)]
    return model, prompts


def _cfg(model, **kw):
    return default_cache_config(model.config, num_seqs=2, max_tokens=320, page_size=16, token_budget=64, **kw)


def test_exact_mode_tokens_are_dense_tokens(setup):
    """Greedy exact mode = plain dense decoding token for token (float32), with a labels drafter that selects
    64 of up to 260 tokens: drafts are accepted only in part, so verification and rollback both run. (Quest
    drafts in the bf16, CLI and bench_longctx tests.)"""
    model, prompts = setup
    cfg = _cfg(model, key_channels=8, label_bits=4)
    dense = generate(model, prompts, max_new_tokens=MAX_NEW, cache_config=cfg, attention="dense")
    eng = Engine(model, cfg, attention="auto", speculative=SpecConfig("sparse", K))
    reqs = eng.run(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [r.tokens for r in reqs] == dense
    spec, gen = eng.spec, eng.gen
    assert gen.attention == "dense" and spec.draft.attention == "sparse"
    assert spec.draft.config.selection_rule == cfg.selection_rule
    assert spec.draft.config.token_budget == 64 < spec.draft.config.max_context
    assert 0.0 < spec.acceptance_rate < 1.0, spec.acceptance_rate
    # the drafter runs on the target's parameters (Generator.sibling), not a copy
    same = jax.tree.leaves(jax.tree.map(lambda a, b: a is b, gen.params, spec.draft.params))
    assert same and all(same)
    # every draft slot released with its target slot
    assert sorted(spec.draft.backend.manager.alloc.free_slots) == [0, 1]


@pytest.mark.slow
def test_exact_mode_deterministic_bfloat16(setup):
    """In bfloat16 the K + 1-row verification rounds unlike the one-row step; deterministic mode verifies every
    step with K + 1 rows, so exact mode's tokens equal dense decoding through those shapes with nothing drafted
    (method "none"), whatever the drafts were. Through generate with attention "auto", which exact mode makes
    dense."""
    model, prompts = setup
    bf = LlamaModel(get_preset("tiny"), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    cfg = _cfg(bf, dtype=jnp.bfloat16)
    ref = generate(bf, prompts[:2], max_new_tokens=24, cache_config=cfg, attention="dense",
                   speculative=SpecConfig("none", K, deterministic=True))
    got = generate(bf, prompts[:2], max_new_tokens=24, cache_config=cfg,
                   speculative=SpecConfig("sparse", K, deterministic=True))
    assert got == ref


def test_target_attention_rule():
    spec = SpecConfig("sparse", 2)
    assert target_attention(spec, "auto") == "dense"
    assert target_attention(spec, "dense") == "dense"
    assert target_attention(None, "auto") == "auto"
    assert target_attention(SpecConfig("ngram", 2), "sparse") == "sparse"
    with pytest.raises(ValueError, match="verifies with dense attention.*'sparse'"):
        target_attention(spec, "sparse")
    mc = get_preset("tiny")
    cfg = default_cache_config(mc, num_seqs=1, max_tokens=256, page_size=16, token_budget=64)
    d = resolve_attention("sparse", mc, cfg)
    with pytest.raises(ValueError, match="verifies with dense attention"):
        target_attention(spec, d)
    dd = resolve_attention("dense", mc, cfg)
    assert target_attention(spec, dd) is dd


def test_refusals(setup):
    model, prompts = setup
    with pytest.raises(ValueError, match="draft_attention = 'dense'"):
        SpecConfig("sparse", 2, draft_attention="dense")
    with pytest.raises(ValueError, match="takes no draft_model"):
        SpecConfig("sparse", 2, draft_model=model)
    with pytest.raises(ValueError, match="verifies with dense attention"):
        generate(model, prompts[:1], max_new_tokens=4, attention="sparse", speculative=SpecConfig("sparse", 2))
    cfg = _cfg(model, verify_rows=K + 1)
    gen = Generator(model, cfg, attention="sparse")
    with pytest.raises(ValueError, match="target's attention is 'sparse'"):
        Engine(generator=gen, speculative=SpecConfig("sparse", K))
    # a sibling over another tp, or a cache of another model shape, is refused before anything is built
    dense = Generator(model, cfg, attention="dense")
    with pytest.raises(ValueError, match="head_dim"):
        dense.sibling(dataclasses.replace(cfg, head_dim=32), attention="sparse")


def test_drafter_config_keeps_selection(setup):
    """The drafter's cache: the target's slots, context, page, budget and selection fields; a sized HBM pool."""
    model, _ = setup
    cfg = _cfg(model, key_channels=8, label_bits=4, kv_dtype="float8_e4m3fn")
    d = drafter_config(model.config, cfg)
    for f in ("max_seqs", "max_context", "page_size", "token_budget", "key_channels", "label_bits", "kv_dtype"):
        assert getattr(d, f) == getattr(cfg, f), f
    groups = d.num_kv_heads // d.kv_heads_per_group
    assert d.num_frames >= d.max_seqs * d.num_layers * groups * (d.token_budget // d.page_size)


def _cli(tmp_path, *extra):
    from ulacache_jax.app import cli
    inp = tmp_path / "p.jsonl"
    if not inp.exists():
        rng = np.random.default_rng(5)
        inp.write_text("".join(json.dumps({"id": str(i), "prompt_ids": [int(t) for t in rng.integers(0, 256, 180)]})
                               + "\n" for i in range(2)))
    out = tmp_path / f"o{len(list(tmp_path.iterdir()))}.jsonl"
    rc = cli.main(["generate", "--model", "tiny", "--input", str(inp), "--output", str(out), "--max-new-tokens",
                   "12", "--token-budget", "64", "--page-size", "16", *extra])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {r["id"]: r["token_ids"] for r in rows}      # lines are written as requests finish


@pytest.mark.slow
def test_cli_exact_mode(tmp_path, capsys):
    from ulacache_jax.app import cli
    dense = _cli(tmp_path, "--attention", "dense")
    exact = _cli(tmp_path, "--speculative", "sparse")
    assert exact == dense and sorted(dense) == ["0", "1"]
    cap = capsys.readouterr()
    err = cap.out + cap.err                            # the report is printed on stdout, the notes on stderr
    assert "attention dense" in err and "speculative (sparse):" in err and "draft cache (sparse) HBM" in err
    for bad, msg in ((["--attention", "sparse"], "--speculative sparse (exact mode) verifies with dense"),
                     (["--hbm-pages", "64"], "with --speculative sparse (exact mode) the run's cache is dense")):
        rc = cli.main(["generate", "--model", "tiny", "--input", str(tmp_path / "p.jsonl"), "--output",
                       str(tmp_path / "bad.jsonl"), "--max-new-tokens", "4", "--speculative", "sparse", *bad])
        assert rc == cli.EXIT_USAGE and msg in capsys.readouterr().err
        assert not (tmp_path / "bad.jsonl").exists()


@pytest.mark.slow
def test_bench_exact_small(tmp_path, monkeypatch):
    """scripts/bench_exact.py --small: the reference check runs before the timings (its comparison, exact mode's
    tokens = dense decoding's through `generate`, is test_exact_mode_tokens_are_dense_tokens's: recorded here, not
    compiled twice), then one row's timings and the modelled tok/s (every draft accepted: K + 1 tokens a cycle;
    none: one)."""
    from scripts import bench_exact
    order = []
    monkeypatch.setattr(bench_exact, "check", lambda args: order.append("check"))
    real_cycle = bench_exact.Cycle

    def cycle(*a, **kw):
        order.append("cycle")
        return real_cycle(*a, **kw)
    monkeypatch.setattr(bench_exact, "Cycle", cycle)
    res = bench_exact.main(["--small", "--out", str(tmp_path), "--ks", "2", "--acceptance", "0,1", "--commit", "t"])
    assert order[:2] == ["check", "cycle"]
    (row,) = res.rows
    assert (row["context"], row["batch"], row["num_tokens"], row["key_channels"]) == (512, 2, 2, 4)
    assert row["reps"] == 3 and row["cycle_ms"] > 0 and row["dense_ms"] > 0 and 0 <= row["hit_rate"] <= 1
    cyc_s = row["cycle_ms"] / 1e3
    assert row["at_acceptance"]["0"]["tok_s"] == pytest.approx(2 / cyc_s)
    assert row["at_acceptance"]["1"]["tok_s"] == pytest.approx(2 * 3 / cyc_s) == pytest.approx(row["bound_tok_s"])
    with open(tmp_path / "exact.json") as fh:
        assert json.load(fh)["meta"]["commit"] == "t"
    with pytest.raises(SystemExit, match="exists"):
        bench_exact.main(["--small", "--out", str(tmp_path)])
    for bad in (["--ks", "0"], ["--acceptance", "1.5"], ["--rows", "x:1"]):
        with pytest.raises(SystemExit):
            bench_exact.main(["--out", str(tmp_path / "b"), *bad])


def _verify_case(dtype, T=300):
    """Rows of three sequences at positions 10 (5 rows), T - 5 (5) and 1 (3)."""
    S, Q, H, KV, D = 3, 5, 8, 2, 64
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=s), dtype) for s in ((S, Q, H, D), (S, T, KV, D), (S, T, KV, D)))
    pos = jnp.asarray([10, T - 5, 1])
    qpos = pos[:, None] + jnp.arange(Q)[None]
    s = jnp.arange(S)[:, None]
    return q, k, v, k[s, qpos], v[s, qpos], pos, qpos


def _verify_reference(q, k, v, qpos):
    """Each row on its own through the jnp attention, seeing keys 0 .. its position."""
    from ulacache_jax.models.attention import dense_attention
    S, T = k.shape[:2]
    kpos = jnp.broadcast_to(jnp.arange(T)[None], (S, T))
    return jnp.stack([dense_attention(q[:, j:j + 1], k, v, qpos[:, j:j + 1], kpos, k_valid=kpos <= qpos[:, j:j + 1])
                      [:, 0] for j in range(q.shape[1])], 1)


def test_verify_attention_is_each_rows_causal_view():
    """The dense verification's split attention (committed keys by one fused call, in one piece or several, the
    rows' own keys as a causal block, merged by log-sum-exp) = each row's own causal attention."""
    from ulacache_jax.runtime.backends import verify_attention, verify_splits
    q, k, v, kn, vn, pos, qpos = _verify_case(jnp.float32)
    want = np.asarray(_verify_reference(q, k, v, qpos))
    for splits in (None, 1, 2, 4):     # pieces of the committed keys: a row at 1 or 10 leaves later pieces empty
        got = np.asarray(verify_attention(q, k, v, kn, vn, pos, implementation="xla", splits=splits))
        np.testing.assert_allclose(got, want, atol=3e-6, rtol=3e-6)
    with pytest.raises(ValueError, match="splits = 7 must be >= 1 and divide the cache's 300 keys"):
        verify_attention(q, k, v, kn, vn, pos, implementation="xla", splits=7)
    assert verify_splits(131072) == 8 and verify_splits(300) == 1 and verify_splits(32768) == 2
    assert verify_splits(100000) == 5 and verify_splits(131136) == 8      # any divisor, not only powers of two


def test_verify_walk_is_each_rows_causal_view():
    """The verification by the decode kernel over the cache's frames (rows' own K/V written first) = each row's own
    causal attention, through the kernel (interpret mode) and its reference."""
    from ulacache_jax.runtime.backends import verify_walk
    q, k, v, kn, vn, pos, qpos = _verify_case(jnp.float32, T=320)     # kn, vn: the cache's K/V at the rows
    want = np.asarray(_verify_reference(q, k, v, qpos))
    for impl in ("ref", "pallas"):
        got = np.asarray(verify_walk(q, k, v, pos, page_size=64, impl=impl))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="320 keys must be whole pages of 48"):
        verify_walk(q, k, v, pos, page_size=48)


@pytest.mark.gpu
def test_verify_attention_cudnn_on_the_gpu():
    """cuDNN's flash attention with its log-sum-exp, compiled on the GPU, against the per-row reference (bf16)."""
    from ulacache_jax.runtime.backends import verify_attention, verify_walk
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, k, v, kn, vn, pos, qpos = _verify_case(jnp.bfloat16, T=4096)
    want = np.asarray(_verify_reference(q, k, v, qpos), np.float32)
    for splits in (1, 4):
        got = jax.jit(lambda *a: verify_attention(*a, implementation="cudnn", splits=splits))(q, k, v, kn, vn, pos)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)
    got = jax.jit(lambda *a: verify_walk(*a, page_size=64))(q, k, v, pos)    # the cache holds the rows' K/V
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)
