"""Issue 51's newcomer cases at the Python API and the CLI: each a clear error naming the value (not an
AttributeError, ZeroDivisionError, a traceback or a silent reinterpretation), leaving nothing behind."""
import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from ulacache_jax import generate
from ulacache_jax.runtime.engine import Engine
from ulacache_jax.runtime.requests import SamplingParams
from cache_steps import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("bad, message", [
    (None, r"model = None must be a loaded model"),
    ("smollm2-135m", r"model = 'smollm2-135m' must be a loaded model .*from_pretrained\('smollm2-135m'\)"),
    ("/tmp", r"model = '/tmp' must be a loaded model"),
])
def test_generate_and_engine_refuse_a_model_name(bad, message):
    with pytest.raises(TypeError, match=message):
        generate(bad, [[1, 2, 3]], max_new_tokens=2)
    if bad is None:      # Engine(None): neither a model nor a generator
        with pytest.raises(ValueError, match="give exactly one of model or generator"):
            Engine(bad)
    else:
        with pytest.raises(TypeError, match=message.replace("model =", "Engine: model =")):
            Engine(bad)


def test_tp_and_speculative_types(model):
    for tp in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match=r"tp = .* must be an int >= 1"):
            generate(model, [[1, 2, 3]], max_new_tokens=2, tp=tp)
    with pytest.raises(TypeError, match=r"speculative = 'ngram' must be None or a SpecConfig"):
        generate(model, [[1, 2, 3]], max_new_tokens=2, speculative="ngram")
    with pytest.raises(TypeError, match=r"speculative = 'ngram' must be None or a SpecConfig"):
        Engine(model, speculative="ngram")


@pytest.mark.parametrize("kw, message", [
    (dict(seed=4294967301), r"seed = 4294967301 must be None or an int in \[0, 2\*\*32\)"),
    (dict(seed=-1), r"seed = -1 must be None or an int in \[0, 2\*\*32\)"),
    (dict(temperature=float("inf")), r"temperature = inf must be a finite number >= 0"),
])
def test_sampling_params_refuse_what_would_be_reinterpreted(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw).check(256)


def test_stop_strings_without_a_tokenizer_fail_the_request(model):
    """An Engine without a tokenizer cannot match stop strings: the request fails with a message, the others run."""
    eng = Engine(model, max_seqs=2, max_context=64)
    bad = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=2, stop=("a",)))
    good = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    while eng.has_unfinished():
        eng.step()
    assert eng.get(bad).finish_reason == "error" and "need the engine's tokenizer" in eng.get(bad).error
    assert eng.get(good).finish_reason == "length" and len(eng.get(good).tokens) == 2
    assert eng.occupancy()["slots_used"] == 0


def test_cli_cases_are_one_line_errors_before_loading(tmp_path):
    """The real command, in subprocesses: --tp beyond the devices, a --draft-model that does not exist,
    --num-speculative-tokens without --speculative: exit 2, one line naming the option, no output file; and a
    preset as the draft model (as --help says) runs."""
    from test_cli_safety import ARGS, _cmd, _run_all
    inp = tmp_path / "p.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt_ids": [1, 2, 3]}) + "\n")
    cases = [(["--tp", "2"], "--tp 2: tp = 2 needs 2 devices but only 1"),
             (["--speculative", "draft", "--draft-model", "nosuch"], "--draft-model 'nosuch': no such file"),
             (["--num-speculative-tokens", "3"], "--num-speculative-tokens 3 needs --speculative")]
    cmds = [_cmd("--input", str(inp), "--output", str(tmp_path / f"o{i}.jsonl"), *extra, *ARGS)
            for i, (extra, _) in enumerate(cases)]
    cmds.append(_cmd("--input", str(inp), "--output", str(tmp_path / "draft.jsonl"), "--speculative", "draft",
                     "--draft-model", "tiny", *ARGS))
    got = _run_all(cmds)
    for i, ((rc, _, err), (_, msg)) in enumerate(zip(got, cases)):
        assert rc == 2 and msg in err and "Traceback" not in err, err
        assert len([x for x in err.splitlines() if "error" in x]) == 1, err
        assert not (tmp_path / f"o{i}.jsonl").exists()
    rc, _, err = got[-1]
    assert rc == 0, err
    (row,) = [json.loads(x) for x in (tmp_path / "draft.jsonl").read_text().splitlines()]
    assert row["finish_reason"] == "length" and len(row["token_ids"]) == 8


