"""What the per-request options cost a decode step: the same batch decoded with no option (the plain program),
with penalties (token counts [S, V] carried through the chunk), with logprobs (a top-k over the vocabulary a
step) and with a per-request token budget under the engine's (quest.limit_pages after the top-k). Median wall
time per step over full chunks that compiled nothing, one Engine per variant over one Generator (random weights).

    python -m scripts.probes.sampling_cost [--preset tiny] [--slots 4] [--prompt 100] [--new 257]
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
import jax.numpy as jnp
from flax import nnx

from ulacache_jax.models import LlamaModel, get_preset
from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generation import Generator, default_cache_config


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens (random ids)")
    ap.add_argument("--new", type=int, default=257, help="tokens generated per request")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=128, help="the engine's budget (the cap)")
    a = ap.parse_args(argv)
    mc = get_preset(a.preset)
    model = LlamaModel(mc, dtype=jnp.float32, rngs=nnx.Rngs(0))
    cfg = default_cache_config(mc, num_seqs=a.slots, max_tokens=a.prompt + a.new, page_size=a.page_size,
                               token_budget=a.token_budget)
    gen = Generator(model, cfg, attention="sparse")
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, mc.vocab_size, a.prompt))) for _ in range(a.slots)]
    half = max(a.token_budget // 2 // a.page_size, cfg.sink_pages + cfg.recent_pages) * a.page_size
    variants = {"plain": {}, "penalties": {"repetition_penalty": 1.2, "presence_penalty": 0.5},
                "logprobs": {"logprobs": 5}, f"budget {half}": {"token_budget": half}}
    for name, kw in variants.items():
        eng = Engine(generator=gen)
        eng.run(prompts, SamplingParams(max_new_tokens=a.new, **kw))
        t = [r.decode_s / r.decode_steps for r in eng.timeline
             if r.decode_steps == a.page_size and not r.decode_compiled]
        print(f"{name:12s} median step {1e3 * statistics.median(t):.3f} ms over {len(t)} chunks")


if __name__ == "__main__":
    main()
