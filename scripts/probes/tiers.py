#!/usr/bin/env python3
"""Probes that fix the tier layout (issue 4), one GPU call; JSON to --out/probe_tiers.json.

1. mosaic_read / mosaic_write: Mosaic GPU (`plgpu.kernel`, TMA page copies) reading a pinned_host pool into HBM
   frames and writing HBM pages into a pinned_host pool (aliased through `jax.new_ref`): compiles? runs? GB/s,
   against the Triton-lowered `page_copy` kernels on the same pages.
2. big_pools: Triton-lowered fetch/flush on a 5 GiB bf16 pinned host pool and a 5 GiB HBM pool (> 2**31 elements,
   > 2**32 bytes): the pages around 2**31 elements and the last page round-trip exactly, nothing else moves.
3. zero_miss_floor: a jitted step of 16 x (2048x4096 @ 4096x4096 matmul + tanh) with and without a fetch of 256
   entries all -1 after each matmul (also 16 real misses, and K+V in one launch): device cost per fetch call.
4. shard_map: a [1, H, ...] pinned_host pool on a 1-device mesh under `jax.shard_map`: the kernel indexing the
   rank axis itself vs an XLA `host[0]` slice (does it copy the pool?), and a donated flush that stays pinned.
5. pin_capacity: pinned_host arrays in 8 GiB steps until failure, ~100 GiB or MemAvailable - 16 GiB; time per
   step; then freed (a child process, so an OOM kill loses only this probe).
Each probe runs in a child process that writes results as it goes; a crash is recorded and the rest still run.

Usage: python scripts/probes/tiers.py [--out DIR] [--only a,b]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench_tiers.py is there

PROBES = ("mosaic_read", "mosaic_write", "big_pools", "zero_miss_floor", "shard_map", "pin_capacity")
GiB = 2**30


def meminfo() -> dict:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return {k: round(info[k] / GiB, 2) for k in ("MemTotal", "MemAvailable", "MemFree") if k in info}
    except OSError:
        return {}


# ------------------------------------------------------------------------------------------------ probes

def _setup():
    import jax
    import jax.numpy as jnp
    from scripts import bench_tiers as bt
    from ulacache_jax.pallas_kernels import page_copy as pc
    s_host, s_dev = bt.shardings()
    return jax, jnp, bt, pc, s_host, s_dev


def _mosaic_copy(dst, src, src_idx, dst_idx, gmem_cast=False):
    """dst[dst_idx[i]] = src[src_idx[i]] by Mosaic GPU: one program per entry, TMA gmem -> smem -> gmem; dst is
    aliased through a mutable ref (plgpu.kernel has no input_output_aliases). Mosaic's copies accept only GMEM
    refs and a pinned_host operand arrives as a Host ref, so `gmem_cast` wraps the pinned array in
    `jax.new_ref(..., memory_space=GMEM)` (does XLA then copy the pool? the probe times it)."""
    import jax
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    interp = None if jax.default_backend() == "gpu" else plgpu.InterpretGPUParams()
    n, page_shape = src_idx.shape[0], src.shape[1:]

    def body(si, di, s_gmem, d_gmem, smem, bar):
        i = lax.axis_index("b")
        s, d = si[i], di[i]

        @pl.when((s >= 0) & (d >= 0))
        def _():
            plgpu.copy_gmem_to_smem(s_gmem.at[s], smem, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            plgpu.copy_smem_to_gmem(smem, d_gmem.at[d])
            plgpu.wait_smem_to_gmem(0)

    space = plgpu.GMEM if gmem_cast else None
    ref = jax.new_ref(dst, memory_space=space)
    src_arg = jax.new_ref(src, memory_space=space) if gmem_cast else src
    plgpu.kernel(body, out_type=(), grid=(n,), grid_names=("b",),
                 scratch_types=[plgpu.SMEM(page_shape, src.dtype), plgpu.Barrier(num_arrivals=1, num_barriers=1)],
                 interpret=interp)(src_idx, dst_idx, src_arg, ref)
    return jax.freeze(ref)


def probe_mosaic(write: bool, res: dict):
    jax, jnp, bt, pc, s_host, s_dev = _setup()
    import functools
    import numpy as np
    P = 65536 if jax.default_backend() == "gpu" else 64
    truth = bt.random_pages(jax.random.key(1), P)
    # Mosaic checks the ref's memory space at trace time. A pinned_host array made by device_put is typed Host;
    # one that came out of a jit with out_shardings pinned_host is (in jax 0.11.2) typed like device memory.
    hosts = {"device_put_host": lambda: jax.device_put(truth, s_host),
             "jit_out_host": lambda: jax.jit(lambda x: x + 0, out_shardings=s_host)(truth)}
    rng = np.random.default_rng(1)
    res["host_avals"] = {k: str(jax.jit(lambda x: x).trace(f()).jaxpr.in_avals[0]) if hasattr(jax.jit(lambda x: x),
                         "trace") else "n/a" for k, f in hosts.items()}
    res["whole_pool_bytes"] = P * 16384
    sizes = (1024, 4096) if P > 4096 else (8,)
    page_bytes = int(np.prod(bt.PAGE_SHAPE)) * 2
    for n in sizes:
        si = jnp.asarray(rng.choice(P, n, replace=False).astype(np.int32))
        di = jnp.asarray(rng.choice(P, n, replace=False).astype(np.int32))
        nbytes = n * page_bytes
        host = hosts["jit_out_host"]()
        res["host_kind"] = host.sharding.memory_kind
        if not write:   # fetch: pinned host -> HBM pool
            pool = jnp.zeros_like(truth)
            for mode in ("plain_device_put_host", "plain", "gmem_ref"):
                try:
                    if mode == "plain_device_put_host":
                        host_m = hosts["device_put_host"]()
                    fn = jax.jit(functools.partial(_mosaic_copy, gmem_cast=mode == "gmem_ref"), donate_argnums=0)
                    h_arg = host_m if mode == "plain_device_put_host" else host
                    st = {"p": fn(pool, h_arg, si, di)}
                    ok = bool(bt._pages_equal(st["p"], di, truth, si))

                    def run(fn=fn, st=st, h_arg=h_arg):
                        st["p"] = fn(st["p"], h_arg, si, di)
                        return st["p"]
                    res[f"mosaic_{mode}_{n}"] = {"ok": ok, **bt.measure(run, 10, nbytes)}
                    pool = st["p"]
                except Exception as e:  # noqa: BLE001
                    res[f"mosaic_{mode}_{n}"] = {"error": repr(e)[:400]}
                    pool = jnp.zeros_like(truth) if pool.is_deleted() else pool
            st2 = {"p": pool}

            def run_t():
                st2["p"] = pc.fetch_donated(st2["p"], host, si, di, impl="pallas")
                return st2["p"]
            res[f"triton_{n}"] = bt.measure(run_t, 10, nbytes)
            try:   # Mosaic from an HBM source, for scale
                fn = jax.jit(_mosaic_copy, donate_argnums=0)
                st3 = {"p": st2["p"]}

                def run_h():
                    st3["p"] = fn(st3["p"], truth, si, di)
                    return st3["p"]
                res[f"mosaic_hbm_src_{n}"] = bt.measure(run_h, 10, nbytes)
            except Exception as e:  # noqa: BLE001
                res[f"mosaic_hbm_src_{n}"] = {"error": repr(e)[:400]}
        else:           # flush: HBM pages -> pinned host pool
            fresh = bt.random_pages(jax.random.key(n), P)
            for mode in ("plain_device_put_host", "plain", "gmem_ref"):
                try:
                    if mode == "plain_device_put_host":
                        host.delete()
                        host = hosts["device_put_host"]()
                    elif host.is_deleted():
                        host = hosts["jit_out_host"]()
                    fn = jax.jit(functools.partial(_mosaic_copy, gmem_cast=mode == "gmem_ref"), donate_argnums=0,
                                 out_shardings=s_host)
                    st = {"h": fn(host, fresh, si, di)}
                    kind = st["h"].sharding.memory_kind
                    back = jax.device_put(st["h"], s_dev)
                    ok = bool(bt._pages_equal(back, di, fresh, si))
                    del back

                    def run(fn=fn, st=st):
                        st["h"] = fn(st["h"], truth, si, di)
                        return st["h"]
                    res[f"mosaic_{mode}_{n}"] = {"ok": ok, "kind_after": kind, **bt.measure(run, 10, nbytes)}
                    host = st["h"]
                except Exception as e:  # noqa: BLE001
                    res[f"mosaic_{mode}_{n}"] = {"error": repr(e)[:400]}
                    if host.is_deleted():
                        host = hosts["jit_out_host"]()
            st2 = {"h": host}

            def run_t():
                st2["h"] = pc.flush_donated(st2["h"], truth, si, di, impl="pallas")
                return st2["h"]
            res[f"triton_{n}"] = bt.measure(run_t, 10, nbytes)
            host = st2["h"]


def probe_big_pools(res: dict):
    jax, jnp, bt, pc, s_host, s_dev = _setup()
    import functools
    import numpy as np
    gpu = jax.default_backend() == "gpu"
    page = bt.PAGE_SHAPE
    per = int(np.prod(page))                               # 8192 elements = 16 KiB bf16
    H = (5 * GiB) // (per * 2) if gpu else 300             # 327680 pages = 2.68e9 elements (> 2**31)
    res["pages"], res["elements"], res["bytes"] = H, H * per, H * per * 2
    res["elements_over_2_31"] = H * per > 2**31
    mk = jax.jit(lambda: jnp.zeros((H,) + page, jnp.bfloat16), out_shardings=s_host)
    t0 = time.perf_counter()
    host = jax.block_until_ready(mk())
    res["alloc_host_s"] = round(time.perf_counter() - t0, 2)
    edge = 2**31 // per if gpu else H // 2                  # page 262144 starts at element 2**31
    targets = sorted({0, 1, edge - 1, edge, edge + 1, H - 1})
    n = len(targets)
    src = bt.random_pages(jax.random.key(7), n)
    t = jnp.asarray(np.array(targets, np.int32))
    host = pc.flush_donated(host, src, jnp.arange(n, dtype=jnp.int32), t, impl="pallas")
    res["host_kind_after_flush"] = host.sharding.memory_kind
    small = jnp.zeros((16,) + page, jnp.bfloat16)
    small = pc.fetch_donated(small, host, t, jnp.arange(n, dtype=jnp.int32), impl="pallas")
    res["flush_fetch_exact"] = bool(bt._pages_equal(small, jnp.arange(n), src, jnp.arange(n)))
    # pages nobody wrote must still be zero (no wrapped offset hit them)
    cand = [2, 3, edge - 2, edge + 2, edge + 3, H - 2, H - 3]
    probe_pages = jnp.asarray(np.array([c for c in cand if c not in targets][:5], np.int32))
    small2 = pc.fetch_donated(jnp.ones((8,) + page, jnp.bfloat16), host, probe_pages,
                              jnp.arange(5, dtype=jnp.int32), impl="pallas")
    res["untouched_pages_zero"] = bool((small2[:5] == 0).all())
    # fetch speed from high pages of the big host pool
    rng = np.random.default_rng(3)
    hi = jnp.asarray(rng.choice(np.arange(edge, H), 1024, replace=False).astype(np.int32)) if gpu else t
    pool = jnp.zeros((4096,) + page, jnp.bfloat16)
    fi = jnp.arange(hi.shape[0], dtype=jnp.int32)
    st = {"p": pool}
    def run():
        st["p"] = pc.fetch_donated(st["p"], host, hi, fi, impl="pallas")
        return st["p"]
    res["fetch_1024_high_pages"] = bt.measure(run, 10, int(hi.shape[0]) * per * 2)
    del st, pool
    # a > 2**31-element HBM pool: fetch into its last frames, flush from them
    big = jax.block_until_ready(jnp.zeros((H,) + page, jnp.bfloat16))
    frames = t
    big = pc.fetch_donated(big, host, t, frames, impl="pallas")
    res["hbm_big_fetch_exact"] = bool(bt._pages_equal(big, frames, src, jnp.arange(n)))
    host = pc.flush_donated(host, big, frames[::-1], t, impl="pallas")
    small3 = pc.fetch_donated(jnp.zeros((16,) + page, jnp.bfloat16), host, t, jnp.arange(n, dtype=jnp.int32),
                              impl="pallas")
    res["hbm_big_flush_exact"] = bool(bt._pages_equal(small3, jnp.arange(n), src, jnp.arange(n)[::-1]))
    try:
        mos = jax.jit(functools.partial(_mosaic_copy, gmem_cast=True), donate_argnums=0)(
            jnp.zeros((16,) + page, jnp.bfloat16), host, t, jnp.arange(n, dtype=jnp.int32))
        res["mosaic_big_host_read_exact"] = bool(bt._pages_equal(mos, jnp.arange(n), src, jnp.arange(n)[::-1]))
    except Exception as e:  # noqa: BLE001
        res["mosaic_big_host_read_error"] = repr(e)[:400]
    del big, host


def probe_zero_miss(res: dict):
    jax, jnp, bt, pc, s_host, s_dev = _setup()
    import numpy as np
    gpu = jax.default_backend() == "gpu"
    K = 16
    M, Kd = (2048, 4096) if gpu else (64, 64)
    F = 16384 if gpu else 64
    x = jax.random.normal(jax.random.key(0), (M, Kd), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (Kd, Kd), jnp.float32) / np.sqrt(Kd)).astype(jnp.bfloat16)
    truth = bt.random_pages(jax.random.key(2), F)
    host = jax.device_put(truth, s_host)
    host_v = jax.device_put(truth, s_host)
    minus = jnp.full((256,), -1, jnp.int32)
    rng = np.random.default_rng(4)
    some = np.full(256, -1, np.int32)
    pos = rng.permutation(256)[:16]
    some_h, some_f = some.copy(), some.copy()
    some_h[pos] = rng.choice(F, 16, replace=False)
    some_f[pos] = rng.choice(F, 16, replace=False)
    cases = {"none": None, "zero_miss_256": (minus, minus), "16_misses_of_256": (jnp.asarray(some_h),
             jnp.asarray(some_f)), "zero_miss_256_kv": (minus, minus), "zero_miss_256_p4": (minus, minus),
             "zero_miss_2048": (jnp.full((2048,), -1, jnp.int32),) * 2}
    base = None
    for name, idx in cases.items():
        kv = name.endswith("_kv")
        kw = {"pages_per_program": 4} if name.endswith("_p4") else {}

        def step(x, w, pool, host, host_v, hi, fi, idx=idx, kv=kv, kw=kw):
            # every array is an argument (a closed-over array could become an embedded constant)
            for _ in range(K):
                x = jnp.tanh(x @ w)
                if idx is not None:
                    pool = pc.fetch(pool, [host, host_v] if kv else host, hi, fi, impl="pallas", **kw)
            return x, pool

        fn = jax.jit(step, donate_argnums=2)
        pool = [jnp.zeros_like(truth), jnp.zeros_like(truth)] if kv else jnp.zeros_like(truth)
        hi, fi = idx if idx is not None else (minus, minus)
        st = {"p": pool, "x": x}

        def run():
            st["x"], st["p"] = fn(x, w, st["p"], host, host_v, hi, fi)
            return st["x"]

        m = bt.measure(run, 10, 0)
        m.pop("gbps", None), m.pop("gbps_wall", None)
        ev = m.get("events") or {}
        m["fetch_kernel_us_per_call"] = round(sum(v for k, v in ev.items() if "fetch" in k) / K, 3) if ev else None
        if name == "none":
            base = m
        elif base is not None and base.get("device_us") and m.get("device_us"):
            m["extra_device_us_per_fetch"] = round((m["device_us"] - base["device_us"]) / K, 3)
            m["extra_wall_us_per_fetch"] = round((m["wall_us"] - base["wall_us"]) / K, 3)
        res[name] = m
        del st, pool


def probe_shard_map(res: dict):
    jax, jnp, bt, pc, s_host, s_dev = _setup()
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    gpu = jax.default_backend() == "gpu"
    H, F, n = (16384, 4096, 256) if gpu else (64, 32, 8)
    mesh = jax.make_mesh((1,), ("tp",))
    kind = s_host.memory_kind
    hs = NamedSharding(mesh, P("tp"), memory_kind=kind)
    ds = NamedSharding(mesh, P("tp"))
    truth = bt.random_pages(jax.random.key(5), H)
    host = jax.device_put(truth[None], hs)                   # [1, H, page, g, D] pinned_host
    pool = jax.device_put(jnp.zeros((1, F) + bt.PAGE_SHAPE, jnp.bfloat16), ds)
    rng = np.random.default_rng(5)
    hi = jnp.asarray(rng.choice(H, n, replace=False).astype(np.int32))
    fi = jnp.asarray(rng.choice(F, n, replace=False).astype(np.int32))
    res["host_kind"] = host.sharding.memory_kind
    nbytes = n * 16384
    whole = H * 16384
    res["host_pool_bytes"] = whole

    def fetch_rank(pool, host, hi, fi):      # the kernel indexes the rank axis itself
        return pc.fetch(pool, host, hi, fi, rank=0, impl="pallas")

    def fetch_slice(pool, host, hi, fi):     # XLA slices the pinned_host operand first
        return pc.fetch(pool[0], host[0], hi, fi, impl="pallas")[None]

    for name, body in (("kernel_rank_index", fetch_rank), ("xla_slice", fetch_slice)):
        try:
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp"), P(), P()), out_specs=P("tp")),
                        donate_argnums=0, out_shardings=ds)
            st = {"p": f(pool, host, hi, fi)}
            ok = bool(bt._pages_equal(st["p"][0], fi, truth, hi))

            def run():
                st["p"] = f(st["p"], host, hi, fi)
                return st["p"]

            m = bt.measure(run, 10, nbytes)
            res[f"fetch_{name}"] = {"ok": ok, **m}
            pool = st["p"]
        except Exception as e:  # noqa: BLE001
            res[f"fetch_{name}"] = {"error": repr(e)[:600]}
    # donated flush under shard_map, output kept pinned_host
    try:
        src = bt.random_pages(jax.random.key(6), n)
        si = jnp.arange(n, dtype=jnp.int32)

        def flush_rank(host, src, si, hi):
            return pc.flush(host, src, si, hi, rank=0, impl="pallas")

        g = jax.jit(jax.shard_map(flush_rank, mesh=mesh, in_specs=(P("tp"), P(), P(), P()), out_specs=P("tp")),
                    donate_argnums=0, out_shardings=hs)
        st = {"h": g(host, src, si, hi)}
        back = jax.device_put(st["h"], ds)
        ok = bool(bt._pages_equal(back[0], hi, src, si))
        del back

        def run():
            st["h"] = g(st["h"], src, si, hi)
            return st["h"]

        m = bt.measure(run, 10, nbytes)
        res["flush_kernel_rank_index"] = {"ok": ok, "kind_after": st["h"].sharding.memory_kind, **m}
    except Exception as e:  # noqa: BLE001
        res["flush_kernel_rank_index"] = {"error": repr(e)[:600]}
    res["note"] = (f"a whole-pool copy would move {whole / 2**20:.0f} MiB (~{whole / 50e9 * 1e6:.0f} us at 50 GB/s); "
                   f"the fetch moves {nbytes / 2**20:.1f} MiB")


def probe_pin_capacity(res: dict):
    """Runs in this child: allocate 8 GiB pinned arrays until failure / cap; print progress as it goes."""
    jax, jnp, bt, pc, s_host, s_dev = _setup()
    step_gib = 8 if jax.default_backend() == "gpu" else 1
    mi = meminfo()
    cap = min(100.0, mi.get("MemAvailable", 100.0) - 16.0) if jax.default_backend() == "gpu" else 2.0
    res["meminfo_before"], res["cap_gib"], res["step_gib"] = mi, cap, step_gib
    elems = step_gib * GiB // 2
    mk = jax.jit(lambda: jnp.zeros((8, elems // 8), jnp.bfloat16), out_shardings=s_host)
    arrs, steps, t_all = [], [], time.perf_counter()
    budget = float(os.environ.get("PIN_BUDGET_S", "90"))
    while (len(arrs) + 1) * step_gib <= cap and time.perf_counter() - t_all < budget:
        t0 = time.perf_counter()
        try:
            a = jax.block_until_ready(mk())
        except Exception as e:  # noqa: BLE001
            res["failed_at_gib"] = (len(arrs) + 1) * step_gib
            res["error"] = repr(e)[:400]
            break
        arrs.append(a)
        steps.append({"total_gib": len(arrs) * step_gib, "s": round(time.perf_counter() - t0, 3),
                      "kind": a.sharding.memory_kind, "avail_gib": meminfo().get("MemAvailable")})
        res["steps"] = steps
        print("PIN", json.dumps(steps[-1]), flush=True)
    res["pinned_gib"] = len(arrs) * step_gib
    t0 = time.perf_counter()
    for a in arrs:
        a.delete()
    arrs.clear()
    res["free_s"] = round(time.perf_counter() - t0, 3)
    res["meminfo_after_free"] = meminfo()
    res["stopped_by"] = ("error" if "error" in res else "cap" if (len(steps) + 1) * step_gib > cap else "time")


RUNNERS = {
    "mosaic_read": lambda r: probe_mosaic(False, r),
    "mosaic_write": lambda r: probe_mosaic(True, r),
    "big_pools": probe_big_pools,
    "zero_miss_floor": probe_zero_miss,
    "shard_map": probe_shard_map,
    "pin_capacity": probe_pin_capacity,
}


# ------------------------------------------------------------------------------------------------ driver

def child(names: list[str], path: str):
    """Runs the probes in order, rewriting the JSON after each (a crash keeps what came before)."""
    import jax
    from scripts import bench_tiers as bt
    data = json.load(open(path)) if os.path.exists(path) else {}
    data.setdefault("info", bt.device_info())
    data.setdefault("meminfo", meminfo())
    for name in names:
        data.setdefault("probes", {})[name] = {"status": "started"}
        json.dump(data, open(path, "w"), indent=1, default=str)
        res = {}
        t0 = time.perf_counter()
        try:
            RUNNERS[name](res)
            res["status"] = "ok"
        except Exception as e:  # noqa: BLE001
            res["status"] = "error"
            res["error"] = repr(e)[:800]
            res["traceback"] = traceback.format_exc()[-1500:]
        res["seconds"] = round(time.perf_counter() - t0, 2)
        data["probes"][name] = res
        json.dump(data, open(path, "w"), indent=1, default=str)
        print(f"probe {name}: {res['status']} in {res['seconds']} s", flush=True)
        jax.clear_caches()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--only", default=",".join(PROBES))
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds for all probes together")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "probe_tiers.json")
    names = [n for n in args.only.split(",") if n]
    if args.child:
        child(names, path)
        return
    if os.path.exists(path):
        os.remove(path)
    t_end = time.time() + args.timeout
    todo = list(names)
    while todo:
        # pin_capacity always in its own process (an OOM kill must not take the other probes with it)
        batch = [n for n in todo if n != "pin_capacity"] or ["pin_capacity"]
        left = t_end - time.time()
        if left < 5:
            break
        cmd = [sys.executable, __file__, "--child", "--out", args.out, "--only", ",".join(batch)]
        try:
            proc = subprocess.run(cmd, timeout=max(5, left), check=False, capture_output=True, text=True)
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = "timeout"
            text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(text[-4000:], flush=True)
        data = json.load(open(path)) if os.path.exists(path) else {"probes": {}}
        pins = [json.loads(line[4:]) for line in text.splitlines() if line.startswith("PIN ")]
        done = [n for n in batch if data.get("probes", {}).get(n, {}).get("status") not in (None, "started")]
        crashed = [n for n in batch if data.get("probes", {}).get(n, {}).get("status") == "started"]
        for n in crashed:
            data["probes"][n] = {"status": f"crashed or timed out (child rc {rc})"}
            if n == "pin_capacity" and pins:
                data["probes"][n].update(steps=pins, pinned_gib=pins[-1]["total_gib"])
            json.dump(data, open(path, "w"), indent=1, default=str)
            done.append(n)
        todo = [n for n in todo if n not in done]
        if rc != 0 and not crashed and not done:
            break
    data = json.load(open(path)) if os.path.exists(path) else {}
    print(json.dumps(summarize(data), indent=1, default=str))


def summarize(data: dict) -> dict:
    """The answers, short."""
    p = data.get("probes", {})
    out = {"device": data.get("info", {}).get("device"), "jax": data.get("info", {}).get("jax")}
    for name, r in p.items():
        keep = {}
        for k, v in r.items():
            if isinstance(v, dict):
                keep[k] = {kk: v[kk] for kk in ("ok", "gbps", "device_us", "wall_us", "extra_device_us_per_fetch",
                                                "fetch_kernel_us_per_call", "kind_after", "error") if kk in v}
            elif k not in ("traceback", "steps"):
                keep[k] = v
        out[name] = keep
    return out


if __name__ == "__main__":
    main()
