"""One layer's sparse decode (select -> sieve -> fetch -> attend, `decode_layer.attend_layer`) against cuDNN dense
decode at the same shapes, and the cost of misses (issue 5, deliverable 4, layer rows).

Shapes (issue 5): B sequences, H=64 query heads, KV=8, D=128, bf16, page 64, one layer, context C tokens already
ingested (random K/V made on the device, distinct per sequence, written through the real ingestion path into the
pinned host pool and the key summaries). The layer function is jitted with the cache state donated and run as a
`fori_loop` of `--calls` calls inside one jit (the attention output feeds a checksum, so nothing is removed);
time per call = median wall time of the loop / calls.

Rows, same run:
- cudnn: `jax.nn.dot_product_attention(implementation="cudnn")` over the whole context, q [B, 1, H, D].
- layer, resident: the same q every call, so after the first call every selected page is in HBM (0 misses);
  Pallas sieve and the jnp reference sieve.
- layer, misses: every call first evicts all HBM copies of a fraction of the (sequence, KV group) pairs (PB-LRU
  slots emptied, vTLB entries cleared: `evict_units`), so those pairs' selected pages all miss (fresh random
  queries do not give controlled misses: with random keys the Quest bound favours the same wide pages for any
  query); the measured miss fraction (the layer's stats) is reported with the PCIe bytes per call and GB/s
  (every call of every variant runs the eviction pass, empty for the resident rows); both fetch strategies (a separate fetch kernel before attention, or the
  attention kernel reading misses from the host pool and storing them into their frames).
Before timing, one call of each variant is checked against the same call with every jnp reference (sieve, scores,
top-k, attention) and the separate fetch on a copy of the state (vTLB frames equal, outputs within 2e-2).
Also rows with lax.top_k instead of the radix top-k kernel and with the Triton attention kernel instead of the
Mosaic one (the default on Hopper), and a
split of the resident layer's time into stages.

Run (H200): python3 scripts/bench_layer.py --out DIR [--commit SHA]   -> DIR/layer.json, DIR/layer.png
Other shapes: --batch 8 --context 32768 --budgets 1024 2048 4096 --no-stages --no-compare --name layer_b8_32k
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from scripts.bench_meta import add_common_args, median_seconds, pyplot, run_meta, save_figure, write_json
from ulacache_jax.cache.state import CacheState
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.select import quest as selection
from ulacache_jax.cache.decode_layer import DecodeOptions, LayerStats, attend_layer, attend_pages, flush_tail, plan_layer
from ulacache_jax.pallas_kernels import on_gpu
from ulacache_jax.pallas_kernels.page_scores import pad_page_count, page_scores
from ulacache_jax.pallas_kernels.sparse_decode_attention import sparse_decode_attention
from ulacache_jax.pallas_kernels.pb_lru_sieve import sieve_geometry
from ulacache_jax.cache.pb_lru import EMPTY_TAG
from ulacache_jax.runtime.sequences import CacheManager

from scripts.bench_decode import synthetic_fill_sparse

H, KV, D, PAGE = 64, 8, 128, 64
DT = jnp.bfloat16


def make_cache(batch: int, ctx: int, budget: int, pool_steps: int, seed: int = 0) -> CacheManager:
    """A one-layer cache holding `batch` sequences of `ctx` tokens (random K/V through the ingestion path)."""
    pages = pad_page_count(ctx // PAGE + 2)   # room for the context and the decode's new tokens
    step_pages = batch * KV * (budget // PAGE)
    nb, ns = sieve_geometry(pool_steps * step_pages, step_pages)
    cfg = CacheConfig(num_layers=1, num_kv_heads=KV, head_dim=D, max_seqs=batch, max_pages_per_seq=pages,
                      page_size=PAGE, kv_heads_per_group=1, dtype="bfloat16", num_buckets=nb, slots_per_bucket=ns,
                      host_pages=batch * KV * pages, token_budget=budget, sink_pages=1, recent_pages=2)
    m = CacheManager(cfg)
    synthetic_fill_sparse(m, [m.admit(ctx + PAGE) for _ in range(batch)], ctx, seed, chunk=32768)
    jax.block_until_ready(m.state)
    return m


def copy_state(state: CacheState) -> CacheState:
    return jax.tree.map(lambda a: jnp.array(a, copy=True), state)


def evict_units(state: CacheState, cold) -> CacheState:
    """Forget every HBM copy of the pages of the (sequence, group) pairs where cold [B, G] is True: PB-LRU slots
    emptied, vTLB entries cleared. Their next selection misses entirely (a controlled miss fraction)."""
    pb, tb = state.pb, state.vtlb
    seq = (pb.tag_hi >> np.uint32(12)).astype(jnp.int32)
    grp = (pb.tag_hi & np.uint32(0xF)).astype(jnp.int32)
    b, g = cold.shape
    mine = (pb.stamp >= 0) & cold[jnp.clip(seq, 0, b - 1), jnp.clip(grp, 0, g - 1)] & (seq < b)
    pb = dataclasses.replace(pb, tag_hi=jnp.where(mine, EMPTY_TAG, pb.tag_hi),
                             tag_lo=jnp.where(mine, EMPTY_TAG, pb.tag_lo), stamp=jnp.where(mine, -1, pb.stamp))
    frame = jnp.where(cold[None, :, None, :, None], -1, tb.frame)                # [R, S, L, G, P]
    return dataclasses.replace(state, pb=pb, vtlb=dataclasses.replace(tb, frame=frame))


def layer_loop(options: DecodeOptions, calls: int, batch: int, ctx: int, host_sh):
    """jit(state, host, q, cold [B, KV] bool) -> (state, checksum, stats summed over the calls, host). Every call first
    evicts the cold pairs' pages (an empty mask costs the same elementwise pass), then runs the layer."""
    pos = jnp.full((batch,), ctx, jnp.int32)
    live = jnp.ones((batch,), bool)

    def run(state, host, q, cold):
        kn = jnp.zeros((batch, KV, D), DT)

        def body(i, carry):
            st, chk, tot = carry
            st = evict_units(st, cold)
            st, out, stats = attend_layer(st, host, 0, q, kn, kn, pos, live, options=options)
            return st, chk + out[0, 0, 0, 0].astype(jnp.float32), tot + stats

        st, chk, tot = lax.fori_loop(0, calls, body, (state, jnp.float32(0), LayerStats.zeros()))
        # as in the decode program: the host pool goes through the tail flush (nothing completes here, pos is
        # fixed), which XLA needs for a pinned_host input that kernels read (E1200 otherwise)
        st, host = flush_tail(st, host)
        return st, chk, tot, host

    return jax.jit(run, donate_argnums=(0, 1), out_shardings=(None, None, None, host_sh))


