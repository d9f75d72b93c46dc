"""The quality / speed frontier of the selection rules (issue 48 item 3): every rule and budget the long-context
harness measured, placed by what it keeps of dense's answers against the bytes one decode step reads at the 8B
shape and, where a decode row of the same rule and budget ratio exists, its measured speed over dense.

    python -m scripts.frontier [--longctx docs/benchmarks/longctx.json]
        [--decode docs/benchmarks/decode.json docs/benchmarks/decode_variants.json] [--out docs/benchmarks]
        [--head-dim 64] [--name frontier] -> OUT/NAME.json, OUT/NAME.png
        [--also FILE:HEAD_DIM:LABEL[:MODEL] ...]
    (both models: --also docs/benchmarks/longctx100.json:128:Qwen2.5-Coder-1.5B:qwen2.5-coder-1.5b adds the 1.5B's
    cells of a harness file holding several models, its rows and outputs picked by their `model`)

Quality (per rule spec, context and budget, over the prompts of `longctx.json`'s outputs): `kept` = of the prompts
dense answers right (score 1), the share the rule answers right too, wholly (score 1: the issue's ">= 95% of the
answers dense gets right"), `kept_score` its mean score on them (partial credit: a multi-value answer's values
found), `accuracy` and `dense_accuracy`, `n` prompts and `n_dense_right`. A prompt answered in several runs counts
once (its last output).
Bytes (a decode step at the 8B shape, Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16, 128K x 3, at the cell's page
size): the rule's scorer (`SelectionRule.step_bytes`, channels scaled by the model's head_dim to 128: half of Qwen
0.5B's 64 is 64 of 128) + the selected K/V (the budget ratio of the context, plus a tail page) + the weights (16.06
GB), as a fraction of dense's (weights + every K/V). Speed: the tok/s of the newest decode row (128K x 3, the last
in the --decode files' order) of the same rule, channel fraction, bits, budget ratio, page size and page dtype (fp8
pages are another configuration) over the dense row of the same call (same `run` or `variant`, same device); its hit
rate and hot share (bench_decode --hot-share) are reported beside it, to be read against the rule's trace hit rate.
Rows without one have no speed.
"""
from __future__ import annotations

import argparse
import json
import os

from scripts.bench_longctx import row_page
from scripts.bench_meta import add_common_args, pyplot, run_meta, save_figure, write_json
from ulacache_jax.cache.select.key_copy import KeyCopy
from ulacache_jax.cache.select.labels import Labels
from ulacache_jax.cache.select.quest import Quest
from ulacache_jax.cache.select.two_stage import TwoStage

SHAPE = dict(num_layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=64)   # Llama-3.1-8B, bf16
CONTEXT, BATCH = 131072, 3
WEIGHT_BYTES = 16.06e9


def rule_object(name: str, channels: int, bits: int, two: int | None, budget_pages: int, first: int = 0,
                first_bits: int = 4):
    """The library's rule for a harness row's fields at the 8B shape (channels already scaled); first: a two-stage
    rule's first-stage label channels (scaled too; 0: Quest's bound) at first_bits."""
    rule = {"quest": lambda: Quest(), "key_copy": lambda: KeyCopy(channels=channels),
            "labels": lambda: Labels(channels=channels, bits=bits)}[name]()
    if not two:
        return rule
    return TwoStage(second=rule, keep_pages=two * budget_pages,
                    first=Labels(channels=first, bits=first_bits) if first else None)


