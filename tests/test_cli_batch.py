"""`ulacache generate` on OpenAI Batch API files ({"custom_id", "method", "url", "body"} lines, detected per file;
results in the Batch output format, --resume keyed by custom_id), and the library's own lines taking OpenAI
nulls, harmless fields and the per-request sampling fields."""
import contextlib
import io
import json

from ulacache_jax.app import batch_lines, cli, jsonl_io
from ulacache_jax.app import openai_protocol as proto
from ulacache_jax.models import ByteTokenizer
from ulacache_jax.runtime.requests import SamplingParams

TOK = ByteTokenizer()
DEFAULTS = SamplingParams(max_new_tokens=20, stop_ids=(257,))
ARGS = ["--model", "tiny", "--page-size", "16", "--token-budget", "64", "--max-seqs", "2", "--max-context", "256",
        "--max-new-tokens", "12", "--no-progress", "--compile-cache", "off", "--attention", "sparse", "--quiet"]


def batch_line(cid, url="/v1/chat/completions", **body):
    if "messages" not in body and "prompt" not in body:
        body = {("messages" if "chat" in url else "prompt"): [{"role": "user", "content": "hi"}] if "chat" in url
                else "hello", **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def parse(lines, **kw):
    return batch_lines.parse_input(lines, tokenizer=TOK, vocab_size=258, limit=256, defaults=DEFAULTS, **kw)


def test_batch_lines_parse_like_server_bodies():
    lines = [batch_line("a", model="gpt-4o-mini", max_tokens=5, temperature=0.5, seed=3, stop=["x"]),
             batch_line("b", url="/v1/completions", prompt="hello there", max_tokens=None, top_p=None),
             batch_line("c", colour="red"),                                         # bad body field
             json.dumps({"custom_id": "d", "method": "GET", "url": "/v1/chat/completions", "body": {}}),
             batch_line("e", url="/v1/embeddings"),
             batch_line("a"),                                                       # duplicate custom_id
             batch_line("f", n=3, seed=11, temperature=0.7),
             batch_line("h", n=0),
             json.dumps({"id": 1, "prompt": "own format"}),                         # the other format
             batch_line("g", url="/v1/completions", prompt="x" * 300)]
    records, errors, skipped, _ = parse(lines)
    assert [r.id for r in records] == ["a", "b", "f"]
    a, b, f = records
    assert (a.choices, f.choices) == (1, 3)
    seeds = [f.choice_sampling(j).seed for j in range(3)]
    assert seeds[0] == 11 and len(set(seeds)) == 3                     # choice 0 keeps the body's seed
    assert all(f.choice_sampling(j).temperature == 0.7 for j in range(3))
    assert f.unit_key(0) != f.unit_key(1) and a.unit_key(0) == batch_lines.id_key("a")
    assert a.api_kind == "chat" and b.api_kind == "completion"
    assert (a.sampling.max_new_tokens, a.sampling.temperature, a.sampling.seed, a.sampling.stop) == (5, 0.5, 3, ("x",))
    assert b.sampling.max_new_tokens == 20 and b.sampling.stop_ids == (257,)    # the command line's defaults
    assert b.prompt_ids == TOK.encode("hello there")
    assert a.prompt_ids == TOK.apply_chat_template([{"role": "user", "content": "hi"}])
    got = {e.line: (e.id, e.error) for e in errors}
    assert "unknown field 'colour'" in got[3][1] and got[3][0] == "c"
    assert "'method'" in got[4][1] and "'url'" in got[5][1]
    assert "duplicate custom_id" in got[6][1] and "'n'" in got[8][1] and got[8][0] == "h"
    assert got[9][0] is None and "custom_id" in got[9][1]
    assert "context limit" in got[10][1]
    assert all(e.batch for e in errors)
    out = errors[0].as_output()
    assert out["custom_id"] == "c" and out["response"] is None and out["error"]["code"] == "invalid_request"
    assert jsonl_io.record_id(out) == "c" and not jsonl_io.record_ok(out)


def test_own_lines_take_openai_nulls_harmless_and_contract_fields():
    lines = [json.dumps({"id": 1, "prompt": "hi", "temperature": None, "stop": None, "model": "m", "user": "u",
                         "stream": False, "n": 1, "seed": None, "max_tokens": None}),
             json.dumps({"id": 2, "prompt": "hi", "stream": True}),
             json.dumps({"id": 3, "prompt": "hi", "n": 2}),
             json.dumps({"id": 4, "prompt": "hi", "presence_penalty": 3})]
    records, errors, _, _ = parse(lines)
    assert [r.id for r in records] == [1] and records[0].sampling == DEFAULTS
    got = {e.id: e.error for e in errors}
    assert "'stream'" in got[2] and "'n'" in got[3] and "presence_penalty" in got[4]
    have = proto.engine_sampling_fields()
    records, errors, _, _ = parse([json.dumps({"id": 5, "prompt": "hi", "min_p": 0.1})])
    if "min_p" in have:
        assert records[0].sampling.min_p == 0.1
    else:
        assert "'min_p' is not supported by this engine" in errors[0].error


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_generate_batch_file_end_to_end_and_resume(tmp_path):
    inp, outp = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    lines = [batch_line("q1", max_tokens=6),
             batch_line("q2", url="/v1/completions", prompt="The keeper of the light", max_tokens=6),
             batch_line("bad", temperature="hot")]
    inp.write_text("\n".join(lines) + "\n")
    rc, _, err = run_cli(["generate", "--input", str(inp), "--output", str(outp), *ARGS])
    assert rc == 1, err                                   # the bad line fails
    rows = {r["custom_id"]: r for r in map(json.loads, outp.read_text().splitlines())}
    assert set(rows) == {"q1", "q2", "bad"}
    for cid, obj in (("q1", "chat.completion"), ("q2", "text_completion")):
        r = rows[cid]
        assert r["id"].startswith("batch_req_") and r["error"] is None
        resp = r["response"]
        assert resp["status_code"] == 200 and resp["request_id"].startswith("req_")
        body = resp["body"]
        assert body["object"] == obj and body["model"] == "tiny"
        assert 1 <= body["usage"]["completion_tokens"] <= 6
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert rows["bad"]["response"] is None and "temperature" in rows["bad"]["error"]["message"]
    # --resume: the custom_ids done are skipped, the failed line is not reported again
    rc, _, err = run_cli(["generate", "--input", str(inp), "--output", str(outp), "--resume", *ARGS])
    assert rc == 1 and "2 ids already done" in err, err
    assert len(outp.read_text().splitlines()) == 3


def test_batch_line_with_n_choices_end_to_end(tmp_path):
    """A body's n: one output line with n choices (index 0..n-1), usage counting the prompt once; choice 0 is what
    the same body with n = 1 gives, the others are sampled with their own derived seeds."""
    inp, outp = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    body = dict(url="/v1/completions", prompt="The keeper of the light", max_tokens=8, temperature=1.0, seed=5)
    inp.write_text("\n".join([batch_line("three", n=3, **body), batch_line("one", **body),
                              batch_line("greedy", n=2, url="/v1/completions", prompt="abc", max_tokens=5)]) + "\n")
    rc, _, err = run_cli(["generate", "--input", str(inp), "--output", str(outp), *ARGS])
    assert rc == 0, err
    rows = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, outp.read_text().splitlines())}
    assert len(rows) == 3
    three, one = rows["three"], rows["one"]
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in three["choices"]]
    assert texts[0] == one["choices"][0]["text"]
    assert len(set(texts)) > 1, texts                  # random weights at temperature 1: the seeds differ
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert 3 <= three["usage"]["completion_tokens"] <= 24
    g = rows["greedy"]["choices"]
    assert len(g) == 2 and g[0]["text"] == g[1]["text"]


