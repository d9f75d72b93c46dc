"""Prefill ingestion throughput: one chunk of K/V (all layers) written into the tiered cache by
`CacheManager._ingest` (summaries, host write-through of complete pages by the page flush kernel, tail page).

Why: the prefill and the decode benchmark's synthetic fill go through this path, whose rate should be that of the
page flush kernel (docs/BENCHMARKS.md, tiers). This script times the ingest call per chunk size, splits its device time by event (JAX profiler, as in bench_tiers), and measures a
bulk HBM -> pinned-host copy of the same bytes as the ceiling, in the same run. The first chunk is checked: host
pages read back equal the K/V given.

Run (H200): python3 scripts/bench_ingest.py --out DIR [--commit SHA]   -> DIR/ingest.json, DIR/ingest.png
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import jax
import jax.numpy as jnp

from scripts.bench_meta import Results, add_common_args, pyplot, run_meta, save_figure
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.runtime.sequences import CacheManager

from scripts.bench_tiers import measure


def make_manager(layers: int, kv: int, d: int, page: int, context: int) -> CacheManager:
    pages = -(-(context // page + 2) // 128) * 128
    cfg = CacheConfig(num_layers=layers, num_kv_heads=kv, head_dim=d, max_seqs=1, max_pages_per_seq=pages,
                      page_size=page, kv_heads_per_group=1, dtype="bfloat16", num_buckets=16, slots_per_bucket=64,
                      host_pages=layers * kv * pages, token_budget=2048, sink_pages=1, recent_pages=2)
    return CacheManager(cfg)


def check_first_chunk(m: CacheManager, slot: int, k, chunk: int) -> bool:
    """Host pages of layer 0 and the last layer, group 0, first and last page of the chunk equal the K given."""
    c = m.config
    hp = np.asarray(m.state.vtlb.host_page[0, slot])                                  # [L, G, P]
    ok = True
    for layer in (0, c.num_layers - 1):
        for p in (0, chunk // c.page_size - 1):
            got = np.asarray(m.host.k[0, hp[layer, 0, p]], np.float32)[:, 0]           # [page, D]
            want = np.asarray(k[layer, p * c.page_size:(p + 1) * c.page_size, 0], np.float32)
            ok &= bool(np.array_equal(got, want))
    return ok


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--chunks", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--reps", type=int, default=3)
    return add_common_args(p, files="ingest.json, ingest.png")


def main(argv=None):
    from ulacache_jax.cache.state import raise_host_limit
    raise_host_limit()
    a = build_parser().parse_args(argv)
    KV, D, PAGE = 8, 128, 64
    m = make_manager(a.layers, KV, D, PAGE, a.context)
    slot = m.admit(a.context)
    res = Results(os.path.join(a.out, "ingest.json"), run_meta(a.commit),
                  shapes=dict(layers=a.layers, KV=KV, D=D, page=PAGE, context=a.context))
    host_sh = m.host_shardings().k
    for chunk in a.chunks:
        mk = jax.jit(lambda key: jax.random.normal(key, (a.layers, chunk, KV, D), jnp.bfloat16))
        k, v = mk(jax.random.key(1)), mk(jax.random.key(2))
        nbytes = 2 * k.nbytes
        row = dict(chunk=chunk, kv_bytes=nbytes)
        try:
            starts = iter(range(0, a.context - chunk + 1, chunk))   # a fresh page range every call

            def run():
                s = next(starts, 0)
                m.state, m.host = m._ingest(m.state, m.host, slot, k, v, s, a.context)
                return m.state.kmin
            run()
            if chunk == a.chunks[0]:
                row["check_first_chunk"] = check_first_chunk(m, slot, k, chunk)
            row["ingest"] = measure(run, a.reps, nbytes, warmup=0)
            row["rng"] = measure(lambda: mk(jax.random.key(3)), a.reps, nbytes // 2)
            # the ceiling: one bulk HBM -> pinned host copy of the same bytes
            flat = jnp.concatenate([k.reshape(-1), v.reshape(-1)])
            row["bulk_d2h"] = measure(lambda: jax.device_put(flat, host_sh), a.reps, nbytes)
            del flat
        except Exception as e:  # a chunk size failing must not lose the others
            row["error"] = repr(e)[:400]
        res.add(row)
        print(json.dumps(row), flush=True)
    plot(res, os.path.join(a.out, "ingest.png"))
    print("| chunk | ingest wall ms | ingest GB/s (wall) | device GB/s | bulk D2H GB/s | top device events (us) |")
    print("|---|---|---|---|---|---|")
    for r in res.rows:
        if "error" in r:
            print(f"| {r['chunk']} | ERROR {r['error'][:80]} |")
            continue
        i, b = r["ingest"], r["bulk_d2h"]
        print(f"| {r['chunk']} | {i['wall_us'] / 1e3:.1f} | {i['gbps_wall']:.1f} | {i.get('gbps') or float('nan'):.1f} | "
              f"{b['gbps_wall']:.1f} | {i.get('events', {})} |")
    return dict(meta=res.meta, rows=res.rows, **res.extra)


def plot(res: Results, path):
    plt = pyplot()
    rows = [r for r in res.rows if "ingest" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["ingest"]["gbps_wall"] for r in rows], 0.4, label="ingest (wall)")
    ax.bar(x + 0.2, [r["bulk_d2h"]["gbps_wall"] for r in rows], 0.4, label="bulk HBM -> pinned host")
    ax.set_xticks(x, [f"{r['chunk'] // 1024}K tokens" for r in rows])
    ax.set_ylabel("GB/s of K/V")
    s = res.extra["shapes"]
    ax.set_title(f"prefill ingestion, {s['layers']} layers x {s['KV']} KV x {s['D']}, {res.meta['device']}",
                 fontsize=9)
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
