"""Cache backends: UlaCache (sparse, two-tier) and the dense HBM baseline behind one protocol.

A backend has two halves:
- the traced half (`SparseOps`, `DenseOps`: frozen and hashable, so programs built from them are shared) is what
  the one program (program.py) calls inside `jax.shard_map`, on one rank's view of the cache:
  `prefill_store` (one layer's prompt K/V into the cache), `begin_chunk`, `lengths`, `attend` (one layer of one
  decode step) and `end_chunk` (commit lengths, flush the sequences at a flush point). The decode carries `cache` through its loop and reads
  `host` (the pinned host pool; `()` for dense) without carrying it.
- the host half (`SparseBackend`, `DenseBackend`) owns the arrays, sharded over the mesh's "tp" axis (one device
  is a mesh of one), and the slot bookkeeping in plain Python: `admit`, `release`, `request_error`, and the
  per-layer prefill views (`layer_view` / `set_layer_view`: what one layer's prefill program donates and gets
  back).
The attention kind is resolved once, by `backend_class` (make_backend); nothing else compares it. The kernel
choices are resolved once too, when make_backend builds the ops (kernel_choice.resolve).
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulacache_jax.cache.codec import Pages
from ulacache_jax.cache.state import CacheState, HostPool, device_memory_bytes, rebase_clock
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.decode_layer import (DecodeOptions, LayerStats, attend_layer, commit_rows, commit_summaries, flush_tail,
                           verify_layer)
from ulacache_jax.cache.kernel_choice import Platform, ResolvedKernels, resolve
from ulacache_jax.models.attention import dense_attention
from ulacache_jax.pallas_kernels.sparse_decode_attention import sparse_decode_attention
from ulacache_jax.runtime.prefix_cache import DensePrefixes, SparsePrefixes, dense_attach, sparse_attach
from ulacache_jax.runtime.sequences import CacheManager, CapacityError, ingest_chunk, reingest_selection
from ulacache_jax.runtime.tp import host_specs, TP_AXIS

ATTENTION_KINDS = ("sparse", "dense")


# ---- traced halves --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Kernels:
    """What both traced halves carry: the kernel choices resolved once (kernel_choice.resolve), and the decode
    options with those choices in place of their 'auto's. Build with `build`."""
    options: DecodeOptions
    kernels: ResolvedKernels

    @classmethod
    def build(cls, options: DecodeOptions, config: CacheConfig, platform: Platform, **query):
        """The ops for `options` on `platform` (query: resolve's query_dtype and query_heads_per_kv)."""
        kernels = resolve(options, config, platform, **query)
        return cls(kernels.decode_options(options), kernels)


@dataclasses.dataclass(frozen=True)
class SparseOps(_Kernels):
    """UlaCache inside the program: cache = CacheState (one rank's view), host = HostPool."""
    kind: ClassVar[str] = "sparse"

    def prefill_store(self, view, layer, slot, k, v, length, start=0):
        """view (state, host); k, v [T, KVr, D] of layer `layer` (traced), tokens [start, start + T) -> view."""
        state, host = view
        return ingest_chunk(state, host, slot, k[None], v[None], start, length, layer0=layer, impl=self.options.copy)

    def prefill_attach(self, view, layer, slot, src, start, rest=None, length=None):
        """The attached shared prefix (tokens [0, start), whole pages) of one layer: its K/V from the host pool and
        its page summaries (prefix_cache.sparse_attach). src [Tp]: only its length is used. rest [T, KVr, D]: the
        keys of tokens [start, start + T) stored before (prefill_store), of a prompt `length` long: encoded again
        for a rule whose online channels the prefix has just set (sequences.reingest_selection).
        -> (view, k, v [Tp, KVr, D])."""
        state, host = view
        state, k, v = sparse_attach(state, host, layer, slot, start, src.shape[0], impl=self.options.copy)
        c = state.config
        if rest is not None and c.selection_rule.calibration_tokens(c):
            state = reingest_selection(state, slot, rest[None], start, length, layer0=layer)
        return (state, host), k, v

    def begin_chunk(self, cache: CacheState) -> CacheState:
        return rebase_clock(cache)    # the int32 PB-LRU clock never wraps (a no-op until 2**30 ticks)

    def lengths(self, cache: CacheState):
        return cache.seqs.length

    def attend(self, cache: CacheState, host: HostPool, layer: int, q, k, v, pos, live, rank, budget=None):
        """q [S, 1, Hr, D], k/v [S, KVr, D], pos [S], live [S], budget [S] pages per sequence or None (the
        config's) -> (cache, out [S, 1, Hr, D], LayerStats). The host pool is read here, never carried through the
        decode loop (DESIGN.md section 1)."""
        return attend_layer(cache, host, layer, q, k, v, pos, live & cache.seqs.active, options=self.options,
                            rank=rank, budget=budget)

    def end_chunk(self, cache: CacheState, host: HostPool, length, flush=None):
        """Commit the chunk's lengths [S]; flush the completed tail pages of the sequences at a flush point (flush
        [S] bool; None: every sequence) -> (cache, host)."""
        cache = dataclasses.replace(cache, seqs=dataclasses.replace(cache.seqs, length=length))
        return flush_tail(cache, host, impl=self.options.copy, only=flush)

    def verify(self, cache: CacheState, host: HostPool, layer: int, q, k, v, pos, nrows, live, rank):
        """Speculative verification, one layer: q [S, Q, Hr, D], k/v [S, Q, KVr, D], rows j < nrows [S] at
        pos + j, each as a plain decode step at its position -> (cache, out [S, Q, Hr, D], LayerStats)."""
        return verify_layer(cache, host, layer, q, k, v, pos, nrows, live & cache.seqs.active,
                            options=self.options, rank=rank)

    def commit(self, cache: CacheState, host: HostPool, length, flush):
        """Accepted rows committed: length [S], flush [S] bool (the sequences at a flush point) -> (cache, host)."""
        return commit_rows(cache, host, length, flush, impl=self.options.copy)

    def commit_length(self, cache: CacheState, length, summaries: bool = True) -> CacheState:
        """`commit` with no sequence at a flush point, without the host pool (the speculative chunk's steps).
        summaries=False: the lengths only, after a plain decode step (`attend` wrote its summaries)."""
        cache = dataclasses.replace(cache, seqs=dataclasses.replace(cache.seqs, length=length))
        return commit_summaries(cache, length) if summaries else cache


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "ks", "vs", "rk", "rv"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DenseCache:
    """The baseline: every K/V in HBM. k, v: one [S, T_max, KV, D] array per layer (a tuple of L). One array per
    layer, not one [L, ...] array: with a single array each layer's token write produced a new whole-cache value
    that cuDNN read a slice of, and XLA kept a second full cache (the dense decode at 128K x 7 sequences asked for
    56 GiB more than the cache on the H200, scripts/probes/decode_memory.py).
    In a scaled page format (cache/codec.py, fp8) k, v hold codes, pages of page_size rows; ks, vs one
    [S, T_max / page, 1, KV, 1] float32 scale array per layer (a scale per page and KV head), and rk, rv one
    [S, page, KV, D] array per layer in the model's dtype: each slot's page under construction (its scale needs
    all its tokens, as the sparse cache's tail ring), read from there until the page is complete. None otherwise."""
    k: tuple
    v: tuple
    ks: tuple | None = None
    vs: tuple | None = None
    rk: tuple | None = None
    rv: tuple | None = None

    @staticmethod
    def zeros(num_layers: int, shape, dtype, device=None, *, codec=None, page_size: int = 0,
              scale_device=None) -> "DenseCache":
        """shape [S, T_max, KV, D], dtype the model's; codec: the page format (None: the model's dtype).
        device: where the arrays live, committed (an uncommitted first cache compiles the programs a second
        time once their committed outputs come back); scale_device: the scales' (None: device)."""
        def make(shape_, dt, fill=0, dev=device):
            return tuple(jnp.full(shape_, fill, dt, device=dev) for _ in range(num_layers))
        if codec is None or not codec.scaled:
            return DenseCache(make(shape, dtype), make(shape, dtype))
        S, T, KV, D = shape
        sdt = codec.storage_dtype(dtype)
        scale = (S, T // page_size, 1, KV, 1)
        ring = (S, page_size, KV, D)
        sdev = device if scale_device is None else scale_device
        return DenseCache(make(shape, sdt), make(shape, sdt), make(scale, jnp.float32, 1, sdev),
                          make(scale, jnp.float32, 1, sdev), make(ring, dtype), make(ring, dtype))

    def layer(self, l: int) -> tuple:
        """Layer l's arrays: (k, v), or (k, v, ks, vs, rk, rv) in a scaled page format."""
        if self.ks is None:
            return self.k[l], self.v[l]
        return self.k[l], self.v[l], self.ks[l], self.vs[l], self.rk[l], self.rv[l]

    def set_layer(self, l: int, *arrays) -> "DenseCache":
        """Layer l's arrays replaced (as `layer` gives them)."""
        def put(t, x):
            return t[:l] + (x,) + t[l + 1:]
        if len(arrays) == 2:
            return dataclasses.replace(self, k=put(self.k, arrays[0]), v=put(self.v, arrays[1]))
        k, v, ks, vs, rk, rv = arrays
        return DenseCache(put(self.k, k), put(self.v, v), put(self.ks, ks), put(self.vs, vs), put(self.rk, rk),
                          put(self.rv, rv))


VERIFY_CHUNK = 16384   # committed keys a cuDNN call's sequence holds: the verification's split (verify_splits)


def verify_splits(T: int, chunk: int = VERIFY_CHUNK) -> int:
    """Pieces the committed keys of a T-key cache are cut into for the verification: the most pieces of at least
    `chunk` keys that divide T evenly (1 below 2 * chunk). cuDNN's flash kernel runs one program per (sequence,
    head, block of query rows), so a few verification rows over a long cache make S x H programs that each walk
    every key; cut in pieces, the pieces run side by side and are merged by their log-sum-exps."""
    return next(c for c in range(max(1, T // chunk), 0, -1) if T % c == 0)      # c = 1 always divides


def verify_attention(q, k_cache, v_cache, k_new, v_new, pos, *, implementation: str | None = "cudnn",
                     splits: int | None = None):
    """Verification rows over a dense cache, the committed keys read once by a fused kernel: q [S, Q, H, D] the rows
    at positions pos [S] + j, k_cache / v_cache [S, T, KV, D] (keys < pos committed; pos >= 1, as every decoding
    sequence has its prompt), k_new / v_new [S, Q, KV, D] the rows' own K/V -> [S, Q, H, D] in q's dtype.
    Row j's causal view is split in two: every committed key (`dot_product_attention` over the first pos keys, no
    mask: cuDNN's flash kernel, with its log-sum-exp) and the rows' own keys 0 .. j (a Q x Q causal block in jnp),
    merged by their log-sum-exps. One call with the whole view as a mask takes cuDNN off its flash path, and the
    jnp attention writes float32 scores and a masked copy of V: both read far more than the K/V (docs/BENCHMARKS.md,
    exact mode). The committed keys go in as `splits` pieces of T / splits keys (default verify_splits(T)), each
    piece a sequence of the call's batch (a free reshape), so the pieces' programs fill the GPU (split-K)."""
    S, Q, H, D = q.shape
    T, KV = k_cache.shape[1], k_new.shape[2]
    c = verify_splits(T) if splits is None else splits
    if c < 1 or T % c:
        raise ValueError(f"splits = {c} must be >= 1 and divide the cache's {T} keys")
    f32 = jnp.float32
    seen = jnp.clip(pos[:, None] - (jnp.arange(c) * (T // c))[None, :], 0, T // c)      # [S, c] keys a piece
    qc = jnp.broadcast_to(q[:, None], (S, c, Q, H, D)).reshape(S * c, Q, H, D)
    o1, lse1 = jax.nn.dot_product_attention(
        qc, k_cache.reshape(S * c, T // c, KV, D), v_cache.reshape(S * c, T // c, KV, D),
        key_value_seq_lengths=jnp.maximum(seen, 1).reshape(S * c), implementation=implementation,
        return_residual=True)
    if lse1.shape != (S * c, Q, H):                    # [S, H, Q]: the layout some implementations return
        lse1 = jnp.swapaxes(lse1, 1, 2)
    lse1 = jnp.where(seen[:, :, None, None] > 0, lse1.reshape(S, c, Q, H), -jnp.inf)     # an empty piece: no mass
    o1 = o1.reshape(S, c, Q, H, D).astype(f32)
    qg = q.reshape(S, Q, KV, H // KV, D)
    s2 = jnp.einsum("SQKGD,SPKD->SKGQP", qg, k_new, preferred_element_type=f32) * D ** -0.5
    causal = jnp.arange(Q)[:, None] >= jnp.arange(Q)[None, :]                          # [Q, P]: key P <= row Q
    s2 = jnp.where(causal, s2, jnp.finfo(f32).min)
    lse2 = jax.nn.logsumexp(s2, axis=-1)                                               # [S, KV, G, Q]
    o2 = jnp.einsum("SKGQP,SPKD->SQKGD", jnp.exp(s2 - lse2[..., None]), v_new.astype(f32)).reshape(S, Q, H, D)
    lse2 = jnp.moveaxis(lse2, 3, 1).reshape(S, Q, H)
    m = jnp.maximum(jnp.max(lse1, axis=1), lse2)                                       # [S, Q, H]
    w1 = jnp.exp(lse1 - m[:, None])[..., None]                                         # [S, c, Q, H, 1]
    w2 = jnp.exp(lse2 - m)[..., None]
    num = jnp.sum(o1 * w1, axis=1) + o2 * w2
    return (num / (jnp.sum(w1, axis=1) + w2)).astype(q.dtype)


def verify_walk(q, k_cache, v_cache, pos, *, page_size: int = 64, impl: str = "pallas", tuning=None):
    """Verification rows over a dense cache by the decode attention kernel, the cache read in place as frames:
    q [S, Q, H, D] the rows at positions pos [S] + j, k_cache / v_cache [S, T, KV, D] holding every key up to
    pos + Q - 1 (the rows' own written first) -> [S, Q, H, D]. The cache is S * T / page_size frames of
    [page_size, KV, D] (one group of every KV head; a free reshape) and each sequence attends its pages below
    pos + Q; the kernel's causal rows (row j sees positions <= pos + j) give each row its view, so the Q x G rows
    of a KV head share one read of its keys. impl: the kernel's ('pallas' Triton on GPU, interpret mode
    elsewhere; 'ref' its jnp reference)."""
    S, Q, H, D = q.shape
    T, KV = k_cache.shape[1], k_cache.shape[2]
    if T % page_size:
        raise ValueError(f"the cache's {T} keys must be whole pages of {page_size}")
    n = T // page_size
    seq = (pos + Q).astype(jnp.int32)                                                  # [S]
    pg = jnp.arange(n)[None, :] * page_size                                            # [1, n]
    start = jnp.where(pg < seq[:, None], pg, -1)[:, None, :].astype(jnp.int32)         # [S, 1, n]
    frame = (jnp.arange(S)[:, None] * n + jnp.arange(n)[None, :])[:, None, :].astype(jnp.int32)
    return sparse_decode_attention(q, k_cache.reshape(S * n, page_size, KV, D),
                                   v_cache.reshape(S * n, page_size, KV, D), frame, start, seq, impl=impl,
                                   tuning=tuning)


def dense_page_walk(view, q, pos, live, *, page_size: int, impl: str = "pallas", tuning=None):
    """Dense decode attention over a scaled page format's cache without decoding it: view (DenseCache.layer's
    six arrays: codes ck, cv [S, T, KV, D], scales cks, cvs [S, T / P, 1, KV, 1], rings rk, rv [S, P, KV, D]),
    q [S, 1, H, D], pos [S] the new token's position (written to the ring), live [S] bool -> out [S, 1, H, D].
    The codes are the attention kernel's pool (pallas_kernels/sparse_decode_attention.py): S * T / P frames of
    [P, KV, D], frame s * T / P + p holding sequence s's page p, one group of every KV head. A sequence reads its
    complete pages 0 .. pos // P - 1 from their frames with their scales (dequantised in registers), its page
    pos // P from its ring slot (the kernel's second page source, in the model's dtype), and no page past it.
    impl: the kernel's ('pallas': Triton on GPU, interpret mode elsewhere; 'ref': its jnp reference); tuning: its
    launch (None: the kernel's default_tuning; scripts/probes/dense_walk_tuning.py times others)."""
    ck, cv, cks, cvs, rk, rv = view
    S, T, KV, D = ck.shape
    P = page_size
    n = T // P
    pg = jnp.arange(n)[None, :]                                                       # [1, n]
    cur = (pos // P)[:, None]                                                         # [S, 1]
    src = jnp.where(live[:, None], jnp.where(pg < cur, 1, jnp.where(pg == cur, 2, 0)), 0)   # [S, n]
    frame = jnp.arange(S)[:, None] * n + pg                                           # [S, n]
    start = jnp.where(src > 0, pg * P, -1)
    ring = jnp.where(src == 2, jnp.arange(S)[:, None], -1)
    seq_len = jnp.where(live, pos + 1, 0).astype(jnp.int32)
    return sparse_decode_attention(
        q, ck.reshape(S * n, P, KV, D), cv.reshape(S * n, P, KV, D), frame[:, None].astype(jnp.int32),
        start[:, None].astype(jnp.int32), seq_len, host_k=rk, host_v=rv, page_host=ring[:, None].astype(jnp.int32),
        page_src=src[:, None].astype(jnp.int32), k_scale=cks.reshape(S * n, 1, KV, 1),
        v_scale=cvs.reshape(S * n, 1, KV, 1), impl=impl, tuning=tuning)


@dataclasses.dataclass(frozen=True)
class DenseOps(_Kernels):
    """The dense baseline inside the program: cache = (DenseCache, length [S]), host = (). Decode attention by
    `kernels.dense_attention` (cuDNN or the jnp reference). A scaled page format (cache/codec.py: fp8) stores
    complete pages as codes with a scale per page and KV head and each slot's page under construction in the
    model's dtype (DenseCache); on GPU its attention walks the codes page by page (`dense_page_walk`: the Triton
    attention kernel dequantises in registers, so each code byte is read once), elsewhere ('xla', or 'cudnn' when
    forced) it reads the pages decoded by XLA."""
    kind: ClassVar[str] = "dense"
    codec: object = None        # the page format (CacheConfig.codec)
    page_size: int = 0
    dtype: str = "float32"      # the model's (the ring's)

    @classmethod
    def build(cls, options: DecodeOptions, config: CacheConfig, platform: Platform, **query):
        ops = super().build(options, config, platform, **query)
        return dataclasses.replace(ops, codec=config.codec, page_size=config.page_size, dtype=config.dtype)

    def prefill_store(self, view, layer, slot, k, v, length, start=0):
        """view: the layer's arrays (DenseCache.layer) [S, T_max, KVr, D] ...; k, v [T, KVr, D] of tokens
        [start, start + T) (start page-aligned, T a multiple of page_size in a scaled format) -> view."""
        if len(view) == 6:
            return self._store_pages(view, slot, k, v, length, start)
        ck, cv = view
        T = k.shape[0]
        if isinstance(start, int) and start == 0:
            return ck.at[slot, :T].set(k.astype(ck.dtype)), cv.at[slot, :T].set(v.astype(cv.dtype))
        rows = start + jnp.arange(T)
        return (ck.at[slot, rows].set(k.astype(ck.dtype), mode="drop"),
                cv.at[slot, rows].set(v.astype(cv.dtype), mode="drop"))

    def _store_pages(self, view, slot, k, v, length, start):
        """A scaled format's prefill: every page of the chunk encoded (a partial last page too: it is read from the
        ring until it completes, and encoded again then), the page holding position `length` (the next token's)
        into the ring when it lies in this chunk."""
        ck, cv, cks, cvs, rk, rv = view
        P = self.page_size
        T, KV, D = k.shape
        n = T // P
        kp = k.astype(self.dtype).reshape(n, P, KV, D)
        vp = v.astype(self.dtype).reshape(n, P, KV, D)
        enc = self.codec.encode(kp, vp, self.dtype)                  # codes [n, P, KV, D], scales [n, 1, KV, 1]
        rows = start + jnp.arange(T)
        pages = start // P + jnp.arange(n)
        ck = ck.at[slot, rows].set(enc.k.reshape(T, KV, D), mode="drop")
        cv = cv.at[slot, rows].set(enc.v.reshape(T, KV, D), mode="drop")
        cks = cks.at[slot, pages].set(enc.ks, mode="drop")
        cvs = cvs.at[slot, pages].set(enc.vs, mode="drop")
        cur = length // P - start // P                               # the next token's page, in the chunk
        inside = (cur >= 0) & (cur < n)
        c = jnp.clip(cur, 0, n - 1)
        rk = rk.at[slot].set(jnp.where(inside, kp[c], rk[slot]))
        rv = rv.at[slot].set(jnp.where(inside, vp[c], rv[slot]))
        return ck, cv, cks, cvs, rk, rv

    def _decoded(self, view, pos):
        """A scaled format's K and V [S, T_max, KVr, D] in the model's dtype: the decoded pages, each slot's page
        under construction (the one holding pos [S]) from its ring."""
        ck, cv, cks, cvs, rk, rv = view
        S, T, KV, D = ck.shape
        P = self.page_size
        k, v = self.codec.decode(Pages(ck.reshape(S, T // P, P, KV, D), cv.reshape(S, T // P, P, KV, D), cks, cvs),
                                 self.dtype)
        cur = (jnp.arange(T)[None, :] // P) == (pos[:, None] // P)    # [S, T]
        ring_k = jnp.tile(rk, (1, T // P, 1, 1))                      # [S, T, KV, D]: row t holds rk[t % P]
        ring_v = jnp.tile(rv, (1, T // P, 1, 1))
        return (jnp.where(cur[..., None, None], ring_k, k.reshape(S, T, KV, D)),
                jnp.where(cur[..., None, None], ring_v, v.reshape(S, T, KV, D)))

    def _append_scaled(self, view, k, v, pos, live):
        """One token per slot (k, v [S, KVr, D] at pos [S]) into a scaled format's ring, the ring page encoded into
        its page of the cache (final once the page completes; a partial page's codes are never read)."""
        ck, cv, cks, cvs, rk, rv = view
        S = k.shape[0]
        P = self.page_size
        off = jnp.where(live, pos % P, P)                             # P = dropped
        rk = rk.at[jnp.arange(S), off].set(k.astype(rk.dtype), mode="drop")
        rv = rv.at[jnp.arange(S), off].set(v.astype(rv.dtype), mode="drop")
        enc = self.codec.encode(rk, rv, self.dtype)                  # [S, P, KVr, D], [S, 1, KVr, 1]
        npages = ck.shape[1] // P
        page = jnp.where(live, pos // P, npages)                     # npages = dropped
        rows = jnp.where(live[:, None], page[:, None] * P + jnp.arange(P)[None, :], ck.shape[1])   # [S, P]
        s = jnp.arange(S)[:, None]
        ck = ck.at[s, rows].set(enc.k, mode="drop")
        cv = cv.at[s, rows].set(enc.v, mode="drop")
        cks = cks.at[jnp.arange(S), page].set(enc.ks, mode="drop")
        cvs = cvs.at[jnp.arange(S), page].set(enc.vs, mode="drop")
        return ck, cv, cks, cvs, rk, rv

    def prefill_attach(self, view, layer, slot, src, start, rest=None, length=None):
        """The shared prefix (tokens [0, start)) of one layer copied into `slot`'s rows from the slots that hold
        it, src [Tp] per token (prefix_cache.dense_attach); a scaled format's page scales with them. rest, length:
        unused (no selection state).
        -> (view, k, v [Tp, KVr, D] in the model's dtype)."""
        if len(view) == 2:
            ck, cv, k, v = dense_attach(*view, slot, src, start)
            return (ck, cv), k, v
        ck, cv, cks, cvs, rk, rv = view
        ck, cv, kc, vc = dense_attach(ck, cv, slot, src, start)     # codes [Tp, KVr, D]
        P = self.page_size
        Tp = src.shape[0]
        KV, D = kc.shape[1:]
        pg = jnp.arange(Tp // P)
        live = pg * P < start
        psrc = jnp.where(live, src[::P], slot)                       # [Tp / P] source slot per page
        ksc, vsc = cks[psrc, pg], cvs[psrc, pg]                      # [Tp / P, 1, KVr, 1]
        dst = jnp.where(live, pg, cks.shape[1])                      # past the pages = dropped
        cks = cks.at[slot, dst].set(ksc, mode="drop")
        cvs = cvs.at[slot, dst].set(vsc, mode="drop")
        k, v = self.codec.decode(Pages(kc.reshape(-1, P, KV, D), vc.reshape(-1, P, KV, D), ksc, vsc), self.dtype)
        return (ck, cv, cks, cvs, rk, rv), k.reshape(Tp, KV, D), v.reshape(Tp, KV, D)

    def begin_chunk(self, cache):
        return cache

    def lengths(self, cache):
        return cache[1]

    def attend(self, cache, host, layer: int, q, k, v, pos, live, rank, budget=None):
        """Every token of every sequence (a budget has nothing to select here; the Engine refuses one)."""
        dense, length = cache
        T = dense.k[layer].shape[1]
        S = q.shape[0]
        if dense.ks is not None:      # a scaled page format: the ring, its page encoded
            view = self._append_scaled(dense.layer(layer), k, v, pos, live)
            dense = dense.set_layer(layer, *view)
            if self.kernels.dense_attention == "pallas":
                o = dense_page_walk(view, q, pos, live, page_size=self.page_size, impl="pallas")
                return (dense, length), o, LayerStats.zeros()
            ck, cv = self._decoded(view, pos)
        else:
            w = jnp.where(live, pos, T)                               # write index, T = dropped
            ck = dense.k[layer].at[jnp.arange(S), w].set(k.astype(dense.k[layer].dtype), mode="drop")  # [S, T, KV, D]
            cv = dense.v[layer].at[jnp.arange(S), w].set(v.astype(dense.v[layer].dtype), mode="drop")
            dense = dense.set_layer(layer, ck, cv)
        seen = jnp.where(live, pos + 1, 0)
        if self.kernels.dense_attention == "cudnn":
            o = jax.nn.dot_product_attention(q, ck, cv, key_value_seq_lengths=jnp.maximum(seen, 1),
                                             implementation="cudnn")
        else:
            kpos = jnp.broadcast_to(jnp.arange(T)[None], (S, T))
            o = dense_attention(q, ck, cv, pos[:, None], kpos, k_valid=kpos < seen[:, None])
        return (dense, length), o, LayerStats.zeros()

    def end_chunk(self, cache, host, length, flush=None):
        return (cache[0], length), host

    def verify(self, cache, host, layer: int, q, k, v, pos, nrows, live, rank):
        """q [S, Q, H, D], k/v [S, Q, KV, D]: rows j < nrows written at pos + j, each attending causally up to its
        own position (jnp attention: cuDNN's causal mask is not per-row) -> (cache, out [S, Q, H, D], stats)."""
        dense, length = cache
        if dense.ks is not None:
            raise ValueError(f"speculative verification with the dense baseline in kv_dtype {self.codec.name!r} is "
                             "not built (its rows may complete a page mid-verification); use the sparse cache or "
                             "kv_dtype 'auto'")
        T = dense.k[layer].shape[1]
        S, Q = q.shape[:2]
        qpos = pos[:, None] + jnp.arange(Q)[None, :]                   # [S, Q]
        ok = live[:, None] & (jnp.arange(Q)[None, :] < nrows[:, None])
        w = jnp.where(ok, qpos, T)                                      # T = dropped
        s = jnp.arange(S)[:, None]
        ck = dense.k[layer].at[s, w].set(k.astype(dense.k[layer].dtype), mode="drop")
        cv = dense.v[layer].at[s, w].set(v.astype(dense.v[layer].dtype), mode="drop")
        if self.kernels.dense_attention == "cudnn":
            o = verify_attention(q, ck, cv, k.astype(ck.dtype), v.astype(cv.dtype), pos, implementation="cudnn")
        else:
            kpos = jnp.broadcast_to(jnp.arange(T)[None], (S, T))
            seen = jnp.where(live, pos + jnp.maximum(nrows, 1), 0)
            o = dense_attention(q, ck, cv, qpos, kpos, k_valid=kpos < seen[:, None])
        return (dense.set_layer(layer, ck, cv), length), o, LayerStats.zeros()

    def commit(self, cache, host, length, flush):
        return (cache[0], length), host

    def commit_length(self, cache, length, summaries: bool = True):
        return cache[0], length


# ---- host halves ----------------------------------------------------------------------------------------------
class SparseBackend:
    """UlaCache's arrays and bookkeeping: a `CacheManager` over the mesh (state + pinned host pool per rank)."""
    kind = "sparse"
    ops_class = SparseOps
    host_tier = True      # pages live in a host pool and cross PCIe: hit rates and PCIe bytes mean something

    @staticmethod
    def footprint(config: CacheConfig) -> dict:
        """Bytes of the cache: HBM (all ranks) and host, by part."""
        fp = config.footprint()
        hbm = {k: v * config.tp for k, v in fp.items() if k != "host"}
        return {"hbm_bytes": sum(hbm.values()), "host_bytes": fp["host"] * config.tp, "hbm_detail": hbm}

    def __init__(self, config: CacheConfig, mesh: Mesh, ops: SparseOps):
        self.config, self.ops = config, ops
        self.manager = CacheManager(config, mesh=mesh, impl=ops.kernels.copy)

    # the carried decode cache and the host pool
    @property
    def cache(self):
        return self.manager.state

    @cache.setter
    def cache(self, value):
        self.manager.state = value

    @property
    def host(self):
        return self.manager.host

    @host.setter
    def host(self, value):
        self.manager.host = value

    def specs(self):
        """-> (cache specs, host specs, host out-shardings): PartitionSpecs over "tp" and the pool's memory kind."""
        return self.manager.specs, host_specs(self.config), self.manager.host_shardings()

    # prefill: every layer donates the whole state and host pool (the layer index is traced)
    def layer_view(self, layer: int):
        return self.manager.state, self.manager.host

    def set_layer_view(self, layer: int, view) -> None:
        self.manager.state, self.manager.host = view

    def view_specs(self):
        """-> (view specs, view out-shardings)."""
        return (self.manager.specs, host_specs(self.config)), (None, self.manager.host_shardings())

    def prefill_done(self, slot: int, length: int) -> None:
        """Nothing: ingestion already set the sequence's length."""

    def prefixes(self, budget_pages: int | None = None) -> SparsePrefixes:
        """The stored shared prefixes of this cache (host pages attached to new sequences)."""
        return SparsePrefixes(self.manager, budget_pages)

    # slots
    def request_error(self, num_tokens: int) -> str | None:
        """Why a sequence of num_tokens tokens can never be admitted (even into an empty cache), else None."""
        need = self.manager.alloc.pages_needed(num_tokens)
        if need > self.config.host_pages:
            return (f"{num_tokens} tokens need {need} host pages, more than the whole host pool "
                    f"(host_pages = {self.config.host_pages})")
        return None

    def admit(self, num_tokens: int) -> int:
        return self.manager.admit(num_tokens)

    def release(self, slot: int) -> None:
        self.manager.release(slot)


class DenseBackend:
    """The dense baseline's arrays: per-layer K/V [S, T_max, KV, D] in HBM, KV heads sharded over "tp"."""
    kind = "dense"
    ops_class = DenseOps
    host_tier = False

    @staticmethod
    def footprint(config: CacheConfig) -> dict:
        """Bytes of the cache: every K/V in HBM (all ranks), no host tier."""
        c = config
        pages = c.max_seqs * c.max_pages_per_seq * c.num_groups                 # pages of one layer, K or V
        kv = 2 * c.num_layers * pages * c.page_bytes                            # codes (and scales): the format's
        detail = {"dense_kv": kv}
        if c.codec.scaled:   # each slot's page under construction, in the model's dtype
            detail["dense_ring"] = (2 * c.num_layers * c.max_seqs * c.page_size * c.num_kv_heads * c.head_dim
                                    * c.jnp_dtype.itemsize)
        return {"hbm_bytes": sum(detail.values()), "host_bytes": 0, "hbm_detail": detail}

    def __init__(self, config: CacheConfig, mesh: Mesh, ops: DenseOps):
        c = config
        self.config, self.ops, self.mesh = config, ops, mesh
        self._kv_sh = NamedSharding(mesh, P(None, None, TP_AXIS))
        self._rep = NamedSharding(mesh, P())
        # checked before allocating: a context too large for the device otherwise hangs in XLA's allocator or fails
        # with its RESOURCE_EXHAUSTED, neither naming the option to lower (weights are loaded by now: free memory)
        available, what = device_memory_bytes(mesh.devices.flat[0], free=True)
        short = memory_error(DenseBackend, c, available, what)
        if short is not None:
            raise ValueError(f"attention 'dense' with max_context = {c.max_context} and max_seqs = {c.max_seqs}: "
                             f"{short}: lower max_context or max_seqs, or use attention='sparse' (its K/V live "
                             "in host memory)")
        # committed from the start: the programs' outputs come back committed, and an uncommitted first cache made
        # prefill and decode compile twice (the H200's dense rows paid a second compile in their first timed chunk)
        self.dense = DenseCache.zeros(c.num_layers, (c.max_seqs, c.max_context, c.num_kv_heads, c.head_dim),
                                      c.jnp_dtype, device=self._kv_sh, codec=c.codec, page_size=c.page_size,
                                      scale_device=NamedSharding(mesh, P(None, None, None, TP_AXIS)))
        self.length = jnp.zeros(c.max_seqs, jnp.int32, device=self._rep)
        self._free = list(range(c.max_seqs))[::-1]
        self._set_length = jax.jit(lambda a, slot, n: a.at[slot].set(n), donate_argnums=0, out_shardings=self._rep)

    @property
    def cache(self):
        return self.dense, self.length

    @cache.setter
    def cache(self, value):
        self.dense, self.length = value

    host = ()

    def _layer_specs(self) -> tuple:
        """PartitionSpecs of one layer's arrays (DenseCache.layer): KV heads over "tp" (axis 2 of the K/V and the
        ring, axis 3 of the scales)."""
        kv = P(None, None, TP_AXIS)
        if not self.config.codec.scaled:
            return kv, kv
        sc = P(None, None, None, TP_AXIS)
        return kv, kv, sc, sc, kv, kv

    def specs(self):
        L = self.config.num_layers
        return (DenseCache(*[(x,) * L for x in self._layer_specs()]), P()), (), ()

    def layer_view(self, layer: int):
        return self.dense.layer(layer)

    def set_layer_view(self, layer: int, view) -> None:
        self.dense = self.dense.set_layer(layer, *view)

    def view_specs(self):
        return self._layer_specs(), None

    def prefill_done(self, slot: int, length: int) -> None:
        self.length = self._set_length(self.length, slot, length)

    def prefixes(self, budget_pages: int | None = None) -> DensePrefixes:
        """The stored shared prefixes of this cache (rows copied between slots)."""
        return DensePrefixes(self.config, budget_pages)

    def request_error(self, num_tokens: int) -> str | None:
        return None

    def admit(self, num_tokens: int) -> int:
        c = self.config
        if math.ceil(num_tokens / c.page_size) > c.max_pages_per_seq:
            raise CapacityError(f"sequence of {num_tokens} tokens exceeds the max context {c.max_context}")
        if not self._free:
            raise CapacityError(f"all max_seqs = {c.max_seqs} sequence slots are in use (over by 1)")
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort(reverse=True)


def backend_class(attention: str):
    """The backend class for `attention` ('sparse' = UlaCache, 'dense' = every K/V in HBM): the one place that
    reads the attention kind (make_backend builds from it; sizing before a backend exists asks its class)."""
    if attention == "sparse":
        return SparseBackend
    if attention == "dense":
        return DenseBackend
    raise ValueError(f"attention = {attention!r} must be one of {ATTENTION_KINDS}")


def memory_error(cls, config: CacheConfig, available: int | None, what: str,
                 weight_bytes: int | None = None) -> str | None:
    """The device-memory check, one for the CLI (before the Engine: available is the device's whole memory, to hold
    the cache and weight_bytes of weights) and DenseBackend (before its cache is allocated: what is free):
    why the cache of `cls` (SparseBackend / DenseBackend, its footprint per rank) does not fit, or None when it
    fits or `available` is unknown (None). what: the memory `available` measures, for the message
    (state.device_memory_bytes says it)."""
    if available is None:
        return None
    cache = cls.footprint(config)["hbm_bytes"] // max(1, config.tp)
    if cache + (weight_bytes or 0) <= available:
        return None
    gib = 2**30
    weights = "" if weight_bytes is None else f" and the weights {weight_bytes / gib:.2f} GiB"
    return (f"the cache needs {cache / gib:.2f} GiB ({cache} bytes) of device memory{weights}, but {what} is "
            f"{available / gib:.2f} GiB ({available} bytes)")


def make_backend(attention: str, config: CacheConfig, mesh: Mesh, options: DecodeOptions = DecodeOptions(), *,
                 query_dtype=None, query_heads_per_kv: int = 1):
    """The backend for `attention` over `mesh`, its kernel choices resolved here, once, for the mesh's platform
    (kernel_choice.resolve; query_dtype and query_heads_per_kv: the model's, see there)."""
    cls = backend_class(attention)
    ops = cls.ops_class.build(options, config, Platform.of(mesh.devices.flat[0]), query_dtype=query_dtype,
                              query_heads_per_kv=query_heads_per_kv)
    return cls(config, mesh, ops)
