"""The Generator: one model, one cache backend, one compiled program (program.py) over a mesh; and the one cache
sizing policy (`default_cache_config`) that generate, the Engine, TP and the CLI use.

The Generator is the host-side driver of the program: `admit` a sequence into a slot, `prefill` it layer by layer
(the prompt length bucketed to a power of two, so lengths do not recompile; or a chunk at a time, `begin_prefill` /
`prefill_next`, each chunk attending to the earlier ones' K/V in the cache), `decode_chunk` every slot for up to
`page_size` steps (one host sync per chunk), `release` the slot. The Engine schedules requests over it; `generate()`
runs on the Engine. Tensor parallelism is the same Generator over a mesh of `cache_config.tp` devices (a single
device is a mesh of one): the params are placed by `tp.param_specs`, the cache by the backend.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulacache_jax.runtime.backends import DenseCache, make_backend
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.select import labels
from ulacache_jax.models import calibration
from ulacache_jax.runtime.cost_model import resolve_attention
from ulacache_jax.cache.decode_layer import DecodeOptions, LayerStats
from ulacache_jax.pallas_kernels.pb_lru_sieve import pool_slots, sieve_geometry
from ulacache_jax.runtime.prefix_cache import PrefixStats, prefix_bucket
from ulacache_jax.runtime.program import layer_graphdef, program
from ulacache_jax.runtime.tp import TP_AXIS, make_mesh, param_specs, shard_params, tp_graphdef

__all__ = ["Generator", "PrefillProgress", "default_cache_config", "bucket_length", "bucket_pages", "DenseCache"]


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


def shipped_table(model_config, num_channels: int):
    """The label-channel table shipped for the model's weights file (ModelConfig.file_sha256, models/calibration)
    at C = num_channels, fitted to its KV heads; None where there is none (online channels then)."""
    if model_config.file_sha256 is None:
        return None
    try:
        table = calibration.channel_table(None, num_channels, digest=model_config.file_sha256)
    except ValueError:                  # tables, but not for this C
        return None
    return None if table is None else calibration.fit_heads(table, model_config.num_kv_heads)


def default_cache_config(model_config, *, num_seqs: int, max_tokens: int, page_size: int | None = None,
                         token_budget: int = 2048, dtype=None, tp: int = 1, pool_headroom: float = 1.0,
                         **overrides) -> CacheConfig:
    """The cache sizing policy: `num_seqs` sequences of up to `max_tokens` tokens each over `tp` ranks, HBM frames
    for every sequence's whole token budget and host pages for every token (per rank: a rank caches only its own
    KV-head groups). page_size None: 64, or 16 when max_tokens <= 512 (short contexts keep more pages to choose
    from). pool_headroom: HBM frames per frame of one step's selections, at most one per page
    (cost_model.pool_headroom: PB-LRU's buckets hit only with headroom), rounded up to the slots the sieve scans
    anyway (`scanned_slots`). Selection: the library's default rule, label channels (select/labels.py:
    `default_channels(head_dim)` channels at DEFAULT_BITS bits: the table shipped for the model's weights file
    where ModelConfig.file_sha256 finds one (`shipped_table`), else calibrated online from each prompt's first
    tokens), where `overrides` name no key_channels or selection rule (key_channels=0: Quest;
    key_channels=C alone: the key copy in the model's dtype). `overrides` replace any CacheConfig field."""
    mc = model_config
    if page_size is None:
        page_size = 64 if max_tokens > 512 else 16
    pages = bucket_pages(math.ceil(max_tokens / page_size))
    budget = min(token_budget, pages * page_size)
    num_groups = mc.num_kv_heads if mc.num_kv_heads <= 16 else 16
    if num_groups % tp:
        raise ValueError(f"tp = {tp} must divide the cache's {num_groups} KV-head groups (num_kv_heads = "
                         f"{mc.num_kv_heads}); with more ranks than KV heads replicate them first "
                         "(tp.prepare_model)")
    groups = num_groups // tp
    every_page = num_seqs * mc.num_layers * groups * pages
    # pages a (sequence, group) selects a step (CacheConfig.shortlist_pages; the config does not exist yet)
    step_pages = CacheConfig.step_pages(budget // page_size, int(overrides.get("token_shortlist") or 0))
    frames_needed = min(math.ceil(pool_headroom * num_seqs * mc.num_layers * groups * step_pages), every_page)
    # one sieve call = one layer of a decode step: the largest buckets that keep the Pallas sieve on its fast path
    requests = num_seqs * groups * step_pages
    buckets, slots = sieve_geometry(frames_needed, requests)
    # the sieve scans a bucket in whole slot chunks (a power of two), so the slots up to the chunk's end cost it
    # nothing: the pool takes them (more hits for HBM alone), at most one frame per page
    slots = pool_slots(buckets, slots, requests, every_page)   # >= slots: frames_needed <= every_page
    kw = dict(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
              kv_heads_per_group=mc.num_kv_heads // num_groups,
              max_seqs=num_seqs, max_pages_per_seq=pages, page_size=page_size,
              dtype=jnp.dtype(dtype or "float32").name, num_buckets=buckets, slots_per_bucket=slots,
              host_pages=every_page, token_budget=budget,
              sink_pages=min(1, budget // page_size), recent_pages=min(2, max(0, budget // page_size - 1)), tp=tp)
    if "key_channels" not in overrides and overrides.get("selection") is None:
        kw.update(key_channels=labels.default_channels(mc.head_dim), label_bits=labels.DEFAULT_BITS)
        if "channel_table" not in overrides:
            kw["channel_table"] = shipped_table(mc, kw["key_channels"])
    kw.update(overrides)
    return CacheConfig(**kw)


@dataclasses.dataclass
class PrefillProgress:
    """A prompt being prefilled into `slot` (Generator.begin_prefill / prefill_next), whole or in chunks across
    calls: `done` of its tokens have their K/V in the cache (first the `shared` pages of a stored prefix, attached
    at admission; then the chunks computed), always a whole number of pages until the prompt is complete.
    src [shared]: dense only, the slot whose HBM rows hold each shared page (None for sparse)."""
    slot: int
    prompt: list[int]
    done: int
    shared: int = 0
    src: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.done >= len(self.prompt)

    @property
    def remaining(self) -> int:
        return len(self.prompt) - self.done


def check_model_fits_cache(model_config, config: CacheConfig) -> None:
    """The clear error for a model whose shape, head split or attention the cache cannot serve."""
    mc, c = model_config, config
    for name, a, b in (("num_layers", c.num_layers, mc.num_layers), ("num_kv_heads", c.num_kv_heads, mc.num_kv_heads),
                       ("head_dim", c.head_dim, mc.head_dim)):
        if a != b:
            raise ValueError(f"cache_config.{name} = {a} does not match the model's {b}"
                             + (" (more ranks than KV heads? see tp.prepare_model)" if name == "num_kv_heads" else ""))
    for name, n in (("num_heads", mc.num_heads), ("intermediate_size", mc.intermediate_size)):
        if n % c.tp:
            raise ValueError(f"tp = {c.tp} must divide the model's {name} = {n}")
    if getattr(mc, "sliding_window", None) is not None and c.max_context > mc.sliding_window:
        raise ValueError(f"model uses a sliding window of {mc.sliding_window} tokens; the cache's max context "
                         f"{c.max_context} exceeds it and sliding-window attention is not implemented in the cache")


@jax.jit
def _accumulate(total: LayerStats, per_rank: LayerStats, chunk: LayerStats):
    """chunk: one decode chunk's LayerStats, [R] per rank -> (total summed over ranks, per rank)."""
    return total + jax.tree.map(lambda a: a.sum().astype(jnp.int32), chunk), per_rank + chunk


class Generator:
    """Prefill and decode for one model, one cache (attention 'sparse' = UlaCache, 'dense' = every K/V in HBM,
    'auto' = the one cost_model.resolve_attention picks for this cache and device, or a cost_model.Decision made
    for it) and one mesh of `cache_config.tp` devices; reusable across requests. `decision` says which kind runs
    and why. `stats` sums the decode's LayerStats over ranks, `rank_stats` keeps them per rank ([R] arrays)."""

    def __init__(self, model, cache_config: CacheConfig, *, attention: str = "sparse",
                 options: DecodeOptions = DecodeOptions(), mesh: Mesh | None = None):
        c = cache_config
        mesh = make_mesh(c.tp) if mesh is None else mesh
        if mesh.shape.get(TP_AXIS) != c.tp:
            raise ValueError(f"mesh axis {TP_AXIS!r} has {mesh.shape.get(TP_AXIS)} devices, cache_config.tp = {c.tp}")
        check_model_fits_cache(model.config, c)
        self._build(model.config, model.dtype, tp_graphdef(model), shard_params(nnx.split(model)[1], mesh), c,
                    attention, options, mesh)

    def sibling(self, cache_config: CacheConfig, *, attention: str) -> "Generator":
        """A Generator of this one's model over another cache (same mesh and options): the graphdef and the placed
        parameters are shared, not copied, so a second cache of the same model (exact mode's sparse drafter,
        speculative/decoder.py) costs its cache's memory only."""
        if cache_config.tp != self.config.tp:
            raise ValueError(f"sibling cache_config.tp = {cache_config.tp} must be this generator's {self.config.tp}")
        check_model_fits_cache(self.model_config, cache_config)
        gen = object.__new__(Generator)
        gen._build(self.model_config, self._dtype, self._graphdef, self.params, cache_config, attention,
                   self.options, self.mesh)
        return gen

    def _build(self, model_config, dtype, graphdef, params, c: CacheConfig, attention, options, mesh) -> None:
        """The constructor's body over a model's parts (config, dtype, graphdef, params placed on `mesh`)."""
        self.model_config, self.config, self.options, self.mesh = model_config, c, options, mesh
        self._dtype, self._graphdef = dtype, graphdef
        # 'auto' is resolved here, once: the backend, the program and the reports see only the kind it became
        self.decision = resolve_attention(attention, model_config, c, mesh.devices.flat[0])
        attention = self.decision.kind
        self.backend = make_backend(attention, c, mesh, options, query_dtype=dtype,
                                    query_heads_per_kv=model_config.num_queries_per_kv)
        self.params = params
        self.layer_params = [self.params["layers"][l] for l in range(c.num_layers)]
        specs = param_specs(self.params)
        cache_spec, host_spec, host_sh = self.backend.specs()
        view_spec, view_sh = self.backend.view_specs()
        self.program = program(graphdef, layer_graphdef(graphdef, self.params), self.backend.ops, c, mesh, specs,
                               specs["layers"][0], cache_spec, host_spec, host_sh, view_spec, view_sh)
        self._decode = self.program.decode
        self.replicated = NamedSharding(mesh, P())   # where host-made inputs go (the speculative step places its own)
        self.reset_stats()
        self.prefixes = None     # shared prefixes (prefix_cache.py): off here, on by default in the Engine

    def reset_stats(self) -> None:
        """Zero `stats` and `rank_stats`, placed as the decode programs return them (replicated; [R] over the
        mesh), so that `add_stats` compiles once: zeros of another placement would compile it again on the next
        chunk, ~40 ms of host time inside the first timed chunks."""
        R = self.config.tp
        self.stats = jax.device_put(LayerStats.zeros(), self.replicated)
        self.rank_stats = jax.device_put(jax.tree.map(lambda z: jnp.zeros(R, jnp.int32), LayerStats.zeros()),
                                         NamedSharding(self.mesh, P(TP_AXIS)))

    def add_stats(self, chunk: LayerStats) -> None:
        """Add one decode program's LayerStats ([R] per rank) to `stats` (summed over ranks) and `rank_stats`."""
        self.stats, self.rank_stats = _accumulate(self.stats, self.rank_stats, chunk)

    def set_prefix_cache(self, on: bool, budget_pages: int | None = None) -> None:
        """Turn shared prefixes on (prompts sharing complete pages with a stored prompt attach them instead of
        prefilling them; stored prompts keep at most `budget_pages` host pages, None = as long as the pool has
        room) or off (the stored prefixes are dropped). Call it with no sequence admitted. Refused where the
        selection rule says so (SelectionRule.prefix_sharing); a rule that calibrates on a prompt's first N
        tokens gets only prefixes that cover them (SelectionRule.calibration_tokens), so outputs never depend on
        what other prompts stored."""
        why = self.config.selection_rule.prefix_sharing(self.config)
        if on and why:
            raise ValueError(why)
        if self.prefixes is not None:
            self.prefixes.close()
        self.prefixes = self.backend.prefixes(budget_pages) if on else None

    def prefix_stats(self):
        """prefix_cache.PrefixStats of this generator's shared prefixes (zeros when off)."""
        return dataclasses.replace(self.prefixes.index.stats) if self.prefixes is not None else PrefixStats()

    @property
    def attention(self) -> str:
        """'sparse' or 'dense': the backend's kind (for reports; `decision` says why)."""
        return self.backend.kind

    @property
    def cache(self):
        """The sparse backend's CacheManager (state, host pool, allocator); None for dense."""
        return getattr(self.backend, "manager", None)

    # the dense backend's arrays, by the names benchmark scripts fill them under
    @property
    def dense(self) -> DenseCache:
        return self.backend.dense

    @dense.setter
    def dense(self, value: DenseCache):
        self.backend.dense = value

    @property
    def dense_len(self):
        return self.backend.length

    @dense_len.setter
    def dense_len(self, value):
        self.backend.length = value

    # ---- slots ------------------------------------------------------------------------------------------------
    def request_error(self, num_tokens: int) -> str | None:
        """Why a sequence of num_tokens tokens (prompt + new) can never be admitted, else None."""
        return self.backend.request_error(num_tokens)

    def admit(self, num_tokens: int, prompt=None) -> int:
        """A slot (and host pages) for a sequence of up to num_tokens tokens; sequences.CapacityError if full. With
        shared prefixes on, `prompt` (the ids `prefill` will get) attaches its stored prefix."""
        slot = self.prefixes.admit(num_tokens, prompt) if self.prefixes is not None else None
        return self.backend.admit(num_tokens) if slot is None else slot

    def release(self, slot: int) -> None:
        self.backend.release(slot)
        if self.prefixes is not None:
            self.prefixes.released(slot)

    # ---- prefill and decode -------------------------------------------------------------------------------------
    def prefill(self, slot: int, prompt: list[int]):
        """Prefill one admitted slot, layer by layer through one compiled layer program; -> last-position logits
        [V]. With shared prefixes on, the prompt's stored prefix is attached (or, dense, copied) and only the rest
        is computed; its complete pages are stored for later prompts. (A prompt whose power-of-two bucket would
        reach past the context goes in two or more chunks: `chunk_end`.)"""
        job = self.begin_prefill(slot, prompt)
        while True:
            logits = self.prefill_next(job)
            if job.finished:
                return logits

    def begin_prefill(self, slot: int, prompt: list[int]) -> PrefillProgress:
        """Start the prefill of an admitted slot: its stored prefix (shared prefixes on) is attached and counted
        as done; `prefill_next` computes the rest, whole or a chunk at a time."""
        m, src = self.prefixes.sources(slot, prompt) if self.prefixes is not None else (0, None)
        return PrefillProgress(slot, list(prompt), m * self.config.page_size, m, src)

    def chunk_end(self, start: int, length: int, max_tokens: int | None = None) -> int:
        """Where a prefill chunk starting at token `start` (page-aligned) of a `length`-token prompt ends: the
        prompt's end where the rest fits in `max_tokens` (None: no limit) and its bucket fits the context, else
        max_tokens tokens, or, where the last bucket would reach past the context (the ingest would clamp onto
        earlier pages), the largest power of two of pages the rest holds (no padding)."""
        c = self.config
        rest = length - start
        if max_tokens is not None and rest > max_tokens:
            return start + max_tokens
        if start + bucket_length(rest, c.page_size) <= c.max_context:
            return length
        return start + (1 << (rest // c.page_size).bit_length() - 1) * c.page_size

    def prefill_next(self, job: PrefillProgress, max_tokens: int | None = None):
        """Prefill the next chunk of `job`: up to `max_tokens` tokens (None: the whole rest; else a power of two
        times page_size, so chunks reuse the compiled buckets), whole pages unless it ends the prompt -> the last
        position's logits [V] once the prompt is complete, else None.

        A chunk starting at token s > 0 attends to tokens [0, s) through the shared-prefix path (program
        `prefill_layer_from`, prefix_cache.prefix_attention over [earlier tokens | chunk]): their K/V are read back,
        every layer, from where the earlier chunks wrote them. Sparse: from the host pool (every complete page is
        written through at ingestion and the earlier chunks end on page boundaries), so the chunk moves s x
        num_layers x num_kv_heads x head_dim x 2 (K and V) x dtype bytes over PCIe host to device, and the
        selection rule's page state of those pages is recomputed from them (the values ingestion wrote); a prompt
        of n tokens in chunks of C moves about n^2 / (2 C) tokens' K/V in all. Dense: from the slot's own HBM rows
        (no PCIe). Tokens equal a whole prefill's up to the order of the attention's float sums (the prefix cache's
        exactness)."""
        c = self.config
        if max_tokens is not None and (max_tokens < c.page_size or max_tokens % c.page_size
                                       or (max_tokens // c.page_size) & (max_tokens // c.page_size - 1)):
            raise ValueError(f"max_tokens = {max_tokens} must be page_size = {c.page_size} times a power of two")
        n, start = len(job.prompt), job.done
        if start >= n:
            raise ValueError(f"slot {job.slot}: its prompt of {n} tokens is already prefilled")
        end = self.chunk_end(start, n, max_tokens)
        # the slot holding each earlier page (dense reads them from there; sparse only from the host pool): the
        # shared pages' sources, then the slot itself for its own earlier chunks
        src = np.full(start // c.page_size, job.slot, np.int32)
        if job.src is not None:
            src[:job.shared] = job.src
        logits = self._prefill_range(job.slot, job.prompt[:end], start, src, end == n)
        job.done = end
        if end < n:
            return None
        if self.prefixes is not None:
            st = self.prefixes.index.stats
            st.hit_tokens += job.shared * c.page_size
            st.prefill_tokens += n - job.shared * c.page_size
            st.hits += job.shared > 0
            st.saved_host_pages += self.prefixes.saved_host_pages(job.shared)
            self.prefixes.stored(job.slot, job.prompt, job.shared, job.src)
        return logits

    def _prefill_range(self, slot: int, tokens: list[int], start: int, src, want_logits: bool):
        """Prefill tokens [start, len(tokens)) of a slot whose first `start` tokens (whole pages) are in the cache
        (a shared prefix, earlier chunks; src [start / page_size]: the slot holding each of those pages, read by
        the dense backend); the sequence's length becomes len(tokens) -> the last token's logits [V] if want_logits,
        else None."""
        c = self.config
        n = len(tokens)
        prog, b = self.program, self.backend
        if start:
            T = bucket_length(n - start, c.page_size)
            if start + T > c.max_context:    # the sparse ingest would clamp its slices onto the shared pages
                raise ValueError(f"shared prefix of {start // c.page_size} pages leaves a {T}-token prefill bucket "
                                 f"past the max context {c.max_context} (prefix_cache.max_shared_pages must allow at "
                                 f"most the pages that fit)")
            Tp = prefix_bucket(start // c.page_size, c.max_pages_per_seq) * c.page_size
            per_tok = np.zeros(Tp, np.int32)
            if src is not None:
                per_tok[:start] = np.repeat(src, c.page_size)
            ids = jax.device_put(np.pad(np.asarray(tokens[start:], np.int32), (0, T - (n - start))), self.replicated)
            args = jax.device_put((np.int32(start), per_tok), self.replicated)
            x = prog.embed(self.params, ids)
            for l, lp in enumerate(self.layer_params):
                view, x = prog.prefill_layer_from(lp, b.layer_view(l), x, slot, l, n, *args)
                b.set_layer_view(l, view)
        else:
            T = bucket_length(n, c.page_size)
            # committed like the layers' outputs, so every layer call hits the one compiled program
            ids = jax.device_put(np.pad(np.asarray(tokens, np.int32), (0, T - n)), self.replicated)
            x = prog.embed(self.params, ids)
            for l, lp in enumerate(self.layer_params):
                view, x = prog.prefill_layer(lp, b.layer_view(l), x, slot, l, n)
                b.set_layer_view(l, view)
        b.prefill_done(slot, n)
        return prog.logits(self.params, x, n - start) if want_logits else None

    def decode_chunk(self, tok, done, remaining, keys, sampling, stop_ids, *, steps: int | None = None,
                     phase=None):
        """One jitted chunk of `steps` steps (None: page_size; else a power of two up to it) for every slot. keys
        [S]: one PRNG key per slot (see sampling.row_keys). phase [S] int32 (None: every slot at a flush point):
        each slot's decode steps since its last flush point; step i draws from fold_in(key, phase + i) and only
        the slots whose phase + steps reaches page_size flush (Program._decode), so a chunk shorter than a page
        leaves the tokens as they are. Returns (tokens [S, steps] with -1 where a slot produced nothing, done,
        remaining)."""
        out, done, remaining, _, _ = self.decode_chunk_with(tok, done, remaining, keys, sampling, stop_ids,
                                                           steps=steps, phase=phase)
        return out, done, remaining

    def decode_chunk_with(self, tok, done, remaining, keys, sampling, stop_ids, *, steps: int | None = None,
                          penalties=None, logprobs: bool = False, budget=None, phase=None):
        """`decode_chunk` with the sampling options that need their own program (Program.decode_steps):
        penalties a sampling.PenaltyState [S, V] (None = off; donated), logprobs whether to return the raw model
        logprobs, budget [S] int32 pages each slot selects (None = the config's select_pages for all), phase as
        `decode_chunk`'s. -> (tokens [S, steps], done, remaining, the updated PenaltyState or None, (logprob
        [S, steps], top_ids [S, steps, N], top_lp [S, steps, N]) or None)."""
        steps = self.config.page_size if steps is None else steps
        decode = self.program.decode_steps(steps, penalties=penalties is not None, logprobs=logprobs,
                                           budgets=budget is not None, phased=phase is not None)
        # host-made inputs replicated on the mesh like the previous chunk's outputs: one compile, not two
        args = (tok, done, remaining, keys, sampling, stop_ids) + \
            (() if phase is None else (jnp.asarray(phase, jnp.int32),))
        args = jax.device_put(args, self.replicated)
        extra = (() if penalties is None else (penalties,)) + \
            (() if budget is None else (jax.device_put(budget, self.replicated),))
        b = self.backend
        b.cache, b.host, out, done, remaining, stats, *rest = decode(self.params, b.cache, b.host, *args, *extra)
        self.add_stats(stats)
        pen = rest.pop(0) if penalties is not None else None
        lp = rest.pop(0) if logprobs else None
        return out, done, remaining, pen, lp

    def replay(self, tokens: dict[int, list[int]], budget=None) -> None:
        """Rebuild what decoding wrote: tokens {slot: ids} are fed through decode steps from each slot's current
        length (a prefilled prompt, at a flush point), page_size steps a round, every slot in the same rounds
        (Program._replay). budget [S] int32 pages each slot selects, or None, as the Engine's decode chunks take it
        (Slots.budgets). A slot ends at a flush point when its count is a multiple of page_size, else between two
        with phase = count % page_size."""
        if not tokens:
            return
        P, S = self.config.page_size, self.config.max_seqs
        bad = [s for s in tokens if not 0 <= s < S]
        if bad:
            raise ValueError(f"replay slots {bad} are outside the cache's {S} slots")
        rounds = max(-(-len(t) // P) for t in tokens.values())
        b = self.backend
        prog = self.program.replay(budget is not None)
        for k in range(rounds):
            forced = np.zeros((S, P), np.int32)                                         # [S, page_size]
            count = np.zeros(S, np.int32)                                               # [S]
            for s, ids in tokens.items():
                part = ids[k * P:(k + 1) * P]
                forced[s, :len(part)], count[s] = part, len(part)
            args = jax.device_put((forced, count) + (() if budget is None else (budget,)), self.replicated)
            b.cache, b.host = prog(self.params, b.cache, b.host, *args)

    def next_logits(self, tok) -> jax.Array:
        """Logits [S, V] of the token after `tok` [S] (each slot's last token) for every active slot, exactly as a
        decode step computes them; the cache is not advanced (checks, scoring)."""
        b = self.backend
        tok = jax.device_put(jnp.asarray(tok, jnp.int32), self.replicated)
        return self.program.next_logits(self.params, b.cache, b.host, tok)
