"""The benchmark scripts' own helpers (scripts/ is a package: imported as scripts.<name>)."""
import os
import sys

import pytest
import numpy as np
import jax.numpy as jnp
from flax import nnx


from scripts.bench_decode import synthetic_fill_dense  # noqa: E402
from scripts.pick_launch import pick  # noqa: E402
from ulacache_jax.runtime.generator import Generator, default_cache_config  # noqa: E402
from ulacache_jax.models import LlamaModel, get_preset  # noqa: E402


def tiny_dense_generator():
    model = LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    cfg = default_cache_config(model.config, num_seqs=3, max_tokens=256, page_size=16)
    return Generator(model, cfg, attention="dense")


def test_dense_fill_consumes_the_zero_cache():
    """The fill must write into the donated zero arrays: an unused donated argument is pruned by jit and stays
    alive, which doubled the dense cache's HBM on the H200 (its largest-batch rows could not run)."""
    gen = tiny_dense_generator()
    old = gen.dense.k + gen.dense.v
    synthetic_fill_dense(gen, 2, 100, seed=1)
    assert all(x.is_deleted() for x in old)
    k = np.asarray(gen.dense.k[0])                                                   # [S, T, KV, D]
    assert k.shape == old[0].shape
    assert np.abs(k[0]).sum() > 0 and not np.array_equal(k[0], k[1])                  # random, distinct per sequence
    assert list(np.asarray(gen.dense_len)) == [100, 100, 0]


def test_dense_fill_of_fp8_pages():
    """bench_decode --kv-dtype float8_e4m3fn: the dense fill writes e4m3 codes (random, distinct per sequence) into the
    donated code arrays and keeps the scale and ring arrays of the page format (unit scales)."""
    model = LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    cfg = default_cache_config(model.config, num_seqs=3, max_tokens=256, page_size=16, kv_dtype="float8_e4m3fn")
    gen = Generator(model, cfg, attention="dense")
    old = gen.dense.k + gen.dense.v
    synthetic_fill_dense(gen, 2, 100, seed=1)
    assert all(x.is_deleted() for x in old)
    k = gen.dense.k[0]
    assert k.dtype == jnp.float8_e4m3fn and gen.dense.ks is not None and gen.dense.rk is not None
    k = np.asarray(k.astype(jnp.float32))
    assert np.abs(k[0]).sum() > 0 and not np.array_equal(k[0], k[1])
    assert (np.asarray(gen.dense.ks[0]) == 1).all()


def test_dense_fill_keeps_one_decode_program():
    """After the fill, decode chunks reuse one compiled program: an uncommitted dense_len once made the first
    timed chunk compile it again (the H200 dense rows' p99)."""
    from ulacache_jax.runtime.sampling import SamplingArrays, row_keys
    gen = tiny_dense_generator()
    synthetic_fill_dense(gen, 2, 100, seed=1)
    S = gen.config.max_seqs
    for i in range(2):
        out, _, _ = gen.decode_chunk(jnp.zeros(S, jnp.int32), jnp.arange(S) >= 2, jnp.full(S, 1 << 30, jnp.int32),
                                     row_keys(jnp.arange(S, dtype=jnp.uint32), jnp.full(S, i, jnp.uint32)),
                                     SamplingArrays.fill(S), jnp.asarray([-1], jnp.int32))
        np.asarray(out)
    assert gen._decode._cache_size() == 1


def test_pick_launch_takes_the_fastest_checked_variant():
    rows = [dict(kind="scores", impl="pallas", block_pages=16, num_warps=8, ok=True, us=190.0),
            dict(kind="scores", impl="pallas", block_pages=128, num_warps=4, ok=True, us=400.0),
            dict(kind="scores", impl="pallas", block_pages=32, num_warps=2, ok=False, us=50.0),   # wrong: ignored
            dict(kind="scores", impl="ref", ok=True, us=100.0),                                 # not a launch
            dict(kind="top_k", impl="lax.top_k", ok=True, us=115.0),
            dict(kind="top_k", impl="pallas_radix", ok=True, us=20.0)]
    assert pick(dict(rows=rows)) == ["--score-launch", "16", "8"]                    # the radix kernel: default
    slow_radix = rows[:4] + [dict(rows[4]), dict(rows[5], us=300.0)]
    assert pick(dict(rows=slow_radix)) == ["--score-launch", "16", "8", "--topk", "ref"]
    assert pick(dict(rows=[dict(kind="top_k", impl="pallas_radix", error="x")])) == []


