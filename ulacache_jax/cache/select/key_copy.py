"""A compressed copy of every flushed key, resident in HBM, and the page selection that scores it.

Quest's per-page min/max bound (quest.py) ranks pages by an upper bound of one logit; on a trained model it
misses needles whose page is otherwise unremarkable (docs/BENCHMARKS.md, "A compressed copy of every key"). With
CacheConfig.key_channels = C > 0 the cache also keeps, for every token of every flushed page, C of its key's D
channels: those of largest energy (sum of k_d^2 over the keys of the sequence's first CALIB_TOKENS tokens), chosen
per (sequence, layer, KV head) when its first prefill block is written (or its shared prefix attached) and fixed
for the sequence's life; or fixed for the cache's life by an offline table. A page then scores the
attention mass it would get: each query head's softmax over the approximate logits q[chan] . k[chan] / sqrt(D) of
every flushed token, summed over the page's tokens and the group's query heads. The copy costs C / (2 D) of the
context's K + V bytes in HBM (16 of 128 channels: 6.25%) and is read in full every step.

Arrays (`CacheState.sel`, a `KeyCopyState`; one rank's view inside the decode, the state holds a leading rank axis):
- kc [S, L, G, P, page, g, C]: the copy, page-major so a flush writes whole pages; tokens of pages at or past a
  sequence's `flushed` count are stale and never read (masked).
- chan [S, L, G, g, C] int32: the channel indices of each (sequence, layer, KV head).
- ksc: None here; the label rule's scales (labels.py).
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp

from ulacache_jax.cache.select.rule import SelectionRule
from ulacache_jax.pallas_kernels.page_lse import page_lse, ref_dequant

# Online channels come from the keys of a prompt's first CALIB_TOKENS tokens, a window fixed in tokens so that a
# sequence's channels depend on its own prompt only: a shared prefix that covers the window, or a chunked prefill
# whose first chunk holds it, gives the channels a whole-prompt prefill picks (`calibration_tokens`).
CALIB_TOKENS = 1024


def pick_channels(k, live, num_channels: int):
    """k [..., T, g, D] keys; live [..., T] bool -> [..., g, C] int32: the C channels of largest energy over the
    live tokens (ties: lower index first). Where no token is live the energies tie: channels 0..C-1."""
    kf = jnp.where(live[..., None, None], k.astype(jnp.float32), 0.0)
    energy = jnp.sum(kf * kf, axis=-3)                                                  # [..., g, D]
    return jax.lax.top_k(energy, num_channels)[1].astype(jnp.int32)


def compress(k, chan):
    """k [..., T, g, D]; chan [..., g, C] -> [..., T, g, C]: each token's key at its KV head's channels."""
    idx = jnp.broadcast_to(chan[..., None, :, :], k.shape[:-1] + chan.shape[-1:])
    return jnp.take_along_axis(k, idx, axis=-1)


def channel_queries(q, chan, G: int, g: int):
    """q [S, Q, Hr, D] (Hr query heads of G * g KV heads); chan [S, G, g, C] int32 -> [S, Q, G, g, h, C] float32:
    each query head at its KV head's copy channels, over sqrt(D) (the logit's scale over the full head)."""
    S, Q, Hr, D = q.shape
    C = chan.shape[-1]
    h = Hr // (G * g)
    qg = q.astype(jnp.float32).reshape(S, Q, G, g, h, D)
    idx = jnp.broadcast_to(chan[:, None, :, :, None, :], (S, Q, G, g, h, C))
    return jnp.take_along_axis(qg, idx, axis=-1) / jnp.sqrt(jnp.float32(D))


def token_mass(vals, chan, q, ok):
    """Per-token attention mass over listed pages: vals [S, G, K, page, g, C] float32 the copy's values of the listed
    pages (dequantised labels); chan [S, G, g, C] int32; q [S, Q, Hr, D]; ok [S, G, K] bool the listed pages that
    take part -> [S, G, K, page] float32: each query head's softmax over the approximate logits of every token of the
    ok pages, summed over the group's heads and query rows (0 on pages not ok). Normalised over the listed pages
    (the shortlist holds the pages of largest mass, so the rest is the smallest part of each softmax)."""
    G, g = vals.shape[1], vals.shape[4]
    qc = channel_queries(q, chan, G, g)                                                 # [S, Q, G, g, h, C]
    logit = jnp.einsum("sqGjhc,sGKtjc->sGjqhKt", qc, vals)                              # [S, G, g, Q, h, K, t]
    live = ok[:, :, None, None, None, :, None]
    logit = jnp.where(live, logit, -jnp.inf)
    top = jnp.max(logit, axis=(-2, -1), keepdims=True)
    p = jnp.where(live, jnp.exp(logit - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=(-2, -1), keepdims=True), jnp.finfo(jnp.float32).tiny)
    return jnp.sum(p, axis=(2, 3, 4))                                                   # [S, G, K, t]


def page_mass(kc, chan, q, flushed, *, layer: int, impl: str = "auto", ksc=None, bits: int = 0, valid=None):
    """Page scores of one layer from the key copy: the attention mass each flushed page would receive.

    kc [S, L, G, P, page, g, C] (the rank's copy, every layer); chan [S, G, g, C] int32 (this layer's channels);
    q [S, Q, Hr, D] (Hr query heads of this rank's G * g KV heads; the Q rows' masses are summed); flushed [S]
    int32 pages per sequence -> [S, G, P] float32, -inf on pages at or past `flushed`. Softmax per query head over
    the flushed tokens (the unflushed tail is always attended and not part of the ranking), summed over the page's
    tokens and the group's heads. The per-page log-sum-exp of the logits is pallas_kernels/page_lse.py (impl:
    'auto' = kernel on GPU); each head's normaliser over the pages and the sum are [.., P]-sized XLA ops.
    Labels (bits 8 or 4): kc holds codes and ksc [S, L, G, P, g, C] their scales, every layer's (read in place;
    select/labels.py); the kernel dequantises in registers, so a step reads C * bits / 8 bytes a token.
    valid [S, G, P] bool, instead of `flushed`: the pages that take part (a two-stage shortlist, kc then holds only
    those pages)."""
    S, L, G, P, page, g, _ = kc.shape
    C = chan.shape[-1]
    Q, Hr = q.shape[1], q.shape[2]
    h = Hr // (G * g)
    qc = channel_queries(q, chan, G, g)                                                 # [S, Q, G, g, h, C]
    qc = qc.transpose(0, 2, 3, 1, 4, 5).reshape(S, G, g, Q * h, C)                      # rows: (Q, h)
    lse = page_lse(kc, qc, layer=layer, impl=impl, scale=ksc, bits=bits)                # [S, G, g * Q * h, P]
    if valid is None:
        ok = jnp.arange(P)[None, None, None, :] < flushed[:, None, None, None]         # [S, 1, 1, P]
    else:
        ok = valid[:, :, None, :]                                                       # [S, G, 1, P]
    lse = jnp.where(ok, lse, -jnp.inf)
    total = jax.nn.logsumexp(lse, axis=-1, keepdims=True)                              # each row's normaliser
    w = jnp.exp(lse - jnp.where(jnp.isfinite(total), total, 0.0))                       # 0 on masked pages
    return jnp.where(ok[:, :, 0], w.sum(axis=2), -jnp.inf)                              # [S, G, P]


@partial(jax.tree_util.register_dataclass, data_fields=["kc", "chan", "ksc"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KeyCopyState:
    """The key copy's leaves in CacheState.sel (all ranks: a leading R axis)."""
    kc: jax.Array            # [R, S, L, G, P, page, g, Cs] the copy (Cs = C; labels: codes, C / 2 bytes at 4 bits)
    chan: jax.Array          # [R, S, L, G, g, C] int32 its channels
    ksc: jax.Array | None    # [R, S, L, G, P, g, C] bfloat16 label scales per page and channel (None: no labels)


