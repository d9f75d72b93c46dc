"""Data-parallel replicas across hosts (DESIGN.md section 6): one process per host, each a full replica (TP over
its own devices: `generation.generate(..., tp=N)`), each decoding its own block of the prompts; `jax.distributed`
connects the processes only to share the results. TP never crosses a host (its psums want NVLink), and no collective runs
during decoding: a replica's step touches only its own devices, so replicas never wait for each other.

Launch on a cluster, one process per host (host 0 runs the coordinator; any free port):

    python -m ulacache_jax.app.distributed --coordinator HOST0:12345 --num-processes 4 --process-id $RANK \\
        --tp 8 --model /models/Llama-3.1-70B-Instruct --input prompts.jsonl --output results.jsonl

Under SLURM (srun, one task per node) or another environment that jax.distributed.initialize() detects, leave out
--coordinator/--num-processes/--process-id. Every process reads the same --input and takes prompts
[i*N/P, (i+1)*N/P); process 0 writes --output (one JSON line per prompt, in input order) after an allgather.
On CPU (tests) the same code runs with several local processes and forced host devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N); cross-process transfers use gloo there.

Greedy output does not depend on the process layout. Sampled output (temperature > 0) is seeded per process with
`seed + first prompt index`, so it is reproducible for one layout, not across layouts.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np
import jax

from ulacache_jax.runtime import generation
from ulacache_jax.runtime import tp as tp_mod
from ulacache_jax.app.model_loading import load_model


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None,
               initialization_timeout: int = 300) -> tuple[int, int]:
    """`jax.distributed.initialize` (once; a second call is a no-op) -> (process index, process count). Must run
    before anything else touches jax devices. With no arguments jax detects the cluster (SLURM, TPU, ...)."""
    if not _initialized():
        kw = dict(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
                  initialization_timeout=initialization_timeout)
        if local_device_ids is not None:
            kw["local_device_ids"] = local_device_ids
        jax.distributed.initialize(**kw)
    return jax.process_index(), jax.process_count()


def _initialized() -> bool:
    probe = getattr(jax.distributed, "is_initialized", None)
    if probe is not None:
        return bool(probe())
    from jax._src import distributed as _d   # jax versions without is_initialized
    return _d.global_state.client is not None


def shard_range(num_items: int, process_id: int, num_processes: int) -> range:
    """The contiguous block of items of one process: [i*N/P, (i+1)*N/P) (sizes differ by at most one)."""
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id = {process_id} must be in [0, num_processes = {num_processes})")
    return range(process_id * num_items // num_processes, (process_id + 1) * num_items // num_processes)


def gather_results(local: list[list[int]], shard: range, num_items: int, width: int) -> list[list[int]]:
    """Every process's token lists -> all of them, in item order, on every process (one allgather of a padded
    [num_items, width] int32 array: rows of other processes are -1). Collective: every process must call it."""
    from jax.experimental import multihost_utils

    mine = np.full((num_items, width), -1, np.int32)
    for i, toks in zip(shard, local):
        mine[i, :len(toks)] = toks
    every = np.asarray(multihost_utils.process_allgather(mine))        # [P, N, width]
    merged = every.max(axis=0)                                         # each row is filled by one process
    return [[int(t) for t in row if t >= 0] for row in merged]


def generate(model, prompt_ids, *, max_new_tokens: int, tp: int = 1, gather: bool = True, seed: int = 0,
             **kwargs) -> list[list[int]]:
    """Data-parallel `generation.generate(..., tp=tp)`: this process generates for its block of `prompt_ids`
    (every process passes the same list) on its own `tp` local devices. With gather=True (a collective: every process must call it) returns
    every prompt's tokens in order on every process; else only this process's block (`shard_range`)."""
    pid, n = jax.process_index(), jax.process_count()
    shard = shard_range(len(prompt_ids), pid, n)
    mine = [prompt_ids[i] for i in shard]
    local = generation.generate(model, mine, max_new_tokens=max_new_tokens, tp=tp, seed=seed + shard.start,
                            **kwargs) if mine else []
    if not gather:
        return local
    return gather_results(local, shard, len(prompt_ids), max_new_tokens)


# ---- command line -----------------------------------------------------------------------------------------------
def _read_prompts(path: str, tokenizer) -> tuple[list, list[list[int]]]:
    ids, prompts = [], []
    for n, line in enumerate(pathlib.Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "prompt_ids" in rec:
            p = [int(t) for t in rec["prompt_ids"]]
        elif "prompt" in rec and tokenizer is not None:
            p = list(tokenizer.encode(rec["prompt"]))
        else:
            raise ValueError(f"{path}:{n}: need 'prompt_ids' (or 'prompt' with a model that has a tokenizer)")
        ids.append(rec.get("id", n))
        prompts.append(p)
    return ids, prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ulacache_jax.app.distributed", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (omit where jax detects it)")
    ap.add_argument("--num-processes", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks within each host")
    ap.add_argument("--model", default=None, help="HF folder, ulacache checkpoint folder or preset (see `ulacache "
                    "generate --help`); default: the tiny preset with random weights")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--input", required=True, help='JSONL: {"id": ..., "prompt": "..."} or {"prompt_ids": [...]}')
    ap.add_argument("--output", required=True, help="JSONL written by process 0, one line per prompt in order")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)

    pid, n = initialize(args.coordinator, args.num_processes, args.process_id)
    # with --tp > 1 the model is made or loaded straight into its sharding over this host's first tp devices
    loaded = load_model(args.model, args.dtype, args.seed, tp_mod=tp_mod if args.tp > 1 else None, tp=args.tp)
    ids, prompts = _read_prompts(args.input, loaded.tokenizer)
    out = generate(loaded.model, prompts, max_new_tokens=args.max_new_tokens, tp=args.tp,
                   temperature=args.temperature, seed=args.seed, stop_ids=tuple(loaded.model.config.eos_token_ids))
    if pid == 0:
        with open(args.output, "w", encoding="utf-8") as f:
            for i, toks in zip(ids, out):
                rec = {"id": i, "ids": toks}
                if loaded.tokenizer is not None:
                    rec["text"] = loaded.tokenizer.decode(toks)
                f.write(json.dumps(rec) + "\n")
    print(f"process {pid}/{n}: {len(shard_range(len(prompts), pid, n))} of {len(prompts)} prompts on "
          f"{args.tp} local device(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