def test_batch_line_with_n_choices_resumes_from_a_checkpoint(tmp_path, monkeypatch):
    """Interrupted after two engine steps with a checkpoint each step, then resumed: every line's choices are the
    uninterrupted run's (the checkpoint maps each engine request to its line and choice)."""
    from ulacache_jax.runtime.engine import Engine
    inp = tmp_path / "batch.jsonl"
    # 33 tokens a choice: the first and two whole decode chunks of 16 (a shorter last chunk compiles its own)
    inp.write_text("\n".join(batch_line(f"c{i}", url="/v1/completions", prompt="light " * (i + 2), n=3,
                                        max_tokens=33, temperature=1.0, seed=i) for i in range(2)) + "\n")
    args = [*ARGS[:ARGS.index("--max-new-tokens")], "--no-progress", "--compile-cache", "off", "--attention",
            "sparse", "--quiet", "--max-new-tokens", "33", "--stop-ids", "none"]
    ref = tmp_path / "ref.jsonl"
    rc, _, err = run_cli(["generate", "--input", str(inp), "--output", str(ref), *args])
    assert rc == 0, err
    out, ck = tmp_path / "out.jsonl", tmp_path / "ck"
    step, calls = Engine.step, []

    def interrupted_step(self):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Engine, "step", interrupted_step)
    run = ["generate", "--input", str(inp), "--output", str(out), "--checkpoint-dir", str(ck),
           "--checkpoint-every", "1", *args]
    rc, _, err = run_cli(run)
    assert rc == 130 and "rerun with --resume" in err, err
    monkeypatch.setattr(Engine, "step", step)
    rc, _, err = run_cli(run + ["--resume"])
    assert rc == 0 and "restored from checkpoint" in err, err

    def choices(path):
        return {r["custom_id"]: [c["text"] for c in r["response"]["body"]["choices"]]
                for r in map(json.loads, path.read_text().splitlines())}
    assert choices(out) == choices(ref)