@dataclasses.dataclass(frozen=True)
class KeyCopy(SelectionRule):
    """C = `channels` channels of every flushed key in the model's dtype, picked per (sequence, layer, KV head)
    from the key energy of its prompt's first `window` tokens, or fixed by `table` ([L][KV][C] channel ids, nested
    tuples: an offline calibration, kept for the cache's life). Pages score the attention mass the copy predicts."""
    channels: int
    table: tuple | None = None
    window: int = CALIB_TOKENS
    name: ClassVar[str] = "key_copy"
    bits: ClassVar[int] = 0        # the stored copy's bits a channel; 0: the model's dtype (labels.py: 8 / 4)

    @classmethod
    def from_config(cls, config) -> "KeyCopy":
        return cls(channels=config.key_channels, table=config.channel_table)

    def check(self, config):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"{type(self).__name__}: window = {self.window!r} must be an int >= 1 (tokens)")
        if not 0 < self.channels <= config.head_dim:
            raise ValueError(f"{type(self).__name__}: channels = {self.channels} must be in [1, head_dim = "
                             f"{config.head_dim}]")

    # ---- what differs between the copy and the labels (labels.Labels overrides these three) -------------------
    def pick(self, k, live, num_channels: int):
        """k [..., T, g, D]; live [..., T] -> [..., g, C] int32: a sequence's channels from its first block."""
        return pick_channels(k, live, num_channels)

    def encode(self, x, dtype):
        """x [..., T, g, C] one page's copy -> (stored [..., T, g, Cs], scales [..., g, C] or None)."""
        return x.astype(dtype), None

    def code_shape_dtype(self, config):
        """(Cs, dtype) of the stored copy's last axis."""
        return self.channels, config.jnp_dtype

    def initial_channels(self, config, ranks: int = 1):
        """[R, S, L, G, g, C] int32: a free slot's channels. The offline table's (one rank) where there is one,
        else 0..C-1 until a sequence's first tokens pick its own."""
        c, C = config, self.channels
        shape = (ranks, c.max_seqs, c.num_layers, c.groups_per_rank, c.kv_heads_per_group, C)
        if self.table is None:
            return jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), shape)
        tab = jnp.asarray(self.table, jnp.int32).reshape(c.num_layers, c.groups_per_rank, c.kv_heads_per_group, C)
        return jnp.broadcast_to(tab[None, None], shape)

    def init(self, config, ranks):
        c = config
        cs, dt = self.code_shape_dtype(c)
        lead = (ranks, c.max_seqs, c.num_layers, c.groups_per_rank, c.max_pages_per_seq)
        return KeyCopyState(
            kc=jnp.zeros(lead + (c.page_size, c.kv_heads_per_group, cs), dt),
            chan=self.initial_channels(c, ranks),
            ksc=jnp.zeros(lead + (c.kv_heads_per_group, self.channels), jnp.bfloat16) if self.bits else None)

    # ---- hooks -------------------------------------------------------------------------------------------------
    def ingest(self, state, slot, layer0, page0, kp, live, first):
        """The copy of a block of whole pages of one sequence, all ranks, at prefill ingestion: first (traced bool,
        the sequence's first block) picks its channels from this block's live keys (else the stored channels are
        kept; with a table never re-picked). Dead tokens' copies are written too: they lie at or past the
        sequence's length, in pages that are not flushed yet, and are never read before a flush rewrites them."""
        sel = state.sel
        R, Lb, G, n, page, g, D = kp.shape
        C = self.channels
        zero = jnp.zeros((), jnp.int32)
        at = (zero, jnp.asarray(slot, jnp.int32), jnp.asarray(layer0, jnp.int32), zero)
        flat = kp.reshape(R, Lb, G, n * page, g, D)
        old = jax.lax.dynamic_slice(sel.chan, at + (zero, zero), (R, 1, Lb, G, g, C))[:, 0]   # [R, Lb, G, g, C]
        # a first block starts at token 0, so its token i is position i: the window is its first `window` tokens
        window = live.reshape(-1) & (jnp.arange(n * page) < self.window)
        ch = old if self.table is not None else jnp.where(first, self.pick(flat, window, C), old)
        block = compress(flat, ch).reshape(R, 1, Lb, G, n, page, g, C)
        at_page = at + (jnp.asarray(page0, jnp.int32), zero, zero)
        codes, scale = self.encode(block, sel.kc.dtype)              # [R, 1, Lb, G, n, page, g, Cs], [.., n, g, C]
        kc = jax.lax.dynamic_update_slice(sel.kc, codes, at_page + (zero,))
        ksc = sel.ksc if scale is None else jax.lax.dynamic_update_slice(sel.ksc, scale, at_page)
        chan = jax.lax.dynamic_update_slice(sel.chan, ch[:, None], at + (zero, zero))
        return dataclasses.replace(state, sel=KeyCopyState(kc=kc, chan=chan, ksc=ksc))

    def attach(self, state, slot, layer, kp, live):
        """An attached shared prefix's pages [0, n) of one layer join the copy, as ingestion writes them. Online
        channels are picked here from the prefix's first `window` tokens (the prefix cache attaches only
        prefixes that cover them, `calibration_tokens`, so they are the channels the sequence's own first block
        would give); the rest of the prompt is ingested as a later block and keeps them."""
        sel = state.sel
        R, G, n, P, g, D = kp.shape
        C = self.channels
        zero = jnp.zeros((), jnp.int32)
        at = (zero, jnp.asarray(slot, jnp.int32), jnp.asarray(layer, jnp.int32), zero)
        flat = kp.reshape(R, G, n * P, g, D)
        chan = sel.chan
        if self.table is None:
            window = jnp.repeat(live, P) & (jnp.arange(n * P) < self.window)                  # [n * P]
            ch = self.pick(flat, window, C)                                                    # [R, G, g, C]
            chan = jax.lax.dynamic_update_slice(chan, ch[:, None, None], at + (zero, zero))
        else:
            ch = jax.lax.dynamic_slice(chan, at + (zero, zero), (R, 1, 1, G, g, C))[:, 0, 0]   # [R, G, g, C]
        x = compress(flat, ch).reshape(R, 1, 1, G, n, P, g, C)
        codes, scale = self.encode(x, sel.kc.dtype)                 # [R, 1, 1, G, n, P, g, Cs], [.., n, g, C]
        size = codes.shape
        old = jax.lax.dynamic_slice(sel.kc, at + (zero,) * 4, size)
        kc = jax.lax.dynamic_update_slice(sel.kc, jnp.where(live[:, None, None, None], codes, old), at + (zero,) * 4)
        ksc = sel.ksc
        if scale is not None:
            old = jax.lax.dynamic_slice(sel.ksc, at + (zero,) * 3, scale.shape)
            ksc = jax.lax.dynamic_update_slice(sel.ksc, jnp.where(live[:, None, None], scale, old), at + (zero,) * 3)
        return dataclasses.replace(state, sel=dataclasses.replace(sel, kc=kc, ksc=ksc, chan=chan))

    def flush(self, state, kp, page):
        """The completed tail pages join the copy (read from their ring frames), one rank."""
        sel = state.sel
        S, L, G = kp.shape[:3]
        s = jnp.arange(S)[:, None, None, None]
        l = jnp.arange(L)[None, :, None, None]
        g = jnp.arange(G)[None, None, :, None]
        x = compress(kp, sel.chan[0][s, l, g])                                          # [S, L, G, T, page, g, C]
        codes, scale = self.encode(x, sel.kc.dtype)
        # written into the full [R, ...] arrays at rank 0, as Quest's summaries are: slicing the rank out and
        # adding it back (`kc[0].at[..].set(..)[None]`) gave the scatter's result a layout the state's does not
        # have, and XLA copied the whole copy (every layer's codes) twice per flush to restore it
        kc = sel.kc.at[0, s, l, g, page].set(codes, mode="drop")
        ksc = sel.ksc if scale is None else sel.ksc.at[0, s, l, g, page].set(scale, mode="drop")
        return dataclasses.replace(state, sel=dataclasses.replace(sel, kc=kc, ksc=ksc))

    def release(self, state, slot):
        """A freed slot's online channels go back to the initial ones (a table's never change, and a rank's slice
        of it is not known inside the per-rank program); the copy itself needs no clearing: a sequence reads only
        its flushed pages."""
        sel = state.sel
        if self.table is not None:
            return state
        chan = sel.chan.at[:, slot].set(self.initial_channels(state.config, sel.chan.shape[0])[:, 0])
        return dataclasses.replace(state, sel=dataclasses.replace(sel, chan=chan))

    def score(self, state, layer, q, flushed, options):
        sel = state.sel
        return page_mass(sel.kc[0], sel.chan[0, :, layer], q, flushed, layer=layer, impl=options.scores,
                         bits=self.bits, ksc=None if sel.ksc is None else sel.ksc[0])

    def score_pages(self, state, layer, q, flushed, pages, ok, options):
        """The listed pages' mass, normalised over them: their codes (and scales) gathered by page id, so a step
        reads the shortlist's copy only."""
        sel = state.sel
        S, G, K = pages.shape
        s = jnp.arange(S)[:, None, None]
        g = jnp.arange(G)[None, :, None]
        kc = sel.kc[0, s, layer, g, pages][:, None]                                     # [S, 1, G, K, page, g, Cs]
        ksc = None if sel.ksc is None else sel.ksc[0, s, layer, g, pages][:, None]    # [S, 1, G, K, g, C]
        return page_mass(kc, sel.chan[0, :, layer], q, flushed, layer=0, impl=options.scores, bits=self.bits,
                         ksc=ksc, valid=ok)

    tokens: ClassVar[bool] = True

    def score_tokens(self, state, layer, q, pages, ok, options):
        """The listed pages' tokens' mass from their copy (codes and scales gathered by page id, dequantised):
        token_mass over the shortlist."""
        sel = state.sel
        S, G, K = pages.shape
        s = jnp.arange(S)[:, None, None]
        g = jnp.arange(G)[None, :, None]
        kc = sel.kc[0, s, layer, g, pages]                                              # [S, G, K, page, g, Cs]
        vals = (kc.astype(jnp.float32) if not self.bits
                else ref_dequant(kc, sel.ksc[0, s, layer, g, pages], self.bits))        # [S, G, K, page, g, C]
        return token_mass(vals, sel.chan[0, :, layer], q, ok)

    def step_bytes(self, *, context, num_layers, kv_heads, head_dim, itemsize, page_size):
        """The whole copy, every step: C channels of every token."""
        return context * num_layers * kv_heads * self.channels * itemsize

    def kernel_bytes(self, **shape):
        """All of them: the copy (or the labels, whose `step_bytes` this calls) is scored by the page-lse kernel."""
        return self.step_bytes(**shape)

    def calibration_tokens(self, config):
        """Online channels come from a prompt's first `window` tokens (at most the context); a table needs none."""
        return 0 if self.table is not None else min(self.window, config.max_context)
