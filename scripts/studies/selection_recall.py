"""How much of the true attention each page-selection rule keeps, on a trained model's real queries and keys.

    python -m scripts.studies.selection_recall --model qwen2.5-coder-0.5b --contexts 4096 --prompts 3 \
        --out docs/studies
    python -m scripts.studies.selection_recall --tiny --contexts 256 --prompts 1 --out /tmp/r   # tests

A CPU-sized stand-in for the decode-path harness (scripts/bench_longctx.py) where no GPU is at hand: one dense
forward per prompt (a RULER-style needle prompt, chat-templated, scripts/ruler_tasks.py) records every layer's
post-RoPE keys and the query of the position that generates the answer's first token. For every layer and KV head
the true attention of that query (softmax over all keys, summed over the group's query heads) gives each page its
mass; each rule scores the flushed pages as the library does (the same functions: Quest's bound over the page
min/max, the key copy's and the labels' page mass through pallas_kernels.page_lse's reference, labels quantised by
select/labels.quantize), selects with quest.select_pages (the budget here also pays for the tail page), and its
**recall** is the true mass of the pages it attends (selected + the unflushed tail) over the total. Rows per
(rule, budget): mean recall over layers, heads and prompts, its 10th percentile, and the worst layer's mean.
Bytes a decode step's scorer reads per token of context (one KV head) are beside each rule: Quest 2 * D * 2 / page,
a key copy C * 2, labels C * bits / 8 + 2 * C * 2 / page (the bf16 scales).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from scripts import bench_meta


def dense_forward_fn(model, store):
    """The jitted dense forward fn(params, ids [1, T] int32, init) -> (cache, h [1, T, E] before the final norm):
    positions 0..T-1, blocked attention, `init` threaded through every layer's store(cache, q, k, v, layer) ->
    cache (q [1, T, H, D], k/v [1, T, KV, D], post-RoPE). One function compiles once per length, so a study that
    pads its prompts to a few lengths reuses it (dense_layers)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from ulacache_jax.models.attention import blocked_attention
    graphdef, _ = nnx.split(model)

    @jax.jit
    def run(params, ids, init):
        m = nnx.merge(graphdef, params)
        pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]

        def attn(cache, q, k, v, meta, layer):
            return store(cache, q, k, v, layer), blocked_attention(q, k, v, meta, meta)

        return m.run_layers(init, m.embed(ids), pos, pos, attn)

    return run


def dense_forward(model, ids, init, store):
    """dense_forward_fn's forward over ids [T], once: what the studies record from a prompt (record)."""
    import jax.numpy as jnp
    from flax import nnx
    _, params = nnx.split(model)
    return dense_forward_fn(model, store)(params, jnp.asarray(ids, jnp.int32)[None], init)


def record(model, ids, positions=None):
    """ids [T] -> (keys [L, T, KV, D] float32, queries), post-RoPE: the query [L, H, D] float32 of the last
    position, or with `positions` [A] those positions' queries [L, A, H, D] (needle_steps: every answer step)."""
    import jax.numpy as jnp
    L, KV = model.config.num_layers, model.config.num_kv_heads
    H, D = model.config.num_heads, model.config.head_dim
    T = len(ids)
    at = jnp.asarray([T - 1] if positions is None else positions, jnp.int32)

    def store(cache, q, k, v, layer):
        return (cache[0].at[layer].set(k[0].astype(jnp.float32)),
                cache[1].at[layer].set(q[0, at].astype(jnp.float32)))

    zero = (jnp.zeros((L, T, KV, D), jnp.float32), jnp.zeros((L, len(at), H, D), jnp.float32))
    (ks, qs), _ = dense_forward(model, ids, zero, store)
    return np.asarray(ks), np.asarray(qs)[:, 0] if positions is None else np.asarray(qs)


def page_truth(k, q, page: int):
    """k [T, D], q [h, D] (one KV head, its h query heads) -> (mass of each whole page [P], tail mass): the
    softmax over all T keys of each query head, summed over the heads / h."""
    D = k.shape[1]
    logits = (q @ k.T) / np.sqrt(D)                                                    # [h, T]
    p = np.exp(logits - logits.max(1, keepdims=True))
    p = (p / p.sum(1, keepdims=True)).mean(0)                                          # [T]
    P = k.shape[0] // page
    return p[:P * page].reshape(P, page).sum(1), p[P * page:].sum()


