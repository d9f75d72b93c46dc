"""HBM pages each tensor-parallel rank needs: head-sharded sparse slicing vs every rank replicating the union of all
heads' selections (DESIGN.md section 6, issue 9; the write-up claims a 57.1% smaller per-GPU footprint).

Run (CPU is enough, ~1 min):  python -m scripts.studies.tp_footprint --out docs/studies
Writes tp_footprint.json and tp_footprint.png to --out and prints a table.

Selection traces: for every decode step t and layer, the pages each KV-head group selects, computed by the
library's own selection (`selection.ref_page_scores` Quest bound over per-page key min/max, then
`selection.select_pages`: first `sink` and last `recent` flushed pages always, the rest by score, `budget` pages
per group). Two sources:
- "model": a Llama-shaped model with RANDOM weights (8 KV heads, GQA 4) run over a random byte sequence; q and k
  are read from its own forward pass (teacher-forced, so every position is a decode step).
- "synthetic": keys planted around per-head topic centres (the document is a run of topic segments; head g sees
  segment s as its own centre c[g, topic(s)]), queries of each head drifting between topics (a random walk:
  each step it moves toward its current target topic, and with probability `switch` picks a new target). With
  probability `shared` a head's target follows a global topic instead of its own (`--shared` sweeps it), so
  `shared` = 1 means every head reads the same region and head sharding saves least.

Footprints per rank r (owning groups A_r = [r*G/R, (r+1)*G/R)), in group-pages (one page of one KV-head group,
the unit of `page_bytes`), over the pages needed within a window of W steps (W = 1: one step's selection; W > 1:
what a cache must hold to serve W steps without refetching):
- replicated: the union U of all groups' selections, allocated for each local group: |U| * |A_r|;
- rank-sliced (the write-up's head-sharded slicing, a page frame holding all of a rank's heads):
  |union over g in A_r of S_g| * |A_r|;
- per-group (UlaCache-JAX: a page is per (layer, group), so a rank holds exactly its groups' pages):
  sum over g in A_r of |S_g|.
Reported: the per-rank maximum (what each GPU must provision), averaged over steps and layers, and the reduction
1 - sharded / replicated. Tail pages (the 2 unflushed ring pages per group) are the same in every scheme and not
counted.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from ulacache_jax.cache.select import quest as selection
from scripts.bench_meta import add_common_args, git_commit, write_json
from ulacache_jax.models import LlamaModel, ModelConfig
from ulacache_jax.models.attention import dense_attention

CLAIM = 0.571
TPS = (2, 4, 8)


# ---- selection -------------------------------------------------------------------------------------------------
def page_summaries(k, page: int):
    """k [T, KV, D] -> kmin, kmax [KV, P, 1, D] over complete pages (groups of one KV head)."""
    T, KV, D = k.shape
    P = T // page
    kp = k[:P * page].reshape(P, page, KV, D)
    return kp.min(axis=1).transpose(1, 0, 2)[:, :, None], kp.max(axis=1).transpose(1, 0, 2)[:, :, None]


@jax.jit
def _scores(q, kmin, kmax):
    """q [Tq, 1, H, D]; kmin/kmax [G, P, g, D] shared by every step -> [Tq, G, P]: selection.ref_page_scores
    without broadcasting the summaries to every step (checked against it in `select`)."""
    G, P, g, D = kmin.shape
    qpos, qneg = selection.fold_queries(q, G, g)                                          # [Tq, G, g, D]
    return (jnp.einsum("gpjd,tgjd->tgp", kmax.astype(jnp.float32), qpos)
            + jnp.einsum("gpjd,tgjd->tgp", kmin.astype(jnp.float32), qneg))


def select(q, k, positions, page: int, budget: int, sink: int, recent: int) -> np.ndarray:
    """Pages each group selects at each decode position: q [Tq, H, D] (the queries at `positions` [Tq]),
    k [T, KV, D] (one layer) -> [Tq, G, budget] page ids (-1 unused). A step at position t sees the t // page
    complete pages."""
    kmin, kmax = page_summaries(k, page)
    qs = jnp.asarray(q)[:, None]                                          # [Tq, 1, H, D]
    scores = _scores(qs, jnp.asarray(kmin), jnp.asarray(kmax))
    ref = selection.ref_page_scores(qs[:2], jnp.broadcast_to(kmin, (2,) + kmin.shape),
                                    jnp.broadcast_to(kmax, (2,) + kmax.shape))
    np.testing.assert_allclose(np.asarray(scores[:2]), np.asarray(ref), rtol=1e-4, atol=1e-4)
    flushed = jnp.asarray(positions // page, jnp.int32)
    return np.asarray(selection.select_pages(scores, flushed, select_pages=budget, sink_pages=sink,
                                             recent_pages=recent))


# ---- traces ----------------------------------------------------------------------------------------------------
def load_trace_model(args, rng):
    """(label, model, token ids [1, T]): --model (a checkpoint folder or preset, via the CLI's loader) over --text
    (tokenized) or random ids; by default a small random-weight model with 8 KV heads over random bytes."""
    T = args.model_context
    if args.model is None:
        mc = ModelConfig(architecture="llama", vocab_size=256, hidden_size=256, intermediate_size=512,
                         num_layers=args.model_layers, num_heads=32, num_kv_heads=8, head_dim=32,
                         rope_theta=10000.0, max_position_embeddings=T)
        model, tok, label = LlamaModel(mc, dtype=jnp.float32, rngs=nnx.Rngs(args.seed)), None, "model (random weights)"
    else:
        from ulacache_jax.app.model_loading import load_model
        loaded = load_model(args.model, "auto", args.seed)
        model, tok = loaded.model, loaded.tokenizer
        label = f"model {loaded.label}"
    if args.text and tok is not None:
        ids = list(tok.encode(open(args.text, encoding="utf-8").read()))
        if len(ids) < T:
            raise SystemExit(f"--text has {len(ids)} tokens, fewer than --model-context {T}")
        ids = np.asarray(ids[:T])
        label += ", text"
    else:
        ids = rng.integers(0, model.config.vocab_size, T)
        label += ", random ids" if args.model is not None else ""
    return label, model, jnp.asarray(ids, jnp.int32)[None]


def model_trace(args, rng) -> tuple[str, list[np.ndarray]]:
    """Per layer, the selection [Tq, G, budget] of the model over its token sequence (teacher-forced)."""
    label, model, ids = load_trace_model(args, rng)
    T, chunk, steps = args.model_context, 256, args.steps

    def attn(cache, q, k, v, pos, layer):
        outs = [dense_attention(q[:, s:s + chunk], k, v, pos[:, s:s + chunk], pos) for s in range(0, T, chunk)]
        return cache + [(q[0, T - steps:], k[0])], jnp.concatenate(outs, axis=1)

    pos = jnp.arange(T, dtype=jnp.int32)[None]
    fwd = nnx.jit(lambda m, ids: m.forward_with_cache([], ids, pos, pos, attn)[0])
    qk = fwd(model, ids)
    positions = np.arange(T - steps, T)
    return label, [select(np.asarray(q), np.asarray(k), positions, args.model_page, args.budget, args.sink,
                          args.recent) for q, k in qk]


def synthetic_trace(args, rng, shared: float, budget: int | None = None, layers: int | None = None):
    """Per layer (independent draws), the selection [Tq, G, budget] of planted-cluster keys by drifting queries.
    round(shared * G) of the heads track one global topic, the others a topic of their own each."""
    G, qpg, D, page, T = 8, 4, 64, args.page, args.context
    P, topics, steps = T // page, args.topics, args.steps
    out = []
    for _ in range(layers or args.synthetic_layers):
        centre = rng.standard_normal((G, topics, D)).astype(np.float32)   # head g's view of each topic
        seg = []                                                           # the document: topic segments
        while len(seg) < P:
            seg += [int(rng.integers(topics))] * int(rng.integers(1, 9))  # of 1..8 pages
        tok_topic = np.repeat(np.asarray(seg[:P]), page)
        k = centre[:, tok_topic].transpose(1, 0, 2) + rng.standard_normal((T, G, D), np.float32)
        follows = np.arange(G) < round(shared * G)
        target = rng.integers(topics, size=G)
        target[follows] = target[0]
        cur = centre[np.arange(G), target].copy()
        q = np.zeros((T, G * qpg, D), np.float32)
        for t in range(T - steps, T):
            glob = int(rng.integers(topics)) if rng.random() < args.switch else target[0]
            for g in range(G):
                if follows[g]:
                    target[g] = glob
                elif rng.random() < args.switch:
                    target[g] = int(rng.integers(topics))
                cur[g] += 0.3 * (centre[g, target[g]] - cur[g])            # drift toward the target topic
            q[t] = np.repeat(cur, qpg, axis=0) + rng.standard_normal((G * qpg, D), np.float32)
        positions = np.arange(T - steps, T)
        out.append(select(q[positions], k, positions, page, budget or args.budget, args.sink, args.recent))
    return out


# ---- footprints ------------------------------------------------------------------------------------------------
def footprints(sel: np.ndarray, tp: int, window: int) -> dict[str, float]:
    """sel [Tq, G, K] (one layer) -> mean over windows of the per-rank maximum group-pages, per scheme."""
    Tq, G, _ = sel.shape
    per = G // tp
    acc = {"replicated": [], "rank_sliced": [], "per_group": []}
    for t0 in range(0, Tq - window + 1, window):
        sets = [set(sel[t0:t0 + window, g].ravel().tolist()) - {-1} for g in range(G)]
        union = set().union(*sets)
        rep, rank, grp = [], [], []
        for r in range(tp):
            own = sets[r * per:(r + 1) * per]
            rep.append(len(union) * per)
            rank.append(len(set().union(*own)) * per)
            grp.append(sum(len(s) for s in own))
        acc["replicated"].append(max(rep))
        acc["rank_sliced"].append(max(rank))
        acc["per_group"].append(max(grp))
    return {k: float(np.mean(v)) for k, v in acc.items()}


def summarize(trace: list[np.ndarray], windows) -> dict:
    res = {}
    for w in windows:
        for tp in TPS:
            if trace[0].shape[1] % tp:          # fewer groups than ranks (a --model with < 8 KV heads)
                continue
            f = [footprints(s, tp, w) for s in trace]
            m = {k: float(np.mean([x[k] for x in f])) for k in f[0]}
            m["reduction_rank_sliced"] = 1 - m["rank_sliced"] / m["replicated"]
            m["reduction_per_group"] = 1 - m["per_group"] / m["replicated"]
            res[f"W{w}_TP{tp}"] = m
    # how different the heads' choices are: mean pairwise Jaccard overlap of two groups' one-step selections
    jac = []
    for s in trace:
        for t in range(0, s.shape[0], 8):
            sets = [set(s[t, g].tolist()) - {-1} for g in range(s.shape[1])]
            jac += [len(a & b) / len(a | b) for i, a in enumerate(sets) for b in sets[i + 1:] if a | b]
    res["mean_pairwise_jaccard"] = float(np.mean(jac))
    return res


def plot(results: dict, path: str, windows) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["traces"])
    schemes = (("reduction_per_group", "per-group pages (UlaCache-JAX)"),
               ("reduction_rank_sliced", "rank-sliced frames (write-up)"))
    panels = [(w, key, label) for w in windows for key, label in schemes]
    ncol = 3
    nrow = -(-(len(panels) + 1) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6 * ncol, 4.3 * nrow), squeeze=False)
    axes = axes.ravel()
    width = 0.8 / len(names)
    for ax, (w, key, label) in zip(axes, panels):
        for i, n in enumerate(names):
            vals = [100 * results["traces"][n].get(f"W{w}_TP{tp}", {}).get(key, np.nan) for tp in TPS]
            bars = ax.bar(np.arange(len(TPS)) + (i - (len(names) - 1) / 2) * width, vals, width, label=n)
            ax.bar_label(bars, fmt="%.0f", fontsize=6)
        ax.axhline(100 * CLAIM, color="k", ls="--", lw=1, label="write-up claim 57.1%")
        ax.set_xticks(np.arange(len(TPS)), [f"TP={tp}" for tp in TPS])
        ax.set_ylim(0, 100)
        ax.set_ylabel("per-rank HBM pages saved (%)")
        ax.set_title(f"{label}, window {w} step{'s' if w > 1 else ''}", fontsize=9)
    ax = axes[len(panels)]
    sweep = results["budget_sweep"]
    frac = [100 * v["selected_fraction"] for v in sweep.values()]
    for tp in TPS:
        line, = ax.plot(frac, [100 * v[f"TP{tp}"]["reduction_per_group"] for v in sweep.values()], "o-",
                        label=f"TP={tp} per-group")
        ax.plot(frac, [100 * v[f"TP{tp}"]["reduction_rank_sliced"] for v in sweep.values()], "s--",
                color=line.get_color(), alpha=0.6, label=f"TP={tp} rank-sliced")
    ax.axhline(100 * CLAIM, color="k", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("selected pages / context pages (%)")
    ax.set_ylabel("per-rank HBM pages saved (%)")
    ax.set_ylim(0, 100)
    ax.set_title("synthetic (half the heads share a topic), window 1: vs budget", fontsize=9)
    ax.legend(fontsize=6)
    for a in axes[len(panels) + 1:]:
        a.axis("off")
    handles, labels = axes[0].get_legend_handles_labels()
    (axes[len(panels) + 1] if len(axes) > len(panels) + 1 else fig).legend(handles, labels, loc="center",
                                                                          fontsize=9, title="bars")
    pr = results["params"]
    fig.suptitle(f"Head-sharded vs replicated-union HBM pages per rank, 8 KV-head groups. Synthetic: "
                 f"{pr['context']} tokens, page {pr['page']}; model (random weights): {pr['model_context']} "
                 f"tokens, page {pr['model_page']}; budget {pr['budget']} pages per group", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, out_default="docs/studies", files="tp_footprint.json, tp_footprint.png", model=None,
                    model_default_help="RANDOM weights (--model-layers layers); a --model's KV heads must be "
                                       "a multiple of 8 (kv_heads_per_group 1)")
    ap.add_argument("--context", type=int, default=65536, help="tokens of context (synthetic traces)")
    ap.add_argument("--page", type=int, default=64, help="page size (synthetic traces)")
    ap.add_argument("--model-context", type=int, default=8192, help="tokens of context (model trace)")
    ap.add_argument("--model-page", type=int, default=16, help="page size (model trace)")
    ap.add_argument("--budget", type=int, default=32, help="selected pages per group (token_budget / page)")
    ap.add_argument("--budget-sweep", default="8,16,32,64,128,256",
                    help="budgets (pages) for the synthetic shared=0.5 sweep at TP = 2/4/8, window 1")
    ap.add_argument("--sink", type=int, default=1)
    ap.add_argument("--recent", type=int, default=2)
    ap.add_argument("--steps", type=int, default=256, help="decode steps traced (the last positions)")
    ap.add_argument("--windows", default="1,16")
    ap.add_argument("--model-layers", type=int, default=2, help="layers of the default random-weight model")
    ap.add_argument("--text", default=None, help="a text file to run the --model over (default: random ids)")
    ap.add_argument("--synthetic-layers", type=int, default=4)
    ap.add_argument("--topics", type=int, default=64)
    ap.add_argument("--switch", type=float, default=0.05, help="per-step probability a head picks a new topic")
    ap.add_argument("--shared", default="0,0.5,1", help="fractions of heads tracking one global topic (a sweep)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    path = os.path.join(args.out, "tp_footprint.json")
    windows = [int(w) for w in args.windows.split(",")]
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    results = {
        "script": "scripts/studies/tp_footprint.py", "commit": args.commit or git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{jax.default_backend()} (footprints are counts, not timings)",
        "params": {k: v for k, v in vars(args).items() if k not in ("out", "commit")},
        "claim": {"reduction": CLAIM, "source": "reference/ulacache-breakdown.txt, Table 2 (unverified, see "
                  "SEED-ERRATA)"},
        "units": "group-pages (one page_size x kv_heads_per_group x head_dim page of K, and one of V) per rank: the "
                 "per-rank maximum, averaged over windows and layers",
        "traces": {},
    }
    # the JSON is rewritten after every trace and every budget of the sweep: a run cut short keeps what it counted
    label, trace = model_trace(args, rng)
    results["traces"][label] = summarize(trace, windows)
    write_json(path, results, indent=2)
    for s in (float(x) for x in args.shared.split(",")):
        results["traces"][f"synthetic shared={s:g}"] = summarize(synthetic_trace(args, rng, s), windows)
        write_json(path, results, indent=2)
    sweep = results["budget_sweep"] = {}   # synthetic, shared = 0.5, window 1
    for b in (int(x) for x in args.budget_sweep.split(",")):
        tr = synthetic_trace(args, rng, 0.5, budget=b, layers=2)
        sweep[str(b)] = {"selected_fraction": b / (args.context // args.page),
                         **{f"TP{tp}": summarize(tr, [1])[f"W1_TP{tp}"] for tp in TPS}}
        write_json(path, results, indent=2)
    plot(results, os.path.join(args.out, "tp_footprint.png"), windows)
    print(f"{'trace':26s} {'W':>3s} {'TP':>3s} {'replicated':>10s} {'rank-sliced':>11s} {'per-group':>9s} "
          f"{'saved(rank)':>11s} {'saved(group)':>12s}")
    for n, r in results["traces"].items():
        for w in windows:
            for tp in TPS:
                if f"W{w}_TP{tp}" not in r:
                    continue
                m = r[f"W{w}_TP{tp}"]
                print(f"{n:26s} {w:3d} {tp:3d} {m['replicated']:10.1f} {m['rank_sliced']:11.1f} {m['per_group']:9.1f} "
                      f"{100 * m['reduction_rank_sliced']:10.1f}% {100 * m['reduction_per_group']:11.1f}%")
        print(f"{n:26s} mean pairwise Jaccard of two groups' selections: {r['mean_pairwise_jaccard']:.3f}")
    print(f"({time.perf_counter() - t0:.0f} s; write-up claim: {100 * CLAIM:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
