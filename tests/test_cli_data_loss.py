"""Nothing already in a folder the user points at is lost or replaced (issue 51's four data-loss cases): a
--checkpoint-dir we did not create is refused unless empty (orbax would prune its integer-named entries as steps);
outputs, locks and checkpoint folders are keyed by the real file, so a symlink to a running output is refused and a
--resume repair writes through the link; non-regular targets (devices, FIFOs, folders) are refused for --output,
--report and --plot; the settings fingerprint names the model that is loaded and covers every option that changes
tokens (the list is derived from the parser).

The CLI cases run the real `ulacache` command in a subprocess (helpers of tests/test_cli_safety.py)."""
import json
import os
import pathlib
import stat

import pytest

from ulacache_jax.app import cli, resume
from ulacache_jax.app import jsonl_io
from ulacache_jax.runtime import checkpoint

from test_cli_safety import ARGS, ULACACHE, _cmd, _records, _run_all

PROMPTS = '{"id": 1, "prompt": "hello"}\n{"id": 2, "prompt": "world"}\n'


def _one_line_error(rc, out, err, msg):
    assert rc == 2, err
    assert msg in err and "Traceback" not in err and "RANDOM" not in err, err
    assert len(err.strip().splitlines()) == 1, err


# ---- 1. a checkpoint folder of other things -----------------------------------------------------------------------
def test_checkpoint_dir_we_did_not_create_is_refused_unless_empty(tmp_path):
    d = tmp_path
    inp = d / "p.jsonl"
    inp.write_text(PROMPTS)
    runs = d / "runs"                                   # the repro: years, one with notes
    (runs / "2023").mkdir(parents=True)
    (runs / "2024").mkdir()
    (runs / "2023" / "notes.txt").write_text("notes\n")
    other = d / "other"                                 # no integer names, but not ours either
    other.mkdir()
    (other / "notes.txt").write_text("keep\n")
    empty = d / "empty"
    empty.mkdir()
    got = _run_all([
        _cmd("--input", str(inp), "--output", str(d / "o1.jsonl"), "--checkpoint-dir", str(runs), *ARGS),
        _cmd("--input", str(inp), "--output", str(d / "o2.jsonl"), "--checkpoint-dir", str(other), *ARGS),
        _cmd("--input", str(inp), "--output", str(d / "o3.jsonl"), "--checkpoint-dir", str(empty),
             "--checkpoint-every", "1", *ARGS),
    ])
    _one_line_error(*got[0], f"--checkpoint-dir {runs} is not a checkpoint folder written by ulacache")
    assert "it holds 2023, 2024" in got[0][2]
    _one_line_error(*got[1], "it holds notes.txt")
    assert sorted(os.listdir(runs)) == ["2023", "2024"] and (runs / "2023" / "notes.txt").read_text() == "notes\n"
    assert os.listdir(other) == ["notes.txt"]
    assert not (d / "o1.jsonl").exists() and not (d / "o2.jsonl").exists()
    rc, _, err = got[2]
    assert rc == 0, err                                 # an empty folder is ours from the first save on
    assert (empty / checkpoint.MARKER).is_file() and any(p.name.isdigit() for p in empty.iterdir())
    assert {r["id"] for r in _records(d / "o3.jsonl")} == {1, 2}
    # a folder of ours stays usable; an integer-named folder someone put into it is refused, not pruned
    checkpoint.check_directory(empty)
    (empty / "77").mkdir()                              # empty: a prune cut short, nothing to lose
    checkpoint.check_directory(empty)
    (empty / "77" / "notes.txt").write_text("notes\n")
    with pytest.raises(checkpoint.CheckpointError, match="it holds 77"):
        checkpoint.check_directory(empty)


