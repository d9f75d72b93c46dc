"""scripts/bench_longctx.py on the tiny random model: prompts made to a file and answered from it, dense and sparse
rules on the same prompts, the row vocabulary, and the rule / budget parsing."""
import json
import os

import pytest

from scripts import bench_longctx as bl

VOCAB = {"model", "attention", "rule", "channels", "label_bits", "kv_dtype", "task", "context", "prompt_tokens",
         "depth", "batch", "budget", "page_size", "accuracy", "same_as_dense", "n", "tokens_per_s", "device",
         "commit"}
PROMPT_ARGS = ["--tiny", "--tasks", "niah_single,niah_multikey", "--contexts", "1024", "--depths", "0.5",
               "--num-prompts", "2", "--haystack", "noise", "--max-new", "8"]   # 8 new tokens: one decode program


@pytest.mark.slow  # a benchmark script end to end: the second tier (Makefile)
def test_prompts_file_then_dense_and_sparse(tmp_path):
    pfile = str(tmp_path / "prompts.json")
    assert bl.main(["--make-prompts", pfile, *PROMPT_ARGS]) is None
    with open(pfile) as fh:
        made = json.load(fh)["prompts"]
    assert len(made) == 4 and {p["task"] for p in made} == {"niah_single", "niah_multikey"}
    assert all(p["chat_tokens"] + p["max_new_tokens"] <= 1024 and p["chat_tokens"] > 950 for p in made)
    # the file holds what the same arguments make in-process
    again, _ = bl.make_prompts(bl.load_tokenizer("tiny"), tasks=["niah_single", "niah_multikey"], contexts=[1024],
                               depths=[0.5], num_prompts=2, haystack="noise", seed=0, max_new=8)
    assert again == made

    with pytest.raises(SystemExit, match="no prompts left"):      # a subset of the file: here none
        bl.main(["--prompts", pfile, "--tiny", "--contexts", "2048", "--out", str(tmp_path / "none")])

    out = str(tmp_path / "out")
    res = bl.main(["--prompts", pfile, "--tiny", "--dtype", "float32", "--rules", "dense,quest,key_copy:4",
                   "--budgets", "256", "--batch", "4", "--out", out, "--commit", "test"])
    with open(os.path.join(out, "longctx.json")) as fh:
        data = json.load(fh)
    assert os.path.exists(os.path.join(out, "longctx.png"))
    rows = data["rows"]
    assert len(rows) == 3 * 2                                  # (dense, quest, key_copy) x 2 tasks, one depth
    for r in rows:
        assert VOCAB <= set(r), VOCAB - set(r)
        assert r["attention"] in ("dense", "sparse") and r["rule"] in ("dense", "quest", "key_copy", "labels")
        assert 0.0 <= r["same_as_dense"] <= 1.0 and 0.0 <= r["accuracy"] <= 1.0 and r["n"] == 2
        assert r["context"] == 1024 and r["depth"] == 0.5 and r["commit"] == "test" and r["batch"] == 4
    dense = [r for r in rows if r["rule"] == "dense"]
    assert dense and all(r["same_as_dense"] == 1.0 and r["budget"] is None for r in dense)
    kc = [r for r in rows if r["rule"] == "key_copy"]
    assert kc and all(r["channels"] == 4 and r["budget"] == 256 and r["attention"] == "sparse" for r in kc)
    # the per-prompt outputs recompute same_as_dense
    outs = data["outputs"]
    assert len(outs) == 3 * 4
    dense_text = {o["id"]: o["output"] for o in outs if o["spec"] == "dense"}
    for r in rows:
        ids = [p["id"] for p in data["prompts"] if p["task"] == r["task"]]
        got = {o["id"]: o["output"] for o in outs if o["spec"] == r["spec"] and o["id"] in ids}
        assert r["same_as_dense"] == sum(got[i] == dense_text[i] for i in ids) / len(ids)
    assert all("text" not in p for p in data["prompts"])       # haystack text stays out of the results
    assert [p["id"] for p in data["prompts"]] == [p["id"] for p in made]

    # in-process prompts (no file) give the same prompts and the same dense answers
    out2 = str(tmp_path / "out2")
    res2 = bl.main([*PROMPT_ARGS, "--dtype", "float32", "--rules", "dense", "--batch", "4", "--out", out2])
    assert res2["meta"]["prompts_digest"] == res["meta"]["prompts_digest"]
    assert {o["id"]: o["output"] for o in res2["outputs"]} == dense_text


