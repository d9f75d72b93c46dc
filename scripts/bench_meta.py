"""The benchmarks' shared harness (scripts/bench_*.py): what a run records about itself, how it times, the ceiling
it compares against, its JSON written row by row, and its plot.

- `run_meta(commit)`: device, platform, device count, jax version, commit and UTC date of the run (+ command line).
- `median_seconds(run, ...)`: median wall seconds of a blocking call (compiled and warmed first; an untimed
  `prepare` gives each repetition fresh donated inputs); `time_chain` times a step chained n times inside one jit
  (dispatch paid once per chain); `device_events(run, reps)`: the GPU's own busy time per call from the profiler.
- `copy_ceiling(nbytes)`: device-to-device copy bandwidth measured in the same run (bytes/s, read + write).
- `Results(path, meta)`: `.add(row)` rewrites `{"meta": ..., "rows": [...]}` after every row, so a run cut by a
  timeout keeps what it measured; `write_json(path, obj)` is the one writer (whole file or nothing: a run killed
  mid-write leaves the previous rows, never a torn file).
- `add_common_args(parser, ...)`: the one spelling of `--out` (a folder, made when the first result is written; an
  existing file refused before any work),
  `--commit`, and where a script loads a model or picks a dtype, `--model` / `--dtype`.
- `pyplot()`: matplotlib on the Agg backend; `save_figure(fig, path)`.
Medians, not means: a GPU call's first repetitions and the odd host hiccup are outliers, not signal.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


# ----------------------------------------------------------------------------------------------------------------
# what a run records about itself
# ----------------------------------------------------------------------------------------------------------------
def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(root: str | None = None) -> str:
    """HEAD's hash (+ '-dirty' with uncommitted changes to tracked files); read from .git directly where git cannot
    run (the GPU machine gets a copied tree whose git may refuse it); 'unknown' when neither works."""
    root = root or repo_root()
    try:
        out = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=root)
        commit = out.stdout.strip()
        if out.returncode == 0 and len(commit) == 40:
            st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, timeout=20, cwd=root)
            return commit + ("-dirty" if st.returncode == 0 and st.stdout.strip() else "")
    except Exception:  # noqa: BLE001 - no git binary, a timeout: fall back to reading the files
        pass
    try:
        head = open(os.path.join(root, ".git", "HEAD")).read().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        path = os.path.join(root, ".git", ref)
        if os.path.exists(path):
            return open(path).read().strip()
        for line in open(os.path.join(root, ".git", "packed-refs")):
            if line.strip().endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return "unknown"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_meta(commit: str | None = None, **extra) -> dict:
    """The fields every benchmark JSON carries: device kind, platform, device count, jax version, commit (given,
    e.g. by the device runbook, else read from git), UTC date and the command line; `extra` is merged in."""
    dev = jax.devices()[0]
    return dict(device=dev.device_kind, platform=dev.platform, num_devices=jax.device_count(), jax=jax.__version__,
                commit=commit or git_commit(), date=utc_now(), command=" ".join(sys.argv), **extra)


# ----------------------------------------------------------------------------------------------------------------
# the shared command line
# ----------------------------------------------------------------------------------------------------------------
MODEL_HELP = ("the model: a pretrained name (smollm2-135m, qwen2.5-coder-0.5b), a GGUF file or a folder holding "
              "one, or a Hugging Face folder")
DTYPES = ("float32", "bfloat16", "float16")
OUT_HELP = "output folder, made if missing (the files inside it are named by the benchmark: {files})"
COMMIT_HELP = ("the measured commit recorded in the JSON, for a tree without a usable .git (the GPU machine's copy); "
               "default: read from git")
OUT_FILE_SUFFIXES = (".json", ".npz", ".png", ".jsonl")   # a missing --out named so is a file name, not a folder


def out_folder(text: str) -> str:
    """argparse type of `--out`: a folder path, checked before any work so a run never ends in IsADirectoryError
    after its first row or replaces a file the user pointed at. Refused, by name: an existing non-folder, a path
    under one, and a missing path named like a result file (`x.json`: the old file-valued --out of some scripts).
    The folder is created when the first result is written (`write_json`, `save_figure`), not here: parsing
    `--help` or a `--png`/`--report` redraw must not leave folders behind."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path is not a folder")
    if os.path.exists(text):
        if not os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder: --out takes a folder (the JSON "
                                             "and PNG are written inside it under the benchmark's name)")
        return text
    if text.lower().endswith(OUT_FILE_SUFFIXES):
        raise argparse.ArgumentTypeError(f"{text!r} names a file: --out takes a folder (the JSON and PNG are "
                                         "written inside it under the benchmark's name)")
    parent = os.path.dirname(os.path.abspath(text))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be a folder: {parent!r} is a file")
    return text


