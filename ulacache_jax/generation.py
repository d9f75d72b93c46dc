"""jit-compiled generation over UlaCache (sparse) or a dense HBM cache (the baseline), with the same model.

Flow per batch: admit each prompt into a slot -> prefill each prompt layer by layer (dense causal attention over
the prompt, K/V streamed into the host pool and summaries; the prompt length is bucketed to a power of two, so
lengths do not recompile) -> decode in jitted chunks of `page_size` steps (a fori_loop with a done mask, reading
the host pool, then one flush of the completed tail pages; state and host pool donated), one host sync per chunk.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from functools import partial

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx


from .pallas_kernels import on_gpu
from .pallas_kernels.pb_lru_sieve import sieve_geometry
from .cache_state import rebase_clock
from .config import CacheConfig
from .decode_layer import DecodeOptions, LayerStats, attend_layer, flush_tail
from .sampling import SamplingArrays, check_sampling, row_keys, sample
from .sequences import CacheManager, ingest_chunk
from .models.attention import dense_attention


def bucket_length(n: int, minimum: int) -> int:
    """Prompt length bucket: the next power of two >= max(n, minimum), so only log2(max) shapes compile."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def bucket_pages(n: int) -> int:
    """Pages per sequence for a cache of n pages: the next power of two up to 128, then the next multiple of
    max(128, 2^(bit_length - 4)): at most 16 sizes per octave (few compiles), at most 1/8 more host pool than
    needed (a power of two doubled it at 128K + a few pages), and a multiple of 128 pages (the score block
    divides it; see page_scores.pad_page_count)."""
    if n <= 128:
        return bucket_length(n, 1)
    step = max(128, 1 << (n.bit_length() - 4))
    return -(-n // step) * step


def default_cache_config(model_config, *, num_seqs: int, max_tokens: int, page_size: int = 64,
                         token_budget: int = 2048, dtype=None, **overrides) -> CacheConfig:
    """A cache for `num_seqs` sequences of up to `max_tokens` tokens each, HBM frames for the whole budget."""
    mc = model_config
    pages = bucket_pages(math.ceil(max_tokens / page_size))
    budget = min(token_budget, pages * page_size)
    num_groups = mc.num_kv_heads if mc.num_kv_heads <= 16 else 16
    frames_needed = num_seqs * mc.num_layers * num_groups * (budget // page_size)
    # one sieve call = one layer of a decode step: the largest buckets that keep the Pallas sieve on its fast path
    buckets, slots = sieve_geometry(frames_needed, num_seqs * num_groups * (budget // page_size))
    kw = dict(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
              kv_heads_per_group=mc.num_kv_heads // num_groups,
              max_seqs=num_seqs, max_pages_per_seq=pages, page_size=page_size,
              dtype=jnp.dtype(dtype or "float32").name, num_buckets=buckets, slots_per_bucket=slots,
              host_pages=num_seqs * mc.num_layers * num_groups * pages, token_budget=budget,
              sink_pages=min(1, budget // page_size), recent_pages=min(2, max(0, budget // page_size - 1)))
    kw.update(overrides)
    return CacheConfig(**kw)


def _check_prompts(prompt_ids, vocab_size: int, max_new_tokens: int) -> list[list[int]]:
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
        raise TypeError("prompt_ids must be a list of token-id lists")
    out = []
    for i, p in enumerate(prompt_ids):
        p = [int(t) for t in np.asarray(p).reshape(-1)]
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside [0, vocab_size = {vocab_size})")
        out.append(p)
    if not out:
        raise ValueError("prompt_ids is empty")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens!r} must be an int >= 1")
    return out


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DenseCache:
    """The baseline: every K/V in HBM. k, v: one [S, T_max, KV, D] array per layer (a tuple of L). One array per
    layer, not one [L, ...] array: with a single array each layer's token write produced a new whole-cache value
    that cuDNN read a slice of, and XLA kept a second full cache (the dense decode at 128K x 7 sequences asked for
    56 GiB more than the cache on the H200, scripts/probe_decode_memory.py)."""
    k: tuple
    v: tuple

    @staticmethod
    def zeros(num_layers: int, shape, dtype, device=None) -> "DenseCache":
        """device: where the arrays live, committed (see Generator: an uncommitted first cache compiles the
        programs a second time once their committed outputs come back)."""
        return DenseCache(tuple(jnp.zeros(shape, dtype, device=device) for _ in range(num_layers)),
                          tuple(jnp.zeros(shape, dtype, device=device) for _ in range(num_layers)))

    def set_layer(self, l: int, k, v) -> "DenseCache":
        return DenseCache(self.k[:l] + (k,) + self.k[l + 1:], self.v[:l] + (v,) + self.v[l + 1:])


def _use_cudnn(q) -> bool:
    """cuDNN attention (prefill, dense decode) on GPU for half-precision inputs, the one backend test the kernels
    use too; the jnp reference elsewhere (cuDNN takes no fp32)."""
    return on_gpu() and q.dtype in (jnp.bfloat16, jnp.float16)


def _prefill_attention(q, k, v, length):
    """Causal attention over one prompt; q [1, T, H, D], k/v [1, T, KV, D]. cuDNN flash attention on GPU (O(T)
    memory), the jnp reference elsewhere. Padding past `length` only sees earlier tokens, so it cannot leak."""
    if _use_cudnn(q):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    pos = jnp.arange(q.shape[1])[None]
    return dense_attention(q, k, v, pos, pos)


PREFILL_CHUNK = 4096  # tokens of per-token prefill work (projections, MLP) at a time


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


class _Program:
    """The jitted prefill and decode-chunk functions of one (model graph, cache shape, options): shared by every
    Generator with the same key (see `_program`), so a new Generator for the same model does not recompile.

    Prefill is three small programs driven by a Python loop over layers (`Generator.prefill`): embed, one layer
    (its params, the cache and the residual stream donated in, written in place, aliased out: every layer runs
    the same compiled program with its own params and a traced layer index) and the last-token logits. Its
    compile time is therefore that of one layer whatever the depth (an unrolled whole-model program compiled
    in time growing faster than the layer count)."""

    def __init__(self, graphdef, layer_gd, config: CacheConfig, attention: str, options: DecodeOptions, host_sh):
        self.graphdef, self.layer_gd, self.config, self.options = graphdef, layer_gd, config, options
        self.embed = jax.jit(self._embed)
        self.logits = jax.jit(self._logits)
        if attention == "sparse":
            self.prefill_layer = jax.jit(self._prefill_layer_sparse, donate_argnums=(1, 2, 3),
                                         out_shardings=(None, host_sh, None))
            self.decode = jax.jit(self._decode_sparse, donate_argnums=(1, 2),
                                  out_shardings=(None, host_sh, None, None, None, None))
        else:
            self.prefill_layer = jax.jit(self._prefill_layer_dense, donate_argnums=(1, 2, 3))
            self.decode = jax.jit(self._decode_dense, donate_argnums=(1,))

    # ---- prefill -------------------------------------------------------------------------------------------
    def _embed(self, params, ids):
        """ids [T] (bucketed) -> residual stream x [1, T, E]."""
        return nnx.merge(self.graphdef, params).embed(ids[None])

    def _logits(self, params, x, length):
        """x [1, T, E] after the last layer, length [] -> logits [V] of the last prompt token."""
        h = jax.lax.dynamic_slice_in_dim(x, length - 1, 1, axis=1)
        return nnx.merge(self.graphdef, params).logits(h)[0, 0]

    def _layer_kv(self, layer_params, x, length):
        """One layer over the prompt: x [1, T, E] -> (k, v [T, KV, D] for the cache, layer output [1, T, E])."""
        layer = nnx.merge(self.layer_gd, layer_params)
        T = x.shape[1]
        C = min(T, PREFILL_CHUNK)      # both powers of two: C divides T
        pos = jnp.arange(T, dtype=jnp.int32)[None]
        # per-token work in chunks of C tokens, so a 256K prompt never holds a [T, intermediate] MLP activation
        # (7 GB at Llama-3.1-8B shape); attention itself is flash (cuDNN) on GPU, O(T) memory
        q, k, v = _token_chunks(layer.qkv, C, x, pos)
        x = _token_chunks(layer.finish, C, x, _prefill_attention(q, k, v, length))
        return k[0], v[0], x

    def _prefill_layer_sparse(self, layer_params, state, host, x, slot, layer, length):
        """Layer `layer` (traced) of a prompt in slot `slot`: its K/V streamed into the host pool and summaries."""
        k, v, x = self._layer_kv(layer_params, x, length)
        state, host = ingest_chunk(state, host, slot, k[None], v[None], 0, length, layer0=layer,
                                   impl=self.options.copy)
        return state, host, x

    def _prefill_layer_dense(self, layer_params, ck, cv, x, slot, length):
        """ck, cv [S, T_max, KV, D]: this layer's dense cache, the prompt's K/V written at slot `slot`."""
        k, v, x = self._layer_kv(layer_params, x, length)
        T = x.shape[1]
        return ck.at[slot, :T].set(k.astype(ck.dtype)), cv.at[slot, :T].set(v.astype(cv.dtype)), x

    # ---- decode --------------------------------------------------------------------------------------------
    def _decode_loop(self, params, cache, attend, tok, done, remaining, length, keys, sampling, stop_ids):
        """page_size decode steps. keys [S] one PRNG key per slot for this chunk; tok [S] last token, done [S], remaining [S] tokens still allowed, length [S]
        committed lengths. Returns (cache, tokens [S, steps] (-1 where nothing was produced), done, remaining,
        length, stats)."""
        model = nnx.merge(self.graphdef, params)
        steps = self.config.page_size
        S = tok.shape[0]

        def body(i, carry):
            cache, tok, done, remaining, length, out, stats = carry
            live = ~done
            x = model.embed(tok[:, None])
            st = LayerStats.zeros()
            for l, layer in enumerate(model.layers):
                q, k, v = layer.qkv(x, length[:, None])
                cache, o, s = attend(cache, l, q, k[:, 0], v[:, 0], length, live)
                st = st + s
                x = layer.finish(x, o)
            logits = model.logits(x)[:, 0]
            nxt = sample(logits, jax.vmap(jax.random.fold_in, (0, None))(keys, i), sampling)
            nxt = jnp.where(live, nxt, -1)
            length = length + live
            remaining = remaining - live
            done = done | (live & ((remaining <= 0) | jnp.isin(nxt, stop_ids)))
            return cache, jnp.where(live, nxt, tok), done, remaining, length, out.at[i].set(nxt), stats + st

        # [steps, S], written by row: XLA:CPU copied the whole page pool every step when this buffer was [S, steps]
        # written by column (measured with memory_analysis; tests/test_generate.py guards it)
        out = jnp.full((steps, S), -1, jnp.int32)
        carry = (cache, tok, done, remaining, length, out, LayerStats.zeros())
        cache, tok, done, remaining, length, out, stats = jax.lax.fori_loop(0, steps, body, carry)
        return cache, out.T, done, remaining, length, stats

    def _rank(self):
        """This program's TP rank inside the traced code (0 here; tp._TPProgram: the mesh axis index)."""
        return 0

    def _out_stats(self, stats):
        """The decode's LayerStats as returned (tp._TPProgram adds a leading rank axis)."""
        return stats

    def _decode_sparse(self, params, state, host, tok, done, remaining, keys, sampling, stop_ids):
        opts, rank = self.options, self._rank()
        state = rebase_clock(state)   # the int32 PB-LRU clock never wraps (a no-op until 2**30 ticks)

        def attend(state, l, q, k, v, pos, live):
            # the host pool is read here, never carried through the loop (DESIGN.md section 1)
            return attend_layer(state, host, l, q, k, v, pos, live & state.seqs.active, options=opts, rank=rank)

        state, out, done, remaining, length, stats = self._decode_loop(
            params, state, attend, tok, done, remaining, state.seqs.length, keys, sampling, stop_ids)
        state = dataclasses.replace(state, seqs=dataclasses.replace(state.seqs, length=length))
        state, host = flush_tail(state, host, impl=opts.copy)
        return state, host, out, done, remaining, self._out_stats(stats)

    def _decode_dense(self, params, dense, length, tok, done, remaining, keys, sampling, stop_ids):
        T = dense.k[0].shape[1]

        def attend(cache, l, q, k, v, pos, live):
            S = q.shape[0]
            w = jnp.where(live, pos, T)                                   # write index, T = dropped
            ck = cache.k[l].at[jnp.arange(S), w].set(k.astype(cache.k[l].dtype), mode="drop")     # [S, T, KV, D]
            cv = cache.v[l].at[jnp.arange(S), w].set(v.astype(cache.v[l].dtype), mode="drop")
            seen = jnp.where(live, pos + 1, 0)
            if _use_cudnn(q):
                o = jax.nn.dot_product_attention(q, ck, cv, key_value_seq_lengths=jnp.maximum(seen, 1),
                                                 implementation="cudnn")
            else:
                kpos = jnp.broadcast_to(jnp.arange(T)[None], (S, T))
                o = dense_attention(q, ck, cv, pos[:, None], kpos, k_valid=kpos < seen[:, None])
            return cache.set_layer(l, ck, cv), o, LayerStats.zeros()

        dense, out, done, remaining, length, stats = self._decode_loop(
            params, dense, attend, tok, done, remaining, length, keys, sampling, stop_ids)
        return dense, length, out, done, remaining, stats


@functools.lru_cache(maxsize=8)
def _program(graphdef, layer_gd, config: CacheConfig, attention: str, options: DecodeOptions, host_sh) -> _Program:
    return _Program(graphdef, layer_gd, config, attention, options, host_sh)


class Generator:
    """Prefill and decode for one model and one cache shape; reusable across batches."""

    def __init__(self, model, cache_config: CacheConfig, *, attention: str = "sparse",
                 options: DecodeOptions = DecodeOptions()):
        if attention not in ("sparse", "dense"):
            raise ValueError(f"attention = {attention!r} must be 'sparse' or 'dense'")
        mc = model.config
        c = cache_config
        for name, a, b in (("num_layers", c.num_layers, mc.num_layers), ("num_kv_heads", c.num_kv_heads, mc.num_kv_heads),
                           ("head_dim", c.head_dim, mc.head_dim)):
            if a != b:
                raise ValueError(f"cache_config.{name} = {a} does not match the model's {b}")
        if getattr(mc, "sliding_window", None) is not None and c.max_context > mc.sliding_window:
            raise ValueError(f"model uses a sliding window of {mc.sliding_window} tokens; the cache's max context "
                             f"{c.max_context} exceeds it and sliding-window attention is not implemented in the cache")
        self.model_config, self.config, self.attention, self.options = mc, c, attention, options
        graphdef, self.params = nnx.split(model)
        self.stats = LayerStats.zeros()
        if attention == "sparse":
            self.cache = CacheManager(c)
            host_sh = self.cache.host_shardings()
        else:
            self.cache, host_sh = None, None
            # committed to the device from the start: the programs' outputs come back committed, and an
            # uncommitted first cache made prefill and decode compile twice (the H200's dense rows paid a second
            # compile in their first timed chunk: p99 7x the p50)
            dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            self.dense = DenseCache.zeros(c.num_layers, (c.max_seqs, c.max_context, c.num_kv_heads, c.head_dim),
                                          c.jnp_dtype, device=dev)
            self.dense_len = jnp.zeros(c.max_seqs, jnp.int32, device=dev)
        self.layer_params = [self.params["layers"][l] for l in range(c.num_layers)]
        self.program = _program(graphdef, layer_graphdef(graphdef, self.params), c, attention, options, host_sh)
        self._decode = self.program.decode

    # ---- host-side driver -----------------------------------------------------------------------------------
    def prefill(self, slot: int, prompt: list[int]):
        """Prefill one admitted slot; returns last-position logits [V]."""
        c = self.config
        T = bucket_length(len(prompt), c.page_size)
        # committed like the layers' outputs, so every layer call hits the one compiled program
        ids = jax.device_put(np.pad(np.asarray(prompt, np.int32), (0, T - len(prompt))), self._replicated())
        prog, n = self.program, len(prompt)
        x = prog.embed(self.params, ids)
        for l, lp in enumerate(self.layer_params):
            if self.attention == "sparse":
                m = self.cache
                m.state, m.host, x = prog.prefill_layer(lp, m.state, m.host, x, slot, l, n)
            else:
                k, v, x = prog.prefill_layer(lp, self.dense.k[l], self.dense.v[l], x, slot, n)
                self.dense = self.dense.set_layer(l, k, v)
        if self.attention != "sparse":
            self.dense_len = self.dense_len.at[slot].set(n)
        return prog.logits(self.params, x, n)

    def _replicated(self):
        """Where host-made inputs go: committed beside the cache (TPGenerator: replicated over the mesh)."""
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def decode_chunk(self, tok, done, remaining, keys, sampling, stop_ids):
        """One jitted chunk of page_size steps for every slot. keys [S]: one PRNG key per slot (see
        sampling.row_keys). Returns (tokens [S, page_size] with -1 where a slot produced nothing, done, remaining)."""
        # committed like the chunk's own outputs, so the first chunk compiles the same program as the rest
        tok, done, remaining = jax.device_put((tok, done, remaining), jax.devices()[0])
        if self.attention == "sparse":
            m = self.cache
            m.state, m.host, out, done, remaining, stats = self._decode(self.params, m.state, m.host, tok, done,
                                                                         remaining, keys, sampling, stop_ids)
        else:
            self.dense, self.dense_len, out, done, remaining, stats = self._decode(
                self.params, self.dense, self.dense_len, tok, done, remaining, keys, sampling, stop_ids)
        self.stats = self.stats + stats
        return out, done, remaining

    def admit(self, num_tokens: int) -> int:
        if self.attention == "sparse":
            return self.cache.admit(num_tokens)
        raise NotImplementedError  # dense slots are assigned by the caller in order

    def release(self, slot: int) -> None:
        if self.attention == "sparse":
            self.cache.release(slot)

    def run(self, prompts: list[list[int]], max_new_tokens: int, *, temperature=0.0, top_p=1.0, top_k=0, seed=0,
            stop_ids=()) -> list[list[int]]:
        """Generate for up to max_seqs prompts at once (the caller splits larger batches)."""
        c = self.config
        S = c.max_seqs
        if len(prompts) > S:
            raise ValueError(f"{len(prompts)} prompts exceed max_seqs = {S}")
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > c.max_context:
            raise ValueError(f"prompt + max_new_tokens = {longest} tokens exceeds the cache's max context "
                             f"{c.max_context} (max_pages_per_seq x page_size)")
        seeds = jnp.asarray([(seed * 1_000_003 + s) % 2**32 for s in range(S)], jnp.uint32)
        sampling = SamplingArrays.fill(S, temperature, top_p, top_k)
        stops = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
        slots = [self.admit(len(p) + max_new_tokens) if self.attention == "sparse" else i for i, p in enumerate(prompts)]
        first = np.zeros(S, np.int32)
        results: list[list[int]] = [[] for _ in prompts]
        done = np.ones(S, bool)
        remaining = np.zeros(S, np.int32)
        try:
            for i, (slot, p) in enumerate(zip(slots, prompts)):
                logits = self.prefill(slot, p)
                t = int(sample(logits[None], row_keys(seeds[slot:slot + 1], jnp.asarray([2**31 - 1], jnp.uint32)),
                               SamplingArrays.fill(1, temperature, top_p, top_k))[0])
                results[i].append(t)
                first[slot] = t
                remaining[slot] = max_new_tokens - 1
                done[slot] = remaining[slot] <= 0 or t in stop_ids
            tok, dn, rem = jnp.asarray(first), jnp.asarray(done), jnp.asarray(remaining)
            chunk = 0
            while not bool(np.all(np.asarray(dn))):
                keys = row_keys(seeds, jnp.full(S, chunk, jnp.uint32))
                out, dn, rem = self.decode_chunk(tok, dn, rem, keys, sampling, stops)
                out_np = np.asarray(out)
                for i, slot in enumerate(slots):
                    results[i].extend(int(t) for t in out_np[slot] if t >= 0)
                last = np.where(out_np >= 0, out_np, -1)
                tok_np = np.asarray(tok).copy()
                for s in range(S):
                    got = last[s][last[s] >= 0]
                    if len(got):
                        tok_np[s] = got[-1]
                tok = jnp.asarray(tok_np)
                chunk += 1
        finally:
            for slot in slots:
                self.release(slot)
        return results


def generate(model, prompt_ids, *, max_new_tokens: int, cache_config: CacheConfig | None = None,
             attention: str = "sparse", temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             stop_ids=(), options: DecodeOptions = DecodeOptions()) -> list[list[int]]:
    """Generate up to max_new_tokens tokens for each prompt (a ragged list of id lists) -> list of id lists.

    attention="sparse" decodes with UlaCache (query-aware page selection over a two-tier cache);
    attention="dense" is the baseline with the same model and every K/V in HBM. Prompts beyond the cache's
    max_seqs run in successive waves (the Engine does continuous batching)."""
    mc = model.config
    prompts = _check_prompts(prompt_ids, mc.vocab_size, max_new_tokens)
    check_sampling(temperature, top_p, top_k, mc.vocab_size)
    if cache_config is None:
        longest = max(len(p) for p in prompts) + max_new_tokens
        cache_config = default_cache_config(mc, num_seqs=bucket_length(len(prompts), 1) if len(prompts) <= 8 else 8,
                                            max_tokens=longest, page_size=64 if longest > 512 else 16,
                                            dtype=model.dtype)
    gen = Generator(model, cache_config, attention=attention, options=options)
    return run_in_waves(gen, prompts, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                        stop_ids=stop_ids)


def run_in_waves(gen: Generator, prompts, max_new_tokens: int, *, temperature, top_p, top_k, seed, stop_ids):
    """Prompts beyond the generator's max_seqs slots run in successive waves of max_seqs."""
    out: list[list[int]] = []
    S = gen.config.max_seqs
    for w in range(0, len(prompts), S):
        out.extend(gen.run(prompts[w:w + S], max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                           seed=seed + w, stop_ids=tuple(stop_ids)))
    return out
