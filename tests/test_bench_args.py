"""The benchmark scripts' one command line (scripts/bench_meta.add_common_args) and their row-by-row JSON.

The scripts are found by walking scripts/, so a new script cannot skip the shared `--out` / `--commit`: it either
has a `build_parser()` built on the helper or is named in NOT_RESULT_SCRIPTS with the reason it writes no results.
"""
import argparse
import importlib
import json
import os
import pathlib

import pytest

from scripts import bench_meta

ROOT = pathlib.Path(__file__).resolve().parent.parent

# modules under scripts/ that are not result-writing scripts (or cannot use the helper), and why
NOT_RESULT_SCRIPTS = {
    "scripts.bench_meta": "the harness itself",
    "scripts.haystacks": "a library (haystack texts)",
    "scripts.ruler_tasks": "a library (RULER-style tasks)",
    "scripts.scoring": "a library (the teacher-forced scorer)",
    "scripts.gguf_parts": "splits / joins a model file; writes no results",
    "scripts.probes.dense_walk_tuning": "prints a launch table of the dense fp8 page walk; writes no results",
    "scripts.pick_launch": "prints bench_decode options read from select.json",
    "scripts.batch_infer": "the `ulacache generate` command under another name",
    "scripts.probes.sampling_cost": "prints a decode step's time per sampling option; writes no results",
    "scripts.probes.label_ncu": "launches a label kernel for ncu to read; writes no results",
    "scripts.probes.verify_split": "prints a table of exact mode's verification variants; writes no results",
    "scripts.studies.selection_ceiling": "bench_quality with a study's hook: the arguments after -- are bench_quality's",
    # runs as a file with an OLDER tree on PYTHONPATH (regression_profile.sh): it may import only what both trees
    # share, so not this tree's bench_meta helper; its --out are the trace / diff JSON files it writes whole
    "scripts.probes.regression_diff": "runs inside another tree; imports nothing from this one's scripts",
}
# scripts whose JSON records commits from elsewhere, so they take no --commit
NO_COMMIT = {"scripts.probes.pair_report": "its rows' commits are --old-commit / --new-commit"}


def script_modules() -> list[str]:
    mods = []
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        mods.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return mods


def result_scripts() -> list[str]:
    return [m for m in script_modules() if m not in NOT_RESULT_SCRIPTS]


def actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings}


def test_the_exemptions_name_existing_modules():
    """An exemption for a module that no longer exists (or was renamed) would silently let its successor skip."""
    mods = set(script_modules())
    assert set(NOT_RESULT_SCRIPTS) <= mods and set(NO_COMMIT) <= mods
    assert len(result_scripts()) >= 20      # the walk found the scripts (bench_*, probes, studies, ...)


@pytest.mark.parametrize("mod", result_scripts())
def test_every_script_takes_the_shared_out_commit_model_dtype(mod):
    m = importlib.import_module(mod)
    assert hasattr(m, "build_parser"), f"{mod}: no build_parser() (or name it in NOT_RESULT_SCRIPTS with why)"
    acts = actions(m.build_parser())
    assert "--out" in acts and acts["--out"].type is bench_meta.out_folder, f"{mod}: --out not from add_common_args"
    assert acts["--out"].help.startswith(bench_meta.OUT_HELP.split("{")[0])
    if mod in NO_COMMIT:
        assert "--commit" not in acts
    else:
        assert "--commit" in acts and acts["--commit"].help == bench_meta.COMMIT_HELP, mod
    if "--model" in acts:         # one spelling and help wherever a script loads a model
        assert acts["--model"].help.startswith(bench_meta.MODEL_HELP + "; default: "), mod
    if "--dtype" in acts:
        assert tuple(acts["--dtype"].choices) == bench_meta.DTYPES, mod
        assert acts["--dtype"].default in bench_meta.DTYPES, mod


@pytest.mark.parametrize("mod", result_scripts())
def test_out_at_an_existing_file_is_refused_by_name(mod, tmp_path, capsys):
    """Before any work: never an IsADirectoryError after the first row, never a file replaced."""
    parser = importlib.import_module(mod).build_parser()
    target = tmp_path / "results.json"
    target.write_text("keep me")
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--out", str(target)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--out" in err and str(target) in err and "not a folder" in err, err
    assert target.read_text() == "keep me"


def test_out_folder_checks_without_creating(tmp_path, monkeypatch):
    """A folder path is accepted and made only when the first result is written (parsing --help or a --png
    redraw leaves nothing behind); a missing path named like a result file, or a path under a file, is refused."""
    new = tmp_path / "a" / "b"
    assert bench_meta.out_folder(str(new)) == str(new) and not new.exists()
    assert bench_meta.out_folder(str(tmp_path)) == str(tmp_path)
    (tmp_path / "f").write_text("x")
    for bad, why in ((tmp_path / "spec.json", "names a file"), (tmp_path / "trace.npz", "names a file"),
                     (tmp_path / "f" / "sub", "is a file"), ("", "empty")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            bench_meta.out_folder(str(bad) if bad else "")
    # the default folder (docs/benchmarks, relative) is not created by parsing either
    monkeypatch.chdir(tmp_path)
    from scripts import bench_select
    args = bench_select.build_parser().parse_args([])
    assert args.out == "docs/benchmarks" and not (tmp_path / "docs").exists()


def test_add_common_args_refuses_what_it_cannot_document():
    with pytest.raises(ValueError, match="model_default_help"):
        bench_meta.add_common_args(argparse.ArgumentParser(), model=None)
    with pytest.raises(ValueError, match="float64"):
        bench_meta.add_common_args(argparse.ArgumentParser(), dtype="float64")
    p = bench_meta.add_common_args(argparse.ArgumentParser(), model="smollm2-135m", dtype="bfloat16")
    a = p.parse_args([])
    assert (a.out, a.commit, a.model, a.dtype) == ("docs/benchmarks", None, "smollm2-135m", "bfloat16")
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "float64"])


def test_write_json_is_whole_or_nothing(tmp_path):
    """An interrupt in the middle of a rewrite leaves the previous complete file and no temporary file."""
    path = tmp_path / "sub" / "r.json"
    bench_meta.write_json(str(path), dict(rows=[1]))

    class Boom:
        def item(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bench_meta.write_json(str(path), dict(rows=[1, 2], bad=Boom()))
    assert json.loads(path.read_text()) == dict(rows=[1])
    assert os.listdir(path.parent) == ["r.json"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)


def test_a_run_interrupted_after_its_first_row_keeps_it(tmp_path, monkeypatch):
    """bench_select, Ctrl-C while timing its second row: the JSON on disk is valid and holds the first row."""
    from scripts import bench_select
    real, calls = bench_select.loop_time, []

    def loop_time(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(bench_select, "loop_time", loop_time)
    out = tmp_path / "bench"
    with pytest.raises(KeyboardInterrupt):
        bench_select.main(["--batch", "1", "--pages", "128", "--budget", "128", "--calls", "1", "--reps", "1",
                           "--blocks", "16", "--warps", "2", "--out", str(out), "--commit", "test"])
    data = json.loads((out / "select.json").read_text())
    assert data["meta"]["commit"] == "test"
    assert len(data["rows"]) == 1 and data["rows"][0]["impl"] == "pallas" and "us" in data["rows"][0]