def add_common_args(parser: argparse.ArgumentParser, *, out_default: str | None = "docs/benchmarks",
                    out_required: bool = False, out_default_help: str | None = None,
                    files: str = "NAME.json, NAME.png", commit: bool = True,
                    model: str | None | bool = False, model_default_help: str | None = None,
                    dtype: str | bool = False) -> argparse.ArgumentParser:
    """Adds `--out` (a folder: `out_folder`), `--commit`, and with `model` (its default: a string, or None with
    `model_default_help` saying what None loads) `--model`, with `dtype` (its default) `--dtype`: every benchmark
    script spells, documents and checks them the same way. `files` names what the script writes inside --out;
    `out_default_help` says what a default of None means; `commit=False` only where the JSON's commits come from
    elsewhere (a report over two trees' rows). `model` / `dtype` left False (the default) add no --model /
    --dtype: not every script loads a model."""
    if out_required:
        parser.add_argument("--out", required=True, type=out_folder, help=OUT_HELP.format(files=files))
    else:
        parser.add_argument("--out", default=out_default, type=out_folder,
                            help=OUT_HELP.format(files=files) + f"; default: {out_default_help or out_default}")
    if commit:
        parser.add_argument("--commit", default=None, help=COMMIT_HELP)
    if model is not False:
        if model is True:
            raise ValueError("add_common_args(model=...) takes the default model (a string or None), not True")
        shown = model if model is not None else model_default_help
        if shown is None:
            raise ValueError("add_common_args(model=None) needs model_default_help: what runs without --model")
        parser.add_argument("--model", default=model, help=f"{MODEL_HELP}; default: {shown}")
    if dtype is not False:
        if dtype not in DTYPES:
            raise ValueError(f"add_common_args(dtype={dtype!r}): the default dtype must be one of {DTYPES}")
        parser.add_argument("--dtype", default=dtype, choices=DTYPES, help=f"model and cache dtype; default: {dtype}")
    return parser


# ----------------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------------
def block(tree):
    """Wait for every array of a pytree (non-arrays pass through)."""
    jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, tree)
    return tree


@dataclasses.dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    max_s: float
    reps: int

    def row(self, scale: float = 1e6, unit: str = "us") -> dict:
        """JSON fields: median, min and max in `unit`, and the repetition count."""
        return {unit: self.median_s * scale, f"min_{unit}": self.min_s * scale, f"max_{unit}": self.max_s * scale,
                "reps": self.reps}


def median_seconds(run: Callable, reps: int = 10, *, warmup: int = 1, prepare: Callable | None = None,
                   budget_s: float | None = None, per_call: int = 1) -> Timing:
    """Median wall seconds of `run()` (or `run(prepare())`), blocking on its result, after `warmup` untimed calls
    (the first compiles). `prepare` is not timed (fresh donated inputs, a copied state). With `budget_s`, at least
    3 repetitions and then more, up to `reps`, while the budget lasts. `per_call` divides every time (a loop of n
    calls timed as one)."""
    def call():
        arg = block(prepare()) if prepare is not None else None
        t0 = time.perf_counter()
        block(run(arg) if prepare is not None else run())
        return (time.perf_counter() - t0) / per_call

    for _ in range(warmup):
        call()
    times, t_start = [], time.perf_counter()
    while len(times) < reps and (budget_s is None or len(times) < 3 or time.perf_counter() - t_start < budget_s):
        times.append(call())
    return Timing(median_s=statistics.median(times), min_s=min(times), max_s=max(times), reps=len(times))


