"""scripts/bench_quality.py in its tiny mode (tiny random model) and the teacher-forced scorer it is built on."""
import importlib.util
import json
import os
import sys

import numpy as np
import pytest
import jax.numpy as jnp
from flax import nnx

import ulacache_jax
from ulacache_jax.runtime.generation import default_cache_config
from ulacache_jax.models import LlamaModel, get_preset
from scripts.scoring import TeacherForcedScorer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_quality", os.path.join(ROOT, "scripts", "bench_quality.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod     # its dataclasses look their module up while the module runs
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model():
    return LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.mark.slow
@pytest.mark.parametrize("budget", [256, 32])
def test_scorer_matches_dense_and_generate(model, budget):
    """Budget 256 covers the 183-token windows: sparse log-probs equal dense ones. At both budgets the scorer's
    greedy argmax continuation is generate()'s tokens (the scorer's decode is generate's sparse decode)."""
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, 150))) for _ in range(2)]
    cc = default_cache_config(model.config, num_seqs=2, max_tokens=200, page_size=16, token_budget=budget,
                              dtype="float32")
    # 33 tokens: the prefill's and two whole decode chunks of page_size steps, so generate compiles one decode
    # program (a shorter last chunk compiles its own)
    gen = ulacache_jax.generate(model, prompts, max_new_tokens=33, cache_config=cc, attention="sparse")
    res = TeacherForcedScorer(model, cc, record=True).score([p + g for p, g in zip(prompts, gen)], 150)
    for w, g in enumerate(gen):
        np.testing.assert_array_equal(res.argmax[w], np.asarray(g[1:]))
    assert res.logp.shape == (2, 32) and res.selections.shape[:3] == (33, 2, 2)
    if budget >= 183:
        np.testing.assert_allclose(res.logp, res.dense_logp, atol=2e-5, rtol=0)
        assert res.summary()["top1_agreement"] == 1.0 and res.summary()["kl"] < 1e-6
    else:
        assert res.summary()["kl"] > 1e-4 and res.misses > 0      # really sparse: the budget is 2 pages


def test_scorer_rejects_bad_windows(model):
    cc = default_cache_config(model.config, num_seqs=2, max_tokens=64, page_size=16, token_budget=32,
                              dtype="float32")
    sc = TeacherForcedScorer(model, cc)
    with pytest.raises(ValueError, match="one length"):
        sc.score([[1] * 40, [1] * 41], 20)
    with pytest.raises(ValueError, match="prefix"):
        sc.score([[1] * 40], 39)
    with pytest.raises(ValueError, match="max_seqs"):
        sc.score([[1] * 40] * 3, 20)


@pytest.mark.slow  # a benchmark script end to end: the second tier (Makefile)
def test_tiny_mode_rows(tmp_path):
    bq = _load_script()
    rows, meta = bq.main(["--tiny", "--out", str(tmp_path), "--contexts", "512", "--depths", "50",
                          "--budgets", "32,512", "--pages", "16", "--pools", "4"])
    data = json.loads((tmp_path / "quality.json").read_text())
    assert (tmp_path / "quality.png").stat().st_size > 0
    assert data["rows"] == json.loads(json.dumps(rows))
    required = {"task", "context", "depth", "budget", "page_size", "attention", "n", "device", "commit", "jax", "date"}
    metric = {"passkey": "accuracy", "ppl": "ppl", "hit_rate": "hit_rate"}
    for r in data["rows"]:
        assert required <= set(r), r
        assert metric[r["task"]] in r
        if r["task"] == "ppl":
            assert {"top1_agreement", "kl"} <= set(r)
    assert {r["task"] for r in rows} == {"passkey", "ppl", "hit_rate"}
    pk = [r for r in rows if r["task"] == "passkey"]
    assert {(r["attention"], r["budget"]) for r in pk} == {("dense", None), ("sparse", 32), ("sparse", 512)}
    # budget 512 covers every 512-token sequence: dense by construction, and its answers are dense's
    for r in pk:
        assert r["dense_by_construction"] == (r["budget"] in (None, 512)) and r["n"] == 2
        if r["dense_by_construction"]:
            assert r["same_as_dense"] == 1.0
    pp = {r["budget"]: r for r in rows if r["task"] == "ppl"}
    assert pp[512]["dense_by_construction"] and pp[512]["top1_agreement"] == 1.0
    assert abs(pp[512]["ppl"] / pp[None]["ppl"] - 1) < 1e-5
    assert not pp[32]["dense_by_construction"] and pp[32]["kl"] > 0
    hr = {r["policy"]: r["hit_rate"] for r in rows if r["task"] == "hit_rate" and r["pool"] == "1/4"}
    assert set(hr) == {"pb_lru", "global_lru", "belady"}
    assert all(0.0 <= h <= 1.0 for h in hr.values())
    assert meta["text"]["sha256"] and meta["refused"] == []


