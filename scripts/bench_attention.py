"""Benchmark of the sparse decode attention kernel on the H200 (issue 5, deliverable 4, kernel rows).

One run measures, on the same device: the copy ceiling (XLA elementwise over a donated 4 GiB buffer, and a torch
D2D copy when torch is there); our kernel over the selected pages (B in {8, 32}, H=64, KV=8, D=128, bf16, page
64, budgets 1024/2048/4096 tokens + 2 tail pages, contexts 32K/128K/256K, frame tables random permutations);
the Pallas `paged_attention` op on the same selected pages (page 16); cuDNN dense decode at the full contexts;
misses served from a pinned_host pool (zero-copy read, fused read+store, separate fetch kernel then attention);
and a Mosaic GPU page walk (TMA pipeline, no attention math) as the bound a Mosaic kernel could reach. `token`:
the per-token kernel (token_decode_attention; B in {3, 8}, page 16, g = 1, budgets 2048/4096/8192 tokens + 2 tail
pages' rows, drawn at random rows of random frames of a 4 GB pool) against the page kernel over the same number of
tokens as whole pages, and the token kernel over those pages' rows (gather cost apart from per-token work); it
runs `ceiling` first. Every kernel is checked against the reference before it is timed.

An existing OUT/attention.json is extended, not replaced: the sections this run does not measure are kept, each
with the meta of the run that measured it (`kept_sections`); --fresh replaces the file whole.

Run (H200): python3 -m scripts.bench_attention --out DIR   (writes attention.json and attention.png to DIR)
           python3 -m scripts.bench_attention --only ceiling token --out DIR   (the token rows alone)
Import: `from scripts.bench_attention import main; main(["--only", "kernel"], extra_sections=[fn])`, where
fn(ctx) -> list of row dicts; ctx is a `BenchContext` (timer, selection builder, ceiling) so that the integrator
can add layer-level rows (select + sieve + attend) to the same run and JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import time
import warnings

import numpy as np
import jax
import jax.numpy as jnp

from scripts.bench_meta import (add_common_args, median_seconds, pyplot, run_meta, save_figure, time_chain,
                                write_json)
from ulacache_jax.pallas_kernels import page_copy
from ulacache_jax.pallas_kernels import sparse_decode_attention as sda
from ulacache_jax.pallas_kernels import token_decode_attention as tda

H, KV, D, PAGE, TAIL = 64, 8, 128, 64, 2
R = H // KV
DT = jnp.bfloat16
SECTIONS = ("ceiling", "kernel", "sweep", "msweep", "paged", "cudnn", "miss", "mosaic", "token")


# ----------------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------------
def rel_err(a, b):
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


# ----------------------------------------------------------------------------------------------------------------
# workload
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Selection:
    q: jax.Array           # [B, 1, H, D]
    pool_k: jax.Array      # [F, page, 1, D]
    pool_v: jax.Array
    frame: jax.Array       # [B, G, K] int32
    start: jax.Array       # [B, G, K] int32
    seq_len: jax.Array     # [B] int32
    frame_np: np.ndarray
    start_np: np.ndarray
    tokens: int            # attended tokens summed over (b, group)
    slots: int             # K

    @property
    def bytes(self) -> int:  # K and V bytes of the attended tokens
        return self.tokens * D * 2 * 2


def make_selection(batch, budget, ctx, seed=0, spare_frac=0.125) -> Selection:
    """Per (b, group): the sink page, budget/page - 1 random pages, and the 2 tail pages (the last one partial);
    slots shuffled; frames a random permutation of a pool sized to hold them plus 1/8 spare frames (NaN)."""
    rng = np.random.default_rng(seed)
    seq_len = ctx - 17
    n_pages = -(-seq_len // PAGE)
    n_sel = budget // PAGE
    k = n_sel + TAIL
    g = KV
    start = np.empty((batch, g, k), np.int32)
    for b in range(batch):
        for grp in range(g):
            mid = rng.choice(np.arange(1, n_pages - TAIL), n_sel - 1, replace=False)
            pages = np.concatenate([[0], mid, [n_pages - 2, n_pages - 1]])
            start[b, grp] = rng.permutation(pages) * PAGE
    used = batch * g * k
    nf = used + int(used * spare_frac)
    perm = rng.permutation(nf).astype(np.int32)
    frame = perm[:used].reshape(batch, g, k)
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    pool_k = jax.random.normal(k1, (nf, PAGE, 1, D), DT)
    pool_v = jax.random.normal(k2, (nf, PAGE, 1, D), DT)
    spare = jnp.asarray(perm[used:])
    pool_k = pool_k.at[spare].set(jnp.nan)
    pool_v = pool_v.at[spare].set(jnp.nan)
    q = jax.random.normal(k3, (batch, 1, H, D), DT)
    last_fill = seq_len - (n_pages - 1) * PAGE
    tokens = batch * g * ((k - 1) * PAGE + last_fill)
    return Selection(q=q, pool_k=pool_k, pool_v=pool_v, frame=jnp.asarray(frame), start=jnp.asarray(start),
                     seq_len=jnp.full((batch,), seq_len, jnp.int32), frame_np=frame, start_np=start,
                     tokens=tokens, slots=k)


# ----------------------------------------------------------------------------------------------------------------
# context handed to sections (also to the integrator's extra sections)
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class BenchContext:
    args: argparse.Namespace
    results: dict
    t_start: float
    time_chain = staticmethod(time_chain)
    make_selection = staticmethod(make_selection)
    rel_err = staticmethod(rel_err)

    def time_left(self) -> float:
        return self.args.deadline - (time.perf_counter() - self.t_start)

    @property
    def ceiling_tbs(self) -> float | None:
        c = self.results.get("ceiling", {})
        vals = [v for k, v in c.items() if k.endswith("_tbs") and v]
        return max(vals) if vals else None

    mosaic_broken: bool = False
    kept: dict = dataclasses.field(default_factory=dict)   # sections of OUT's earlier file this run does not measure

    def best_tuning(self, batch, budget, section="sweep"):
        """The fastest swept tuning for (batch, budget) when this run swept it, else None (library default)."""
        rows = [r for r in self.results.get(section, []) if r["batch"] == batch and r["budget"] == budget
                and "us" in r and r.get("rel_err", 1) < 2e-2]
        return json.loads(min(rows, key=lambda r: r["us"])["tuning"]) if rows else None

    def add(self, section, row):
        row = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}
        self.results.setdefault(section, []).append(row)
        print(f"[{section}] " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        self.save()   # after every row: a section cut by the call's time limit keeps the rows it measured
        return row

    def merged(self) -> dict:
        """What attention.json holds: this run's results, and the earlier file's sections this run does not measure
        (`kept_sections`). Kept sections stay out of `results`: this run's ceiling and tunings are its own."""
        return {**self.results, **{k: v for k, v in self.kept.items() if k not in self.results}}

    def save(self):
        if self.args.out:
            write_json(os.path.join(self.args.out, "attention.json"), self.merged())


