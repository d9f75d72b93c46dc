"""The page-selection protocol: what a rule keeps, when it writes it, how it scores pages (DESIGN.md sections 2, 3).

A rule is a frozen, hashable dataclass (it rides in `CacheConfig.selection`, a static jit field, so two equal
rules compile one program). Its per-sequence state is one pytree of arrays with a leading rank axis, stored whole
in `CacheState.sel` (None for a rule with no state of its own). The cache calls the rule's hooks at fixed points of
a sequence's life; every hook takes the state and returns a new one, and a rule touches only its own leaves
(`state.sel`), except Quest (quest.py), whose key summaries `kmin` / `kmax` are top-level fields kept for every
rule (the tail-append kernel updates them in the same launch as the ring write, and they are the first stage of a
two-stage selection).

Every hook runs traced, inside the cache's jitted programs. Views: hooks marked "one rank" index the leading
rank axis at 0 (decode code written for one rank's view); hooks marked "all ranks" handle every rank of the state
they get, [R, ...] (prefill code: R = config.tp, which is 1 inside the `shard_map` the runtime runs them in). Shapes: S slots, L layers, G groups per rank, P
max_pages_per_seq, T the tail ring's pages (config.TAIL_PAGES), page tokens a page, g KV heads a group, D
head_dim, Hr query heads of a rank.

Hooks (defaults: do nothing), in the order a sequence meets them:
- `init(config, ranks)` -> the state pytree ([R, ...] leaves) or None: built once with the cache.
- `ingest(state, slot, layer0, page0, kp, live, first)` all ranks: a prefill block of whole pages was written.
- `attach(state, slot, layer, kp, live)` all ranks: a shared prefix's pages [0, n) of one layer were attached to
  `slot` from the host pool (prefix_cache.sparse_attach) instead of being prefilled.
- `append(state, layer, k, pos, live)` one rank: a decode step wrote one token per sequence into its tail page.
- `flush(state, kp, page)` one rank: tail pages completed and went to the host pool.
- `commit(state, tail_k, length)` one rank: speculative rows were accepted; tail-page state is recomputed from
  the committed tokens only (rejected rows' keys sit in the ring past the length and must leave no trace).
- `release(state, slot)` all ranks: the slot was freed.
- `score(state, layer, q, flushed, options)` one rank -> [S, G, P] float32: higher = attend first; pages at or
  past `flushed` are never chosen (the caller masks them), the first `sink_pages` and last `recent_pages` always.
- `score_pages(state, layer, q, flushed, pages, ok, options)` one rank -> [S, G, K] float32: the scores of the listed pages
  only (a two-stage rule's second stage, two_stage.py); the default scores every page and gathers, a rule that
  can read just the listed pages' state overrides it.
- `score_tokens(state, layer, q, pages, ok, options)` one rank -> [S, G, K, page] float32: the listed pages'
  tokens' estimated attention mass (per-token selection, CacheConfig.token_shortlist); only rules with `tokens`
  True have one (the key copy and labels; Quest's bound is per page).
- `step_bytes(...)` -> bytes the score reads per sequence and decode step (the cost model's term);
  `kernel_bytes(...)` -> the part of them the page log-sum-exp kernel reads (timed at that kernel's own rate).
- `prefix_sharing(config)` -> None where a sharer may attach another prompt's pages, else the reason why not.
- `calibration_tokens(config)` -> N: the rule's state depends on a prompt's first N tokens as a whole (online
  label channels); a shared prefix is attached only where it covers them, and a chunked prefill's first chunk
  must hold them, so neither changes a sequence's tokens. 0 (the default): nothing of the kind.
- `check(config)`: raise ValueError for a config the rule cannot serve.
Static per-model arrays (a calibrated channel table) are fields of the rule object, as nested tuples so the rule
stays hashable; `init` turns them into arrays.

Two-stage: `two_stage.TwoStage(second, keep_pages, first=None)` lets Quest's bound over the page summaries every
cache keeps (or the rule `first`, with its own state) shortlist `keep_pages` pages per (sequence, group) for another
rule, which scores only those (`score_pages`).

Adding a rule: one file with a SelectionRule subclass (its kernel and resolver row, if it has one) and a config
value, `CacheConfig(..., selection=MyRule(...))`; no other file changes (tests/test_select_protocol.py does it
from the test file alone).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SelectionRule:
    """Base of every page-selection rule: the protocol (module docstring) with do-nothing hooks."""
    name: ClassVar[str] = "rule"
    tokens: ClassVar[bool] = False     # whether `score_tokens` is implemented (per-token selection)

    @classmethod
    def from_config(cls, config) -> "SelectionRule":
        """The rule as a CacheConfig's fields describe it (a rule with parameters of its own overrides this)."""
        return cls()

    def check(self, config) -> None:
        """Raise ValueError when `config` cannot hold this rule's state (shapes, dtypes)."""

    def init(self, config, ranks: int):
        """The rule's state for a fresh cache: a pytree of [R, ...] arrays, or None."""
        return None

    def ingest(self, state, slot, layer0, page0, kp, live, first):
        """All ranks. kp [R, Lb, G, n, page, g, D] keys of pages [page0, page0 + n) of layers [layer0, layer0 + Lb)
        of `slot`; live [n, page] bool tokens that exist; first: traced bool, the sequence's first block."""
        return state

    def attach(self, state, slot, layer, kp, live):
        """All ranks. kp [R, G, n, page, g, D] keys of the attached prefix pages [0, n) of layer `layer` of `slot`;
        live [n] bool the pages that are part of the prefix (the rest are zeros, to be prefilled)."""
        return state

    def append(self, state, layer, k, pos, live):
        """One rank. k [S, G, g, D] the new token's key of layer `layer` per sequence at position pos [S] int32,
        live [S] bool."""
        return state

    def flush(self, state, kp, page):
        """One rank. kp [S, L, G, T, page, g, D] keys of the tail-ring pages; page [S, 1, 1, T] int32 their page
        ids, P (out of range: drop) where the page did not complete."""
        return state

    def commit(self, state, tail_k, length):
        """One rank. tail_k [S, L, G, T, page, g, D] keys of the tail pages state.seqs.flushed + [0, T), of which
        the first length [S] - page start tokens are committed (active sequences only)."""
        return state

    def release(self, state, slot):
        """All ranks. The slot is free: reset whatever a new sequence must not inherit."""
        return state

    def score(self, state, layer, q, flushed, options):
        """One rank. q [S, 1, Hr, D]; flushed [S] int32 candidate pages -> [S, G, P] float32."""
        raise NotImplementedError(f"{type(self).__name__}.score")

    def score_pages(self, state, layer, q, flushed, pages, ok, options):
        """One rank. flushed [S] int32; pages [S, G, K] int32 page ids, ok [S, G, K] bool (the listed page is a
        flushed page) -> [S, G, K] float32 their scores (any value where not ok). This default scores every page and
        gathers (right for any rule, no bytes saved); rules whose state is per page read only the listed pages."""
        full = self.score(state, layer, q, flushed, options)                          # [S, G, P]
        return jnp.take_along_axis(full, jnp.clip(pages, 0, full.shape[-1] - 1), axis=-1)

    def score_tokens(self, state, layer, q, pages, ok, options):
        """One rank. q [S, Q, Hr, D]; pages [S, G, K] int32 page ids, ok [S, G, K] bool -> [S, G, K, page] float32
        each listed page's tokens' estimated attention mass (any value where not ok). Rules with `tokens` only."""
        raise NotImplementedError(f"{type(self).__name__} scores pages only (no per-token estimate)")

    def step_bytes(self, *, context: int, num_layers: int, kv_heads: float, head_dim: int, itemsize: int,
                   page_size: int) -> float:
        """Bytes the score reads for one sequence of `context` tokens in one decode step (all layers)."""
        return 0.0

    def kernel_bytes(self, *, context: int, num_layers: int, kv_heads: float, head_dim: int, itemsize: int,
                     page_size: int) -> float:
        """Of `step_bytes`, those the page log-sum-exp kernel (pallas_kernels/page_lse.py) reads: that kernel is
        bound by its instructions, not by HBM, so the cost model times them at the kernel's measured rate
        (CostModel.score_kernel_bytes_per_s). 0 for a rule that does not score through it."""
        return 0.0

    def calibration_tokens(self, config) -> int:
        """Tokens at the start of a prompt this rule calibrates on as a whole (module docstring); 0: none."""
        return 0

    def prefix_sharing(self, config) -> str | None:
        """None: prompts may attach another prompt's stored pages (`attach` fills this rule's state for them).
        Else the reason they may not (Generator.set_prefix_cache raises it)."""
        return None
