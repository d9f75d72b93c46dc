"""What a rerun of `ulacache generate` continues from: the settings fingerprint of a run (every option that
changes tokens: run_settings; NOT_IN_FINGERPRINT names the others and why), the output file's state for --resume
(ids done, errors already reported, torn lines repaired), and the checkpoint folder's in-flight requests (read,
checked against this run, restored into the Engine). The command's docstring (app/cli.py) describes the contract.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sys

from ulacache_jax.app import batch_lines, jsonl_io
from ulacache_jax.app.errors import UsageError
from ulacache_jax.app.model_loading import DEFAULT_MODEL, resolve_dtype


def num_speculative_tokens(args) -> int:
    """--num-speculative-tokens, 4 when not given."""
    return 4 if args.num_speculative_tokens is None else args.num_speculative_tokens


# generate's options that cannot change a run's tokens, each with why: every other option is in run_settings (a
# test derives the list from the parser, so a new option is either fingerprinted or named here)
NOT_IN_FINGERPRINT = {
    "input": "where the prompts come from (each record keeps its id and line)",
    "output": "where results go", "report": "a side file", "plot": "a side file",
    "resume": "how the output is opened", "force": "--resume's override", "overwrite": "how the output is opened",
    "checkpoint_dir": "where the batch is saved", "checkpoint_every": "when the batch is saved",
    "compile_cache": "where compiled programs are kept", "no_progress": "the progress bar",
    "progress_every": "how often progress is logged", "quiet": "the report",
    "hbm_pages": "the HBM tier's size: which pages are resident, not which are selected",
    "host_gb": "the host tier's size", "max_seqs": "how many requests decode together (each keeps its own seed)",
    "tp": "how the model is split over devices", "max_prefill_tokens": "how a prefill is split over steps",
    "prefill_chunk_tokens": "how a prompt is split into prefill chunks (the same tokens as whole)",
    "no_prefix_cache": "whether a shared prefix's K/V is reused or computed again",
}


# options fingerprinted only when not at their default, so files written before they were fingerprinted (at the
# default, the only case that was right then) still resume
FINGERPRINTED_WHEN_SET = {"key_channels": 0, "label_bits": 0, "channel_table": "auto", "kv_dtype": "auto",
                           "two_stage": None, "token_shortlist": None,
                           "speculative": None, "num_speculative_tokens": 4, "draft_model": None,
                           "deterministic": False,
                           "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                           "logprobs": None}


def file_identity(spec: str | None) -> str | None:
    """A model, draft model or table given as a path -> its real path (the same file named two ways is one
    setting); a preset's name as it is."""
    if spec is not None and pathlib.Path(spec).exists():
        return os.path.realpath(spec)
    return spec


def run_settings(args) -> dict:
    """What decides a run's outputs, for the --resume fingerprint: the model (the one loaded: the default resolved),
    dtype, sampling defaults, limits, the cache's selection (budget, page, key channels, labels), attention and
    speculative decoding. NOT_IN_FINGERPRINT lists the options left out and why."""
    settings = {"model": file_identity(args.model or DEFAULT_MODEL), "dtype": resolve_dtype(args.dtype),
                "seed": args.seed, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "top_k": args.top_k, "stop_ids": args.stop_ids, "stop": list(args.stop),
                "max_context": args.max_context, "token_budget": args.token_budget, "page_size": args.page_size,
                "attention": args.attention}
    for name, default in FINGERPRINTED_WHEN_SET.items():
        v = num_speculative_tokens(args) if name == "num_speculative_tokens" else getattr(args, name)
        if name == "label_bits":      # what 'auto' means: none with Quest, so Quest files written before the
            from ulacache_jax.cache.select.labels import resolve_bits      # labels' default still resume
            v = resolve_bits(v, args.key_channels)
        if v != default:
            if name == "channel_table" and v != "online":
                p = pathlib.Path(v)
                try:   # the table, not its name
                    v = hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.is_file() else v
                except OSError:
                    pass   # unreadable: _channel_table names the error
            settings[name] = file_identity(v) if name == "draft_model" else v
    return settings


