"""Why do dense passkey answers on the H200 differ between bench_quality calls of the same prompts? (issue 19: 4K
dense 57% in one call, 69% in another, same seed and prompts.)

Two suspects: the wave (which prompts share a decode batch and the cache's max_tokens, both set by the other
contexts of the call) and float32 matmul precision (JAX computes float32 dots with TF32 on recent GPUs unless told
otherwise, and which kernel XLA picks depends on the batch shape). This runs the 4K passkey prompts dense twice
per precision, as bench_quality's call with 4K alone would (sorted by length, cache sized for 4K) and as one with
8K prompts beside them would (shuffled, cache sized for 8K), and prints each run's accuracy and how many answers
differ between the two layouts. On CPU both layouts agree (true float32).

    python scripts/probes/wave_precision.py --model smollm2.gguf [--precisions default,highest] [--out JSON]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np



def main(argv=None):
    import jax
    from scripts import bench_quality as bq
    import ulacache_jax
    from ulacache_jax.runtime.generation import default_cache_config
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--keys", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precisions", default="default,highest")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    args = argparse.Namespace(tiny=False, small=False, model=a.model, dtype="float32")
    model, tok, _ = bq.load_model(args)
    text, _ = bq.stdlib_text()
    ids = np.asarray(tok.encode(text, add_special_tokens=False), np.int32)
    grid = dataclasses.replace(bq.GRIDS["full"], contexts=(a.context,), keys=a.keys)
    prompts = bq.passkey_prompts(tok, ids, grid, 0)
    eos = bq.eos_of(model, tok)
    order_sorted = sorted(range(len(prompts)), key=lambda i: len(prompts[i]["ids"]))
    order_mixed = list(np.random.default_rng(1).permutation(len(prompts)))
    layouts = {"alone": (order_sorted, a.context + grid.max_new),
               "beside 2x": (order_mixed, 2 * a.context + grid.max_new)}
    rows = []
    for prec in a.precisions.split(","):
        answers = {}
        for name, (order, max_tokens) in layouts.items():
            cc = default_cache_config(model.config, num_seqs=a.batch, max_tokens=max_tokens, page_size=64,
                                      token_budget=1024, dtype="float32")
            t0 = time.time()
            with jax.default_matmul_precision(None if prec == "default" else prec):
                out = ulacache_jax.generate(model, [prompts[i]["ids"] for i in order], max_new_tokens=grid.max_new,
                                            cache_config=cc, attention="dense", stop_ids=eos)
            res = [None] * len(prompts)
            for j, i in enumerate(order):
                res[i] = list(out[j])
            answers[name] = res
            acc = float(np.mean([str(p["key"]) in tok.decode(r) for p, r in zip(prompts, res)]))
            rows.append(dict(precision=prec, layout=name, max_tokens=max_tokens, accuracy=acc,
                             seconds=round(time.time() - t0, 1)))
            print(json.dumps(rows[-1]), flush=True)
        diff = sum(x != y for x, y in zip(*answers.values()))
        rows.append(dict(precision=prec, answers_differing=diff, of=len(prompts)))
        print(json.dumps(rows[-1]), flush=True)
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, context=a.context, prompts=len(prompts))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    print("| precision | layout | accuracy | answers differing |\n|---|---|---|---|")
    for r in rows:
        if "layout" in r:
            print(f"| {r['precision']} | {r['layout']} (cache {r['max_tokens']}) | {100 * r['accuracy']:.0f}% | |")
        else:
            print(f"| {r['precision']} | | | {r['answers_differing']} of {r['of']} |")


if __name__ == "__main__":
    main()