def step_bytes(name: str, channels: int, bits: int, two: int | None, ratio: float | None, first: int = 0,
               first_bits: int = 4, page_size: int = SHAPE["page_size"]) -> dict:
    """Bytes of one decode step at the 8B shape, 128K x 3, with pages of page_size tokens (the harness cell's: a
    smaller page selects at a finer grain, and the labels' per-page scales cost more a token): scorer, selected
    K/V, weights, and the total as a fraction of dense's."""
    shape = dict(SHAPE, page_size=page_size)
    kv_token = shape["num_layers"] * shape["kv_heads"] * shape["head_dim"] * 2 * shape["itemsize"]
    dense = WEIGHT_BYTES + BATCH * CONTEXT * kv_token
    if name == "dense":
        return dict(scorer_gb=0.0, selected_gb=BATCH * CONTEXT * kv_token / 1e9, total_gb=dense / 1e9,
                    fraction_of_dense=1.0)
    budget = round(ratio * CONTEXT / page_size) * page_size
    rule = rule_object(name, channels, bits, two, budget // page_size, first, first_bits)
    scorer = BATCH * rule.step_bytes(context=CONTEXT, **shape)
    selected = BATCH * (budget + page_size) * kv_token
    total = WEIGHT_BYTES + scorer + selected
    return dict(scorer_gb=scorer / 1e9, selected_gb=selected / 1e9, total_gb=total / 1e9,
                fraction_of_dense=total / dense)


def page_dtype(kv_dtype):
    """None for pages stored in the model's own dtype (a decode row's None / 'auto', a harness row's model dtype),
    else the storage dtype's name (fp8 pages are another configuration, priced and timed apart)."""
    return None if kv_dtype in (None, "auto", "bfloat16", "float16", "float32") else kv_dtype


def rule_fields(rows: list[dict]) -> dict:
    """{spec: (rule, channels, label_bits, two_stage multiple or None, first-stage label channels and bits or 0,
    page size, page dtype)} as the harness's rows record them (bench_longctx.row_page; page_dtype names the pages'
    storage); the rows of the deleted page-group two-stage rule (two_stage [group, multiple]) are left out."""
    return {r["spec"]: (r["rule"], r["channels"], r["label_bits"], r.get("two_stage"), r.get("first_channels") or 0,
                        r.get("first_bits") or 0, row_page(r), page_dtype(r.get("kv_dtype")))
            for r in rows
            if not isinstance(r.get("two_stage"), list)}


def quality_cells(longctx: dict, model: str | None = None) -> list[dict]:
    """Per (spec, context, budget): kept share of dense's right answers, accuracy, n (module docstring). model: only
    the rows and outputs whose `model` is this (a harness file of several models; None: all)."""
    prompts = {p["id"]: p for p in longctx["prompts"]}
    mine = lambda x: model is None or x.get("model") == model
    fields = rule_fields([r for r in longctx["rows"] if mine(r)])
    last: dict = {}
    for o in filter(mine, longctx["outputs"]):            # later runs replace earlier outputs of one prompt
        last[(o["spec"], o["budget"], o["id"])] = o["score"]
    dense = {pid: s for (spec, _, pid), s in last.items() if spec == "dense"}
    cells: dict = {}
    for (spec, budget, pid), score in last.items():
        cells.setdefault((spec, prompts[pid]["context"], budget), []).append((pid, score))
    out = []
    for (spec, context, budget), scores in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2] or 0)):
        parsed = fields.get(spec)
        if parsed is None:
            continue
        right = [pid for pid, _ in scores if dense.get(pid) == 1.0]
        kept = [s for pid, s in scores if dense.get(pid) == 1.0]      # fractional on multi-value: values found
        out.append(dict(spec=spec, rule=parsed[0], channels=parsed[1], label_bits=parsed[2], two_stage=parsed[3],
                        first_channels=parsed[4], first_bits=parsed[5], page_size=parsed[6], page_dtype=parsed[7],
                        context=context, budget=budget,
                        budget_ratio=None if budget is None else budget / context, n=len(scores),
                        accuracy=sum(s for _, s in scores) / len(scores),
                        dense_accuracy=(sum(dense[pid] for pid, _ in scores if pid in dense)
                                        / max(1, sum(pid in dense for pid, _ in scores))),
                        n_dense_right=len(right),
                        kept=sum(k == 1.0 for k in kept) / len(kept) if kept else None,
                        kept_score=sum(kept) / len(kept) if kept else None))
    return out


