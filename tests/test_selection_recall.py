"""scripts/studies/selection_recall.py on the tiny model: every rule's recall is a fraction of the true page mass,
grows with the budget, is 1 when the budget covers every page, and the scorers' bytes order as their formats."""
import json

import numpy as np

from scripts.studies import selection_recall as sr


def test_recall_rows(tmp_path):
    assert sr.main(["--tiny", "--contexts", "512", "--prompts", "1", "--budgets", "128,256,1024", "--page-size", "16",
                    "--rules", "quest,key_copy:4,labels:4:8,labels:4:4,two:2:labels:4:4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "selection_recall.json").read_text())["rows"]
    assert len(rows) == 15
    by = {(r["rule"], r["label_bits"], r["budget"]): r for r in rows}
    for r in rows:
        assert 0 < r["recall_worst_layer"] <= r["recall"] <= 1 + 1e-6 and r["recall_p10"] <= r["recall"] + 1e-9
    for key in {(r, b) for r, b, _ in by}:
        rec = [by[key + (b,)]["recall"] for b in (128, 256, 1024)]
        assert rec[0] <= rec[1] + 1e-9 and abs(rec[2] - 1) < 1e-5          # 1024 covers every page of 512
    bytes_ = {k[:2]: by[k]["scorer_bytes_per_token"] for k in by}
    assert bytes_[("labels", 4)] < bytes_[("labels", 8)] < bytes_[("key_copy", None)]
    # the two-stage rule: Quest's page summaries (2 * D * 2 / 16 bytes a token) + the labels over 2 x the budget
    two = {b: by[("two_stage/labels", 4, b)] for b in (128, 256, 1024)}
    assert two[128]["shortlist_mult"] == 2 and "group_pages" not in two[128]
    assert bytes_[("quest", None)] == 2 * 16 * 2 / 16
    assert abs(two[128]["scorer_bytes_per_token"] - (bytes_[("quest", None)] + bytes_[("labels", 4)] * 0.5)) < 1e-9
    assert abs(two[1024]["scorer_bytes_per_token"] - (bytes_[("quest", None)] + bytes_[("labels", 4)])) < 1e-9


def test_select_keeps_sink_recent_and_top_pages():
    scores = np.array([0.0, 5.0, 1.0, 9.0, 2.0, 0.5])
    np.testing.assert_array_equal(sr.select(scores, 4), [0, 3, 5])        # sink, top, the last flushed (recent)
    np.testing.assert_array_equal(sr.select(scores, 10), np.arange(6))


def test_shortlist_mask_keeps_the_top_quest_bounds():
    """The study's first stage: the keep_pages pages of highest Quest bound (the tail past the last whole page is
    not a page); a shortlist of at least every page keeps them all."""
    rng = np.random.default_rng(0)
    k, q = rng.standard_normal((8 * 16 + 5, 4)), rng.standard_normal((2, 4))
    bound = sr.rule_scores(("quest",), k, q, 16)                                         # [8]
    mask = sr.shortlist_mask(k, q, 16, 3)
    assert mask.shape == (8,) and set(np.flatnonzero(mask).tolist()) == set(np.argsort(-bound)[:3].tolist())
    assert sr.shortlist_mask(k, q, 16, 8).all() and sr.shortlist_mask(k, q, 16, 20).all()
    assert sr.parse_rule("two:4:labels:8:4") == ("two", 4, ("labels", 8, 4, "online"))
