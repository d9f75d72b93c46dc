"""Where multi-value answers are lost: how much of the true attention on each needle's page a selection rule keeps
at every step of writing the answer, on a trained model's real queries and keys.

    python -m scripts.studies.needle_steps --model qwen2.5-coder-0.5b --context 8192 --prompts 4 --page-size 16 \
        --budgets 256 --out docs/studies
    python -m scripts.studies.needle_steps --tiny --context 512 --prompts 1 --page-size 16 --budgets 64 --out /tmp/n

The long-context harness (scripts/bench_longctx.py) shows that on RULER's multi-value task the label rule at 1/32
writes the first one or two values and stops where dense writes all four, and that at a budget covering the context
its answers are dense's word for word: the loss is selection's. This study asks which step loses it. One dense
forward per prompt over the chat-templated prompt followed by the right answer ("v1, v2, v3, v4" and the end of
turn, teacher-forced) records every layer's post-RoPE keys and the queries of every answer position
(selection_recall.record). At each answer position, for every layer and KV head, the true attention of the
group's queries gives each page its mass (selection_recall.page_truth over the keys so far); each rule scores the
flushed pages as the library does (selection_recall.rule_scores) and selects within the budget
(selection_recall.select). For each needle (the page holding its value's tokens in the prompt), **needle recall** is
the true attention on that page in the selected set over the true attention on it, summed over layers and heads
(--by-layer: per layer, with attention_kept, the share of all the true attention the selected pages and the tail
hold: where attention is broad, a page budget keeps little of it whatever the rule).
Rows per (rule, budget, phase): phase `write j` = the positions that predict value j's tokens (recall of needle j's
page: is the page being copied from attended?), `after j` = the position that predicts what follows value j (a
separator or the end of the turn: the continue-or-stop decision; recall of the needles not yet written). The oracle
rule `mass` selects by the true page mass itself (the ceiling of any page selection at this budget).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from scripts import bench_meta
from scripts.studies import selection_recall as sr


def find(seq: list[int], sub: list[int], end: int) -> int:
    """The start of the last occurrence of sub in seq[:end] (a needle's value in the prompt), -1 if none."""
    for s in range(end - len(sub), -1, -1):
        if seq[s:s + len(sub)] == sub:
            return s
    return -1


def teacher_forced(tok, prompt_ids: list[int], answers) -> tuple[list[int], list[tuple[str, int, list[int]]]]:
    """prompt ids + the right answer "v1, v2, ..." + the end of turn -> (ids, steps): steps (phase, position,
    needle indices) name the positions that predict value j's tokens ('write j', needle j) and the one that predicts
    what follows value j ('after j', the needles not yet written; the last value's is the end of the turn)."""
    ids, steps = list(prompt_ids), []
    for j, value in enumerate(answers):
        piece = list(tok.encode((", " if j else "") + value, add_special_tokens=False))
        vals = list(tok.encode(value, add_special_tokens=False))
        start = len(ids) + len(piece) - len(vals)                     # value j's first token
        ids += piece
        steps += [(f"write {j + 1}", p, [j]) for p in range(start - 1, len(ids) - 1)]
        steps.append((f"after {j + 1}", len(ids) - 1, list(range(j + 1, len(answers)))))
    ids.append(tok.eos_ids[-1])                                       # the end of turn (SmolLM2 / Qwen: im_end)
    return ids, [s for s in steps if s[2]]


def plot(rows: list[dict], path: str) -> str:
    """Left: needle recall per answer phase, a line per (rule, budget) (rows summed over layers; a merged file's
    runs apart). Right, where rows per layer exist: attention_kept per layer, a line per (rule, budget, phase kind:
    writing a value or deciding to go on)."""
    plt = bench_meta.pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    summed = [r for r in rows if r.get("layer") is None and r["needle_recall"] is not None]
    phases = sorted({r["phase"] for r in summed}, key=lambda ph: (int(ph.split()[1]), ph.split()[0] != "write"))
    for key in dict.fromkeys((r.get("run"), r["rule"], r["budget"]) for r in summed):
        pts = {r["phase"]: r["needle_recall"] for r in summed if (r.get("run"), r["rule"], r["budget"]) == key}
        xs = [i for i, ph in enumerate(phases) if ph in pts]
        ax.plot(xs, [pts[phases[i]] for i in xs], "o-", label=" ".join(str(k) for k in key if k is not None))
    ax.set_xticks(range(len(phases)), phases, fontsize=7, rotation=45)
    ax.set(ylabel="true attention on needle pages kept", ylim=(0, 1.02))
    if summed:
        ax.legend(fontsize=6)
    per = [r for r in rows if r.get("layer") is not None]
    for key in dict.fromkeys((r["rule"], r["budget"], r["phase"].split()[0]) for r in per):
        by: dict = {}
        for r in per:
            if (r["rule"], r["budget"], r["phase"].split()[0]) == key:
                by.setdefault(r["layer"], []).append(r["attention_kept"])
        layers = sorted(by)
        ax2.plot(layers, [sum(by[x]) / len(by[x]) for x in layers], ".-", label=" ".join(map(str, key)))
    ax2.set(xlabel="layer", ylabel="share of all true attention kept", ylim=(0, 1.02))
    if per:
        ax2.legend(fontsize=6)
    return bench_meta.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny random model and byte tokenizer (tests)")
    ap.add_argument("--task", default="niah_multivalue", help="a task with several answers, each a needle's value")
    ap.add_argument("--haystack", default="essays")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=4, help="prompts (depths spread over 0.1-0.9)")
    ap.add_argument("--budgets", default="256")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rules", default="mass,quest,labels:32:4", help="mass (the true page mass: the oracle) or "
                    "selection_recall's rules (quest, key_copy:C, labels:C:BITS[:online|table])")
    ap.add_argument("--by-layer", action="store_true",
                    help="rows per layer too (layer = the index; default: summed over layers), each with the share of "
                         "the whole true attention the selection keeps there (attention_kept)")
    ap.add_argument("--name", default="needle_steps")
    return bench_meta.add_common_args(ap, out_required=True, files="NAME.json, NAME.png (--name)", model="qwen2.5-coder-0.5b")


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    import jax.numpy as jnp
    from flax import nnx
    from scripts import haystacks, ruler_tasks
    from ulacache_jax import models
    rules = [("mass",) if s == "mass" else sr.parse_rule(s) for s in args.rules.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    page = args.page_size
    if any(b % page or b // page < 4 for b in budgets):
        ap.error(f"--budgets {args.budgets} must be multiples of --page-size {page} of at least 4 pages (sink, "
                 "recent, the tail and one selected)")
    if any(r[0] == "two" or r[-1] == "table" for r in rules):
        ap.error(f"--rules {args.rules}: mass, quest, key_copy:C or labels:C:BITS[:online] (no two-stage or table)")
    if args.tiny:
        model = models.LlamaModel(models.get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
        tok, label = models.ByteTokenizer(), "tiny"
        hay = haystacks.haystack_fn("noise", tok)
    else:
        path = models.resolve_model_path(args.model)
        model, tok = models.from_pretrained(str(path), dtype=jnp.float32), models.load_tokenizer(str(path))
        label, hay = args.model, haystacks.haystack_fn(args.haystack, tok)
    KV, H, D = model.config.num_kv_heads, model.config.num_heads, model.config.head_dim
    if any(r[0] in ("key_copy", "labels") and not 0 < r[1] <= D for r in rules):
        ap.error(f"--rules {args.rules}: channels must be in [1, head_dim = {D}]")
    res = bench_meta.Results(os.path.join(args.out, f"{args.name}.json"),
                             bench_meta.run_meta(args.commit, model=label, task=args.task, haystack=args.haystack,
                                                 context=args.context, page_size=page))
    # keyed by (rule, budget, phase, layer; layer None unless --by-layer)
    kept, total = {}, {}                                   # true mass on the needles kept / in all
    att, att_n = {}, {}                                    # attention kept (--by-layer) / heads x steps summed
    t0 = time.perf_counter()
    for i in range(args.prompts):
        depth = 0.1 + 0.8 * i / max(1, args.prompts - 1)
        pr = ruler_tasks.make(args.task, haystack_text_fn=hay, num_tokens=args.context - 64, depth=depth,
                              seed=ruler_tasks.prompt_seed(0, args.task, args.context, i), tokenizer=tok)
        msgs = [{"role": "user", "content": pr.text}]
        prompt = (list(tok.apply_chat_template(msgs, add_generation_prompt=True))
                  if hasattr(tok, "apply_chat_template") else list(tok.encode(pr.text)))
        ids, steps = teacher_forced(tok, prompt, pr.answers)
        starts = [find(prompt, list(tok.encode(v, add_special_tokens=False)), len(prompt)) for v in pr.answers]
        if min(starts) < 0:
            raise SystemExit(f"prompt {i}: a value of {pr.answers} is not in the prompt's tokens")
        needle_page = [s // page for s in starts]
        ks, qs = sr.record(model, ids, [p for _, p, _ in steps])
        print(f"prompt {i}: {len(prompt)} + {len(ids) - len(prompt)} tokens, needle pages {needle_page}, "
              f"recorded at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        for a, (phase, pos, needles) in enumerate(steps):
            for layer in range(model.config.num_layers):
                for g in range(KV):
                    k = ks[layer, :pos + 1, g]
                    q = qs[layer, a, g * (H // KV):(g + 1) * (H // KV)]
                    mass, tail = sr.page_truth(k, q, page)
                    lkey = layer if args.by_layer else None
                    for rule in rules:
                        sc = mass if rule[0] == "mass" else sr.rule_scores(rule, k, q, page)
                        for b in budgets:
                            sel = set(sr.select(sc, b // page).tolist())
                            key = (rule, b, phase, lkey)
                            if args.by_layer:
                                att[key] = att.get(key, 0.0) + tail + float(sum(mass[p] for p in sel
                                                                                if p < len(mass)))
                                att_n[key] = att_n.get(key, 0) + 1
                            for n in needles:
                                m = mass[needle_page[n]] if needle_page[n] < len(mass) else 0.0
                                total[key] = total.get(key, 0.0) + m
                                kept[key] = kept.get(key, 0.0) + (m if needle_page[n] in sel else 0.0)
    for (rule, b, phase, layer), tot in sorted(total.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2],
                                                                             kv[0][3] or 0)):
        key = (rule, b, phase, layer)
        res.add(dict(model=label, rule=":".join(str(x) for x in rule), budget=b, budget_ratio=b / args.context,
                     page_size=page, phase=phase, prompts=args.prompts, needle_mass=tot,
                     needle_recall=kept[key] / tot if tot > 0 else None,
                     **({} if layer is None else dict(layer=layer, attention_kept=att[key] / att_n[key]))))
    res.save()
    plot(res.rows, os.path.join(args.out, f"{args.name}.png"))
    print(f"{'rule':<16}{'budget':>7} {'phase':<8}{'layer':>6}{'needle mass':>12}{'recall':>8}{'attn kept':>10}")
    for r in res.rows:
        rec = "-" if r["needle_recall"] is None else f"{r['needle_recall']:.3f}"
        ak = f"{r['attention_kept']:.3f}" if "attention_kept" in r else "-"
        print(f"{r['rule']:<16}{r['budget']:>7} {r['phase']:<8}{str(r.get('layer', '-')):>6}"
              f"{r['needle_mass']:>12.2f}{rec:>8}{ak:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