def attn_step(tuning=None, impl="pallas"):
    def step(q, pk, pv, frame, start, seq_len):
        return sda.sparse_decode_attention(q, pk, pv, frame, start, seq_len, impl=impl, tuning=tuning)
    return step


# ----------------------------------------------------------------------------------------------------------------
# sections
# ----------------------------------------------------------------------------------------------------------------
def section_ceiling(ctx: BenchContext):
    n = 2 ** 31  # 4 GiB of bf16
    x = jnp.zeros((n,), DT) + 1
    add = jax.jit(lambda a: a + 1, donate_argnums=0)
    box = [x]

    def step():  # the array is donated: each call consumes the previous result
        box[0] = add(box[0])
        return box[0]
    t = median_seconds(step, 5).median_s
    out = {"xla_elementwise_4GiB_s": t, "xla_elementwise_tbs": 2 * n * 2 / t / 1e12}
    box.clear()
    del x
    try:
        import torch
        if torch.cuda.is_available():
            src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
            dst = torch.empty_like(src)
            for _ in range(3):
                dst.copy_(src)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = []
            for _ in range(10):
                e0.record()
                dst.copy_(src)
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) / 1e3)
            t = statistics.median(ts)
            out.update(torch_d2d_copy_4GiB_s=t, torch_d2d_copy_tbs=2 * n * 2 / t / 1e12)
            del src, dst
            torch.cuda.empty_cache()
    except Exception as e:  # torch absent or no room: the XLA number stands alone
        out["torch_error"] = repr(e)[:200]
    ctx.results["ceiling"] = out
    print("[ceiling]", out, flush=True)


def check_kernel(sel: Selection, tuning=None, impl="pallas", ref=None):
    out = jax.jit(attn_step(tuning, impl))(sel.q, sel.pool_k, sel.pool_v, sel.frame, sel.start, sel.seq_len)
    if ref is None:
        ref = jax.jit(sda.ref_sparse_decode_attention)(sel.q, sel.pool_k, sel.pool_v, sel.frame, sel.start,
                                                       sel.seq_len)
    return rel_err(out, ref), ref


def section_kernel(ctx: BenchContext):
    a = ctx.args
    for b in a.batches:
        for budget in a.budgets:
            for i, c in enumerate(a.contexts):
                if a.kernel_rows is not None and (b, budget, c) not in a.kernel_rows:
                    continue
                if ctx.time_left() < 0:
                    ctx.add("kernel", dict(batch=b, budget=budget, context=c, skipped="deadline"))
                    continue
                sel = make_selection(b, budget, c, seed=b + budget + i)
                ref = None
                for impl in a.impls:
                    if impl == "mosaic" and ctx.mosaic_broken:
                        continue
                    if impl == "mosaic":
                        tune = ctx.best_tuning(b, budget, "msweep") or sda.default_mosaic_tuning(b, KV, sel.slots)
                    else:
                        tune = ctx.best_tuning(b, budget) or sda.default_tuning(b, KV, sel.slots, PAGE)
                    try:
                        err, ref = check_kernel(sel, tune, impl, ref)
                        t, _ = time_chain(attn_step(tune, impl), sel.q, sel.pool_k, sel.pool_v, sel.frame, sel.start,
                                          sel.seq_len)
                    except Exception as e:
                        ctx.add("kernel", dict(impl=impl, batch=b, budget=budget, context=c, error=repr(e)[:300]))
                        continue
                    ceil = ctx.ceiling_tbs
                    ctx.add("kernel", dict(impl=impl, batch=b, budget=budget, context=c, slots=sel.slots, rel_err=err,
                                           us=t * 1e6, attended_mb=sel.bytes / 1e6, tbs=sel.bytes / t / 1e12,
                                           frac_ceiling=(sel.bytes / t / 1e12 / ceil) if ceil else None,
                                           tuning=json.dumps(tune)))
                del sel, ref
        ctx.save()


def section_sweep(ctx: BenchContext):
    grid = []
    for npb in (1, 2, 4):                      # B=32, budget 4096: the 3.0 TB/s target row
        for ns in (2, 4, 8):
            grid.append((32, 4096, dict(num_splits=ns, pages_per_block=npb, num_warps=4, num_stages=2)))
    for npb, ns, nw, st in ((2, 4, 4, 3), (2, 4, 8, 2), (4, 4, 8, 2), (4, 4, 4, 3), (2, 4, 4, 1)):
        grid.append((32, 4096, dict(num_splits=ns, pages_per_block=npb, num_warps=nw, num_stages=st)))
    for npb, ns in ((1, 8), (1, 16), (2, 8), (2, 16), (4, 16)):
        grid.append((8, 4096, dict(num_splits=ns, pages_per_block=npb, num_warps=4, num_stages=2)))
    for npb, ns in ((1, 2), (1, 4), (2, 2), (2, 4)):
        grid.append((32, 1024, dict(num_splits=ns, pages_per_block=npb, num_warps=4, num_stages=2)))
    sels = {}
    for b, budget, tune in grid:
        if ctx.time_left() < 0:
            ctx.add("sweep", dict(batch=b, budget=budget, tuning=json.dumps(tune), skipped="deadline"))
            continue
        if (b, budget) not in sels:
            sels[(b, budget)] = make_selection(b, budget, 131072, seed=7)
        sel = sels[(b, budget)]
        try:
            err, _ = check_kernel(sel, tune)
            t, _ = time_chain(attn_step(tune), sel.q, sel.pool_k, sel.pool_v, sel.frame, sel.start, sel.seq_len,
                              reps=5)
            ctx.add("sweep", dict(batch=b, budget=budget, rel_err=err, us=t * 1e6, tbs=sel.bytes / t / 1e12,
                                  tuning=json.dumps(tune)))
        except Exception as e:
            ctx.add("sweep", dict(batch=b, budget=budget, tuning=json.dumps(tune), error=repr(e)[:300]))
    ctx.save()


