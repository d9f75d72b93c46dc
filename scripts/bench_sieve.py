"""Benchmark the PB-LRU access: the Pallas sieve (grouping + kernel + state update, one jitted call) against the
sort-based jnp reference, for N requests, pools of F frames and B buckets (DESIGN.md section 5, issue 3).

Run on the GPU:  python scripts/bench_sieve.py --out docs/benchmarks [--commit SHA] [--variants]
Writes sieve.json and sieve.png to --out and prints a table.

Workload (synthetic, decode-like): a hot set of N distinct LIDs (random seq/layer/group/page fields), 10% of it
replaced each step and requested in a new order each step, against a pool that starts full: every slot holds a
LID of its bucket, stamps spread over the last F / (0.1 N) steps (the age profile a full pool reaches when 0.1 N
new pages arrive per step), then three warm-up steps bring the hot set in. So a step is ~90% hits plus 0.1 N
misses that evict the oldest slots (when N <= F).

Timing: each measurement replays the same steps (16 for N = 8K, 4 above) from the same warmed state (the state
is donated, as in a decode step). device_us (the sieve): the steps as separate jitted calls under the JAX
profiler, the GPU time of each call's kernels and copies summed (what the access costs inside a larger jitted
step, launch gaps aside; the median gap between dependent launches is recorded too). scan_us (the reference;
the sieve at B = 256, 1024 and N = 8K): wall time per step of one jitted lax.scan over the steps, median over
repetitions; it includes the scan's own per-step cost (scan_floor_us, measured with a trivial body). Before
timing, the sieve's steps are checked against the reference's, output by output and the final state, bit for
bit; a sieve case that fails is rerun with the other grouping and both are recorded.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from scripts.bench_meta import (Results, add_common_args, block, device_events,
                                median_seconds, pyplot, run_meta, save_figure)
from ulacache_jax.cache import pb_lru
from ulacache_jax.pallas_kernels import pb_lru_sieve as sv
from ulacache_jax.pallas_kernels.lid_hash import GOLDEN

STEPS = 16
CHURN = 0.1
TARGET_US = 20.0


def np_bucket(x: np.ndarray, nb: int) -> np.ndarray:
    bits = nb.bit_length() - 1
    if bits == 0:
        return np.zeros(x.shape, np.int64)
    with np.errstate(over="ignore"):
        return ((x * np.uint64(GOLDEN)) >> np.uint64(64 - bits)).astype(np.int64)


def random_lids(rng, n: int) -> np.ndarray:
    seq = rng.integers(0, 2**20, n, dtype=np.uint64)
    layer = rng.integers(0, 32, n, dtype=np.uint64)
    group = rng.integers(0, 8, n, dtype=np.uint64)
    page = rng.integers(0, 2**20, n, dtype=np.uint64)
    return (seq << np.uint64(44)) | (layer << np.uint64(36)) | (group << np.uint64(32)) | (page * np.uint64(64))


def words(x: np.ndarray):
    return (x >> np.uint64(32)).astype(np.uint32), (x & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def make_workload(n: int, nb: int, ns: int, seed: int = 0):
    """Full pool state (numpy), clock after prefill, and warm-up + timed batches [W + STEPS, N]."""
    rng = np.random.default_rng(seed)
    nf = nb * ns
    age = max(1, math.ceil(nf / (CHURN * n)))
    # prefill: 1.5 F random LIDs grouped by bucket, S per bucket (a rare short bucket keeps empty slots)
    cand = random_lids(rng, int(1.5 * nf) + 64)
    cb = np_bucket(cand, nb)
    order = np.argsort(cb, kind="stable")
    cand, cb = cand[order], cb[order]
    starts = np.searchsorted(cb, np.arange(nb))
    rank = np.arange(len(cand)) - starts[cb]
    keep = rank < ns
    tags = np.full(nf, np.uint64(0xFFFFFFFFFFFFFFFF))
    stamp = np.full(nf, -1, np.int32)
    tags[cb[keep] * ns + rank[keep]] = cand[keep]
    stamp[cb[keep] * ns + rank[keep]] = rng.integers(0, age, int(keep.sum()), dtype=np.int32)
    # decode-like batches: hot set with churn
    hot = random_lids(rng, n)
    batches = []
    for _ in range(3 + STEPS):
        k = int(CHURN * n)
        hot[rng.choice(n, k, replace=False)] = random_lids(rng, k)
        batches.append(rng.permutation(hot))
    th, tl = words(tags)
    return (th.reshape(nb, ns), tl.reshape(nb, ns), stamp.reshape(nb, ns)), age, np.stack(batches)


def device_state(np_state):
    th, tl, ts = np_state
    return pb_lru.PBLRUState(tag_hi=jnp.asarray(th), tag_lo=jnp.asarray(tl), stamp=jnp.asarray(ts))


def copy_state(s):
    return jax.tree.map(lambda a: jnp.array(a, copy=True), s)


def make_step(impl: str, cfg=None):
    if impl == "pallas":
        def step(state, hi, lo, valid, now):
            slots, out = sv.access((state.tag_hi, state.tag_lo, state.stamp), hi, lo, valid, now, config=cfg)
            return pb_lru.PBLRUState(*slots), pb_lru.AccessOut(*out)
    else:
        def step(state, hi, lo, valid, now):
            return pb_lru.ref_access(state, hi, lo, valid, now)
    return step


def bench_config(impl, n, nb, ns, work, budget_s, steps, methods=(), cfg=None, check=False, profile=False):
    """One configuration: warm the state, optionally check `steps` steps against the reference, profile the
    device time per call, and time a jitted scan over the steps."""
    np_state, age, batches = work
    his, los = words(batches[:3 + steps])
    his, los = jnp.asarray(his), jnp.asarray(los)
    valid = jnp.ones((n,), bool)
    state0 = device_state(np_state)
    ref_jit = pb_lru.ref_access  # jitted; shared across calls of one shape
    for w in range(3):  # warm-up steps bring the hot set in (reference)
        state0, _ = ref_jit(state0, his[w], los[w], valid, jnp.int32(age + w))
    block(state0)
    nows = jnp.arange(age + 3, age + 3 + steps, dtype=jnp.int32)
    xs = [(his[3 + t], los[3 + t], nows[t]) for t in range(steps)]  # pre-sliced: one dispatch per step below
    block(xs)
    step = jax.jit(make_step(impl, cfg), donate_argnums=0)
    rec = dict(impl=impl, N=n, F=nb * ns, B=nb, S=ns, steps=steps,
               config=None if cfg is None else dataclasses.asdict(cfg))

    def run_chain(s):
        outs = []
        for hi, lo, now in xs:
            s, o = step(s, hi, lo, valid, now)
            outs.append(o)
        return s, outs

    if check or profile:
        s_a, outs_a = run_chain(copy_state(state0))  # compiles
        block((s_a, outs_a))
    if check:  # every step against the reference (outputs, and the final state), bit for bit
        s_b, hits, ok = copy_state(state0), 0, True
        for t, (hi, lo, now) in enumerate(xs):
            s_b, o_b = ref_jit(s_b, hi, lo, valid, now)
            ok &= all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(outs_a[t]), jax.tree.leaves(o_b)))
            hits += int(o_b.hit.sum())
        ok &= all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(s_a), jax.tree.leaves(s_b)))
        rec["check_ok"] = bool(ok)
        rec["hit_rate"] = hits / (steps * n)
        if not ok:
            print(f"!! MISMATCH vs reference: {impl} N={n} F={nb * ns} B={nb} cfg={cfg}", flush=True)
    if profile:
        try:
            s = copy_state(state0)
            block(s)
            dt = device_events(lambda: run_chain(s), reps=1)
            if dt is None:
                raise RuntimeError("no GPU events in the trace")
            rec["device_us"] = dt.busy_ns / 1e3 / steps
            rec["device_kernels"] = {k: round(v / 1e3 / steps, 2)
                                     for k, v in sorted(dt.by_name.items(), key=lambda x: -x[1])}
            rec["device_events_per_call"] = dt.events / steps
            rec["launch_gap_us_median"] = None if dt.gap_ns_median is None else dt.gap_ns_median / 1e3
        except Exception as e:  # no CUPTI, no trace: the scan timing still stands
            rec["profile_error"] = repr(e)[:300]
    if "scan" in methods:
        inner = make_step(impl, cfg)

        def scan_steps(s):
            def body(s, x):
                hi, lo, now = x
                return inner(s, hi, lo, valid, now)
            return lax.scan(body, s, (his[3:], los[3:], nows))
        scan_steps = jax.jit(scan_steps, donate_argnums=0)
        t = median_seconds(scan_steps, 30, prepare=lambda: copy_state(state0), budget_s=budget_s)
        rec["scan_us"] = 1e6 * t.median_s / steps
        rec["scan_reps"] = t.reps
    return rec


def safe_bench(*args, **kw):
    try:
        return bench_config(*args, **kw)
    except Exception as e:
        impl, n, nb, ns = args[:4]
        print(f"!! failed: {impl} N={n} B={nb} cfg={kw.get('cfg')}: {repr(e)[:400]}", flush=True)
        return dict(impl=impl, N=n, F=nb * ns, B=nb, S=ns, config=None if kw.get("cfg") is None else
                    dataclasses.asdict(kw["cfg"]), error=repr(e)[:1000])


def scan_floor(n, nb, ns, budget_s):
    """The scan machinery alone (16 steps, trivial body, same carry): the per-step floor of the scan method."""
    state0 = pb_lru.init(nb, ns)
    nows = jnp.arange(STEPS, dtype=jnp.int32)

    def floor_scan(s):
        def body(s, x):
            return pb_lru.PBLRUState(s.tag_hi, s.tag_lo, s.stamp.at[0, 0].set(x)), x
        return lax.scan(body, s, nows)
    floor_scan = jax.jit(floor_scan, donate_argnums=0)
    t = median_seconds(floor_scan, 30, prepare=lambda: copy_state(state0), budget_s=budget_s)
    return 1e6 * t.median_s / STEPS


def metric(r):
    """Device time per access: profiled kernel time when there is one, else the scan wall time per step."""
    return r.get("device_us", r.get("scan_us")) if "error" not in r else None


def plot(records, path):
    plt = pyplot()
    pools = sorted({r["F"] for r in records if "F" in r})
    fig, axes = plt.subplots(1, len(pools), figsize=(6.5 * len(pools), 4.8), squeeze=False)
    colors = {8192: "tab:blue", 65536: "tab:orange", 262144: "tab:green"}
    for ax, f in zip(axes[0], pools):
        for n in sorted({r["N"] for r in records}):
            for impl, style in (("pallas", "-o"), ("ref", "--s")):
                how = "profiled device time" if any("device_us" in r for r in records if r.get("impl") == impl) \
                    else "scan wall per step"
                label = f"{'sieve' if impl == 'pallas' else 'reference'} ({how})"
                pts = sorted((r["B"], metric(r)) for r in records
                             if r.get("impl") == impl and r["F"] == f and r["N"] == n and r.get("config") is None
                             and metric(r) is not None)
                if pts:
                    ax.plot(*zip(*pts), style, color=colors.get(n, "k"), label=f"{label}, N={n // 1024}K",
                            alpha=1.0 if impl == "pallas" else 0.6)
        ax.axhline(TARGET_US, color="red", lw=0.8, ls=":", label="20 us target (8K requests)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("buckets B (B = 1: global LRU, reference only)")
        ax.set_ylabel("time per access call (us)")
        ax.set_title(f"PB-LRU access, pool {f // 1024}K frames")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, files="NAME.json, NAME.png (--name)")
    ap.add_argument("--requests", type=int, nargs="+", default=[8192, 65536, 262144])
    ap.add_argument("--pools", type=int, nargs="+", default=[65536, 1048576])
    ap.add_argument("--buckets", type=int, nargs="+", default=[16, 64, 128, 256, 1024])
    ap.add_argument("--budget-s", type=float, default=1.0, help="timing seconds per configuration (>= 3 reps)")
    ap.add_argument("--max-seconds", type=float, default=1e9, help="stop starting new configurations after this")
    ap.add_argument("--variants", action="store_true", help="also time launch variants (warps, grouping)")
    ap.add_argument("--name", default="sieve", help="output file stem")
    ap.add_argument("--kernel-only", action="store_true",
                    help="time the sieve alone (profiled device time): no reference or global-LRU timings and no "
                         "scan wall time, so a short device call reaches every configuration (each is still "
                         "checked against the reference)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    t_begin = time.perf_counter()
    meta = run_meta(args.commit, steps_per_measurement=STEPS, churn=CHURN, target_us=TARGET_US,
                    workload="synthetic decode-like: hot set of N distinct LIDs, 10% churn per step, full pool",
                    metrics={"device_us": "profiled GPU time per access call (sum of its kernels and copies)",
                             "scan_us": "wall time per step of one jitted lax.scan over 16 steps (includes the "
                                        "scan's per-step overhead, scan_floor_us)"})
    res = Results(os.path.join(args.out, f"{args.name}.json"), meta)
    records, extra, save = res.rows, res.extra, res.save

    extra["scan_floor_us"] = scan_floor(8192, 256, 256, args.budget_s)
    print(f"scan floor: {extra['scan_floor_us']:.1f} us per step", flush=True)

    def show(rec):
        print(f"{rec['impl']:6s} N={rec['N']:6d} F={rec['F']:7d} B={rec['B']:4d} S={rec['S']:6d} "
              f"device={rec.get('device_us', float('nan')):9.1f}us scan={rec.get('scan_us', float('nan')):9.1f}us "
              f"ok={rec.get('check_ok', '-')} hit={rec.get('hit_rate', float('nan')):.3f} "
              f"cfg={rec.get('config')}", flush=True)
        if rec.get("device_kernels"):
            print("   kernels:", rec["device_kernels"], "gap", rec.get("launch_gap_us_median"), flush=True)
        if rec.get("profile_error"):
            print("   profile error:", rec["profile_error"], flush=True)

    try:
        for n in args.requests:
            steps = STEPS if n <= 8192 else 4
            budget = args.budget_s if n <= 8192 else args.budget_s / 2
            for f in args.pools:
                for nb in ([] if args.kernel_only else [1]) + args.buckets:
                    if time.perf_counter() - t_begin > args.max_seconds:
                        raise TimeoutError
                    ns = f // nb
                    work = make_workload(n, nb, ns, seed=n ^ f)
                    if nb > 1:
                        scan = ("scan",) if n <= 8192 and not args.kernel_only else ()
                        rec = safe_bench("pallas", n, nb, ns, work, budget, steps, scan, check=True, profile=True)
                        records.append(rec)
                        show(rec)
                        if rec.get("check_ok") is False or "error" in rec:  # the other grouping, recorded too
                            cfg = sv.choose_config(n, nb, ns)
                            cfg = dataclasses.replace(cfg, grouping="sort" if cfg.grouping != "sort" else "scan")
                            rec = safe_bench("pallas", n, nb, ns, work, budget, steps, scan, cfg=cfg, check=True,
                                             profile=True)
                            rec["fallback"] = True
                            records.append(rec)
                            show(rec)
                    if not args.kernel_only:
                        rec = safe_bench("ref", n, nb, ns, work, budget, steps, ("scan",))
                        records.append(rec)
                        show(rec)
                    if args.variants and n <= 8192 and nb in (256, 1024) and (nb == 1024 or f == args.pools[0]):
                        base_cfg = sv.choose_config(n, nb, ns)
                        cfg = dataclasses.replace(base_cfg, num_warps=12 - base_cfg.num_warps)  # 4 <-> 8
                        rec = safe_bench("pallas", n, nb, ns, work, budget, steps, (), cfg=cfg, profile=True)
                        records.append(rec)
                        show(rec)
                    if args.variants and nb > 1 and n <= sv.RANK_MAX_REQUESTS:  # the other groupings
                        base_cfg = sv.choose_config(n, nb, ns)
                        for g in sv.GROUPINGS:
                            if g == base_cfg.grouping:
                                continue
                            cfg = dataclasses.replace(base_cfg, grouping=g)
                            rec = safe_bench("pallas", n, nb, ns, work, budget, steps, (), cfg=cfg, check=True,
                                             profile=True)
                            records.append(rec)
                            show(rec)
                    save()
    except TimeoutError:
        print("out of time: stopping", flush=True)
    finally:
        save()
        finish(records, extra, args.out, args.name)


def finish(records, extra, out, name):
    plot(records, os.path.join(out, f"{name}.png"))
    fl = extra.get("scan_floor_us", 0.0)
    print(f"\n(device: profiled GPU time per access; scan: wall per step in a jitted scan, floor {fl:.1f} us)")
    print("| N | pool frames | B | sieve device (us) | sieve scan (us) | reference device (us) | reference scan (us) | check |")
    print("|---|---|---|---|---|---|---|---|")
    fmt = lambda x: "-" if x is None else f"{x:.1f}"
    for r in records:
        if r["impl"] == "pallas" and r.get("config") is None and "error" not in r:
            ref = next((x for x in records if x["impl"] == "ref" and x["N"] == r["N"] and x["F"] == r["F"]
                        and x["B"] == r["B"]), {})
            print(f"| {r['N']} | {r['F']} | {r['B']} | {fmt(r.get('device_us'))} | {fmt(r.get('scan_us'))} | "
                  f"{fmt(ref.get('device_us'))} | {fmt(ref.get('scan_us'))} | {r.get('check_ok')} |")
    for r in records:
        if r["impl"] == "ref" and r["B"] == 1:
            print(f"| {r['N']} | {r['F']} | 1 (global LRU) | - | - | {fmt(r.get('device_us'))} | "
                  f"{fmt(r.get('scan_us'))} | - |")


if __name__ == "__main__":
    main()