@pytest.mark.slow
def test_key_channels_list_rows(tmp_path):
    """--key-channels 0,8: each value its own sparse cells against one dense run; rows carry their value and a
    covering budget stays dense's answers with the key copy too."""
    bq = _load_script()
    # context 512 as in test_tiny_mode_rows: the dense and key-channels-0 cells are its cells (compiled once)
    rows, meta = bq.main(["--tiny", "--out", str(tmp_path), "--tasks", "passkey", "--contexts", "512",
                          "--depths", "50", "--budgets", "32,512", "--pages", "16", "--key-channels", "0,8"])
    cells = {(r["attention"], r["budget"], r["key_channels"]) for r in rows}
    assert cells == {("dense", None, 0)} | {("sparse", b, kc) for b in (32, 512) for kc in (0, 8)}
    assert meta["key_channels"] == [0, 8]
    for r in rows:
        if r["budget"] == 512:
            assert r["dense_by_construction"] and r["same_as_dense"] == 1.0, r
    with pytest.raises(SystemExit):
        bq.main(["--tiny", "--out", str(tmp_path), "--key-channels", "8,-1"])


@pytest.mark.slow
def test_label_bits_and_window_overrides(tmp_path):
    """--label-bits 4 makes the key-channel cells labels (rows and meta say so; Quest cells stay Quest), the ppl
    window / prefix / traced steps follow their overrides, and a prefix that leaves no scored position is refused."""
    bq = _load_script()
    rows, meta = bq.main(["--tiny", "--out", str(tmp_path), "--tasks", "ppl,trace", "--budgets", "32", "--pages", "8",
                          "--key-channels", "8,0", "--label-bits", "4", "--ppl-window", "160", "--ppl-prefix", "128",
                          "--trace-steps", "16", "--pools", "2"])
    sparse = [r for r in rows if r.get("task") == "ppl" and r["attention"] == "sparse"]
    assert {(r["key_channels"], r["label_bits"]) for r in sparse} == {(8, 4), (0, 0)}
    assert meta["label_bits"] == 4 and meta["grid"]["ppl_window"] == 160 and meta["grid"]["ppl_prefix"] == 128
    assert meta["trace"]["steps"] == 16 and all(r["context"] == 160 for r in sparse)
    with pytest.raises(SystemExit):
        bq.main(["--tiny", "--out", str(tmp_path), "--ppl-window", "128", "--ppl-prefix", "128"])


@pytest.mark.slow
def test_two_stage_cells_rerank_quests_shortlist(tmp_path, capsys):
    """--two-stage MULT: the labels cells run as the second stage behind Quest's shortlist (rows carry two_stage, a
    cell apart from the plain rule's in row_id, named in the plot legend); a shortlist covering every page ranks
    exactly as the labels alone; --two-stage with Quest cells (key channels 0) or a bad MULT is refused by name."""
    bq = _load_script()
    args = ["--tiny", "--tasks", "ppl", "--budgets", "32", "--pages", "8", "--key-channels", "8", "--label-bits", "4",
            "--ppl-window", "160", "--ppl-prefix", "128"]
    plain, _ = bq.main(args + ["--out", str(tmp_path / "a")])
    two, meta = bq.main(args + ["--out", str(tmp_path / "b"), "--two-stage", "5"])   # 5 x 4 pages >= 20 flushed
    sp = lambda rows: [r for r in rows if r.get("task") == "ppl" and r["attention"] == "sparse"]
    assert [r.get("two_stage") for r in sp(two)] == [5] and "two_stage" not in sp(plain)[0]
    assert bq.row_id(sp(two)[0]) != bq.row_id(sp(plain)[0]) and bq.sel_name(bq.sel_of(sp(two)[0])).endswith("5x")
    for k in ("ppl", "top1_agreement", "kl"):
        assert sp(two)[0][k] == pytest.approx(sp(plain)[0][k], rel=1e-6)
    for bad in (["--key-channels", "0,8", "--two-stage", "4"], ["--key-channels", "8", "--two-stage", "0"]):
        with pytest.raises(SystemExit):
            bq.main(["--tiny", "--out", str(tmp_path / "c")] + bad)
    assert "--two-stage" in capsys.readouterr().err


