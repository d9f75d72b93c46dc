"""scripts/frontier.py: the kept share of dense's right answers per rule, the 8B-shape bytes a step, and the speed
of a matching decode row over the same call's dense row (synthetic harness and decode files)."""
import json

import pytest

from scripts import frontier


def _longctx(tmp_path):
    prompts = [dict(id=f"p{i}", context=16384) for i in range(4)]
    outs = []
    for i, s in enumerate((1.0, 1.0, 1.0, 0.0)):                 # dense right on p0-p2
        outs.append(dict(id=f"p{i}", spec="dense", budget=None, score=s))
    for i, s in enumerate((1.0, 0.0, 1.0, 1.0)):                 # labels keep 2 of dense's 3
        outs.append(dict(id=f"p{i}", spec="labels:32:4", budget=512, score=s))
    outs.append(dict(id="p1", spec="labels:32:4", budget=512, score=1.0))   # a later run of p1 replaces it
    for i in range(4):
        outs.append(dict(id=f"p{i}", spec="two:8:4:quest", budget=512, score=0.0))  # the deleted rule: not placed
    rows = [dict(spec="dense", rule="dense", channels=0, label_bits=0, two_stage=None),
            dict(spec="labels:32:4", rule="labels", channels=32, label_bits=4, two_stage=None),
            dict(spec="two:8:4:quest", rule="quest", channels=0, label_bits=0, two_stage=[8, 4])]  # deleted rule
    path = tmp_path / "longctx.json"
    path.write_text(json.dumps(dict(prompts=prompts, outputs=outs, rows=rows)))
    return path


