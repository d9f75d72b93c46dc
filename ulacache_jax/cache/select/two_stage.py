"""Two-stage page selection: a coarse bound shortlists pages, a finer rule ranks only the shortlist.

Why: at long context the scorer, not the selected pages, is the sparse step's byte cost. Quest's page-64 min/max
summaries are 2 * D * 2 / 64 bytes a token and KV head, read whole every step (0.54 GB a step at 256K on the 8B
shape, twice the selected K/V); a key copy or labels read C * bits / 8 a token. A two-stage rule reads

1. **the first stage, whole**: Quest's bound over page-group summaries, min / max over `group_pages` consecutive
   pages (1 / group_pages of Quest's summary bytes; group_pages 1: Quest's own page summaries), and keeps the
   `keep_pages` // group_pages groups of highest bound (a multiple of the budget: the shortlist);
2. **the second stage, on the shortlist only**: `second.score_pages` scores the shortlisted pages, gathering their
   summaries / labels by page id (the rest score -inf, so they are chosen only after every shortlisted page, which
   `keep_pages >= select_pages` rules out). Labels' page mass is normalised over the shortlist (the pages outside it
   have the lowest bound, so their mass is the smallest part of the softmax).

Bytes a step (one sequence, all layers) = group summaries of the context + the second stage's bytes over
keep_pages pages: with group_pages 8 and a 4x budget shortlist reranked by 16-channel 4-bit labels, 0.13 GB at 256K
on the 8B shape, a quarter of Quest's 0.54 GB (`step_bytes`, the cost model's term).

The group summaries `gmin`, `gmax` [R, S, L, G, NG, g, D] (NG = ceil(P / group_pages)) live in `CacheState.sel`
beside the second stage's own state. A free slot's groups are neutral (min = the dtype's largest value, max = its
lowest: `init`, `release`), and every write only min / max-es pages into their groups, where pages get their keys:
a prefill block (`ingest`), an attached prefix (`attach`: a shared prefix, or the earlier chunks of a chunked
prefill, whose hooks run in either order with the chunk's own ingest) and a decode flush (`flush`). Min and max
are commutative and a page's tokens never change once written, so the order of those writes does not matter and a
page written twice (attached again, or a prefill's partial last page flushed whole later) is harmless. Pages
without a live token leave their group as it was. The speculative commit needs nothing: groups only cover pages
whose tokens are final (flushed), or a prefill's partial last page, which is not a candidate until its flush.
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp

from ulacache_jax.cache.select import registry
from ulacache_jax.cache.select.quest import Quest
from ulacache_jax.cache.select.rule import SelectionRule
from ulacache_jax.pallas_kernels import page_scores


@partial(jax.tree_util.register_dataclass, data_fields=["second", "gmin", "gmax"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TwoStageState:
    """A two-stage rule's leaves in CacheState.sel (all ranks: a leading R axis)."""
    second: object               # the second stage's own state (None for Quest / a stateless rule)
    gmin: jax.Array | None       # [R, S, L, G, NG, g, D] group summaries (None: group_pages 1, Quest's own)
    gmax: jax.Array | None


def shortlist(first, flushed, *, group_pages: int, keep_groups: int):
    """first [S, G, NG] float32 group bounds; flushed [S] int32 flushed pages -> (pages [S, G, K] int32 page ids of
    the `keep_groups` groups of highest bound, K = keep_groups * group_pages; ok [S, G, K] bool: the page is
    flushed). A group is a candidate when its first page is flushed."""
    S, G, NG = first.shape
    live = jnp.arange(NG)[None, None, :] * group_pages < flushed[:, None, None]                 # [S, 1, NG]
    _, top = jax.lax.top_k(jnp.where(live, first, -jnp.inf), min(keep_groups, NG))              # [S, G, kg]
    pages = (top[..., None] * group_pages + jnp.arange(group_pages)).reshape(S, G, -1)         # [S, G, K]
    ok = (pages < flushed[:, None, None]) & jnp.take_along_axis(jnp.broadcast_to(live, (S, G, NG)), top, -1
                                                                 ).repeat(group_pages, -1)
    return pages.astype(jnp.int32), ok


def spread(scores, pages, ok, num_pages: int):
    """scores [S, G, K] of the shortlisted pages [S, G, K] -> [S, G, P] float32: -inf off the shortlist."""
    S, G, K = pages.shape
    full = jnp.full((S, G, num_pages), -jnp.inf, jnp.float32)
    idx = jnp.where(ok, pages, num_pages)                                                     # not ok: dropped
    return full.at[jnp.arange(S)[:, None, None], jnp.arange(G)[None, :, None], idx].set(
        scores.astype(jnp.float32), mode="drop")