def test_passkey_cells_do_not_depend_on_the_other_cells_listed():
    """A (context, depth) cell's prompts are the same whether or not other contexts or depths come before it in
    the grid (one generator for the whole grid once gave a call's 4K cells other prompts when 2K was listed)."""
    import dataclasses
    bq = _load_script()
    tok = bq.TinyChat()
    text_ids = np.asarray(tok.encode("".join(f"line {i}: filler text of the haystack.\n" for i in range(400)),
                                     add_special_tokens=False), np.int32)
    grid = bq.GRIDS["tiny"]
    both = bq.passkey_prompts(tok, text_ids, grid, 0)
    alone = bq.passkey_prompts(tok, text_ids, dataclasses.replace(grid, contexts=(512,), depths=(75,)), 0)
    assert len(alone) == grid.keys
    assert [p for p in both if p["context"] == 512 and p["depth"] == 75] == alone
    assert len({p["key"] for p in both}) > 1


def _pk_row(ctx, acc, prompts=None, commit="a"):
    r = dict(task="passkey", context=ctx, depth=50, budget=None, page_size=None, attention="dense", n=20,
             accuracy=acc, same_as_dense=1.0, dense_by_construction=True, commit=commit)
    return r | ({"prompts": prompts} if prompts else {})


def test_combine_keeps_every_run_and_labels_prompt_sets(tmp_path):
    """--combine: a later file's row replaces an earlier row of the same cell (prompt set included); each input's
    command / commit stays in meta.runs and an input's own sources in combined_from; the tables put the current
    prompt set first, unlabelled, and label untagged older rows."""
    bq = _load_script()
    old = dict(meta=dict(command="old run", commit="a", combined_from=["first.json"], model="m", device="cpu"),
               rows=[_pk_row(2048, 0.9), _pk_row(4096, 0.5, "cell-seeded")])
    new = dict(meta=dict(command="new run", commit="b", model="m", device="cpu"),
               rows=[_pk_row(4096, 0.6, "cell-seeded", "b"), _pk_row(8192, 0.4, "cell-seeded", "b")])
    for name, d in (("old.json", old), ("new.json", new)):
        (tmp_path / name).write_text(json.dumps(d))
    rows, meta = bq.main(["--combine", str(tmp_path / "old.json"), str(tmp_path / "new.json"),
                          "--out", str(tmp_path), "--name", "both"])
    got = {(r["context"], r.get("prompts")): r["accuracy"] for r in rows}
    assert got == {(2048, None): 0.9, (4096, "cell-seeded"): 0.6, (8192, "cell-seeded"): 0.4}
    assert [(r["command"], r["file"]) for r in meta["runs"]] == [("old run", "old.json"), ("new run", "new.json")]
    assert meta["combined_from"] == ["first.json", "old.json", "new.json"]
    assert meta["command"] == "new run"
    table = bq.markdown(rows, meta).splitlines()
    dense = [line for line in table if line.startswith("| dense")]
    assert dense[0].startswith("| dense |") and "grid-seeded, earlier calls" in dense[1]
    assert (tmp_path / "both.png").stat().st_size > 0


def test_line_styles_never_run_out():
    bq = _load_script()
    styles = [s for _, s in zip(range(60), bq.line_styles())]
    assert len(styles) == 60 and len(set(styles[:44])) == 44


