"""Study: does attending every page in the first layers (Quest skips its first two layers) keep the needles that
page selection loses? Emulated through the library's per-request budgets, before any decode-path change:

one Engine per rule whose cache budget covers the whole context (`select_pages` = every page), each request limited
to `--budget` tokens (`SamplingParams.token_budget`: the rule's top pages up to that rank, sinks and recent pages
first: `selection.limit_pages`), except in layers < d, where the study drops the limit (`decode_layer.plan_layer`
called with budget None, wrapped here for the study only; each d re-traces the decode program). The selection at
d = 0 is the rule's own at that budget. Prompts come from `bench_longctx --make-prompts` (shared prefixes on: a
prompt is prefilled once per Engine, then attached for every d).

    python -m scripts.studies.dense_layers --prompts P.json --model qwen2.5-coder-0.5b --dtype float32 \\
        --page-size 16 --budget 128 --dense-layers 0,2 --rules quest,key_copy:16 --out DIR

Rows: rule, dense_layers, budget, page_size, context, task, depth, accuracy, same_as_dense, n, seconds.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from scripts import bench_longctx as bl
from scripts import ruler_tasks
from scripts.bench_meta import add_common_args, run_meta, write_json


def _limited_plan(original, dense_layers: int):
    """decode_layer.plan_layer with no per-request budget in layers < dense_layers."""
    def plan(state, host, layer, *a, budget=None, **kw):
        return original(state, host, layer, *a, budget=None if layer < dense_layers else budget, **kw)
    return plan


def run(args) -> dict:
    import jax
    from ulacache_jax.cache import decode_layer
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    model, tok = bl.load_model(args.model, args.dtype)
    prompts, _ = bl.read_prompt_file(args.prompts)
    ids = [bl.chat_ids(tok, p["text"]) for p in prompts]
    stop = bl.stop_ids_of(model, tok)
    max_new = max(p["max_new_tokens"] for p in prompts)
    longest = max(len(i) for i in ids) + max_new
    ctx = -(-longest // args.page_size) * args.page_size
    original = decode_layer.plan_layer
    res = dict(meta=run_meta(args.commit), rows=[])
    res["meta"].update(prompts=len(prompts), budget=args.budget, page_size=args.page_size)
    outs = {}
    try:
        for spec in ["dense"] + [r for r in args.rules.split(",") if r]:
            rule = bl.parse_rule(spec)
            base = default_cache_config(model.config, num_seqs=args.batch, max_tokens=ctx, page_size=args.page_size,
                                        token_budget=ctx, dtype=model.dtype)
            eng = Engine(generator=Generator(model, rule.cache_config(base), attention=rule.attention),
                         prefix_cache=rule.attention == "sparse")
            for d in ([None] if spec == "dense" else [int(x) for x in args.dense_layers.split(",")]):
                decode_layer.plan_layer = _limited_plan(original, d or 0)
                jax.clear_caches()      # the decode program re-traces with this d
                sp = SamplingParams(max_new_tokens=max_new, stop_ids=stop,
                                    token_budget=None if spec == "dense" else args.budget)
                t0 = time.perf_counter()
                reqs = eng.run(ids, sp)
                secs = time.perf_counter() - t0
                texts = [tok.decode(r.tokens) for r in reqs]
                outs[(spec, d)] = texts
                for task in sorted({p["task"] for p in prompts}):
                    sel = [i for i, p in enumerate(prompts) if p["task"] == task]
                    acc = [ruler_tasks.score(bl.as_prompt(prompts[i]), texts[i]) for i in sel]
                    same = [texts[i] == outs[("dense", None)][i] for i in sel]
                    res["rows"].append(dict(rule=spec, dense_layers=d, budget=None if spec == "dense" else args.budget,
                                            page_size=args.page_size, context=ctx, task=task,
                                            accuracy=float(np.mean(acc)), same_as_dense=float(np.mean(same)),
                                            n=len(sel), seconds=round(secs, 1)))
                write_json(f"{args.out}/{args.name}.json", res)
                allacc = np.mean([ruler_tasks.score(bl.as_prompt(p), t) for p, t in zip(prompts, texts)])
                print(f"{spec:<22} d={d} budget {args.budget}: accuracy {allacc:.3f} ({secs:.0f} s)", flush=True)
    finally:
        decode_layer.plan_layer = original
    return res


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="a bench_longctx --make-prompts file")
    ap.add_argument("--rules", default="quest", help="bench_longctx rule specs (no dense: it always runs first)")
    ap.add_argument("--budget", type=int, default=128, help="tokens a request attends per step")
    ap.add_argument("--dense-layers", default="0,2", help="comma list of d: layers < d attend every page")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--name", default="dense_layers")
    return add_common_args(ap, files="NAME.json (--name)", model=None, model_default_help=bl.DEFAULT_MODEL,
                           dtype="float32")


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.model = args.model or bl.DEFAULT_MODEL
    run(args)


if __name__ == "__main__":
    main()
