"""Query-aware page selection (Quest bound), per sequence and KV-head group.

Score of page p for group j: sum over the group's query heads h and dims d of max(q_hd * kmin_pd, q_hd * kmax_pd).
Since kmax >= kmin, max(q*kmin, q*kmax) = relu(q)*kmax + min(q, 0)*kmin, so summing over heads first gives
    score[p] = kmax[p] . sum_h relu(q_h) + kmin[p] . sum_h min(q_h, 0)
exactly: two mat-vecs over the summaries, a memory-bound read of 2/page_size of the K bytes. With
CacheConfig.summary_split = split > 1 each page holds `split` sub-page summaries (min/max over page_size // split
tokens each) and score[p] is the max of its sub-pages' bounds (2 * split / page_size of the K bytes read); selection
and transfer stay per page. The first
`sink_pages` and last `recent_pages` flushed pages always win; only flushed pages are candidates (unflushed tail
pages are always attended from the tail ring).

The summaries kmin, kmax [R, S, L, G, P * split, g, D] are top-level CacheState fields kept for EVERY rule (not in
`CacheState.sel`): the tail-append kernel (pallas_kernels/tail_append.py) updates them in the same launch as the
ring write of a decode step (two scatters a layer fewer), and they are the first stage of a two-stage selection
(two_stage.py). Every other write of them is a hook of the `Quest` rule below (ingest, prefix attach, speculative
commit, release), which the cache runs whatever rule scores (registry.kept_rules).
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from ulacache_jax.cache.select.rule import SelectionRule
from ulacache_jax.pallas_kernels import page_scores, page_topk
from ulacache_jax.pallas_kernels.page_scores import fold_queries


def ref_page_scores(q, kmin, kmax, split: int = 1):
    """q [B, Q, H, D]; kmin, kmax [B, G, P * split, g, D] (one layer's summaries) -> scores [B, G, P] fp32 (Quest
    bound; split > 1: the max over each page's sub-pages); the same math as the kernel's reference, which reads the
    summaries of every layer in place."""
    B, G, PS, g, D = kmin.shape
    qpos, qneg = fold_queries(q, G, g)
    return page_scores.ref_page_scores(kmin[:, None], kmax[:, None], qpos, qneg, layer=0, split=split)


def select_pages(scores, flushed, *, select_pages: int, sink_pages: int, recent_pages: int, impl: str = "ref"):
    """scores [B, G, P]; flushed [B] int32 candidate pages per sequence -> page ids [B, G, K] int32 (K =
    min(select_pages, P)), -1 for unused; every flushed page when flushed <= K. Order: by page id (ids first, then
    the -1s). impl: 'ref' (lax.top_k) or 'pallas' / 'auto' (pallas_kernels/page_topk.py, one kernel for the
    masking and the top-k: the same result)."""
    return page_topk.select_top_pages(scores, flushed, min(select_pages, scores.shape[-1]), sink=sink_pages,
                                      recent=recent_pages, impl=impl)


def limit_pages(sel, scores, flushed, budget, *, sink_pages: int, recent_pages: int):
    """Per-sequence budgets under the config's: sel [B, G, K] `select_pages`' winners (page ids in page order, -1
    unused), scores [B, G, P] the scores they were chosen by, flushed [B] int32, budget [B] int32 pages this
    sequence may attend (<= K, >= sink + recent) -> sel with every winner past the sequence's budget rank set to -1.
    A winner's rank orders the winners as the top-k does (page_topk.candidate_scores: sink and recent pages first,
    ties to the lower page id), so the pages kept are exactly what `select_pages` with K = budget picks: a budget
    that covers every flushed page keeps them all. One compiled program serves mixed budgets."""
    B, G, K = sel.shape
    valid = sel >= 0
    page = jnp.maximum(sel, 0)
    x = jnp.take_along_axis(scores.astype(jnp.float32), page, axis=-1)                 # [B, G, K]
    x = page_topk.candidate_scores(x, page, flushed[:, None, None], scores.shape[-1], sink=sink_pages,
                                   recent=recent_pages)
    x = jnp.where(valid, x, -jnp.inf)
    # winners are in page order, so a stable sort by descending score breaks ties to the lower page id
    order = jnp.argsort(-x, axis=-1, stable=True)                                      # [B, G, K]
    rank = jnp.argsort(order, axis=-1)                                                 # inverse permutation
    return jnp.where(valid & (rank < budget[:, None, None]), sel, -1)


def init_summaries(config, ranks: int):
    """(kmin, kmax) of a fresh cache: zeros [R, S, L, G, P * split, g, D] in the cache's dtype."""
    c = config
    shape = (ranks, c.max_seqs, c.num_layers, c.groups_per_rank, c.summary_pages, c.kv_heads_per_group, c.head_dim)
    return jnp.zeros(shape, c.jnp_dtype), jnp.zeros(shape, c.jnp_dtype)


