"""`ulacache`: batch offline inference (`generate`), the benchmark scripts (`bench`) and the demo (`demo`).

    ulacache generate --input prompts.jsonl --output results.jsonl [--model PATH_OR_PRESET] [--report r.json]

Input: one JSON object a line, {"id": ..., "prompt": "..."} or {"id": ..., "prompt_ids": [...]}, optionally
with per-request "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_ids". Output: one JSON object a
line as each request finishes, {"id", "line", "text", "ids", "finish_reason" (stop | length | error),
"prompt_tokens", "completion_tokens"} or {"id", "line", "finish_reason": "error", "error"}; flushed line by line
so an interrupted run loses nothing and `--resume` continues it. Exit code: 0 if every request succeeded, 1 if
any line failed (bad input or a failed request), 2 for bad options, 130 when interrupted.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import pathlib
import subprocess
import sys
import time

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
KNOWN_FIELDS = ("id", "prompt", "prompt_ids", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_ids")


class UsageError(Exception):
    """Bad options or an unusable model/output path: reported on stderr, exit code 2."""


# ---- argument parsing -----------------------------------------------------------------------------------------
def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s} must be an int >= 1")
    return v


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{s} must be > 0")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ulacache", description="UlaCache-JAX: long-context serving with a two-tier "
                                "sparse KV cache (HBM + host).")
    sub = p.add_subparsers(dest="command", required=True, metavar="{generate,bench,demo}")
    g = sub.add_parser("generate", help="batch offline inference over a JSONL file of prompts",
                       description="Batch offline inference with continuous batching over the cache's sequence "
                       "slots. Input lines: {\"id\": ..., \"prompt\": \"...\"} or "
                       "{\"id\": ..., \"prompt_ids\": [...]}, "
                       "optionally with max_new_tokens, temperature, top_p, top_k, seed, stop_ids. Exit code 0 if "
                       "every request succeeded, 1 if any failed, 2 for bad options, 130 when interrupted.")
    g.add_argument("--model", default=None,
                   help="a Hugging Face model folder (config.json + safetensors), a checkpoint folder written by "
                        "ulacache_jax.models.save, or a preset name (tiny, tiny-gqa8, llama-3.1-8b, ...: RANDOM "
                        "weights). Default: the tiny byte-level preset with random weights (gibberish output)")
    g.add_argument("--input", required=True, help="JSONL prompts ('-' = stdin)")
    g.add_argument("--output", required=True, help="JSONL results, written as requests finish")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=0, help="engine sampling seed (and the random weights of a preset)")
    g.add_argument("--stop-ids", default=None,
                   help="comma-separated stop token ids (default: the model's EOS ids; 'none' for no stop ids)")
    g.add_argument("--token-budget", type=_positive_int, default=2048,
                   help="tokens each KV-head group attends per step (sink + recent + selected pages)")
    g.add_argument("--page-size", type=_positive_int, default=64, help="tokens per KV page (power of two)")
    g.add_argument("--hbm-pages", type=_positive_int, default=None,
                   help="HBM frame pool size in pages (default: the whole token budget of every slot)")
    g.add_argument("--host-gb", type=_positive_float, default=None,
                   help="host pool size in GiB (default: every slot at the full context)")
    g.add_argument("--max-seqs", type=_positive_int, default=4, help="sequence slots decoded together")
    g.add_argument("--max-context", type=_positive_int, default=None,
                   help="context limit in tokens (prompt + generated); default: the model's "
                        "max_position_embeddings. The cache is sized for the longest request that fits")
    g.add_argument("--max-prefill-tokens", type=_positive_int, default=None,
                   help="prompt tokens prefilled per step while other requests decode (default: the max context)")
    g.add_argument("--attention", choices=("sparse", "dense"), default="sparse",
                   help="sparse = UlaCache; dense = every K/V in HBM (the baseline)")
    g.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel ranks (needs ulacache_jax.tp)")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="param and cache dtype (auto: float32 on CPU, bfloat16 on accelerators)")
    g.add_argument("--report", default=None, help="write the report as JSON here (and a PNG beside it)")
    g.add_argument("--plot", default=None, help="PNG of hit rate and throughput over time (default: the report "
                                                 "path with .png)")
    g.add_argument("--resume", action="store_true",
                   help="append to --output, skipping ids that already have a result there (failed lines are tried "
                        "again; an input error already reported for the same line is not repeated)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty --output")
    g.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    g.add_argument("--quiet", action="store_true", help="do not print the report")

    b = sub.add_parser("bench", help="run the benchmark scripts (scripts/bench_*.py) with their defaults")
    b.add_argument("--list", action="store_true", help="list the scripts found and exit")
    b.add_argument("--only", action="append", default=[], help="run only scripts whose name contains this")
    b.add_argument("--scripts-dir", default=None,
                   help="where the bench_*.py scripts are (default: the repo's scripts/)")

    d = sub.add_parser("demo", help="batch inference on the tiny preset (random weights) with built-in long prompts")
    d.add_argument("--out-dir", default=None, help="where to write results, report and plot (default: a temp dir)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .cache_state import raise_host_limit
    raise_host_limit()  # before JAX starts: XLA's pinned host pool is 64 GiB by default, whatever the RAM
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            return cmd_bench(args)
        from . import demo
        return demo.main(["--out-dir", args.out_dir] if args.out_dir else [])
    except UsageError as e:
        print(f"ulacache {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


# ---- model ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LoadedModel:
    model: object
    tokenizer: object | None
    label: str
    random_weights: bool


def load_model(spec: str | None, dtype: str, seed: int) -> LoadedModel:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from . import models

    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    jdt = jnp.dtype(dtype)
    name = spec or "tiny"
    path = pathlib.Path(name)
    if spec is None or (name in models.PRESETS and not path.exists()):
        mc = models.get_preset(name)
        model = models.LlamaModel(mc, dtype=jdt, rngs=nnx.Rngs(seed))
        tok = models.ByteTokenizer() if mc.vocab_size == models.BYTE_VOCAB_SIZE else None
        return LoadedModel(model, tok, f"{name} preset, RANDOM weights (seed {seed})", True)
    if not path.exists():
        raise UsageError(f"--model {spec!r}: no such folder, and not a preset (presets: {', '.join(models.PRESETS)})")
    try:
        if (path / "model.json").is_file():
            model = models.load(path, dtype=jdt)
        else:
            model = models.from_pretrained(path, dtype=jdt)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {spec!r}: {e}") from None
    tok = None
    if (path / "tokenizer.json").is_file():
        tok = models.load_tokenizer(path)
    elif model.config.vocab_size == models.BYTE_VOCAB_SIZE:
        tok = models.ByteTokenizer()
    return LoadedModel(model, tok, f"{path.name} ({path})", False)


# ---- input ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Record:
    line: int
    id: object
    prompt_ids: list[int]
    sampling: object           # engine.SamplingParams
    capped_from: int | None = None


@dataclasses.dataclass
class InputError:
    line: int
    id: object
    error: str

    def as_output(self) -> dict:
        return {"id": self.id, "line": self.line, "finish_reason": "error", "error": self.error}


def _id_key(x) -> str:
    return json.dumps(x, sort_keys=True)


@dataclasses.dataclass
class ResumeState:
    done_ids: set = dataclasses.field(default_factory=set)       # ids with a result (not an error)
    reported: set = dataclasses.field(default_factory=set)       # (line, id) of lines already reported as errors
    need_newline: bool = False


def read_resume_state(path: pathlib.Path) -> ResumeState:
    """What an existing output file already holds (for --resume). A last line cut short by an interruption is
    not valid JSON: it is ignored (that request runs again)."""
    st = ResumeState()
    if not path.exists():
        return st
    text = path.read_text(encoding="utf-8")
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or "id" not in obj:
            continue
        if obj.get("finish_reason") == "error":
            st.reported.add((obj.get("line"), _id_key(obj["id"])))
        else:
            st.done_ids.add(_id_key(obj["id"]))
    st.need_newline = bool(text) and not text.endswith("\n")
    return st


def parse_input(lines, *, tokenizer, vocab_size: int, limit: int, defaults, resume: ResumeState | None = None):
    """-> (records, errors, skipped, skipped_errors). `defaults`: engine.SamplingParams from the command line.
    With `resume`: ids that already have a result are skipped; a line that fails again as already reported in
    the output is not reported twice (counted in skipped_errors)."""
    from .engine import RequestError

    resume = resume or ResumeState()
    records: list[Record] = []
    errors: list[InputError] = []
    seen: dict[str, int] = {}
    skipped = skipped_errors = 0
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        rid = None
        try:
            rec = _parse_line(raw, n, seen, resume.done_ids, tokenizer=tokenizer, vocab_size=vocab_size,
                              limit=limit, defaults=defaults)
        except RequestError as e:
            rid = e.args[1] if len(e.args) > 1 else None
            if (n, _id_key(rid)) in resume.reported:
                skipped_errors += 1
            else:
                errors.append(InputError(n, rid, e.args[0]))
            continue
        if rec is None:
            skipped += 1
        else:
            records.append(rec)
    return records, errors, skipped, skipped_errors


def _parse_line(raw: str, n: int, seen: dict, done_ids: set, *, tokenizer, vocab_size: int, limit: int, defaults):
    """One input line -> Record, or None if its id already has a result. Raises RequestError(message, id)."""
    from .engine import RequestError

    rid = None

    def fail(msg):
        raise RequestError(msg, rid)

    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        fail(f"malformed JSON: {e.msg} at column {e.colno}")
    if not isinstance(obj, dict):
        fail(f"expected a JSON object, got {type(obj).__name__}")
    rid = obj.get("id")
    unknown = sorted(set(obj) - set(KNOWN_FIELDS))
    if unknown:
        fail(f"unknown field(s) {', '.join(map(repr, unknown))} (known: {', '.join(KNOWN_FIELDS)})")
    if "id" not in obj:
        fail("missing field 'id'")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        fail(f"id must be a string or an int, got {json.dumps(rid)}")
    key = _id_key(rid)
    if key in seen:
        fail(f"duplicate id (first on line {seen[key]})")
    seen[key] = n
    if key in done_ids:
        return None
    if ("prompt" in obj) == ("prompt_ids" in obj):
        fail("give exactly one of 'prompt' (text) and 'prompt_ids' (token ids)")
    if "prompt" in obj:
        text = obj["prompt"]
        if not isinstance(text, str):
            fail(f"'prompt' must be a string, got {type(text).__name__}")
        if not text.strip():
            fail("empty prompt" + (" (only whitespace)" if text else ""))
        if tokenizer is None:
            fail("this model has no tokenizer (no tokenizer.json): give 'prompt_ids'")
        ids = tokenizer.encode(text)
    else:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            fail("'prompt_ids' must be a list of ints")
        if not ids:
            fail("empty prompt")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            fail(f"token id {bad[0]} outside [0, vocab_size = {vocab_size})")
    over = {k: obj[k] for k in ("max_new_tokens", "temperature", "top_p", "top_k", "seed") if k in obj}
    if "stop_ids" in obj:
        if not isinstance(obj["stop_ids"], list):
            fail("'stop_ids' must be a list of ints")
        over["stop_ids"] = tuple(obj["stop_ids"])
    sp = dataclasses.replace(defaults, **over)
    try:
        sp.check(vocab_size)
    except ValueError as e:
        fail(str(e))
    if len(ids) + 1 > limit:
        fail(f"prompt of {len(ids)} tokens is longer than the context limit of {limit} tokens (with room for one "
             "generated token; --max-context)")
    rec = Record(n, rid, [int(t) for t in ids], sp)
    if len(ids) + sp.max_new_tokens > limit:
        rec.capped_from = sp.max_new_tokens
        rec.sampling = dataclasses.replace(sp, max_new_tokens=limit - len(ids))
    return rec


# ---- generate ---------------------------------------------------------------------------------------------------
def _cache_config(args, mc, dtype, num_seqs: int, max_tokens: int, tp_mod=None):
    """The cache for this run: generate.default_cache_config (tp.default_tp_cache_config under --tp: frames and
    host pages per rank), then --hbm-pages / --host-gb."""
    from .config import CacheConfig
    from .generation import default_cache_config

    def make():
        kw = dict(num_seqs=num_seqs, max_tokens=max_tokens, page_size=args.page_size, token_budget=args.token_budget,
                  dtype=dtype)
        if tp_mod is not None:
            return tp_mod.default_tp_cache_config(mc, args.tp, **kw)
        return default_cache_config(mc, **kw)

    try:
        if args.token_budget % args.page_size:
            raise ValueError(f"--token-budget {args.token_budget} must be a multiple of --page-size {args.page_size}")
        cfg = make()
        over = {}
        if args.hbm_pages is not None:
            n = args.hbm_pages
            slots = 64 if n >= 64 * 64 else max(1, min(n, max(4, n // 16)))
            buckets = 1 << max(0, (n // slots).bit_length() - 1)   # a power of two, frames <= n
            over.update(num_buckets=buckets, slots_per_bucket=slots)
        if args.host_gb is not None:
            over["host_pages"] = max(1, int(args.host_gb * 2**30) // (2 * cfg.page_bytes))
        if over:
            cfg = CacheConfig(**{**dataclasses.asdict(cfg), **over})
    except ValueError as e:
        raise UsageError(f"cache settings: {e}") from None
    return cfg


def find_tp_module():
    """ulacache_jax.tp if this install has it (head-sharded tensor parallelism), else None."""
    if importlib.util.find_spec("ulacache_jax.tp") is None:
        return None
    return importlib.import_module("ulacache_jax.tp")


def _tp_module(args):
    if args.tp <= 1:
        return None
    if args.attention != "sparse":
        raise UsageError(f"--tp {args.tp} shards the sparse cache; --attention dense is single-device")
    tp = find_tp_module()
    if tp is None:
        raise UsageError(f"--tp {args.tp} needs the TP module (ulacache_jax.tp, head-sharded tensor parallelism), "
                         "which this install does not have; run with --tp 1")
    missing = [n for n in ("TPGenerator", "prepare_model", "default_tp_cache_config") if not hasattr(tp, n)]
    if missing:
        raise UsageError(f"--tp {args.tp}: ulacache_jax.tp lacks {', '.join(missing)}, which the CLI drives")
    return tp


def _param_bytes(model) -> int:
    import jax
    from flax import nnx
    return int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def cmd_generate(args) -> int:
    t_start = time.perf_counter()
    out_path = pathlib.Path(args.output)
    if not out_path.parent.exists():
        raise UsageError(f"--output {args.output}: folder {out_path.parent} does not exist")
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite contradict each other")
    if out_path.exists() and out_path.stat().st_size and not (args.resume or args.overwrite):
        raise UsageError(f"--output {args.output} exists and is not empty: --resume to continue it, --overwrite "
                         "to replace it")
    resume = read_resume_state(out_path) if args.resume else ResumeState()
    try:
        lines = sys.stdin.read().splitlines() if args.input == "-" else \
            pathlib.Path(args.input).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--input {args.input}: {e}") from None

    from .engine import Engine, SamplingParams
    from . import report as report_mod

    tp_mod = _tp_module(args)
    loaded = load_model(args.model, args.dtype, args.seed)
    if tp_mod is not None:
        try:   # replicates KV heads when --tp exceeds them
            loaded.model = tp_mod.prepare_model(loaded.model, args.tp)
        except ValueError as e:
            raise UsageError(f"--tp {args.tp}: {e}") from None
    mc = loaded.model.config
    if loaded.random_weights:
        print(f"ulacache: model {loaded.label}: output text is gibberish", file=sys.stderr)
    if args.stop_ids is None:
        stops = tuple(mc.eos_token_ids)
    elif args.stop_ids.strip().lower() == "none":
        stops = ()
    else:
        try:
            stops = tuple(int(s) for s in args.stop_ids.split(",") if s.strip())
        except ValueError:
            raise UsageError(f"--stop-ids {args.stop_ids!r}: expected comma-separated ints") from None
    defaults = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=None, stop_ids=stops)
    try:
        defaults.check(mc.vocab_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    limit = args.max_context or mc.max_position_embeddings
    records, errors, skipped, skipped_errors = parse_input(lines, tokenizer=loaded.tokenizer, vocab_size=mc.vocab_size,
                                                           limit=limit, defaults=defaults, resume=resume)
    for e in errors:
        print(f"{args.input}:{e.line}: id {json.dumps(e.id)}: {e.error}", file=sys.stderr)
    if skipped or skipped_errors:
        print(f"ulacache: --resume: {skipped} ids already done in {args.output}, skipped; {skipped_errors} input "
              "errors already reported there, not repeated", file=sys.stderr)

    engine = None
    if records:   # built before the output is touched: a bad cache setting leaves it as it was
        longest = min(limit, max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in records))
        num_seqs = min(args.max_seqs, len(records))
        cfg = _cache_config(args, mc, loaded.model.dtype, num_seqs, longest, tp_mod)
        try:
            if tp_mod is not None:
                engine = Engine(generator=tp_mod.TPGenerator(loaded.model, cfg), seed=args.seed,
                                max_prefill_tokens_per_step=args.max_prefill_tokens)
            else:
                engine = Engine(loaded.model, cfg, attention=args.attention, seed=args.seed,
                                max_prefill_tokens_per_step=args.max_prefill_tokens)
        except ValueError as e:   # a pool that does not fit memory, fewer devices than --tp, ...
            raise UsageError(f"cache: {e}") from None

    mode = "a" if args.resume else "w"
    engine_failed = 0
    interrupted = False
    rep = None
    with open(out_path, mode, encoding="utf-8") as out:
        if resume.need_newline:
            out.write("\n")
        for e in errors:
            out.write(json.dumps(e.as_output()) + "\n")
        out.flush()
        if engine is not None:
            by_rid = {engine.add_request(r.prompt_ids, r.sampling): r for r in records}
            finished = []
            bar = None
            if _is_tty(sys.stderr) and not args.no_progress:
                from tqdm import tqdm
                bar = tqdm(total=len(records), unit="req", file=sys.stderr, dynamic_ncols=True)
            n_tokens = 0
            try:
                while engine.has_unfinished():
                    for ev in engine.step():
                        n_tokens += len(ev.new_tokens)
                        if not ev.finished:
                            continue
                        req = engine.pop(ev.request_id)
                        rec = by_rid[ev.request_id]
                        finished.append(req)
                        out.write(json.dumps(_result_line(rec, req, loaded.tokenizer)) + "\n")
                        out.flush()
                        if req.finish_reason == "error":
                            engine_failed += 1
                            print(f"{args.input}:{rec.line}: id {json.dumps(rec.id)}: {req.error}", file=sys.stderr)
                        if bar is not None:
                            bar.update(1)
                    if bar is not None:
                        el = engine.elapsed()
                        bar.set_postfix_str(f"{n_tokens / el:.1f} tok/s, {engine.num_running} running, "
                                            f"{engine.num_queued} queued" if el > 0 else "")
            except KeyboardInterrupt:
                interrupted = True
            finally:
                if bar is not None:
                    bar.close()
            rep = report_mod.build_report(
                engine, finished, wall_s=time.perf_counter() - t_start, model_label=loaded.label,
                random_weights=loaded.random_weights, param_bytes=_param_bytes(loaded.model),
                extra={"input": args.input, "output": args.output,
                       "lines": {"requests": len(records), "input_errors": len(errors), "skipped_resume": skipped,
                                 "input_errors_reported_before": skipped_errors},
                       "input_errors": [dataclasses.asdict(e) for e in errors], "interrupted": interrupted})
    if interrupted:
        print(f"ulacache: interrupted; finished requests are in {args.output}: rerun with --resume to continue",
              file=sys.stderr)
    if rep is not None:
        if args.report:
            plot = args.plot or str(pathlib.Path(args.report).with_suffix(".png"))
            rep["plot"] = plot
            report_mod.write_json(rep, args.report)
            report_mod.plot_timeline(rep, plot)
        elif args.plot:
            report_mod.plot_timeline(rep, args.plot)
        if not args.quiet:
            print(report_mod.format_report(rep))
            if args.report:
                print(f"report: {args.report}  plot: {rep['plot']}")
    elif not args.quiet:
        print(f"ulacache: nothing to run ({len(errors)} input errors, {skipped} ids already done)")
    if interrupted:
        return EXIT_INTERRUPTED
    # with --resume, input errors reported by the earlier run still count: the input still has failing lines
    return EXIT_FAILED if errors or skipped_errors or engine_failed else EXIT_OK


def _result_line(rec: Record, req, tokenizer) -> dict:
    if req.finish_reason == "error":
        return {"id": rec.id, "line": rec.line, "finish_reason": "error", "error": req.error}
    out = {"id": rec.id, "line": rec.line,
           "text": tokenizer.decode(req.tokens) if tokenizer is not None else None,
           "ids": req.tokens, "finish_reason": req.finish_reason,
           "prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.tokens)}
    if rec.capped_from is not None or req.capped:
        out["max_new_tokens_capped_to"] = req.max_new_tokens
    return out


# ---- bench ------------------------------------------------------------------------------------------------------
def find_bench_scripts(scripts_dir: str | None = None) -> list[pathlib.Path]:
    if scripts_dir is not None:
        dirs = [pathlib.Path(scripts_dir)]
    else:
        dirs = [pathlib.Path(__file__).resolve().parent.parent / "scripts", pathlib.Path.cwd() / "scripts"]
    for d in dirs:
        found = sorted(d.glob("bench_*.py"))
        if found:
            return found
    return []


def cmd_bench(args) -> int:
    scripts = find_bench_scripts(args.scripts_dir)
    if args.only:
        scripts = [s for s in scripts if any(o in s.name for o in args.only)]
    if not scripts:
        raise UsageError("no scripts/bench_*.py found" + (f" matching {args.only}" if args.only else "")
                         + " (run from the repository, or give --scripts-dir)")
    if args.list:
        for s in scripts:
            print(s)
        return EXIT_OK
    failed = []
    for s in scripts:
        print(f"== {s.name}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, str(s)], cwd=s.parent.parent).returncode
        print(f"== {s.name}: exit {rc} after {time.perf_counter() - t0:.1f} s", flush=True)
        if rc:
            failed.append(s.name)
    if failed:
        print(f"ulacache bench: failed: {', '.join(failed)}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
