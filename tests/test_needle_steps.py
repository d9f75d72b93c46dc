"""scripts/studies/needle_steps.py: the teacher-forced answer's steps name the right positions and needles, and on
the tiny model every rule's needle recall is a fraction, reaches 1 when the budget covers every page, and the
oracle (the true page mass) keeps at least as much needle attention as any rule when the needle pages are the
heaviest ones."""
import json

import numpy as np
import pytest

from scripts.studies import needle_steps as ns
from scripts.studies import selection_recall as sr
from ulacache_jax import models


def test_teacher_forced_steps_name_each_value_and_the_stop_decision():
    tok = models.ByteTokenizer()
    prompt = list(tok.encode("numbers: 12 and 345.", add_special_tokens=False))
    ids, steps = ns.teacher_forced(tok, prompt, ("12", "345"))
    assert tok.decode(ids[len(prompt):-1]) == "12, 345" and ids[-1] == tok.eos_ids[-1]
    phases = [(ph, ids[p + 1], nd) for ph, p, nd in steps]          # each step's position predicts ids[p + 1]
    assert [ph for ph, _, _ in phases] == ["write 1", "write 1", "after 1", "write 2", "write 2", "write 2"]
    assert [chr(t) for _, t, _ in phases] == ["1", "2", ",", "3", "4", "5"]
    assert [nd for _, _, nd in phases] == [[0], [0], [1], [1], [1], [1]]   # after the last value: nothing to find
    assert ns.find(prompt, list(tok.encode("345", add_special_tokens=False)), len(prompt)) == prompt.index(ord("3"))
    assert ns.find(prompt, list(tok.encode("999", add_special_tokens=False)), len(prompt)) == -1


def test_oracle_keeps_the_heaviest_needle_pages():
    """sr.select on the true page mass keeps the top pages: a needle page that carries the most mass is always
    selected, so its recall under the oracle is 1 at any budget of at least 4 pages (sink, recent, tail, one chosen)."""
    mass = np.array([0.05, 0.01, 0.6, 0.02, 0.3, 0.02])
    sel = set(sr.select(mass, 4).tolist())
    assert 2 in sel and 0 in sel


@pytest.mark.slow
def test_study_rows_on_the_tiny_model(tmp_path):
    assert ns.main(["--tiny", "--context", "1024", "--prompts", "1", "--page-size", "16", "--budgets", "64,1024",
                    "--rules", "mass,labels:8:4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "needle_steps.json").read_text())["rows"]
    assert (tmp_path / "needle_steps.png").stat().st_size > 0
    phases = {r["phase"] for r in rows}
    assert phases == {"write 1", "write 2", "write 3", "write 4", "after 1", "after 2", "after 3"}
    assert len(rows) == 2 * 2 * len(phases)
    for r in rows:
        assert r["needle_mass"] > 0 and 0 <= r["needle_recall"] <= 1 + 1e-9
        if r["budget"] == 1024:                                        # every page of the 1024-token context
            assert abs(r["needle_recall"] - 1) < 1e-9


@pytest.mark.slow
def test_rows_by_layer_keep_a_share_of_all_attention(tmp_path):
    """--by-layer: rows per layer, each with attention_kept, the share of the whole true attention in the selected
    pages and the tail: a fraction, 1 where the budget covers every page, and the oracle's (the top-mass pages
    beside the same forced sink and recent pages) at least any rule's at every (budget, phase, layer)."""
    assert ns.main(["--tiny", "--context", "1024", "--prompts", "1", "--page-size", "16", "--budgets", "64,1024",
                    "--rules", "mass,labels:8:4", "--by-layer", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "needle_steps.json").read_text())["rows"]
    assert (tmp_path / "needle_steps.png").stat().st_size > 0                        # the per-layer panel too
    layers = {r["layer"] for r in rows}
    assert layers == set(range(models.get_preset("tiny").num_layers))
    by = {(r["rule"], r["budget"], r["phase"], r["layer"]): r["attention_kept"] for r in rows}
    labels, = {r["rule"] for r in rows} - {"mass"}                     # the rule's name as the rows spell it
    assert all(0 <= v <= 1 + 1e-6 for v in by.values())
    for (rule, b, phase, layer), v in by.items():
        if b == 1024:
            assert abs(v - 1) < 1e-5
        if rule == "mass":
            assert v >= by[(labels, b, phase, layer)] - 1e-6


def test_bad_rules_and_budgets_are_refused_by_name(tmp_path):
    with pytest.raises(SystemExit):
        ns.main(["--tiny", "--budgets", "40", "--page-size", "16", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        ns.main(["--tiny", "--rules", "labels:64:4", "--out", str(tmp_path)])    # tiny head_dim is 16
    with pytest.raises(SystemExit):
        ns.main(["--tiny", "--rules", "two:2:labels:8:4", "--out", str(tmp_path)])
    assert not (tmp_path / "needle_steps.json").exists()
