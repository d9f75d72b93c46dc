"""Record the page selections of a model decoding through UlaCache, as an eviction-study trace (issue 3).

    python -m scripts.selection_trace [--out docs/studies] [--name eviction_model_trace] [--steps 128] ...
        (writes OUT/NAME.npz)
    python -m scripts.studies.eviction_study --trace docs/studies/eviction_model_trace.npz --name eviction_model ...

Model: by default a Llama-shaped decoder with RANDOM weights (4 layers, 32 query heads, 8 KV heads of dim 32,
byte vocab). Random weights give real Quest selections over real key summaries, but WITHOUT the attention
structure of a trained model (no retrieval heads, no topic locality learned from data), so the trace is labelled
"random-weight model trace" everywhere. `--model PATH` loads a real checkpoint instead
(`ulacache_jax.models.from_pretrained`; its tokenizer.json, if present, encodes the prompts), and the label says so.

Path: the library's own. `Generator.prefill`, then decode token by token through `program.decode_layers` (the one
layer loop the compiled decode runs) with the Generator's own backend ops (`backends.SparseOps`), in chunks of
page_size steps opened by `ops.begin_chunk` and closed by `ops.end_chunk` (commit lengths, flush the tail), exactly
as `Program.decode` does, sampling with `sampling.sample` and the per-slot keys the Engine derives (greedy by
default; `--temperature`). The only addition is `RecordingOps`: before handing each layer to the backend's
`attend`, it recomputes the selection that call is about to make with the same building blocks on the same inputs
(`append_token`, `selection.fold_queries`, `pallas_kernels.page_scores.page_scores`, `selection.select_pages`), so
the recorded pages are the pages the sieve receives. Two checks guard that (both on by default, printed and stored):
- replaying the recorded trace through `pb_lru.ref_access` with the cache's own pool shape and clock reproduces
  the hit count of every (step, layer) sieve call that the backend reported;
- `--check-generate`: the Engine (the path `generate()` runs) on the same prompts, same Generator, gives the same
  tokens as this loop.

Trace layout (what `eviction_study.py --trace` reads): `lids` uint64 [rows, N] and `valid` bool [rows, N]; one row
per sieve call, i.e. per (decode step, layer) in execution order (`--rows layer`, the default, N = seqs x groups x
K), or one row per decode step with every layer's requests concatenated (`--rows step`, the synthetic trace's
convention). Within a row: sequence-major, then group, then the selection's K pages (by score). LIDs are
`seq << 44 | layer << 36 | group << 32 | page * page_size` (ulacache_jax/cache/lid.py). Also stored: `total_pages`
(the KV cache's complete pages at the end of decoding, over every (sequence, layer, group): the denominator of
the study's pool fractions), `clock` [rows] (the cache clock the library stamped each sieve call with: it ticks
once per call; with `--rows step`, the stamp of the step's first layer), `lib_hits`/`lib_requests` [steps, L],
`tokens`, `label`, and a JSON `meta`.

Caveat of the default (random weights, greedy): generation collapses to a repeated token within a few steps, so
the queries move only with position and the trace's step-to-step locality is high; `--temperature 1.0` (random
byte tokens) gives the opposite extreme. A trained model's selections lie somewhere else; rerun with --model.
The kept trace is docs/studies/eviction_model_trace.npz; the study's hit rates on it are rows of
docs/benchmarks/eviction.json (the commands are in its meta).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from ulacache_jax.cache import pb_lru# noqa: E402
from ulacache_jax.runtime.backends import SparseOps  # noqa: E402
from scripts.bench_meta import add_common_args, git_commit, write_npz  # noqa: E402
from ulacache_jax.cache.decode_layer import DecodeOptions, attend_pages, plan_layer  # noqa: E402
from ulacache_jax.app.demo_prompts import demo_prompts  # noqa: E402
from ulacache_jax.runtime.engine import Engine, SamplingParams  # noqa: E402
from ulacache_jax.runtime.generator import Generator, default_cache_config  # noqa: E402
from ulacache_jax.models import (BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE, ByteTokenizer, LlamaModel,  # noqa: E402
                                 ModelConfig)
from ulacache_jax.runtime.program import DecodeMeta, decode_layers  # noqa: E402
from ulacache_jax.runtime.sampling import SamplingArrays, row_keys, sample  # noqa: E402


# ---- model and prompts ------------------------------------------------------------------------------------------
def build_model(args):
    """-> (model, tokenizer, label). RANDOM weights unless --model is given."""
    if args.model:
        from ulacache_jax.models import from_pretrained, load_tokenizer
        model = from_pretrained(args.model, dtype=jnp.dtype(args.dtype))
        try:
            tok = load_tokenizer(args.model)
        except FileNotFoundError:
            tok = None
        return model, tok, f"model trace ({os.path.basename(os.path.normpath(args.model))}, checkpoint weights)"
    cfg = ModelConfig(architecture="llama", vocab_size=BYTE_VOCAB_SIZE, hidden_size=args.hidden,
                      intermediate_size=2 * args.hidden, num_layers=args.layers, num_heads=args.heads,
                      num_kv_heads=args.kv_heads, head_dim=args.head_dim, rope_theta=500000.0,
                      max_position_embeddings=1 << 17, bos_token_id=BYTE_BOS_ID, eos_token_ids=(BYTE_EOS_ID,))
    model = LlamaModel(cfg, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(args.seed))
    return model, ByteTokenizer(), "random-weight model trace"


def build_prompts(args, tokenizer, vocab_size):
    """-> (list of token-id lists of exactly --prompt-len tokens, description).

    demo: sequence i is the six built-in demo prompts (ulacache_jax/app/demo_prompts.py: a ledger, a service log, a
    manual, a story) concatenated starting from the i-th, cut to its last tokens (so it ends with a question),
    behind a BOS. random: uniformly random byte tokens."""
    n = args.prompt_len
    if args.prompts == "demo":
        texts = [r["prompt"] for r in demo_prompts()]
        bos = getattr(tokenizer, "bos_id", None) if tokenizer is not None else BYTE_BOS_ID
        body = n - (bos is not None)
        out = []
        for i in range(args.num_seqs):
            text = "\n\n".join(texts[(i + j) % len(texts)] for j in range(len(texts)))
            ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else list(text.encode())
            while len(ids) < body:
                ids = ids + ids
            ids = [t % vocab_size for t in ids[-body:]]
            out.append(([bos] if bos is not None else []) + ids)
        return out, (f"{args.num_seqs} prompts of {n} tokens: the built-in demo prompts concatenated (rotated per "
                     "sequence), cut to their last tokens")
    rng = np.random.default_rng(args.seed)
    ids = [rng.integers(0, min(256, vocab_size), n).tolist() for _ in range(args.num_seqs)]
    return ids, f"{args.num_seqs} prompts of {n} uniformly random byte tokens"


# ---- the decode loop, recording selections -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RecordingOps:
    """The sparse backend's traced half, recording what each layer's sieve call receives. The decode cache is
    (CacheState, record); record holds, per layer l (a static index): pages [L, S, G, K] int32 (-1 unused), valid
    [L, S, G, K] bool, clock [L] int32 (the stamp the sieve call gets), hits and misses [L] int32."""
    inner: SparseOps

    def attend(self, cache, host, layer, q, k, v, pos, live, rank):
        state, rec = cache
        c, o = state.config, self.inner.options
        lv = live & state.seqs.active                           # as SparseOps.attend
        clock = state.clock
        # SparseOps.attend is attend_layer = plan_layer + attend_pages: its plan holds the pages the sieve received
        state, plan, s = plan_layer(state, host, layer, q, k, v, pos, lv, options=o, rank=rank)
        state, out = attend_pages(state, host, q, plan, options=o)
        start = plan.start[..., :min(c.shortlist_pages, c.max_pages_per_seq)]   # the pages the sieve received
        sel = jnp.where(start >= 0, start // c.page_size, -1)
        rec = dict(pages=rec["pages"].at[layer].set(sel),
                   valid=rec["valid"].at[layer].set((sel >= 0) & lv[:, None, None]),
                   clock=rec["clock"].at[layer].set(clock), hits=rec["hits"].at[layer].set(s.hits),
                   misses=rec["misses"].at[layer].set(s.misses))
        return (state, rec), out, s


def make_step(graphdef, ops: SparseOps):
    """One decode step of every slot through `program.decode_layers`, as in the body of `Program._decode`'s loop
    (single device: the plain graphdef, rank 0); also returns the step's record (see RecordingOps)."""
    rec_ops = RecordingOps(ops)

    def step(params, state, host, tok, length, keys, i, sampling):
        c = state.config
        L, S, G, K = c.num_layers, c.max_seqs, c.groups_per_rank, min(c.shortlist_pages, c.max_pages_per_seq)
        model = nnx.merge(graphdef, params)
        live = state.seqs.active
        rec = dict(pages=jnp.full((L, S, G, K), -1, jnp.int32), valid=jnp.zeros((L, S, G, K), bool),
                   clock=jnp.zeros(L, jnp.int32), hits=jnp.zeros(L, jnp.int32), misses=jnp.zeros(L, jnp.int32))
        (state, rec), y, _ = decode_layers(model, rec_ops, (state, rec), model.embed(tok[:, None]),
                                           DecodeMeta(length, live, 0, host))
        nxt = sample(model.logits(y)[:, 0], jax.vmap(jax.random.fold_in, (0, None))(keys, i), sampling)
        return state, nxt, length + live, rec

    return jax.jit(step, donate_argnums=(1,))