def shortlist_mask(k, q, page: int, keep_pages: int):
    """The first stage of a two-stage rule (select/two_stage.py), one KV head: Quest's bound over the flushed pages
    (the min / max of their keys) -> [P] bool the keep_pages pages of highest bound."""
    import jax.numpy as jnp
    from ulacache_jax.cache.select import two_stage
    P = k.shape[0] // page
    bound = rule_scores(("quest",), k, q, page)                                        # [P]
    pages, ok = two_stage.shortlist(jnp.asarray(bound, jnp.float32)[None, None], jnp.asarray([P], jnp.int32),
                                    keep_pages=keep_pages)
    mask = np.zeros(P, bool)
    mask[np.asarray(pages)[0, 0][np.asarray(ok)[0, 0]]] = True
    return mask


def rule_scores(rule, k, q, page: int, table_ch=None, cand=None):
    """Page scores [P] of one KV head's flushed pages, as the library computes them. rule: ('quest',),
    ('key_copy', C) or ('labels', C, bits, 'online' | 'table'); k [T, D]; q [h, D]. cand [P] bool: a two-stage
    shortlist, the only pages scored (-inf elsewhere; the page mass is normalised over them, as score_pages
    does)."""
    import jax.numpy as jnp
    from ulacache_jax.cache.select import key_copy, labels
    from ulacache_jax.pallas_kernels.page_lse import ref_page_lse
    T, D = k.shape
    P = T // page
    kp = k[:P * page].reshape(P, page, D)
    cand = np.ones(P, bool) if cand is None else cand
    if rule[0] == "quest":
        lo, hi = kp.min(1), kp.max(1)                                                  # [P, D]
        return np.where(cand, np.maximum(q[:, None] * lo[None], q[:, None] * hi[None]).sum((0, 2)), -np.inf)
    C = rule[1]
    kk = jnp.asarray(k[:P * page])[:, None]                                            # [T', 1, D]
    live = jnp.ones(P * page, bool)
    if rule[0] == "key_copy":
        ch = key_copy.pick_channels(kk, live, C)[0]
    elif rule[3] == "table":
        ch = jnp.asarray(table_ch, jnp.int32)
    else:
        ch = labels.pick_pairs(kk, live, C)[0]
    x = np.asarray(k[:P * page][:, np.asarray(ch)]).reshape(1, 1, 1, P, page, 1, C)     # [S, L, G, P, T, g, C]
    qc = (q[:, np.asarray(ch)] / np.sqrt(D)).reshape(1, 1, 1, q.shape[0], C)
    if rule[0] == "key_copy":
        lse = ref_page_lse(jnp.asarray(x), jnp.asarray(qc), layer=0)
    else:
        codes, scale = labels.quantize(jnp.asarray(x), rule[2])
        lse = ref_page_lse(codes, jnp.asarray(qc), layer=0, scale=scale, bits=rule[2])
    lse = np.where(cand[None], np.asarray(lse)[0, 0], -np.inf)                         # [h, P]
    w = np.exp(lse - lse.max(1, keepdims=True))
    return np.where(cand, (w / w.sum(1, keepdims=True)).sum(0), -np.inf)


def select(scores, budget_pages: int, sink: int = 1, recent: int = 2):
    """Page ids [<= K] the library's selection (quest.select_pages) keeps from scores [P] of the flushed pages.
    Here the budget also pays for the unflushed tail page (the decode attends it beside its K = budget pages), so K =
    budget_pages - 1 and one of the `recent` pages is that tail: every rule gets one page less than in the decode."""
    import jax.numpy as jnp
    from ulacache_jax.cache.select import quest
    keep = budget_pages - 1
    if keep < sink + recent - 1:
        raise ValueError(f"budget of {budget_pages} pages is below sink {sink} + recent {recent} (the tail among them)")
    ids = quest.select_pages(jnp.asarray(scores, jnp.float32)[None, None], jnp.asarray([len(scores)], jnp.int32),
                             select_pages=keep, sink_pages=sink, recent_pages=recent - 1)
    ids = np.asarray(ids)[0, 0]
    return np.sort(ids[ids >= 0])


