"""Per-op device-time diff of one sparse decode chunk between two source trees (a regression hunt).

`trace`: run inside one tree (PYTHONPATH = the tree, cwd = the tree): the sparse row of that tree's
`scripts/bench_decode.py` (its `bench_config` and `synthetic_fill_sparse`, Llama-3.1-8B shape, random bf16
weights, `DecodeOptions()` = bench_decode's defaults), one warm-up chunk (compile), `--chunks` chunks timed
without the profiler (wall time per step, as bench_decode times it), then one chunk of `page_size` decode steps
under `jax.profiler.trace` (per-step numbers are that chunk's totals / page_size). Only the
`Generator` / `bench_decode` entry points that both trees share are used, so one driver serves old and new.
Writes a summary JSON: per normalised kernel name its launches, device time and the idle gap before its launches;
the chunk's busy / idle / span time; the launches of one middle layer in order.
`diff`: two such JSONs -> a per-op table (per decode step, all layers) and per-step totals, printed and written.
`--tiny` (CPU check): the tiny preset, 1K context, budget 256 (the CPU trace has host events, not kernels).
Device command: see regression_profile.sh.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time


def op_name(name: str) -> str:
    """A kernel name without XLA's per-instance numeric suffixes (loop_add_fusion_103 -> loop_add_fusion,
    sort_980_1_ -> sort, quest_page_scores_12 -> quest_page_scores), so one kernel matches across trees and layers."""
    return re.sub(r"([._]\d+)+[._]?$", "", name).rstrip("._") or name


def device_events(trace_dir: str) -> list[tuple[str, float, float]]:
    """(name, ts_us, dur_us) of the device events of a jax.profiler perfetto trace (profile_decode's reader, this
    checkout's: it imports nothing from the library, so it serves both trees), sorted by start."""
    from scripts.profile_decode import load_device_events
    ev = [(e["name"], float(e["ts"]), float(e["dur"])) for e in load_device_events(trace_dir)]
    return sorted(ev, key=lambda e: e[1])


def summarize(ev: list[tuple[str, float, float]], steps: int, layers: int) -> dict:
    """ev: one chunk's events sorted by start. Per op (normalised name): launches, device us and the idle gap
    before its launches (us, summed); the chunk's busy (union of intervals), idle and span us; one middle layer."""
    ops = collections.defaultdict(lambda: dict(launches=0, us=0.0, gap_us=0.0))
    busy, end, gaps = 0.0, (ev[0][1] if ev else 0.0), []
    for name, ts, dur in ev:
        gap = max(0.0, ts - end)
        s, t = max(ts, end), ts + dur
        busy += max(0.0, t - s)
        end = max(end, t)
        o = ops[op_name(name)]
        o["launches"] += 1
        o["us"] += dur
        o["gap_us"] += gap
        gaps.append(gap)
    span = end - ev[0][1] if ev else 0.0
    per = steps * layers
    layer = []
    marks = [n for n, o in ops.items() if o["launches"] == per]   # ops launched exactly once per layer-step
    if marks:
        mark = max(marks, key=lambda n: ops[n]["us"])
        idx = [i for i, e in enumerate(ev) if op_name(e[0]) == mark]
        mid = (steps // 2) * layers + layers // 2                  # a middle layer of a middle step
        lo, hi = idx[mid - 1] + 1, idx[mid] + 1
        layer = [dict(name=op_name(n), us=d, gap_us=g) for (n, _, d), g in zip(ev[lo:hi], gaps[lo:hi])]
    return dict(ops=dict(ops), busy_us=busy, idle_us=span - busy, span_us=span, events=len(ev), layer=layer)


def trace(args) -> dict:
    tree = os.path.abspath(args.tree)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    import ulacache_jax
    if not os.path.abspath(ulacache_jax.__file__).startswith(tree + os.sep):
        raise SystemExit(f"ulacache_jax imported from {ulacache_jax.__file__}, not from --tree {tree}: "
                         "run with PYTHONPATH=<tree>")
    from ulacache_jax.cache.state import raise_host_limit
    if not args.tiny:
        raise_host_limit()      # before JAX starts: bench_decode's main does the same
    import dataclasses
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from scripts import bench_decode as bd
    from ulacache_jax.cache.decode_layer import DecodeOptions
    from ulacache_jax.runtime.generation import Generator
    from ulacache_jax.models import LlamaModel, get_preset
    from ulacache_jax.runtime.sampling import SamplingArrays, row_keys
    if args.tiny:
        mc, ctx, budget = get_preset("tiny"), 1024, 256
    else:
        mc, ctx, budget = dataclasses.replace(get_preset("llama-3.1-8b"), num_layers=args.layers), args.context, \
            args.budget
    batch, t0 = args.batch, time.perf_counter()
    model = LlamaModel(mc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    ns = argparse.Namespace(chunks=args.chunks, budget=budget)
    cfg = bd.bench_config(mc, "sparse", batch, ctx, ns, args.kv_fraction)
    gen = Generator(model, cfg, attention="sparse", options=DecodeOptions())
    slots = [gen.admit(ctx + (args.chunks + 1) * cfg.page_size) for _ in range(batch)]
    bd.synthetic_fill_sparse(gen.cache, slots, ctx, seed=batch, chunk=32768)
    jax.block_until_ready((gen.cache.state, gen.cache.host))
    setup_s = time.perf_counter() - t0
    S = cfg.max_seqs
    tok, done = jnp.zeros(S, jnp.int32), jnp.arange(S) >= batch
    rem, sampling, stops = jnp.full(S, 1 << 30, jnp.int32), SamplingArrays.fill(S), jnp.asarray([-1], jnp.int32)
    keys = lambda i: row_keys(jnp.arange(S, dtype=jnp.uint32), jnp.full(S, i, jnp.uint32))
    t = time.perf_counter()
    jax.block_until_ready(gen.decode_chunk(tok, done, rem, keys(0), sampling, stops))      # compile + warm
    compile_s = time.perf_counter() - t
    walls = []
    for i in range(args.chunks):            # as bench_decode times them: wall per chunk / page_size
        t = time.perf_counter()
        jax.block_until_ready(gen.decode_chunk(tok, done, rem, keys(i + 1), sampling, stops))
        walls.append((time.perf_counter() - t) / cfg.page_size * 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(gen.decode_chunk(tok, done, rem, keys(99), sampling, stops))
        ev = device_events(tmp)
    res = summarize(ev, cfg.page_size, mc.num_layers)
    res.update(tree=tree, context=ctx, batch=batch, budget=budget, layers=mc.num_layers, steps=cfg.page_size,
               kv_fraction=args.kv_fraction, setup_s=setup_s, compile_s=compile_s,
               wall_us_per_step=sorted(walls)[len(walls) // 2], wall_us_per_step_all=walls,
               device=str(jax.devices()[0].device_kind), jax=jax.__version__)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{tree}: {len(ev)} events, span {res['span_us'] / res['steps']:.1f} us/step, wall "
          f"{res['wall_us_per_step']:.1f} us/step, setup {setup_s:.1f} s, compile {compile_s:.1f} s", flush=True)
    return res


def diff(old: dict, new: dict, top: int) -> dict:
    """Per op per decode step (all layers): launches per layer-step, device us and gap us in both trees."""
    steps_o, steps_n = old["steps"], new["steps"]
    per_o, per_n = steps_o * old["layers"], steps_n * new["layers"]
    rows = []
    for name in set(old["ops"]) | set(new["ops"]):
        o, n = old["ops"].get(name, {}), new["ops"].get(name, {})
        r = dict(name=name, n_old=o.get("launches", 0) / per_o, n_new=n.get("launches", 0) / per_n,
                 us_old=o.get("us", 0.0) / steps_o, us_new=n.get("us", 0.0) / steps_n,
                 gap_old=o.get("gap_us", 0.0) / steps_o, gap_new=n.get("gap_us", 0.0) / steps_n)
        r["delta_us"] = r["us_new"] - r["us_old"]
        r["delta_gap"] = r["gap_new"] - r["gap_old"]
        rows.append(r)
    rows.sort(key=lambda r: -max(r["us_old"], r["us_new"], r["gap_old"], r["gap_new"]))
    tot = {k: dict(old=old[k + "_us"] / steps_o, new=new[k + "_us"] / steps_n) for k in ("busy", "idle", "span")}
    tot["wall"] = dict(old=old["wall_us_per_step"], new=new["wall_us_per_step"])
    for v in tot.values():
        v["delta"] = v["new"] - v["old"]
    print(f"\nper decode step, all {new['layers']} layers ({old['context'] // 1024}K x {old['batch']}, "
          f"budget {old['budget']}); n = launches per layer-step; gap = idle before the op's launches")
    print(f"{'op':44s} {'n old':>6s} {'n new':>6s} {'us old':>9s} {'us new':>9s} {'delta':>8s} "
          f"{'gap old':>8s} {'gap new':>8s} {'d gap':>7s}")
    for r in rows[:top]:
        print(f"{r['name'][:44]:44s} {r['n_old']:6.2f} {r['n_new']:6.2f} {r['us_old']:9.1f} {r['us_new']:9.1f} "
              f"{r['delta_us']:+8.1f} {r['gap_old']:8.1f} {r['gap_new']:8.1f} {r['delta_gap']:+7.1f}")
    rest = rows[top:]
    if rest:
        print(f"{'(%d more ops)' % len(rest):44s} {'':6s} {'':6s} {sum(r['us_old'] for r in rest):9.1f} "
              f"{sum(r['us_new'] for r in rest):9.1f} {sum(r['delta_us'] for r in rest):+8.1f} "
              f"{sum(r['gap_old'] for r in rest):8.1f} {sum(r['gap_new'] for r in rest):8.1f}")
    for k, v in tot.items():
        what = dict(busy="device busy", idle="gaps (idle)", span="device span", wall="wall (untraced)")[k]
        print(f"{'TOTAL ' + what:44s} {'':6s} {'':6s} {v['old']:9.1f} {v['new']:9.1f} {v['delta']:+8.1f}")
    lo, ln = old.get("layer", []), new.get("layer", [])
    if lo or ln:
        print(f"\none middle layer in launch order (us, gap before): old {len(lo)} launches "
              f"{sum(x['us'] + x['gap_us'] for x in lo):.1f} us | new {len(ln)} launches "
              f"{sum(x['us'] + x['gap_us'] for x in ln):.1f} us")
        for i in range(max(len(lo), len(ln))):
            a = f"{lo[i]['name'][:30]:30s} {lo[i]['us']:7.2f} {lo[i]['gap_us']:6.2f}" if i < len(lo) else " " * 45
            b = f"{ln[i]['name'][:30]:30s} {ln[i]['us']:7.2f} {ln[i]['gap_us']:6.2f}" if i < len(ln) else ""
            print(f"{a} | {b}")
    meta = {k: dict(old=old.get(k), new=new.get(k)) for k in ("tree", "setup_s", "compile_s", "events",
                                                               "device", "jax", "wall_us_per_step_all")}
    return dict(context=old["context"], batch=old["batch"], budget=old["budget"], layers=old["layers"],
                steps=old["steps"], totals_us_per_step=tot, ops_us_per_step=rows, meta=meta,
                layer=dict(old=lo, new=ln))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace", help="profile one chunk in --tree (PYTHONPATH must be that tree)")
    t.add_argument("--tree", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--context", type=int, default=262144)
    t.add_argument("--batch", type=int, default=1)
    t.add_argument("--budget", type=int, default=2048)
    t.add_argument("--layers", type=int, default=32)
    t.add_argument("--kv-fraction", type=float, default=0.25)
    t.add_argument("--chunks", type=int, default=4, help="bench_decode's --chunks (sizes the cache, timed chunks)")
    t.add_argument("--tiny", action="store_true", help="CPU check: tiny preset, 1K context, budget 256")
    d = sub.add_parser("diff", help="compare two trace JSONs")
    d.add_argument("old")
    d.add_argument("new")
    d.add_argument("--out", required=True)
    d.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    if args.cmd == "trace":
        trace(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)         # the JSON is written: skip freeing tens of GB of pinned host pool at interpreter exit
    sides, errors = [], []
    for path in (args.old, args.new):
        try:
            with open(path) as f:
                sides.append(json.load(f))
        except (OSError, ValueError) as e:    # a tree that crashed or timed out: its side reads as zeros
            errors.append(f"{path}: {e}")
            sides.append(None)
    if sides == [None, None]:
        raise SystemExit("no trace JSON: " + "; ".join(errors))
    ok = next(s for s in sides if s is not None)
    empty = dict(ok, ops={}, busy_us=0.0, idle_us=0.0, span_us=0.0, wall_us_per_step=0.0, layer=[], tree=None)
    res = diff(*(s if s is not None else empty for s in sides), args.top)
    if errors:
        res["errors"] = errors
        print("MISSING SIDE: " + "; ".join(errors))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
