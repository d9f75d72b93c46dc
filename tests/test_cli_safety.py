"""Nothing lost (issue 23, part 1): the `ulacache generate` output is refused when it is the input, locked, written
in whole lines, repaired and keyed by settings on --resume; bad text fails its own line; paths, device memory and
broken model folders are refused before any work with a clear message; SIGTERM and Ctrl-C stop gracefully.

The CLI cases run the real `ulacache` command in a subprocess (the tiny preset, tiny shapes); the file helpers
of ulacache_jax/app/jsonl_io.py are also tested directly."""
import errno
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ulacache_jax.app import batch_lines, cli
from ulacache_jax.app import jsonl_io
from ulacache_jax.runtime.text import apply_stop
from ulacache_jax.runtime.engine import SamplingParams
from ulacache_jax.models import ByteTokenizer

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
ARGS = ["--page-size", "16", "--token-budget", "64", "--max-seqs", "2", "--max-context", "256",
        "--max-new-tokens", "8", "--no-progress", "--stop-ids", "none", "--compile-cache", "off", "--quiet"]
ULACACHE = [sys.executable, "-m", "ulacache_jax"]


def _cmd(*argv):
    model = [] if "--model" in argv else ["--model", "tiny"]     # the default model is the trained SmolLM2
    return [*ULACACHE, "generate", *model, *argv]


def _start(argv, **kw):
    # CPU only: with every platform allowed, jax also probes TPU at start-up, and on a loaded machine its "TPU
    # backend initialization is taking more than N seconds" warning lands in the stderr these tests read
    kw.setdefault("env", dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS") or "cpu"))
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _run_all(cmds, timeout=300):
    """Run the commands at once (each pays the JAX import) -> [(rc, stdout, stderr)]."""
    procs = [_start(c) for c in cmds]
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *o) for p, o in zip(procs, outs)]


def _records(path):
    return [json.loads(x) for x in pathlib.Path(path).read_text(encoding="utf-8").splitlines()]


# ---- file helpers ---------------------------------------------------------------------------------------------
def test_split_lines_bom_bad_bytes_and_line_separators():
    data = jsonl_io.BOM + b'{"a": 1}\r\n' + b'{"b": "\xff"}\n' + '{"c": "x\u2028y"}\n'.encode() + b"\n" + b'{"d": 4}'
    lines = jsonl_io.split_lines(data)
    assert [ln.number for ln in lines] == [1, 2, 3, 4, 5]
    assert lines[0].text == '{"a": 1}'                      # BOM dropped, \r dropped: the first request is kept
    assert lines[1].text is None and "0xff" in lines[1].error and "byte 8 of the line" in lines[1].error
    assert json.loads(lines[2].text) == {"c": "x\u2028y"}   # U+2028 inside a string does not split the line
    assert lines[3].text == "" and lines[4].text == '{"d": 4}'


def test_lone_surrogate_named():
    assert jsonl_io.lone_surrogate("fine é") is None
    assert "U+D800 at character 2" in jsonl_io.lone_surrogate(json.loads('"ab\\ud800"'))