def scorer_bytes(rule, D: int, page: int, shortlist: float = 1.0) -> float:
    """Bytes the scorer reads per context token and KV head each decode step; a two-stage rule reads Quest's page
    summaries and its second stage over the `shortlist` fraction of the context."""
    if rule[0] == "two":
        return scorer_bytes(("quest",), D, page) + scorer_bytes(rule[2], D, page) * shortlist
    if rule[0] == "quest":
        return 2 * D * 2 / page
    if rule[0] == "key_copy":
        return rule[1] * 2
    return rule[1] * rule[2] / 8 + 2 * rule[1] * 2 / page


def plot(rows, path: str) -> str:
    """Recall vs the scorer's bytes per token, one panel per (model, context, variant: merged runs apart), one
    marker colour per budget."""
    from scripts import bench_meta
    plt = bench_meta.pyplot()
    panels = sorted({(r["model"], r["context"], r.get("variant") or "") for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (model, ctx, variant) in zip(axes[0], panels):
        mine = [r for r in rows if (r["model"], r["context"], r.get("variant") or "") == (model, ctx, variant)]
        for b in sorted({r["budget"] for r in mine}):
            rs = sorted((r for r in mine if r["budget"] == b),
                        key=lambda r: r["scorer_bytes_per_token"])
            ax.plot([r["scorer_bytes_per_token"] for r in rs], [r["recall"] for r in rs], "o", label=f"budget {b}")
            for r in rs:
                name = r["rule"] + (f" {r['channels']}" if r["channels"] else "") + \
                    (f"@{r['label_bits']}b{' T' if r['calibration'] == 'table' else ''}" if r["label_bits"] else "") + \
                    (f" x{r['shortlist_mult']}" if r.get("shortlist_mult") else "")
                ax.annotate(name, (r["scorer_bytes_per_token"], r["recall"]), fontsize=5)
        ax.set_xscale("log")
        ax.set(title=f"{model}, {ctx} tokens{', ' + variant if variant else ''}",
               xlabel="scorer bytes / token / KV head", ylabel="attention recall")
        ax.legend(fontsize=7)
    return bench_meta.save_figure(fig, path)


def scoring(rule):
    """The rule that scores the pages it selects from: a two-stage rule's second stage, else the rule itself."""
    return rule[2] if rule[0] == "two" else rule


def parse_rule(s: str):
    parts = s.split(":")
    if parts[0] == "two":
        return ("two", int(parts[1]), parse_rule(":".join(parts[2:])))
    if parts[0] == "quest":
        return ("quest",)
    if parts[0] == "key_copy":
        return ("key_copy", int(parts[1]))
    if parts[0] == "labels":
        return ("labels", int(parts[1]), int(parts[2]), parts[3] if len(parts) > 3 else "online")
    raise SystemExit(f"--rules {s!r}: quest, key_copy:C, labels:C:BITS[:online|table] or two:MULT:<rule> "
                     "(Quest's page bound shortlists MULT x the budget for <rule>)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny random model and byte tokenizer (tests)")
    ap.add_argument("--task", default="niah_single")
    ap.add_argument("--haystack", default="essays")
    ap.add_argument("--contexts", default="4096")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per context (depths spread over 0.1-0.9)")
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--rules", default="quest,key_copy:16,key_copy:8,labels:8:8,labels:8:4,labels:8:4:table,"
                                       "labels:16:4,labels:16:4:table,labels:4:4")
    ap.add_argument("--name", default="selection_recall")
    # --out required: a study's rows go where the caller means them to (docs/studies when kept); the
    # default model is the 32K model whose label-channel tables ship (the rules ending in :table need one)
    return bench_meta.add_common_args(ap, out_required=True, files="NAME.json, NAME.png (--name)",
                                      model="qwen2.5-coder-0.5b")


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    import jax.numpy as jnp
    from flax import nnx
    from scripts import haystacks, ruler_tasks
    from ulacache_jax import models
    rules = [parse_rule(s) for s in args.rules.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if any(b % args.page_size for b in budgets):
        ap.error(f"--budgets {args.budgets} must be multiples of --page-size {args.page_size}")
    if args.tiny:
        model = models.LlamaModel(models.get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
        tok, label, tables = models.ByteTokenizer(), "tiny", None
        hay = haystacks.haystack_fn("noise", tok)
    else:
        path = models.resolve_model_path(args.model)
        model, tok = models.from_pretrained(str(path), dtype=jnp.float32), models.load_tokenizer(str(path))
        label = args.model
        from ulacache_jax.models import calibration
        tables = {scoring(r)[1]: calibration.channel_table(args.model, scoring(r)[1]) for r in rules
                  if scoring(r)[-1] == "table"}
        hay = haystacks.haystack_fn(args.haystack, tok)
    if any(scoring(r)[-1] == "table" for r in rules) and not tables:
        rules = [r for r in rules if scoring(r)[-1] != "table"]
    D, KV, H = model.config.head_dim, model.config.num_kv_heads, model.config.num_heads
    page = args.page_size
    res = bench_meta.Results(os.path.join(args.out, f"{args.name}.json"),
                             bench_meta.run_meta(args.commit, model=label, task=args.task, haystack=args.haystack,
                                                 page_size=page))
    recalls = {}                                                  # (rule, budget, context) -> [recall per layer/head]
    worst = {}
    t0 = time.perf_counter()
    for ctx in contexts:
        for i in range(args.prompts):
            depth = 0.1 + 0.8 * i / max(1, args.prompts - 1)
            pr = ruler_tasks.make(args.task, haystack_text_fn=hay, num_tokens=ctx - 64, depth=depth,
                                  seed=ruler_tasks.prompt_seed(0, args.task, ctx, i), tokenizer=tok)
            msgs = [{"role": "user", "content": pr.text}]
            ids = (list(tok.apply_chat_template(msgs, add_generation_prompt=True))
                   if hasattr(tok, "apply_chat_template") else list(tok.encode(pr.text)))
            ks, qs = record(model, ids)
            print(f"context {ctx} prompt {i}: {len(ids)} tokens recorded at {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
            for layer in range(model.config.num_layers):
                for g in range(KV):
                    k = ks[layer, :, g]
                    q = qs[layer, g * (H // KV):(g + 1) * (H // KV)]
                    mass, tail = page_truth(k, q, page)
                    total = mass.sum() + tail
                    for rule in rules:
                        inner = scoring(rule)
                        tab = None if inner[-1] != "table" else tables[inner[1]][layer][g]
                        sc = None if rule[0] == "two" else rule_scores(rule, k, q, page, tab)
                        for b in budgets:
                            if rule[0] == "two":
                                cand = shortlist_mask(k, q, page, rule[1] * (b // page - 1))
                                sc = rule_scores(inner, k, q, page, tab, cand)
                            sel = select(sc, b // page)
                            r = (mass[sel].sum() + tail) / total
                            recalls.setdefault((rule, b, ctx), []).append(r)
                            worst.setdefault((rule, b, ctx, layer), []).append(r)
    for (rule, b, ctx), rs in recalls.items():
        per_layer = [np.mean(v) for (r2, b2, c2, _), v in worst.items() if (r2, b2, c2) == (rule, b, ctx)]
        inner = scoring(rule)
        two = dict(shortlist_mult=rule[1]) if rule[0] == "two" else {}
        frac = min(1.0, rule[1] * b / ctx) if rule[0] == "two" else 1.0
        res.add(dict(model=label, rule=("two_stage/" if two else "") + inner[0],
                     channels=inner[1] if len(inner) > 1 else None,
                     label_bits=inner[2] if inner[0] == "labels" else None,
                     calibration=inner[3] if inner[0] == "labels" else None, **two, task=args.task, context=ctx,
                     budget=b, budget_ratio=b / ctx, page_size=page, prompts=args.prompts,
                     recall=float(np.mean(rs)), recall_p10=float(np.percentile(rs, 10)),
                     recall_worst_layer=float(min(per_layer)),
                     scorer_bytes_per_token=scorer_bytes(rule, D, page, frac)))
    res.save()
    plot(res.rows, os.path.join(args.out, f"{args.name}.png"))
    print(f"{'rule':<26}{'ctx':>6}{'budget':>7}{'recall':>8}{'p10':>7}{'worst L':>8}{'B/tok':>7}")
    for r in res.rows:
        name = r["rule"] + (f":{r['channels']}" if r["channels"] else "") + \
            (f":{r['label_bits']}:{r['calibration']}" if r["label_bits"] else "") + \
            (f" x{r['shortlist_mult']}" if r.get("shortlist_mult") else "")
        print(f"{name:<26}{r['context']:>6}{r['budget']:>7}{r['recall']:>8.3f}{r['recall_p10']:>7.3f}"
              f"{r['recall_worst_layer']:>8.3f}{r['scorer_bytes_per_token']:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