def section_msweep(ctx: BenchContext):
    """Mosaic kernel: check, then a few splits / pipeline depths. A failed check marks Mosaic broken for the run."""
    for b, budget in ((32, 4096), (8, 4096)):
        sel = make_selection(b, budget, 131072, seed=11)
        base = sda.default_mosaic_tuning(b, KV, sel.slots)["num_splits"]
        ref = None
        for ns in ((base, 2 * base) if b == 32 else (base,)):
            for nconc in (2, 3):
                if ctx.time_left() < 0 or ctx.mosaic_broken:
                    continue
                tune = dict(num_splits=ns, max_concurrent_steps=nconc)
                try:
                    err, ref = check_kernel(sel, tune, "mosaic", ref)
                    if not err < 2e-2:
                        ctx.mosaic_broken = True
                    t, _ = time_chain(attn_step(tune, "mosaic"), sel.q, sel.pool_k, sel.pool_v, sel.frame, sel.start,
                                      sel.seq_len, reps=5)
                    ctx.add("msweep", dict(batch=b, budget=budget, rel_err=err, us=t * 1e6,
                                           tbs=sel.bytes / t / 1e12, tuning=json.dumps(tune)))
                except Exception as e:
                    ctx.mosaic_broken = True
                    ctx.add("msweep", dict(batch=b, budget=budget, tuning=json.dumps(tune), error=repr(e)[:1500]))
        del sel, ref
    ctx.save()


