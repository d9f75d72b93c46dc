"""The one program: prefill and decode of one (model, cache backend, mesh), every entry point
`jax.jit(jax.shard_map(f))` over the mesh's "tp" axis. A single device is a mesh of one, so generate, the
Engine and tensor parallelism run the same compiled code; `f` sees one rank's view of the cache (tp.per_rank)
and the model's graphdef with row-parallel layers (tp.tp_graphdef: a psum after the attention output projection
and after the MLP, a no-op on one device).

The layer loop is `decode_layers`: the model's own `run_layers` ((cache, x, meta) -> (cache, y) per layer) with
the backend's `attend` as its attention. Prefill is three small programs driven by a Python loop over layers
(`Generator.prefill`): embed, one layer (its params passed as arguments and its cache view donated, so every
layer runs the same compiled program with a traced layer index) and the last-token logits: its compile time is
that of one layer whatever the depth.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulacache_jax.runtime.speculative import ngram as ngram_device
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.decode_layer import LayerStats
from ulacache_jax.models.attention import blocked_attention
from ulacache_jax.runtime.prefix_cache import prefix_attention
from ulacache_jax.runtime.sampling import MAX_LOGPROBS, sample_step
from ulacache_jax.runtime.speculative.rules import accept, backoff, draw, gate_rows, spec_bounds, token_probs
from ulacache_jax.runtime.tp import TP_AXIS, per_rank

PREFILL_CHUNK = 4096  # tokens of per-token prefill work (projections, MLP) at a time


class DecodeMeta(NamedTuple):
    """What every layer of one decode step shares: pos [S] int32 (the new token's position = committed length),
    live [S] bool, the rank (global group offset under TP), the host pool (read, never carried) and budget [S]
    int32 pages each sequence selects (None: the cache config's select_pages for all)."""
    pos: jax.Array
    live: jax.Array
    rank: jax.Array | int
    host: object
    budget: jax.Array | None = None


def decode_layers(model, ops, cache, x, meta: DecodeMeta):
    """One decode step through every layer: x [S, 1, E] embedded tokens -> (cache, y [S, 1, E] before the final
    norm, LayerStats summed over layers). `ops` is a backend's traced half (backends.SparseOps / DenseOps);
    works on one rank's view (inside shard_map) or directly on a single-device cache (rank 0)."""
    kw = {} if meta.budget is None else {"budget": meta.budget}    # ops without budgets (scripts) take none

    def attn_fn(carry, q, k, v, meta, layer):
        cache, stats = carry
        cache, o, s = ops.attend(cache, meta.host, layer, q, k[:, 0], v[:, 0], meta.pos, meta.live, meta.rank, **kw)
        return (cache, stats + s), o

    (cache, stats), y = model.run_layers((cache, LayerStats.zeros()), x, meta.pos[:, None], meta, attn_fn)
    return cache, y, stats


def decode_step(model, ops, cache, tok, meta: DecodeMeta, keys, sampling, pen=None, num_top: int = 0):
    """One plain decode step of every slot: tok [S] last tokens, keys [S] this step's PRNG keys -> (cache, nxt [S]
    the sampled tokens, -1 where not meta.live, LayerStats, logprobs: sampling.sample_step's, None unless num_top).
    pen: sampling.PenaltyState (None: no penalties). The body of a decode chunk and the speculative chunk's step
    without drafts."""
    cache, y, stats = decode_layers(model, ops, cache, model.embed(tok[:, None]), meta)
    nxt, lp = sample_step(model.logits(y)[:, 0], keys, sampling, pen, num_top)
    return cache, jnp.where(meta.live, nxt, -1), stats, lp


class VerifyMeta(NamedTuple):
    """What every layer of one verification shares: pos [S] int32 (row 0's position = committed length), nrows
    [S] int32 rows in use (row j at pos + j), live [S] bool, the rank and the host pool (read, never carried)."""
    pos: jax.Array
    nrows: jax.Array
    live: jax.Array
    rank: jax.Array | int
    host: object


def verify_layers(model, ops, cache, x, meta: VerifyMeta):
    """Speculative verification through every layer: x [S, Q, E] embedded tokens (the last committed token and
    Q - 1 drafts) -> (cache, y [S, Q, E] before the final norm, LayerStats). Row j computes what a plain decode
    step at position pos + j computes (`ops.verify`); nothing is committed (`ops.commit` does)."""
    def attn_fn(carry, q, k, v, meta, layer):
        cache, stats = carry
        cache, o, s = ops.verify(cache, meta.host, layer, q, k, v, meta.pos, meta.nrows, meta.live, meta.rank)
        return (cache, stats + s), o

    positions = meta.pos[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)[None, :]
    (cache, stats), y = model.run_layers((cache, LayerStats.zeros()), x, positions, meta, attn_fn)
    return cache, y, stats


def prefill_attention(q, k, v, length, impl: str):
    """Causal attention over one prompt; q [1, T, H, D], k/v [1, T, KV, D]. impl (the backend's resolved
    prefill_attention): 'cudnn' (flash attention, O(T) memory) or 'xla' (the blocked jnp attention, also O(T):
    the whole score matrix of a 32K float32 prompt would be 56 GiB). Padding past `length` only sees earlier tokens,
    so it cannot leak."""
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    pos = jnp.arange(q.shape[1])[None]
    return blocked_attention(q, k, v, pos, pos)


def _token_chunks(fn, chunk: int, *xs):
    """Apply a per-token fn to arrays [1, T, ...] in chunks of `chunk` tokens (lax.map: one compiled chunk)."""
    T = xs[0].shape[1]
    if chunk >= T:
        return fn(*xs)
    n = T // chunk
    split = [x.reshape((n, 1, chunk) + x.shape[2:]) for x in xs]
    out = jax.lax.map(lambda a: fn(*a), tuple(split))
    return jax.tree.map(lambda y: y.reshape((1, T) + y.shape[3:]), out)


def layer_graphdef(graphdef, params) -> nnx.GraphDef:
    """The graphdef of one decoder layer: every layer of the model must share it, so one compiled per-layer
    program (the layer's params passed as arguments) serves them all."""
    layers = nnx.merge(graphdef, params).layers
    first = nnx.split(layers[0])[0]
    for l, layer in enumerate(layers):
        if nnx.split(layer)[0] != first:
            raise ValueError(f"layer {l} differs in structure from layer 0; the runtime runs one program per layer "
                             "kind and needs every decoder layer alike")
    return first


class Program:
    """The jitted entry points (see the module docstring). Built through `program(...)`, which shares one
    Program between generators of the same key, so a new Generator for the same model does not recompile.

    embed(params, ids [T]) -> x [1, T, E]
    prefill_layer(layer_params, view, x, slot, layer, length) -> (view, x)      view and x donated
    prefill_layer_from(layer_params, view, x, slot, layer, length, start, src) -> (view, x): the same for the
        rest of a prompt after a shared prefix of `start` tokens
    logits(params, x, length) -> [V] of the last prompt token
    decode(params, cache, host, tok, done, remaining, keys, sampling, stop_ids)
        -> (cache, host, tokens [S, page_size], done, remaining, LayerStats of [R] per rank)   cache, host donated
    decode_steps(n): the same for a chunk of n steps (n a power of two <= page_size); decode_steps(n, phased=True)
        takes phase [S] after stop_ids: each slot's steps since its last flush point (keys and flushes follow it)
    next_logits(params, cache, host, tok) -> [S, V]: one step's logits, nothing committed.
    replay(budgets)(params, cache, host, forced [S, page_size], count [S][, budget [S]]) -> (cache, host): given
        tokens fed through decode steps (a checkpoint restore), see `_replay`.
    verify(rows), propose(rows), commit, spec_chunk(steps, K, ngram_max, min_drafts): speculative decoding
    (speculative.py); set_row(hist [S, C], slot, row [C]) -> hist: the chunk's device history, hist donated."""

    def __init__(self, graphdef, layer_gd, ops, config: CacheConfig, mesh: Mesh, params_spec, layer_spec,
                 cache_spec, host_spec, host_sh, view_spec, view_sh):
        """*_spec: PartitionSpec trees over "tp"; host_sh, view_sh: the out-shardings of the host pool and of a
        prefill view (memory kinds: the pinned host pool stays in host memory)."""
        self.graphdef, self.layer_gd, self.ops, self.config, self.mesh = graphdef, layer_gd, ops, config, mesh
        ps, lps, cs, hs, vs, r = params_spec, layer_spec, cache_spec, host_spec, view_spec, P()
        stats_spec = jax.tree.map(lambda _: P(TP_AXIS), LayerStats.zeros())

        def jit(fn, in_specs, out_specs, out_shardings=None, **kw):
            # outputs placed by their specs (explicitly: on a mesh of one, an inferred sharding comes back as an
            # equivalent but different one, and the next call would compile again), host memory where given
            sh = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs, is_leaf=lambda x: isinstance(x, P))
            if out_shardings is not None:
                sh = jax.tree.map(lambda given, by_spec: by_spec if given is None else given, out_shardings, sh,
                                  is_leaf=lambda x: x is None)
            return jax.jit(per_rank(fn, mesh, config, in_specs, out_specs), out_shardings=sh, **kw)

        self.embed = jit(self._embed, (ps, r), r)
        self.logits = jit(self._logits, (ps, r, r), r)
        self.prefill_layer = jit(self._prefill_layer, (lps, vs, r, r, r, r), (vs, r), (view_sh, None),
                                 donate_argnums=(1, 2))
        self.prefill_layer_from = jit(self._prefill_layer_from, (lps, vs) + (r,) * 6, (vs, r), (view_sh, None),
                                      donate_argnums=(1, 2))
        def decode(steps, penalties, num_top, budgets, phased):
            # extra inputs after stop_ids (arg 8), in order: the phase (phased), the penalty state (carried through
            # the chunk and donated), the budgets; the penalty state and the logprobs are extra outputs
            extra_in, extra_out = (r,) * (phased + penalties + budgets), (r,) * (penalties + (num_top > 0))
            return jit(functools.partial(self._decode, steps=steps, penalties=penalties, num_top=num_top,
                                         budgets=budgets, phased=phased),
                       (ps, cs, hs) + (r,) * 6 + extra_in, (cs, hs, r, r, r, stats_spec) + extra_out,
                       (None, host_sh, None, None, None, None) + (None,) * len(extra_out),
                       donate_argnums=(1, 2) + (9 + phased,) * penalties)
        self._decode_for = functools.lru_cache(maxsize=None)(decode)
        self.decode = self._decode_for(config.page_size, False, 0, False, False)
        self.next_logits = jit(self._next_logits, (ps, cs, hs, r), r)
        self._replay_for = functools.lru_cache(maxsize=None)(lambda budgets: jit(
            functools.partial(self._replay, budgets=budgets), (ps, cs, hs, r, r) + (r,) * budgets, (cs, hs),
            (None, host_sh), donate_argnums=(1, 2)))
        # one row of the ngram chunk's device history (speculative.SpecDecoder): built here, once per program,
        # so a new Engine over the same Generator does not compile it again
        self.set_row = jax.jit(_set_row, donate_argnums=0, out_shardings=NamedSharding(mesh, r))
        # speculative decoding (speculative.py): one program per row count (and per draft kind), built on first use
        self._verify_for = functools.lru_cache(maxsize=None)(lambda rows, probs: jit(
            functools.partial(self._verify, rows=rows, with_probs=probs), (ps, cs, hs) + (r,) * 6,
            (cs, hs, r, r, r, r, stats_spec), (None, host_sh) + (None,) * 5, donate_argnums=(1, 2)))
        self._propose_for = functools.lru_cache(maxsize=None)(lambda rows: jit(
            functools.partial(self._propose, rows=rows), (ps, cs, hs) + (r,) * 4, (cs, r, r), (None, None, None),
            donate_argnums=(1,)))
        self.commit = jit(self._commit, (cs, hs, r, r, r), (cs, hs), (None, host_sh), donate_argnums=(0, 1))
        self._spec_chunk_for = functools.lru_cache(maxsize=None)(lambda steps, num_tokens, ngram_max, min_drafts,
                                                                 page, fixed: jit(
            functools.partial(self._spec_chunk, steps=steps, num_tokens=num_tokens, ngram_max=ngram_max,
                              min_drafts=min_drafts, page=page, fixed=fixed),
            (ps, cs, hs) + (r,) * 9, (cs, hs) + (r,) * 8 + (stats_spec,), (None, host_sh) + (None,) * 9,
            donate_argnums=(1, 2, 3)))

    def decode_steps(self, steps: int, *, penalties: bool = False, logprobs: bool = False, budgets: bool = False,
                     phased: bool = False):
        """The decode program of a chunk of `steps` steps (a power of two up to page_size: a request's last chunk
        runs only the steps it needs, and only log2(page_size) + 1 programs exist). phased: the program takes
        phase [S] after stop_ids (see `_decode`): the Engine's, whose chunks may be shorter than a page.
        penalties: it takes a sampling.PenaltyState next (donated, returned updated after the stats); logprobs:
        it returns (logprob [S, steps], top_ids [S, steps, MAX_LOGPROBS], top_lp [S, steps, MAX_LOGPROBS]) last
        (the raw model logprobs: sampling.token_logprobs); budgets: it takes budget [S] int32 (pages each slot
        selects, at most select_pages) after those. A batch that uses none of the sampling options runs the plain
        program, so the options cost nothing where no request asks for them."""
        page = self.config.page_size
        if steps < 1 or steps > page or steps & (steps - 1):
            raise ValueError(f"steps = {steps} must be a power of two in [1, page_size = {page}]")
        return self._decode_for(steps, bool(penalties), MAX_LOGPROBS if logprobs else 0, bool(budgets),
                                bool(phased))

    # ---- prefill -------------------------------------------------------------------------------------------
    def _embed(self, params, ids):
        return nnx.merge(self.graphdef, params).embed(ids[None])

    def _logits(self, params, x, length):
        h = jax.lax.dynamic_slice_in_dim(x, length - 1, 1, axis=1)
        return nnx.merge(self.graphdef, params).logits(h)[0, 0]

    def _prefill_layer(self, layer_params, view, x, slot, layer, length):
        """Layer `layer` (traced) over the prompt x [1, T, E] (T bucketed, `length` real tokens): its K/V handed
        to the backend's prefill_store, the layer output returned."""
        block = nnx.merge(self.layer_gd, layer_params)
        T = x.shape[1]
        C = min(T, PREFILL_CHUNK)      # both powers of two: C divides T
        pos = jnp.arange(T, dtype=jnp.int32)[None]
        # per-token work in chunks of C tokens, so a 256K prompt never holds a [T, intermediate] MLP activation
        # (7 GB at Llama-3.1-8B shape); attention itself is flash (cuDNN) on GPU, O(T) memory
        q, k, v = _token_chunks(block.qkv, C, x, pos)
        view = self.ops.prefill_store(view, layer, slot, k[0], v[0], length)
        attn = prefill_attention(q, k, v, length, self.ops.kernels.prefill_attention)
        return view, _token_chunks(block.finish, C, x, attn)

    def _prefill_layer_from(self, layer_params, view, x, slot, layer, length, start, src):
        """Layer `layer` over the rest of a prompt whose first `start` tokens (whole pages) are a shared prefix:
        x [1, Ts, E] holds tokens [start, start + Ts) (Ts bucketed; `length` is the whole prompt's). The prefix's
        K/V come from the backend's prefill_attach (sparse: the attached host pages; dense: rows copied from the
        slots in src [Tp], the prefix operand's static length), the rest attends over them and itself
        (prefix_cache.prefix_attention), its K/V stored from `start` on; the shared pages are only read."""
        block = nnx.merge(self.layer_gd, layer_params)
        Ts = x.shape[1]
        C = min(Ts, PREFILL_CHUNK)
        pos = start + jnp.arange(Ts, dtype=jnp.int32)[None]
        q, k, v = _token_chunks(block.qkv, C, x, pos)
        # store first, then read the prefix from the stored view: the two touch disjoint pages (rows), and the read
        # taking the store's output orders it after the in-place write. The other order left the pool (host pool,
        # sparse) with an unordered reader beside an in-place writer, and XLA copied it to keep both valid.
        view = self.ops.prefill_store(view, layer, slot, k[0], v[0], length, start=start)
        view, kp, vp = self.ops.prefill_attach(view, layer, slot, src, start, k[0], length)
        attn = prefix_attention(q, k, v, kp[None], vp[None], start, self.ops.kernels.prefill_attention)
        return view, _token_chunks(block.finish, C, x, attn)

    # ---- decode --------------------------------------------------------------------------------------------
    def _decode(self, params, cache, host, tok, done, remaining, keys, sampling, stop_ids, *extra, steps: int,
                penalties: bool, num_top: int, budgets: bool, phased: bool):
        """`steps` decode steps for every slot. tok [S] last token, done [S], remaining [S] tokens still
        allowed, keys [S] one PRNG key per slot for this chunk. Tokens [S, steps] are -1 where nothing was
        produced. phased: phase [S] int32 (else 0 and every slot flushed at the end), the slot's decode steps
        since its last flush point; step i draws from fold_in(key, phase + i), and only slots whose phase + steps
        reaches page_size flush, so chunks shorter than a page give the tokens one page_size chunk gives.
        penalties: pen (sampling.PenaltyState) penalizes each step's logits and counts its tokens; num_top: each
        step's raw logprobs are returned; budgets: budget [S] pages a slot selects (`decode_steps`)."""
        phase = extra[0] if phased else None
        pen = extra[phased] if penalties else None
        budget = extra[phased + penalties] if budgets else None
        ops, model = self.ops, nnx.merge(self.graphdef, params)
        rank = jax.lax.axis_index(TP_AXIS)
        S = tok.shape[0]
        cache = ops.begin_chunk(cache)

        def body(i, carry):
            cache, tok, done, remaining, length, out, stats, pen, lps = carry
            live = ~done
            step_keys = (jax.vmap(jax.random.fold_in, (0, None))(keys, i) if phase is None
                         else jax.vmap(jax.random.fold_in)(keys, phase + i))
            cache, nxt, st, lp = decode_step(model, ops, cache, tok, DecodeMeta(length, live, rank, host, budget),
                                             step_keys, sampling, pen, num_top)
            if pen is not None:
                pen = pen.add(nxt, live)
            if num_top:
                lps = tuple(buf.at[i].set(v) for buf, v in zip(lps, lp))
            length = length + live
            remaining = remaining - live
            done = done | (live & ((remaining <= 0) | jnp.isin(nxt, stop_ids)))
            return (cache, jnp.where(live, nxt, tok), done, remaining, length, out.at[i].set(nxt), stats + st, pen,
                    lps)

        # [steps, S], written by row: XLA:CPU copied the whole page pool every step when this buffer was [S, steps]
        # written by column (measured with memory_analysis; tests/test_generate.py guards it)
        out = jnp.full((steps, S), -1, jnp.int32)
        lps = None
        if num_top:             # [steps, S], [steps, S, num_top] x 2, by row as `out`
            lps = (jnp.zeros((steps, S), jnp.float32), jnp.zeros((steps, S, num_top), jnp.int32),
                   jnp.zeros((steps, S, num_top), jnp.float32))
        carry = (cache, tok, done, remaining, ops.lengths(cache), out, LayerStats.zeros(), pen if penalties else None,
                 lps)
        cache, tok, done, remaining, length, out, stats, pen, lps = jax.lax.fori_loop(0, steps, body, carry)
        flush = None if phase is None else phase + steps >= self.config.page_size     # [S]: at a flush point
        cache, host = ops.end_chunk(cache, host, length, flush)
        res = (cache, host, out.T, done, remaining, jax.tree.map(lambda a: a[None], stats))
        if penalties:
            res += (pen,)
        if num_top:
            res += ((lps[0].T, lps[1].transpose(1, 0, 2), lps[2].transpose(1, 0, 2)),)
        return res

    def replay(self, budgets: bool = False):
        """The replay program (`_replay`); budgets: it takes budget [S] int32 after count."""
        return self._replay_for(bool(budgets))

    def _replay(self, params, cache, host, forced, count, *extra, budgets: bool):
        """Feed given tokens through decode steps: slot s takes forced[s, i] as its input at step i < count[s]
        (its K/V appended at its length, the step's selection and attention as a decode step computes them; no
        token is sampled), the other slots are untouched. A replay round starts at a flush point, so the slots
        whose count reaches page_size flush at its end and the rest stay between two (their phase = count).
        Why: a checkpoint restore must rebuild the cache a decode built; a prefill of the generated tokens attends
        every earlier token where the sparse decode attended its selection, so it writes other K/V past the first
        layer and the continuation parts from the uninterrupted one."""
        budget = extra[0] if budgets else None
        ops, model = self.ops, nnx.merge(self.graphdef, params)
        rank = jax.lax.axis_index(TP_AXIS)
        cache = ops.begin_chunk(cache)

        def body(i, carry):
            cache, length = carry
            live = i < count                                                            # [S]
            x = model.embed(forced[:, i][:, None])                                      # [S, 1, E]
            cache, _, _ = decode_layers(model, ops, cache, x, DecodeMeta(length, live, rank, host, budget))
            return cache, length + live

        cache, length = jax.lax.fori_loop(0, forced.shape[1], body, (cache, ops.lengths(cache)))
        return ops.end_chunk(cache, host, length, count >= self.config.page_size)

    # ---- speculative decoding (speculative.py) ----------------------------------------------------------------
    def verify(self, rows: int, with_probs: bool = False):
        """verify(params, cache, host, tokens [S, rows], nrows, bound, keys, sampling, draft_probs)
            -> (cache, host, out [S, rows], n_new [S], length [S], flush [S], LayerStats of [R])   cache, host donated
        Row 0 of `tokens` is each slot's last token, rows 1.. its drafts (nrows [S] rows in use, 0 = not running);
        every row is verified as a plain decode step, the drafts accepted by speculative.accept (draft_probs
        [S, rows - 1, V] the draft model's distributions if with_probs, else ignored: the drafts are point masses),
        the accepted rows committed (length), the sequences whose length reaches bound [S] (their next flush
        point) flushed. out: the new tokens (accepted drafts then the target's own), -1 past n_new."""
        return self._verify_for(rows, with_probs)

    def propose(self, rows: int):
        """propose(params, cache, tok [S], nrows [S], keys, sampling) -> (cache, drafts [S, rows - 1],
        probs [S, rows - 1, V]): a draft model's proposals, nrows - 1 per slot, each decoded by one plain step
        (its K/V left in the tail ring as a lease; committed or not by `commit`)."""
        return self._propose_for(rows)

    def spec_chunk(self, steps: int, num_tokens: int, ngram_max: int, min_drafts: float = 1.0, *,
                   fixed: bool = False):
        """spec_chunk(params, cache, host, hist [S, C], hlen [S], done [S], remaining [S], prompt_len [S],
                      backoff (k_now, fails, skip) [S] each, keys [S], sampling, stop_ids [S, N])
            -> (cache, host, hist, hlen, out [steps, S, K + 1], n_new [steps, S], done, remaining, backoff,
                counts (verifications, proposed [S], accepted [S]), LayerStats of [R])     cache, host, hist donated
        Up to `steps` ngram verifications (K = num_tokens) in one device call: each proposes up to K drafts per
        running slot from its history (ngram_device.propose, the host NgramIndex's rule) within the slot's back-off
        state and before its next flush point (speculative.spec_bounds), cut to one row a slot unless the drafts
        number at least min_drafts per running slot (speculative.gate_rows, the host step's rule), verifies and
        commits them (as `verify` with K + 1 rows), appends the new tokens to hist and out (-1 past n_new) and
        updates done (remaining tokens; each slot's stop_ids, -1 = none), the back-off state (speculative.backoff)
        and the counts. A step where no running slot has a draft left is a plain decode step (decode_layers and
        `sample`, one row a slot; the K + 1-row verification runs only when some slot drafts; `_once` picks one of
        the two), so a chunk that stops finding drafts costs what plain decoding costs instead of ending early and
        leaving the host short, unaligned plain chunks. A slot that reaches its next flush point waits there (no
        rows) for the rest of the loop: its flush, which writes the host pool, runs once after the loop (the host
        pool is only read inside it, as in `decode`); without a host pool (dense) no slot waits. The loop ends when
        no slot runs (every one waits or is done) or after `steps`. A slot's last history token is its last token
        (row 0). fixed (deterministic mode, speculative.SpecConfig.deterministic): every step is a K + 1-row
        verification, the steps where no slot drafts included (no plain decode step in the program).
        Keys: fold_in(keys, verification)."""
        return self._spec_chunk_for(steps, num_tokens, ngram_max, float(min_drafts), self.config.page_size,
                                    bool(fixed))

    def _verify_rows(self, model, cache, host, tokens, nrows, bound, keys, sampling, draft_probs, rank):
        """One verification (`verify`'s body) up to the commit -> (cache, out, n_new, length, flush, stats); the
        caller commits (ops.commit with flush, or without)."""
        ops = self.ops
        cache = ops.begin_chunk(cache)
        pos = ops.lengths(cache)
        live = nrows > 0
        cache, y, stats = verify_layers(model, ops, cache, model.embed(tokens), VerifyMeta(pos, nrows, live, rank, host))
        out, n_new = accept(model.logits(y), tokens[:, 1:], nrows, keys, sampling, draft_probs)
        length = jnp.where(live, pos + n_new, pos)
        flush = live & (length >= bound)
        return cache, out, n_new, length, flush, stats

    def _verify(self, params, cache, host, tokens, nrows, bound, keys, sampling, draft_probs, *, rows: int,
                with_probs: bool):
        model = nnx.merge(self.graphdef, params)
        rank = jax.lax.axis_index(TP_AXIS)
        cache, out, n_new, length, flush, stats = self._verify_rows(
            model, cache, host, tokens, nrows, bound, keys, sampling, draft_probs if with_probs else None, rank)
        cache, host = self.ops.commit(cache, host, length, flush)
        return cache, host, out, n_new, length, flush, jax.tree.map(lambda a: a[None], stats)

    def _spec_chunk(self, params, cache, host, hist, hlen, done, remaining, prompt_len, backoff_state, keys,
                    sampling, stop_ids, *, steps: int, num_tokens: int, ngram_max: int, min_drafts: float,
                    page: int, fixed: bool):
        ops, model = self.ops, nnx.merge(self.graphdef, params)
        rank = jax.lax.axis_index(TP_AXIS)
        S, Q = hist.shape[0], num_tokens + 1
        park = bool(jax.tree.leaves(host))     # the flush writes a host pool: a slot at its flush point waits

        def proposal(cache, hist, hlen, done, remaining, state, pending):
            # the next verification's rows: [last token, drafts] [S, Q], rows in use [S] (0: done, or parked at
            # its flush point until the flush after the loop), flush points [S]
            k, bound = spec_bounds(ops.lengths(cache), prompt_len, remaining, state, page)
            drafts, nd = ngram_device.propose(hist, hlen, k, num_tokens=num_tokens, ngram_max=ngram_max)
            last = jnp.take_along_axis(hist, jnp.maximum(hlen - 1, 0)[:, None], axis=1)
            nrows = gate_rows(jnp.where(done | (pending & park), 0, 1 + nd).astype(jnp.int32), min_drafts)
            return jnp.concatenate([last, drafts], axis=1), nrows, bound

        def cond(carry):
            i, nrows = carry[0], carry[8]
            return (i < steps) & jnp.any(nrows > 0)

        def verify(q, cache, tokens, nrows, bound, k):
            # a verification of q rows a slot -> (cache, out [S, Q] (-1 past q), n_new, length, flush, stats)
            cache, o, n_new, length, flush, st = self._verify_rows(
                model, cache, host, tokens[:, :q], jnp.minimum(nrows, q), bound, k, sampling, None, rank)
            cache = ops.commit_length(cache, length)                  # the flush runs after the loop
            return (cache, jnp.pad(o, ((0, 0), (0, Q - q)), constant_values=-1), n_new, length, flush, st)

        def plain(cache, tokens, nrows, bound, k):
            # no slot drafts: the plain decode step (`decode_step`, a decode chunk's body), not a one-row
            # verification: the verification's batched selection stages overflow pages and appends leases, work a
            # single committed row does not need. Its token's K/V and key summaries are written as decode writes
            # them (token by token), so the commit sets the lengths only. The PB-LRU clock was rebased once, before
            # the loop, as a decode chunk does.
            pos, live = ops.lengths(cache), nrows > 0
            cache, nxt, st, _ = decode_step(model, ops, cache, tokens[:, 0], DecodeMeta(pos, live, rank, host), k,
                                            sampling)
            n_new = live.astype(jnp.int32)
            length = pos + n_new
            o = jnp.pad(nxt[:, None], ((0, 0), (0, Q - 1)), constant_values=-1)
            return ops.commit_length(cache, length, summaries=False), o, n_new, length, live & (length >= bound), st

        def body(carry):
            (i, cache, hist, hlen, done, remaining, state, tokens, nrows, bound, pending, out, nn, counts,
             stats) = carry
            live = nrows > 0
            k = jax.vmap(jax.random.fold_in, (0, None))(keys, i)
            if Q > 1 and not fixed:    # one row a slot where nobody drafts: the plain step's cost, not K + 1 rows'
                wide = jnp.any(nrows > 1)
                res = (cache, jnp.full((S, Q), -1, jnp.int32), zeros, zeros, jnp.zeros((S,), bool),
                       LayerStats.zeros())
                res = _once(wide, lambda r: verify(Q, r[0], tokens, nrows, bound, k), res)
                cache, o, n_new, length, flush, st = _once(~wide, lambda r: plain(r[0], tokens, nrows, bound, k), res)
            else:
                cache, o, n_new, length, flush, st = verify(Q, cache, tokens, nrows, bound, k)
            hist, hlen = ngram_device.append(hist, hlen, o, n_new)
            remaining = remaining - n_new
            stop = jnp.any((o[:, :, None] >= 0) & (o[:, :, None] == stop_ids[:, None, :]), axis=(1, 2))
            done = done | (live & ((remaining <= 0) | stop))
            drafted = jnp.maximum(nrows - 1, 0)
            state = backoff(state, n_new, drafted, num_tokens, page)
            counts = (counts[0] + 1, counts[1] + drafted, counts[2] + jnp.where(drafted > 0, n_new - 1, 0))
            pending = pending | flush
            tokens, nrows, bound = proposal(cache, hist, hlen, done, remaining, state, pending)
            return (i + 1, cache, hist, hlen, done, remaining, state, tokens, nrows, bound, pending,
                    out.at[i].set(o), nn.at[i].set(n_new), counts, stats + st)

        zeros = jnp.zeros((S,), jnp.int32)
        cache = ops.begin_chunk(cache)
        pending = jnp.zeros((S,), bool)                               # slots that reached a flush point
        tokens, nrows, bound = proposal(cache, hist, hlen, done, remaining, backoff_state, pending)
        out = jnp.full((steps, S, Q), -1, jnp.int32)                 # written by row, as decode's [steps, S]
        nn = jnp.zeros((steps, S), jnp.int32)
        carry = (jnp.int32(0), cache, hist, hlen, done, remaining, backoff_state, tokens, nrows, bound,
                 pending, out, nn, (jnp.int32(0), zeros, zeros), LayerStats.zeros())
        (_, cache, hist, hlen, done, remaining, state, _, _, _, pending, out, nn, counts,
         stats) = jax.lax.while_loop(cond, body, carry)
        cache, host = ops.commit(cache, host, ops.lengths(cache), pending)
        return (cache, host, hist, hlen, out, nn, done, remaining, state, counts,
                jax.tree.map(lambda a: a[None], stats))

    def _propose(self, params, cache, host, tok, nrows, keys, sampling, *, rows: int):
        ops, model = self.ops, nnx.merge(self.graphdef, params)
        rank = jax.lax.axis_index(TP_AXIS)
        cache = ops.begin_chunk(cache)
        pos = ops.lengths(cache)
        S, V = tok.shape[0], model.config.vocab_size

        def body(i, carry):
            cache, tok, drafts, probs = carry
            on = (i < nrows).astype(jnp.int32)
            cache, y, _ = verify_layers(model, ops, cache, model.embed(tok[:, None]),
                                        VerifyMeta(pos + i, on, on > 0, rank, host))
            logits = model.logits(y)[:, 0]                                                  # [S, V]
            p = token_probs(logits, sampling)
            d = draw(p, logits, jax.vmap(jax.random.fold_in, (0, None))(keys, i), sampling)
            d = jnp.where(i + 1 < nrows, d, tok)
            return cache, d, drafts.at[:, i].set(d), probs.at[:, i].set(p)

        drafts = jnp.zeros((S, rows), jnp.int32)
        probs = jnp.zeros((S, rows, V), jnp.float32)
        cache, _, drafts, probs = jax.lax.fori_loop(0, rows, body, (cache, tok, drafts, probs))
        return cache, drafts[:, :rows - 1], probs[:, :rows - 1]

    def _commit(self, cache, host, length, flush, keep):
        """A draft cache follows the target's commit: length [S] and flush [S] where keep [S], else unchanged."""
        length = jnp.where(keep, length, self.ops.lengths(cache))
        return self.ops.commit(cache, host, length, keep & flush)

    def _next_logits(self, params, cache, host, tok):
        model = nnx.merge(self.graphdef, params)
        length = self.ops.lengths(cache)
        meta = DecodeMeta(length, jnp.ones(tok.shape, bool), jax.lax.axis_index(TP_AXIS), host)
        _, y, _ = decode_layers(model, self.ops, cache, model.embed(tok[:, None]), meta)
        return model.logits(y)[:, 0]


def _set_row(hist, slot, row):
    return hist.at[slot].set(row)


def _once(pred, fn, init):
    """fn(init) where pred, else init (same structure), as a while loop of at most one trip rather than lax.cond:
    a loop's carry is updated in place, while a conditional whose branches write the cache pool made XLA copy the
    pool (test_speculative's no-pool-copy test)."""
    def body(c):
        return jnp.zeros((), bool), fn(c[1])
    return jax.lax.while_loop(lambda c: c[0], body, (pred, init))[1]


def _flat(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None or isinstance(x, P))
    return treedef, tuple(leaves)


def _unflat(key):
    return jax.tree_util.tree_unflatten(*key)


@functools.lru_cache(maxsize=8)
def _program(graphdef, layer_gd, ops, config, mesh, *spec_keys) -> Program:
    return Program(graphdef, layer_gd, ops, config, mesh, *(_unflat(k) for k in spec_keys))


def program(graphdef, layer_gd, ops, config: CacheConfig, mesh: Mesh, params_spec, layer_spec, cache_spec,
            host_spec, host_sh, view_spec, view_sh) -> Program:
    """The Program of this key, built once (spec trees are flattened to make the key hashable)."""
    keys = tuple(_flat(t) for t in (params_spec, layer_spec, cache_spec, host_spec, host_sh, view_spec, view_sh))
    return _program(graphdef, layer_gd, ops, config, mesh, *keys)
