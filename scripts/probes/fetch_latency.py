"""Probe (issue 21): why the decode's miss fetch takes ~24 us a layer for ~11 misses (profile rows 13-17) when the
tier probe fetched 16 misses from a small pool in 7.8 us. Hypothesis: the GPU's address translation of a large
pinned host pool (each miss touches a page of host memory no recent fetch touched).

`page_copy.fetch` (K and V in one launch, rank indexed in the kernel, a fixed vector of `--entries` entries padded
with -1: the decode's call) is timed alone under the profiler (GPU event time a call) for host pools of several
sizes and miss counts, with the misses' host pages drawn three ways:
- fresh:     new random pages over the whole pool at every call (the decode's misses: first-time selections);
- repeat:    the same random pages at every call (whatever translation they need is cached after the first);
- clustered: new pages at every call, but consecutive ones (one 2 MiB-aligned stretch of host memory).
Each call's result is checked first: the host pool holds page p's index mod 127 in every element, so every
fetched frame must hold its host page's value.
Device command (repo root): python3 -m scripts.probes.fetch_latency --out DIR --commit X (default --out: out)
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import jax
import jax.numpy as jnp

from ulacache_jax.pallas_kernels import page_copy
from scripts import bench_meta
from scripts.bench_meta import Results, device_events, run_meta
from ulacache_jax.cache.state import host_sharding, raise_host_limit

PAGE = (64, 1, 128)   # tokens, kv heads in a group, head dim: the 8B's page
PAGE_BYTES = 64 * 1 * 128 * 2   # one K (or V) page in bf16: 16 KiB
MODES = ("fresh", "repeat", "clustered")


def host_pool(pages: int):
    """[1, pages, *PAGE] bf16 in pinned host memory, page p filled with p % 127 (exact in bf16)."""
    make = jax.jit(lambda: jnp.broadcast_to((jnp.arange(pages, dtype=jnp.int32) % 127).astype(jnp.bfloat16)
                                            [None, :, None, None, None], (1, pages) + PAGE),
                   out_shardings=host_sharding())
    return make()


def index_sets(rng, mode: str, calls: int, misses: int, entries: int, host_pages: int, frames: int):
    """`calls` (host_idx, frame_idx) pairs [entries] int32, the first `misses` entries valid, the rest -1."""
    per_2mib = (2 << 20) // PAGE_BYTES
    out, first = [], None
    for _ in range(calls):
        if mode == "repeat" and first is not None:
            out.append(first)
            continue
        if mode == "clustered":
            stretches = max(1, (host_pages - misses) // per_2mib + 1)   # 2 MiB-aligned starts that fit
            base = int(rng.integers(0, stretches)) * per_2mib
            hp = base + np.arange(misses)
        else:
            hp = rng.choice(host_pages, misses, replace=False)
        hi = np.full(entries, -1, np.int32)
        fi = np.full(entries, -1, np.int32)
        hi[:misses] = hp
        fi[:misses] = rng.choice(frames, misses, replace=False)
        first = (jnp.asarray(hi), jnp.asarray(fi))
        out.append(first)
    return out


def plot(rows: list[dict], path: str) -> str:
    """Fetch us against misses, a line per (pool size, mode): whether the pool size or the pages' spread moves it."""
    plt = bench_meta.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for gib in sorted({r["pool_gib"] for r in rows}):
        for mode, style in zip(MODES, ("-", "--", ":")):
            pts = sorted((r["misses"], r["fetch_us"]) for r in rows
                         if r["pool_gib"] == gib and (r["mode"] == mode or r["misses"] == 0) and r["fetch_us"])
            if len(pts) > 1:
                ax.plot(*zip(*pts), style, marker="o", ms=3, label=f"{gib:g} GiB {mode}")
    ax.set_xlabel("misses in one fetch call (of 256 entries; K + V pages of 16 KiB each)")
    ax.set_ylabel("fetch_pages GPU time (us)")
    ax.set_title("miss fetch from pinned host memory")
    if ax.lines:   # no times (CPU: no profiler) -> an empty plot, no legend
        ax.legend(fontsize=7, ncol=3)
    return bench_meta.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # default "out", not docs/benchmarks: a probe's rows are read once, not kept with the docs
    bench_meta.add_common_args(ap, out_default="out", files="fetch_latency.json, fetch_latency.png")
    ap.add_argument("--pool-gib", type=float, nargs="+", default=[1.0, 8.0, 32.0],
                    help="host pool size, K and V together (the 8B at 256K x 1: 32 GiB)")
    ap.add_argument("--misses", type=int, nargs="+", default=[0, 4, 11, 32, 128])
    ap.add_argument("--entries", type=int, default=256, help="index vector length (the decode's requests a layer)")
    ap.add_argument("--frames", type=int, default=16384)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--png", default=None, help="only draw the PNG of an existing fetch_latency.json (where the GPU "
                                                "image lacks matplotlib)")
    return ap


