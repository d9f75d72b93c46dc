"""What bucketing costs in hit rate: PB-LRU (B buckets of S slots) against a global LRU (B = 1, the same code)
and Belady's optimal policy (fully associative, capacity = pool, clairvoyant), on page-selection traces.

    python -m scripts.studies.eviction_study [--out docs/benchmarks] [--trace TRACE.npz] [--name eviction] [--clock row]

Pools hold 1/4, 1/8 and 1/16 of the trace's distinct pages; slots per bucket sweep from 8 upward to the whole
pool (B = 1). Hit rates are over all requests after a warm-up (--warmup steps). Runs on CPU with the jnp
reference (`pb_lru.ref_access`; the Pallas sieve is bit-identical to it). Writes eviction.json and eviction.png
(`--name` changes the stem) and prints a markdown table.

Trace (SYNTHETIC unless --trace is given): `synthetic_trace` below. Each (sequence, layer, KV-group) stream owns
`pages` pages whose key summaries are planted around `clusters` centroids, in runs of consecutive pages
("topics"); its query drifts (a small random step per decode step) and now and then jumps to another centroid;
each step every stream selects its sink page, its recent pages and the top pages by the score q . k (a stand-in
for the Quest bound) up to `budget` pages, so selected pages recur across steps while the query stays near a
topic. One step's batch is all streams' selected pages as LIDs, in stream order.
--trace loads real selection traces instead: an .npz with `lids` (uint64 [steps, N]) and optional `valid` (bool
[steps, N]), e.g. dumped from the model's generate loop (rerun then, and label the result as real).
`scripts/selection_trace.py` writes such traces from the library's own decode path; their optional `label`
(e.g. "random-weight model trace") names the source in the outputs, and their optional `clock` [steps] (the
cache clock the library stamped each sieve call with) is used as PB-LRU's `now` with `--clock trace`; the
default, `--clock row`, stamps row t with t, as for the synthetic trace.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

from scripts.bench_meta import add_common_args, git_commit, write_json
from ulacache_jax.cache import pb_lru


def synthetic_trace(seed=0, seqs=16, layers=2, groups=2, pages=256, clusters=12, dim=32, budget=32, sink=1,
                    recent=2, steps=240, drift=0.15, jump=0.03, topic_run=16, noise=0.6):
    """([steps, seqs*layers*groups*budget] uint64 LIDs, total pages of the KV cache) (see the module docstring).
    Page p's LID uses token p * 64 (page size 64)."""
    rng = np.random.default_rng(seed)
    streams = [(s, l, g) for s in range(seqs) for l in range(layers) for g in range(groups)]
    keys, queries, lids = [], [], []
    for s, l, g in streams:
        cent = rng.standard_normal((clusters, dim))
        cent /= np.linalg.norm(cent, axis=1, keepdims=True)
        topic = np.repeat(rng.integers(0, clusters, -(-pages // topic_run)), topic_run)[:pages]
        k = cent[topic] + noise * rng.standard_normal((pages, dim)) / np.sqrt(dim)
        keys.append(k)
        queries.append((cent, cent[rng.integers(clusters)].copy()))
        lids.append((np.uint64(s) << np.uint64(44)) | (np.uint64(l) << np.uint64(36)) | (np.uint64(g) << np.uint64(32))
                    | (np.arange(pages, dtype=np.uint64) * np.uint64(64)))
    fixed = np.r_[np.arange(sink), np.arange(pages - recent, pages)]
    out = np.empty((steps, len(streams) * budget), np.uint64)
    for t in range(steps):
        row = []
        for i in range(len(streams)):
            cent, q = queries[i]
            if rng.random() < jump:
                q = cent[rng.integers(len(cent))].copy()
            q = q + drift * rng.standard_normal(q.shape) / np.sqrt(q.size)
            q /= np.linalg.norm(q)
            queries[i] = (cent, q)
            score = keys[i] @ q
            score[fixed] = -np.inf
            top = np.argpartition(-score, budget - len(fixed))[:budget - len(fixed)]
            row.append(lids[i][np.r_[fixed, top]])
        out[t] = np.concatenate(row)
    return out, len(streams) * pages


def words(x):
    return (jnp.asarray((x >> np.uint64(32)).astype(np.uint32)), jnp.asarray((x & np.uint64(0xFFFFFFFF)).astype(np.uint32)))


def pblru_hit_rate(trace, valid, nb, ns, warmup, clock=None):
    state = pb_lru.init(nb, ns)
    hits = total = 0
    for t in range(trace.shape[0]):
        hi, lo = words(trace[t])
        now = t if clock is None else int(clock[t])
        state, out = pb_lru.ref_access(state, hi, lo, jnp.asarray(valid[t]), jnp.int32(now))
        if t >= warmup:
            hits += int(out.hit.sum())
            total += int(valid[t].sum())
    return hits / max(total, 1)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, files="NAME.json, NAME.png (--name)")
    ap.add_argument("--trace", default=None, help=".npz with lids [steps, N] uint64 (and valid); default synthetic")
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--min-slots", type=int, default=8)
    ap.add_argument("--name", default="eviction", help="stem of the output files (NAME.json, NAME.png)")
    ap.add_argument("--clock", choices=("row", "trace"), default="row",
                    help="PB-LRU stamps: the row index, or the trace's own `clock` (needs --trace)")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.clock == "trace" and not args.trace:
        ap.error("--clock trace needs --trace")
    t0 = time.time()
    if args.trace:
        data = np.load(args.trace)
        trace = data["lids"].astype(np.uint64)
        valid = data["valid"].astype(bool) if "valid" in data else np.ones(trace.shape, bool)
        distinct = len(np.unique(trace[valid]))
        total_pages = int(data["total_pages"]) if "total_pages" in data else distinct
        label = str(data["label"]) if "label" in data else "real selection trace"
        source = f"{label} {os.path.basename(args.trace)}"
        if args.clock == "trace":
            if "clock" not in data:
                raise SystemExit(f"--clock trace: {args.trace} has no `clock`")
            clock = data["clock"].astype(np.int64)
            source += " (PB-LRU stamps: the library's cache clock)"
    else:
        trace, total_pages = synthetic_trace()
        valid = np.ones(trace.shape, bool)
        distinct = len(np.unique(trace[valid]))
        source = "SYNTHETIC (scripts/studies/eviction_study.py synthetic_trace, default parameters)"
    if args.clock == "row":
        clock = np.arange(trace.shape[0])
    # pools hold 1/4, 1/8, 1/16 of the KV cache's pages (rounded down to a power of two so B = pool / S is one)
    pools = {frac: 1 << max(3, int(np.floor(np.log2(total_pages / frac)))) for frac in (4, 8, 16)}
    meta = dict(source=source, steps=int(trace.shape[0]), requests_per_step=int(trace.shape[1]),
                total_pages=int(total_pages), distinct_pages_requested=int(distinct), warmup_steps=args.warmup,
                clock=args.clock, jax=jax.__version__,
                device=jax.devices()[0].device_kind, commit=args.commit or git_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(), command=" ".join(sys.argv))
    if args.trace and "meta" in data:
        meta["trace_meta"] = json.loads(str(data["meta"]))
    results = []
    path = os.path.join(args.out, f"{args.name}.json")
    for frac, pool in pools.items():
        glob = pblru_hit_rate(trace, valid, 1, pool, args.warmup, clock)
        opt = pb_lru.belady_hit_rate(trace, valid, pool, args.warmup)
        rows = []
        s = args.min_slots
        while s <= pool:
            nb = pool // s
            hr = glob if nb == 1 else pblru_hit_rate(trace, valid, nb, s, args.warmup, clock)
            rows.append(dict(slots=s, buckets=nb, hit_rate=hr))
            s *= 2
        within = [r for r in rows if r["hit_rate"] >= glob - 0.01]
        best = min(within, key=lambda r: r["slots"]) if within else None
        res = dict(pool_fraction=f"1/{frac}", pool_frames=pool, global_lru=glob, belady=opt, sweep=rows,
                   smallest_slots_within_1pt=None if best is None else best["slots"],
                   buckets_at_that=None if best is None else best["buckets"])
        results.append(res)
        write_json(path, dict(meta=meta, results=results))   # after every pool: a cut run keeps the pools done
        print(f"pool 1/{frac} ({pool} frames): global LRU {glob:.4f}, Belady {opt:.4f}, "
              + ", ".join(f"S={r['slots']}:{r['hit_rate']:.4f}" for r in rows), flush=True)
    meta["seconds"] = round(time.time() - t0, 1)
    write_json(path, dict(meta=meta, results=results))
    plot(results, meta, os.path.join(args.out, f"{args.name}.png"))
    print(f"\nTrace: {source}; {meta['steps']} steps x {meta['requests_per_step']} requests over a KV cache of "
          f"{total_pages} pages ({distinct} ever selected); hit rates after {args.warmup} warm-up steps.\n")
    print("| pool (of the KV pages) | frames | global LRU (B = 1) | Belady (optimal) | PB-LRU at S = 8 | "
          "smallest S within 1 pt of global LRU (B) | PB-LRU there | gap to Belady there |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        at8 = r["sweep"][0]["hit_rate"]
        s = r["smallest_slots_within_1pt"]
        there = next(x for x in r["sweep"] if x["slots"] == s)["hit_rate"]
        print(f"| {r['pool_fraction']} | {r['pool_frames']} | {100 * r['global_lru']:.1f}% | {100 * r['belady']:.1f}% "
              f"| {100 * at8:.1f}% | {s} ({r['buckets_at_that']}) | {100 * there:.1f}% | "
              f"{100 * (r['belady'] - there):.1f} pt |")


def plot(results, meta, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r, color in zip(results, ("tab:blue", "tab:orange", "tab:green")):
        xs = [x["slots"] for x in r["sweep"]]
        ax.plot(xs, [100 * x["hit_rate"] for x in r["sweep"]], "-o", color=color,
                label=f"PB-LRU, pool {r['pool_fraction']} ({r['pool_frames']} frames)")
        ax.axhline(100 * r["belady"], color=color, ls=":", lw=1)
        ax.plot([xs[-1]], [100 * r["global_lru"]], "s", color=color, ms=9, mfc="none")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("slots per bucket S (rightmost point: B = 1, global LRU, square)")
    ax.set_ylabel("hit rate (%)")
    label = "SYNTHETIC trace" if meta["source"].startswith("SYNTHETIC") else meta["source"]
    sep = " " if meta["source"].startswith("SYNTHETIC") else "\n"   # a long trace label goes on its own line
    ax.set_title(f"PB-LRU hit rate vs slots per bucket; dotted: Belady optimal{sep}({label})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