def test_bench_ingest_checks_and_reports(tmp_path):
    from scripts.bench_ingest import main
    res = main(["--layers", "2", "--context", "1024", "--chunks", "256", "--reps", "1", "--out", str(tmp_path)])
    row = res["rows"][0]
    assert "error" not in row and row["check_first_chunk"] is True
    assert row["ingest"]["bytes"] == 2 * 2 * 256 * 8 * 128 * 2 and row["ingest"]["wall_us"] > 0
    assert (tmp_path / "ingest.json").exists() and (tmp_path / "ingest.png").exists()


def test_rows_record_the_attention_kernel_that_ran(monkeypatch):
    """'auto' changed meaning (Triton, then Mosaic on Hopper): each decode row records the resolved kernel."""
    from scripts.bench_decode import attention_kernel
    from ulacache_jax.cache.kernel_choice import Platform
    mc = get_preset("llama-3.1-8b")
    cfg = default_cache_config(mc, num_seqs=2, max_tokens=4096, dtype="bfloat16")
    tiny = get_preset("tiny")
    tiny_cfg = default_cache_config(tiny, num_seqs=2, max_tokens=256, page_size=16)
    assert attention_kernel("auto", mc, cfg, Platform("cpu")) == "ref"
    assert attention_kernel("pallas", mc, cfg, Platform("gpu")) == "triton"
    assert attention_kernel("auto", mc, cfg, Platform("gpu", hopper=True)) == "mosaic"
    assert attention_kernel("auto", tiny, tiny_cfg, Platform("gpu", hopper=True)) == "triton"  # head_dim 16
    assert attention_kernel("auto", mc, cfg, Platform("gpu")) == "triton"


# ----------------------------------------------------------------------------------------------------------------
# the shared harness (scripts/bench_meta.py) and the scripts built on it, in small shapes
# ----------------------------------------------------------------------------------------------------------------
def test_harness_timing_and_results(tmp_path):
    import json
    import jax
    from scripts import bench_meta as bm
    calls = []
    t = bm.median_seconds(lambda x: calls.append(x) or jnp.ones(3) * x, 5, warmup=2, prepare=lambda: len(calls),
                          per_call=4)
    assert t.reps == 5 and len(calls) == 7 and 0 < t.min_s <= t.median_s <= t.max_s
    assert set(t.row()) == {"us", "min_us", "max_us", "reps"}
    sec, carry = bm.time_chain(lambda c, a: c + a, jnp.zeros(4), jnp.ones(4), reps=3, max_n=4)
    assert sec > 0 and float(carry[0]) >= 3                                          # warm-ups and chains all ran
    assert bm.copy_ceiling(1 << 20, reps=2) > 0 and bm.read_ceiling(1 << 20, reps=2) > 0
    if jax.default_backend() == "cpu":
        assert bm.device_events(lambda: jnp.ones(8) + 1, 2) is None                  # no GPU planes to read
    meta = bm.run_meta("abc123", note="x")
    assert meta["commit"] == "abc123" and meta["note"] == "x"
    assert {"device", "platform", "num_devices", "jax", "date", "command"} <= set(meta)
    res = bm.Results(str(tmp_path / "sub" / "r.json"), meta, shapes=dict(B=1))
    res.add(dict(a=np.float32(1.5)))
    first = json.loads((tmp_path / "sub" / "r.json").read_text())                    # written after the first row
    assert first["rows"] == [{"a": 1.5}] and first["shapes"] == {"B": 1} and first["meta"]["commit"] == "abc123"