def test_kept_share_bytes_and_matched_speed(tmp_path):
    dec = tmp_path / "decode.json"
    rows = [dict(attention="sparse", context=131072, batch=3, budget=4096, rule="labels", key_channels=64,
                 label_bits=4, tokens_per_s=150.0, hit_rate=0.9, run="X", device="GPU"),
            dict(attention="dense", context=131072, batch=3, budget=4096, tokens_per_s=100.0, run="X", device="GPU"),
            dict(attention="sparse", context=131072, batch=3, budget=2048, rule="labels", key_channels=64,
                 label_bits=4, tokens_per_s=999.0, run="X", device="GPU")]          # another ratio: not matched
    dec.write_text(json.dumps(dict(rows=rows)))
    out = frontier.main(["--longctx", str(_longctx(tmp_path)), "--decode", str(dec), "--out", str(tmp_path / "o"),
                         "--commit", "abc"])
    by = {r["spec"]: r for r in out}
    assert set(by) == {"dense", "labels:32:4"}
    lab = by["labels:32:4"]
    assert lab["kept"] == 1.0 and lab["n_dense_right"] == 3 and lab["accuracy"] == 1.0 and lab["channels_8b"] == 64
    assert lab["speedup"] == pytest.approx(1.5) and lab["hit_rate"] == 0.9
    # 64 channels at 4 bits + a 2-byte scale a page and channel, every token of 3 x 128K, 32 layers x 8 heads
    assert lab["scorer_gb"] == pytest.approx(3 * 131072 * 32 * 8 * 64 * (0.5 + 2 / 64) / 1e9)
    assert 0 < lab["fraction_of_dense"] < 1 and by["dense"]["fraction_of_dense"] == 1.0
    data = json.loads((tmp_path / "o" / "frontier.json").read_text())
    assert data["meta"]["commit"] == "abc" and len(data["rows"]) == 2
    assert (tmp_path / "o" / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_stage_bytes_read_quest_and_the_shortlist():
    quest = frontier.step_bytes("quest", 0, 0, None, 1 / 32)
    two = frontier.step_bytes("labels", 64, 4, 4, 1 / 32)
    alone = frontier.step_bytes("labels", 64, 4, None, 1 / 32)
    assert quest["scorer_gb"] < two["scorer_gb"] < alone["scorer_gb"]
    assert two["selected_gb"] == alone["selected_gb"] == quest["selected_gb"]


def test_a_two_stage_decode_row_names_its_second_stage_and_is_matched_by_it(tmp_path):
    """bench_decode records a two-stage row's scorer as its second stage's channels and bits (two_stage.configure
    moves them from the config into the rule), and the frontier matches that row to the two-stage cell over the
    same rule, not to the plain one."""
    import dataclasses
    from scripts.bench_decode import scorer_fields
    from ulacache_jax.cache.config import CacheConfig
    from ulacache_jax.cache.select import two_stage
    from ulacache_jax.cache.select.labels import Labels
    cfg = CacheConfig.preset("tiny", key_channels=8, label_bits=4)
    assert scorer_fields(cfg) == dict(rule="labels", key_channels=8, label_bits=4)
    assert scorer_fields(two_stage.configure(cfg, 4)) == dict(rule="two_stage", key_channels=8, label_bits=4,
                                                              second_rule="labels")
    lf = two_stage.configure(cfg, 4, first=Labels(channels=2, bits=4))               # a label first stage
    assert scorer_fields(lf) == dict(rule="two_stage", key_channels=8, label_bits=4, second_rule="labels",
                                     first_rule="labels", first_channels=2, first_bits=4)
    assert scorer_fields(dataclasses.replace(cfg, key_channels=0, label_bits=0)) == dict(
        rule="quest", key_channels=0, label_bits=0)
    path = _longctx(tmp_path)
    lc = json.loads(path.read_text())
    lc["outputs"] += [dict(id=f"p{i}", spec="two:4:labels:32:4", budget=512, score=1.0) for i in range(4)]
    lc["rows"].append(dict(spec="two:4:labels:32:4", rule="labels", channels=32, label_bits=4, two_stage=4))
    path.write_text(json.dumps(lc))
    dec = tmp_path / "decode.json"
    common = dict(attention="sparse", context=131072, batch=3, budget=4096, key_channels=64, label_bits=4, run="X")
    dec.write_text(json.dumps(dict(rows=[
        dict(common, rule="labels", tokens_per_s=110.0),
        dict(common, rule="two_stage", second_rule="labels", two_stage=4, tokens_per_s=150.0),
        dict(attention="dense", context=131072, batch=3, budget=4096, tokens_per_s=100.0, run="X")])))
    out = frontier.main(["--longctx", str(path), "--decode", str(dec), "--out", str(tmp_path / "o")])
    by = {r["spec"]: r for r in out}
    assert by["two:4:labels:32:4"]["speedup"] == pytest.approx(1.5)
    assert by["labels:32:4"]["speedup"] == pytest.approx(1.1)
    # a label first stage (4 bits) before an 8-bit rerank: its harness row is matched only by the decode row with
    # that stage (channels scaled by the head dim, 64 -> 128), and its bytes are the first stage's over the context
    # at its own bits plus the rerank's
    spec = "two:4:labels:16:4+labels:64:8"
    lc["outputs"] += [dict(id=f"p{i}", spec=spec, budget=512, score=1.0) for i in range(4)]
    lc["rows"].append(dict(spec=spec, rule="labels", channels=64, label_bits=8, two_stage=4, first_rule="labels",
                           first_channels=16, first_bits=4))
    path.write_text(json.dumps(lc))
    rows = json.loads(dec.read_text())["rows"]
    two = dict(common, key_channels=128, label_bits=8, rule="two_stage", second_rule="labels", two_stage=4)
    rows.append(dict(two, first_rule="labels", first_channels=32, first_bits=4, tokens_per_s=130.0))
    rows.append(dict(two, first_rule="labels", first_channels=32, first_bits=8, tokens_per_s=190.0))   # other bits
    rows.append(dict(two, tokens_per_s=170.0))                                     # a Quest first stage: not it
    dec.write_text(json.dumps(dict(rows=rows)))
    out = frontier.main(["--longctx", str(path), "--decode", str(dec), "--out", str(tmp_path / "o")])
    lf = {r["spec"]: r for r in out}[spec]
    assert lf["speedup"] == pytest.approx(1.3) and lf["first_channels_8b"] == 32
    want = frontier.step_bytes("labels", 128, 8, 4, lf["budget_ratio"], 32, first_bits=4)
    assert lf["scorer_gb"] == pytest.approx(want["scorer_gb"])
    assert want["scorer_gb"] < frontier.step_bytes("labels", 128, 8, 4, lf["budget_ratio"], 32,
                                                   first_bits=8)["scorer_gb"]
    assert lf["scorer_gb"] < frontier.step_bytes("labels", 128, 8, None, lf["budget_ratio"])["scorer_gb"] / 2


def test_name_writes_its_own_files_and_refuses_a_path(tmp_path):
    """--name NAME writes NAME.json / NAME.png in --out (the 1.5B's frontier beside the 0.5B's); a name that is a
    path is refused before anything is written."""
    dec = tmp_path / "decode.json"
    dec.write_text(json.dumps(dict(rows=[])))
    args = ["--longctx", str(_longctx(tmp_path)), "--decode", str(dec), "--out", str(tmp_path / "o"), "--commit", "abc",
            "--head-dim", "128", "--model-label", "Qwen2.5-Coder-1.5B"]
    rows = frontier.main(args + ["--name", "frontier15b"])
    assert {r["spec"] for r in rows} == {"dense", "labels:32:4"}
    assert next(r for r in rows if r["spec"] == "labels:32:4")["channels_8b"] == 32      # 32 of 128 stays 32
    assert json.loads((tmp_path / "o" / "frontier15b.json").read_text())["meta"]["commit"] == "abc"
    assert not (tmp_path / "o" / "frontier.json").exists()
    for bad in ("../x", "a/b", ""):
        with pytest.raises(SystemExit, match="plain file stem"):
            frontier.main(args + ["--name", bad])
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["frontier15b.json", "frontier15b.png"]


def test_also_adds_another_models_cells_picked_by_model(tmp_path):
    """--also FILE:HEAD_DIM:LABEL:MODEL adds the cells of a file holding several models' rows and outputs (the
    same prompt ids), only those whose `model` is MODEL, scaled by that head dim and labelled LABEL in each row's
    `model`; a bad --also is a usage error."""
    base = json.loads(_longctx(tmp_path).read_text())
    two = dict(prompts=base["prompts"], outputs=[], rows=[])
    for model, labels_right in (("small", (1.0, 0.0, 1.0, 1.0)), ("big", (1.0, 1.0, 1.0, 0.0))):
        two["rows"] += [dict(r, model=model) for r in base["rows"][:2]]
        two["outputs"] += [dict(id=f"p{i}", model=model, spec="dense", budget=None, score=s)
                           for i, s in enumerate((1.0, 1.0, 1.0, 0.0))]
        two["outputs"] += [dict(id=f"p{i}", model=model, spec="labels:32:4", budget=512, score=s)
                           for i, s in enumerate(labels_right)]
    both = tmp_path / "both.json"
    both.write_text(json.dumps(two))
    dec = tmp_path / "decode.json"
    dec.write_text(json.dumps(dict(rows=[])))
    rows = frontier.main(["--longctx", str(_longctx(tmp_path)), "--decode", str(dec), "--out", str(tmp_path / "o"),
                          "--also", f"{both}:128:Big-1.5B:big"])
    big = {r["spec"]: r for r in rows if r["model"] == "Big-1.5B"}
    assert {r["model"] for r in rows} == {"Qwen2.5-Coder-0.5B", "Big-1.5B"} and set(big) == {"dense", "labels:32:4"}
    assert big["labels:32:4"]["kept"] == 1.0 and big["labels:32:4"]["n"] == 4       # big's outputs only (small: 2/3)
    assert big["labels:32:4"]["channels_8b"] == 32                                    # 32 of 128 stays 32
    meta = json.loads((tmp_path / "o" / "frontier.json").read_text())["meta"]
    assert meta["sources"]["also"] == [f"{both}:128:Big-1.5B:big"]
    for bad in (f"{both}:x:Big", f"{both}:128", f"{both}:0:Big", f"{both}:128::big"):
        with pytest.raises(SystemExit):
            frontier.main(["--out", str(tmp_path / "p"), "--also", bad])


def test_a_page_16_cell_is_matched_by_page_16_rows_and_priced_at_page_16(tmp_path):
    """A harness cell run at pages of 16 (row page_size 16) takes its speed only from a decode row at page 16 (the
    page-64 row of the same rule and ratio is another configuration, and so is a row over fp8 pages), its dense
    row from the same call at any page but in the model's dtype; its bytes are those of page 16: the same selected
    share, but the labels' per-page scales cost 4x more a token than at page 64."""
    path = _longctx(tmp_path)
    lc = json.loads(path.read_text())
    lc["outputs"] += [dict(id=f"p{i}", spec="labels:32:4@p16", budget=512, score=1.0) for i in range(4)]
    lc["rows"].append(dict(spec="labels:32:4@p16", rule="labels", channels=32, label_bits=4, two_stage=None,
                           page_size=16))
    path.write_text(json.dumps(lc))
    dec = tmp_path / "decode.json"
    common = dict(attention="sparse", context=131072, batch=3, budget=4096, rule="labels", key_channels=64,
                  label_bits=4, run="X")
    dec.write_text(json.dumps(dict(rows=[
        dict(common, page=16, tokens_per_s=140.0),
        dict(common, page=64, tokens_per_s=200.0),                          # the page-64 row: not the p16 cell's
        dict(common, page=64, kv_dtype="float8_e4m3fn", tokens_per_s=300.0),  # fp8 pages: another configuration
        dict(attention="dense", context=131072, batch=3, budget=4096, tokens_per_s=50.0, run="X", page=64,
             kv_dtype="float8_e4m3fn"),                                    # nor the baseline: dense over fp8
        dict(attention="dense", context=131072, batch=3, budget=4096, tokens_per_s=100.0, run="X", page=64)])))
    out = frontier.main(["--longctx", str(path), "--decode", str(dec), "--out", str(tmp_path / "o")])
    by = {r["spec"]: r for r in out}
    assert by["labels:32:4@p16"]["speedup"] == pytest.approx(1.4) and by["labels:32:4@p16"]["page_size"] == 16
    assert by["labels:32:4"]["speedup"] == pytest.approx(2.0) and by["labels:32:4"]["page_size"] == 64
    p16, p64 = (frontier.step_bytes("labels", 64, 4, None, 1 / 32, page_size=p) for p in (16, 64))
    assert p16["scorer_gb"] == pytest.approx(3 * 131072 * 32 * 8 * 64 * (0.5 + 2 / 16) / 1e9)
    assert p16["scorer_gb"] > p64["scorer_gb"]
    assert by["labels:32:4@p16"]["scorer_gb"] == pytest.approx(p16["scorer_gb"])


def test_kept_counts_whole_answers_and_kept_score_the_partial_credit(tmp_path):
    """On a task scored in fractions (multi-value: the share of values found), `kept` is the share of dense's
    right answers the rule gets wholly right; `kept_score` is its mean score on them."""
    path = _longctx(tmp_path)
    lc = json.loads(path.read_text())
    lc["outputs"] += [dict(id=f"p{i}", spec="labels:64:4", budget=512, score=s)
                      for i, s in enumerate((1.0, 0.75, 0.5, 1.0))]               # dense right on p0-p2
    lc["rows"].append(dict(spec="labels:64:4", rule="labels", channels=64, label_bits=4, two_stage=None))
    path.write_text(json.dumps(lc))
    dec = tmp_path / "decode.json"
    dec.write_text(json.dumps(dict(rows=[])))
    out = {r["spec"]: r for r in frontier.main(["--longctx", str(path), "--decode", str(dec),
                                                "--out", str(tmp_path / "o")])}
    assert out["labels:64:4"]["kept"] == pytest.approx(1 / 3)
    assert out["labels:64:4"]["kept_score"] == pytest.approx(2.25 / 3)
    assert out["labels:32:4"]["kept"] == out["labels:32:4"]["kept_score"] == 1.0