def time_chain(step: Callable, carry, *args, donate: bool = False, target_s: float = 0.004, reps: int = 7,
               max_n: int = 32) -> tuple[float, Any]:
    """Median seconds per call of `step(carry, *args) -> carry`, run as a chain of n calls inside one jit (the
    output feeds the next call, so nothing is hoisted or overlapped, and dispatch is paid once per chain; n makes
    a chain last about target_s). Returns (seconds, carry)."""
    def chain(n):
        def run(c, *a):
            for _ in range(n):
                c = step(c, *a)
            return c
        return jax.jit(run, donate_argnums=(0,) if donate else ())

    one = chain(1)
    carry = block(one(carry, *args))
    t0 = time.perf_counter()
    carry = block(one(carry, *args))
    est = time.perf_counter() - t0
    n = int(min(max_n, max(1, math.ceil(target_s / max(est, 1e-6)))))
    run = chain(n) if n > 1 else one
    carry = block(run(carry, *args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        carry = block(run(carry, *args))
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times), carry


_SKIP_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Launch Stats", "Steps", "Source code", "TensorFlow Ops",
               "Framework Name Scope", "Framework Ops")


@dataclasses.dataclass(frozen=True)
class DeviceTime:
    busy_ns: float                # per call: the summed duration of the device's events (kernels, memcpys)
    span_ns: float                # per call: first event start to last event end, over all calls / reps
    by_name: dict[str, float]     # per call: ns by event name
    events: int                   # per call
    gap_ns_median: float | None   # median gap between consecutive events closer than 20 us (launch gaps)
    lines: list[str]


def device_events(run: Callable, reps: int) -> DeviceTime | None:
    """Runs `run()` reps times (no sync in between) under the JAX profiler and reads the GPU's events; None where
    the profiler or the GPU planes are unavailable (on CPU, or without CUPTI)."""
    try:
        from jax._src.lib import _profiler  # the in-memory profiler session: no trace files to parse
        sess = _profiler.ProfilerSession(jax.profiler.ProfileOptions())
    except Exception as e:  # noqa: BLE001
        print("profiler unavailable:", repr(e)[:200], flush=True)
        return None
    out = None
    for _ in range(reps):
        out = run()
    block(out)
    pd = jax.profiler.ProfileData.from_serialized_xspace(sess.stop())
    by_name, lines_seen, spans = {}, set(), []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = list(plane.lines)
        streams = [ln for ln in lines if ln.name.startswith("Stream")] or \
            [ln for ln in lines if ln.name not in _SKIP_LINES]
        for ln in streams:
            lines_seen.add(ln.name)
            for ev in ln.events:
                d, s = float(ev.duration_ns), float(ev.start_ns)
                by_name[ev.name] = by_name.get(ev.name, 0.0) + d / reps
                spans.append((s, d))
    if not spans:
        return None
    spans.sort()
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(spans, spans[1:]) if 0 <= b[0] - (a[0] + a[1]) < 20e3]
    return DeviceTime(busy_ns=sum(d for _, d in spans) / reps,
                      span_ns=(max(s + d for s, d in spans) - spans[0][0]) / reps, by_name=by_name,
                      events=len(spans) // reps, gap_ns_median=statistics.median(gaps) if gaps else None,
                      lines=sorted(lines_seen))


