import json
import re

import numpy as np
import pytest

from scripts.studies import oracle_ppl


@pytest.mark.slow
def test_every_page_is_dense_and_a_small_budget_is_not(tmp_path):
    """The oracle with every page kept scores exactly what the dense pass scores; a budget of 4 pages of 16 does not;
    runs append to the JSON."""
    args = ["--tiny", "--window", "256", "--prefix", "192", "--windows", "2", "--page-size", "16",
            "--budget", "64", "1024", "--out", str(tmp_path)]
    assert oracle_ppl.main(args) == 0
    assert oracle_ppl.main(args + ["--run", "again"]) == 0
    data = json.load(open(tmp_path / "oracle_ppl.json"))
    assert [r["run"] for r in data["runs"]] == ["", "again"]
    s = {x["config"]: x for x in data["runs"][0]["summary"]}
    dense, every, few = s["dense"], s["oracle, budget 1024, page 16"], s["oracle, budget 64, page 16"]
    assert dense["n"] == every["n"] == few["n"] == 2 * (256 - 1 - 192)
    assert every["ppl"] == pytest.approx(dense["ppl"], rel=1e-5) and every["top1_agreement"] == 1.0
    assert every["kl"] == pytest.approx(0.0, abs=1e-6)
    assert few["kl"] > 1e-4 and few["top1_agreement"] < 1.0
    assert (tmp_path / "oracle_ppl.png").stat().st_size > 0


def test_summary_pools_windows_by_their_positions():
    """ppl over every scored position (not a mean of the windows' ppl), ratios to the dense row, top-1 and KL per
    position."""
    rows = [{"window": w, "config": c, "page_size": p, "budget": b, "budget_ratio": r, "n": n, "nll_sum": s,
             "top1_same": t, "kl_sum": k}
            for w, n in ((0, 10), (1, 30))
            for c, p, b, r, s, t, k in (("dense", None, None, 1.0, 1.0 * n, n, 0.0),
                                        ("oracle, budget 64, page 16", 16, 64, 0.25, (1.0 if w == 0 else 2.0) * n,
                                         n // 2, 0.1 * n))]
    dense, sparse = oracle_ppl.summarize(rows)
    assert dense["n"] == sparse["n"] == 40 and dense["ppl"] == pytest.approx(np.e) and dense["ppl_ratio"] == 1.0
    assert sparse["ppl"] == pytest.approx(np.exp((10 + 60) / 40))
    assert sparse["ppl_ratio"] == pytest.approx(np.exp((10 + 60) / 40 - 1))
    assert sparse["top1_agreement"] == pytest.approx(20 / 40) and sparse["kl"] == pytest.approx(0.1)


@pytest.mark.parametrize("bad, needle", [(["--prefix", "300"], "--prefix 300"),
                                         (["--budget", "40"], "--budget 40"),
                                         (["--budget", "48"], "more than --sink 1 + --recent 2"),
                                         (["--windows", "0"], "--windows 0")])
def test_bad_values_name_the_option(tmp_path, bad, needle):
    with pytest.raises(SystemExit, match=re.escape(needle)):
        oracle_ppl.main(["--tiny", "--window", "256", "--prefix", "192", "--out", str(tmp_path), *bad])
    assert not (tmp_path / "oracle_ppl.json").exists()


@pytest.mark.parametrize("content", ["not json", '{"rows": []}', None])
def test_a_foreign_results_file_stops_the_run_by_name_and_is_kept(tmp_path, content):
    """An oracle_ppl.json this study did not write (not JSON, another script's, a folder) stops the run before the
    model loads, naming it, and is left as it was."""
    target = tmp_path / "oracle_ppl.json"
    if content is None:
        target.mkdir()
    else:
        target.write_text(content)
    with pytest.raises(SystemExit, match=re.escape(repr(str(target)))):
        oracle_ppl.main(["--tiny", "--window", "256", "--prefix", "192", "--out", str(tmp_path)])
    assert target.is_dir() if content is None else target.read_text() == content