@pytest.mark.slow
def test_bench_sieve_small_run_checks_and_writes(tmp_path):
    import json
    import subprocess
    import sys as _sys
    root = os.path.join(os.path.dirname(__file__), "..")
    script = ["-m", "scripts.bench_sieve"]   # scripts/ is a package run from the repo root
    out = subprocess.run([_sys.executable, *script, "--requests", "64", "--pools", "256", "--buckets", "4",
                          "--budget-s", "0.01", "--out", str(tmp_path), "--commit", "test"],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads((tmp_path / "sieve.json").read_text())
    assert d["meta"]["commit"] == "test" and (tmp_path / "sieve.png").exists()
    kern = [r for r in d["rows"] if r["impl"] == "pallas"]
    assert kern and all(r["check_ok"] for r in kern) and all("scan_us" in r for r in d["rows"])
    # --kernel-only: the sieve's rows alone, still checked against the reference, no reference or LRU timings
    out = subprocess.run([_sys.executable, *script, "--requests", "64", "--pools", "256", "--buckets", "4", "8",
                          "--budget-s", "0.01", "--out", str(tmp_path), "--name", "k", "--kernel-only"],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "k.json").read_text())["rows"]
    assert [(r["impl"], r["B"]) for r in rows] == [("pallas", 4), ("pallas", 8)]
    assert all(r["check_ok"] and "scan_us" not in r for r in rows)


# ----------------------------------------------------------------------------------------------------------------
# scripts that drive the runtime's internals: run in the smallest shapes, so a refactor cannot silently break them
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_selection_trace_records_what_the_sieve_sees(tmp_path):
    """selection_trace.py decodes through program.decode_layers with a recording backend: its replay check (the
    recorded pages reproduce the backend's hits) and its Engine check (same tokens) must both hold, and the trace
    carries what scripts/studies/eviction_study.py --trace reads."""
    from scripts.selection_trace import main
    out = tmp_path / "trace.npz"                     # --out is a folder: OUT/NAME.npz inside it
    meta = main(["--out", str(tmp_path), "--name", "trace", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                 "--head-dim", "16", "--hidden", "32", "--num-seqs", "2", "--prompt-len", "48", "--steps", "16", "--page-size", "16",
                 "--token-budget", "32"])
    assert meta["replay_matches_library"] is True and meta["generate_tokens_match"] is True
    d = np.load(out)
    assert d["lids"].shape == d["valid"].shape == (16, 2 * 1 * 2)          # rows = steps x layers; seqs x groups x K
    assert d["clock"].shape == (16,) and (np.diff(d["clock"]) == 1).all()  # one tick per sieve call
    assert int(d["total_pages"]) > 0 and str(d["label"]) == "random-weight model trace"