def append_operands(config, pos, live):
    """What the tail-append kernel needs to update the summaries of a decode step: pos [S] int32 token positions,
    live [S] bool -> (sub [S] the sub-page, -1 = skipped; first [S] bool: the token starts its sub-page, so the
    summary resets to it)."""
    sp, soff = pos // config.summary_size, pos % config.summary_size                  # split 1: page, offset
    return jnp.where(live, sp, -1), soff == 0


@dataclasses.dataclass(frozen=True)
class Quest(SelectionRule):
    """Quest's bound over the per-(sub-)page min/max key summaries (module docstring). split: summaries per page
    (CacheConfig.summary_split; the layout the hooks write is the state's config's, `check` makes them agree)."""
    split: int = 1
    name: ClassVar[str] = "quest"

    @classmethod
    def from_config(cls, config) -> "Quest":
        return cls(split=config.summary_split)

    def check(self, config):
        if self.split != config.summary_split:
            raise ValueError(f"Quest(split = {self.split}) needs CacheConfig.summary_split = {self.split} (it is "
                             f"{config.summary_split})")

    def ingest(self, state, slot, layer0, page0, kp, live, first):
        """The summaries of a prefill block: min/max over each sub-page's live tokens; a sub-page without live
        tokens gets (big, -big), whose bound is about -big: it never wins its page's max. Pages with no live token
        keep their old summaries."""
        c = state.config
        R, L, G, n, page, g, D = kp.shape
        dt = kp.dtype
        big = jnp.asarray(jnp.finfo(dt).max, dt)
        split, ns = c.summary_split, n * c.summary_split                              # ns sub-pages (split 1: n)
        lv = live[None, None, None, :, :, None, None]
        subs = lambda x: x.reshape(R, L, G, ns, c.summary_size, g, D)
        kmin = subs(jnp.where(lv, kp, big)).min(axis=4)                               # [R, L, G, ns, g, D]
        kmax = subs(jnp.where(lv, kp, -big)).max(axis=4)
        has_tok = live[:, 0]                                                          # [n] a page's first token
        # summaries of pages [page0, page0 + n) of layers [layer0, layer0 + L): one dynamic slice in, one update out
        zero = jnp.zeros((), jnp.int32)
        at = (zero, jnp.asarray(slot, jnp.int32), jnp.asarray(layer0, jnp.int32), zero,
              jnp.asarray(page0 * split, jnp.int32), zero, zero)
        size = (R, 1, L, G, ns, g, D)
        old_min = jax.lax.dynamic_slice(state.kmin, at, size)[:, 0]                   # [R, L, G, ns, g, D]
        old_max = jax.lax.dynamic_slice(state.kmax, at, size)[:, 0]
        sel = jnp.repeat(has_tok, split)[None, None, None, :, None, None]
        return dataclasses.replace(
            state, kmin=jax.lax.dynamic_update_slice(state.kmin, jnp.where(sel, kmin, old_min)[:, None], at),
            kmax=jax.lax.dynamic_update_slice(state.kmax, jnp.where(sel, kmax, old_max)[:, None], at))

    def attach(self, state, slot, layer, kp, live):
        """The summaries of an attached prefix's whole pages, as ingestion computes them (every token live)."""
        c = state.config
        R, G, n, P, g, D = kp.shape
        split, ns = c.summary_split, n * c.summary_split
        sel = jnp.repeat(live, split)[None, None, :, None, None]
        zero = jnp.zeros((), jnp.int32)
        at = (zero, jnp.asarray(slot, jnp.int32), jnp.asarray(layer, jnp.int32), zero, zero, zero, zero)
        size = (R, 1, 1, G, ns, g, D)
        old_min = jax.lax.dynamic_slice(state.kmin, at, size)[:, 0, 0]                # [R, G, ns, g, D]
        old_max = jax.lax.dynamic_slice(state.kmax, at, size)[:, 0, 0]
        ks = kp.reshape(R, G, ns, c.summary_size, g, D)
        kmin = jnp.where(sel, ks.min(axis=3), old_min)[:, None, None]
        kmax = jnp.where(sel, ks.max(axis=3), old_max)[:, None, None]
        return dataclasses.replace(state, kmin=jax.lax.dynamic_update_slice(state.kmin, kmin, at),
                                   kmax=jax.lax.dynamic_update_slice(state.kmax, kmax, at))

    def commit(self, state, tail_k, length):
        """The tail pages' summaries from their committed tokens: min/max over the ring's first min(P, length -
        page start) tokens of each unflushed page holding committed tokens; other pages untouched. Min and max are
        exact, so this equals the token-by-token appends of the same tokens, whatever rejected leases the ring
        holds past the length. With summary_split > 1 the same per sub-page: a sub-page without committed tokens
        is untouched, as the append leaves it."""
        c = state.config
        S, L, G, T = tail_k.shape[:4]
        split, sub, TS = c.summary_split, c.summary_size, T * c.summary_split       # split 1: sub = page_size
        tp = state.seqs.flushed[:, None] + jnp.arange(T)[None, :]                      # [S, T]
        tsp = (tp[:, :, None] * split + jnp.arange(split)).reshape(S, TS)             # [S, T*split] sub-pages
        n = jnp.clip(length[:, None] - tsp * sub, 0, sub)                              # [S, TS] committed tokens
        has = state.seqs.active[:, None] & (n > 0)
        s = jnp.arange(S)[:, None, None, None]
        l = jnp.arange(L)[None, :, None, None]
        g = jnp.arange(G)[None, None, :, None]
        kp = tail_k.reshape(S, L, G, TS, sub, c.kv_heads_per_group, c.head_dim)       # [S, L, G, TS, sub, g, D]
        ok = (jnp.arange(sub)[None, None, :] < n[:, :, None])[:, None, None, :, :, None, None]
        kmin = jnp.where(ok, kp, jnp.inf).min(axis=4).astype(kp.dtype)                # [S, L, G, TS, g, D]
        kmax = jnp.where(ok, kp, -jnp.inf).max(axis=4).astype(kp.dtype)
        page = jnp.broadcast_to(jnp.where(has[:, None, None, :], tsp[:, None, None, :], c.summary_pages),
                                (S, L, G, TS))
        return dataclasses.replace(state, kmin=state.kmin.at[0, s, l, g, page].set(kmin, mode="drop"),
                                   kmax=state.kmax.at[0, s, l, g, page].set(kmax, mode="drop"))

    def release(self, state, slot):
        return dataclasses.replace(state, kmin=state.kmin.at[:, slot].set(0), kmax=state.kmax.at[:, slot].set(0))

    def score(self, state, layer, q, flushed, options):
        """Quest's bound of every page (pallas_kernels/page_scores.py; options.scores picks the kernel)."""
        return page_scores.page_scores(state.kmin[0], state.kmax[0], q, layer=layer, impl=options.scores,
                                       launch=options.score_launch, split=state.config.summary_split)

    def score_pages(self, state, layer, q, flushed, pages, ok, options):
        """The listed pages' bounds from their summaries alone, gathered by page id."""
        c = state.config
        S, G, K = pages.shape
        sub = (pages[..., None] * c.summary_split + jnp.arange(c.summary_split)).reshape(S, G, -1)   # [S, G, K*split]
        s = jnp.arange(S)[:, None, None]
        g = jnp.arange(G)[None, :, None]
        kmin = state.kmin[0, s, layer, g, sub][:, None]                               # [S, 1, G, K*split, g, D]
        kmax = state.kmax[0, s, layer, g, sub][:, None]
        return page_scores.ref_page_scores(kmin, kmax, *fold_queries(q, G, c.kv_heads_per_group), layer=0,
                                           split=c.summary_split)

    def step_bytes(self, *, context, num_layers, kv_heads, head_dim, itemsize, page_size):
        """Both summaries of every (sub-)page: 2 * split / page_size of the K bytes."""
        return math.ceil(context / page_size) * self.split * 2 * num_layers * kv_heads * head_dim * itemsize
