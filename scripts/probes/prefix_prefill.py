"""Where a shared-prefix prefill spends its time (issue 24): on the H200 the SmolLM2 8K row of bench_prefix was
slower with sharing (sparse 91 s vs 34 s to the last answer, prefill 60 s vs 5.5 s) while on CPU sharing cuts
prefill 4x. Per mode (sparse, dense; sharing on): every prefill timed to completion (the first full, the rest
attaching the stored document), then one more warm round under jax.profiler with the top device ops by time;
and the copies of arrays of >= 1M elements in the compiled prefill programs (a copy of the host pool per layer
is what an unordered read beside an in-place write costs).
  python scripts/probes/prefix_prefill.py --model PATH.gguf [--doc 8192] [--questions 6] [--out DIR]
  python scripts/probes/prefix_prefill.py --preset llama-3.1-8b --doc 16384      (random weights and ids)
Prints one line per prefill and a table per mode; JSON to <out>/prefix_prefill.json."""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time


def big_copies(hlo: str, min_elems: int = 1 << 20) -> list[str]:
    """'name dtype[shape]' of each copy instruction of >= min_elems elements in a compiled module's text."""
    out = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+)\[([\d,]*)\](\{[^}]*\})? (copy|fusion|custom-call)\b", line)
        if m and m.group(3) and ("copy" in m.group(1) or m.group(5) == "copy"):
            n = 1
            for d in m.group(3).split(","):
                n *= int(d)
            if n >= min_elems:
                out.append(f"{m.group(1)} {m.group(2)}[{m.group(3)}]{m.group(4) or ''}")
    return out


def run(attention: str, args) -> dict:
    import jax
    import jax.numpy as jnp
    from bench_e2e import real_text_ids
    from scripts.profile_decode import load_device_events
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    from ulacache_jax.models import from_pretrained, load_tokenizer
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    if args.preset:
        import numpy as np
        from flax import nnx
        from ulacache_jax.models import LlamaModel, get_preset
        model = LlamaModel(get_preset(args.preset), dtype=dtype, rngs=nnx.Rngs(0))
        rng = np.random.default_rng(0)
        doc = rng.integers(0, model.config.vocab_size, args.doc).tolist()
        prompts = [doc + rng.integers(0, model.config.vocab_size, 20).tolist() for _ in range(args.questions)]
    else:
        model = from_pretrained(args.model, dtype=dtype)
        tok = load_tokenizer(args.model)
        doc = real_text_ids(tok, args.doc)
        prompts = [doc + tok.encode(f"\n\nQuestion: what does part {i} do?\nAnswer:") for i in range(args.questions)]
    cfg = default_cache_config(model.config, num_seqs=args.questions, max_tokens=args.doc + 128, page_size=64,
                               dtype=dtype, token_budget=512)
    gen = Generator(model, cfg, attention=attention)
    times = []
    orig = gen.prefill

    def timed(slot, prompt):
        t = time.perf_counter()
        out = jax.block_until_ready(orig(slot, prompt))
        times.append(time.perf_counter() - t)
        print(f"{attention} prefill {len(times)}: {times[-1]:.3f} s", flush=True)
        return out
    gen.prefill = timed
    copies = {}
    for name in ("prefill_layer", "prefill_layer_from"):     # the compiled text of each, at its first call
        f = getattr(gen.program, name)

        def first(*a, f=f, name=name):
            if name not in copies:
                try:
                    copies[name] = big_copies(f.lower(*a).compile().as_text())
                except Exception as e:  # noqa: BLE001 - the listing is a diagnostic; the timing goes on
                    copies[name] = [f"(no listing: {type(e).__name__}: {e})"]
            return f(*a)
        setattr(gen.program, name, first)
    eng = Engine(generator=gen, prefix_cache=True)
    errors = [r.error for r in eng.run(prompts, SamplingParams(max_new_tokens=2, stop_ids=())) if r.error]
    if errors:                               # the Engine reports a failed prefill as the request's error
        raise RuntimeError(f"{len(errors)} of {len(prompts)} requests failed; first: {errors[0]}")
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t = time.perf_counter()
            eng.run(prompts[:2], SamplingParams(max_new_tokens=2, stop_ids=()))
            warm = time.perf_counter() - t
        ev = load_device_events(d)
    from scripts.probes.regression_diff import op_name          # this folder's probe: one kernel's name across instances
    ops = collections.Counter()
    for e in ev:
        ops[op_name(e["name"])] += float(e["dur"])
    return dict(attention=attention, prefill_s=times, big_copies=copies, warm_round_s=warm, device_busy_us=sum(ops.values()),
                top_ops_us=ops.most_common(args.top))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a GGUF or Hugging Face folder (real text)")
    src.add_argument("--preset", help="a model preset with random weights (random ids)")
    p.add_argument("--doc", type=int, default=8192)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--modes", default="sparse,dense")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", default="out/prefix_prefill")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for mode in args.modes.split(","):
        r = run(mode, args)
        rows.append(r)
        print(f"== {mode}: prefills {' '.join(f'{t:.2f}' for t in r['prefill_s'])} s; warm round "
              f"{r['warm_round_s']:.2f} s, device busy {r['device_busy_us'] / 1e3:.1f} ms")
        for name, cs in r["big_copies"].items():
            print(f"   {name}: {len(cs)} big copies {cs[:6]}")
        for name, us in r["top_ops_us"]:
            print(f"   {us / 1e3:9.2f} ms  {name[:110]}")
        with open(os.path.join(args.out, "prefix_prefill.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