@pytest.mark.slow
def test_decode_memory_probe_compiles_the_generators_program():
    """probes/decode_memory.py builds, without allocating, the very Program a Generator of that shape gets, and
    the tiny decode aliases the whole cache input -> output."""
    from scripts.probes.decode_memory import abstract_program, main
    from ulacache_jax.cache.decode_layer import DecodeOptions
    mc = get_preset("tiny")
    model = LlamaModel(mc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    shape_only = nnx.eval_shape(lambda: LlamaModel(mc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    cfg = default_cache_config(mc, num_seqs=2, max_tokens=256, page_size=16, dtype="bfloat16")
    for side in ("sparse", "dense"):
        gen = Generator(model, cfg, attention=side)
        assert abstract_program(shape_only, cfg, side, DecodeOptions(), gen.mesh)[0] is gen.program
    report = main(["--preset", "tiny", "--context", "256", "--batch", "2", "--layers", "2", "--budget", "64",
                   "--chunks", "1"])
    for side, rec in report.items():
        assert rec["alias"] >= sum(rec["cache_bytes"].values()), side


def test_bench_prefix_plot_from_rows(tmp_path):
    """bench_prefix's PNG (drawn beside the JSON, or later with --png where the GPU machine has no matplotlib): one
    pair of bars per (model, document, attention); an errored row is left out, not drawn as zero time."""
    import json
    from scripts import bench_prefix
    row = dict(model="tiny", doc_tokens=480, attention="sparse", questions=4, time_to_last_answer_s=2.0,
               prefill_tokens_computed=590)
    rows = [dict(row, sharing=True), dict(row, sharing=False, time_to_last_answer_s=9.0, prefill_tokens_computed=2030),
            dict(row, attention="dense", sharing=True, error="boom")]
    path = tmp_path / "prefix.json"
    path.write_text(json.dumps(dict(meta={}, rows=rows)))
    bench_prefix.main(["--png", str(path)])
    png = tmp_path / "prefix.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_chunked_prefill_gaps_and_plot(tmp_path):
    """bench_chunked_prefill: a delivery gap is counted in the step that delivered it (the window: the steps that
    prefilled the long prompt), once per gap and once per token for the per-token latency; the PNG is drawn from
    the JSON's rows."""
    import json
    import types
    from scripts import bench_chunked_prefill as b
    req = types.SimpleNamespace(deliveries=[(0.0, 1, 0), (1.0, 4, 0), (3.0, 4, 1), (3.5, 2, 2)])
    assert b._gaps(req) == ([1.0, 2.0, 0.5], [0.25] * 4 + [0.5] * 4 + [0.25] * 2)
    assert b._gaps(req, range(1, 2)) == ([2.0], [0.5] * 4)
    assert b._pct([3.0, 1.0, 2.0], 50) == 2.0 and b._pct([], 99) is None
    row = dict(kind="scenario", timed=True, window_gap_p50_ms=10.0, window_gap_p99_ms=40.0)
    tp = dict(kind="throughput", tokens_per_s=100.0)
    path = tmp_path / "chunked_prefill.json"
    path.write_text(json.dumps(dict(meta=dict(long_prompt=256, running=2, model="tiny", device="cpu"),
                                    rows=[dict(row, chunk=None, cadence=16), dict(row, chunk=32, cadence=4),
                                          dict(tp, cadence=16), dict(tp, cadence=4)])))
    b.main(["--png", str(path)])
    png = tmp_path / "chunked_prefill.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_real_prefill_rows_take_generates_path():
    """bench_decode --fill prefill: the first tokens its prefill times are generate's first tokens for the same
    prompts (sparse and dense), the compiling prompt's slot is released, and a row records the time to first
    token beside its decode rate (run_side end to end on the tiny model)."""
    import argparse
    from scripts import bench_decode as bd
    from ulacache_jax import generate
    model = LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    for attention in ("sparse", "dense"):
        cfg = default_cache_config(model.config, num_seqs=2, max_tokens=512, page_size=16, token_budget=64)
        gen = Generator(model, cfg, attention=attention)
        first, running, info = bd.real_prefill(gen, 2, 200, 240, model.config.vocab_size)
        rng = np.random.default_rng(200 + 2)
        rng.integers(0, model.config.vocab_size, 200)                     # the compiling prompt
        prompts = [rng.integers(0, model.config.vocab_size, 200).tolist() for _ in range(2)]
        want = [t[0] for t in generate(model, prompts, max_new_tokens=1, cache_config=cfg, attention=attention)]
        assert running.tolist() == [True, True] and first.tolist() == want, attention
        assert info["first_prefill_s"] > 0 and info["ttft_s"] > 0 and info["prefill_tok_s"] == 200 / info["ttft_s"]
    args = argparse.Namespace(budget=128, chunks=2, kv_fraction=0.5, sieve="auto", topk="auto", attention_impl="auto",
                              score_launch=None, tp=1, fill="prefill", key_channels=0, scores="auto")
    row = bd.run_side(model, model.config, "sparse", 1, 256, args, copy_bw=1e11)
    assert row["fill"] == "prefill" and row["ttft_s"] > 0 and row["tokens_per_s"] > 0 and row["hit_rate"] is not None


def test_appended_runs_keep_earlier_rows_commands_and_commits(tmp_path):
    """bench_decode.py and profile_decode.py --append: the rows already in the JSON stay, its command and commit
    fields gain this run's; without --append (or without a file) the run starts empty."""
    import json
    from scripts import bench_meta as bm
    path = str(tmp_path / "decode_profile.json")
    assert bm.earlier_run(path, True) == ({}, [])
    assert bm.appended_meta({}, "abc", "x.py --rows a") == dict(command="x.py --rows a", commit="abc")
    with open(path, "w") as f:
        json.dump(dict(commit="old1", command="x.py --rows a", device="H200", rows=[dict(r=1)]), f)
    assert bm.earlier_run(path, False) == ({}, [])
    meta, rows = bm.earlier_run(path, True)
    assert rows == [dict(r=1)] and meta == dict(commit="old1", command="x.py --rows a", device="H200")
    assert bm.appended_meta(meta, "new2", "x.py --rows b", run="L") == dict(
        command="x.py --rows a; run L: x.py --rows b", commit="old1 / new2")


def test_pair_report_pairs_rows_and_names_the_commits(tmp_path):
    """probes/pair_report.py: rows of the two trees paired by (attention, context, batch, pool); a row that failed
    on one side stays in the report with None there (not dropped); the real commits replace the old / new labels."""
    import json
    from scripts.probes import pair_report
    row = dict(attention="sparse", context=32768, batch=1, hit_rate=0.9, kv_fraction=0.25)
    small_pool = dict(row, kv_fraction=0.0625)  # the same shape at another pool is its own pair
    for side, rows in (("old", [dict(row, tokens_per_s=100.0), dict(row, context=262144, tokens_per_s=50.0),
                                dict(small_pool, tokens_per_s=70.0)]),
                       ("new", [dict(row, tokens_per_s=110.0), dict(row, context=262144, error="timeout"),
                                dict(small_pool, tokens_per_s=77.0)])):
        (tmp_path / side).mkdir()
        (tmp_path / side / "decode.json").write_text(json.dumps(dict(device="H200", jax="0.11.2", rows=rows)))
    pair_report.main([str(tmp_path), "--old-commit", "aaaa", "--new-commit", "bbbb", "--name", "pair"])
    out = json.loads((tmp_path / "pair.json").read_text())
    assert [(p["context"], p["kv_fraction"]) for p in out["pairs"]] == [(32768, 0.0625), (32768, 0.25), (262144, 0.25)]
    by_ctx = {p["context"]: p for p in out["pairs"] if p["kv_fraction"] == 0.25}
    assert abs(by_ctx[32768]["change"] - 0.1) < 1e-12 and abs(out["pairs"][0]["change"] - 0.1) < 1e-12
    assert by_ctx[262144]["old_tokens_per_s"] == 50.0 and by_ctx[262144]["new_tokens_per_s"] is None
    assert by_ctx[262144]["change"] is None
    assert sorted(r["commit"] for r in out["rows"]) == ["aaaa"] * 3 + ["bbbb"] * 2
    assert out["meta"]["commit"] == "aaaa (old) / bbbb (new)" and out["meta"]["device"] == "H200"
    assert (tmp_path / "pair.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fetch_latency_probe_checks_every_mode(tmp_path):
    """probes/fetch_latency.py on CPU (the kernel in interpret mode, no profiler so no times): every mode's fetched
    frames hold their host pages' values, and the rows name pool, misses and mode."""
    import json
    from scripts.probes import fetch_latency
    fetch_latency.main(["--out", str(tmp_path), "--pool-gib", "0.004", "--misses", "0", "3", "--calls", "5",
                        "--frames", "16", "--entries", "8"])
    rows = json.loads((tmp_path / "fetch_latency.json").read_text())["rows"]
    assert [(r["misses"], r["mode"]) for r in rows] == [(0, "fresh"), (3, "fresh"), (3, "repeat"), (3, "clustered")]
    assert all(r["check_ok"] for r in rows) and rows[0]["host_pages"] == int(0.004 * 2**30) // (2 * 16384)


@pytest.mark.slow
def test_hot_pages_raise_the_synthetic_rows_hit_rate():
    """bench_decode --hot-share: planted hot pages repeat in every step's selection, so the same row's hit rate
    rises from random weights' (no locality) towards 1; the row records the share; bad values are refused."""
    import argparse
    import pytest
    from scripts import bench_decode as bd
    model = LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    hits = {}
    for share in (0.0, 1.0):
        args = argparse.Namespace(budget=512, chunks=3, kv_fraction=0.25, sieve="auto", topk="auto",
                                  attention_impl="auto", score_launch=None, tp=1, fill="synthetic", key_channels=8,
                                  label_bits=4, scores="auto", hot_share=share)
        row = bd.run_side(model, model.config, "sparse", 2, 4096, args, copy_bw=1e11)
        assert row["hot_share"] == share
        hits[share] = row["hit_rate"]
    assert hits[1.0] > 0.95 and hits[1.0] > hits[0.0] + 0.2, hits
    assert bd.hot_page_probability(0.5, 64, 131072, 64) == 0.5 * 64 / 2048
    assert bd.hot_page_probability(1.0, 64, 4096, 64) == 1.0
    for bad in ("-0.1", "1.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad if bad == "x" else "must be in"):
            bd.hot_share_arg(bad)


@pytest.mark.slow
def test_page_size_reaches_both_sides_rows():
    """bench_decode --page-size: the row's cache and its record take the page (32 here), both sides."""
    import argparse
    from scripts import bench_decode as bd
    model = LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert bd.build_parser().parse_args(["--page-size", "32"]).page_size == 32
    for side in ("sparse", "dense"):
        args = argparse.Namespace(budget=512, chunks=2, kv_fraction=0.25, sieve="auto", topk="auto",
                                  attention_impl="auto", score_launch=None, tp=1, fill="synthetic", key_channels=8,
                                  label_bits=4, scores="auto", hot_share=0.0, page_size=32)
        row = bd.run_side(model, model.config, side, 2, 2048, args, copy_bw=1e11)
        assert row["page"] == 32 and row["tokens_per_s"] > 0


@pytest.mark.slow
def test_a_label_first_stage_row_runs_and_names_its_stages():
    """bench_decode --two-stage MULT --first-channels C: labels over C channels shortlist for the labels the row's
    --key-channels name (the row records both stages); --first-channels needs --two-stage, an even count and at
    most the head dim."""
    import argparse
    import pytest
    from scripts import bench_decode as bd
    model = LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    D = model.config.head_dim
    args = argparse.Namespace(budget=512, chunks=2, kv_fraction=0.25, sieve="auto", topk="auto", attention_impl="auto",
                              score_launch=None, tp=1, fill="synthetic", key_channels=D, label_bits=4, scores="auto",
                              hot_share=0.0, two_stage=2, first_channels=4)
    row = bd.run_side(model, model.config, "sparse", 2, 4096, args, copy_bw=1e11)
    assert (row["rule"], row["second_rule"], row["key_channels"], row["first_rule"], row["first_channels"],
            row["first_bits"], row["two_stage"]) == ("two_stage", "labels", D, "labels", 4, 4, 2)
    assert row["tokens_per_s"] > 0 and "first=Labels(channels=4" in row["selection"]
    for bad in ("3", "-2", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"--first-channels {bad!r} must be an even int"):
            bd.first_channels_arg(bad)
    with pytest.raises(SystemExit, match="--first-channels 4 needs --two-stage"):
        bd.main(["--first-channels", "4", "--out", "unused"])
    with pytest.raises(SystemExit, match="--first-channels 256 must be <= the model's head_dim 128"):
        bd.main(["--first-channels", "256", "--two-stage", "4", "--out", "unused"])