def speed_of(cell: dict, head_dim: int, decode_rows: list[dict]):
    """(speedup over the same call's dense row, hit rate, device, commit) of the newest decode row at 128K x 3
    matching the cell's rule, channel fraction, bits, budget ratio, page size and page dtype, over the same call's
    dense row with pages in the model's dtype (at any page size: dense reads every key either way); None if there
    is none."""
    if cell["rule"] == "dense":
        return None
    chans = cell["channels"] * SHAPE["head_dim"] // head_dim
    first = cell.get("first_channels", 0) * SHAPE["head_dim"] // head_dim
    want_budget = round(cell["budget_ratio"] * CONTEXT)
    best = None
    for r in decode_rows:
        if r.get("attention") != "sparse" or r.get("context") != CONTEXT or r.get("batch") != BATCH:
            continue
        rule = r.get("rule") or ("labels" if r.get("label_bits") else "key_copy" if r.get("key_channels") else "quest")
        if rule == "two_stage":      # matched by its second stage (its channels and bits are that stage's)
            rule = r.get("second_rule")
        if (rule != cell["rule"] or (r.get("key_channels") or 0) != chans or (r.get("label_bits") or 0)
                != cell["label_bits"] or r.get("budget") != want_budget or bool(r.get("two_stage")) != bool(
                cell["two_stage"]) or (r.get("first_channels") or 0) != first
                or (r.get("first_bits") or 0) != cell.get("first_bits", 0)
                or (r.get("page") or SHAPE["page_size"]) != cell["page_size"]
                or page_dtype(r.get("kv_dtype")) != cell["page_dtype"]):
            continue
        call = (r.get("variant"), r.get("run"), r.get("device"))
        dense = [d for d in decode_rows if d.get("attention") == "dense" and d.get("context") == CONTEXT
                 and d.get("batch") == BATCH and (d.get("variant"), d.get("run"), d.get("device")) == call
                 and page_dtype(d.get("kv_dtype")) is None]
        if dense:
            best = dict(speedup=r["tokens_per_s"] / dense[-1]["tokens_per_s"], tokens_per_s=r["tokens_per_s"],
                        dense_tokens_per_s=dense[-1]["tokens_per_s"], hit_rate=r.get("hit_rate"),
                        hot_share=r.get("hot_share"), device=r.get("device"), commit=r.get("commit"))
    return best


def load_rows(path: str) -> list[dict]:
    with open(path) as fh:
        d = json.load(fh)
    return d["rows"] if isinstance(d, dict) else d


