#!/usr/bin/env python3
"""Benchmark of the tier kernels on the GPU: `fetch` (pinned host -> HBM frames) against a bulk pinned-host -> HBM
copy of the same bytes (`jax.device_put`), and `flush` (HBM -> pinned host pages) against a bulk HBM -> pinned-host
copy, for 8..8192 pages of 64 x 1 x 128 bf16 (16 KiB) at random indices of a 65536-page pool (1 GiB per side).

Every kernel result is checked against the truth before it is timed. Times: device time per call from the JAX
profiler (sum of the call's device events: kernels and memcpys, CUPTI), and the wall-clock latency of one blocking
call (dispatch + device + sync, median). GB/s counts the page bytes moved once. A variant table compares pages per
program, warps and K+V in one launch at a few sizes. Writes tiers.json (after every row) and tiers.png
to --out (default docs/benchmarks) and prints a short table last.

Usage: python -m scripts.bench_tiers [--out DIR] [--commit SHA] [--pool-pages 65536] [--reps 20]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

from scripts.bench_meta import (add_common_args, device_events, median_seconds, pyplot, run_meta, save_figure,
                                write_json)
from ulacache_jax.pallas_kernels import page_copy as pc

PAGE_SHAPE = (64, 1, 128)
DTYPE = jnp.bfloat16
SIZES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
VARIANT_SIZES = (64, 1024, 8192)
VARIANTS = {  # name -> kernel kwargs
    "p1": dict(pages_per_program=1), "p2": dict(pages_per_program=2), "p4": dict(pages_per_program=4),
    "p8": dict(pages_per_program=8), "p1w8": dict(pages_per_program=1, num_warps=8),
}


# ---------------------------------------------------------------- measurement (also used by bench_ingest.py)

def measure(run, reps: int, nbytes: int, warmup: int = 2) -> dict:
    """Bytes moved by `run()`, its median blocking latency and, where the profiler sees the GPU, its device time
    (GB/s from the device time, else from the latency)."""
    wall = median_seconds(run, reps, warmup=warmup).median_s
    ev = device_events(run, reps)
    res = {"bytes": nbytes, "wall_us": wall * 1e6, "gbps_wall": nbytes / wall / 1e9}
    if ev is not None:
        busy = ev.busy_ns
        res.update(device_us=busy / 1e3, span_us=ev.span_ns / 1e3, gbps=nbytes / busy if busy else None,
                   events={k: round(v / 1e3, 2) for k, v in sorted(ev.by_name.items(), key=lambda kv: -kv[1])[:4]},
                   lines=ev.lines[:6])
    else:
        res.update(device_us=None, gbps=res["gbps_wall"])
    return res


def device_info(commit: str | None = None) -> dict:
    return run_meta(commit, memory_kinds=sorted(m.kind for m in jax.devices()[0].addressable_memories()))


def shardings():
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host" if "pinned_host" in kinds else None)
    return host, jax.sharding.SingleDeviceSharding(dev, memory_kind="device" if "device" in kinds else None)


def random_pages(key, n: int):
    """[n, *PAGE_SHAPE] bf16 with random bits (some NaN patterns: compare as bits)."""
    bits = jax.random.bits(key, (n,) + PAGE_SHAPE, jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, DTYPE)


@jax.jit
def _pages_equal(a, a_idx, b, b_idx):
    u = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)
    return jnp.array_equal(u(jnp.take(a, a_idx, axis=0)), u(jnp.take(b, b_idx, axis=0)))


# ---------------------------------------------------------------- the benchmark

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, files="tiers.json, tiers.png")
    ap.add_argument("--pool-pages", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list, or 'none'")
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip the variant table past this many seconds")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    sizes = [int(s) for s in args.sizes.split(",")]
    P = args.pool_pages
    page_bytes = int(np.prod(PAGE_SHAPE)) * jnp.dtype(DTYPE).itemsize
    info = device_info(args.commit)
    print(json.dumps(info))
    s_host, s_dev = shardings()
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu:
        print("note: no GPU; running the kernels in interpret mode on small sizes (a smoke test, not a benchmark)")

    truth = random_pages(jax.random.key(0), P)                  # [P, page, g, D] HBM: what the host pool holds
    host = jax.device_put(truth, s_host)                        # pinned_host copy
    pool = jnp.zeros_like(truth)                                # HBM frame pool
    truth_v = random_pages(jax.random.key(99), P)               # a V pool for the K+V variant
    host_v = jax.device_put(truth_v, s_host)
    jax.block_until_ready((truth, host, pool, host_v))
    print(f"pool {P} pages x {page_bytes} B = {P * page_bytes / 2**30:.2f} GiB per side; host kind "
          f"{host.sharding.memory_kind}")
    rng = np.random.default_rng(0)

    def index_sets(n, k=4):
        return [(jnp.asarray(rng.choice(P, n, replace=False).astype(np.int32)),
                 jnp.asarray(rng.choice(P, n, replace=False).astype(np.int32))) for _ in range(k)]

    def bench_fetch(n, sets, kw, kv=False):
        nonlocal pool
        if kv:
            # V from its own pinned array: the same array twice would let the second read of a page merge with the
            # first in L2 (run 1 measured 87 GB/s "K+V" at 64 pages that way)
            pool2 = jnp.zeros_like(truth)
            state = {"p": [pool, pool2]}
            host_arg = [host, host_v]
        else:
            state = {"p": pool}
            host_arg = host
        hi, fi = sets[0]
        state["p"] = pc.fetch_donated(state["p"], host_arg, hi, fi, impl="pallas", **kw)
        first = state["p"][0] if kv else state["p"]
        ok = bool(_pages_equal(first, fi, truth, hi))
        if kv:
            ok = ok and bool(_pages_equal(state["p"][1], fi, truth_v, hi))
        it = [0]

        def run():
            h, f = sets[it[0] % len(sets)]
            it[0] += 1
            state["p"] = pc.fetch_donated(state["p"], host_arg, h, f, impl="pallas", **kw)
            return state["p"]

        res = measure(run, args.reps, n * page_bytes * (2 if kv else 1))
        pool = state["p"][0] if kv else state["p"]
        res["ok"] = ok
        return res

    def bench_flush(n, sets, kw):
        nonlocal host
        state = {"h": host}
        si, hi = sets[0]
        fresh = random_pages(jax.random.key(n), P)  # new content, so the check sees the write
        state["h"] = pc.flush_donated(state["h"], fresh, si, hi, impl="pallas", **kw)
        back = jax.device_put(state["h"], s_dev)     # a device copy (never a numpy view of the donated pool)
        ok = bool(_pages_equal(back, hi, fresh, si))
        ok = ok and state["h"].sharding.memory_kind == host.sharding.memory_kind
        del back
        it = [0]

        def run():
            s, h = sets[it[0] % len(sets)]
            it[0] += 1
            state["h"] = pc.flush_donated(state["h"], truth, s, h, impl="pallas", **kw)
            return state["h"]

        res = measure(run, args.reps, n * page_bytes)
        # restore the truth in the pages we overwrote (the fetch checks read host against truth); with the default
        # kernel, since interpret mode (CPU) canonicalises NaN payloads in masked loads
        for _, h in sets:
            state["h"] = pc.flush_donated(state["h"], truth, h, h, impl="pallas")
        host = state["h"]
        res["ok"] = ok
        return res

    def bench_bulk(n):
        src_h = jax.device_put(truth[:n], s_host)
        src_d = jnp.array(truth[:n])
        jax.block_until_ready((src_h, src_d))
        h2d = measure(lambda: jax.device_put(src_h, s_dev), args.reps, n * page_bytes)
        d2h = measure(lambda: jax.device_put(src_d, s_host), args.reps, n * page_bytes)
        back = jax.device_put(src_h, s_dev)
        h2d["ok"] = bool(_pages_equal(back, jnp.arange(n), truth, jnp.arange(n)))
        d2h["ok"] = jax.device_put(src_d, s_host).sharding.memory_kind == s_host.memory_kind
        return h2d, d2h

    rows, variant_rows = [], []
    default_kw = {}

    def save_partial():
        """Every row so far, rewritten after each (a run cut by its time limit keeps them); the whole JSON at the
        end replaces it."""
        write_json(os.path.join(args.out, "tiers.json"), {**info, "partial": True, "rows": rows,
                                                          "variants": variant_rows})
    for n in sizes:
        sets = index_sets(n)
        h2d, d2h = bench_bulk(n)
        f = bench_fetch(n, sets, default_kw)
        w = bench_flush(n, sets, default_kw)
        row = {"pages": n, "bytes": n * page_bytes, "fetch": f, "flush": w, "bulk_h2d": h2d, "bulk_d2h": d2h,
               "fetch_vs_bulk": f["gbps"] / h2d["gbps"], "flush_vs_bulk": w["gbps"] / d2h["gbps"]}
        rows.append(row)
        save_partial()
        print(f"{n:5d} pages: fetch {f['gbps']:.1f} GB/s ({f['device_us'] or 0:.1f} us dev, {f['wall_us']:.1f} us "
              f"wall) ok={f['ok']} | h2d {h2d['gbps']:.1f} | flush {w['gbps']:.1f} GB/s ({w['wall_us']:.1f} us wall)"
              f" ok={w['ok']} | d2h {d2h['gbps']:.1f}", flush=True)
        if n == sizes[0]:
            print("profiled events (fetch):", f.get("events"), f.get("lines"))
            print("profiled events (h2d):", h2d.get("events"), h2d.get("lines"))

    variants = [] if args.variants == "none" else args.variants.split(",")
    for n in [s for s in VARIANT_SIZES if s <= P]:
        if not variants:
            break
        sets = index_sets(n)
        for name in variants + ["kv"]:
            if time.perf_counter() - t_start > args.budget_s:
                print(f"budget reached: variant table stops at {n} pages before {name}")
                break
            kw = VARIANTS.get(name, {})
            try:
                f = bench_fetch(n, sets, kw, kv=(name == "kv"))
                w = bench_flush(n, sets, kw) if name != "kv" else None
                variant_rows.append({"pages": n, "variant": name, "kw": kw, "fetch": f, "flush": w})
                print(f"variant {name:5s} {n:5d} pages: fetch {f['gbps']:.1f} GB/s ok={f['ok']}"
                      + (f" | flush {w['gbps']:.1f} GB/s ok={w['ok']}" if w else ""), flush=True)
            except Exception as e:  # noqa: BLE001
                variant_rows.append({"pages": n, "variant": name, "kw": kw, "error": repr(e)[:500]})
                print(f"variant {name} {n}: FAILED {repr(e)[:300]}", flush=True)
            save_partial()

    big = [r for r in rows if r["pages"] >= 1024]
    summary = {
        "fetch_min_ratio_from_1024": min((r["fetch_vs_bulk"] for r in big), default=None),
        "flush_min_ratio_from_1024": min((r["flush_vs_bulk"] for r in big), default=None),
        "all_checks_ok": all(r[k]["ok"] for r in rows for k in ("fetch", "flush", "bulk_h2d", "bulk_d2h"))
        and all(v.get("fetch", {}).get("ok", True) and (v.get("flush") or {}).get("ok", True) for v in variant_rows),
        "target": ">= 0.75 of the bulk copy from 1024 pages up",
    }
    result = {**info, "page_shape": PAGE_SHAPE, "dtype": "bfloat16", "page_bytes": page_bytes, "pool_pages": P,
              "reps": args.reps, "kernel_defaults": {"pages_per_program": pc.PAGES_PER_PROGRAM,
                                                     "num_warps": pc.NUM_WARPS},
              "method": "device_us: per-call sum of device events (JAX profiler / CUPTI); gbps from device_us; "
                        "wall_us: median blocking call incl. dispatch",
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "rows": rows, "variants": variant_rows, "summary": summary,
              "elapsed_s": time.perf_counter() - t_start}
    write_json(os.path.join(args.out, "tiers.json"), result)
    try:
        plot(rows, os.path.join(args.out, "tiers.png"), info)
    except Exception as e:  # noqa: BLE001
        print("plot failed:", repr(e)[:200])

    print(f"\n{info['device']}  jax {info['jax']}  commit {info['commit'][:12]}  {P}-page pool, 16 KiB pages, "
          f"random indices. GB/s from device time (profiler); dev = device us per call; wall = blocking call us")
    print(f"{'pages':>5} | {'fetch':>5} {'h2d':>5} {'ratio':>5} {'dev':>6} {'wall':>6} | {'flush':>5} {'d2h':>5} "
          f"{'ratio':>5} {'dev':>6} {'wall':>6} | ok")
    for r in rows:
        f, w, h, d = r["fetch"], r["flush"], r["bulk_h2d"], r["bulk_d2h"]
        print(f"{r['pages']:>5} | {f['gbps']:5.1f} {h['gbps']:5.1f} {r['fetch_vs_bulk']:5.2f} "
              f"{f['device_us'] or 0:6.1f} {f['wall_us']:6.0f} | {w['gbps']:5.1f} {d['gbps']:5.1f} "
              f"{r['flush_vs_bulk']:5.2f} {w['device_us'] or 0:6.1f} {w['wall_us']:6.0f} | "
              f"{f['ok'] and w['ok'] and h['ok'] and d['ok']}")
    print("summary:", json.dumps(summary))


def plot(rows, path, info):
    plt = pyplot()
    n = [r["pages"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, lab, st in (("fetch", "fetch (kernel, pinned->HBM)", "o-"), ("bulk_h2d", "bulk H2D device_put", "s--"),
                         ("flush", "flush (kernel, HBM->pinned)", "o-"), ("bulk_d2h", "bulk D2H device_put", "s--")):
        a.plot(n, [r[key]["gbps"] for r in rows], st, label=lab)
        b.plot(n, [r[key]["wall_us"] for r in rows], st, label=lab)
    a.set(xscale="log", xlabel="pages (16 KiB)", ylabel="GB/s (device time)", title="bandwidth")
    b.set(xscale="log", yscale="log", xlabel="pages (16 KiB)", ylabel="us (blocking call, wall)", title="latency")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"UlaCache tier copies on {info['device']} (jax {info['jax']}, {info['commit'][:8]})")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
