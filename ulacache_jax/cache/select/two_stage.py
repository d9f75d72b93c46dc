"""Two-stage page selection: a cheap first stage shortlists pages, a finer rule ranks only the shortlist.

Why: measured (below), a cheap bound over every page and a finer estimate of the attention mass over a few of
them choose better than either alone, and the finer rule's bytes are read over the shortlist only. A two-stage rule

1. **shortlists** the `keep_pages` flushed pages of highest first-stage score per (sequence, group of KV heads), a
   multiple of the budget's pages. The first stage is Quest's bound over the page summaries every cache keeps
   (`kmin` / `kmax`, quest.py: no state of its own; `first` None), or any other rule (`first`: e.g. labels over a
   quarter of the channels, whose own state the two-stage rule keeps beside the second stage's);
2. **reranks** them with `second.score_pages`, which gathers only the shortlisted pages' summaries / labels by page
   id (the rest score -inf, so they are chosen only after every shortlisted page, which `keep_pages >=
   select_pages` rules out). Labels' page mass is normalised over the shortlist (the pages outside it have the
   lowest first-stage score, so their mass is the smallest part of the softmax).

Any rule may shortlist for another (the selection protocol's "one rule shortlists for another"). Labels over a
quarter of the channels shortlisting for labels over every channel gained little on multi-value needles and decoded no
faster than dense (docs/BENCHMARKS.md, `longctx100.json` runs D, E; `decode_variants.json` run V): the seam is kept, no
default uses it.

Measured on an H200 (Qwen2.5-Coder-0.5B, needle in a haystack at 16K / 32K, budget 1/32): Quest's bound
shortlisting 4x the budget for labels to rerank kept 46% of the answers, against 21-38% for Quest alone and 38% for
labels alone. An earlier first stage, Quest's bound over summaries of groups of 8 or 16 pages (to read a fraction
of Quest's bytes), kept 0-8% and decoded no faster than Quest (0.97x): it was deleted.

Bytes a step (one sequence, all layers) = the first stage's over the whole context (Quest's summaries, or a first
rule's `step_bytes`) + the second stage's bytes over keep_pages pages (`step_bytes`, the cost model's term): on the
8B shape at 256K, 0.54 GB + 0.07 GB for 16-channel 4-bit labels over a 4x shortlist of an 8K budget, 13% above
Quest alone.

State: with a Quest first stage, the second stage's own, as is (`CacheState.sel`; None for a Quest second stage),
and its hooks run as they would alone. With a first rule, a `TwoStageState` of both rules' states, each rule's
hooks running on its own (a rule reads and writes `state.sel`: each sees its own part there). A Quest stage's hooks
do not run here: Quest's run for every cache (registry.kept_rules).
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp

from ulacache_jax.cache.select import registry
from ulacache_jax.cache.select.quest import Quest, select_pages
from ulacache_jax.cache.select.rule import SelectionRule


def shortlist(first, flushed, *, keep_pages: int, impl: str = "ref"):
    """first [S, G, P] float32 page bounds; flushed [S] int32 flushed pages -> (pages [S, G, K] int32 the ids of the
    K = min(keep_pages, P) pages of highest bound among the flushed ones, in page order; ok [S, G, K] bool: a page
    was chosen there, false (page 0) where fewer than K are flushed). The decode's own page top-k (quest.select_pages,
    no sink or recent pages forced; impl as its), so the shortlist takes the radix-select kernel where the decode's
    selection does, not XLA's top-k, which costs a layer as much as the sieve and the vTLB update together."""
    ids = select_pages(first, flushed, select_pages=keep_pages, sink_pages=0, recent_pages=0, impl=impl)
    ok = ids >= 0
    return jnp.where(ok, ids, 0), ok


