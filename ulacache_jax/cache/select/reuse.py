"""Cross-layer reuse of page scores: a few layers score their pages, the others select by the last one's scores.

Why: in a labels decode step at the 8B shape, scoring (the label page-lse kernel and the softmax over pages) is
~30-60 us of a layer's ~175 us of selection, sieve, fetch and attention (docs/BENCHMARKS.md, decode profile), and
which pages matter changes slowly from layer to layer (TidalDecode, arXiv 2410.05076, selects tokens at two layers
and reuses them in the rest). `Reuse(inner, layers)` runs `inner` at the listed layers; every other layer ranks its
pages by the scores of the nearest listed layer below it, in the same step. Each layer still attends its own K/V at
those pages (its own frames, sieve access and fetch): only the scoring is shared.

State: a `ReuseState` of the inner rule's state (None for Quest, whose hooks run for every cache) and `carry`
[R, S, G, P] float32, the scores of the last listed layer. Layer 0 is always listed, so a step never reads the
previous step's carry. Speculative verification scores each row at every layer (decode_layer.verify_batched) and is
not built with reuse: `check` refuses a cache with verification rows.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp

from ulacache_jax.cache.select import registry
from ulacache_jax.cache.select.quest import Quest
from ulacache_jax.cache.select.rule import SelectionRule


@partial(jax.tree_util.register_dataclass, data_fields=["inner", "carry"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class ReuseState:
    """CacheState.sel of a Reuse rule."""
    inner: object            # the inner rule's state (None: no state of its own)
    carry: jax.Array         # [R, S, G, P] float32 the last listed layer's page scores in this step


@dataclasses.dataclass(frozen=True)
class Reuse(SelectionRule):
    """`inner` scores pages at `layers` (sorted, 0 first); the other layers reuse the scores of the nearest listed
    layer below them (module docstring)."""
    inner: SelectionRule
    layers: tuple[int, ...]
    name: ClassVar[str] = "reuse"

    def check(self, config):
        L = config.num_layers
        ls = self.layers
        if (not isinstance(ls, tuple) or not ls or any(isinstance(x, bool) or not isinstance(x, int) for x in ls)
                or list(ls) != sorted(set(ls)) or ls[0] != 0 or ls[-1] >= L):
            raise ValueError(f"Reuse: layers = {ls!r} must be a sorted tuple of distinct layer indices starting at 0, "
                             f"each < num_layers = {L}")
        if not isinstance(self.inner, SelectionRule) or isinstance(self.inner, Reuse):
            raise ValueError(f"Reuse: the inner rule {self.inner!r} must be a SelectionRule other than Reuse")
        if config.verify_rows > 1:
            raise ValueError(f"Reuse: verify_rows = {config.verify_rows} (speculative verification) is not built with "
                             "reused page scores (a verification scores every row at every layer); use verify_rows = 1 "
                             "or a rule without Reuse")
        self.inner.check(config)

    # ---- the inner rule's state and hooks, as they would be alone -------------------------------------------------
    def _stateful(self) -> bool:
        return not isinstance(self.inner, Quest)           # Quest's hooks run for every cache (registry.kept_rules)

    def _view(self, state):
        return dataclasses.replace(state, sel=state.sel.inner)

    def _call(self, hook: str, state, *args):
        if not self._stateful():
            return state
        inner = getattr(self.inner, hook)(self._view(state), *args).sel
        return dataclasses.replace(state, sel=dataclasses.replace(state.sel, inner=inner))

    def init(self, config, ranks):
        c = config
        return ReuseState(inner=self.inner.init(c, ranks) if self._stateful() else None,
                          carry=jnp.zeros((ranks, c.max_seqs, c.groups_per_rank, c.max_pages_per_seq), jnp.float32))

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
        """The inner rule's scores at a listed layer; elsewhere the carried ones (the same flushed pages: a step's
        layers share each sequence's flushed count)."""
        if layer in self.layers:
            return self.inner.score(self._view(state) if self._stateful() else state, layer, q, flushed, options)
        return state.sel.carry[0]

    def scored(self, state, layer, scores):
        """A listed layer's scores are carried to the layers above it (written into the full [R, ...] array at rank
        0, as the other one-rank hooks write)."""
        if layer not in self.layers:
            return state
        return dataclasses.replace(state, sel=dataclasses.replace(
            state.sel, carry=state.sel.carry.at[0].set(scores.astype(jnp.float32))))

    def step_bytes(self, *, context, num_layers, kv_heads, head_dim, itemsize, page_size):
        """The inner rule's bytes at the listed layers only."""
        return self.inner.step_bytes(context=context, num_layers=self.scoring_layers(num_layers), kv_heads=kv_heads,
                                     head_dim=head_dim, itemsize=itemsize, page_size=page_size)

    def kernel_bytes(self, *, context, num_layers, **shape):
        return self.inner.kernel_bytes(context=context, num_layers=self.scoring_layers(num_layers), **shape)

    def scoring_layers(self, num_layers: int) -> int:
        """Listed layers among the first num_layers."""
        return sum(1 for x in self.layers if x < num_layers)

    def prefix_sharing(self, config):
        return self.inner.prefix_sharing(config)


def configure(config, layers: tuple[int, ...]):
    """`config` with its own rule (registry.resolve) scoring at `layers` only (a Reuse); the config's rule fields
    are reset, as two_stage.configure does (the rule object carries them from here on)."""
    rule = Reuse(registry.resolve(config), layers=tuple(layers))
    return dataclasses.replace(config, key_channels=0, label_bits=0, channel_table=None, selection=rule)  # checked


def parse_spec(spec: str, num_layers: int) -> tuple[int, ...]:
    """'every:N' (layers 0, N, 2N, ...) or a comma list of layer indices (the CLI's and the benchmarks'
    --reuse-layers) -> the listed layers; anything else raises ValueError naming the value."""
    try:
        if spec.startswith("every:"):
            n = int(spec.split(":", 1)[1])
            if n < 1:
                raise ValueError
            return tuple(range(0, num_layers, n))
        layers = tuple(int(x) for x in spec.split(","))
    except (AttributeError, ValueError):
        raise ValueError(f"--reuse-layers {spec!r} must be every:N (N >= 1) or a comma list of layer indices "
                         f"(0 first, each < {num_layers})") from None
    if not layers or list(layers) != sorted(set(layers)) or layers[0] != 0 or layers[-1] >= num_layers:
        raise ValueError(f"--reuse-layers {spec!r}: layers must be sorted, distinct, start at 0 and stay below "
                         f"{num_layers}")
    return layers