# ----------------------------------------------------------------------------------------------------------------
# ceilings
# ----------------------------------------------------------------------------------------------------------------
def copy_ceiling(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device memory copy bandwidth in bytes/s (read + write counted) of `x * 1` over a bf16 array of nbytes:
    the ceiling a memory-bound kernel of the same run is compared against."""
    x = jnp.ones(nbytes // 2, jnp.bfloat16)
    f = jax.jit(lambda a: a * 1)
    return 2 * nbytes / median_seconds(lambda: f(x), reps).median_s


def read_ceiling(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device memory read bandwidth in bytes/s: a sum over a bf16 array of nbytes (reads only), timed as a chain of
    sums in one jit (time_chain: each sum depends on the last, so none is merged or hoisted) so a call's dispatch
    and sync are not counted against the memory (at 1 GB a single call's took up to a third of its time)."""
    x = jnp.ones(nbytes // 2, jnp.bfloat16)
    sec, _ = time_chain(lambda c, a: c + jnp.sum(a.astype(jnp.float32) + c, dtype=jnp.float32) * 1e-12,
                        jnp.float32(0), x, target_s=0.01, reps=reps)
    return nbytes / sec


# ----------------------------------------------------------------------------------------------------------------
# results and plots
# ----------------------------------------------------------------------------------------------------------------
class Results:
    """A benchmark's JSON file, `{"meta": ..., "rows": [...], **extra}`, rewritten after every row."""

    def __init__(self, path: str, meta: dict, **extra):
        self.path, self.meta, self.rows, self.extra = path, meta, [], dict(extra)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.save()
        return row

    def save(self) -> None:
        write_json(self.path, dict(meta=self.meta, rows=self.rows, **self.extra))


def write_json(path: str, obj, *, indent: int = 1) -> str:
    """Writes `obj` as JSON to `path` whole or not at all: into a temporary file beside it, then renamed over it,
    so a run killed or interrupted mid-write keeps the previous complete file (the rows measured so far)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=indent, default=_jsonable)
        os.chmod(tmp, 0o644)   # mkstemp's 0600 would make the results unreadable to the group that reads them
        os.replace(tmp, path)
    except BaseException:   # KeyboardInterrupt included: no temporary file is left behind
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_npz(path: str, **arrays) -> str:
    """`np.savez_compressed(path, **arrays)` whole or not at all (a temporary file renamed over `path`, as
    `write_json`): a trace cut by a timeout or Ctrl-C never leaves a truncated archive under the final name."""
    import numpy as np
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:   # a file object: savez would append ".npz" to a name
            np.savez_compressed(fh, **arrays)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def earlier_run(path: str, append: bool) -> tuple[dict, list]:
    """(meta, rows) of the JSON at `path` when appending to it (a run split across sessions and machines keeps the
    rows already there), else ({}, [])."""
    if not (append and os.path.exists(path)):
        return {}, []
    with open(path) as f:
        meta = json.load(f)
    return meta, meta.pop("rows", [])


def earlier_runs(path: str) -> dict:
    """A study's JSON of runs ({"runs": [...]}; none if it does not exist), read before any work so that a file the
    study did not write stops it by name instead of being replaced at the end."""
    if not os.path.lexists(path):
        return {"runs": []}
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path!r} exists and is not a readable JSON file ({type(e).__name__}: {e}): move it or "
                         "pick another --out") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise SystemExit(f"{path!r} is not a {os.path.basename(path)} of runs (no 'runs' list): move it or pick "
                         "another --out")
    return data


def appended_meta(earlier: dict, commit: str, command: str, run: str | None = None) -> dict:
    """The `command` and `commit` fields of a JSON this run appends to: the earlier runs' stay, this one's is added."""
    if not earlier:
        return dict(command=command, commit=commit)
    return dict(command=f"{earlier.get('command', '')}; run {run or commit}: {command}".lstrip("; "),
                commit=f"{earlier.get('commit', '')} / {commit}".lstrip(" /"))


def _jsonable(x):
    if hasattr(x, "tolist") and getattr(x, "size", 1) != 1:   # numpy / jax arrays (writers that used str() got text)
        return x.tolist()
    if hasattr(x, "item"):  # numpy / jax scalars
        return x.item()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return str(x)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display on the GPU machine or in CI)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def child_env() -> dict:
    """The environment of a row's child process: this one's, with the repository root on PYTHONPATH, because a
    child started as `python scripts/x.py` has scripts/ (not the root) first on sys.path and must still import
    `scripts.bench_meta` like its parent did under `python -m scripts.x`."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=repo_root() + (os.pathsep + path if path else ""))


def row_in_child(cmd: list[str], timeout: float, **labels) -> dict:
    """Run one benchmark row in a fresh process (its compiles, HBM and pinned host memory are its own) and return
    the JSON it printed on a line starting "ROW "; on a crash or a timeout, `labels` plus the error."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())
    except subprocess.TimeoutExpired:
        return dict(labels, error=f"timeout after {timeout:.0f} s")
    line = [x for x in res.stdout.splitlines() if x.startswith("ROW ")]
    return json.loads(line[-1][4:]) if line else dict(labels, error=res.stderr[-600:])