def test_rules_and_budgets(tmp_path):
    from ulacache_jax.cache.config import CacheConfig
    table = str(tmp_path / "table.json")
    with open(table, "w") as fh:
        json.dump({"model_digest": "x", "channels": [[[0, 1, 2, 3]] * 2] * 2}, fh)
    rules = bl.parse_rules(f"quest,labels:4:8:{table},dense,key_copy:6,labels:4:4")
    assert [r.spec for r in rules][0] == "dense"                       # dense runs first
    lab = next(r for r in rules if r.table_path)
    cc = lab.cache_config(CacheConfig.preset("tiny"))
    assert (cc.key_channels, cc.label_bits, cc.rule) == (4, 8, "labels") and len(cc.channel_table) == 2
    kc = next(r for r in rules if r.rule == "key_copy").cache_config(CacheConfig.preset("tiny"))
    assert (kc.key_channels, kc.label_bits, kc.rule) == (6, 0, "key_copy")
    # two:MULT:<rule>: Quest's page bound shortlists MULT x the budget for <rule> to rank
    base = CacheConfig.preset("tiny")
    two = bl.parse_rules("two:4:labels:4:4")[0]
    tc = two.cache_config(base)
    assert (two.two_stage, two.rule, tc.rule) == (4, "labels", "two_stage")
    assert (tc.selection.keep_pages, tc.selection.second.channels, tc.selection.second.bits) == \
        (4 * base.select_pages, 4, 4)
    # two:MULT:<first>+<rule>: <first> shortlists in Quest's place (rows say which)
    lf = bl.parse_rules(f"two:4:labels:4:4:{table}+labels:16:4")[0]
    lc = lf.cache_config(base)
    assert (lf.two_stage, lf.rule, lf.channels, lc.rule) == (4, "labels", 16, "two_stage")
    first = lc.selection.first
    assert (first.channels, first.bits, first.table, lc.selection.second.channels) == (4, 4, cc.channel_table, 16)
    assert bl.first_fields(lf) == dict(first_rule="labels", first_channels=4, first_bits=4)
    assert bl.first_fields(two) == {}
    for bad in ("two:0:quest", "two:4:dense", "two:4", "two:8:4:quest", "two:4:two:2:quest", "two:4:quest+labels:4:4",
                "two:4:dense+labels:4:4", "two:4:labels:4:4+dense", "two:4:labels:4:4+labels:4:4+labels:4:4",
                "two:4:labels:4:3+labels:4:4"):
        with pytest.raises(SystemExit):
            bl.parse_rules(bad)
    with pytest.raises(SystemExit):
        bl.parse_rules("labels:4:3")
    with pytest.raises(SystemExit):
        bl.parse_rules("topk")
    assert bl.budgets_for(16384, [512, 1000, 16384], [0.0078125, 0.03125], 64) == ([128, 512, 1024], [16384])


def test_auto_table_is_the_models_shipped_one():
    """labels:C:BITS:auto takes the shipped table of the model (found by its preset's pinned sha256: no file is
    read or hashed); a model without a table, or a C its table lacks, is refused naming the rule before any model
    loads."""
    from ulacache_jax.models import calibration
    rule, = bl.parse_rules("labels:32:4:auto")
    assert rule.table_path == "auto" and rule.table is None
    got, = bl.resolve_tables([rule], "qwen2.5-coder-0.5b")
    assert got.table == calibration.channel_table("qwen2.5-coder-0.5b", 32)
    assert got.table_digest == calibration.model_digest("qwen2.5-coder-0.5b")
    assert os.path.basename(got.table_path) == got.table_digest[:16] + ".json"
    with pytest.raises(SystemExit, match=r"labels:32:4:auto.*no shipped label-channel table"):
        bl.resolve_tables([rule], "tiny")
    with pytest.raises(SystemExit, match=r"labels:12:4:auto.*C = \[8, 16, 32\], not 12"):
        bl.resolve_tables(bl.parse_rules("labels:12:4:auto"), "qwen2.5-coder-0.5b")
    untouched = bl.parse_rules("quest,labels:32:4")
    assert bl.resolve_tables(untouched, "tiny") == untouched
    two, = bl.resolve_tables(bl.parse_rules("two:4:labels:16:4:auto+labels:64:4"), "qwen2.5-coder-0.5b")
    assert two.first.table == calibration.channel_table("qwen2.5-coder-0.5b", 16) and two.table is None


@pytest.mark.slow
def test_exact_rule(tmp_path):
    """exact:K:<rule>: the rule drafts with sparse attention, dense attention verifies, so (float32) every answer
    equals dense's; rows carry K and the speculative counters."""
    ex = bl.parse_rules("exact:3:labels:4:4")[0]
    assert (ex.exact, ex.rule, ex.channels, ex.attention) == (3, "labels", 4, "dense")
    for bad in ("exact:0:quest", "exact:x:quest", "exact:2:dense", "exact:2", "exact:2:exact:2:quest"):
        with pytest.raises(SystemExit):
            bl.parse_rules(bad)
    out = str(tmp_path / "out")
    res = bl.main([*PROMPT_ARGS, "--dtype", "float32", "--rules", "dense,exact:3:quest", "--budgets", "256",
                   "--batch", "4", "--out", out, "--commit", "test"])
    rows = [r for r in res["rows"] if r["spec"] == "exact:3:quest"]
    assert len(rows) == 2 and all(r["same_as_dense"] == 1.0 and r["budget"] == 256 and r["exact"] == 3
                                  and r["attention"] == "dense" for r in rows)
    assert all(0.0 <= r["acceptance"] <= 1.0 and r["verifications"] > 0 and r["tokens_per_verification"] >= 1.0
               for r in rows)


def test_page_series_keeps_a_spec_run_at_several_pages_apart():
    """A spec that ran at pages of 16 and 32 becomes two series (`spec@p16`, `spec@p32`) for the plot, so its runs
    are not averaged; a spec at one page size and dense keep their names."""
    rows = [dict(spec="dense", page_size=16), dict(spec="labels:64:4", page_size=16),
            dict(spec="labels:64:4", page_size=32), dict(spec="labels:32:4:auto", page_size=16),
            dict(spec="labels:32:4:auto", page_size=16), dict(spec="quest")]
    assert [r["spec"] for r in bl.page_series(rows)] == [
        "dense", "labels:64:4@p16", "labels:64:4@p32", "labels:32:4:auto", "labels:32:4:auto", "quest"]
    assert rows[1]["spec"] == "labels:64:4"                                      # the caller's rows are not edited