def test_a_dense_cache_too_large_for_memory_is_refused_before_allocating(model):
    """A dense max_context of 10**9 asks for ~2 TB: refused at once (not XLA's RESOURCE_EXHAUSTED or a hang in its
    allocator), naming max_context, max_seqs, the bytes needed and available, and what to lower."""
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    cfg = default_cache_config(model.config, num_seqs=4, max_tokens=10**9)
    for make in (lambda: Engine(model, attention="dense", max_context=10**9),
                 lambda: Generator(model, cfg, attention="dense")):
        t0 = time.perf_counter()
        with pytest.raises(ValueError) as info:
            make()
        assert time.perf_counter() - t0 < 5
        msg = str(info.value)
        assert "attention 'dense' with max_context = " in msg and "max_seqs = " in msg, msg
        assert "bytes) of device memory, but the available host memory" in msg, msg
        assert "lower max_context or max_seqs" in msg, msg


def _generate_argv(tmp_path, *extra, off=True):
    """`ulacache generate` on the tiny preset, one prompt, the shared small shapes (test_cli_safety.ARGS)."""
    from test_cli_safety import ARGS
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt_ids": [1, 2, 3]}) + "\n")
    args = ARGS if off else [a for a in ARGS if a not in ("--compile-cache", "off")]
    return ["generate", "--model", "tiny", "--input", str(inp), "--output", str(tmp_path / "o.jsonl"), *args, *extra]


def _no_model(*a, **k):
    raise AssertionError("the model was loaded: the error should come first")


@pytest.mark.parametrize("failing", ["write", "replace"])
def test_resume_repair_on_a_full_disk_is_one_line_and_keeps_the_file(tmp_path, monkeypatch, capsys, failing):
    """--resume rewrites an output with a torn last line; on a full disk (the temp file's write, or the rename) the
    command ends with one line naming the file and the errno's message, and the file keeps its bytes."""
    from ulacache_jax.app import cli, jsonl_io
    argv = _generate_argv(tmp_path, "--resume")
    out = tmp_path / "o.jsonl"
    out.write_bytes(b'{"id": 7, "token_ids": [1, 2]')          # torn: the repair must rewrite the file
    before = out.read_bytes()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if failing == "write":
        monkeypatch.setattr(pathlib.Path, "write_bytes", full)
    else:
        monkeypatch.setattr(jsonl_io.os, "replace", full)
    monkeypatch.setattr(cli, "load_engine_model", _no_model)
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == cli.EXIT_USAGE and len(err.strip().splitlines()) == 1, err
    assert f"--output {out}: --resume cannot rewrite it (No space left on device)" in err and "unchanged" in err
    assert out.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "o.jsonl"]   # no temp file left, the lock released


def _unwritable(monkeypatch, folder: pathlib.Path) -> None:
    """Make `folder` (and what is under it) unwritable: chmod 0o500; as root, which writes through permission bits,
    the write probe (a temp file) fails there as a read-only mount would make it."""
    folder.chmod(0o500)
    if os.geteuid() == 0:
        real = tempfile.mkstemp

        def probe(*a, dir=None, **k):
            if dir is not None and pathlib.Path(dir).resolve().is_relative_to(folder.resolve()):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
            return real(*a, dir=dir, **k)
        monkeypatch.setattr(tempfile, "mkstemp", probe)


def test_an_unwritable_compile_cache_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """--compile-cache DIR that cannot be written: exit 2, one line naming the folder and why, the model not
    loaded. A symlink to a writable folder is used as the folder. The default folder (not asked for) that cannot
    be written is a warning, and the run goes on without the cache."""
    from ulacache_jax.app import cli
    ro = tmp_path / "ro"
    ro.mkdir()
    _unwritable(monkeypatch, ro)
    monkeypatch.setattr(cli, "load_engine_model", _no_model)
    try:
        rc = cli.main(_generate_argv(tmp_path, "--compile-cache", str(ro), off=False))
        err = capsys.readouterr().err
        assert rc == cli.EXIT_USAGE and len(err.strip().splitlines()) == 1, err
        assert f"--compile-cache {ro} is not writable (Permission denied)" in err, err
        assert not (tmp_path / "o.jsonl").exists()
        # the default folder under an unwritable $XDG_CACHE_HOME: no refusal, no cache
        monkeypatch.delenv(cli.COMPILE_CACHE_ENV, raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(ro))
        assert cli.setup_compile_cache(None) is None
        err = capsys.readouterr().err
        assert "warning: the default compile cache" in err and "running without the compile cache" in err, err
    finally:
        ro.chmod(0o700)
    import jax
    updates = []
    monkeypatch.setattr(jax.config, "update", lambda k, v: updates.append((k, v)))   # this process's JAX untouched
    (tmp_path / "rw").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "rw")
    assert cli.setup_compile_cache(str(tmp_path / "link")) == str(tmp_path / "link")
    assert ("jax_compilation_cache_dir", str(tmp_path / "link")) in updates
    assert os.listdir(tmp_path / "rw") == []                  # the probe cleaned up after itself


