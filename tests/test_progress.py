"""Progress without a terminal (app/progress.py) and the report's time split (load / steps that compiled / steady
steps / other): issue 51 item 5."""
import io
import json

import pytest

from ulacache_jax.app.progress import ProgressLog


class _Engine:
    num_running, num_queued = 2, 3

    def elapsed(self):
        return 4.0

    def stats_totals(self):
        return {"hits": 9, "misses": 1, "overflow": 0, "fetched": 1}


def test_progress_log_prints_at_most_every_interval():
    t = [0.0]
    out = io.StringIO()
    log = ProgressLog(10, every=5.0, stream=out, clock=lambda: t[0])
    for now, done in ((1.0, 1), (4.9, 2), (5.0, 3), (7.0, 4), (10.5, 5)):
        t[0] = now
        log.update(done, 40 * done, _Engine())
    log.close()
    lines = out.getvalue().splitlines()
    assert lines == ["ulacache: 3/10 requests done, 120 tokens, 30.0 tok/s, 2 running, 3 queued, HBM hit rate 0.900",
                     "ulacache: 5/10 requests done, 200 tokens, 50.0 tok/s, 2 running, 3 queued, HBM hit rate 0.900",
                     "ulacache: 5/10 requests done, 200 tokens, 50.0 tok/s, 2 running, 3 queued, HBM hit rate 0.900"]
    quiet = io.StringIO()
    log = ProgressLog(10, every=100.0, stream=quiet, clock=lambda: 0.0)
    log.update(1, 1, _Engine())
    log.close()
    assert quiet.getvalue() == ""                         # nothing printed: no closing line either
    with pytest.raises(ValueError, match="must be > 0"):
        ProgressLog(1, every=0)


def test_cli_logs_progress_without_a_terminal_and_splits_the_time(tmp_path):
    """The real command with stderr a pipe: progress lines appear (every 0.01 s); the report's time is load +
    steps that compiled + steady steps + other = wall, and the plot is drawn from process start."""
    from test_cli_safety import _cmd, _run_all
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt_ids": [1 + i, 2, 3]}) + "\n" for i in range(6)))
    rep = tmp_path / "r.json"
    # 33 tokens: the first and two whole decode chunks of 16, one decode program (a shorter last chunk compiles its
    # own)
    (rc, out, err), = _run_all([_cmd("--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--max-seqs", "2",
                                     "--max-new-tokens", "33", "--page-size", "16", "--stop-ids", "none",
                                     "--compile-cache", "off", "--progress-every", "0.01", "--report", str(rep))])
    assert rc == 0, err
    lines = [x for x in err.splitlines() if "requests done" in x]
    assert lines and lines[-1].startswith("ulacache: 6/6 requests done"), err
    r = json.loads(rep.read_text())
    parts = (r["load_s"], r["compile_steps_s"], r["steady_steps_s"])
    assert all(p >= 0 for p in parts) and r["load_s"] > 0 and sum(parts) <= r["wall_s"] + 1e-6, r
    assert "wall = load" in out and (tmp_path / "r.png").stat().st_size > 0
    (rc, _, err), = _run_all([_cmd("--input", str(inp), "--output", str(tmp_path / "o2.jsonl"), "--max-new-tokens",
                                   "4", "--compile-cache", "off", "--quiet", "--no-progress", "--progress-every",
                                   "0.01")])
    assert rc == 0 and "requests done" not in err, err