STAGES = ("scores", "select", "plan", "attention", "attention-mosaic")  # attention: the Triton kernel


def stage_loop(stage: str, options: DecodeOptions, calls: int, batch: int, ctx: int, host_sh):
    """jit(state, host, q, plan) -> (state, checksum, zero stats, host): `calls` runs of one part of the layer, to split the
    layer's time. scores: fold the queries and score every page (page_scores); select: + top-k selection; plan:
    everything before the attention kernel (append, select, sieve, vTLB, separate fetch: `plan_layer`); attention:
    the attention kernel alone over a fixed resident PagePlan (`attend_pages` with the Triton kernel on GPU);
    attention-mosaic: the same with the Mosaic GPU kernel (the reference on CPU for both). Each call's query depends on the
    previous call's checksum, so XLA cannot hoist a call out of the loop."""
    pos = jnp.full((batch,), ctx, jnp.int32)
    live = jnp.ones((batch,), bool)
    kn = jnp.zeros((batch, KV, D), DT)

    def one(st, host, q, plan):
        c = st.config
        if stage in ("scores", "select"):
            sc = page_scores(st.kmin[0], st.kmax[0], q, layer=0, impl=options.scores,
                             launch=options.score_launch, split=c.summary_split)               # [S, G, P]
            if stage == "scores":
                return st, sc[:, :, 0].sum()
            sel = selection.select_pages(sc, jnp.where(live, st.seqs.flushed, 0), select_pages=c.select_pages,
                                         sink_pages=c.sink_pages, recent_pages=c.recent_pages, impl=options.topk)
            return st, sel[:, :, 0].sum().astype(jnp.float32)
        if stage == "plan":
            st, pl_, _ = plan_layer(st, host, 0, q, kn, kn, pos, live, options=options)
            return st, pl_.frame[:, :, 0].sum().astype(jnp.float32)
        opt = dataclasses.replace(options, attention=kernel_impl("mosaic" if stage == "attention-mosaic" else "triton"))
        st, out = attend_pages(st, host, q, plan, options=opt)
        return st, out[0, 0, 0, 0].astype(jnp.float32)

    def run(state, host, q, plan):
        def body(i, carry):
            st, chk = carry
            st, x = one(st, host, q + (chk * 1e-30).astype(q.dtype), plan)
            return st, chk + x

        st, chk = lax.fori_loop(0, calls, body, (state, jnp.float32(0)))
        st, host = flush_tail(st, host)  # the pinned host pool goes back out (E1200 otherwise), as in layer_loop
        return st, chk, LayerStats.zeros(), host   # layer_loop's outputs, so time_loop times both

    return jax.jit(run, donate_argnums=(0, 1), out_shardings=(None, None, None, host_sh))


