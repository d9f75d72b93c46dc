"""Probe: what Engine.save costs against the decode it interrupts, and what a restore (re-prefill) costs.

Why: `ulacache generate --checkpoint-dir` must stay within 5% of the run's time at its default interval (a save
once 20x the last save's duration has passed: the fewest steps that keep saving under 5%). One Engine runs a batch
to the end, saving after every step (each save timed); a step is one decode chunk of page_size tokens for every
running request, and the saves run between steps on the same thread, so the overhead of saving every N steps is
(median save) / (N x mean step). Steps that compiled something are left out of the mean; the first save also
computes the engine's identity (the weight digest), once per engine.
    python3 scripts/probes/checkpoint_overhead.py [--model smollm2-135m|tiny] [--requests 8] [--slots 4]
Prints one JSON line.
"""
import argparse
import json
import math
import pathlib
import sys
import tempfile
import time

import numpy as np



def load(name: str):
    """A random-weight preset (tiny, ...) or a model path / pretrained name (smollm2-135m), in float32."""
    from flax import nnx
    from ulacache_jax import models
    from ulacache_jax.models.pretrained import resolve_model_path
    try:
        return models.LlamaModel(models.get_preset(name), rngs=nnx.Rngs(0))
    except KeyError:
        pass
    import jax.numpy as jnp
    path = resolve_model_path(name)
    if models.find_gguf(path) is not None:
        return models.from_gguf(path, jnp.float32)
    if (path / "config.json").is_file():
        return models.from_pretrained(path, dtype=jnp.float32)
    return models.load(path, dtype=jnp.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens")
    ap.add_argument("--new", type=int, default=320, help="new tokens per request")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--every", type=int, nargs="*", default=[1, 4, 8, 16])
    a = ap.parse_args()
    from ulacache_jax.runtime.engine import Engine, SamplingParams

    model = load(a.model)
    ctx = a.prompt + a.new
    eng = Engine(model, attention="sparse", max_seqs=a.slots, max_context=ctx, page_size=a.page_size,
                 token_budget=4 * a.page_size)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    for _ in range(a.requests):
        eng.add_request([int(t) for t in rng.integers(1, vocab, a.prompt)],
                        SamplingParams(max_new_tokens=a.new, stop_ids=()))
    saves, steps = [], []
    with tempfile.TemporaryDirectory() as d:
        while eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            t1 = time.perf_counter()
            rec = eng.timeline[-1]
            if eng.has_unfinished():
                eng.save(d)
                saves.append(time.perf_counter() - t1)
            if not rec.compiled:
                steps.append(t1 - t0)
    step_s = float(np.mean(steps))
    save_s = float(np.median(saves[1:])) if len(saves) > 1 else float(saves[0])
    out = {"model": a.model, "requests": a.requests, "slots": a.slots, "page_size": a.page_size,
           "prompt": a.prompt, "new": a.new, "steps_timed": len(steps), "step_s": round(step_s, 4),
           "save_first_s": round(saves[0], 4), "save_median_s": round(save_s, 4),
           "overhead_pct": {n: round(100 * save_s / (n * step_s), 2) for n in a.every},
           "default_interval_steps": max(1, math.ceil(save_s / (0.05 * step_s)))}   # cli.CHECKPOINT_SHARE
    print(json.dumps(out))


if __name__ == "__main__":
    main()
