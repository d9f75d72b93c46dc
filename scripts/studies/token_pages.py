"""Over how many pages do per-token selection's chosen tokens spread? Pages a step would have to fetch if it read only
the pages holding a chosen token, against the shortlist it fetches today.

    python -m scripts.studies.token_pages --model qwen2.5-coder-0.5b --text austen.txt --window 8192 \
        --budget 256 512 --shortlist 0 2 4 --out docs/studies                              # CPU, ~minutes
    python -m scripts.studies.token_pages --tiny --out /tmp/t                              # tests

Per-token selection (CacheConfig.token_shortlist = M) sends M x the budget's pages to the sieve and the fetch each
step and attends only the budget's tokens among them; on an H100 at 128K x 3 the step grows with those pages (M = 2:
1.05x dense where pages of 16 give 1.53x; docs/BENCHMARKS.md). Fetching only the pages that hold a chosen token
would cut that work by the share of the shortlist no chosen token falls in; the library's token_fetch (deleted) capped
the pages instead and lost quality, which suggested the chosen tokens spread over most of the shortlist. This counts
it. One window of the text is prefilled densely; the queries of its last `queries` positions (every `stride`-th) and
the keys before each are scored per layer and KV head by the labels' estimate (dense_layers.label_logits, the
library's quantiser) or the true logits (--label-channels 0); dense_layers.token_keep picks the budget's tokens
(sink, recent and tail pages whole) from every flushed token (--shortlist 0) or from the M x budget pages of largest
mass; the flushed pages holding a chosen token (sink and recent ones included, the tail not: it is never fetched)
are counted, as a multiple of the budget's pages (1.0: the tokens fill whole pages; M: they touch every shortlisted
page), and the chosen keys' recall (the true attention mass on them) is reported beside, so page sizes and
shortlists can be compared on what they keep as well as on what they fetch (--shortlist 1 is whole-page selection).
Positions are prefill positions, so no decode step runs: the same keys and queries a teacher-forced decode would
see, without its cost.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import types

import numpy as np

from scripts import bench_meta
from scripts.studies.dense_layers import CACHE_UNIT, label_logits, make_prefill, text_study_inputs, token_keep


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default="austen", help="bench_quality's --text: pydoc, austen, essays, or a text file")
    p.add_argument("--window", type=int, default=8192, help="tokens of the one window prefilled")
    p.add_argument("--queries", type=int, default=256, help="the last positions of the window whose queries count")
    p.add_argument("--stride", type=int, default=8, help="every stride-th of those positions")
    p.add_argument("--page-size", type=int, nargs="+", default=[16])
    p.add_argument("--budget", type=int, nargs="+", default=[256], help="tokens a layer attends a step")
    p.add_argument("--shortlist", type=int, nargs="+", default=[0, 2, 4],
                   help="0: the tokens chosen among every flushed token; M >= 1: among the M x budget pages of "
                   "largest mass")
    p.add_argument("--label-channels", type=int, default=32, help="0: the true logits rank the tokens")
    p.add_argument("--label-bits", type=int, default=4, choices=(0, 4, 8))
    p.add_argument("--sink", type=int, default=1)
    p.add_argument("--recent", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="random tiny model and byte text (tests)")
    p.add_argument("--run", default="", help="a label for this run in the JSON")
    return bench_meta.add_common_args(p, out_required=True, files="token_pages.json (each call appends a run), "
                                      "token_pages.png",
                                      model="qwen2.5-coder-0.5b", dtype="float32")


def check_args(a) -> None:
    for pg in a.page_size:
        if pg < 1 or pg % 16 and a.label_channels:
            raise SystemExit(f"--page-size {pg} must be >= 1 (a multiple of 16 with labels: their scale group)")
    if a.queries < 1 or a.stride < 1 or a.queries >= a.window:
        raise SystemExit(f"--queries {a.queries} must be in 1..--window {a.window} - 1, --stride {a.stride} >= 1")
    for m in a.shortlist:
        if m < 0:
            raise SystemExit(f"--shortlist {m} must be 0 (every flushed token) or a multiple M >= 1 of the budget")
    for b, pg in ((b, pg) for b in a.budget for pg in a.page_size):
        if b < 1 or b % pg or b // pg <= a.sink + a.recent or b >= a.window - a.queries:
            raise SystemExit(f"--budget {b} must be a multiple of --page-size {pg} with more than --sink {a.sink} + "
                             f"--recent {a.recent} pages, and below the positions before the queries "
                             f"({a.window - a.queries})")
    if a.label_channels < 0 or a.label_channels % 2:
        raise SystemExit(f"--label-channels {a.label_channels} must be 0 (the true logits) or a positive even count")


def pages_touched(chosen, pos, *, page: int):
    """chosen bool [KV, T] (token_keep's keys), pos [] int32 -> int32 [KV]: flushed pages (the ones a step selects
    and fetches; the sink and recent ones are chosen whole) holding at least one chosen token."""
    import jax.numpy as jnp
    KV, T = chosen.shape
    flushed = jnp.arange(T // page) < pos // page                                    # [npg]
    held = chosen.reshape(KV, T // page, page).any(-1)                                # [KV, npg]
    return (held & flushed[None]).sum(-1).astype(jnp.int32)


def make_counter(model, total: int, a, configs: list):
    """-> count(K [T, KV, D], q [H, D], pos) -> (int32 [n, KV] pages_touched, float32 [n, KV] recall) of one layer's
    choice at one position under each of the n `configs` ((page, budget, shortlist) each). Recall: the true attention
    mass (softmax over the visible keys, mean over the KV head's query heads) on the keys chosen. One program scores
    the keys once (the labels' estimate, or the true logits) for every configuration."""
    import jax
    import jax.numpy as jnp
    D = model.config.head_dim

    @jax.jit
    def count(K, q, pos):
        KVh = K.shape[1]
        qg = q.reshape(KVh, -1, D)                                                    # [KV, g, D]
        seen = jnp.arange(total) <= pos
        true = jnp.where(seen[None, None], jnp.einsum("kgd,tkd->kgt", qg, K) / np.sqrt(D), -jnp.inf)
        s = true if not a.label_channels else jnp.where(
            seen[None, None], label_logits(qg, K, pos, channels=a.label_channels, bits=a.label_bits), -jnp.inf)
        p = jax.nn.softmax(true, axis=-1)                                             # [KV, g, T]
        touched, recall = [], []
        for page, budget, shortlist in configs:
            chosen = token_keep(s, pos, page=page, budget=budget, sink=a.sink, recent=a.recent, shortlist=shortlist)
            touched.append(pages_touched(chosen, pos, page=page))
            recall.append((p * chosen[:, None]).sum(-1).mean(-1))                     # [KV]
        return jnp.stack(touched), jnp.stack(recall)
    return count


def summarize(counts: np.ndarray, budget_pages: int, shortlist: int, recall: np.ndarray) -> dict:
    """counts [n] pages touched, recall [n] (one per layer, KV head and position) -> the row's statistics, the
    counts as multiples of the budget's pages (what whole-page selection fetches; a shortlist of M fetches M of
    them)."""
    x = counts / budget_pages
    return {"n": int(counts.size), "recall_mean": float(recall.mean()), "recall_p10": float(np.quantile(recall, 0.1)),
            "mean_x_budget": float(x.mean()), "p10_x_budget": float(np.quantile(x, 0.1)),
            "p50_x_budget": float(np.median(x)), "p90_x_budget": float(np.quantile(x, 0.9)),
            "max_x_budget": float(x.max()),
            "share_of_shortlist": float(x.mean() / shortlist) if shortlist else None}


def plot(runs: list, path: str) -> str:
    """Pages holding a chosen token (mean, p10-p90 as the bar's error, clipped at the mean: the mean of a skewed
    count can lie outside them) per run, budget and shortlist."""
    plt = bench_meta.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels, x = [], 0
    for run in runs:
        for r in run["rows"]:
            m = r["mean_x_budget"]
            err = [[max(0.0, m - r["p10_x_budget"])], [max(0.0, r["p90_x_budget"] - m)]]
            ax.bar(x, m, yerr=err, color="C0" if r["shortlist"] else "C1", capsize=2)
            labels.append(f"{run['run'] or run['rule']}\np{r.get('page_size', run.get('page_size'))} "
                          f"b{r['budget']} " + (f"{r['shortlist']}x" if r["shortlist"] else "all"))
            x += 1
    ax.set_xticks(range(len(labels)), labels, fontsize=5, rotation=90)
    ax.set_ylabel("pages holding a chosen token / budget's")
    ax.set_title("Per-token selection: pages a step would fetch (blue: shortlist M, orange: every token)", fontsize=8)
    return bench_meta.save_figure(fig, path)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    check_args(a)
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from scripts import bench_quality
    path = os.path.join(a.out, "token_pages.json")
    data = bench_meta.earlier_runs(path)
    model, tok, text_ids, source = text_study_inputs(a)
    if a.label_channels > model.config.head_dim:
        raise SystemExit(f"--label-channels {a.label_channels} is more than the model's head_dim "
                         f"{model.config.head_dim}")
    grid = types.SimpleNamespace(ppl_window=a.window, ppl_prefix=a.window - a.queries, ppl_windows=1)
    ids = bench_quality.ppl_windows(tok, text_ids, grid)[0]
    unit = int(np.lcm.reduce([CACHE_UNIT, 16, *a.page_size]))
    total = -(-len(ids) // unit) * unit
    _, params = nnx.split(model)
    t0 = time.time()
    (ck, _), _, qw = make_prefill(model, a.queries)(params, ids, total)             # qw [L, Q, H, D]
    jax.block_until_ready((ck, qw))                  # dispatch is asynchronous: time the prefill, not its launch
    print(f"prefill {len(ids)} tokens: {time.time() - t0:.1f} s", flush=True)
    L = model.config.num_layers
    first = len(ids) - a.queries                                                     # position of qw[:, 0]
    js = list(range(a.queries - 1, -1, -a.stride))[::-1]                             # the last position included
    rule = f"labels {a.label_channels} @ {a.label_bits}" if a.label_channels else "true logits"
    run = {"meta": bench_meta.run_meta(a.commit), "run": a.run, "model": "tiny" if a.tiny else a.model,
           "dtype": a.dtype, "text": source, "window": len(ids), "positions": [first + j for j in js],
           "page_sizes": a.page_size, "rule": rule, "sink": a.sink, "recent": a.recent, "rows": []}
    data["runs"].append(run)
    configs = [(pg, b, m) for pg in a.page_size for b in a.budget for m in a.shortlist]
    count = make_counter(model, total, a, configs)
    got = []
    for layer in range(L):
        got += [count(ck[layer, 0], qw[layer, j], jnp.int32(first + j)) for j in js]
        print(f"[{time.time() - t0:6.0f}s] layer {layer + 1}/{L} counted", flush=True)
    n_pages = np.stack([np.asarray(g[0]) for g in got], axis=1).reshape(len(configs), -1)   # [n, L * pos * KV]
    recall = np.stack([np.asarray(g[1]) for g in got], axis=1).reshape(len(configs), -1)
    for i, (pg, budget, m) in enumerate(configs):
        row = {"page_size": pg, "budget": budget, "budget_ratio": budget / len(ids), "shortlist": m,
               "budget_pages": budget // pg, **summarize(n_pages[i], budget // pg, m, recall[i])}
        run["rows"].append(row)
        print(f"[{time.time() - t0:6.0f}s] page {pg} budget {budget} shortlist {m or 'every token'}: pages holding a "
              f"chosen token {row['mean_x_budget']:.2f}x the budget's (p10 {row['p10_x_budget']:.2f}, p90 "
              f"{row['p90_x_budget']:.2f})" + (f", {100 * row['share_of_shortlist']:.0f}% of the shortlist"
                                               if m else "") + f"; recall {row['recall_mean']:.4f}", flush=True)
    bench_meta.write_json(path, data)
    plot(data["runs"], os.path.join(a.out, "token_pages.png"))
    print(f"| {rule} | page | budget | pages holding a chosen token / budget's (mean, p10-p90) | "
          f"share of the shortlist | recall (mean, p10) |\n|---|---|---|---|---|---|")
    for r in run["rows"]:
        sl = f"{100 * r['share_of_shortlist']:.0f}%" if r["shortlist"] else "-"
        print(f"| {'tokens in ' + str(r['shortlist']) + 'x pages' if r['shortlist'] else 'every token'} | "
              f"{r['page_size']} | {r['budget']} | {r['mean_x_budget']:.2f} ({r['p10_x_budget']:.2f}-"
              f"{r['p90_x_budget']:.2f}) | {sl} | {r['recall_mean']:.4f} ({r['recall_p10']:.4f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