def kernel_impl(kernel: str) -> str:
    """The named attention kernel ('mosaic' or 'triton') on GPU; the jnp reference on CPU (Mosaic GPU has no CPU
    interpreter, and the Triton one in interpret mode would only make the CPU test slow)."""
    return {"mosaic": "mosaic", "triton": "pallas"}[kernel] if on_gpu() else "ref"


def resident_plan(m: CacheManager, options: DecodeOptions, q, batch, ctx):
    """The PagePlan of one call on a copy of the state after the pages are resident (the attention stage's input)."""
    pos = jnp.full((batch,), ctx, jnp.int32)
    live = jnp.ones((batch,), bool)
    kn = jnp.zeros((batch, KV, D), DT)

    def f(st, host):
        st, plan, stats = plan_layer(st, host, 0, q, kn, kn, pos, live, options=options)
        st, host = flush_tail(st, host)
        return st, plan, stats, host

    fn = jax.jit(f, donate_argnums=(0, 1), out_shardings=(None, None, None, m.host_shardings()))
    m.state, _, _, m.host = fn(m.state, m.host)        # bring the pages in
    st, plan, stats, m.host = fn(copy_state(m.state), m.host)
    assert int(stats.misses) == 0, f"resident plan has {int(stats.misses)} misses"
    return plan


def check_variant(m: CacheManager, options: DecodeOptions, q, batch, ctx) -> dict:
    """One call of the variant and of the all-reference layer on copies of the state: frames and outputs."""
    pos = jnp.full((batch,), ctx, jnp.int32)
    live = jnp.ones((batch,), bool)
    kn = jnp.zeros((batch, KV, D), DT)
    # the host pool is an argument (a closure would bake it into the program as a constant), donated and returned
    # in host memory as in the decode program (XLA requires a pinned_host input the program reads to come back)
    def call(opt):
        def f(st, host):
            st, o, stats = attend_layer(st, host, 0, q, kn, kn, pos, live, options=opt)
            st, host = flush_tail(st, host)
            return st, o, stats, host
        return jax.jit(f, donate_argnums=(0, 1), out_shardings=(None, None, None, m.host_shardings()))

    # reference: the jnp sieve, scores, top-k and attention with the separate fetch (every page is in HBM by then,
    # overflow staged, so the jnp attention never reads the pinned host pool, which XLA rejects on GPU: E1200)
    ref_opt = DecodeOptions(sieve="ref", scores="ref", topk="ref", attention="ref", fused_fetch=False)
    s1, o1, st1, m.host = call(options)(copy_state(m.state), m.host)
    s2, o2, st2, m.host = call(ref_opt)(copy_state(m.state), m.host)
    o1, o2 = np.asarray(o1, np.float32), np.asarray(o2, np.float32)
    rel = float(np.abs(o1 - o2).max() / max(1e-6, np.abs(o2).max()))
    same_frames = bool(jnp.array_equal(s1.vtlb.frame, s2.vtlb.frame))
    return dict(rel_err_vs_ref=rel, frames_equal_ref=same_frames, misses_first_call=int(st1.misses),
                ok=bool(rel < 2e-2 and same_frames and int(st1.misses) == int(st2.misses)))


