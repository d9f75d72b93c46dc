"""Teacher-forced scoring through the sparse decode path: perplexity, top-1 agreement and KL to dense attention.

Quality of sparse attention on running text is a property of the decode loop, not of generation: each step must
feed the text's next token, not the model's. `TeacherForcedScorer` runs the decode step that
`generation.generate` runs, built from the same library pieces (`decode_layer.plan_layer` + `attend_pages`,
which together are `attend_layer`, then `flush_tail` once every `page_size` steps, the PB-LRU clock rebased at
the start of each chunk, and the model's layer `qkv` / `finish` / `logits` methods), with the given tokens fed in.

Flow per batch of equal-length windows (one per cache slot):
1. dense forward over each whole window (one compiled per-layer program, every layer through it): the final
   hidden states (the dense reference's logits, computed per chunk) and every layer's K/V;
2. the first `prefix` tokens' K/V go into the cache through `CacheManager.ingest` (the library's prefill
   ingestion: host write-through, key summaries, partial last page into the tail ring), so the sparse path and
   the dense reference share the prefix exactly;
3. decode steps feed tokens prefix .. T-1 through the sparse path; step j's logits (position prefix + j) score
   token prefix + j + 1 against the dense logits of the same position.
Scored positions are therefore prefix .. T-2 (T - 1 - prefix of them); every one is produced by the sparse path.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from ulacache_jax.runtime.backends import SparseOps
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.decode_layer import DecodeOptions, LayerStats, attend_pages, plan_layer
from ulacache_jax.cache.kernel_choice import Platform
from ulacache_jax.models.attention import blocked_attention
from ulacache_jax.runtime.program import DecodeMeta, decode_layers
from ulacache_jax.runtime.sequences import CacheManager


@dataclasses.dataclass(frozen=True)
class WindowScores:
    """Per scored position of each window (W windows, N = T - 1 - prefix positions), float32 / int32 numpy."""
    logp: np.ndarray          # [W, N] log p(next token) through the sparse decode
    dense_logp: np.ndarray    # [W, N] the same under dense attention
    argmax: np.ndarray        # [W, N] top-1 token of the sparse decode
    dense_argmax: np.ndarray  # [W, N]
    kl: np.ndarray            # [W, N] KL(dense || sparse) in nats
    hits: int                 # PB-LRU hits / misses of every sieve call
    misses: int
    selections: np.ndarray | None = None  # [steps, L, W, G, K] int32 selected page ids (-1 unused), if recorded

    def summary(self) -> dict:
        """Perplexity of both paths, top-1 agreement and mean KL over every scored position."""
        return dict(n=int(self.logp.size), ppl=float(np.exp(-self.logp.mean())),
                    dense_ppl=float(np.exp(-self.dense_logp.mean())),
                    top1_agreement=float((self.argmax == self.dense_argmax).mean()), kl=float(self.kl.mean()))


@dataclasses.dataclass(frozen=True)
class _RecordingOps:
    """The sparse backend's attend (`attend_layer` = `plan_layer` + `attend_pages`) on a cache of (state,
    selections [L, S, G, K]) that also keeps the page indices each layer's plan selected (-1 unused)."""
    options: DecodeOptions

    def attend(self, cache, host, layer: int, q, k, v, pos, live, rank):
        state, sels = cache
        c = state.config
        state, plan, s = plan_layer(state, host, layer, q, k, v, pos, live & state.seqs.active,
                                    options=self.options, rank=rank)
        state, o = attend_pages(state, host, q, plan, options=self.options)
        start = plan.start[..., :sels.shape[-1]]
        return (state, sels.at[layer].set(jnp.where(start >= 0, start // c.page_size, -1))), o, s


def _causal(q, k, v):
    """q [1, T, H, D], k/v [1, T, KV, D] -> causal attention [1, T, H, D] (scores and softmax in float32)."""
    pos = jnp.arange(q.shape[1])[None]
    return blocked_attention(q, k, v, pos, pos)


class _DensePrograms:
    """The jitted dense reference (embed, one layer, per-chunk metrics) of one model graph: shared by every scorer
    of that model (see `_dense_programs`), so scoring several cache configs compiles them once."""

    def __init__(self, graphdef, layer_gd):
        self.graphdef, self.layer_gd = graphdef, layer_gd
        self.embed = jax.jit(lambda p, ids: nnx.merge(graphdef, p).embed(ids))
        self.layer = jax.jit(self._layer)
        self.metrics = jax.jit(self._metrics)

    def _layer(self, layer_params, x):
        """One layer over a whole window: x [1, T, E] -> (x out, k, v [T, KV, D])."""
        layer = nnx.merge(self.layer_gd, layer_params)
        pos = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
        q, k, v = layer.qkv(x, pos)
        return layer.finish(x, _causal(q, k, v)), k[0], v[0]

    def _metrics(self, params, logits, h_all, start, targets):
        """logits [W, C, V] sparse; h_all [W, T', E] dense hidden states, of which positions [start, start + C)
        are this chunk's; targets [W, C] -> per position (logp, dense_logp, argmax, dense_argmax, kl) each [W, C]."""
        model = nnx.merge(self.graphdef, params)
        h = jax.lax.dynamic_slice_in_dim(h_all, start, logits.shape[1], axis=1)
        lp = jax.nn.log_softmax(logits, axis=-1)
        dlp = jax.nn.log_softmax(model.logits(h), axis=-1)
        pick = lambda a: jnp.take_along_axis(a, targets[..., None], axis=-1)[..., 0]
        kl = jnp.sum(jnp.exp(dlp) * (dlp - lp), axis=-1)
        return pick(lp), pick(dlp), jnp.argmax(lp, -1).astype(jnp.int32), jnp.argmax(dlp, -1).astype(jnp.int32), kl


@functools.lru_cache(maxsize=4)
def _dense_programs(graphdef, layer_gd) -> _DensePrograms:
    return _DensePrograms(graphdef, layer_gd)


class TeacherForcedScorer:
    """Scores windows of text through the sparse decode path of one (model, cache config).

    The cache config decides everything the decode does (page size, token budget, sink and recent pages,
    kv_heads_per_group, PB-LRU geometry); its max_seqs is the batch of windows scored together and its
    max_context must hold a window. `record=True` also returns every step's selected pages, per layer
    (the selection the sieve received: the plan's selected page starts), for eviction studies."""

    def __init__(self, model, cache_config: CacheConfig, *, options: DecodeOptions = DecodeOptions(),
                 record: bool = False):
        mc, c = model.config, cache_config
        for name, a, b in (("num_layers", c.num_layers, mc.num_layers),
                           ("num_kv_heads", c.num_kv_heads, mc.num_kv_heads), ("head_dim", c.head_dim, mc.head_dim)):
            if a != b:
                raise ValueError(f"cache_config.{name} = {a} does not match the model's {b}")
        self.model, self.config, self.options, self.record = model, c, options, record
        self.ops = SparseOps.build(options, c, Platform.current(), query_dtype=model.dtype,
                                   query_heads_per_kv=mc.num_queries_per_kv)     # the kernels, resolved once
        self.graphdef, self.params = nnx.split(model)
        self.layer_params = [nnx.split(layer)[1] for layer in model.layers]
        self.dense = _dense_programs(self.graphdef, nnx.split(model.layers[0])[0])
        self._chunk = None   # jitted on first use: its output host pool keeps the pool's sharding (pinned_host)

    def dense_forward(self, ids):
        """ids [T] -> (h [T, E] last layer's output, k, v [L, T, KV, D]): the dense reference of a window."""
        x = self.dense.embed(self.params, jnp.asarray(ids, jnp.int32)[None])
        ks, vs = [], []
        for lp in self.layer_params:
            x, k, v = self.dense.layer(lp, x)
            ks.append(k)
            vs.append(v)
        return x[0], jnp.stack(ks), jnp.stack(vs)

    # ---- sparse decode, teacher forced ---------------------------------------------------------------------------
    def _decode_chunk(self, params, state, host, toks, nsteps):
        """page_size decode steps of every slot fed toks [S, C] (C = page_size); steps >= nsteps are idle. The
        step is generate's: `program.decode_layers` over the sparse backend's ops (with `record`, ops that also
        keep each layer's selected pages). Returns (state, host, logits [S, C, V] float32, selections
        [C, L, S, G, K] or None, LayerStats)."""
        c = self.config
        model = nnx.merge(self.graphdef, params)
        S, C = toks.shape
        K = min(c.shortlist_pages, c.max_pages_per_seq)     # the pages the sieve receives
        ops = self.ops
        rec_ops = _RecordingOps(ops.options)
        state = ops.begin_chunk(state)
        active = state.seqs.active

        def body(i, carry):
            state, length, logits_out, sel_out, stats = carry
            meta = DecodeMeta(length, active & (i < nsteps), 0, host)
            x = model.embed(toks[:, i][:, None])
            if sel_out is None:
                state, y, st = decode_layers(model, ops, state, x, meta)
            else:
                sels = jnp.full((c.num_layers, S, c.groups_per_rank, K), -1, jnp.int32)     # [L, S, G, K]
                (state, sels), y, st = decode_layers(model, rec_ops, (state, sels), x, meta)
                sel_out = sel_out.at[i].set(sels)
            logits_out = logits_out.at[:, i].set(model.logits(y)[:, 0])                  # [S, V]
            return state, length + meta.live, logits_out, sel_out, stats + st

        logits0 = jnp.zeros((S, C, self.model.config.vocab_size), jnp.float32)
        sel0 = jnp.full((C, c.num_layers, S, c.groups_per_rank, K), -1, jnp.int32) if self.record else None
        carry = (state, state.seqs.length, logits0, sel0, LayerStats.zeros())
        state, length, logits, sels, stats = jax.lax.fori_loop(0, C, body, carry)
        state, host = ops.end_chunk(state, host, length)
        return state, host, logits, sels, stats

    def score(self, windows, prefix: int) -> WindowScores:
        """windows: up to max_seqs token-id lists of one length T; prefix: tokens prefilled (the rest are decoded,
        teacher forced, and scored: positions prefix .. T-2)."""
        c = self.config
        windows = [list(map(int, w)) for w in windows]
        if not windows or len(windows) > c.max_seqs:
            raise ValueError(f"{len(windows)} windows: need 1 to max_seqs = {c.max_seqs}")
        T = len(windows[0])
        if any(len(w) != T for w in windows):
            raise ValueError(f"windows must share one length; got {sorted({len(w) for w in windows})}")
        if not 1 <= prefix <= T - 2:
            raise ValueError(f"prefix = {prefix} must be in [1, T - 2 = {T - 2}] (T = {T} tokens a window)")
        if T > c.max_context:
            raise ValueError(f"window of {T} tokens exceeds the cache's max context {c.max_context}")
        V = self.model.config.vocab_size
        bad = [t for w in windows for t in w if not 0 <= t < V]
        if bad:
            raise ValueError(f"token id {bad[0]} outside [0, vocab_size = {V})")
        S, P = c.max_seqs, c.page_size
        cm = CacheManager(c, impl=self.ops.kernels.copy)
        slots, hs = [], []
        try:
            for w in windows:
                h, k, v = self.dense_forward(w)
                slot = cm.admit(T)
                slots.append(slot)
                pre = -(-prefix // P) * P        # a page-aligned chunk holding the prefix; the rest is padding
                kp = jnp.pad(k[:, :prefix], ((0, 0), (0, pre - prefix), (0, 0), (0, 0)))
                vp = jnp.pad(v[:, :prefix], ((0, 0), (0, pre - prefix), (0, 0), (0, 0)))
                cm.ingest(slot, kp, vp, prefix, chunk=pre)
                hs.append(h)
                del k, v
            steps = T - prefix
            nchunks = math.ceil(steps / P)
            toks = np.zeros((S, nchunks * P + 1), np.int32)
            for slot, w in zip(slots, windows):
                toks[slot, :steps] = w[prefix:]
            H = jnp.stack(hs)                                                            # [W, T, E]
            H = jnp.pad(H, ((0, 0), (0, nchunks * P + prefix - T), (0, 0)))
            out = {k: [] for k in ("logp", "dense_logp", "argmax", "dense_argmax", "kl")}
            sels, stats = [], LayerStats.zeros()
            if self._chunk is None:
                # as generation's decode program: the host pool comes back where it lives (pinned_host on GPU)
                self._chunk = jax.jit(self._decode_chunk, donate_argnums=(1, 2),
                                      out_shardings=(None, cm.host_shardings(), None, None, None))
            state, host = cm.state, cm.host
            cm.state = cm.host = None
            idx = np.asarray(slots)
            for ch in range(nchunks):
                n = min(P, steps - ch * P)
                state, host, logits, sel, st = self._chunk(self.params, state, host,
                                                           jnp.asarray(toks[:, ch * P:(ch + 1) * P]), n)
                stats = stats + st
                tgt = jnp.asarray(toks[idx, ch * P + 1:(ch + 1) * P + 1])
                res = self.dense.metrics(self.params, logits[idx], H, prefix + ch * P, tgt)
                for key, a in zip(out, res):
                    out[key].append(np.asarray(a))
                if sel is not None:
                    sels.append(np.asarray(sel)[:, :, idx])
            cm.state, cm.host = state, host
        finally:
            for slot in slots:
                if cm.state is not None:
                    cm.release(slot)
        N = T - 1 - prefix
        cat = {k: np.concatenate(v, axis=1)[:, :N] for k, v in out.items()}
        return WindowScores(**cat, hits=int(stats.hits), misses=int(stats.misses),
                            selections=np.concatenate(sels)[:steps] if self.record else None)


def dense_agreement(model, reference, windows, prefix: int) -> dict:
    """The noise floor a sparse path's top-1 agreement is held to (issue 48: no more than 1 point below dense bf16's
    agreement with dense float32): `model`'s dense forward against `reference`'s (the same weights in another
    dtype) over positions prefix .. T-2 of every window (the positions `TeacherForcedScorer.score` scores) -> dict
    n, top1_agreement, kl (KL(reference || model), nats), ppl and reference_ppl of the windows' next tokens."""
    progs = []
    for m in (model, reference):
        gd, params = nnx.split(m)
        progs.append((_dense_programs(gd, nnx.split(m.layers[0])[0]), params,
                      [nnx.split(layer)[1] for layer in m.layers], jax.jit(lambda p, h, gd=gd: nnx.merge(gd, p)
                                                                            .logits(h).astype(jnp.float32))))
    agree, kl, lp, rlp = [], [], [], []
    for w in windows:
        ids = jnp.asarray(list(map(int, w)), jnp.int32)
        T = ids.shape[0]
        if not 1 <= prefix <= T - 2:
            raise ValueError(f"prefix = {prefix} must be in [1, T - 2 = {T - 2}] (T = {T} tokens a window)")
        hs = []
        for dense, params, layer_params, _ in progs:
            x = dense.embed(params, ids[None])
            for layer in layer_params:
                x, _, _ = dense.layer(layer, x)
            hs.append(x)
        (_, m_params, _, m_logits), (ref, r_params, _, _) = progs
        logits = m_logits(m_params, hs[0][:, prefix:T - 1])                                 # [1, N, V]
        res = ref.metrics(r_params, logits, hs[1], prefix, ids[None, prefix + 1:])
        a, b, am, bm, k = (np.asarray(x) for x in res)
        lp.append(a)
        rlp.append(b)
        agree.append(am == bm)
        kl.append(k)
    cat = lambda xs: np.concatenate([x.ravel() for x in xs])
    return dict(n=int(cat(agree).size), top1_agreement=float(cat(agree).mean()), kl=float(cat(kl).mean()),
                ppl=float(np.exp(-cat(lp).mean())), reference_ppl=float(np.exp(-cat(rlp).mean())))


def score_windows(model, windows, prefix: int, cache_config: CacheConfig, *,
                  options: DecodeOptions = DecodeOptions(), record: bool = False) -> WindowScores:
    """Convenience: `TeacherForcedScorer(model, cache_config, ...).score(windows, prefix)`."""
    return TeacherForcedScorer(model, cache_config, options=options, record=record).score(windows, prefix)
