"""Data-parallel replicas across processes (ulacache_jax/app/distributed.py): two CPU processes on this machine, each
with two forced host devices running a TP = 2 replica over its half of the prompts, joined by
jax.distributed.initialize (coordinator on localhost, a free port). Process 0's output must equal greedy decoding
of each prompt by the model's full forward (the cache covers the context, so sparse attention is exact)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import numpy as np
import pytest

from device_env import forced_devices

from ulacache_jax.app.distributed import shard_range

NUM_PROCESSES, DEVICES_PER_PROCESS, MAX_NEW = 2, 2, 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _greedy_full_forward(model, prompt, n, stop_ids):
    import jax
    import jax.numpy as jnp

    ids, fwd = list(prompt), jax.jit(model.__call__)
    for _ in range(n):
        T = 1 << (len(ids) - 1).bit_length()           # padded to a power of two: causal, padding cannot leak
        t = int(jnp.argmax(fwd(jnp.asarray([ids + [0] * (T - len(ids))]))[0, len(ids) - 1]))
        ids.append(t)
        if t in stop_ids:
            break
    return ids[len(prompt):]


def test_shard_range_covers_every_item_once():
    for n in (0, 1, 5, 8, 13):
        for p in (1, 2, 3, 8):
            got = [i for r in range(p) for i in shard_range(n, r, p)]
            assert got == list(range(n))
            sizes = [len(shard_range(n, r, p)) for r in range(p)]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="process_id"):
        shard_range(4, 2, 2)


def test_two_processes_each_run_their_own_replica(tmp_path):
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (40, 52, 33, 61)]   # one prefill bucket
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "out.jsonl"
    port = _free_port()
    env = forced_devices(DEVICES_PER_PROCESS)
    procs = [subprocess.Popen([sys.executable, "-m", "ulacache_jax.app.distributed", "--coordinator", f"localhost:{port}",
                               "--num-processes", str(NUM_PROCESSES), "--process-id", str(i), "--tp", "2",
                               "--model", "tiny", "--dtype", "float32", "--input", str(inp), "--output", str(out),
                               "--max-new-tokens", str(MAX_NEW)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(NUM_PROCESSES)]
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    for i, (_, err) in enumerate(results):
        assert f"process {i}/{NUM_PROCESSES}: 2 of 4 prompts on 2 local device(s)" in err

    from ulacache_jax.app.model_loading import load_model
    model = load_model("tiny", "float32", 0).model
    stops = set(model.config.eos_token_ids)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == [f"p{i}" for i in range(len(prompts))]
    for rec, p in zip(lines, prompts):
        assert rec["ids"] == _greedy_full_forward(model, p, MAX_NEW, stops), rec["id"]