def time_loop(fn, m: CacheManager, q0, extra, reps: int, calls: int):
    """Median seconds per call (wall of the whole loop / calls) and the stats of one loop; fn is a layer_loop
    (extra = the cold mask) or a stage_loop (extra = the PagePlan)."""
    last = {}

    def run():  # the state and the host pool are donated: each loop continues from the previous one
        m.state, chk, last["tot"], m.host = fn(m.state, m.host, q0, extra)
        return m.state, chk

    # the warm-up call compiles and brings the pages in
    t = median_seconds(run, reps, per_call=calls)
    return t.median_s, jax.tree.map(int, last["tot"])


def cudnn_time(batch: int, ctx: int, reps: int) -> dict:
    """cuDNN dense decode over the whole context (K/V tiled from a random block on the device)."""
    blk = jax.random.normal(jax.random.key(7), (batch, 2048, KV, D), DT)
    tile = jax.jit(lambda x: jnp.tile(x, (1, ctx // 2048, 1, 1)))
    k, v = tile(blk), tile(blk * 0.5)
    q = jax.random.normal(jax.random.key(8), (batch, 1, H, D), DT)
    # correctness where it is cheap: one sequence's first 8K tokens against XLA's attention
    att = lambda q, k, v, impl: jax.nn.dot_product_attention(q, k, v, implementation=impl)
    impl = "cudnn" if on_gpu() else "xla"
    ks, vs = k[:1, :8192], v[:1, :8192]
    a = np.asarray(jax.jit(att, static_argnums=3)(q[:1], ks, vs, impl), np.float32)
    b = np.asarray(jax.jit(att, static_argnums=3)(q[:1], ks, vs, "xla"), np.float32)
    err = float(np.abs(a - b).max() / np.abs(b).max())
    n = 8

    @jax.jit
    def loop(q, k, v):
        def body(i, c):
            o = jax.nn.dot_product_attention(q + c.astype(q.dtype), k, v, implementation=impl)
            return c + o[0, 0, 0, 0].astype(jnp.float32) * 1e-30
        return lax.fori_loop(0, n, body, jnp.float32(0))

    sec = median_seconds(lambda: loop(q, k, v), reps, per_call=n).median_s
    nbytes = 2 * batch * ctx * KV * D * 2
    del k, v
    return dict(us=sec * 1e6, kv_gb=nbytes / 1e9, tb_s=nbytes / sec / 1e12, rel_err_vs_xla_8k=err, impl=impl)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=262144)
    p.add_argument("--budgets", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--miss-units", type=float, nargs="*", default=[0.01, 0.1, 0.3],
                   help="target miss fractions (fraction of (sequence, group) pairs evicted before every call)")
    p.add_argument("--pool-steps", type=int, default=4, help="HBM frames = this many steps' selections")
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-stages", dest="stages", action="store_false",
                   help="skip the split of the resident layer's time into scores / select / plan / attention")
    p.add_argument("--name", default="layer", help="output file stem")
    p.add_argument("--no-compare", dest="compare", action="store_false",
                   help="only the default layer per budget (no reference-sieve, lax.top_k, Triton-attention or miss rows)")
    p.add_argument("--score-launch", type=int, nargs=2, default=None, metavar=("BLOCK_PAGES", "WARPS"),
                   help="score kernel launch shape for every variant (scripts/pick_launch.py reads bench_select's)")
    p.add_argument("--topk", default="auto", help="page top-k of every row but resident-lax-topk: auto "
                   "(the radix kernel on GPU), ref (lax.top_k) or pallas")
    return add_common_args(p, files="NAME.json, NAME.png (--name)")


def main(argv=None):
    from ulacache_jax.cache.state import raise_host_limit
    raise_host_limit()  # before JAX starts: XLA's pinned host pool is 64 GiB by default
    a = build_parser().parse_args(argv)
    launch = tuple(a.score_launch) if a.score_launch else None
    os.makedirs(a.out, exist_ok=True)
    res = run_meta(a.commit, shapes=dict(B=a.batch, H=H, KV=KV, D=D, page=PAGE, context=a.context),
                   score_launch=launch, topk=a.topk, rows=[])
    path = os.path.join(a.out, f"{a.name}.json")

    def add(row):
        row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        write_json(path, res)

    t0 = time.perf_counter()
    cd = cudnn_time(a.batch, a.context, a.reps)
    add(dict(kind="cudnn", budget=None, **cd))
    t1 = time.perf_counter()
    m = make_cache(a.batch, a.context, max(a.budgets), a.pool_steps)
    res["setup_s"] = dict(cudnn=round(t1 - t0, 1), cache=round(time.perf_counter() - t1, 1))
    page_bytes = 2 * PAGE * D * 2                                                      # K + V of one page
    q0 = jax.random.normal(jax.random.key(1), (a.batch, 1, H, D), DT)
    rng = np.random.default_rng(0)
    # the default layer at every budget first, then (first budget) the comparison rows, the stage split and
    # the miss rows:
    # a run cut by its time limit keeps the rows the issue asks for
    todo = [(b, ("resident", "pallas", False, 0.0)) for b in a.budgets]
    if a.compare:  # sieve, top-k, attention and miss rows at the first budget
        # the reference sieve, lax.top_k instead of the radix kernel, and the Triton attention for Mosaic's
        todo += [(a.budgets[0], v) for v in [
            ("resident", "ref", False, 0.0), ("resident-lax-topk", "pallas", False, 0.0),
            ("resident-triton", "pallas", False, 0.0)]]
    if a.stages:
        todo.append((a.budgets[0], ("stages", None, False, 0.0)))
    if a.compare:
        todo += [(a.budgets[0], ("misses", "pallas", fused, f)) for f in a.miss_units for fused in (False, True)]
    for budget, (kind, sieve, fused, frac) in todo:
        m.state = dataclasses.replace(m.state, config=dataclasses.replace(m.config, token_budget=budget))
        m.config = m.state.config
        attended = a.batch * KV * (budget // PAGE + 2) * page_bytes                       # selected + tail pages
        if kind != "stages":
            topk = "ref" if "lax-topk" in kind else a.topk
            opt = DecodeOptions(sieve=sieve, fused_fetch=fused, topk=topk, score_launch=launch,
                                attention=kernel_impl("triton") if "triton" in kind else "auto")
            units = max(1, int(round(frac * a.batch * KV))) if frac else 0
            cold = np.zeros(a.batch * KV, bool)
            cold[rng.choice(a.batch * KV, min(units, a.batch * KV), replace=False)] = True
            cold = jnp.asarray(cold.reshape(a.batch, KV))
            row = dict(kind=kind, budget=budget, sieve=sieve, fused_fetch=fused, target_miss=frac, topk=topk)
            try:
                row.update(check_variant(m, opt, q0, a.batch, a.context))
                fn = layer_loop(opt, a.calls, a.batch, a.context, m.host_shardings())
                sec, tot = time_loop(fn, m, q0, cold, a.reps, a.calls)
                req = tot.hits + tot.misses
                miss = tot.misses / max(1, req)
                pcie = tot.misses * page_bytes / a.calls
                row.update(us=sec * 1e6, miss_fraction=miss, pcie_mb_per_call=pcie / 1e6,
                           pcie_gb_s=pcie / sec / 1e9, attended_tb_s=attended / sec / 1e12,
                           speedup_vs_cudnn=cd["us"] / (sec * 1e6))
            except Exception as e:  # one variant failing must not lose the others
                row["error"] = repr(e)[:400]
            add(row)
            continue
        # the stage split: where the resident layer's time goes
        opt = DecodeOptions(sieve="pallas", topk=a.topk, score_launch=launch)
        plan = resident_plan(m, opt, q0, a.batch, a.context)
        summ = a.batch * KV * m.config.max_pages_per_seq * 2 * D * 2                   # kmin + kmax bytes
        # the Mosaic attention against the jnp reference on the resident pages first
        hbm = lambda impl: jax.jit(lambda st, pp: sparse_decode_attention(
            q0, st.pool_k[0], st.pool_v[0], pp.frame, pp.start, pp.seq_len, page_src=pp.src,
            impl=impl))(m.state, plan).astype(jnp.float32)
        try:
            o_k, o_r = np.asarray(hbm(kernel_impl("mosaic"))), np.asarray(hbm("ref"))
            hbm_err = float(np.abs(o_k - o_r).max() / max(1e-6, np.abs(o_r).max()))
        except Exception as e:  # the Mosaic kernel failing must not lose the other stages
            hbm_err = repr(e)[:400]
        for stage in STAGES:
            row = dict(kind="stage", stage=stage, budget=budget, sieve="pallas", fused_fetch=False)
            try:
                sec, _ = time_loop(stage_loop(stage, opt, a.calls, a.batch, a.context, m.host_shardings()),
                                   m, q0, plan, a.reps, a.calls)
                row.update(us=sec * 1e6, speedup_vs_cudnn=cd["us"] / (sec * 1e6))
                if stage == "scores":
                    row["summaries_tb_s"] = summ / sec / 1e12
                if stage.startswith("attention"):
                    row["attended_tb_s"] = attended / sec / 1e12
                if stage == "attention-mosaic":
                    if isinstance(hbm_err, str):
                        raise RuntimeError(f"check against the reference failed: {hbm_err}")
                    row.update(rel_err_vs_ref=hbm_err, ok=hbm_err < 2e-2)
            except Exception as e:
                row["error"] = repr(e)[:400]
            add(row)
    res["total_s"] = round(time.perf_counter() - t0, 1)
    write_json(path, res)
    plot(res, os.path.join(a.out, f"{a.name}.png"))
    print(f"\ncuDNN dense decode B={a.batch} ctx={a.context}: {cd['us']:.1f} us ({cd['tb_s']:.2f} TB/s)")
    print("| kind | budget | sieve | fused fetch | miss % | us/call | PCIe GB/s | x cuDNN | check |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"][1:]:
        if r["kind"] == "stage":
            continue
        if "error" in r:
            print(f"| {r['kind']} | {r['budget']} | {r['sieve']} | {r['fused_fetch']} | ERROR {r['error'][:60]} |")
            continue
        print(f"| {r['kind']} | {r['budget']} | {r['sieve']} | {r['fused_fetch']} | {100 * r['miss_fraction']:.1f} | "
              f"{r['us']:.1f} | {r['pcie_gb_s']:.1f} | {r['speedup_vs_cudnn']:.1f} | {r['ok']} |")
    stages = [r for r in res["rows"] if r["kind"] == "stage"]
    if stages:
        print("\n| stage (resident, budget %d) | us/call | TB/s |" % stages[0]["budget"])
        print("|---|---|---|")
        for r in stages:
            bw = r.get("summaries_tb_s", r.get("attended_tb_s", ""))
            print(f"| {r['stage']} | {r.get('us', float('nan')):.1f} | {bw if bw == '' else round(bw, 2)} |"
                  + (f" ERROR {r['error'][:80]}" if "error" in r else ""))
    return res


def plot(res, path):
    plt = pyplot()
    rows = [r for r in res["rows"] if r["kind"] in ("resident", "misses") and "us" in r]  # the plot's lines
    cd = res["rows"][0]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for budget in sorted({r["budget"] for r in rows}):
        for fused, style in ((False, "o-"), (True, "s--")):
            pts = sorted((100 * r["miss_fraction"], r["us"]) for r in rows if r["budget"] == budget
                         and r["sieve"] == "pallas" and r["fused_fetch"] == fused)
            if pts:
                ax.plot(*zip(*pts), style, label=f"layer, budget {budget}, {'fused' if fused else 'separate'} fetch")
    if "us" in cd:
        ax.axhline(cd["us"], color="k", ls=":", label=f"cuDNN dense decode ({cd['us']:.0f} us)")
    ax.set_yscale("log")
    ax.set_xlabel("selected pages missing from HBM (%)")
    ax.set_ylabel("us per layer call")
    s = res["shapes"]
    ax.set_title(f"select+sieve+attend, B={s['B']} ctx={s['context'] // 1024}K, {res['device']}", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