def lids_of(pages, page_size):
    """pages [L, S, G, K] int32 (-1 unused) -> uint64 LIDs (seq << 44 | layer << 36 | group << 32 | tok)."""
    L, S, G, K = pages.shape
    l = np.arange(L, dtype=np.uint64)[:, None, None, None]
    s = np.arange(S, dtype=np.uint64)[None, :, None, None]
    g = np.arange(G, dtype=np.uint64)[None, None, :, None]
    tok = np.maximum(pages, 0).astype(np.uint64) * np.uint64(page_size)
    return (s << np.uint64(44)) | (l << np.uint64(36)) | (g << np.uint64(32)) | tok


def replay_hits(lids, valid, clock, num_buckets, slots):
    """Per-row hits of the library's own PB-LRU shape and clock, replayed on the recorded trace."""
    state = pb_lru.init(num_buckets, slots)
    out = np.zeros(len(lids), np.int64)
    for t in range(len(lids)):
        hi = jnp.asarray((lids[t] >> np.uint64(32)).astype(np.uint32))
        lo = jnp.asarray((lids[t] & np.uint64(0xFFFFFFFF)).astype(np.uint32))
        state, res = pb_lru.ref_access(state, hi, lo, jnp.asarray(valid[t]), jnp.int32(clock[t]))
        out[t] = int(res.hit.sum())
    return out