def spread(scores, pages, ok, num_pages: int):
    """scores [S, G, K] of the shortlisted pages [S, G, K] -> [S, G, P] float32: -inf off the shortlist."""
    S, G, K = pages.shape
    full = jnp.full((S, G, num_pages), -jnp.inf, jnp.float32)
    idx = jnp.where(ok, pages, num_pages)                                                     # not ok: dropped
    return full.at[jnp.arange(S)[:, None, None], jnp.arange(G)[None, :, None], idx].set(
        scores.astype(jnp.float32), mode="drop")


@partial(jax.tree_util.register_dataclass, data_fields=["first", "second"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TwoStageState:
    """CacheState.sel of a two-stage rule with a first rule: each stage's own state (a pytree of [R, ...] leaves, or
    None for a stage without state)."""
    first: object
    second: object


def _stateful(rule) -> bool:
    """Whether a stage's hooks run here: Quest's already run for every cache (registry.kept_rules)."""
    return rule is not None and not isinstance(rule, Quest)


@dataclasses.dataclass(frozen=True)
class TwoStage(SelectionRule):
    """`first` (None: Quest's page bound) shortlists `keep_pages` pages per (sequence, group of KV heads), `second`
    ranks them (module docstring). keep_pages >= every page a sequence has: `second` alone (the shortlist holds
    every page)."""
    second: SelectionRule
    keep_pages: int
    first: SelectionRule | None = None
    name: ClassVar[str] = "two_stage"

    def check(self, config):
        v = self.keep_pages
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"TwoStage: keep_pages = {v!r} must be an int >= 1")
        if v < config.select_pages:
            raise ValueError(f"TwoStage: keep_pages = {v} must be >= token_budget // page_size = "
                             f"{config.select_pages} (the shortlist holds the pages attended)")
        for stage, rule in (("second", self.second), ("first", self.first)):
            if isinstance(rule, TwoStage):
                raise ValueError(f"TwoStage: the {stage} stage cannot be another TwoStage")
            if rule is not None and not isinstance(rule, SelectionRule):
                raise ValueError(f"TwoStage: the {stage} stage {rule!r} is not a SelectionRule")
        self.second.check(config)
        if self.first is not None:
            self.first.check(config)

    # ---- each stage's state and hooks, as they would be alone ----------------------------------------------------
    def _paired(self) -> bool:
        """Whether CacheState.sel is a TwoStageState (a first rule with state of its own), else the second's."""
        return _stateful(self.first)

    def _run(self, rule, hook: str, state, sel, *args):
        """`rule`'s hook on `state` with `sel` as its CacheState.sel -> the rule's new sel (as is for Quest)."""
        if not _stateful(rule):
            return sel
        return getattr(rule, hook)(dataclasses.replace(state, sel=sel), *args).sel

    def _call(self, hook: str, state, *args):
        if not self._paired():
            return dataclasses.replace(state, sel=self._run(self.second, hook, state, state.sel, *args))
        sel = state.sel
        return dataclasses.replace(state, sel=TwoStageState(
            first=self._run(self.first, hook, state, sel.first, *args),
            second=self._run(self.second, hook, state, sel.second, *args)))

    def _view(self, state, stage: str):
        """`state` as the named stage sees it (its own sel)."""
        if stage == "second" and not self._paired():
            return state
        return dataclasses.replace(state, sel=getattr(state.sel, stage))

    def init(self, config, ranks):
        second = self.second.init(config, ranks) if _stateful(self.second) else None
        if not self._paired():
            return second
        return TwoStageState(first=self.first.init(config, ranks), second=second)

    def ingest(self, state, slot, layer0, page0, kp, live, first):
        return self._call("ingest", state, slot, layer0, page0, kp, live, first)

    def attach(self, state, slot, layer, kp, live):
        return self._call("attach", state, slot, layer, kp, live)

    def append(self, state, layer, k, pos, live):
        return self._call("append", state, layer, k, pos, live)

    def flush(self, state, kp, page):
        return self._call("flush", state, kp, page)

    def commit(self, state, tail_k, length):
        return self._call("commit", state, tail_k, length)

    def release(self, state, slot):
        return self._call("release", state, slot)

    # ---- scoring -------------------------------------------------------------------------------------------------
    def score(self, state, layer, q, flushed, options):
        c = state.config
        if not self._paired():                                                                 # Quest's bound
            first = (self.first or Quest(c.summary_split)).score(state, layer, q, flushed, options)   # [S, G, P]
        else:
            first = self.first.score(self._view(state, "first"), layer, q, flushed, options)
        pages, ok = shortlist(first, flushed, keep_pages=self.keep_pages, impl=options.topk)   # [S, G, K]
        sc = self.second.score_pages(self._view(state, "second"), layer, q, flushed, pages, ok, options)
        return spread(jnp.where(ok, sc, -jnp.inf), pages, ok, c.max_pages_per_seq)

    @property
    def tokens(self) -> bool:
        """Per-token selection is the second stage's (it ranks the shortlisted pages' tokens)."""
        return self.second.tokens

    def score_tokens(self, state, layer, q, pages, ok, options):
        """The second stage's token mass of the listed pages (per-token selection inside this rule's pages)."""
        return self.second.score_tokens(self._view(state, "second"), layer, q, pages, ok, options)

    def step_bytes(self, *, context, num_layers, kv_heads, head_dim, itemsize, page_size):
        """The first stage's bytes over the whole context (Quest's: one summary per page, as this protocol has no
        config to read a summary_split from), and the second stage's over the shortlist."""
        shape = dict(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize,
                     page_size=page_size)
        return ((self.first or Quest()).step_bytes(context=context, **shape)
                + self.second.step_bytes(context=self.shortlist_tokens(context, page_size), **shape))

    def kernel_bytes(self, *, context, page_size, **shape):
        """Those of the page-lse kernel: the first rule's over the context (none for Quest's summaries, read at the
        HBM rate), and the second stage's over the shortlist."""
        first = self.first.kernel_bytes(context=context, page_size=page_size, **shape) if self.first else 0.0
        return first + self.second.kernel_bytes(context=self.shortlist_tokens(context, page_size),
                                                page_size=page_size, **shape)

    def shortlist_tokens(self, context: int, page_size: int) -> int:
        """The tokens the second stage scores a step: the shortlist's pages, at most the context."""
        return min(context, self.keep_pages * page_size)

    def prefix_sharing(self, config):
        why = self.first.prefix_sharing(config) if self.first is not None else None
        return why or self.second.prefix_sharing(config)

    def calibration_tokens(self, config):
        return max(self.second.calibration_tokens(config),
                   self.first.calibration_tokens(config) if self.first is not None else 0)


def configure(config, shortlist_mult: int, first: SelectionRule | None = None):
    """`config` with its own rule (registry.resolve: Quest, the key copy or labels, from its fields) as the second
    stage of a TwoStage whose shortlist is `shortlist_mult` x the budget's pages, chosen by `first` (None: Quest's
    bound). The rule object carries the channels / bits / table from here on, so the config's own fields are reset
    (they would describe a second rule beside it)."""
    rule = TwoStage(registry.resolve(config), keep_pages=shortlist_mult * config.select_pages, first=first)
    return dataclasses.replace(config, key_channels=0, label_bits=0, channel_table=None, selection=rule)


def parse_spec(spec: str) -> int:
    """'MULT' (the CLI's and the benchmarks' --two-stage) -> the shortlist's multiple of the budget, an int >= 1;
    anything else raises ValueError naming the value."""
    try:
        mult = int(spec)
    except (TypeError, ValueError):
        mult = 0
    if mult < 1:
        raise ValueError(f"--two-stage {spec!r} must be MULT, an int >= 1 (e.g. 4: Quest's bound shortlists 4x the "
                         "budget's pages for the selection rule to rank)")
    return mult