def test_text_sources(tmp_path):
    """--text: the default pydoc, a haystack source (noise: always available), a text file (its sha256 recorded);
    a path that is not a readable text file is refused by name."""
    bq = _load_script()
    text, prov = bq.corpus_text("noise")
    assert prov["source"] == "noise" and len(text) > 1000
    f = tmp_path / "t.txt"
    f.write_text("Emma Woodhouse, handsome, clever, and rich.\n" * 50)
    text, prov = bq.corpus_text(str(f))
    assert text.startswith("Emma") and prov["source"] == "t.txt" and len(prov["sha256"]) == 64
    (tmp_path / "bad.bin").write_bytes(b"\xff\xfe\x00bad")
    for bad in (str(tmp_path / "missing.txt"), str(tmp_path / "bad.bin")):
        with pytest.raises(SystemExit, match="--text"):
            bq.corpus_text(bad)


@pytest.mark.slow
def test_noise_floor_dense_bf16_against_float32(tmp_path, model):
    """dense_agreement of a model with itself is exact; bf16 against float32 (the same weights) agrees on most
    tokens with a small KL; --noise-floor adds that row to the ppl task and its line to the tables."""
    from scripts.scoring import dense_agreement
    rng = np.random.default_rng(3)
    wins = [list(map(int, rng.integers(3, 250, 96))) for _ in range(2)]
    same = dense_agreement(model, model, wins, 64)
    assert same["n"] == 2 * 31 and same["top1_agreement"] == 1.0 and abs(same["kl"]) < 1e-6
    assert same["ppl"] == pytest.approx(same["reference_ppl"])
    low = LlamaModel(get_preset("tiny"), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    f = dense_agreement(low, model, wins, 64)
    assert 0.5 <= f["top1_agreement"] <= 1.0 and 0.0 <= f["kl"] < 0.05
    assert f["reference_ppl"] == pytest.approx(same["ppl"], rel=1e-5)
    with pytest.raises(ValueError, match="prefix = 95"):
        dense_agreement(model, model, wins, 95)
    bq = _load_script()
    rows, meta = bq.main(["--tiny", "--out", str(tmp_path), "--tasks", "ppl", "--budgets", "32", "--pages", "8",
                          "--ppl-window", "160", "--ppl-prefix", "128", "--noise-floor"])
    floor = [r for r in rows if r["task"] == "ppl_floor"]
    assert len(floor) == 1 and floor[0]["model_dtype"] == "bfloat16" and floor[0]["n"] == 31 * meta["ppl"]["windows"]
    assert "Noise floor" in bq.markdown(rows, meta)


@pytest.mark.slow
def test_selection_ceiling_study_hooks(tmp_path):
    """scripts/studies/selection_ceiling.py: every layer dense reproduces dense exactly; the cross-head allocation
    runs and keeps its budget (a cell like any other)."""
    from scripts.studies import selection_ceiling
    from ulacache_jax.cache import decode_layer
    from scripts import scoring
    base = ["--tiny", "--tasks", "ppl", "--pages", "8", "--ppl-window", "160", "--ppl-prefix", "128",
            "--key-channels", "8", "--label-bits", "4"]
    keep = (scoring.TeacherForcedScorer, decode_layer.selection)
    try:
        rows, _ = selection_ceiling.main(["--dense-layers", str(get_preset("tiny").num_layers), "--", *base,
                                          "--budgets", "32", "--out", str(tmp_path / "a")])
        sp = [r for r in rows if r["task"] == "ppl" and r["attention"] == "sparse"]
        assert sp and all(r["ppl_ratio"] == pytest.approx(1.0, abs=1e-6) and r["top1_agreement"] == 1.0 for r in sp)
        scoring.TeacherForcedScorer = keep[0]
        rows, _ = selection_ceiling.main(["--cross-head", "2", "--", *base, "--budgets", "64",
                                          "--out", str(tmp_path / "b")])
        assert [r["budget"] for r in rows if r["task"] == "ppl" and r["attention"] == "sparse"] == [64]
    finally:
        scoring.TeacherForcedScorer, decode_layer.selection = keep