def paged_inputs(sel: Selection, sub=16, k_splits=16, ppcb=4):
    """The same selection for `paged_attention`: one batch row per (b, group), pages in position order, page 16."""
    b, g, k = sel.frame_np.shape
    order = np.argsort(sel.start_np, axis=-1)
    fr = np.take_along_axis(sel.frame_np, order, -1)                     # [B, G, K] by position
    per = PAGE // sub
    table = (fr[..., None] * per + np.arange(per)).reshape(b * g, k * per)
    mult = k_splits * ppcb
    pad = -table.shape[1] % mult
    table = np.pad(table, ((0, 0), (0, pad)), mode="edge").astype(np.int32)  # masked by length; never a NaN frame
    seq_len = int(sel.seq_len[0])
    n_pages = -(-seq_len // PAGE)
    lengths = np.full((b * g,), (k - 1) * PAGE + seq_len - (n_pages - 1) * PAGE, np.int32)
    nf = sel.pool_k.shape[0]
    kp = sel.pool_k.reshape(1, nf * per, sub, D)
    vp = sel.pool_v.reshape(1, nf * per, sub, D)
    qp = sel.q.reshape(b * g, R, D) * (1.0 / math.sqrt(D))  # paged_attention applies no softmax scale
    return qp, kp, vp, jnp.asarray(table), jnp.asarray(lengths)


def section_paged(ctx: BenchContext):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu import paged_attention as pa
    a = ctx.args
    mine = {}
    for r in ctx.results.get("kernel", []):
        if "us" in r:
            mine.setdefault((r["batch"], r["budget"], r["impl"]), []).append(r["us"])
    for b in a.batches:
        for budget in a.budgets:
            if ctx.time_left() < 0:
                ctx.add("paged", dict(batch=b, budget=budget, skipped="deadline"))
                continue
            sel = make_selection(b, budget, 131072, seed=b + budget + 1)
            qp, kp, vp, table, lengths = paged_inputs(sel)
            fn = functools.partial(pa.paged_attention, block_h=16, pages_per_compute_block=4, k_splits=16,
                                   interpret=jax.devices()[0].platform != "gpu")
            try:
                got = fn(qp, kp, vp, table, lengths).reshape(sel.q.shape)
                err = rel_err(got, attn_step()(sel.q, sel.pool_k, sel.pool_v, sel.frame, sel.start, sel.seq_len))
                t, _ = time_chain(lambda q, *r: fn(q, *r), qp, kp, vp, table, lengths)
                sp = {f"speedup_{impl}": t * 1e6 / statistics.median(mine[(b, budget, impl)])
                      for impl in a.impls if (b, budget, impl) in mine}
                ctx.add("paged", dict(batch=b, budget=budget, rel_err_vs_ours=err, us=t * 1e6,
                                      tbs=sel.bytes / t / 1e12, **sp))
            except Exception as e:
                ctx.add("paged", dict(batch=b, budget=budget, error=repr(e)[:300]))
            del sel, qp, kp, vp
    ctx.save()


def section_cudnn(ctx: BenchContext):
    a = ctx.args
    for b in a.batches:
        for c in a.contexts:
            if ctx.time_left() < 0:
                ctx.add("cudnn", dict(batch=b, context=c, skipped="deadline"))
                continue
            nbytes = 2 * b * c * KV * D * 2
            try:
                key = jax.random.key(b + c)
                blk = jax.random.normal(key, (b, 2048, KV, D), DT)
                tile = jax.jit(lambda x: jnp.tile(x, (1, c // 2048, 1, 1)))
                k = tile(blk)
                v = tile(blk * 0.5)
                q = jax.random.normal(jax.random.key(1), (b, 1, H, D), DT)
                fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
                if b * c <= 8 * 32768:  # check against XLA's attention where that is cheap
                    err = rel_err(jax.jit(fn)(q, k, v), jax.nn.dot_product_attention(q, k, v, implementation="xla"))
                else:
                    err = None
                t, _ = time_chain(fn, q, k, v, target_s=0.02, reps=5, max_n=8)
                ctx.add("cudnn", dict(batch=b, context=c, rel_err_vs_xla=err, us=t * 1e6, kv_gb=nbytes / 1e9,
                                      tbs=nbytes / t / 1e12))
                del k, v, blk
            except Exception as e:
                ctx.add("cudnn", dict(batch=b, context=c, error=repr(e)[:300]))
    ctx.save()


def section_miss(ctx: BenchContext):
    from ulacache_jax.cache.state import host_sharding
    hs = host_sharding()
    a = ctx.args
    for b, budget in a.miss_configs:
        if ctx.time_left() < 0:
            ctx.add("miss", dict(batch=b, budget=budget, skipped="deadline"))
            continue
        sel = make_selection(b, budget, 131072, seed=99 + budget)
        g, k = KV, sel.slots
        n_used = b * g * k
        rng = np.random.default_rng(5)
        host_of = rng.permutation(n_used).astype(np.int32).reshape(b, g, k)  # host copy of every selected page
        flat_fr = sel.frame_np.reshape(-1)
        hk = jnp.zeros((n_used, PAGE, 1, D), DT).at[jnp.asarray(host_of.reshape(-1))].set(sel.pool_k[flat_fr])
        hv = jnp.zeros((n_used, PAGE, 1, D), DT).at[jnp.asarray(host_of.reshape(-1))].set(sel.pool_v[flat_fr])
        hk, hv = jax.device_put(hk, hs), jax.device_put(hv, hs)
        page_host = jnp.asarray(host_of)
        t_res, out_res = {}, None
        for impl in a.impls:   # all-resident baselines (the fused path is Triton-only; separate can use either)
            if impl == "mosaic" and ctx.mosaic_broken:
                continue
            try:
                t_res[impl], _ = time_chain(attn_step(None, impl), sel.q, sel.pool_k, sel.pool_v, sel.frame,
                                            sel.start, sel.seq_len)
            except Exception as e:
                ctx.add("miss", dict(batch=b, budget=budget, variant=f"resident_{impl}", error=repr(e)[:300]))
                continue
            if out_res is None:
                out_res = jax.jit(attn_step(None, impl))(sel.q, sel.pool_k, sel.pool_v, sel.frame, sel.start,
                                                         sel.seq_len)
            ctx.add("miss", dict(batch=b, budget=budget, variant=f"resident_{impl}", miss_frac=0.0,
                                 us=t_res[impl] * 1e6, host_memory_kind=str(hk.sharding.memory_kind)))
        non_tail = np.argsort(sel.start_np, axis=-1)[..., :k - TAIL]  # slots of non-tail pages
        for frac in a.miss_fracs:
            if ctx.time_left() < 0 or out_res is None:
                ctx.add("miss", dict(batch=b, budget=budget, miss_frac=frac, skipped="deadline"))
                continue
            n_miss = max(1, int(round(frac * (k - TAIL))))
            src = np.ones((b, g, k), np.int32)
            for bi in range(b):
                for gi in range(g):
                    src[bi, gi, rng.choice(non_tail[bi, gi], n_miss, replace=False)] = 3
            miss_pages = int((src == 3).sum())
            miss_bytes = miss_pages * PAGE * D * 2 * 2
            src_j = jnp.asarray(src)
            src2 = jnp.asarray(np.where(src == 3, 2, src).astype(np.int32))

            def zero_copy(q, pk, pv, fr, st, sl, hk, hv):
                return sda.sparse_decode_attention(q, pk, pv, fr, st, sl, host_k=hk, host_v=hv, page_host=page_host,
                                                   page_src=src2, impl="pallas")

            def fused(c, fr, st, sl, hk, hv):
                q, pk, pv = c
                return sda.sparse_decode_attention(q, pk, pv, fr, st, sl, host_k=hk, host_v=hv, page_host=page_host,
                                                   page_src=src_j, impl="pallas", store_misses=True)

            miss_fr = jnp.asarray(np.where(src == 3, sel.frame_np, -1).reshape(-1))
            miss_hp = jnp.asarray(host_of.reshape(-1))
            sel_idx = np.nonzero((src == 3).reshape(-1))[0]
            miss_fr_c, miss_hp_c = miss_fr[sel_idx], miss_hp[sel_idx]   # only the missing pages

            def separate(c, fr, st, sl, hk, hv, impl="pallas"):
                q, pk, pv = c
                pk, pv = page_copy.fetch([pk, pv], [hk, hv], miss_hp_c, miss_fr_c, impl="pallas")
                return sda.sparse_decode_attention(q, pk, pv, fr, st, sl, impl=impl), pk, pv

            variants = [("zero_copy", zero_copy, False, "pallas"), ("fused", fused, True, "pallas"),
                        ("separate", separate, True, "pallas")]
            if "mosaic" in t_res:
                variants.append(("separate_mosaic", functools.partial(separate, impl="mosaic"), True, "mosaic"))
            for name, fn, donate, base_impl in variants:
                if base_impl not in t_res:
                    continue
                t_base = t_res[base_impl]
                try:
                    if donate:
                        fresh = lambda: (jnp.copy(sel.q), jnp.copy(sel.pool_k), jnp.copy(sel.pool_v))
                        out = jax.jit(fn, donate_argnums=0)(fresh(), sel.frame, sel.start, sel.seq_len, hk, hv)[0]
                        c0 = fresh()
                        t, _ = time_chain(fn, c0, sel.frame, sel.start, sel.seq_len, hk, hv, donate=True)
                    else:
                        out = jax.jit(fn)(sel.q, sel.pool_k, sel.pool_v, sel.frame, sel.start, sel.seq_len, hk, hv)
                        t, _ = time_chain(fn, sel.q, sel.pool_k, sel.pool_v, sel.frame, sel.start, sel.seq_len, hk, hv)
                    extra = t - t_base
                    ctx.add("miss", dict(batch=b, budget=budget, variant=name, miss_frac=frac, miss_pages=miss_pages,
                                         rel_err_vs_resident=rel_err(out, out_res), us=t * 1e6,
                                         extra_us=extra * 1e6, pcie_gbs_total=miss_bytes / t / 1e9,
                                         pcie_gbs_incremental=(miss_bytes / extra / 1e9) if extra > 0 else None))
                except Exception as e:
                    ctx.add("miss", dict(batch=b, budget=budget, variant=name, miss_frac=frac, error=repr(e)[:300]))
        del sel, hk, hv
        ctx.save()


def mosaic_page_walk(table, pk, pv, nconc=2):
    """Mosaic GPU: each program streams its K and V pages (TMA, emit_pipeline over a page table) and sums them.
    table [N, K] int32, pk/pv [F, page, D] -> [N, page, D] f32. The attention math is left out: this is the bound
    a Mosaic attention kernel over the same pages could reach."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    n, k = table.shape
    page, d = pk.shape[1:]

    def body(tbl, pk_g, pv_g, out_g):
        i = jax.lax.axis_index("i")

        def scope(acc):
            acc[...] = jnp.zeros((page, d), jnp.float32)

            def step(_, k_s, v_s):
                acc[...] += k_s[...].astype(jnp.float32) + v_s[...].astype(jnp.float32)

            spec = plgpu.BlockSpec((None, page, d), lambda j: (tbl[i, j], 0, 0))
            plgpu.emit_pipeline(step, grid=(k,), max_concurrent_steps=nconc, in_specs=[spec, spec])(pk_g, pv_g)
            out_g[i] = acc[...]

        pl.run_scoped(scope, plgpu.SMEM((page, d), jnp.float32))

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((n, page, d), jnp.float32), grid=(n,),
                        grid_names=("i",))(table, pk, pv)


def section_mosaic(ctx: BenchContext):
    for b, budget in ((32, 4096), (8, 4096)):
        for nconc in (2, 4):
            if ctx.time_left() < 0:
                ctx.add("mosaic", dict(batch=b, budget=budget, skipped="deadline"))
                continue
            try:
                sel = make_selection(b, budget, 131072, seed=3, spare_frac=0.0)
                nf = sel.pool_k.shape[0]
                pk, pv = sel.pool_k.reshape(nf, PAGE, D), sel.pool_v.reshape(nf, PAGE, D)
                table = sel.frame.reshape(b * KV, sel.slots)
                fn = functools.partial(mosaic_page_walk, nconc=nconc)
                got = jax.jit(fn)(table, pk, pv)
                want = (pk[table].astype(jnp.float32) + pv[table].astype(jnp.float32)).sum(1)
                err = rel_err(got, want)
                # the next table depends on this call's output (a compare XLA cannot fold), so no call is dropped
                t, _ = time_chain(lambda t_, a_, b_: jnp.where(fn(t_, a_, b_)[:, 0, :1] == 1234.5, t_ + 1, t_),
                                  table, pk, pv)
                full_bytes = b * KV * sel.slots * PAGE * D * 2 * 2
                ctx.add("mosaic", dict(batch=b, budget=budget, max_concurrent_steps=nconc, rel_err=err,
                                       us=t * 1e6, tbs=full_bytes / t / 1e12))
            except Exception as e:
                ctx.add("mosaic", dict(batch=b, budget=budget, max_concurrent_steps=nconc, error=repr(e)[:300]))
    ctx.save()


# ----------------------------------------------------------------------------------------------------------------
# token: the per-token kernel against the page kernel over the same bytes
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TokenWorkload:
    """One (batch, budget) row of the token section: one pool, one query and the same tail pages, read three ways.
    Groups hold one KV head each (g = 1, G = KV). Pool rows no list names are NaN, so a stray read shows."""
    q: jax.Array           # [B, 1, H, D]
    pool_k: jax.Array      # [F, t, 1, D]
    pool_v: jax.Array      # [F, t, 1, D]
    seq_len: jax.Array     # [B] int32
    scattered: tuple       # (tok_frame, tok_row, tok_pos) [B, G, N + 2t] int32: N random rows of random frames,
                           # then every row of the 2 tail pages (the last one's unwritten rows pos -1)
    contiguous: tuple      # (tok_frame, tok_row, tok_pos) [B, G, (N/t + 2) t] int32: every row of `pages`' pages
    pages: tuple           # (page_frame, page_start) [B, G, N/t + 2] int32: N/t random pages + the 2 tail pages
    budget: int            # N
    tokens: int            # attended tokens summed over (b, group): B * G * (N + tail rows), all three variants

    @property
    def bytes(self) -> int:  # K and V bytes of the attended tokens
        return self.tokens * self.q.shape[-1] * self.pool_k.dtype.itemsize * 2

    @property
    def pool_gb(self) -> float:  # K and V
        return 2 * self.pool_k.size * self.pool_k.dtype.itemsize / 1e9


def make_token_workload(batch, budget, context, *, pool_gb, heads=H, kv=KV, d=D, page=16, seed=0,
                        dtype=DT) -> TokenWorkload:
    """Per (b, group): `budget` tokens at random rows of random frames (positions random, all before the tail), and
    for the page kernel budget / page random pages; both lists end with the same 2 tail pages (the last one partial:
    seq_len = context - page - 1). The pool holds pool_gb of K and V (at least twice the frames the lists name), the
    frames a random permutation; every row a list names is random normal, every other row NaN."""
    if budget % page:
        raise ValueError(f"budget {budget} is not a whole number of pages of {page}")
    rng = np.random.default_rng(seed)
    seq_len = context - page - 1
    n_pages = -(-seq_len // page)
    n_sel, body = budget // page, n_pages - TAIL          # selected pages; pages before the tail
    if n_sel > body:
        raise ValueError(f"budget {budget} exceeds the {body * page} tokens before the tail at context {context}")
    lists = batch * kv
    need = lists * (n_sel + TAIL)
    nf = max(int(pool_gb * 1e9) // (2 * page * d * jnp.dtype(dtype).itemsize), 2 * need)
    perm = rng.permutation(nf).astype(np.int32)
    tail_fr = perm[:lists * TAIL].reshape(batch, kv, TAIL)                       # [B, G, 2]
    page_fr = perm[lists * TAIL:need].reshape(batch, kv, n_sel)                  # [B, G, N/t]
    picks = rng.choice((nf - lists * TAIL) * page, lists * budget, replace=False)  # any row but the tail frames'
    sc_fr = perm[lists * TAIL + picks // page].reshape(batch, kv, budget)       # [B, G, N]
    sc_row = (picks % page).astype(np.int32).reshape(batch, kv, budget)
    sc_pos = np.stack([rng.choice(body * page, budget, replace=False) for _ in range(lists)])
    sel_start = np.stack([rng.choice(body, n_sel, replace=False) for _ in range(lists)]) * page
    tail_start = np.broadcast_to(np.arange(body, n_pages) * page, (lists, TAIL))
    starts = np.concatenate([sel_start, tail_start], -1).reshape(batch, kv, n_sel + TAIL)
    frames = np.concatenate([page_fr, tail_fr], -1)                              # [B, G, N/t + 2]
    order = rng.permuted(np.broadcast_to(np.arange(n_sel + TAIL), frames.shape), axis=-1)  # slots shuffled
    frames, starts = np.take_along_axis(frames, order, -1), np.take_along_axis(starts, order, -1)

    def rows_of(fr, st):  # every row of pages [B, G, K] -> (frame, row, pos) [B, G, K t]; rows past seq_len pos -1
        rows = np.arange(page, dtype=np.int32)
        pos = st[..., None] + rows
        return (np.repeat(fr, page, -1), np.broadcast_to(rows, pos.shape).reshape(fr.shape[:2] + (-1,)),
                np.where(pos < seq_len, pos, -1).reshape(fr.shape[:2] + (-1,)))

    tail = rows_of(tail_fr, tail_start.reshape(batch, kv, TAIL))
    scattered = tuple(np.concatenate([x, y], -1) for x, y in zip((sc_fr, sc_row, sc_pos.reshape(sc_fr.shape)), tail))
    contiguous = rows_of(frames, starts)
    used = np.zeros((nf, page), bool)
    used[frames.reshape(-1)] = True
    used[sc_fr.reshape(-1), sc_row.reshape(-1)] = True
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    keep = jnp.asarray(used)[:, :, None, None]
    pool_k = jnp.where(keep, jax.random.normal(k1, (nf, page, 1, d), dtype), jnp.nan).astype(dtype)
    pool_v = jnp.where(keep, jax.random.normal(k2, (nf, page, 1, d), dtype), jnp.nan).astype(dtype)
    i32 = lambda xs: tuple(jnp.asarray(x, jnp.int32) for x in xs)
    return TokenWorkload(q=jax.random.normal(k3, (batch, 1, heads, d), dtype), pool_k=pool_k, pool_v=pool_v,
                         seq_len=jnp.full((batch,), seq_len, jnp.int32), scattered=i32(scattered),
                         contiguous=i32(contiguous), pages=i32((frames, starts)), budget=budget,
                         tokens=lists * (budget + seq_len - body * page))


def token_step(impl="pallas", tuning=None):
    def step(q, pk, pv, frame, row, pos, seq_len):
        return tda.token_decode_attention(q, pk, pv, frame, row, pos, seq_len, impl=impl, tuning=tuning)
    return step


def check_output(out, ref, *, rtol=2e-2, atol=2e-2) -> dict:
    """Kernel output against the reference at bf16 tolerance: |out - ref| <= atol * max|ref| + rtol * |ref| for
    every element, and all finite. atol is scaled by the output's largest value: attention over thousands of random
    tokens averages to outputs near 0.02, where a fixed atol of 1e-2 would pass half of an all-zero output.
    Returns max_abs_err, rel_err (the file's norm ratio), scale (max|ref|) and ok."""
    o = np.asarray(jnp.asarray(out, jnp.float32))
    r = np.asarray(jnp.asarray(ref, jnp.float32))
    err = np.abs(o - r)
    scale = float(np.max(np.abs(r)))
    ok = bool(np.isfinite(o).all() and (err <= atol * scale + rtol * np.abs(r)).all())
    return dict(max_abs_err=float(np.max(err)), rel_err=rel_err(o, r), scale=scale, ok=ok)


def token_variants(w: TokenWorkload, impl="pallas"):
    """(variant, kernel step, reference, index lists, tuning) of a workload: the token kernel over the scattered
    tokens (gather + per-token work), the token kernel over whole pages' rows (per-token work on contiguous rows),
    and the page kernel over those pages (the same bytes as whole pages)."""
    b, kv, n = w.scattered[0].shape
    t = w.pool_k.shape[1]
    tok_sc = tda.default_tuning(b, kv, n)
    tok_ct = tda.default_tuning(b, kv, w.contiguous[0].shape[-1])
    pg = sda.default_tuning(b, kv, w.pages[0].shape[-1], t)
    return [("scattered", token_step(impl, tok_sc), tda.ref_token_decode_attention, w.scattered, tok_sc),
            ("contiguous", token_step(impl, tok_ct), tda.ref_token_decode_attention, w.contiguous, tok_ct),
            ("page", attn_step(pg, impl), sda.ref_sparse_decode_attention, w.pages, pg)]


def measure_variant(step, ref_fn, args, nbytes, *, ceiling_tbs=None, timer=time_chain) -> dict:
    """Check step(*args) against ref_fn(*args) (`check_output`), then time it with `timer` (median seconds per
    call): max_abs_err, rel_err, us, TB/s over nbytes and the fraction of ceiling_tbs. A kernel that raises or fails
    the check gives a row with `error` and no time: a wrong kernel's speed is not a result."""
    try:
        chk = check_output(jax.jit(step)(*args), jax.jit(ref_fn)(*args))
    except Exception as e:
        return dict(error=repr(e)[:300])
    row = dict(max_abs_err=chk["max_abs_err"], rel_err=chk["rel_err"])
    if not chk["ok"]:
        return dict(row, error=f"check failed: max |out - ref| {chk['max_abs_err']:.3g} at output scale "
                               f"{chk['scale']:.3g}")
    try:
        t, _ = timer(step, *args)
    except Exception as e:
        return dict(row, error=repr(e)[:300])
    tbs = nbytes / t / 1e12
    return dict(row, us=t * 1e6, tbs=tbs, frac_ceiling=tbs / ceiling_tbs if ceiling_tbs else None)


def token_rows(w: TokenWorkload, *, impl="pallas", ceiling_tbs=None, timer=time_chain):
    """The workload's three rows (`token_variants`), each checked then timed (`measure_variant`); yields each row
    as it is measured, labelled with batch, budget, page, attended tokens and MB, pool GB, list entries (slots for
    the page kernel) and tuning."""
    b = w.q.shape[0]
    for name, step, ref_fn, lists, tune in token_variants(w, impl):
        label = dict(variant=name, batch=b, budget=w.budget, page=w.pool_k.shape[1], tokens=w.tokens,
                     attended_mb=w.bytes / 1e6, pool_gb=w.pool_gb, entries=int(lists[0].shape[-1]),
                     tuning=json.dumps(tune))
        args = (w.q, w.pool_k, w.pool_v, *lists, w.seq_len)
        yield dict(label, **measure_variant(step, ref_fn, args, w.bytes, ceiling_tbs=ceiling_tbs, timer=timer))


def section_token(ctx: BenchContext):
    """Token kernel vs page kernel at the 8B shape, page 16, g = 1: for each batch x budget, the scattered tokens,
    the same count as contiguous rows, and the page kernel over those pages (`token_rows`)."""
    a = ctx.args
    for b in a.token_batches:
        for budget in a.token_budgets:
            if ctx.time_left() < 0:
                ctx.add("token", dict(batch=b, budget=budget, skipped="deadline"))
                continue
            try:
                w = make_token_workload(b, budget, a.token_context, pool_gb=a.token_pool_gb, seed=b * 7 + budget)
            except Exception as e:
                ctx.add("token", dict(batch=b, budget=budget, error=repr(e)[:300]))
                continue
            for row in token_rows(w, ceiling_tbs=ctx.ceiling_tbs):
                ctx.add("token", row)
            del w
    ctx.save()


def plot(results, path):
    """The page kernel against Pallas paged_attention, the miss variants, and (when measured) the token kernel
    against the page kernel over the same tokens. A section kept from an earlier run (`kept_sections`) is labelled
    with that run's device, and this run's ceilings are drawn only beside sections this run measured."""
    plt = pyplot()
    token = [r for r in results.get("token", []) if "tbs" in r]
    fig, axes = plt.subplots(1, 3 if token else 2, figsize=(19 if token else 13, 4.5))
    kept = results.get("kept_sections", {})
    dev = lambda section: str(kept.get(section, {}).get("device") or results.get("device", "")).replace("gpu ", "")
    # this run's ceilings, drawn only beside a section this run measured
    ceilings = lambda section: [(k, v) for k, v in ({} if section in kept else results.get("ceiling", {})).items()
                                if k.endswith("_tbs") and v]
    ax = axes[0]
    rows = [r for r in results.get("kernel", []) if "tbs" in r and r.get("impl") == "pallas"]
    labels, vals = [], []
    for r in rows:
        labels.append(f"B{r['batch']}/{r['budget']}/{r['context'] // 1024}K")
        vals.append(r["tbs"])
    mos = {(r["batch"], r["budget"], r["context"]): r["tbs"] for r in results.get("kernel", [])
           if "tbs" in r and r.get("impl") == "mosaic"}
    ax.bar([i - 0.2 for i in range(len(vals))], vals, width=0.4, color="tab:blue", label="ours, Triton lowering")
    mv = [mos.get((r["batch"], r["budget"], r["context"]), 0.0) for r in rows]
    ax.bar([i + 0.2 for i in range(len(vals))], mv, width=0.4, color="tab:cyan", label="ours, Mosaic GPU")
    paged = {(r["batch"], r["budget"]): r["tbs"] for r in results.get("paged", []) if "tbs" in r}
    px = [i for i, r in enumerate(rows) if (r["batch"], r["budget"]) in paged]
    ax.scatter(px, [paged[(rows[i]["batch"], rows[i]["budget"])] for i in px], color="tab:red", zorder=3,
               label="Pallas paged_attention (same pages)")
    ax.axhline(3.0, ls=":", lw=1, color="green")
    for name, val in ceilings("kernel"):
        ax.axhline(val, ls="--", lw=1, color="gray")
        ax.text(len(vals) - 0.5, val, name.replace("_tbs", ""), fontsize=7, ha="right", va="bottom")
    ax.set_xticks(range(len(vals)), labels, rotation=75, fontsize=6)
    ax.set_ylabel("TB/s over attended K/V bytes")
    ax.set_title(f"sparse decode attention, {dev('kernel')}, bf16")
    ax.legend(fontsize=7)
    ax = axes[1]
    for variant, color in (("zero_copy", "tab:orange"), ("fused", "tab:green"), ("separate", "tab:purple"),
                           ("separate_mosaic", "tab:brown")):
        for budget in sorted({r["budget"] for r in results.get("miss", [])}):
            pts = sorted((r["miss_frac"], r["us"]) for r in results.get("miss", [])
                         if r.get("variant") == variant and r["budget"] == budget and "us" in r)
            if pts:
                ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", color=color,
                        ls="-" if budget == 4096 else ":", label=f"{variant} budget {budget}")
    for r in results.get("miss", []):
        if str(r.get("variant", "")).startswith("resident") and "us" in r:
            ax.axhline(r["us"], color="gray", lw=1, ls="-" if r["budget"] == 4096 else ":")
    ax.set_xlabel("% of selected pages served from pinned_host")
    ax.set_ylabel("us per call (B=32)")
    ax.set_title(f"misses: zero-copy / fused fill / separate fetch, {dev('miss')}")
    ax.legend(fontsize=7)
    if token:
        ax = axes[2]
        cells = sorted({(r["batch"], r["budget"]) for r in token})
        for k, (variant, color) in enumerate((("scattered", "tab:blue"), ("contiguous", "tab:cyan"),
                                              ("page", "tab:gray"))):
            got = {(r["batch"], r["budget"]): r["tbs"] for r in token if r.get("variant") == variant}
            ax.bar([i + (k - 1) * 0.27 for i in range(len(cells))], [got.get(c, 0.0) for c in cells], width=0.27,
                   color=color, label="page kernel, same tokens' pages" if variant == "page" else
                   f"token kernel, {variant} tokens")
        for _, val in ceilings("token"):
            ax.axhline(val, ls="--", lw=1, color="gray")
        ax.set_xticks(range(len(cells)), [f"B{b}/{n}" for b, n in cells], fontsize=7)
        ax.set_ylabel("TB/s over attended K/V bytes")
        ax.set_title(f"per-token attention, {dev('token')}, bf16")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def summary(results):
    lines = []
    c = results.get("ceiling", {})
    lines.append("ceiling: " + ", ".join(f"{k}={v:.3f}" for k, v in c.items() if k.endswith("_tbs")))
    paged = {(r["batch"], r["budget"]): r for r in results.get("paged", []) if "us" in r}
    rows = {}
    for r in results.get("kernel", []):
        if "us" in r:
            rows.setdefault((r["batch"], r["budget"], r["context"]), {})[r["impl"]] = r
    lines.append(f"{'B':>3} {'budget':>6} {'ctx':>5} | {'triton us':>9} {'TB/s':>5} | {'mosaic us':>9} {'TB/s':>5} | "
                 f"{'paged us':>8} {'x best':>6} | err(t/m)")
    nan = float("nan")
    for (b, budget, ctx_), d in rows.items():
        t, m = d.get("pallas", {}), d.get("mosaic", {})
        p = paged.get((b, budget), {})
        best = min([x["us"] for x in (t, m) if x] or [nan])
        lines.append(f"{b:>3} {budget:>6} {ctx_ // 1024:>4}K | {t.get('us', nan):>9.1f} {t.get('tbs', nan):>5.2f} | "
                     f"{m.get('us', nan):>9.1f} {m.get('tbs', nan):>5.2f} | {p.get('us', nan):>8.1f} "
                     f"{p.get('us', nan) / best:>6.2f} | {t.get('rel_err', nan):.1e}/{m.get('rel_err', nan):.1e}")
    for r in results.get("cudnn", []):
        if "us" in r:
            lines.append(f"cudnn B={r['batch']} ctx={r['context'] // 1024}K: {r['us']:.0f} us, {r['tbs']:.2f} TB/s")
    for r in results.get("miss", []):
        if "us" in r:
            lines.append(f"miss B={r['batch']} budget={r['budget']} {r['variant']:>9} {r['miss_frac']:>5.2f}: "
                         f"{r['us']:8.1f} us" + (f", PCIe incr {r['pcie_gbs_incremental']:.1f} GB/s"
                                                  if r.get("pcie_gbs_incremental") else ""))
    for sec in ("sweep", "msweep"):
        best = {}
        for r in results.get(sec, []):
            key = (r["batch"], r["budget"])
            if "us" in r and (key not in best or r["us"] < best[key]["us"]):
                best[key] = r
        for (b, budget), r in best.items():
            lines.append(f"{sec} best B={b} budget={budget}: {r['us']:.1f} us {r['tbs']:.2f} TB/s {r['tuning']}")
        errs = [r for r in results.get(sec, []) if "error" in r]
        if errs:
            lines.append(f"{sec} errors: {errs[0]['error'][:600]}")
    for r in results.get("mosaic", []):
        if "us" in r:
            lines.append(f"mosaic walk B={r['batch']} budget={r['budget']} conc={r['max_concurrent_steps']}: "
                         f"{r['us']:.1f} us {r['tbs']:.2f} TB/s")
    lines += token_summary(results.get("token", []))
    for name, meta in results.get("kept_sections", {}).items():
        lines.append(f"kept from an earlier run: {name} ({meta.get('commit') or meta.get('git_commit')}, "
                     f"{meta.get('date')})")
    return "\n".join(lines)


def token_summary(rows) -> list[str]:
    """One line per (batch, budget) of the token section: us, TB/s and fraction of the ceiling of the scattered
    tokens, the contiguous rows and the page kernel; then each error row."""
    by = {}
    for r in rows:
        if "variant" in r:
            by.setdefault((r["batch"], r["budget"]), {})[r["variant"]] = r
    lines = []
    for (b, budget), d in by.items():
        cells = []
        for v in ("scattered", "contiguous", "page"):
            r = d.get(v, {})
            if "us" in r:
                frac = f" {r['frac_ceiling']:.2f}c" if r.get("frac_ceiling") else ""
                cells.append(f"{v} {r['us']:7.1f} us {r['tbs']:.2f} TB/s{frac} err {r['max_abs_err']:.1e}")
            else:
                cells.append(f"{v} {'ERROR' if 'error' in r else '-'}")
        lines.append(f"token B={b} N={budget}: " + " | ".join(cells))
    lines += [f"token error B={r['batch']} N={r['budget']} {r.get('variant', '')}: {r['error'][:300]}"
              for r in rows if "error" in r]
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, files="attention.json, attention.png")
    p.add_argument("--only", nargs="*", default=None, choices=SECTIONS, help="sections to run (default: all)")
    p.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    p.add_argument("--batches", nargs="*", type=int, default=[8, 32])
    p.add_argument("--impls", nargs="*", default=["pallas", "mosaic"], choices=["pallas", "mosaic"])
    p.add_argument("--budgets", nargs="*", type=int, default=[1024, 2048, 4096])
    p.add_argument("--contexts", nargs="*", type=int, default=[32768, 131072, 262144])
    p.add_argument("--miss-fracs", nargs="*", type=float, default=[0.01, 0.1, 0.3])
    p.add_argument("--miss-configs", nargs="*", default=["32x2048", "32x4096"])
    p.add_argument("--deadline", type=float, default=200.0, help="seconds; later sections are skipped past it")
    p.add_argument("--resume", default=None, help="a results JSON to extend (its skipped rows are dropped)")
    p.add_argument("--kernel-rows", nargs="*", default=None,
                   help="BxBUDGETxCONTEXT triples: only these kernel rows (default: every batch x budget x context)")
    p.add_argument("--token-batches", nargs="*", type=int, default=[3, 8], help="token section: batch sizes")
    p.add_argument("--token-budgets", nargs="*", type=int, default=[2048, 4096, 8192],
                   help="token section: listed tokens per (sequence, group), + the 2 tail pages' rows")
    p.add_argument("--token-context", type=int, default=131072, help="token section: context the tokens come from")
    p.add_argument("--token-pool-gb", type=float, default=4.0,
                   help="token section: pool size, K and V together (at least twice the frames the lists name)")
    p.add_argument("--fresh", action="store_true",
                   help="replace OUT/attention.json whole (default: keep its sections this run does not measure, "
                        "each with the meta of the run that measured it, under kept_sections)")
    return p


def parse(argv=None):
    a = build_parser().parse_args(argv)
    a.miss_configs = [tuple(int(x) for x in s.split("x")) for s in a.miss_configs]
    if a.kernel_rows is not None:
        a.kernel_rows = {tuple(int(x) for x in s.split("x")) for s in a.kernel_rows}
    return a


def sections_to_run(a) -> list[str]:
    """--only (default: every section) less --skip, in order. `token` reports fractions of the ceiling measured in
    the same run, so asking for it runs `ceiling` first unless --skip names it."""
    todo = [s for s in (a.only or SECTIONS) if s not in a.skip]
    if "token" in todo and "ceiling" not in a.skip:
        todo = ["ceiling"] + [s for s in todo if s != "ceiling"]
    return todo


def read_results(path) -> dict:
    """An earlier attention.json, refused by name when it cannot be read (rather than replaced by this run's)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: cannot read the earlier results ({e!r}); move it or pass --fresh") from e


def kept_sections(old: dict, measured) -> tuple[dict, dict]:
    """The sections of an earlier results dict that this run does not measure (names in `measured`), and for each
    the meta of the run that measured it: the earlier file's own `kept_sections` entry where it had one (a section
    kept twice keeps its first meta), else the earlier file's top-level fields (device, jax, commit, date, command,
    shapes, notes) with that section's seconds and error. A section is a named one (SECTIONS), a list of rows (the
    integrator's extra sections) or an entry of `kept_sections`."""
    earlier_kept = old.get("kept_sections", {})
    names = [k for k, v in old.items() if k in SECTIONS or isinstance(v, list) or k in earlier_kept]
    top = {k: v for k, v in old.items() if k not in names and k not in ("section_seconds", "errors",
                                                                       "kept_sections")}
    kept, meta = {}, {}
    for name in names:
        if name in measured:
            continue
        kept[name] = old[name]
        if name in earlier_kept:
            meta[name] = earlier_kept[name]
        else:
            meta[name] = dict(top, seconds=old.get("section_seconds", {}).get(name))
            if name in old.get("errors", {}):
                meta[name]["error"] = old["errors"][name]
    return kept, meta


def main(argv=None, extra_sections=()):
    """Run the benchmark; returns the results dict as written to OUT/attention.json (this run's sections, and the
    earlier file's other sections unless --fresh: `kept_sections`) and drawn in attention.png."""
    a = parse(argv)
    results = run_meta(a.commit, shapes=dict(H=H, KV=KV, D=D, page=PAGE, tail_pages=TAIL, dtype="bfloat16"))
    if a.resume:
        with open(a.resume) as f:
            old = json.load(f)
        for key, val in old.items():
            if isinstance(val, list):
                results[key] = [r for r in val if not (isinstance(r, dict) and "skipped" in r)]
            elif key not in results or key in ("ceiling", "section_seconds"):
                results[key] = val
        results["resumed_from"] = {k: old.get(k) for k in ("date", "commit", "command", "device", "jax")}
    todo = sections_to_run(a)
    kept = {}
    path = os.path.join(a.out, "attention.json") if a.out else None
    if path and os.path.exists(path) and not a.fresh:
        measured = set(todo) | {getattr(fn, "__name__", "extra") for fn in extra_sections} | set(results)
        kept, meta = kept_sections(read_results(path), measured)
        if kept:
            results["kept_sections"] = {**results.get("kept_sections", {}), **meta}
    ctx = BenchContext(args=a, results=results, t_start=time.perf_counter(), kept=kept)
    fns = dict(ceiling=section_ceiling, kernel=section_kernel, sweep=section_sweep, msweep=section_msweep,
               paged=section_paged,
               cudnn=section_cudnn, miss=section_miss, mosaic=section_mosaic, token=section_token)
    for name in todo:
        t0 = time.perf_counter()
        try:
            fns[name](ctx)
        except Exception as e:
            results.setdefault("errors", {})[name] = repr(e)[:500]
            print(f"[{name}] FAILED: {e!r}", flush=True)
        results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        ctx.save()
    for fn in extra_sections:
        rows = fn(ctx) or []
        for r in rows:
            ctx.add(getattr(fn, "__name__", "extra"), r)
        ctx.save()
    results = ctx.merged()
    if a.out:
        try:
            plot(results, os.path.join(a.out, "attention.png"))
        except Exception as e:
            print("plot failed:", repr(e), flush=True)
    print(summary(results), flush=True)
    return results


if __name__ == "__main__":
    main()