def plot(rows: list[dict], path: str) -> str:
    """Kept answers against bytes and speed, a colour per model (the rows' `model`), o 16K / s 32K."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    models = list(dict.fromkeys(r["model"] for r in rows))
    for ax, key, label in ((axes[0], "fraction_of_dense", "bytes a decode step / dense's (8B shape, 128K x 3)"),
                           (axes[1], "speedup", "decode tok/s / dense's, same call (8B shape, 128K x 3)")):
        for context, marker in ((16384, "o"), (32768, "s")):
            pts = [r for r in rows if r["context"] == context and r.get(key) is not None and r["kept"] is not None]
            for r in pts:
                ax.scatter(r[key], 100 * r["kept"], marker=marker, s=30, color=f"C{models.index(r['model'])}",
                           label=r["model"])
                ax.annotate(f"{r['spec'][:22]} {r['budget'] or ''}", (r[key], 100 * r["kept"]), fontsize=6)
        ax.axhline(95, color="k", ls=":", lw=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("% of dense's right answers kept (o 16K, s 32K)")
    axes[1].axvline(2.0, color="k", ls=":", lw=0.8)
    handles = {h.get_label(): h for h in axes[0].collections}                          # one legend entry a model
    axes[0].legend(handles.values(), handles.keys(), fontsize=7)
    fig.suptitle(f"Selection rules: quality ({', '.join(models)} needles) vs bytes and speed")
    return save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--longctx", default="docs/benchmarks/longctx.json")
    ap.add_argument("--decode", nargs="*", default=["docs/benchmarks/decode.json",
                                                     "docs/benchmarks/decode_variants.json"])
    ap.add_argument("--head-dim", type=int, default=64, help="head_dim of the model the harness ran (Qwen 0.5B: 64)")
    ap.add_argument("--model-label", default="Qwen2.5-Coder-0.5B", help="the harness's model, each row's `model`")
    ap.add_argument("--also", action="append", type=source_arg, default=[], metavar="FILE:HEAD_DIM:LABEL[:MODEL]",
                    help="another harness file's cells in the same JSON and plot: its model's head_dim, the rows' "
                         "`model` label and, for a file of several models, the `model` its rows and outputs carry")
    ap.add_argument("--name", default="frontier", help="output files NAME.json and NAME.png")
    return add_common_args(ap, files="NAME.json, NAME.png (--name, default frontier)")


def source_arg(text: str) -> tuple:
    """--also FILE:HEAD_DIM:LABEL[:MODEL] -> (file, head_dim, label, model or None)."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or not parts[1].isdigit() or int(parts[1]) < 1 or not parts[2]:
        raise argparse.ArgumentTypeError(f"--also {text!r} must be FILE:HEAD_DIM:LABEL[:MODEL] (HEAD_DIM an int >= 1)")
    return parts[0], int(parts[1]), parts[2], parts[3] if len(parts) == 4 else None


def main(argv=None):
    args = build_parser().parse_args(argv)
    decode_rows = [r for p in args.decode for r in load_rows(p)]
    rows = []
    for path, head_dim, label, model in [(args.longctx, args.head_dim, args.model_label, None), *args.also]:
        with open(path) as fh:
            longctx = json.load(fh)
        for cell in quality_cells(longctx, model):
            chans = cell["channels"] * SHAPE["head_dim"] // head_dim
            first = cell["first_channels"] * SHAPE["head_dim"] // head_dim
            row = dict(cell, model=label, channels_8b=chans, first_channels_8b=first,
                       **step_bytes(cell["rule"], chans, cell["label_bits"], cell["two_stage"], cell["budget_ratio"],
                                    first, cell["first_bits"] or 4, cell["page_size"]))
            row.update(speed_of(cell, head_dim, decode_rows) or {})
            rows.append(row)
    meta = run_meta(args.commit, sources=dict(longctx=args.longctx, also=[":".join(map(str, a)) for a in args.also],
                                              decode=args.decode), shape=SHAPE,
                    context=CONTEXT, batch=BATCH, weight_bytes=WEIGHT_BYTES)
    if not args.name or any(bad in args.name for bad in ("/", "\\", "..")):
        raise SystemExit(f"--name {args.name!r} must be a plain file stem (no '/', '\\' or '..'): files go in --out")
    write_json(os.path.join(args.out, f"{args.name}.json"), dict(meta=meta, rows=rows))
    plot(rows, os.path.join(args.out, f"{args.name}.png"))
    print(f"{'model':<20} {'context':>7} {'rule':<40} {'page':>4} {'budget':>6} {'n':>3} {'kept':>6} "
          f"{'bytes/dense':>11} {'speedup':>8}")
    for r in rows:
        kept = "-" if r["kept"] is None else f"{100 * r['kept']:.0f}%"
        sp = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
        print(f"{r['model'][:20]:<20} {r['context']:>7} {r['spec'][:40]:<40} {r['page_size']:>4} "
              f"{str(r['budget'] or '-'):>6} {r['n']:>3} {kept:>6} {r['fraction_of_dense']:>11.3f} {sp:>8}")
    return rows


if __name__ == "__main__":
    main()
