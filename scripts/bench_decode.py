"""End-to-end decode benchmark: UlaCache sparse decode vs the dense HBM baseline with the same model.

Llama-3.1-8B shape with RANDOM bf16 weights. The KV cache is, by default (--fill synthetic), a SYNTHETIC fill made
on the device (random K/V with distinct bytes per sequence, written through the real ingestion path into the
pinned host pool and summaries for sparse; straight into HBM for dense), not a prefill; --fill prefill runs random
prompt ids through the Generator's own prefill (the path `generate` takes) and records the time to first token
beside decode (`real_prefill`). Random weights make selections without temporal locality, so hit rates at small
HBM pools are worst cases.

Per context, same run: decode tokens/s and per-token latency (p50/p99 over chunks of page_size steps: tokens are
produced on the device in chunks, one host sync per chunk, so the per-token figure is chunk time / steps), for
each batch, sparse vs dense; each side also as a fraction of its own bytes floor (weights + bytes read per step,
at the HBM copy bandwidth measured in this run). Writes JSON + PNG to docs/benchmarks/ (or --out).

Row kinds (--rows side:context:batch[:kv_fraction[:sieve]]): sparse, dense, and auto, the library's default
(cost_model.resolve_attention on the cache this shape's sparse row gets, so a sparse/dense/auto triple of one
shape is a same-run comparison): an auto row records "attention": "auto", the path it took ("attention_path"),
why, and the model's predicted tokens/s per path; every row records the model's prediction for its own path
("predicted_tokens_per_s", with the row's measured hit rate) beside the measurement. --kv-dtype float8_e4m3fn
stores both sides' pages as e4m3 codes with a scale per page and KV head (the dense side walks them with the Triton
attention kernel on GPU, or, with --dense-attention xla, reads them decoded by XLA); the bytes floor counts a byte a
value then.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

from scripts import bench_meta
from ulacache_jax.cache.codec import KV_DTYPES
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.kernel_choice import DENSE_IMPLS
from ulacache_jax.cache.select import two_stage
from ulacache_jax.cache.select.labels import Labels
from scripts.bench_meta import (add_common_args, appended_meta, child_env, copy_ceiling, earlier_run, git_commit,
                                read_ceiling, utc_now)


def copy_bandwidth(nbytes=4 << 30) -> float:
    """HBM copy ceiling in bytes/s (read + write counted)."""
    return copy_ceiling(nbytes)


def read_bandwidth(nbytes=4 << 30) -> float:
    """HBM read ceiling in bytes/s. A decode step mostly reads (weights, K/V) and can run faster than the read +
    write copy rate, so the copy floor (the issue's) is reported beside this one."""
    return read_ceiling(nbytes)


HOT_GAIN = 4.0   # a hot page's keys are this many times larger: every rule (Quest bound, labels' mass) ranks it first


def hot_page_probability(hot_share: float, select_pages: int, ctx: int, page: int) -> float:
    """The chance a page is hot so that a (sequence, layer, KV head) holds hot_share x select_pages hot pages on
    average (at most every page)."""
    return min(1.0, hot_share * select_pages / max(1, ctx // page))


def synthetic_fill_sparse(m, slots, ctx, seed, chunk=8192, hot_share=0.0):
    """Random K/V (distinct per sequence, made on the device) through the real ingestion path of CacheManager m.

    hot_share > 0 plants locality: a random set of pages per (sequence, layer, KV head), hot_share x the pages a
    step selects on average (the budget's, or per-token selection's shortlist: CacheConfig.shortlist_pages, the
    pages the sieve receives), gets keys HOT_GAIN times larger. Every step's selection then holds those pages (they win
    under any rule) and fills the rest of its budget by the random queries, so the row's hit rate rises with
    hot_share: the knob that matches a row's hit rate to a trained model's trace (random weights alone select with
    no step-to-step locality). The pages' values and the dense side are unchanged."""
    c = m.config
    chunk = min(ctx, chunk)
    P = c.page_size
    prob = hot_page_probability(hot_share, c.shortlist_pages, ctx, P)
    shape = (c.num_layers, chunk, c.num_kv_heads, c.head_dim)

    def make_k(key):
        k = jax.random.normal(key, shape, jnp.float32)
        hot = jax.random.bernoulli(jax.random.fold_in(key, 1), prob, (c.num_layers, chunk // P, 1, c.num_kv_heads))
        gain = jnp.where(hot, HOT_GAIN, 1.0)                                    # [L, chunk / P, 1, KV]
        k = (k.reshape(c.num_layers, chunk // P, P, c.num_kv_heads, c.head_dim) * gain[..., None]).reshape(shape)
        return k.astype(c.jnp_dtype)

    mk_k = jax.jit(make_k)
    mk = jax.jit(lambda key: jax.random.normal(key, shape, c.jnp_dtype))
    for i, slot in enumerate(slots):
        for start in range(0, ctx, chunk):
            k = mk_k(jax.random.key(seed * 1_000_003 + i * 7919 + start))
            v = mk(jax.random.key(seed * 1_000_003 + i * 7919 + start + 1))
            m.state, m.host = m._ingest(m.state, m.host, slot, k, v, start, ctx)


def synthetic_fill_dense(gen, batch, ctx, seed):
    c = gen.config
    S, T, KV, D = gen.dense.k[0].shape
    blk = 4096  # a random 4096-token block per sequence and layer, tiled: no full-size temporaries; each layer's
    # zero array is donated, so the largest batch that fits in HBM can be filled (distinct bytes per sequence)

    def make(old, key):
        # in the cache's own dtype: fp8 pages get codes of unit scale (their scales stay 1)
        b = jax.random.normal(key, (S, blk, KV, D), c.jnp_dtype).astype(old.dtype)
        # written INTO the donated array: jit prunes an unused argument, and a pruned donation is no donation (the
        # old zeros stayed alive beside the new cache: the H200's 128K x 7 and 256K x 3 dense rows ran out of HBM
        # one 1.75 GiB layer array short and XLA's allocator retried until the row's time limit)
        return lax.dynamic_update_slice(old, jnp.tile(b, (1, -(-T // blk), 1, 1))[:, :T], (0, 0, 0, 0))

    fill = jax.jit(make, donate_argnums=0)
    key = lambda l, i: jax.random.key(seed * 1_000_003 + 2 * l + i)
    gen.dense = dataclasses.replace(gen.dense, k=tuple(fill(x, key(l, 0)) for l, x in enumerate(gen.dense.k)),
                                    v=tuple(fill(x, key(l, 1)) for l, x in enumerate(gen.dense.v)))
    # committed where the generator keeps it: an uncommitted length array made the first timed chunk compile the
    # decode program again (the H200's dense rows: p99 3-9x their p50, one chunk in four)
    gen.dense_len = jax.device_put(jnp.where(jnp.arange(c.max_seqs) < batch, ctx, 0).astype(jnp.int32),
                                   gen.dense_len.sharding)


def real_prefill(gen, batch: int, ctx: int, reserve: int, vocab: int):
    """Random prompt ids of ctx tokens through the Generator's prefill (the one `generate` runs), into `batch`
    admitted slots of `reserve` tokens each. A first prompt compiles the prefill programs and is released; then
    each sequence is timed from admission to its first token (prefill + the argmax of its last logits on the host)
    -> (first tokens [S] int32, running [S] bool, dict(first_prefill_s = the compiling one, ttft_s = the median of
    the warm ones, prefill_tok_s = ctx / ttft_s))."""
    rng = np.random.default_rng(ctx + batch)
    S = gen.config.max_seqs
    prompt = lambda: rng.integers(0, vocab, ctx).tolist()
    t = time.perf_counter()
    slot = gen.admit(reserve)
    int(jnp.argmax(gen.prefill(slot, prompt())))
    cold = time.perf_counter() - t
    gen.release(slot)
    first, running, ttft = np.zeros(S, np.int32), np.zeros(S, bool), []
    for _ in range(batch):
        p = prompt()
        t = time.perf_counter()
        slot = gen.admit(reserve)
        first[slot] = int(jnp.argmax(gen.prefill(slot, p)))
        ttft.append(time.perf_counter() - t)
        running[slot] = True
    med = float(np.median(ttft))
    return first, running, dict(first_prefill_s=cold, ttft_s=med, prefill_tok_s=ctx / med)


def bench_config(mc, attention, batch, ctx, args, kv_fraction, page=None, tp=1, key_channels=0, label_bits=None):
    """The cache of one row: room for ctx + (chunks + 1) pages per sequence; sparse: an HBM frame pool of
    kv_fraction of the KV pages (at least one step's selection) and pages padded by `pad_page_count` (the host
    pool is sized to the context, not to a power of two); dense: exactly the tokens needed (HBM). tp > 1 (sparse
    only): frames and host pages are per rank (a rank holds its own KV-head groups' pages only). key_channels
    (sparse only): CacheConfig.key_channels; label_bits (None: --label-bits): CacheConfig.label_bits; page (None:
    the args' --page-size, `page_size`, so a caller that builds its own Namespace cannot drop it)."""
    from ulacache_jax.runtime.generation import default_cache_config
    from ulacache_jax.pallas_kernels.page_scores import pad_page_count
    from ulacache_jax.pallas_kernels.pb_lru_sieve import sieve_geometry
    page = page_size(args) if page is None else page
    need = (ctx + (args.chunks + 1) * page) // page + 1
    shortlist = getattr(args, "token_shortlist", 0) if attention == "sparse" and key_channels else 0
    # pages one layer of a step selects (rank): the budget's, or --token-shortlist x them
    step_pages = batch * mc.num_kv_heads // tp * CacheConfig.step_pages(args.budget // page, shortlist)
    kv_pages = batch * mc.num_layers * mc.num_kv_heads // tp * (ctx // page)
    kw = {}
    if attention == "sparse":
        frames = max(step_pages * mc.num_layers, int(kv_pages * kv_fraction))
        nb, ns = sieve_geometry(frames, step_pages)
        pages = pad_page_count(need)
        kw = dict(num_buckets=nb, slots_per_bucket=ns, max_pages_per_seq=pages, key_channels=key_channels,
                  token_shortlist=shortlist,
                  label_bits=(getattr(args, "label_bits", 0) if label_bits is None else label_bits)
                  if key_channels else 0)
    else:
        kw = dict(max_pages_per_seq=need)
    cfg = default_cache_config(mc, num_seqs=batch, max_tokens=need * page, page_size=page,
                               token_budget=args.budget, dtype="bfloat16", tp=tp,
                               kv_dtype=getattr(args, "kv_dtype", "auto"), **kw)
    if attention == "sparse" and getattr(args, "two_stage", None):
        first = getattr(args, "first_channels", 0)
        cfg = two_stage.configure(cfg, args.two_stage, first=Labels(channels=first, bits=4)
                                  if first else None)
    # host pool: the pages admit reserves (`need` per sequence, layer and group), not the padded page-table width:
    # at 32K x 27 the padding (518 -> 640 pages) alone would pin 28 GB more host memory
    return dataclasses.replace(cfg, host_pages=batch * cfg.num_layers * cfg.groups_per_rank * need)


def scorer_fields(cfg) -> dict:
    """A sparse row's rule and what it scores with: key_channels / label_bits of the rule that reads a key copy
    (a two-stage rule's second stage: two_stage.configure moves them from the config into the rule object), and
    second_rule, that stage's name, for a two-stage row."""
    rule = cfg.selection_rule
    second = getattr(rule, "second", None)
    scorer = rule if second is None else second
    out = dict(rule=cfg.rule, key_channels=getattr(scorer, "channels", 0), label_bits=getattr(scorer, "bits", 0))
    if second is not None:
        out["second_rule"] = second.name
    first = getattr(rule, "first", None)
    if first is not None:
        out.update(first_rule=first.name, first_channels=first.channels, first_bits=first.bits)
    return out


def score_launch(args):
    return tuple(args.score_launch) if args.score_launch else None


def attention_kernel(impl: str, mc, cfg, platform=None) -> str:
    """The kernel the sparse decode's attention resolves to ('mosaic', 'triton' or 'ref'), recorded in each row:
    what 'auto' means depends on the GPU and on the commit (kernel_choice.resolve; platform: the current one)."""
    from ulacache_jax.cache.decode_layer import DecodeOptions
    from ulacache_jax.cache.kernel_choice import Platform, resolve
    got = resolve(DecodeOptions(attention=impl), cfg, platform or Platform.current(), query_dtype=cfg.dtype,
                  query_heads_per_kv=mc.num_queries_per_kv).attention
    return {"pallas": "triton"}.get(got, got)


SIDES = ("sparse", "dense", "auto")
KV_FILLS = {"synthetic": "fill=synthetic: a synthetic fill on the device (random, distinct per sequence), not a "
                         "prefill",
            "prefill": "fill=prefill: random prompt ids through the Generator's prefill (rows carry ttft_s)"}


def hot_share_arg(text: str) -> float:
    """argparse type of --hot-share: a float in [0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} must be in [0, 1] (a share of the budget's pages)")
    return v


def parse_rows(spec: str) -> list[tuple]:
    """'side:context:batch[:kv_fraction[:sieve]],...' -> [(side, context, batch, kv_fraction or None, sieve or
    None)]; side one of SIDES."""
    plan = []
    for r in spec.split(","):
        f = r.strip().split(":")
        if len(f) < 3 or f[0] not in SIDES:
            raise ValueError(f"row {r!r}: expected side:context:batch[:kv_fraction[:sieve]] with side one of {SIDES}")
        try:
            plan.append((f[0], int(f[1]), int(f[2]), float(f[3]) if len(f) > 3 and f[3] else None,
                         f[4] if len(f) > 4 and f[4] else None))
        except ValueError:
            raise ValueError(f"row {r!r}: context and batch must be ints, kv_fraction a number") from None
    return plan


def page_size(args) -> int:
    """The rows' page size: --page-size (64 where a Namespace built by hand, as in the tests, has none)."""
    return getattr(args, "page_size", 64)


def auto_decision(mc, batch, ctx, args, kv_fraction, tp=1, key_channels=0):
    """attention='auto' for one row, resolved as a Generator resolves it (cost_model.resolve_attention, against
    this device's memory), on the cache this shape's sparse row gets (its pool of kv_fraction of the KV)."""
    from ulacache_jax.runtime.cost_model import resolve_attention
    return resolve_attention("auto", mc, bench_config(mc, "sparse", batch, ctx, args, kv_fraction, tp=tp,
                                                      key_channels=key_channels))


def predicted_tokens_per_s(mc, kind, batch, ctx, cfg, hit_rate=None) -> float:
    """The cost model's tokens/s for a row of `kind` on cache `cfg` at `ctx` tokens (sparse: its pool and
    `hit_rate`, None = the model's expected one)."""
    from ulacache_jax.runtime.cost_model import CostModel
    sparse = kind == "sparse"
    return CostModel().tokens_per_s(kind, mc, batch=batch, context=ctx, token_budget=cfg.token_budget,
                                    page_size=cfg.page_size, itemsize=cfg.jnp_dtype.itemsize, tp=cfg.tp,
                                    pool_frames=cfg.num_frames if sparse else None,
                                    hit_rate=hit_rate if sparse else None,
                                    rule=cfg.selection_rule if sparse else None,   # two-stage rows included
                                    fetch_budget=cfg.shortlist_pages * cfg.page_size if sparse else None)


def run_side(model, mc, attention, batch, ctx, args, copy_bw, kv_fraction=None, sieve=None, read_bw=None):
    from ulacache_jax.runtime.generation import Generator
    from ulacache_jax.runtime.sampling import SamplingArrays, row_keys
    page = page_size(args)
    kv_fraction = args.kv_fraction if kv_fraction is None else kv_fraction
    sieve = sieve or args.sieve
    tp = args.tp
    requested, decision = attention, None
    if attention == "auto":
        decision = auto_decision(mc, batch, ctx, args, kv_fraction, tp=tp, key_channels=args.key_channels)
        attention = decision.kind        # from here on the row is that path's; it is recorded as "auto"
    if tp > 1 and attention != "sparse":
        raise ValueError(f"--tp {tp}: only the sparse side runs head-sharded; got {attention}")
    cfg = bench_config(mc, attention, batch, ctx, args, kv_fraction, tp=tp, key_channels=args.key_channels)
    hot_share = getattr(args, "hot_share", 0.0)      # a Namespace built by hand (tests) may lack it
    from ulacache_jax.cache.decode_layer import DecodeOptions
    t_setup = time.perf_counter()
    log = lambda what: print(f"[{attention} {ctx}x{batch}] {what} at {time.perf_counter() - t_setup:.1f} s",
                             file=sys.stderr, flush=True)  # phase times survive a row timeout (run_isolated)
    opts = DecodeOptions(sieve=sieve, topk=args.topk, attention=args.attention_impl, score_launch=score_launch(args),
                         scores=args.scores, dense_attention=getattr(args, "dense_attention", "auto"))
    gen = Generator(model, cfg, attention=decision or attention, options=opts)   # a mesh of cfg.tp GPUs
    S = cfg.max_seqs
    log(f"cache made (host pool {cfg.host_pages * cfg.page_bytes * 2 / 1e9:.1f} GB)")
    fill = {}
    tok, done = jnp.zeros(S, jnp.int32), jnp.arange(S) >= batch
    if args.fill == "prefill":
        first, running, fill = real_prefill(gen, batch, ctx, ctx + (args.chunks + 1) * page, mc.vocab_size)
        tok, done = jnp.asarray(first), jnp.asarray(~running)
    elif attention == "sparse":
        slots_ = [gen.admit(ctx + (args.chunks + 1) * page) for _ in range(batch)]
        synthetic_fill_sparse(gen.cache, slots_, ctx, seed=batch, chunk=32768, hot_share=hot_share)
    else:
        synthetic_fill_dense(gen, batch, ctx, seed=batch)
    jax.block_until_ready((gen.cache.state, gen.cache.host) if attention == "sparse" else gen.dense)
    setup_s = time.perf_counter() - t_setup
    log("filled" if args.fill == "synthetic" else f"prefilled (time to first token {fill['ttft_s']:.2f} s)")
    rem = jnp.full(S, 1 << 30, jnp.int32)
    sampling = SamplingArrays.fill(S)
    stops = jnp.asarray([-1], jnp.int32)
    t0 = time.perf_counter()
    out, _, _ = gen.decode_chunk(tok, done, rem, row_keys(jnp.arange(S, dtype=jnp.uint32), jnp.zeros(S, jnp.uint32)),
                                 sampling, stops)
    out.block_until_ready()
    compile_s = time.perf_counter() - t0
    log("first chunk (compile) done")
    times = []
    gen.reset_stats()
    for i in range(args.chunks):
        t = time.perf_counter()
        out, _, _ = gen.decode_chunk(tok, done, rem, row_keys(jnp.arange(S, dtype=jnp.uint32),
                                                                   jnp.full(S, i + 1, jnp.uint32)), sampling, stops)
        np.asarray(out)
        times.append(time.perf_counter() - t)
    per_tok = np.asarray(times) / page
    st = gen.stats
    hits, misses = int(st.hits), int(st.misses)
    # bytes floor per decode step: weights + KV bytes read (dense: whole context; sparse: attended pages + summaries)
    wbytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    # K+V bytes per token, all layers, in the page format (fp8: a byte a value, plus its page's 4-byte scale)
    code = jnp.dtype(cfg.storage_dtype).itemsize
    kv_tok = 2 * mc.num_kv_heads * (mc.head_dim * code + (4 / page if cfg.codec.scaled else 0)) * mc.num_layers
    if attention == "dense":
        step_bytes = wbytes + batch * (ctx + args.chunks * page / 2) * kv_tok
    else:
        attended = min(ctx, args.budget + 2 * page)
        summ = batch * (ctx // page) * 2 * mc.num_kv_heads * mc.head_dim * 2 * mc.num_layers
        step_bytes = wbytes + batch * attended * kv_tok + summ
    floor_s = step_bytes / (tp * copy_bw)  # TP: every rank reads its share at once (the replicated embedding and
    # LM head, ~2 GB at 8B, are read by every rank: the floor is a little optimistic for tp > 1)
    row = dict(attention=requested, attention_path=attention, batch=batch, context=ctx, budget=args.budget,
               page=page, tp=tp, fill=args.fill, **fill,
               hot_share=hot_share if attention == "sparse" and args.fill == "synthetic" else None,
               kv_fraction=kv_fraction if attention == "sparse" else 1.0,
               pool_frames=cfg.num_frames if attention == "sparse" else None,
               buckets=cfg.num_buckets if attention == "sparse" else None,
               slots_per_bucket=cfg.slots_per_bucket if attention == "sparse" else None,
               sieve=gen.backend.ops.kernels.sieve if attention == "sparse" else None,
               topk=args.topk if attention == "sparse" else None,
               attention_impl=args.attention_impl if attention == "sparse" else None,
               attention_kernel=attention_kernel(args.attention_impl, mc, cfg) if attention == "sparse" else None,
               score_launch=score_launch(args) if attention == "sparse" else None,
               **(scorer_fields(cfg) if attention == "sparse" else dict(key_channels=None, label_bits=None,
                                                                         rule=None)),
               two_stage=getattr(args, "two_stage", None) if attention == "sparse" else None,
               token_shortlist=cfg.token_shortlist if attention == "sparse" else None,
               kv_dtype=cfg.kv_dtype,
               dense_attention=gen.backend.ops.kernels.dense_attention if attention == "dense" else None,
               selection=repr(cfg.selection_rule) if attention == "sparse" else None,
               scores=args.scores if attention == "sparse" else None,
               setup_s=setup_s,
               tokens_per_s=batch / float(np.median(per_tok)), p50_token_ms=1e3 * float(np.median(per_tok)),
               p99_token_ms=1e3 * float(np.percentile(per_tok, 99)), compile_s=compile_s,
               floor_token_ms=1e3 * floor_s, fraction_of_floor=floor_s / float(np.median(per_tok)),
               read_floor_token_ms=1e3 * step_bytes / (tp * read_bw) if read_bw else None,
               fraction_of_read_floor=step_bytes / (tp * read_bw) / float(np.median(per_tok)) if read_bw else None,
               hit_rate=hits / max(1, hits + misses) if attention == "sparse" else None, chunks=args.chunks)
    row["predicted_tokens_per_s"] = predicted_tokens_per_s(mc, attention, batch, ctx, cfg, row["hit_rate"])
    if decision is not None:
        row.update(auto_reason=decision.reason, auto_predicted_tokens_per_s=decision.tokens_per_s,
                   auto_hbm_bytes=decision.hbm_bytes)
    del gen
    gc.collect()  # the generator's buffers go now, not at some later collection
    return row


def run_isolated(args, commit, side, ctx, batch, frac, sieve) -> dict:
    """One row in a child process with this run's options; its row, or an error row."""
    spec = f"{side}:{ctx}:{batch}:{'' if frac is None else frac}:{sieve or ''}"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), "--rows", spec, "--out", tmp, "--commit", commit,
               "--budget", str(args.budget), "--page-size", str(page_size(args)), "--layers", str(args.layers),
               "--chunks", str(args.chunks),
               "--steps", str(args.steps), "--kv-fraction", str(args.kv_fraction), "--sieve", args.sieve,
               "--topk", args.topk, "--attention-impl", args.attention_impl, "--tp", str(args.tp),
               "--fill", args.fill, "--key-channels", str(args.key_channels), "--label-bits", str(args.label_bits),
               "--scores", args.scores, "--hot-share", str(getattr(args, "hot_share", 0.0)),
               "--kv-dtype", getattr(args, "kv_dtype", "auto"),
               "--dense-attention", getattr(args, "dense_attention", "auto")]
        cmd += ["--token-shortlist", str(getattr(args, "token_shortlist", 0))]
        if getattr(args, "two_stage", None):
            cmd += ["--two-stage", str(args.two_stage), "--first-channels", str(getattr(args, "first_channels", 0))]
        if args.score_launch:
            cmd += ["--score-launch", *map(str, args.score_launch)]
        proc = None
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.row_timeout, env=child_env())
            with open(os.path.join(tmp, "decode.json")) as f:
                return json.load(f)["rows"][-1]
        except Exception as e:  # a crash or timeout of one row must not lose the others
            err = proc.stderr if proc is not None else getattr(e, "stderr", None)
            if isinstance(err, bytes):
                err = err.decode(errors="replace")
            tail = (err or "")[-300:]
            if isinstance(e, subprocess.TimeoutExpired):  # the command line tells nothing; the phase log does
                return dict(attention=side, batch=batch, context=ctx,
                            error=f"timeout after {args.row_timeout:.0f} s; {tail}"[:400])
            return dict(attention=side, batch=batch, context=ctx, error=f"{type(e).__name__}: {e} {tail}"[:300])


def write_json(out, res):
    bench_meta.write_json(os.path.join(out, "decode.json"), res)


def two_stage_arg(text: str) -> int:
    try:
        return two_stage.parse_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def first_channels_arg(text: str) -> int:
    """--first-channels: an even int >= 0 (whole rotary pairs); the model's head_dim bounds it when a row is built."""
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0 or v % 2:
        raise argparse.ArgumentTypeError(f"--first-channels {text!r} must be an even int >= 0 (whole rotary pairs)")
    return v


def two_stage_label(v) -> str:
    """A row's two_stage in the plot: MULT -> '4x'. Older rows hold [GROUP, MULT]: GROUP 1 was today's rule ('4x'),
    a larger GROUP the page-group summaries since deleted ('8:4')."""
    if isinstance(v, list):
        return f"{v[1]}x" if v[0] == 1 else f"{v[0]}:{v[1]}"
    return f"{v}x"


def check_token_shortlist(token_shortlist: int, key_channels: int) -> None:
    """--token-shortlist M (here and in profile_decode): >= 0, and > 0 only with a rule that ranks tokens."""
    if token_shortlist < 0 or (token_shortlist and not key_channels):
        raise SystemExit(f"--token-shortlist {token_shortlist} must be >= 0, and > 0 only with --key-channels C "
                         "> 0 (tokens are ranked by the key copy or labels)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=64, choices=[16, 32, 64, 128],
                   help="tokens a page, both sides (smaller pages select finer at the same budget)")
    p.add_argument("--layers", type=int, default=32, help="fewer layers for a quick check")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--kv-fraction", type=float, default=0.25,
                   help="HBM frame pool / KV pages (at least one step's selection)")
    p.add_argument("--sides", default="sparse,dense", help=f"sides of every context x batch, of {SIDES}")
    p.add_argument("--rows", default=None, help="explicit side:context:batch[:kv_fraction[:sieve]] list, side one "
                   f"of {SIDES}, e.g. sparse:32768:1,dense:32768:1,auto:32768:1,sparse:131072:1:0.0625:ref")
    p.add_argument("--sieve", default="auto", help="PB-LRU impl for the sparse side: auto, ref or pallas")
    p.add_argument("--topk", default="auto", help="page top-k of the sparse side: auto (the radix kernel on GPU), "
                   "ref (lax.top_k) or pallas")
    p.add_argument("--score-launch", type=int, nargs=2, default=None, metavar=("BLOCK_PAGES", "WARPS"),
                   help="score kernel launch shape of the sparse side (default: the kernel's own)")
    p.add_argument("--attention-impl", default="auto", help="sparse attention kernel: auto (Mosaic on Hopper where it applies, else Triton), pallas (Triton) or mosaic")
    p.add_argument("--tp", type=int, default=1, help="head-sharded tensor parallelism over this many GPUs (sparse "
                   "rows only; the Generator over a mesh of N devices)")
    p.add_argument("--fill", choices=("synthetic", "prefill"), default="synthetic",
                   help="the KV before decode: a synthetic fill on the device, or random prompts through the "
                   "Generator's prefill (rows then carry the time to first token)")
    p.add_argument("--hot-share", type=hot_share_arg, default=0.0,
                   help="sparse synthetic fill: plant hot pages (keys x HOT_GAIN), this share of the pages a step "
                        "selects (the budget's, or --token-shortlist x them) per sequence, layer and KV head on average, so selections repeat step to step; tunes a "
                        "row's hit rate to a trained model's trace (0: none, the worst case)")
    p.add_argument("--key-channels", type=int, default=0,
                   help="sparse rows: CacheConfig.key_channels (pages scored from an HBM copy of this many channels of "
                        "every key; 0 = Quest summaries)")
    p.add_argument("--label-bits", type=int, default=0, choices=(0, 4, 8),
                   help="sparse rows with --key-channels: CacheConfig.label_bits (label channels: int8 / int4 codes "
                        "of whole rotary pairs; 0 = the copy in the model's dtype)")
    p.add_argument("--token-shortlist", type=int, default=0, metavar="M",
                   help="sparse rows with --key-channels: per-token selection, the budget's tokens of largest label "
                        "mass among M x the budget's pages (CacheConfig.token_shortlist; 0: whole pages)")
    p.add_argument("--two-stage", type=two_stage_arg, default=None, metavar="MULT",
                   help="sparse rows: the rule above as the second stage of a TwoStage (Quest's page bound "
                        "shortlists MULT x the budget; cache/select/two_stage.py)")
    p.add_argument("--first-channels", type=first_channels_arg, default=0, metavar="C",
                   help="with --two-stage: labels over C channels (whole rotary pairs, 4 bits, picked online) "
                        "shortlist in place of Quest's bound (0: Quest)")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="both sides: the K/V page format (CacheConfig.kv_dtype; float8_e4m3fn: e4m3 codes with a "
                        "scale per page and KV head, in the HBM frames, the host pool and the dense cache)")
    p.add_argument("--dense-attention", default="auto", choices=DENSE_IMPLS,
                   help="dense rows: the decode attention (auto: cuDNN, or over fp8 pages the Triton page walk; "
                        "xla: the cache decoded by XLA, then the jnp attention)")
    p.add_argument("--scores", default="auto", choices=("auto", "ref", "pallas"),
                   help="sparse rows: page-score kernel (Quest bounds or the key copy's page mass): auto (the Pallas "
                        "kernel on GPU), ref (XLA) or pallas")
    p.add_argument("--append", action="store_true", help="keep the rows of an existing decode.json in --out")
    p.add_argument("--run", default=None, help="label recorded as each new row's 'run' (with --append, which run "
                                              "of the JSON a row belongs to; the command is added to the JSON's)")
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="run every row in this process (default: one child process per row)")
    p.add_argument("--row-timeout", type=float, default=900, help="seconds one isolated row may take")
    return add_common_args(p, files="decode.json, decode.png")


def main(argv=None):
    from ulacache_jax.cache.state import raise_host_limit
    raise_host_limit()  # before JAX starts: XLA's pinned host pool is 64 GiB by default
    # XLA takes 75% of HBM by default: the largest dense batches (112 GiB of K/V at 128K x 7 + 15 GiB of weights)
    # were refused on the H200 with 90 GiB free; the row processes inherit this
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    args = build_parser().parse_args(argv)
    from ulacache_jax.models import LlamaModel, get_preset
    mc = dataclasses.replace(get_preset("llama-3.1-8b"), num_layers=args.layers)
    check_token_shortlist(args.token_shortlist, args.key_channels)
    if args.first_channels and not args.two_stage:
        raise SystemExit(f"--first-channels {args.first_channels} needs --two-stage MULT (it names the first stage)")
    if args.first_channels > mc.head_dim:
        raise SystemExit(f"--first-channels {args.first_channels} must be <= the model's head_dim {mc.head_dim}")
    rows = []
    plan = parse_rows(args.rows or ",".join(f"{side}:{ctx}:{b}" for ctx in args.contexts.split(",")
                                            for b in args.batches.split(",") for side in args.sides.split(",")))
    commit = args.commit or git_commit()
    os.makedirs(args.out, exist_ok=True)
    old_meta, old_rows = earlier_run(os.path.join(args.out, "decode.json"), args.append)
    rows.extend(old_rows)
    # each row in a fresh process: a large row's buffers (or XLA's allocator state) cannot starve the next one
    # (on the H200 a 128K x 7 dense row after the sparse one could not get its cache); the parent then never
    # touches the GPU (jax.devices() would take XLA's preallocated share of HBM)
    isolate = args.isolate and len(plan) > 1
    if not isolate:
        model = LlamaModel(mc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        copy_bw, read_bw = copy_bandwidth(), read_bandwidth()
    for side, ctx, b, frac, sieve in plan:
        if isolate:
            rows.append(run_isolated(args, commit, side, ctx, b, frac, sieve))
        else:
            try:
                rows.append(run_side(model, mc, side, b, ctx, args, copy_bw, kv_fraction=frac, sieve=sieve,
                                     read_bw=read_bw))
            except Exception as e:  # an OOM at one size must not lose the others
                rows.append(dict(attention=side, batch=b, context=ctx, error=f"{type(e).__name__}: {e}"[:300]))
            rows[-1].update(device=str(jax.devices()[0].device_kind), copy_tb_s=copy_bw / 1e12,
                            read_tb_s=read_bw / 1e12)
        rows[-1].setdefault("commit", commit)
        if args.run:
            rows[-1].setdefault("run", args.run)
        print(json.dumps(rows[-1]), flush=True)
        write_json(args.out, dict(commit=commit, rows=rows, partial=True))
    devices = sorted({r["device"] for r in rows if "device" in r})
    res = dict(device=", ".join(devices), jax=jax.__version__, commit=commit,
               date=utc_now(),
               copy_tb_s="per row (measured in the row's process)",
               model=f"llama-3.1-8b shape, {args.layers} layers, random bf16 weights",
               kv="; ".join(KV_FILLS[f] for f in sorted({r.get("fill", "synthetic") for r in rows})), rows=rows)
    this = "bench_decode.py " + " ".join(sys.argv[1:] if argv is None else argv)
    res.update(appended_meta(old_meta, commit, this, args.run))
    # what else the file appended to holds (docs/benchmarks/decode.json: merged_from, variants) stays
    res.update({k: v for k, v in old_meta.items() if k not in res and k != "partial"})
    write_json(args.out, res)
    plot(res, os.path.join(args.out, "decode.png"), args.kv_fraction)
    label = lambda r: r["attention"] if r["attention"] != "auto" else f"auto>{r.get('attention_path', '?')}"
    print(f"{'side':11s} {'ctx':>7s} {'B':>3s} {'pool':>7s} {'sieve':>6s} {'tok/s':>9s} {'p50 ms':>8s} {'p99 ms':>8s} "
          f"{'floor%':>7s} {'hit':>6s}")
    for r in rows:
        if "error" in r:
            print(f"{label(r):11s} {r['context']:7d} {r['batch']:3d}  ERROR {r['error'][:80]}")
            continue
        hr = "" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        rd = "" if r.get("fraction_of_read_floor") is None else f"{100 * r['fraction_of_read_floor']:5.1f}%"
        print(f"{label(r):11s} {r['context']:7d} {r['batch']:3d} {r.get('kv_fraction', 1.0):7.4f} "
              f"{str(r.get('sieve') or '-'):>6s} {r['tokens_per_s']:9.1f} {r['p50_token_ms']:8.2f} "
              f"{r['p99_token_ms']:8.2f} {100 * r['fraction_of_floor']:6.1f}% {rd:>6s} {hr:>6s}")
    return res


def plot(res, path, kv_fraction):
    """Left: tokens/s sparse vs dense per (context, batch) at the main pool fraction; right: the pool sweep."""
    rows = res["rows"]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
        main_rows = [r for r in rows if "tokens_per_s" in r and
                     (r.get("attention_path", r["attention"]) == "dense"
                      or (r["kv_fraction"] == kv_fraction and r.get("sieve") == "pallas"))]
        labels = sorted({(r["context"], r["batch"]) for r in main_rows})
        rule = lambda r: ("" if r.get("rule") in (None, "quest") else
                          f", {r['rule']}" + (f" {two_stage_label(r['two_stage'])}" if r.get("two_stage") else "")
                          + (f" {r['key_channels']}@{r['label_bits'] or 16}b" if r.get("key_channels") else ""))
        side = lambda r: ((f"auto -> {r.get('attention_path')}" if r["attention"] == "auto" else "")
                          or (f"sparse, {r['attention_kernel']} attention{rule(r)}" if r.get("attention_kernel")
                              else r["attention"]))
        sides = sorted({side(r) for r in main_rows}, key=lambda x: (x == "dense", x))
        w = 0.8 / len(sides)
        for k, name in enumerate(sides):
            ys = [next((r["tokens_per_s"] for r in reversed(main_rows) if side(r) == name   # the latest run's
                        and (r["context"], r["batch"]) == lb), 0.0) for lb in labels]
            ax.bar(np.arange(len(labels)) + w * k - 0.4 + w / 2, ys, w, label=name)
        ax.set_xticks(np.arange(len(labels)), [f"{c // 1024}K b{b}" for c, b in labels])
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"sparse (pool {kv_fraction:g} of KV, Pallas sieve) vs dense\n{res['model']}, "
                     f"{res['device']}, {'prefilled KV' if 'prefill:' in res['kv'] else 'synthetic KV'}",
                     fontsize=9)
        ax.legend()
        sweep = sorted((r["kv_fraction"], r["tokens_per_s"], r["hit_rate"], r["context"], r["batch"], r["sieve"])
                       for r in rows if r.get("attention") == "sparse" and "tokens_per_s" in r)
        swept = [k for k in {(c, b, sv) for _, _, _, c, b, sv in sweep}
                 if sum((c, b, sv) == k for _, _, _, c, b, sv in sweep) > 1]
        ax2.set_visible(bool(swept))       # no pool sweep in this run: the left panel alone
        for key in sorted(swept):
            pts = [(f, t, h) for f, t, h, c, b, sv in sweep if (c, b, sv) == key]
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{key[0] // 1024}K b{key[1]} {key[2]}: tok/s")
            ax3 = ax2.twinx()
            ax3.plot([p[0] for p in pts], [p[2] for p in pts], "s--", color="gray", label="hit rate")
            ax3.set_ylabel("HBM hit rate")
            ax3.set_ylim(0, 1)
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("HBM frame pool / KV pages (random weights: worst-case locality)")
        ax2.set_ylabel("sparse decode tokens/s")
        if swept:
            ax2.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    except Exception as e:
        print("plot failed:", e)


if __name__ == "__main__":
    main()
