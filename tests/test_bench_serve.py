"""scripts/bench_serve.py on the tiny preset with tiny numbers: it starts `ulacache serve` itself, streams through
the openai client, runs the offline Engine, and writes its JSON rows and PNG."""
import json

import pytest

pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from scripts import bench_serve  # noqa: E402


@pytest.mark.slow  # a benchmark script end to end: the second tier (Makefile)
def test_bench_serve_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    out = tmp_path / "serve"
    bench_serve.main(["--model", "tiny", "--clients", "4", "--prompt-lengths", "32,64,128", "--max-tokens", "8",
                      "--page-size", "16", "--token-budget", "64", "--max-context", "256",
                      "--decode-chunk-steps", "4", "--time-limit", "120", "--out", str(out), "--commit", "test"])
    res = json.loads((out / "serve.json").read_text())
    assert res["meta"]["commit"] == "test" and res["meta"]["clients"] == 4
    rows = {r["kind"]: r for r in res["rows"]}
    assert set(rows) == {"server", "check", "offline", "long_prompt"}
    s, o, c, lp = rows["server"], rows["offline"], rows["check"], rows["long_prompt"]
    assert s["completed"] == s["requests"] == 4 and not s["timed_out"] and not s["errors"]
    assert s["tokens_per_s"] > 0 and o["tokens_per_s"] > 0 and o["server_over_offline"] > 0
    assert s["generated_tokens"] == o["generated_tokens"] == 5 * 8           # ignore_eos: every token generated
    assert c["same_text"] and c["requests"] == 3 and c["load_same_text"] == 4 and c["long_same_text"]
    for r in (s, o):
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert 0 <= r["itl_ms_p50"] <= r["itl_ms_p99"] <= r["itl_ms_max"]
    assert s["e2e_p50_s"] <= s["e2e_p99_s"]
    assert lp["prompt_tokens"] == 128 and lp["ttft_alone_s"] > 0 and lp["ttft_under_load_s"] > 0
    assert (out / "serve.png").stat().st_size > 0