def test_same_file_through_symlinks_and_relative_paths(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    f = tmp_path / "in.jsonl"
    f.write_text("x\n")
    (tmp_path / "link.jsonl").symlink_to(f)
    os.link(f, tmp_path / "hard.jsonl")
    monkeypatch.chdir(tmp_path)
    assert jsonl_io.same_file("in.jsonl", "d/../in.jsonl")
    assert jsonl_io.same_file("in.jsonl", tmp_path / "link.jsonl")
    assert jsonl_io.same_file("in.jsonl", "hard.jsonl")
    assert not jsonl_io.same_file("in.jsonl", "out.jsonl")


def test_read_output_repairs_only_the_tail(tmp_path):
    p = tmp_path / "o.jsonl"
    good = [{"id": i, "line": i, "finish_reason": "stop"} for i in range(3)]
    body = b"".join(json.dumps(r).encode() + b"\n" for r in good)
    p.write_bytes(body + b'{"id": 3, "li')
    got = jsonl_io.read_output(p)
    assert got.records == good and got.torn_tail == b'{"id": 3, "li' and got.bad_lines == []
    p.write_bytes(body + json.dumps(good[0]).encode())      # complete record, newline missing: kept
    got = jsonl_io.read_output(p)
    assert len(got.records) == 4 and not got.torn_tail
    p.write_bytes(b"not a record\n" + body)
    assert jsonl_io.read_output(p).bad_lines == [1]


def test_compact_keeps_the_record_that_counts():
    e = "error"
    recs = [{"id": None, "line": 2, "finish_reason": e, "error": "malformed JSON"},
            {"id": "a", "line": 1, "finish_reason": "length"},
            {"id": "a", "line": 9, "finish_reason": e, "error": "duplicate id (first on line 1)"},
            {"id": "b", "line": 3, "finish_reason": e, "error": "old"},
            {"id": "b", "line": 3, "finish_reason": e, "error": "again"},
            {"id": "c", "line": 4, "finish_reason": e, "error": "still failing"},
            {"id": "d", "line": 2, "finish_reason": "stop"},        # line 2 fixed: its id-less error goes
            {"id": "b", "line": 3, "finish_reason": "stop"}]        # b now succeeds: both errors go
    assert [(r["id"], r["line"]) for r in jsonl_io.compact(recs)] == [("a", 1), ("a", 9), ("c", 4), ("d", 2),
                                                                      ("b", 3)]


def test_result_writer_truncates_a_failed_write(tmp_path, monkeypatch):
    p = tmp_path / "o.jsonl"
    w = jsonl_io.ResultWriter(p, append=False)
    w.write_batch([{"id": 1, "finish_reason": "stop"}])
    before = p.read_bytes()
    real_write = os.write

    def disk_full(fd, data):                   # writes half a line, then the disk is full
        real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(jsonl_io.OutputError, match="No space left.*--resume"):
        w.write_batch([{"id": 2, "finish_reason": "stop"}, {"id": 3, "finish_reason": "stop"}])
    monkeypatch.setattr(os, "write", real_write)
    w.close()
    assert p.read_bytes() == before            # back to the last whole line


def test_output_lock_names_the_holder(tmp_path):
    out = tmp_path / "o.jsonl"
    with jsonl_io.OutputLock(out) as held:
        assert held.path.read_text().strip() == str(os.getpid())
        with pytest.raises(jsonl_io.OutputError, match=f"in use by another ulacache run \\(pid {os.getpid()}"):
            jsonl_io.OutputLock(out).acquire()
    assert not (tmp_path / "o.jsonl.lock").exists()
    jsonl_io.OutputLock(out).acquire().release()     # free again


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    p = tmp_path / "r.json"
    p.write_text("old")

    def fail(tmp):
        pathlib.Path(tmp).write_text("half")
        raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError):
        jsonl_io.atomic_write(p, fail)
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["r.json"]


def test_apply_stop_cuts_text_before_the_stop_string():
    tok = ByteTokenizer()
    ids = list(b"Answer: 42\nQuestion: next")
    text, toks, stop = apply_stop(ids, tok, ("\nQuestion",))
    assert text == "Answer: 42" and stop == "\nQuestion" and bytes(toks) == b"Answer: 42\nQuestion"
    assert apply_stop(ids, tok, ("zzz",)) == ("Answer: 42\nQuestion: next", ids, None)


class _ChatTok(ByteTokenizer):
    def apply_chat_template(self, messages, add_generation_prompt=True):
        assert add_generation_prompt
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")


class _NoChatTok:
    vocab_size, bos_id, eos_ids = 258, 256, (257,)

    def encode(self, text, add_special_tokens=True):
        return [256, *text.encode()]


def test_parse_input_text_fields():
    lines = [json.dumps({"id": 1, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7,
                         "stop": "\n"}),
             '{"id": 2, "prompt": "a\\ud800b"}',                                     # lone surrogate
             json.dumps({"id": 3, "prompt": "ok", "stop": ["x", "yy"], "temperature": 0.5, "top_p": 0.9,
                         "top_k": 5, "seed": 11}),
             json.dumps({"id": 4, "prompt": "ok", "max_tokens": 3, "max_new_tokens": 4}),
             json.dumps({"id": 5, "messages": [{"role": "user"}]}),
             json.dumps({"id": 6, "prompt": "ok", "stop": [""]}),
             json.dumps({"id": 7, "prompt_ids": [1.5, 2]})]
    kw = dict(vocab_size=258, limit=64, defaults=SamplingParams(max_new_tokens=10))
    recs, errs, _, _ = batch_lines.parse_input(lines, tokenizer=_ChatTok(), **kw)
    msgs = {e.line: e.error for e in errs}
    assert sorted(msgs) == [2, 4, 5, 6, 7]
    assert "lone surrogate U+D800 at character 1" in msgs[2] and "disagree" in msgs[4]
    assert "role" in msgs[5] and "empty string" in msgs[6] and "list of ints" in msgs[7]
    r1, r3 = recs
    assert r1.prompt_ids == _ChatTok().encode("<user>hi<assistant>") and r1.sampling.max_new_tokens == 7
    assert r1.sampling.stop == ("\n",) and r3.sampling.stop == ("x", "yy")
    assert (r3.sampling.temperature, r3.sampling.top_p, r3.sampling.top_k, r3.sampling.seed) == (0.5, 0.9, 5, 11)
    _, errs, _, _ = batch_lines.parse_input(lines[:1], tokenizer=_NoChatTok(), **kw)
    assert "has no chat template" in errs[0].error


