"""One layer's decode attention over the cache: append -> select -> sieve -> fetch -> attend.

All functions here work on ONE rank's view of the state (leading rank axis of size 1): directly without TP, or
per rank inside `jax.shard_map` (ulacache_jax/runtime/tp.py), where `rank` is the mesh axis index. The decode batch is
every sequence slot (inactive slots are masked), so shapes never depend on how many requests are running.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from ulacache_jax.cache import lid as lid_mod
from ulacache_jax.cache import pb_lru
from ulacache_jax.cache.select import quest as selection
from ulacache_jax.cache.select.registry import kept_rules
from ulacache_jax.cache import vtlb as vtlb_mod
from ulacache_jax.cache.state import (CacheState, HostPool, overflow_frame, pool_pages, ring_arrays, tail_frame,
                                      with_pool, with_ring)
from ulacache_jax.cache.config import TAIL_PAGES
from ulacache_jax.cache.kernel_choice import TOPK_MAX_PAGES, resolved_options
from ulacache_jax.pallas_kernels import next_pow2, page_copy
from ulacache_jax.pallas_kernels.sparse_decode_attention import sparse_decode_attention
from ulacache_jax.pallas_kernels.token_decode_attention import token_decode_attention
from ulacache_jax.pallas_kernels.tail_append import tail_append


@partial(jax.tree_util.register_dataclass, data_fields=["hits", "misses", "overflow", "fetched"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LayerStats:
    hits: jax.Array      # [] int32 selected pages found in HBM
    misses: jax.Array    # [] int32 selected pages not in HBM (filled or overflow)
    overflow: jax.Array  # [] int32 misses with no free candidate slot: read from host, not cached
    fetched: jax.Array   # [] int32 pages that crossed PCIe (misses; one per frame where several rows missed it)

    @staticmethod
    def zeros():
        z = jnp.zeros((), jnp.int32)
        return LayerStats(z, z, z, z)

    def __add__(self, o):
        return LayerStats(self.hits + o.hits, self.misses + o.misses, self.overflow + o.overflow,
                          self.fetched + o.fetched)


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """What the decode asks for per step: 'auto' (the resolver's choice: kernel_choice.resolve, tabled in
    docs/KERNELS.md) or a forced implementation ('pallas' = the Pallas kernel, 'ref' = the jnp reference; the
    attention also takes 'mosaic', the Mosaic GPU kernel on Hopper). A backend resolves them once when it is built."""
    attention: str = "auto"       # sparse decode attention: 'mosaic', 'pallas' (Triton) or 'ref'
    sieve: str = "auto"           # PB-LRU access
    scores: str = "auto"          # Quest page scores
    score_launch: tuple[int, int] | None = None  # (block_pages, num_warps) of the score kernel; None: its default
    topk: str = "auto"            # page top-k: 'pallas' (radix select) or 'ref' (lax.top_k)
    copy: str = "auto"            # page copies between tiers
    fused_fetch: bool = False     # misses read by the attention kernel and stored into their frames in one pass
    softcap: float | None = None
    dense_attention: str = "auto"  # the dense baseline's decode attention: 'cudnn', 'xla' or (fp8 pages) 'pallas'


def append_token(state: CacheState, layer: int, k_new, v_new, pos, live, *, impl: str = "ref") -> CacheState:
    """Write one token's K/V per sequence into its tail-ring page, update that page's key summary (Quest's, kept
    for every rule: in the same kernel launch) and run the selection rule's `append`.
    k_new, v_new [S, KVr, D] (this rank's KV heads); pos [S] int32 token index; live [S] bool. impl: the tail
    append's implementation (pallas_kernels/tail_append.py: one kernel, or 'ref' = four XLA scatters); the decode
    passes its `copy` choice (the append writes pool pages as the copies do)."""
    c = state.config
    S, G, g, P = c.max_seqs, c.groups_per_rank, c.kv_heads_per_group, c.page_size
    ring_k, ring_v = ring_arrays(state)       # the pool, or a scaled codec's own ring (cache/codec.py)
    dt = ring_k.dtype
    kg = k_new.astype(dt).reshape(S, 1, G, g, c.head_dim)
    vg = v_new.astype(dt).reshape(S, 1, G, g, c.head_dim)
    page, off = pos // P, pos % P
    frame = tail_frame(c, jnp.arange(S)[:, None], layer, jnp.arange(G)[None, :], page[:, None])   # [S, G]
    frame = jnp.where(live[:, None], frame, -1)[:, None, :]                          # [S, 1, G], -1 = skipped
    sub, first = selection.append_operands(c, pos, live)                             # [S] each
    ring_k, ring_v, kmin, kmax = tail_append(ring_k, ring_v, kg, vg, frame, off[:, None],
                                             state.kmin, state.kmax, sub, first, layer=layer, impl=impl)
    state = dataclasses.replace(with_ring(state, ring_k, ring_v), kmin=kmin, kmax=kmax)
    for rule in kept_rules(c):
        state = rule.append(state, layer, kg[:, 0], pos, live)
    return state


@partial(jax.tree_util.register_dataclass, data_fields=["frame", "start", "src", "host_page", "seq_len", "tok_frame",
                                                      "tok_row", "tok_pos"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PagePlan:
    """What one layer's attention reads, per (sequence, group): the selected pages then the tail pages.
    frame, start, src, host_page [S, G, K + TAIL_PAGES] int32 (HBM frame, first token or -1 = unused, source:
    0 unused / 1 HBM / 2 host, not cached / 3 host, stored into `frame` by the kernel, host page or -1);
    seq_len [S] int32 visible tokens. Per-token selection (config.token_shortlist) also lists the tokens attended,
    which the attention reads instead of the pages: tok_frame, tok_row, tok_pos [S, G, N + TAIL_PAGES * page] int32
    (frame, row in it, position or -1 = unused: the budget's tokens, then the tail pages' tokens); None otherwise."""
    frame: jax.Array
    start: jax.Array
    src: jax.Array
    host_page: jax.Array
    seq_len: jax.Array
    tok_frame: jax.Array | None = None
    tok_row: jax.Array | None = None
    tok_pos: jax.Array | None = None


def _scores(state: CacheState, layer: int, q, flushed, options: DecodeOptions):
    """Page scores of one query row per sequence: q [S, 1, Hr, D]; flushed [S] candidate pages -> [S, G, P]
    float32, by the config's selection rule (select/registry.py; a static config field, so the choice is static):
    Quest's bound over the key summaries, the key copy's attention mass, ... options.scores picks the kernel."""
    return state.config.selection_rule.score(state, layer, q, flushed, options)


def _sieve_pages(state: CacheState, layer: int, sel, row_live, row_seq, rank, options: DecodeOptions):
    """One PB-LRU access for the selected pages of every row (a row: one sequence's step; a verification has
    several rows per sequence). sel [R, G, K] page ids (-1 unused), row_live [R], row_seq [R] the row's sequence
    slot -> (pb, vtlb table of this rank after the access, valid, page, frame, host_idx, miss, filled, overflow,
    lead), the last eight [R, G, K]: hits refresh recency, misses take frames (filled) or get none (overflow);
    lead: a filled miss that is the first request of its frame in this access (one fetch per frame).
    A page's LID names it by its owner (state.seqs.owner: the slot, or a shared prefix page's id), so the rows of
    every sharer of a stored prefix page request one LID and get one frame; its host page comes from the row's own
    vTLB row (every sharer's row points at the stored page)."""
    c = state.config
    G, P = c.groups_per_rank, c.page_size
    R, _, K = sel.shape
    valid = (sel >= 0) & row_live[:, None, None]
    page = jnp.where(valid, sel, 0)
    seq_ids = jnp.broadcast_to(row_seq[:, None, None], (R, G, K))
    owner = state.seqs.owner[seq_ids, page]                                            # [R, G, K] LID seq field
    grp = jnp.broadcast_to(rank * G + jnp.arange(G)[None, :, None], (R, G, K))
    hi, lo = lid_mod.pack(owner, jnp.full_like(seq_ids, layer), grp, (page * P).astype(jnp.uint32))
    pb = jax.tree.map(lambda a: a[0], state.pb)
    pb, out = pb_lru.access(pb, hi.reshape(-1), lo.reshape(-1), valid.reshape(-1), state.clock, impl=options.sieve)
    table = jax.tree.map(lambda a: a[0], state.vtlb)
    table = vtlb_mod.apply_access(table, hi.reshape(-1), lo.reshape(-1), out, rank * G)
    frame = out.frame.reshape(R, G, K)
    miss = valid & ~out.hit.reshape(R, G, K)
    filled = miss & (frame >= 0)
    host_idx = table.host_page[seq_ids, layer, jnp.arange(G)[None, :, None], page]
    # duplicates of one LID (sharers, or verification rows) share its frame: only the first fetches it. A frame
    # holds one LID, so the LID's first request (the access's `fill`) is the frame's first request.
    lead = out.fill.reshape(R, G, K)
    return pb, table, valid, page, frame, host_idx, miss, filled, miss & (frame < 0), lead


def token_list(config, scores, page, valid, frame, flushed, budget, topk: str):
    """Per-token selection inside the selected pages (config.token_shortlist): scores [R, G, K, page] float32 the
    rule's token mass (score_tokens), page / valid / frame [R, G, K] the selected pages (ids, taking part, HBM frame
    holding each), flushed [R] int32, budget [R] int32 pages of tokens a row attends (None: token_budget) -> (frame,
    row, pos) [R, G, N] int32, N = min(token_budget, K * page): the tokens of largest mass, every token of the sink
    and recent pages first (as whole pages in page selection), pos -1 where a slot is unused (fewer candidates).
    The top-k is the page top-k over the K * page tokens (the radix-select kernel where the row fits it)."""
    c = config
    P = c.page_size
    R, G, K = page.shape
    forced = (page < c.sink_pages) | (page >= flushed[:, None, None] - c.recent_pages)            # [R, G, K]
    x = jnp.where(valid[..., None], jnp.where(forced[..., None], jnp.inf, scores), -jnp.inf).reshape(R, G, K * P)
    every = jnp.full((R,), K * P, jnp.int32)
    impl = topk if next_pow2(K * P) <= TOPK_MAX_PAGES else "ref"
    ids = selection.select_pages(x, every, select_pages=min(c.token_budget, K * P), sink_pages=0, recent_pages=0,
                                 impl=impl)                                                   # [R, G, N]
    if budget is not None:
        ids = selection.limit_pages(ids, x, every, budget * P, sink_pages=0, recent_pages=0)
    at = jnp.maximum(ids, 0)
    use = (ids >= 0) & (jnp.take_along_axis(x, at, axis=-1) > -jnp.inf)
    slot, row = at // P, at % P
    pos = jnp.take_along_axis(page, slot, axis=-1) * P + row
    return (jnp.take_along_axis(frame, slot, axis=-1).astype(jnp.int32), row.astype(jnp.int32),
            jnp.where(use, pos, -1).astype(jnp.int32))


def tail_tokens(page_size: int, t_frame, t_ok, tp, seq_len):
    """The tail pages as a token list: t_frame, t_ok [R, G, T] (their pool frames: the ring is in the pool with
    per-token selection), tp [R, T] their page ids, seq_len [R] -> (frame, row, pos) [R, G, T * page] int32, pos -1
    past the length."""
    R, G, T = t_frame.shape
    row = jnp.arange(page_size, dtype=jnp.int32)
    pos = tp[:, None, :, None] * page_size + row                                                # [R, 1, T, page]
    ok = t_ok[..., None] & (pos < seq_len[:, None, None, None])                                 # [R, G, T, page]
    shape = (R, G, T * page_size)
    return (jnp.broadcast_to(t_frame[..., None], ok.shape).reshape(shape).astype(jnp.int32),
            jnp.broadcast_to(row, ok.shape).reshape(shape), jnp.where(ok, pos, -1).reshape(shape).astype(jnp.int32))


def with_tokens(plan: PagePlan, chosen, tail) -> PagePlan:
    """`plan` with the token lists of `chosen` and `tail` ((frame, row, pos) each) concatenated."""
    f, r, p = (jnp.concatenate([a, b], axis=-1) for a, b in zip(chosen, tail))
    return dataclasses.replace(plan, tok_frame=f, tok_row=r, tok_pos=p)


def plan_layer(state: CacheState, host: HostPool, layer: int, q, k_new, v_new, pos, live, *,
               options: DecodeOptions = DecodeOptions(), rank=0, append: bool = True, budget=None):
    """Append -> select -> sieve -> (separate) fetch for one layer: everything before the attention kernel.
    Returns (state, PagePlan, LayerStats); arguments as in `attend_layer`. append=False: the token's K/V is
    already in the tail ring (`verify_layer`); k_new, v_new are unused. budget [S] int32: pages each sequence
    selects (at most select_pages; selection.limit_pages), None = select_pages for every one."""
    c = state.config
    S, G, P = c.max_seqs, c.groups_per_rank, c.page_size
    options = resolved_options(options, c, q)                                         # a backend's: as given
    if append:
        state = append_token(state, layer, k_new, v_new, pos, live, impl=options.copy)
    seq_len = jnp.where(live, pos + 1, 0)                                             # [S] visible tokens

    # 1. Selection among flushed pages (Quest bound, or the key copy's mass), static count K per (sequence, group).
    flushed = jnp.where(live, state.seqs.flushed, 0)
    scores = _scores(state, layer, q, flushed, options)                               # [S, G, P]
    sel = selection.select_pages(scores, flushed, select_pages=c.shortlist_pages, sink_pages=c.sink_pages,
                                 recent_pages=c.recent_pages, impl=options.topk)      # [S, G, K]
    if budget is not None:      # per-sequence budgets: the winners past a sequence's budget rank are dropped
        sel = selection.limit_pages(sel, scores, flushed, budget * max(1, c.token_shortlist),
                                    sink_pages=c.sink_pages, recent_pages=c.recent_pages)
    if c.token_shortlist and options.fused_fetch:
        raise ValueError(f"token_shortlist = {c.token_shortlist} reads single tokens from HBM frames: the fused fetch "
                         "(misses read from the host pool by the page kernel) does not apply; leave fused_fetch off")
    # 2. Sieve: hits refresh, misses take frames; the vTLB follows.
    pb, table, valid, page, frame, host_idx, miss, filled, overflow, lead = _sieve_pages(
        state, layer, sel, live, jnp.arange(S), rank, options)                        # [S, G, K] each
    K = sel.shape[-1]

    # 3. Misses cross PCIe once: fetched into their frames here, or read and stored by the attention kernel. A
    #    frame several rows missed (sharers of one stored prefix page) is fetched or stored by its first row only.
    pool = [a[0] for a in pool_pages(state).arrays()]                                 # codes (and scales)
    if not options.fused_fetch:
        # overflow pages (no free slot) are staged in this call's overflow frames, so attention reads only HBM.
        # There is one overflow frame per (sequence, group, slot) (config.overflow_frames), so a slot's own frame
        # needs no compaction (a cumsum over the overflow flags cost a launch a layer)
        stage = overflow_frame(c, jnp.arange(S * G * K, dtype=jnp.int32).reshape(S, G, K))   # [S, G, K]
        frame = jnp.where(overflow, stage, frame)
        dst = jnp.where(lead | overflow, frame, -1).reshape(-1)
        pool = page_copy.fetch(pool, [a[0] for a in host.arrays()], host_idx.reshape(-1), dst,
                               impl=options.copy)   # K and V (and their scales) in one launch
        src = jnp.where(valid, 1, 0)
        fetched = lead.sum() + overflow.sum()
    else:
        # a duplicate reads the host page without storing it (two programs storing one frame would race)
        src = jnp.where(valid, jnp.where(overflow | (filled & ~lead), 2, jnp.where(filled, 3, 1)), 0)
        fetched = miss.sum()

    # 4. Tail pages (unflushed, at most TAIL_PAGES) from the ring, appended to the attended set.
    tp = flushed[:, None] + jnp.arange(TAIL_PAGES)[None, :]                           # [S, T]
    t_ok = live[:, None] & (tp * P < seq_len[:, None])
    t_frame = tail_frame(c, jnp.arange(S)[:, None, None], layer, jnp.arange(G)[None, :, None], tp[:, None, :])
    t_frame = jnp.broadcast_to(t_frame, (S, G, TAIL_PAGES))
    t_ok = jnp.broadcast_to(t_ok[:, None, :], (S, G, TAIL_PAGES))
    t_frame, t_src, t_host = tail_sources(c, t_frame, t_ok)
    plan = PagePlan(
        frame=jnp.concatenate([jnp.where(valid, frame, 0), t_frame], axis=-1).astype(jnp.int32),
        start=jnp.concatenate([jnp.where(valid, page * P, -1),
                               jnp.where(t_ok, jnp.broadcast_to(tp[:, None, :], (S, G, TAIL_PAGES)) * P, -1)],
                              axis=-1).astype(jnp.int32),
        src=jnp.concatenate([src, t_src], axis=-1).astype(jnp.int32),
        host_page=jnp.concatenate([jnp.where(valid, host_idx, -1), t_host], axis=-1).astype(jnp.int32),
        seq_len=seq_len.astype(jnp.int32))
    if c.token_shortlist:       # the budget's tokens among the selected pages (all in HBM frames now)
        sc = c.selection_rule.score_tokens(state, layer, q, page, valid, options)      # [S, G, K, page]
        plan = with_tokens(plan, token_list(c, sc, page, valid, frame, flushed, budget, options.topk),
                           tail_tokens(P, t_frame, t_ok, tp, seq_len))
    stats = LayerStats(hits=(valid & ~miss).sum().astype(jnp.int32), misses=miss.sum().astype(jnp.int32),
                       overflow=overflow.sum().astype(jnp.int32), fetched=fetched.astype(jnp.int32))
    # the clock ticks once per sieve call (every layer of every step), so recency orders the accesses as they
    # happened: one tick per 64-step chunk made a chunk's accesses tie and cost 12 points of hit rate at a 1/8
    # pool on a model trace (docs/benchmarks/eviction_model_clock.json vs eviction_model.json)
    state = dataclasses.replace(with_pool(state, pool_pages(state).of([a[None] for a in pool])),
                                pb=jax.tree.map(lambda a: a[None], pb), vtlb=jax.tree.map(lambda a: a[None], table),
                                clock=state.clock + 1)
    return state, plan, stats


def tail_sources(config, t_frame, t_ok):
    """Where the attention kernel reads the tail pages: t_frame [..., T] their ring slots (`tail_frame`), t_ok
    [..., T] bool -> (frame, src, host_page) [..., T] int32. With the ring in the pool: pool frames, source 1. A
    scaled codec's ring (model dtype, its own array: cache/codec.py) is the kernel's second page source, read by
    index like a host page (source 2, unscaled)."""
    if config.codec.ring_in_pool:
        return t_frame, jnp.where(t_ok, 1, 0), jnp.full(t_frame.shape, -1)
    return jnp.zeros_like(t_frame), jnp.where(t_ok, 2, 0), jnp.where(t_ok, t_frame, -1)


def _attention(state: CacheState, q, frame, start, seq_len, src, host_page, options: DecodeOptions, **host_kw):
    """The attention kernel over the pool, in its page format: a scaled codec's pages with their scales (the
    kernel dequantises in registers) and its ring as the second source (`tail_sources`); host_kw: the fused
    fetch's host operands (an unscaled pool only: kernel_choice.resolve refuses the fused fetch with scales)."""
    kw = {}
    if state.pool_ks is not None:
        kw = dict(k_scale=state.pool_ks[0], v_scale=state.pool_vs[0])
    if state.ring_k is not None:
        kw.update(host_k=state.ring_k[0], host_v=state.ring_v[0], page_host=host_page)
    return sparse_decode_attention(q, state.pool_k[0], state.pool_v[0], frame, start, seq_len, page_src=src,
                                   softcap=options.softcap, impl=options.attention, **kw, **host_kw)


def _token_attention(state: CacheState, q, plan: PagePlan, options: DecodeOptions):
    """The token kernel over a plan's token lists (per-token selection); the Triton kernel wherever the page
    attention runs a kernel (Mosaic's page walk has no token form), the reference where it runs the reference."""
    impl = "ref" if options.attention == "ref" else "pallas"
    return token_decode_attention(q, state.pool_k[0], state.pool_v[0], plan.tok_frame, plan.tok_row, plan.tok_pos,
                                  plan.seq_len, softcap=options.softcap, impl=impl)


def attend_pages(state: CacheState, host: HostPool, q, plan: PagePlan, *,
                 options: DecodeOptions = DecodeOptions()):
    """The attention kernel over a PagePlan. q [S, 1, Hr, D] -> (state, out [S, 1, Hr, D]); with fused fetch the
    kernel also reads the misses from the host pool and stores them into their frames (the state's pool changes);
    otherwise every page is in HBM (misses fetched, overflow staged by `plan_layer`) and the host pool is not an
    operand."""
    options = resolved_options(options, state.config, q)
    if plan.tok_frame is not None:
        return state, _token_attention(state, q, plan, options)
    if not options.fused_fetch:
        return state, _attention(state, q, plan.frame, plan.start, plan.seq_len, plan.src, plan.host_page, options)
    res = _attention(state, q, plan.frame, plan.start, plan.seq_len, plan.src, plan.host_page, options,
                     host_k=host.k[0], host_v=host.v[0], page_host=plan.host_page, store_misses=True)
    attn, pool_k, pool_v = res
    return dataclasses.replace(state, pool_k=pool_k[None], pool_v=pool_v[None]), attn


def attend_layer(state: CacheState, host: HostPool, layer: int, q, k_new, v_new, pos, live, *,
                 options: DecodeOptions = DecodeOptions(), rank=0, budget=None):
    """Decode attention of one layer for every slot, one token per sequence: `plan_layer` then `attend_pages`.

    q [S, 1, Hr, D] (this rank's query heads), k_new/v_new [S, KVr, D], pos [S] int32 position of the new token
    (= committed length), live [S] bool, budget [S] int32 pages each sequence selects (None: the config's
    select_pages). Returns (state, out [S, 1, Hr, D], LayerStats)."""
    state, plan, stats = plan_layer(state, host, layer, q, k_new, v_new, pos, live, options=options, rank=rank,
                                    budget=budget)
    state, attn = attend_pages(state, host, q, plan, options=options)
    return state, attn, stats


def flush_tail(state: CacheState, host: HostPool, *, impl: str = "auto", only=None) -> tuple[CacheState, HostPool]:
    """Write every completed, unflushed tail page to the host pool (once per page) and advance `flushed`, for
    every active sequence, or those where only [S] bool is set (the others keep their completed pages in the
    tail ring until their own flush point: where a sequence flushes decides which pages it selects among)."""
    c = state.config
    S, L, G, P = c.max_seqs, c.num_layers, c.groups_per_rank, c.page_size
    length, flushed = state.seqs.length, state.seqs.flushed
    active = state.seqs.active if only is None else state.seqs.active & only                  # [S]
    p = flushed[:, None] + jnp.arange(TAIL_PAGES)[None, :]                            # [S, T]
    done = active[:, None] & ((p + 1) * P <= length[:, None])                        # [S, T]
    s = jnp.arange(S)[:, None, None, None]
    l = jnp.arange(L)[None, :, None, None]
    g = jnp.arange(G)[None, None, :, None]
    pp = p[:, None, None, :]                                                          # [S, 1, 1, T]
    src = tail_frame(c, s, l, g, pp)                                                  # [S, L, G, T]
    dst = state.vtlb.host_page[0, s, l, g, jnp.minimum(pp, c.max_pages_per_seq - 1)]
    dst = jnp.where(done[:, None, None, :], dst, -1).reshape(-1)
    src = jnp.broadcast_to(src, (S, L, G, TAIL_PAGES)).reshape(-1).astype(jnp.int32)
    ring_k, ring_v = ring_arrays(state)
    if c.codec.ring_in_pool:     # the ring's pages are stored pages already: copied as they are
        out = page_copy.flush(host.arrays(), [ring_k[0], ring_v[0]], src, dst.astype(jnp.int32), rank=0,
                              impl=impl)   # K and V in one launch
    else:                        # encoded here, once per page, now that all its tokens are known (cache/codec.py)
        enc = c.codec.encode(ring_k[0, src], ring_v[0, src], c.dtype)                 # [S*L*G*T, page, g, D]
        out = page_copy.flush(host.arrays(), enc.arrays(), jnp.arange(src.shape[0], dtype=jnp.int32),
                              dst.astype(jnp.int32), rank=0, impl=impl)   # codes and scales in one launch
    seqs = dataclasses.replace(state.seqs, flushed=jnp.where(active, length // P, flushed))
    # the selection rules see the completed pages (read from their ring frames, unquantised; unused reads are
    # compiled away)
    pages = jnp.where(done[:, None, None, :], pp, c.max_pages_per_seq)                # [S, 1, 1, T]; P: dropped
    kp = ring_k[0, tail_frame(c, s, l, g, pp)]                                        # [S, L, G, T, page, g, D]
    for rule in kept_rules(c):
        state = rule.flush(state, kp, pages)
    return dataclasses.replace(state, seqs=seqs), HostPool.of(out)


# ---- speculative verification (speculative.py; DESIGN.md section 7) --------------------------------------------
def append_leases(state: CacheState, layer: int, k_new, v_new, pos, nrows, *, impl: str = "ref") -> CacheState:
    """Speculative rows into the tail ring as leases: row j < nrows[s] of k_new, v_new [S, Q, KVr, D] goes to
    position pos[s] + j. K/V only: the key summaries change at commit (`commit_summaries`), so a rejected row
    leaves nothing but ring bytes past the committed length, which no later step reads (a row sees positions up
    to its own, and every position is written again before a row at or past it reads it). impl: as
    `append_token`'s."""
    c = state.config
    S, G, g, P = c.max_seqs, c.groups_per_rank, c.kv_heads_per_group, c.page_size
    Q = k_new.shape[1]
    ring_k, ring_v = ring_arrays(state)
    dt = ring_k.dtype
    kg = k_new.astype(dt).reshape(S, Q, G, g, c.head_dim)
    vg = v_new.astype(dt).reshape(S, Q, G, g, c.head_dim)
    p = pos[:, None] + jnp.arange(Q)[None, :]                                         # [S, Q]
    ok = jnp.arange(Q)[None, :] < nrows[:, None]                                      # [S, Q]
    frame = tail_frame(c, jnp.arange(S)[:, None, None], layer, jnp.arange(G)[None, None, :], (p // P)[..., None])
    frame = jnp.where(ok[..., None], frame, -1)                                       # [S, Q, G], -1 = skipped
    ring_k, ring_v = tail_append(ring_k, ring_v, kg, vg, frame, p % P, impl=impl)
    return with_ring(state, ring_k, ring_v)


def verify_layer(state: CacheState, host: HostPool, layer: int, q, k_new, v_new, pos, nrows, live, *,
                 options: DecodeOptions = DecodeOptions(), rank=0, batched: bool = True):
    """Decode attention of one layer for Q rows per sequence (speculative verification): row j of sequence s sits
    at position pos[s] + j; rows j >= nrows[s] are off. Each row computes what a plain decode step at its position
    computes: its own Quest selection among the flushed pages, the tail ring up to its own position.
    batched (the default; not with fused fetch): the S * Q rows are one virtual decode batch: one top-k, one sieve
    access (a page several rows selected is one LID: one frame, one fetch), one attention launch (`verify_batched`).
    Otherwise the rows run one after another, each a `plan_layer` + `attend_pages` (its own sieve access).
    q [S, Q, Hr, D], k_new/v_new [S, Q, KVr, D], pos/nrows [S] int32, live [S] bool -> (state, out [S, Q, Hr, D],
    LayerStats summed over rows)."""
    state = append_leases(state, layer, k_new, v_new, pos, jnp.where(live, nrows, 0), impl=options.copy)
    if batched and not options.fused_fetch:
        return verify_batched(state, host, layer, q, pos, nrows, live, options=options, rank=rank)
    outs, stats = [], LayerStats.zeros()
    for j in range(q.shape[1]):
        row_live = live & (j < nrows)
        state, plan, st = plan_layer(state, host, layer, q[:, j:j + 1], None, None, pos + j, row_live,
                                     options=options, rank=rank, append=False)
        state, o = attend_pages(state, host, q[:, j:j + 1], plan, options=options)
        outs.append(o)
        stats = stats + st
    return state, jnp.concatenate(outs, axis=1), stats


def verify_batched(state: CacheState, host: HostPool, layer: int, q, pos, nrows, live, *,
                   options: DecodeOptions = DecodeOptions(), rank=0):
    """`verify_layer`'s rows as one virtual decode batch of V = S * Q rows (row s * Q + j), their K/V already in
    the tail ring. Scores per row (the summaries read in place, one call per row), one top-k over V rows, one sieve
    access for every row's pages (duplicate LIDs share a frame: DESIGN.md section 5), misses fetched once, overflow
    pages staged once each in the overflow frames (sized for `verify_rows` rows per sequence, so every row's pages
    fit), one attention launch. Straight-line on purpose: a lax.cond between this and a row-by-row fallback made
    XLA copy both HBM pools around the conditional in every layer (scripts/probes/verify_cost.py)."""
    c = state.config
    S, G, P = c.max_seqs, c.groups_per_rank, c.page_size
    Q = q.shape[1]
    if Q > c.verify_rows:
        raise ValueError(f"verifying Q = {Q} rows per sequence needs cache_config.verify_rows >= {Q} (it is "
                         f"{c.verify_rows}): the overflow frames are sized for verify_rows rows")
    Hr, D = q.shape[2], q.shape[3]
    options = resolved_options(options, c, q[:, :1])                                  # each row is a Q = 1 decode
    V = S * Q
    vseq = jnp.repeat(jnp.arange(S), Q)                                               # [V]
    vj = jnp.tile(jnp.arange(Q), S)
    vpos = jnp.repeat(pos, Q) + vj
    vlive = jnp.repeat(live, Q) & (vj < jnp.repeat(nrows, Q))
    seq_len = jnp.where(vlive, vpos + 1, 0)
    flushed = jnp.where(vlive, state.seqs.flushed[vseq], 0)

    # 1. Selection: row j's scores as a plain step's (its own query), one top-k for all rows.
    sflushed = jnp.where(live, state.seqs.flushed, 0)
    sc = [_scores(state, layer, q[:, j:j + 1], sflushed, options) for j in range(Q)]  # Q x [S, G, Pm]
    scores = jnp.stack(sc, axis=1).reshape((V,) + sc[0].shape[1:])                   # [V, G, Pm]
    sel = selection.select_pages(scores, flushed, select_pages=c.shortlist_pages, sink_pages=c.sink_pages,
                                 recent_pages=c.recent_pages, impl=options.topk)      # [V, G, K]
    # 2. One sieve access; the vTLB follows.
    pb, table, valid, page, frame, host_idx, miss, filled, overflow, lead = _sieve_pages(
        state, layer, sel, vlive, vseq, rank, options)                                # [V, G, K] each
    K = sel.shape[-1]

    # 3. Overflow pages staged once each: a duplicate (same sequence, group and page in another row) takes the
    #    stage of its first occurrence. Each (sequence, group, row, slot) owns an overflow frame (overflow_frames
    #    is sized for verify_rows rows), so the stage is the first occurrence's own slot: no compaction.
    def by_seq(x):                                                                    # [V, G, K] -> [S, G, Q*K]
        return x.reshape(S, Q, G, K).transpose(0, 2, 1, 3).reshape(S, G, Q * K)

    def by_row(x):                                                                    # [S, G, Q*K] -> [V, G, K]
        return x.reshape(S, G, Q, K).transpose(0, 2, 1, 3).reshape(V, G, K)

    opg = by_seq(jnp.where(overflow, page, -1))
    same = (opg[..., :, None] == opg[..., None, :]) & (opg[..., :, None] >= 0)        # [S, G, QK, QK]
    first = jnp.argmax(same, axis=-1)                                                 # first equal entry
    is_first = (first == jnp.arange(Q * K)) & (opg >= 0)
    row_base = (jnp.arange(S)[:, None, None] * G + jnp.arange(G)[None, :, None]) * (Q * K)    # [S, G, 1]
    stage = by_row(row_base + first)                                                   # < S*G*Q*K <= overflow_frames

    # 4. Tail pages of each row, up to its own position.
    tp = flushed[:, None] + jnp.arange(TAIL_PAGES)[None, :]                           # [V, T]
    t_ok = vlive[:, None] & (tp * P < seq_len[:, None])
    t_frame = tail_frame(c, vseq[:, None, None], layer, jnp.arange(G)[None, :, None], tp[:, None, :])
    t_frame = jnp.broadcast_to(t_frame, (V, G, TAIL_PAGES))
    t_ok = jnp.broadcast_to(t_ok[:, None, :], (V, G, TAIL_PAGES))
    t_frame, t_src, t_host = tail_sources(c, t_frame, t_ok)
    start = jnp.concatenate([jnp.where(valid, page * P, -1),
                             jnp.where(t_ok, jnp.broadcast_to(tp[:, None, :], (V, G, TAIL_PAGES)) * P, -1)],
                            axis=-1).astype(jnp.int32)
    src = jnp.concatenate([jnp.where(valid, 1, 0), t_src], axis=-1).astype(jnp.int32)
    hpage = jnp.concatenate([jnp.full((V, G, K), -1), t_host], axis=-1).astype(jnp.int32)
    qv = q.reshape(V, 1, Hr, D)

    fr = jnp.where(overflow, overflow_frame(c, stage), frame)                         # [V, G, K]
    once = lead | (overflow & by_row(is_first))                                        # one fetch per frame
    pool = page_copy.fetch([a[0] for a in pool_pages(state).arrays()], [a[0] for a in host.arrays()],
                           host_idx.reshape(-1), jnp.where(once, fr, -1).reshape(-1).astype(jnp.int32),
                           impl=options.copy)   # K and V (and their scales) in one launch
    state = with_pool(state, pool_pages(state).of([a[None] for a in pool]))
    if c.token_shortlist:       # each row's budget of tokens among its pages, scored with its own query
        rows = [c.selection_rule.score_tokens(state, layer, q[:, j:j + 1], by_seq(page).reshape(S, G, Q, K)[:, :, j],
                                              by_seq(valid).reshape(S, G, Q, K)[:, :, j], options)
                for j in range(Q)]                                                    # Q x [S, G, K, page]
        sc = jnp.stack(rows, axis=1).reshape((V, G, K, P))
        plan = with_tokens(PagePlan(None, None, None, None, seq_len.astype(jnp.int32)),
                           token_list(c, sc, page, valid, fr, flushed, None, options.topk),
                           tail_tokens(P, t_frame, t_ok, tp, seq_len))
        o = _token_attention(state, qv, plan, options)                               # [V, 1, Hr, D]
    else:
        fr = jnp.concatenate([jnp.where(valid, fr, 0), t_frame], axis=-1).astype(jnp.int32)
        o = _attention(state, qv, fr, start, seq_len.astype(jnp.int32), src, hpage, options)   # [V, 1, Hr, D]
    stats = LayerStats(hits=(valid & ~miss).sum().astype(jnp.int32), misses=miss.sum().astype(jnp.int32),
                       overflow=overflow.sum().astype(jnp.int32), fetched=once.sum().astype(jnp.int32))
    state = dataclasses.replace(state, pb=jax.tree.map(lambda a: a[None], pb),
                                vtlb=jax.tree.map(lambda a: a[None], table), clock=state.clock + 1)
    return state, o.reshape(S, Q, Hr, D), stats


def commit_summaries(state: CacheState, length) -> CacheState:
    """The tail pages' selection state recomputed from their committed tokens (length [S]: the new committed
    length), by every kept rule's `commit` (Quest: the key summaries, min/max over each unflushed page's committed
    tokens, which equals `append_token`'s token-by-token updates whatever rejected leases the ring holds)."""
    c = state.config
    S, L, G = c.max_seqs, c.num_layers, c.groups_per_rank
    tp = state.seqs.flushed[:, None] + jnp.arange(TAIL_PAGES)[None, :]                # [S, T]
    s = jnp.arange(S)[:, None, None, None]
    l = jnp.arange(L)[None, :, None, None]
    g = jnp.arange(G)[None, None, :, None]
    kp = ring_arrays(state)[0][0, tail_frame(c, s, l, g, tp[:, None, None, :])]      # [S, L, G, T, page, g, D]
    for rule in kept_rules(c):
        state = rule.commit(state, kp, length)
    return state


def commit_rows(state: CacheState, host: HostPool, length, flush, *, impl: str = "auto"):
    """Commit a verification: length [S] the new committed lengths (accepted rows), flush [S] bool the sequences
    that reached a flush point (their chunk boundary: where plain decode flushes). The tail summaries are
    recomputed from committed tokens, then the flushing sequences' complete pages go to the host pool; a rejected
    row writes nothing here (no vTLB, frame, PB-LRU or host write). -> (state, host)."""
    state = dataclasses.replace(state, seqs=dataclasses.replace(state.seqs, length=length))
    state = commit_summaries(state, length)
    active = state.seqs.active
    state = dataclasses.replace(state, seqs=dataclasses.replace(state.seqs, active=active & flush))
    state, host = flush_tail(state, host, impl=impl)
    return dataclasses.replace(state, seqs=dataclasses.replace(state.seqs, active=active)), host