# ---- 2. symlinks: one lock per real file; a repair writes through the link ---------------------------------------
def test_output_and_checkpoint_locks_are_keyed_by_the_real_file(tmp_path):
    d = tmp_path
    inp = d / "p.jsonl"
    inp.write_text(PROMPTS)
    out = d / "out.jsonl"
    (d / "link.jsonl").symlink_to(out)
    (d / "sub").mkdir()
    (d / "ck").mkdir()
    (d / "ck_link").symlink_to(d / "ck")
    held = jsonl_io.OutputLock(out).acquire()           # a run on out.jsonl
    held_ck = jsonl_io.OutputLock(d / "ck", "--checkpoint-dir").acquire()
    try:
        got = _run_all([
            _cmd("--input", str(inp), "--output", str(d / "link.jsonl"), *ARGS),
            _cmd("--input", str(inp), "--output", str(d / "sub" / ".." / "out.jsonl"), *ARGS),
            _cmd("--input", str(inp), "--output", str(d / "o2.jsonl"), "--checkpoint-dir", str(d / "ck_link"), *ARGS),
        ])
    finally:
        held.release()
        held_ck.release()
    _one_line_error(*got[0], f"--output {d / 'link.jsonl'} is in use by another ulacache run (pid {os.getpid()}")
    _one_line_error(*got[1], f"is in use by another ulacache run (pid {os.getpid()}")
    _one_line_error(*got[2], f"--checkpoint-dir {d / 'ck_link'} is in use by another ulacache run (pid {os.getpid()}")
    assert not out.exists() and not (d / "o2.jsonl").exists()


def test_resume_repair_writes_through_a_symlinked_output(tmp_path):
    d = tmp_path
    inp = d / "p.jsonl"
    inp.write_text('{"id": 1, "prompt": "hello"}\n')
    real = d / "real.jsonl"
    link = d / "link.jsonl"
    link.symlink_to(real)                               # dangling: the run creates the target
    (rc, _, err), = _run_all([_cmd("--input", str(inp), "--output", str(link), *ARGS)])
    assert rc == 0, err
    assert link.is_symlink() and real.is_file() and [r["id"] for r in _records(real)] == [1]
    with open(real, "ab") as f:
        f.write(b'{"id": 2, "fin')                      # a torn last line: --resume repairs the file
    inp.write_text(PROMPTS)
    (rc, _, err), = _run_all([_cmd("--input", str(inp), "--output", str(link), "--resume", *ARGS)])
    assert rc == 0, err
    assert "repaired" in err
    assert link.is_symlink() and os.readlink(link) == str(real), "the repair replaced the link by a file"
    assert sorted(r["id"] for r in _records(real)) == [1, 2]


# ---- 4. non-regular targets --------------------------------------------------------------------------------------
def test_devices_fifos_and_folders_are_refused_and_symlinks_written_through(tmp_path):
    d = tmp_path
    inp = d / "p.jsonl"
    inp.write_text(PROMPTS)
    fifo = d / "fifo"
    os.mkfifo(fifo)
    (d / "fifo_link").symlink_to(fifo)
    report = d / "report.json"
    report.write_text("old\n")
    (d / "report_link.json").symlink_to(report)
    cases = [
        (["--output", str(d / "o1.jsonl"), "--report", str(fifo)], f"--report {fifo} is a FIFO (named pipe)"),
        (["--output", str(d / "o2.jsonl"), "--plot", "/dev/null"], "--plot /dev/null is a character device"),
        (["--output", str(d / "o3.jsonl"), "--report", str(d / "fifo_link")],
         f"--report {d / 'fifo_link'} is a FIFO (named pipe) (through the symlink, {fifo})"),
        (["--output", "/dev/null"], "--output /dev/null is a character device"),
        (["--output", str(fifo)], f"--output {fifo} is a FIFO"),
        (["--output", str(d)], f"--output {d} is a folder"),
        (["--output", str(d / "o4.jsonl"), "--report", str(d / "report_link.json"),
          "--plot", str(d / "plot.png")], None),
    ]
    got = _run_all([_cmd("--input", str(inp), *argv, *ARGS) for argv, _ in cases])
    for (argv, msg), res in zip(cases[:-1], got[:-1]):
        _one_line_error(*res, msg)
    rc, _, err = got[-1]
    assert rc == 0, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and (d / "fifo_link").is_symlink()
    assert (d / "report_link.json").is_symlink()         # written through: the link kept, its target replaced
    assert json.loads(report.read_text())["settings_fingerprint"]
    for n in (1, 2, 3):
        assert not (d / f"o{n}.jsonl").exists()