def repeat_fraction(pages, valid):
    """Share of valid selections (steps >= 1) whose page the same (layer, seq, group) also selected one step
    before: the trace's step-to-step locality. pages, valid [steps, L, S, G, K]."""
    rep = tot = 0
    for t in range(1, pages.shape[0]):
        prev = np.where(valid[t - 1], pages[t - 1], -1)
        cur = np.where(valid[t], pages[t], -2)
        same = (cur[..., :, None] == prev[..., None, :]).any(-1)
        rep += int(same.sum())
        tot += int(valid[t].sum())
    return rep / max(tot, 1)


def main(argv=None) -> dict:
    """Record the trace, run the checks, write OUT/NAME.npz -> the trace's meta (its checks under replay_matches_library
    and generate_tokens_match)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.steps % args.page_size:
        ap.error(f"--steps {args.steps} must be a multiple of --page-size {args.page_size}")
    return record_trace(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # float32: the dtype of the kept trace (docs/studies/eviction_model_trace.npz); bf16 scores would rank
    # near-tied pages differently and so record another trace
    add_common_args(ap, out_default="docs/studies", files="NAME.npz (--name)", model=None,
                    model_default_help="RANDOM weights (a Llama of --layers, --heads, ... with the byte tokenizer)",
                    dtype="float32")
    ap.add_argument("--name", default="eviction_model_trace", help="stem of the trace file, NAME.npz")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", choices=("demo", "random"), default="demo")
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=3968,
                    help="tokens per prompt (default: 3968 + 128 steps = 4096 = 256 pages at the end)")
    ap.add_argument("--steps", type=int, default=128, help="decode steps (a multiple of --page-size)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=512, help="selected tokens per (sequence, group)")
    ap.add_argument("--rows", choices=("layer", "step"), default="layer")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    ap.add_argument("--check-generate", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the Engine (generate()'s path) and require the same tokens")
    return ap


def record_trace(args) -> dict:
    """The run behind `main`: record, check, write OUT/NAME.npz -> the trace's meta."""
    t0 = time.time()
    options = DecodeOptions()

    model, tokenizer, label = build_model(args)
    mc = model.config
    prompts, prompt_desc = build_prompts(args, tokenizer, mc.vocab_size)
    S = len(prompts)
    longest = max(map(len, prompts)) + args.steps + 1
    cc = default_cache_config(mc, num_seqs=S, max_tokens=longest, page_size=args.page_size,
                              token_budget=args.token_budget, dtype=model.dtype)
    print(f"{label}: {mc.num_layers} layers, {mc.num_heads} heads / {mc.num_kv_heads} KV heads of {mc.head_dim}, "
          f"hidden {mc.hidden_size}; {prompt_desc} ({', '.join(str(len(p)) for p in prompts)} tokens); "
          f"page {cc.page_size}, budget {cc.token_budget} tokens = {cc.select_pages} pages per (seq, group), "
          f"{cc.num_groups} groups, library pool {cc.num_buckets} x {cc.slots_per_bucket} frames", flush=True)

    gen = Generator(model, cc, options=options)
    slots = [gen.admit(len(p) + args.steps + 1) for p in prompts]
    assert len(set(slots)) == S
    first = np.zeros(cc.max_seqs, np.int32)
    # the keys the Engine derives for request i (seed * 1_000_003 + i; first token from counter 2**31 - 1, decode
    # chunk n from counter n), so sampled tokens match it too
    seeds = np.zeros(cc.max_seqs, np.uint32)
    for i, slot in enumerate(slots):
        seeds[slot] = (args.seed * 1_000_003 + i) % 2**32
    seeds = jnp.asarray(seeds)
    sampling = SamplingArrays.fill(cc.max_seqs, args.temperature)
    t1 = time.time()
    for slot, p in zip(slots, prompts):
        logits = gen.prefill(slot, p)
        first[slot] = int(sample(logits[None], row_keys(seeds[slot:slot + 1], jnp.asarray([2**31 - 1], jnp.uint32)),
                                 SamplingArrays.fill(1, args.temperature))[0])
    prefill_s = time.time() - t1
    print(f"prefill: {prefill_s:.1f} s", flush=True)

    ops = gen.backend.ops
    step = make_step(nnx.split(model)[0], ops)
    begin = jax.jit(ops.begin_chunk, donate_argnums=0)
    end = jax.jit(ops.end_chunk, donate_argnums=(0, 1))
    m = gen.cache
    state, host = m.state, m.host
    m.state = m.host = None
    tok, length = jnp.asarray(first), jnp.array(state.seqs.length, copy=True)  # not the donated buffer
    recs, toks = [], []
    t1 = time.time()
    for i in range(args.steps):
        if i % cc.page_size == 0:
            state = begin(state)
        keys = row_keys(seeds, jnp.full(cc.max_seqs, i // cc.page_size, jnp.uint32))
        state, tok, length, rec = step(gen.params, state, host, tok, length, keys, jnp.int32(i % cc.page_size),
                                       sampling)
        recs.append(jax.device_get(rec))
        toks.append(np.asarray(tok))
        if (i + 1) % cc.page_size == 0:
            state, host = end(state, host, length)
            print(f"  decode step {i + 1}/{args.steps} ({time.time() - t1:.1f} s)", flush=True)
    decode_s = time.time() - t1
    flushed_last = np.asarray(state.seqs.flushed)[slots].astype(np.int64)
    m.state, m.host = state, host
    for slot in slots:
        gen.release(slot)

    pages = np.stack([r["pages"] for r in recs])    # [steps, L, S, G, K]
    valids = np.stack([r["valid"] for r in recs])
    hits = np.stack([r["hits"] for r in recs])      # [steps, L]
    misses = np.stack([r["misses"] for r in recs])
    clocks = np.stack([r["clock"] for r in recs]).astype(np.int32)   # [steps, L]: the stamp of each sieve call
    toks = np.stack(toks, axis=1)                # [S, steps]
    steps, L, _, G, K = pages.shape
    lids = np.stack([lids_of(pages[t], cc.page_size) for t in range(steps)])   # [steps, L, S, G, K]
    lids = np.where(valids, lids, np.uint64(0))
    if args.rows == "layer":
        row_lids, row_valid = lids.reshape(steps * L, -1), valids.reshape(steps * L, -1)
        row_clock = clocks.reshape(-1)
    else:
        row_lids, row_valid = lids.reshape(steps, -1), valids.reshape(steps, -1)
        row_clock = clocks[:, 0]
    # the KV cache's pages at the end: every (seq, layer, group)'s complete (flushed) pages after the last chunk
    total_pages = int(L * G * flushed_last.sum())

    # check 1: the library's own PB-LRU, replayed on the recorded trace (per sieve call), gives the same hits
    lay_lids, lay_valid = lids.reshape(steps * L, -1), valids.reshape(steps * L, -1)
    rep = replay_hits(lay_lids, lay_valid, clocks.reshape(-1), cc.num_buckets, cc.slots_per_bucket)
    replay_ok = bool(np.array_equal(rep, hits.reshape(-1)))
    req = lay_valid.sum(axis=1)
    lib_hit_rate = float(hits.sum() / max(req.sum(), 1))
    print(f"check: replay of the trace through the library's PB-LRU ({cc.num_buckets} x {cc.slots_per_bucket}, "
          f"its clock) reproduces the backend's hits at every sieve call: {replay_ok} "
          f"(library hit rate {lib_hit_rate:.4f}, {int(hits.sum())} of {int(req.sum())})", flush=True)
    if not np.array_equal(misses.reshape(-1), req - hits.reshape(-1)):
        print("check: WARNING the backend's misses != recorded requests - hits", flush=True)
        replay_ok = False

    # check 2: the Engine (generate()'s path: the compiled decode chunks) on the same Generator gives the same tokens
    gen_ok = None
    if args.check_generate:
        t1 = time.time()
        reqs = Engine(generator=gen, seed=args.seed).run(
            prompts, SamplingParams(max_new_tokens=args.steps + 1, temperature=args.temperature, stop_ids=()))
        mine = [[int(first[s])] + toks[s].tolist() for s in slots]
        gen_ok = [r.tokens for r in reqs] == mine
        print(f"check: the Engine gives the same {args.steps + 1} tokens per sequence: {gen_ok} "
              f"({time.time() - t1:.1f} s)", flush=True)

    rep_frac = repeat_fraction(pages, valids)
    distinct = len(np.unique(row_lids[row_valid]))
    meta = dict(label=label, model=args.model or "RANDOM weights (LlamaModel init, seed %d)" % args.seed,
                model_config=mc.to_dict(), prompts=prompt_desc, temperature=args.temperature,
                prompt_tokens=[len(p) for p in prompts],
                decode_steps=steps, rows=args.rows, rows_shape=list(row_lids.shape),
                cache_config=dataclasses.asdict(cc), total_pages=total_pages, distinct_pages_requested=distinct,
                repeat_fraction_vs_previous_step=rep_frac, library_hit_rate=lib_hit_rate,
                replay_matches_library=replay_ok, generate_tokens_match=gen_ok,
                prefill_s=round(prefill_s, 1), decode_s=round(decode_s, 1), seconds=round(time.time() - t0, 1),
                jax=jax.__version__, device=jax.devices()[0].device_kind, commit=args.commit or git_commit(),
                command=" ".join(sys.argv))
    path = os.path.join(args.out, f"{args.name}.npz")
    write_npz(path, lids=row_lids, valid=row_valid, total_pages=np.int64(total_pages), clock=row_clock,
              lib_hits=hits, lib_requests=req.reshape(steps, L), tokens=toks, label=np.str_(label),
              meta=np.str_(json.dumps(meta)))
    print(f"wrote {path}: {row_lids.shape[0]} rows x {row_lids.shape[1]} requests, {total_pages} KV pages, "
          f"{distinct} distinct selected, {100 * rep_frac:.1f}% of selections repeat the previous step's "
          f"({meta['seconds']} s)")
    return meta


if __name__ == "__main__":
    meta = main()
    sys.exit(0 if meta["replay_matches_library"] and meta["generate_tokens_match"] is not False else 1)