# ---- the real command -----------------------------------------------------------------------------------------
def test_paths_checked_before_the_model_loads(tmp_path):
    """Each refusal is exit 2 with one clear line, before the model loads (no 'RANDOM weights' note yet)."""
    d = tmp_path
    (d / "sub").mkdir()
    inp = d / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "hello"}\n')
    (d / "link.jsonl").symlink_to(inp)
    ro = d / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    ro_dir = ro if os.geteuid() != 0 else pathlib.Path("/proc/self")   # root ignores permission bits
    held = jsonl_io.OutputLock(d / "held.jsonl").acquire()
    held_ck = jsonl_io.OutputLock(d / "ck", "--checkpoint-dir").acquire()   # another run's checkpoint folder
    cases = {
        "same": (["--output", str(inp)], "is the input file"),
        "symlink": (["--output", str(d / "link.jsonl")], "resolve to"),
        "relative": (["--output", str(d / "sub" / ".." / "in.jsonl")], "is the input file"),
        "out_ro": (["--output", str(ro_dir / "o.jsonl")], "not writable"),
        "out_missing": (["--output", str(d / "nope" / "o.jsonl")], "does not exist"),
        "report_missing": (["--output", str(d / "o1.jsonl"), "--report", str(d / "nope" / "r.json")],
                           "--report"),
        "plot_ro": (["--output", str(d / "o2.jsonl"), "--plot", str(ro_dir / "p.png")], "--plot"),
        "locked": (["--output", str(d / "held.jsonl")], f"pid {os.getpid()}"),
        "ck_locked": (["--output", str(d / "o4.jsonl"), "--checkpoint-dir", str(d / "ck")],
                      f"--checkpoint-dir {d / 'ck'} is in use by another ulacache run (pid {os.getpid()}"),
        "force_alone": (["--output", str(d / "o3.jsonl"), "--force"], "--force only applies"),
    }
    try:
        got = _run_all([_cmd("--input", str(inp), *argv, *ARGS) for argv, _ in cases.values()])
    finally:
        held.release()
        held_ck.release()
        ro.chmod(0o755)
    for (name, (_, msg)), (rc, out, err) in zip(cases.items(), got):
        assert rc == 2, (name, err)
        assert msg in err and "Traceback" not in err and "RANDOM" not in err, (name, err)
        assert len(err.strip().splitlines()) == 1, (name, err)
    assert inp.read_text() == '{"id": 1, "prompt": "hello"}\n'
    assert not (d / "o1.jsonl").exists() and not (d / "o2.jsonl").exists()


