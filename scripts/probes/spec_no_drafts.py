"""Probe: what a speculative device chunk costs a step where no slot drafts (the back-off's worst case), against
plain decode chunks, in one process.

The host's n-gram lookup finds drafts in a repetitive prompt (so the Engine starts device chunks), while the
chunk's own proposals (`ngram_device.propose`) are replaced by empty ones: every verification in a chunk is a
step with no drafts. Prints ms per decode step of the warm runs (the Engine timeline's records that did not
compile) for plain decoding and for ngram speculation, and the chunk counters. A chunk step should cost about a
plain step (one row a slot); before 0d1797a a chunk ended after its first verification, so each step paid a host
sync and K + 1 rows.

python scripts/probes/spec_no_drafts.py [--model GGUF] [--dtype float32] [--prompt 1100] [--reps 2]
(default: the tiny random model on CPU; on the H200, --model the SmolLM2 GGUF --dtype bfloat16)
"""
from __future__ import annotations

import argparse
import os
import sys



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GGUF / folder / preset for models.from_pretrained (default: "
                    "the tiny random model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", type=int, default=1100, help="prompt tokens (a repeated 40-token unit)")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--num-tokens", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (each the same prompt)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--methods", default="plain,ngram,ngram-free",
                    help="plain, ngram (the chunk's lookup run, its drafts emptied), ngram-free (no lookup)")
    ap.add_argument("--token-budget", type=int, default=256)
    args = ap.parse_args()
    import numpy as np
    import jax.numpy as jnp
    from flax import nnx
    from ulacache_jax.runtime.speculative import ngram as ngram_device
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    from ulacache_jax.models import LlamaModel, from_pretrained, get_preset
    from ulacache_jax.runtime.speculative.rules import SpecConfig

    real = ngram_device.propose

    def no_drafts(*a, **kw):          # the chunk's proposals, emptied (traced into the chunk program)
        drafts, nd = real(*a, **kw)
        return drafts, jnp.zeros_like(nd)

    def free_drafts(hist, hlen, k, *, num_tokens, ngram_max):  # empty proposals without the lookup's compare passes
        return jnp.zeros((hist.shape[0], num_tokens), jnp.int32), jnp.zeros_like(hlen)
    dtype = jnp.dtype(args.dtype)
    if args.model:
        model = from_pretrained(args.model, dtype=dtype)
    else:
        model = LlamaModel(get_preset("tiny"), dtype=dtype, rngs=nnx.Rngs(0))
    K = args.num_tokens
    cfg = default_cache_config(model.config, num_seqs=args.batch, max_tokens=args.prompt + args.max_new + 64,
                               page_size=args.page_size, token_budget=args.token_budget, dtype=dtype,
                               verify_rows=K + 1)
    rng = np.random.default_rng(3)
    unit = [int(t) for t in rng.integers(0, min(256, model.config.vocab_size), 40)]
    prompt = (unit * (args.prompt // 40 + 1))[:args.prompt]
    print(f"{'method':10s} {'rep':>3s} {'ms/step':>8s} {'steps':>5s} {'chunks':>6s} {'verifications':>13s}")
    # each method its own Generator, so its chunk program is traced with its own `propose`
    for name, spec, fn in (("plain", None, real), ("ngram", SpecConfig("ngram", K), no_drafts),
                           ("ngram-free", SpecConfig("ngram", K), free_drafts)):
        if name not in args.methods.split(","):
            continue
        ngram_device.propose = fn
        gen = Generator(model, cfg, attention="sparse")
        for rep in range(args.reps + 1):                 # rep 0 compiles
            eng = Engine(generator=gen, speculative=spec)
            eng.run([prompt] * args.batch, SamplingParams(max_new_tokens=args.max_new))
            recs = [r for r in eng.timeline if r.decode_steps and not r.decode_compiled]
            secs, steps = sum(r.decode_s for r in recs), sum(r.decode_steps for r in recs)
            sp = eng.spec
            print(f"{name:10s} {rep:3d} {1e3 * secs / max(steps, 1):8.2f} {steps:5d} "
                  f"{sp.chunks if sp else '':>6} {sp.steps if sp else '':>13}", flush=True)


if __name__ == "__main__":
    main()