def main(argv: list[str] | None = None):
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.png:
        with open(a.png) as f:
            print(plot(json.load(f)["rows"], os.path.splitext(a.png)[0] + ".png"))
        return
    if max(a.misses) > min(a.entries, a.frames):
        ap.error(f"--misses {max(a.misses)} exceeds --entries {a.entries} or --frames {a.frames}")
    raise_host_limit()
    rng = np.random.default_rng(0)
    res = Results(os.path.join(a.out, "fetch_latency.json"), run_meta(a.commit))
    pool = [jnp.zeros((1, a.frames) + PAGE, jnp.bfloat16) for _ in range(2)]
    for gib in a.pool_gib:
        pages = int(gib * 2**30) // (2 * PAGE_BYTES)
        if pages < max(a.misses):
            ap.error(f"--pool-gib {gib}: {pages} host pages, fewer than --misses {max(a.misses)}")
        host = [host_pool(pages), host_pool(pages)]
        for misses in a.misses:
            for mode in MODES if misses else ("fresh",):
                sets = index_sets(rng, mode, a.calls, misses, a.entries, pages, a.frames)
                it = iter(sets * 2)   # one pass checks and warms (compile), the second is timed
                st = {"p": pool}

                def run():
                    hi, fi = next(it)
                    st["p"] = page_copy.fetch_donated(st["p"], host, hi, fi, rank=0, impl="pallas")
                    return st["p"]

                ok = True
                for hi, fi in sets[:4]:
                    out = run()
                    n = int((hi >= 0).sum())
                    if n:
                        got = np.asarray(out[0][0, np.asarray(fi[:n])].astype(jnp.float32)).reshape(n, -1)
                        want = (np.asarray(hi[:n]) % 127).astype(np.float32)[:, None]
                        ok &= bool((got == want).all())
                for _ in sets[4:]:
                    run()
                dt = device_events(run, a.calls)
                pool = st["p"]
                us = None if dt is None else dt.by_name.get("fetch_pages", dt.busy_ns) / 1e3
                res.add(dict(pool_gib=gib, host_pages=pages, misses=misses, mode=mode, entries=a.entries,
                             check_ok=ok, fetch_us=us, kib=2 * misses * PAGE_BYTES / 1024))
                print(f"{gib:6.1f} GiB {misses:4d} misses {mode:9s} {us if us is None else round(us, 2)!s:>8} us"
                      f"  check {ok}", flush=True)
        del host
    print(f"{'pool GiB':>8} {'misses':>6} " + " ".join(f"{m:>10}" for m in MODES))
    for gib in a.pool_gib:
        for misses in a.misses:
            cells = {r["mode"]: r["fetch_us"] for r in res.rows if r["pool_gib"] == gib and r["misses"] == misses}
            print(f"{gib:8.1f} {misses:6d} " + " ".join(f"{cells[m]:10.2f}" if cells.get(m) is not None
                                                         else f"{'-':>10}" for m in MODES))
    try:
        plot(res.rows, os.path.join(a.out, "fetch_latency.png"))
    except ImportError as e:
        print(f"no PNG ({e}): rerun with --png {res.path} where matplotlib is installed")


if __name__ == "__main__":
    main()