def group_summaries(kp, live, group_pages: int):
    """kp [..., n, page, g, D] keys of n consecutive pages; live [n, page] bool -> per-page (min, max) [..., n, g, D]
    over the live tokens: (big, -big) on a page without one, which min / max leave as they were."""
    big = jnp.asarray(jnp.finfo(kp.dtype).max, kp.dtype)
    lv = live[..., None, None]                                                                 # [n, page, 1, 1]
    return jnp.where(lv, kp, big).min(axis=-3), jnp.where(lv, kp, -big).max(axis=-3)


@dataclasses.dataclass(frozen=True)
class TwoStage(SelectionRule):
    """`group_pages`-page group bounds shortlist `keep_pages` pages (rounded up to whole groups) per (sequence,
    group of KV heads), `second` ranks them (module docstring). keep_pages >= every page a sequence has: `second`
    alone (the shortlist holds every page)."""
    second: SelectionRule
    keep_pages: int
    group_pages: int = 1
    name: ClassVar[str] = "two_stage"

    @property
    def keep_groups(self) -> int:
        return -(-self.keep_pages // self.group_pages)

    def check(self, config):
        for name in ("keep_pages", "group_pages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TwoStage: {name} = {v!r} must be an int >= 1")
        if self.keep_pages < config.select_pages:
            raise ValueError(f"TwoStage: keep_pages = {self.keep_pages} must be >= token_budget // page_size = "
                             f"{config.select_pages} (the shortlist holds the pages attended)")
        if isinstance(self.second, TwoStage):
            raise ValueError("TwoStage: the second stage cannot be another TwoStage")
        self.second.check(config)

    # ---- the second stage's state rides inside ours -------------------------------------------------------------
    def _delegates(self) -> bool:
        """Quest's hooks already run for every cache (registry.kept_rules): a Quest second stage has none here."""
        return not isinstance(self.second, Quest)

    def _inner(self, state):
        return dataclasses.replace(state, sel=state.sel.second)

    def _outer(self, inner, sel: TwoStageState, **groups):
        return dataclasses.replace(inner, sel=dataclasses.replace(sel, second=inner.sel, **groups))

    def _call(self, hook: str, state, *args):
        if not self._delegates():
            return state
        return self._outer(getattr(self.second, hook)(self._inner(state), *args), state.sel)

    def num_groups(self, config) -> int:
        return -(-config.max_pages_per_seq // self.group_pages)

    def init(self, config, ranks):
        c = config
        second = self.second.init(c, ranks) if self._delegates() else None
        if self.group_pages == 1:
            return TwoStageState(second, None, None)
        shape = (ranks, c.max_seqs, c.num_layers, c.groups_per_rank, self.num_groups(c), c.kv_heads_per_group,
                 c.head_dim)
        big = jnp.finfo(c.jnp_dtype).max
        return TwoStageState(second, jnp.full(shape, big, c.jnp_dtype), jnp.full(shape, -big, c.jnp_dtype))

    def _merge(self, sel: TwoStageState, at, page, pmin, pmax, live_page):
        """Min / max pages into their groups. at: index arrays (rank, slot, layer, group of KV heads) broadcast
        against page [...] int32 page ids (out of range: dropped); pmin, pmax [..., g, D]; live_page [...] bool
        (a page with a live token)."""
        NG = sel.gmin.shape[4]
        grp = jnp.where(live_page, page // self.group_pages, NG)                                  # dead: dropped
        return dataclasses.replace(sel, gmin=sel.gmin.at[at + (grp,)].min(pmin, mode="drop"),
                                   gmax=sel.gmax.at[at + (grp,)].max(pmax, mode="drop"))

    # ---- hooks ---------------------------------------------------------------------------------------------------
    def ingest(self, state, slot, layer0, page0, kp, live, first):
        state = self._call("ingest", state, slot, layer0, page0, kp, live, first)
        if self.group_pages == 1:
            return state
        R, Lb, G, n = kp.shape[:4]
        pmin, pmax = group_summaries(kp, live, self.group_pages)                       # [R, Lb, G, n, g, D]
        at = (jnp.arange(R)[:, None, None, None], jnp.asarray(slot, jnp.int32),
              jnp.asarray(layer0, jnp.int32) + jnp.arange(Lb)[None, :, None, None], jnp.arange(G)[None, None, :, None])
        page = jnp.asarray(page0, jnp.int32) + jnp.arange(n)                            # [n]
        return dataclasses.replace(state, sel=self._merge(state.sel, at, page, pmin, pmax, live[:, 0]))

    def attach(self, state, slot, layer, kp, live):
        state = self._call("attach", state, slot, layer, kp, live)
        if self.group_pages == 1:
            return state
        R, G, n, P = kp.shape[:4]
        pmin, pmax = group_summaries(kp, jnp.broadcast_to(live[:, None], (n, P)), self.group_pages)  # [R, G, n, g, D]
        at = (jnp.arange(R)[:, None, None], jnp.asarray(slot, jnp.int32), jnp.asarray(layer, jnp.int32),
              jnp.arange(G)[None, :, None])
        return dataclasses.replace(state, sel=self._merge(state.sel, at, jnp.arange(n), pmin, pmax, live))

    def append(self, state, layer, k, pos, live):
        return self._call("append", state, layer, k, pos, live)

    def flush(self, state, kp, page):
        state = self._call("flush", state, kp, page)
        if self.group_pages == 1:
            return state
        S, L, G, T, P = kp.shape[:5]
        ones = jnp.ones((T, P), bool)
        pmin, pmax = group_summaries(kp, ones, self.group_pages)                        # [S, L, G, T, g, D]
        page = jnp.broadcast_to(page, (S, L, G, T))
        at = (0, jnp.arange(S)[:, None, None, None], jnp.arange(L)[None, :, None, None],
              jnp.arange(G)[None, None, :, None])
        ok = page < state.config.max_pages_per_seq
        return dataclasses.replace(state, sel=self._merge(state.sel, at, page, pmin, pmax, ok))

    def commit(self, state, tail_k, length):
        return self._call("commit", state, tail_k, length)

    def release(self, state, slot):
        """The slot's groups back to neutral (a new sequence's pages are min / max-ed into them)."""
        state = self._call("release", state, slot)
        if self.group_pages == 1:
            return state
        sel = state.sel
        big = jnp.asarray(jnp.finfo(sel.gmin.dtype).max, sel.gmin.dtype)
        return dataclasses.replace(state, sel=dataclasses.replace(sel, gmin=sel.gmin.at[:, slot].set(big),
                                                                  gmax=sel.gmax.at[:, slot].set(-big)))

    # ---- scoring -------------------------------------------------------------------------------------------------
    def first_stage(self, state, layer, q, options):
        """[S, G, NG] float32 group bounds (group_pages 1: Quest's page bounds, NG = P)."""
        if self.group_pages == 1:
            return Quest(state.config.summary_split).score(state, layer, q, None, options)
        sel = state.sel
        return page_scores.page_scores(sel.gmin[0], sel.gmax[0], q, layer=layer, impl=options.scores,
                                       launch=options.score_launch)

    def score(self, state, layer, q, flushed, options):
        c = state.config
        pages, ok = shortlist(self.first_stage(state, layer, q, options), flushed, group_pages=self.group_pages,
                              keep_groups=self.keep_groups)
        inner = self._inner(state) if self._delegates() else state
        sc = self.second.score_pages(inner, layer, q, flushed, pages, ok, options)                   # [S, G, K]
        return spread(jnp.where(ok, sc, -jnp.inf), pages, ok, c.max_pages_per_seq)

    def step_bytes(self, *, context, num_layers, kv_heads, head_dim, itemsize, page_size):
        """The group summaries of the whole context, and the second stage's bytes over the shortlist."""
        groups = math.ceil(math.ceil(context / page_size) / self.group_pages)
        first = (Quest().step_bytes(context=context, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim,
                                    itemsize=itemsize, page_size=page_size) if self.group_pages == 1 else
                 groups * 2 * num_layers * kv_heads * head_dim * itemsize)
        short = min(context, self.keep_groups * self.group_pages * page_size)
        return first + self.second.step_bytes(context=short, num_layers=num_layers, kv_heads=kv_heads,
                                              head_dim=head_dim, itemsize=itemsize, page_size=page_size)

    def prefix_sharing(self, config):
        return self.second.prefix_sharing(config)


def configure(config, group_pages: int, shortlist_mult: int):
    """`config` with its own rule (registry.resolve: Quest, the key copy or labels, from its fields) as the second
    stage of a TwoStage whose groups are `group_pages` pages and whose shortlist is `shortlist_mult` x the budget's
    pages. The rule object carries the channels / bits / table from here on, so the config's own fields are reset
    (they would describe a second rule beside it)."""
    rule = TwoStage(registry.resolve(config), keep_pages=shortlist_mult * config.select_pages,
                    group_pages=group_pages)
    return dataclasses.replace(config, key_channels=0, label_bits=0, channel_table=None, selection=rule)


def parse_spec(spec: str) -> tuple[int, int]:
    """'GROUP:MULT' (the CLI's and the benchmarks' --two-stage) -> (group pages, shortlist multiple of the budget),
    both ints >= 1; anything else raises ValueError naming the value."""
    parts = spec.split(":")
    try:
        group, mult = (int(x) for x in parts)
    except ValueError:
        group = mult = 0
    if len(parts) != 2 or group < 1 or mult < 1:
        raise ValueError(f"--two-stage {spec!r} must be GROUP:MULT, two ints >= 1 (e.g. 8:4: groups of 8 pages "
                         "shortlist 4x the budget)")
    return group, mult
