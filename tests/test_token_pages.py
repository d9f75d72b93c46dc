"""scripts/studies/token_pages.py: the count of pages holding a chosen token, and its command line."""
import json

import numpy as np
import pytest

from scripts.studies import token_pages


def test_pages_touched_counts_flushed_pages_holding_a_chosen_token():
    """A page counts once however many of its tokens are chosen; the unflushed tail never counts."""
    import jax.numpy as jnp
    chosen = np.zeros((2, 64), bool)                   # 2 KV heads, 4 pages of 16, pos 50: pages 0-2 flushed
    chosen[0, [0, 1, 2, 17, 60]] = True                # head 0: pages 0 and 1 (60 is in the tail page 3)
    chosen[1, 32:48] = True                            # head 1: page 2 whole
    got = token_pages.pages_touched(jnp.asarray(chosen), jnp.int32(50), page=16)
    assert np.asarray(got).tolist() == [2, 1]


def test_tiny_run_counts_every_configuration(tmp_path):
    """One shortlisted page set fetched whole is the budget's pages exactly; a shortlist of M touches at most M
    times them; rows are appended run by run; a file that is not ours is refused by name and left alone."""
    args = ["--tiny", "--label-channels", "8", "--window", "384", "--queries", "32", "--stride", "16",
            "--budget", "64", "--shortlist", "0", "1", "2", "--out", str(tmp_path)]
    assert token_pages.main(args) == 0
    assert token_pages.main(args + ["--run", "again"]) == 0
    data = json.load(open(tmp_path / "token_pages.json"))
    assert [r["run"] for r in data["runs"]] == ["", "again"]
    assert (tmp_path / "token_pages.png").stat().st_size > 0
    rows = {r["shortlist"]: r for r in data["runs"][0]["rows"]}
    assert rows[1]["mean_x_budget"] == 1.0 and rows[1]["share_of_shortlist"] == 1.0
    assert 1.0 <= rows[2]["mean_x_budget"] <= 2.0 and rows[2]["max_x_budget"] <= 2.0
    assert rows[0]["share_of_shortlist"] is None and rows[0]["mean_x_budget"] >= 1.0
    assert rows[2]["n"] == 2 * 2 * 2                   # positions x layers x KV heads of the tiny preset
    assert all(0.0 < r["recall_mean"] <= 1.0 + 1e-6 for r in rows.values())
    # ranked by the true logits, a choice among more candidates keeps at least the mass of one among fewer
    assert token_pages.main(args[:2] + ["0"] + args[3:-1] + [str(tmp_path / "t")]) == 0
    true = {r["shortlist"]: r for r in json.load(open(tmp_path / "t" / "token_pages.json"))["runs"][0]["rows"]}
    assert true[0]["recall_mean"] >= true[2]["recall_mean"] - 1e-6 >= true[1]["recall_mean"] - 2e-6
    bad = tmp_path / "b"
    bad.mkdir()
    (bad / "token_pages.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="token_pages.json"):
        token_pages.main(args[:-1] + [str(bad)])
    assert (bad / "token_pages.json").read_text() == "[1, 2]"


@pytest.mark.parametrize("bad", [["--budget", "40"], ["--budget", "32"], ["--shortlist", "-1"],
                                 ["--queries", "400"], ["--stride", "0"], ["--label-channels", "7"],
                                 ["--page-size", "8"]])
def test_bad_arguments_are_refused_by_name(tmp_path, bad):
    with pytest.raises(SystemExit, match=bad[0]):
        token_pages.main(["--tiny", "--window", "384", "--queries", "32", "--budget", "64", "--out", str(tmp_path)]
                         + bad)
    assert not (tmp_path / "token_pages.json").exists()