def prepare_resume(args, fingerprint: str) -> batch_lines.ResumeState:
    """Read --output for --resume: refuse other settings (unless --force), repair a torn last line, drop error
    records a success supersedes, rewriting the file atomically if anything changed."""
    existing = jsonl_io.read_output(args.output)
    if existing.bad_lines and not args.force:
        ln = existing.bad_lines
        raise UsageError(f"--output {args.output}: line(s) {', '.join(map(str, ln[:5]))}{' ...' if len(ln) > 5 else ''}"
                         " are not result records (not a ulacache output?); --force drops them")
    other = existing.other_settings(fingerprint)
    if other and not args.force:
        fps = sorted({str(r.get(jsonl_io.SETTINGS_FIELD)) for r in other})
        raise UsageError(f"--resume: {len(other)} of the {len(existing.records)} records in {args.output} were made "
                         f"with other settings (fingerprint {', '.join(fps[:3])}; this run's is {fingerprint}: "
                         "model, dtype, sampling defaults, --max-context, --token-budget, --page-size, "
                         "--attention, key channels, labels, speculative decoding): rerun with the same options, or --force to mix them")
    kept = jsonl_io.compact(existing.records)
    if existing.torn_tail or existing.bad_lines or len(kept) != len(existing.records):
        jsonl_io.rewrite_output(args.output, kept)
        parts = []
        if existing.torn_tail:
            parts.append(f"a torn last line ({len(existing.torn_tail)} bytes) dropped")
        if existing.bad_lines:
            parts.append(f"{len(existing.bad_lines)} non-record lines dropped (--force)")
        if len(kept) != len(existing.records):
            parts.append(f"{len(existing.records) - len(kept)} superseded error records removed")
        print(f"ulacache: --resume: repaired {args.output}: {'; '.join(parts)}", file=sys.stderr)
    return batch_lines.resume_state(kept)


def finish_resume(args) -> None:
    """After a --resume run: the new successes supersede old error records; rewrite atomically if so."""
    existing = jsonl_io.read_output(args.output)
    kept = jsonl_io.compact(existing.records)
    if len(kept) != len(existing.records) or existing.torn_tail:
        jsonl_io.rewrite_output(args.output, kept)


def read_checkpoint(args, fingerprint: str):
    """--resume with --checkpoint-dir, before the model loads: the checkpoint to continue, or None (none there, or
    --force over one made with other settings)."""
    from ulacache_jax.runtime import checkpoint
    try:
        ck = checkpoint.read(args.checkpoint_dir)
    except checkpoint.CheckpointError as e:
        if "no complete checkpoint" in str(e):
            return None
        raise UsageError(f"--checkpoint-dir: {e}") from None
    theirs = ck.meta.get("settings")
    if theirs != fingerprint:
        if not args.force:
            raise UsageError(f"--checkpoint-dir {args.checkpoint_dir}: checkpoint {ck.path} was made with other "
                             f"settings (fingerprint {theirs}; this run's is {fingerprint}): rerun with the same "
                             "options, or --force to ignore it (its requests start over)")
        print(f"ulacache: --resume --force: checkpoint {ck.path} (other settings) ignored", file=sys.stderr)
        return None
    return ck


def checkpoint_fits(args, ck, longest: int) -> bool:
    """Whether the checkpoint's cache holds this run (--tp, the longest remaining request); else it is ignored."""
    cfg = ck.cache_config
    if cfg.tp != args.tp or cfg.max_context < longest:
        print(f"ulacache: --resume: checkpoint {ck.path} ignored: its cache (tp {cfg.tp}, context {cfg.max_context}) "
              f"does not hold this run (tp {args.tp}, longest request {longest} tokens)", file=sys.stderr)
        return False
    return True


def restore_checkpoint(engine, ck, records) -> dict:
    """Restore the checkpoint's queued and running requests whose input line is unchanged and not yet done ->
    {engine request id: (Record, choice)}; the other choices are added afresh by the caller (a choice of a
    line with n > 1 that finished before the run stopped was never written: it runs again)."""
    from ulacache_jax.runtime import checkpoint
    by_key = {r.unit_key(j): (r, j) for r in records for j in range(r.choices)}
    ids = ck.meta.get("ids") or {}
    restored, skip = {}, []
    for sr in ck.requests:
        rec, j = by_key.get(ids.get(str(sr.request_id)), (None, 0))
        ok = rec is not None and sr.status != "finished" and rec.prompt_ids == sr.prompt_ids
        if ok:
            want = rec.choice_sampling(j)
            if want.stop_ids is None:
                want = dataclasses.replace(want, stop_ids=engine.default_stop_ids)
            ok = checkpoint.sampling_params(sr.sampling) == want
        if ok:
            restored[sr.request_id] = (rec, j)
            del by_key[rec.unit_key(j)]
        else:
            skip.append(sr.request_id)
    try:
        engine.restore(ck.path.parent, skip=skip)
    except checkpoint.CheckpointError as e:
        raise UsageError(f"--checkpoint-dir: {e}") from None
    running = [engine.get(i) for i in restored if engine.get(i).status == "running"]
    print(f"ulacache: --resume: {len(running)} in-flight requests ({sum(len(r.tokens) for r in running)} tokens "
          f"generated) and {len(restored) - len(running)} queued ones restored from checkpoint {ck.path}",
          file=sys.stderr)
    return restored