def _model_folders(d):
    no_heads = d / "no_heads"
    shutil.copytree(FIXTURES / "tiny_llama", no_heads)
    cfg = json.loads((no_heads / "config.json").read_text())
    del cfg["num_attention_heads"]
    (no_heads / "config.json").write_text(json.dumps(cfg))
    bad_tok = d / "bad_tok"
    shutil.copytree(FIXTURES / "tiny_llama", bad_tok)
    (bad_tok / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": [')
    no_config = d / "no_config"
    no_config.mkdir()
    (no_config / "model.json").write_text(json.dumps({"format": 1, "dtype": "float32"}))
    return {"no_heads": (no_heads, "'num_attention_heads'"), "bad_tok": (bad_tok, "tokenizer"),
            "no_config": (no_config, "'config'")}


def test_broken_model_folders_and_oversized_hbm_pool(tmp_path):
    d = tmp_path
    inp = d / "in.jsonl"
    inp.write_text('{"id": 1, "prompt_ids": [1, 2, 3]}\n')
    cases = {name: (["--model", str(path)], msg) for name, (path, msg) in _model_folders(d).items()}
    # a tier size with dense attention would be ignored: refused (with auto it selects the sparse cache)
    cases["dense_tiers"] = (["--attention", "dense", "--host-gb", "1"], "--attention dense keeps every K/V in HBM")
    cases["hbm"] = (["--hbm-pages", "1000000000"], "--hbm-pages 1000000000")
    got = _run_all([_cmd("--input", str(inp), "--output", str(d / f"{n}.jsonl"), *argv, *ARGS)
                    for n, (argv, _) in cases.items()])
    for (name, (argv, msg)), (rc, out, err) in zip(cases.items(), got):
        assert rc == 2, (name, err[-2000:])
        assert msg in err and "Traceback" not in err, (name, err[-2000:])
        assert not (d / f"{name}.jsonl").exists() or not (d / f"{name}.jsonl").read_text()
    hbm_err = got[-1][2]
    assert "GiB" in hbm_err and "at most about" in hbm_err and "pages fit" in hbm_err


def test_text_lines_resume_by_settings_and_replaced_errors(tmp_path):
    """One file with a BOM, a lone surrogate, an invalid UTF-8 byte, chat messages, a stop string and OpenAI names;
    then --resume: other settings refused (--force accepts), the fixed lines replace their error records."""
    d = tmp_path
    inp, out, rep = d / "in.jsonl", d / "out.jsonl", d / "rep" / "report.json"
    rep.parent.mkdir()
    chat = hasattr(ByteTokenizer, "apply_chat_template")
    lines = [json.dumps({"id": "first", "prompt": "The first line follows a BOM."}).encode(),
             b'{"id": "sur", "prompt": "bad \\ud800 text"}',
             b'{"id": "byte", "prompt": "bad \xff byte"}',
             json.dumps({"id": "chat", "messages": [{"role": "user", "content": "Say hi."}]}).encode(),
             json.dumps({"id": "oai", "prompt_ids": list(range(40, 90)), "max_tokens": 5, "temperature": 0.7,
                         "top_p": 0.9, "top_k": 10, "seed": 3}).encode(),
             json.dumps({"id": "stop", "prompt": "Stop strings cut the text.", "stop": ["e", "a", "i", "o"],
                         "max_tokens": 16}).encode()]
    inp.write_bytes(jsonl_io.BOM + b"\n".join(lines) + b"\n")
    r = subprocess.run(_cmd("--input", str(inp), "--output", str(out), "--report", str(rep), *ARGS),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert f"{inp}:2: id \"sur\": 'prompt' holds a lone surrogate U+D800" in r.stderr
    assert f"{inp}:3: id null: invalid UTF-8: byte 0xff" in r.stderr
    assert "Traceback" not in r.stderr
    recs = {x["id"] if x["id"] is not None else x["line"]: x for x in _records(out)}
    assert recs["first"]["finish_reason"] in ("stop", "length") and recs["first"]["line"] == 1
    assert recs["sur"]["finish_reason"] == "error" and recs[3]["finish_reason"] == "error"
    assert recs["oai"]["completion_tokens"] == 5 == len(recs["oai"]["token_ids"])
    if chat:
        assert recs["chat"]["finish_reason"] != "error"
    else:
        assert "chat template" in recs["chat"]["error"]
    s = recs["stop"]
    tok = ByteTokenizer()
    if s["finish_reason"] == "stop":          # random weights: a vowel may never come
        assert s["stop_reason"] in "eaio" and not any(v in s["text"] for v in "eaio")
        assert tok.decode(s["token_ids"]).endswith(s["stop_reason"])
    else:
        assert s["text"] == tok.decode(s["token_ids"])
    assert len({x["settings"] for x in recs.values()}) == 1
    assert json.loads(rep.read_text())["settings_fingerprint"] == recs["first"]["settings"]
    assert rep.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(os.listdir(rep.parent)) == ["report.json", "report.png"]       # no temp files left
    assert not (d / "out.jsonl.lock").exists()

    # --resume with another --max-new-tokens: refused before the model loads; --force mixes them
    other = [a if a != "8" else "9" for a in ARGS]
    before = out.read_bytes()
    r = subprocess.run(_cmd("--input", str(inp), "--output", str(out), "--resume", *other),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "other settings" in r.stderr and "--force" in r.stderr, r.stderr[-2000:]
    assert out.read_bytes() == before
    # fix the two bad lines, tear the last record, resume with --force and the other settings
    lines[1] = json.dumps({"id": "sur", "prompt": "good text now"}).encode()
    lines[2] = json.dumps({"id": "byte", "prompt": "good byte now"}).encode()
    inp.write_bytes(jsonl_io.BOM + b"\n".join(lines) + b"\n")
    out.write_bytes(before + b'{"id": "torn", "li')
    r = subprocess.run(_cmd("--input", str(inp), "--output", str(out), "--resume", "--force", *other),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == (0 if chat else 1), r.stderr[-3000:]
    assert "torn last line" in r.stderr
    after = _records(out)                          # parses: the torn line is gone
    ids = [x["id"] for x in after]
    assert len(ids) == len(set(ids)) and None not in ids                      # one record per request
    by_id = {x["id"]: x for x in after}
    assert by_id["sur"]["finish_reason"] != "error" and by_id["byte"]["finish_reason"] != "error"
    assert by_id["byte"]["line"] == 3
    assert by_id["first"] == recs["first"]                                    # done records kept as they were


def _wait_for(pred, proc, timeout=240):
    t0 = time.monotonic()
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} early: {proc.stderr.read()[-3000:]}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(0.05)


def test_sigterm_mid_run_and_ctrl_c_at_start_up(tmp_path):
    d = tmp_path
    inp = d / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt_ids": list(range(10, 40 + i % 7))}) + "\n"
                           for i in range(400)))
    term_out, int_out = d / "term.jsonl", d / "int.jsonl"
    term = _start(_cmd("--input", str(inp), "--output", str(term_out), *ARGS))
    intr = _start(_cmd("--input", str(inp), "--output", str(int_out), *ARGS))
    # Ctrl-C once the run holds its lock (start-up: the model loads and compiles next)
    _wait_for(lambda: (d / "int.jsonl.lock").exists(), intr)
    intr.send_signal(signal.SIGINT)
    # SIGTERM once results are coming out
    _wait_for(lambda: term_out.exists() and term_out.stat().st_size > 0, term)
    term.send_signal(signal.SIGTERM)
    _, err = term.communicate(timeout=120)
    assert term.returncode == 143, err[-3000:]
    assert "interrupted by SIGTERM" in err and "--resume" in err and "Traceback" not in err
    got = _records(term_out)                      # whole lines only
    assert 0 < len(got) < 400 and all(x["finish_reason"] == "length" for x in got)
    _, err = intr.communicate(timeout=120)
    assert intr.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "interrupted by SIGINT" in err
    assert len(err.strip().splitlines()) <= 2     # the RANDOM-weights note may come first
    assert not int_out.exists() or int_out.read_text() == ""
    assert not (d / "int.jsonl.lock").exists() and not (d / "term.jsonl.lock").exists()


def test_compile_cache_default_dir_is_reused_across_restarts(tmp_path):
    """On by default in $XDG_CACHE_HOME/ulacache_jax/jax_cache: the first run fills it, a restart compiles no
    prefill or decode program again (no new entries for them; small eager ops that happened to take over 0.1 s on
    a busy machine may add entries); `--compile-cache off` leaves it alone."""
    d = tmp_path
    inp = d / "in.jsonl"
    inp.write_text('{"id": 1, "prompt_ids": [1, 2, 3, 4, 5]}\n')
    env = {k: v for k, v in os.environ.items() if k != cli.COMPILE_CACHE_ENV}
    env["XDG_CACHE_HOME"] = str(d / "xdg")
    args = [a for a in ARGS if a not in ("--compile-cache", "off")]
    cache = d / "xdg" / "ulacache_jax" / "jax_cache"
    entries = []
    for n in range(2):
        r = subprocess.run(_cmd("--input", str(inp), "--output", str(d / f"o{n}.jsonl"), *args),
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        entries.append({f for f in os.listdir(cache) if "prefill" in f or "decode" in f})
    assert entries[0] and entries[1] == entries[0], entries
    assert _records(d / "o0.jsonl")[0]["token_ids"] == _records(d / "o1.jsonl")[0]["token_ids"]
    assert cli.setup_compile_cache("off") is None
    assert cli.default_compile_cache_dir() == pathlib.Path(os.environ.get("XDG_CACHE_HOME") or
                                                           pathlib.Path.home() / ".cache") / "ulacache_jax/jax_cache"


def test_a_stop_signal_dropped_by_a_gc_callback_is_raised_at_the_next_check(capsys):
    """An exception raised while Python runs a gc callback is dropped ("Exception ignored", as the CI dry run saw
    with jax's _xla_gc_callback): StopSignals latches the signal, hides that traceback, and check() raises it."""
    import gc
    stop = cli.StopSignals().install()
    raised_at_once = False
    try:
        def callback(phase, info):
            if phase == "start":
                gc.callbacks.remove(callback)
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):      # the handler runs here, inside the callback
                    pass
        gc.callbacks.append(callback)
        try:
            gc.collect()
        except cli.Terminated:
            raised_at_once = True
        assert stop.received == signal.SIGTERM
        if not raised_at_once:
            with pytest.raises(cli.Terminated):
                stop.check()
    finally:
        stop.restore()
    assert "Exception ignored" not in capsys.readouterr().err
    assert not raised_at_once      # it did land inside the callback, where Python drops it