def test_atomic_write_refuses_non_regular_targets_and_keeps_links(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(jsonl_io.OutputError, match="FIFO"):
        jsonl_io.atomic_write_bytes(fifo, b"x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    target = tmp_path / "t.txt"
    target.write_text("old")
    (tmp_path / "l.txt").symlink_to(target)
    jsonl_io.atomic_write_bytes(tmp_path / "l.txt", b"new")
    assert (tmp_path / "l.txt").is_symlink() and target.read_text() == "new"


# ---- 3. the settings fingerprint ---------------------------------------------------------------------------------
def _generate_actions():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    return [a for a in sub.choices["generate"]._actions if a.dest != "help"]


def _other_values(a):
    """Values other than the option's default, for each kind of option the parser has."""
    if a.choices:
        return [c for c in a.choices if c != a.default]
    if a.nargs == 0:                                    # store_true
        return [not a.default]
    if isinstance(a.default, list):                     # append
        return [["x"]]
    if a.type in (int, cli.positive_int):
        return [(a.default or 0) + 3, (a.default or 0) + 8]
    if a.type in (float, cli._positive_float):
        return [(a.default or 0.0) + 0.25]
    return ["x", "some/other-value"]


def test_every_option_that_can_change_tokens_is_in_the_fingerprint():
    """Derived from the parser: each option of `generate` changes the fingerprint when set to another value, or is
    in resume.NOT_IN_FINGERPRINT (with why); so a new option cannot be forgotten."""
    base_argv = ["generate", "--input", "p.jsonl", "--output", "o.jsonl"]
    base = resume.run_settings(cli.build_parser().parse_args(base_argv))
    actions = _generate_actions()
    dests = {a.dest for a in actions}
    assert set(resume.NOT_IN_FINGERPRINT) <= dests, set(resume.NOT_IN_FINGERPRINT) - dests   # no stale names
    missing = []
    for a in actions:
        if a.dest in resume.NOT_IN_FINGERPRINT:
            continue
        changed = False
        for v in _other_values(a):
            args = cli.build_parser().parse_args(base_argv)
            setattr(args, a.dest, v)
            if jsonl_io.settings_fingerprint(resume.run_settings(args)) != jsonl_io.settings_fingerprint(base):
                changed = True
                break
        if not changed:
            missing.append(a.option_strings[0])
    assert not missing, f"options that change tokens but not the fingerprint: {missing}"
    # the default model is fingerprinted as the one loaded, not as the tiny preset
    assert base["model"] == cli.DEFAULT_MODEL
    tiny = resume.run_settings(cli.build_parser().parse_args(base_argv + ["--model", "tiny"]))
    assert jsonl_io.settings_fingerprint(tiny) != jsonl_io.settings_fingerprint(base)


def test_resume_refuses_a_file_made_with_another_model_or_key_channels(tmp_path):
    d = tmp_path
    inp = d / "p.jsonl"
    inp.write_text(PROMPTS)
    out = d / "o.jsonl"
    (rc, _, err), = _run_all([_cmd("--input", str(inp), "--output", str(out), "--max-new-tokens", "2", *ARGS)])
    assert rc == 0, err
    inp.write_text(PROMPTS + '{"id": 3, "prompt": "again"}\n')
    before = out.read_bytes()
    default_model = [*ULACACHE, "generate", "--input", str(inp), "--output", str(out), "--resume", *ARGS]
    key_copy = _cmd("--input", str(inp), "--output", str(out), "--resume", "--key-channels", "8", *ARGS)
    # one at a time: both would take the output's lock
    got = [_run_all([c])[0] for c in (default_model, key_copy)]
    for res in got:
        _one_line_error(*res, "were made with other settings")
    assert out.read_bytes() == before