def _extension_init(signum=None):
    """What an extension module's import does when a signal lands in its init: ImportError, the interrupt its cause."""
    from ulacache_jax.app import cli
    try:
        raise KeyboardInterrupt if signum is None else cli.Terminated(signum)
    except KeyboardInterrupt as e:
        raise ImportError("Encountered an error while initializing the extension.") from e


@pytest.mark.parametrize("raised, code, name", [
    (KeyboardInterrupt, 130, "SIGINT (Ctrl-C)"),
    (lambda: _extension_init(), 130, "SIGINT (Ctrl-C)"),
    (lambda: _extension_init(signal.SIGTERM), 143, "SIGTERM"),
])
def test_an_interrupt_during_start_up_is_one_line(tmp_path, monkeypatch, capsys, raised, code, name):
    """Ctrl-C (or SIGTERM) while the model loads, raised as itself or wrapped in an ImportError by an extension's
    init: exit 130 (143), one line, no traceback, no output written."""
    from ulacache_jax.app import cli

    def loader(*a, **k):
        if raised is KeyboardInterrupt:
            raise KeyboardInterrupt
        raised()
    monkeypatch.setattr(cli, "load_engine_model", loader)
    rc = cli.main(_generate_argv(tmp_path))
    err = capsys.readouterr().err
    assert rc == code and "Traceback" not in err, err
    assert err.strip().splitlines() == [f"ulacache generate: interrupted by {name} during start-up; no results were "
                                        "written"], err
    assert not (tmp_path / "o.jsonl").exists() or (tmp_path / "o.jsonl").read_text() == ""
    # the traceback an extension's init prints (sys.excepthook, from C) of our own stop is dropped too
    stop = cli.StopSignals().install()
    try:
        stop.received = signal.SIGINT
        sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
    finally:
        stop.restore()
    assert capsys.readouterr().err == ""


def test_a_signal_inside_the_jax_import_is_one_line(tmp_path):
    """The real command, a signal sent while jaxlib's extension initialises (its first import of numpy): it used to
    come back as a traceback printed from C and a 44-line ImportError, exit 1; now it waits for the import and
    stops the run: 130 (SIGINT) / 143 (SIGTERM), one line."""
    from test_cli_safety import ARGS
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt_ids": [1, 2, 3]}) + "\n")
    code = """
import os, signal, sys
class Kick:   # the signal, sent from inside jaxlib._jax's init (numpy is first imported there)
    def find_spec(self, name, path=None, target=None):
        if name == "numpy.lib":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), int(sys.argv[1]))
        return None
sys.meta_path.insert(0, Kick())
from ulacache_jax.app import cli
assert "numpy" not in sys.modules and "jax" not in sys.modules
sys.exit(cli.main(sys.argv[2:]))
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = {sig: subprocess.Popen([sys.executable, "-c", code, str(int(sig)), "generate", "--model", "tiny",
                                    "--input", str(inp), "--output", str(tmp_path / f"o{int(sig)}.jsonl"), *ARGS],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                   cwd=pathlib.Path(__file__).resolve().parents[1])
             for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig, p in procs.items():
        _, err = p.communicate(timeout=120)
        name = "SIGINT (Ctrl-C)" if sig == signal.SIGINT else "SIGTERM"
        assert p.returncode == 128 + sig and "Traceback" not in err, (p.returncode, err[-3000:])
        assert err.strip().splitlines() == [f"ulacache generate: interrupted by {name} during start-up; no results "
                                            "were written"], err
