"""Continuous batching over a Generator's sequence slots: requests in, tokens streamed out.

One `step()`:
1. admit queued requests into free slots (FIFO) and prefill them; while other requests are decoding, at most
   `max_prefill_tokens_per_step` prompt tokens are prefilled per step (at least one prompt), so running requests
   keep producing tokens between prefills; when nothing is decoding, every free slot is filled at once;
2. one decode chunk (`page_size` steps, one host sync) for every running request; when every running request
   needs fewer tokens, the chunk runs only the next power of two >= the most any of them needs (short answers
   pay for what they use; one compiled program per power of two);
3. finished requests (a stop id, max_new_tokens, or an error) release their slot and host pages at once, so the
   next step admits queued requests into them.
When the slots or the host pool are full (`CapacityError`), requests wait in the queue. A request that can never
fit (prompt + max_new_tokens past the context limit, more host pages than the whole pool, an empty prompt, a
token outside the vocabulary, bad sampling parameters) finishes at once with finish_reason "error" and a message;
the other requests are not affected.

Sampling parameters are per request (temperature, top_p, top_k, max_new_tokens, stop ids): the compiled decode
chunk takes per-slot SamplingArrays and per-slot remaining counts. Stop ids are matched on the host, per
request, when the chunk's tokens come back: the chunk itself is given no stop ids, so a request that stops
mid-chunk keeps decoding until the chunk ends (the fixed-length chunk computes every slot anyway) and its
tokens past the stop are dropped. (Giving the chunk the union of the running requests' stop ids would halt a request
at another request's stop id, and resuming it would shift where its later chunks, and so its page flushes,
fall; sparse attention depends on which pages are flushed (selected) or still in the tail ring (always
attended), so its tokens would depend on the other requests.) Every request's chunks start at its own prefill,
as in generate(), so greedy tokens do not depend on the batch. Seeds: every slot samples with its own key,
derived from the request's seed (or the engine seed and the request id) and the request's own chunk count
(`sampling.row_keys`), so a request's sampled tokens depend only on its seed, not on what shares its batch.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Iterator, Sequence

import numpy as np
import jax
import jax.numpy as jnp

from ulacache_jax.runtime import checkpoint
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.runtime.cost_model import pool_headroom
from ulacache_jax.cache.decode_layer import DecodeOptions
from ulacache_jax.runtime.generator import Generator, bucket_length, default_cache_config
from ulacache_jax.runtime import validate
from ulacache_jax.runtime.requests import ERROR, LENGTH, STOP, Request, RequestError, SamplingParams, StepOutput, StepRecord
from ulacache_jax.runtime.sampling import SamplingArrays, row_keys, sample
from ulacache_jax.runtime.sequences import CapacityError
from ulacache_jax.runtime.slots import SlotTable
from ulacache_jax.runtime.speculative.decoder import SpecDecoder
from ulacache_jax.runtime.text import apply_stop, encode_prompt
from ulacache_jax.runtime.tp import prepare_model

_NO_STOPS = 8  # the chunk's stop-id array: all -1 (never sampled), stops are matched on the host
_sample_first = jax.jit(sample)   # a request's first token, from its prefill logits [1, V]


class Engine:
    """Continuous-batching inference over one Generator (sparse UlaCache or the dense baseline).

    Engine(model, cache_config) builds the Generator; Engine(generator=gen) reuses a compiled one (its slots
    must all be free). Without a cache_config, one is made by `default_cache_config` for `max_seqs` sequences of
    up to `max_context` tokens (default: the model's max_position_embeddings, at most 4096) with `page_size` and
    `token_budget`, over `tp` local devices (the model's KV heads replicated where tp exceeds them). attention:
    'auto' (the default: chosen once, when the Generator is built, cost_model.resolve_attention), 'sparse' or
    'dense'; `attention` is the kind that runs, `gen.decision` why. kv_dtype: the K/V page format
    (CacheConfig.kv_dtype: "auto" or "float8_e4m3fn"), for the cache made here or replacing a given config's."""

    def __init__(self, model=None, cache_config: CacheConfig | None = None, *, generator: Generator | None = None,
                 attention: str = "auto", options: DecodeOptions = DecodeOptions(), max_seqs: int = 4,
                 max_context: int | None = None, page_size: int = 64, token_budget: int = 2048, tp: int = 1,
                 seed: int = 0, max_prefill_tokens_per_step: int | None = None, tokenizer=None, prefix_cache=None,
                 clock=time.perf_counter, speculative=None, kv_dtype: str = "auto"):
        if (model is None) == (generator is None):
            raise ValueError("give exactly one of model or generator")
        if generator is None:
            if cache_config is None:
                model = prepare_model(model, tp)
                mc = model.config
                ctx = max_context or min(mc.max_position_embeddings, 4096)
                cache_config = default_cache_config(mc, num_seqs=max_seqs, max_tokens=ctx, page_size=page_size,
                                                    token_budget=token_budget, dtype=model.dtype, tp=tp,
                                                    pool_headroom=pool_headroom(attention), kv_dtype=kv_dtype)
            else:
                model = prepare_model(model, cache_config.tp)
                if kv_dtype != "auto":
                    cache_config = dataclasses.replace(cache_config, kv_dtype=kv_dtype)
            if speculative is not None:
                # a verification attends 1 + K rows per sequence in one call: stage their overflow pages too
                cache_config = dataclasses.replace(cache_config, verify_rows=max(cache_config.verify_rows,
                                                                                 speculative.num_tokens + 1))
            generator = Generator(model, cache_config, attention=attention, options=options)
        self.gen = generator
        # shared prefixes (prefix_cache.py), on by default (None) unless the selection rule refuses them (the key
        # copy: they would change its channels; Generator.set_prefix_cache): prompts that start with the complete
        # pages of a stored prompt attach them instead of prefilling them; prefix_cache=False prefills every
        # prompt whole
        if prefix_cache is None:
            prefix_cache = generator.config.selection_rule.prefix_sharing(generator.config) is None
        if bool(prefix_cache) != (generator.prefixes is not None):
            generator.set_prefix_cache(bool(prefix_cache))
        self._prefix0 = generator.prefix_stats()
        # speculative decoding (speculative.SpecConfig, None = off): one verification per step instead of a chunk
        self.spec = None
        if speculative is not None:
            self.spec = SpecDecoder(generator, speculative)
        self.tokenizer = tokenizer
        self.default_stop_ids: tuple[int, ...] = tuple(getattr(tokenizer, "eos_ids", ()) or ())
        self.config: CacheConfig = generator.config
        self.vocab_size = generator.model_config.vocab_size
        c = self.config
        S = c.max_seqs
        if max_prefill_tokens_per_step is not None and max_prefill_tokens_per_step < 1:
            raise ValueError(f"max_prefill_tokens_per_step = {max_prefill_tokens_per_step} must be >= 1")
        self.max_prefill_tokens_per_step = max_prefill_tokens_per_step or c.max_context
        self.seed = validate.check_seed(seed)
        self.clock = clock
        self.t0 = clock()
        self.requests: dict[int, Request] = {}
        self._queue: collections.deque[int] = collections.deque()
        self._pending: list[StepOutput] = []          # requests that failed at add_request, reported next step
        self._next_id = 0
        # per-slot decode inputs and the request holding each slot, host side (slots.py; public: the speculative
        # step and the checkpoint use it)
        self.slots = SlotTable.empty(S)
        self._chunks = 0
        self._seen_buckets: set[int] = set()
        self._seen_steps: set[int] = set()
        self.no_stops = jnp.full(_NO_STOPS, -1, jnp.int32)   # the chunk's stop ids: none (matched on the host)
        self.timeline: list[StepRecord] = []
        self._stats0 = self._stats_now()
        self._identity: dict | None = None

    @property
    def attention(self) -> str:
        """'sparse' or 'dense': the attention this engine decodes with ('auto' resolved by its Generator)."""
        return self.gen.attention

    # ---- requests ------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids, sampling: SamplingParams | None = None) -> int:
        """Queue a request -> its id. prompt_ids: token ids, or (with the engine's tokenizer) text or chat
        messages (text.encode_prompt). A request that can never run finishes at once with finish_reason "error"
        (reported by the next step); it does not raise."""
        sampling = sampling or SamplingParams()
        if sampling.stop_ids is None:
            sampling = dataclasses.replace(sampling, stop_ids=self.default_stop_ids)
        rid = self._next_id
        self._next_id += 1
        now = self.clock()
        try:
            try:
                prompt_ids = encode_prompt(prompt_ids, self.tokenizer)
            except ValueError as e:
                raise RequestError(str(e)) from None
            prompt = self._check_prompt(prompt_ids)
        except RequestError as e:
            prompt = []
            err = str(e)
        else:
            err = None
        req = Request(rid, prompt, sampling, t_added=now)
        self.requests[rid] = req
        if err is None:
            try:
                sampling.check(self.vocab_size)
                req.max_new_tokens, req.capped = self._fit(len(prompt), int(sampling.max_new_tokens))
            except RequestError as e:
                err = str(e)
        if err is not None:
            self.finish(req, ERROR, error=err)
            self.report(StepOutput(rid, (), True, ERROR, err))
        else:
            self._queue.append(rid)
        return rid

    def _check_prompt(self, prompt_ids) -> list[int]:
        """validate.check_prompt (the one prompt check of generate, the Engine and the CLI), its TypeError or
        ValueError as this request's RequestError."""
        try:
            return validate.check_prompt(prompt_ids, self.vocab_size, name="prompt_ids")
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from None

    def _fit(self, n_prompt: int, max_new: int) -> tuple[int, bool]:
        """-> (effective max_new_tokens, capped). The cache holds prompt + max_new_tokens tokens per sequence."""
        c = self.config
        limit = c.max_context
        if n_prompt + 1 > limit:
            raise RequestError(f"prompt of {n_prompt} tokens does not fit the context limit of {limit} tokens "
                               f"(max_pages_per_seq {c.max_pages_per_seq} x page_size {c.page_size}) with room for "
                               f"one generated token")
        eff = min(max_new, limit - n_prompt)
        err = self.gen.request_error(n_prompt + eff)
        if err is not None:
            raise RequestError(f"prompt of {n_prompt} + {eff} new tokens: {err}")
        return eff, eff < max_new

    def get(self, request_id: int) -> Request:
        return self.requests[request_id]

    def pop(self, request_id: int) -> Request:
        """Forget a finished request (long batches: keeps the engine's memory flat)."""
        req = self.requests[request_id]
        if not req.finished:
            raise ValueError(f"request {request_id} is {req.status}, not finished")
        return self.requests.pop(request_id)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return len(self.slots.request_of)

    @property
    def queued_ids(self) -> list[int]:
        """The queued requests' ids, first to be admitted first."""
        return list(self._queue)

    @property
    def pending_ids(self) -> list[int]:
        """Ids of requests that finished outside a step (errors at add_request, aborts), reported by the next step."""
        return [ev.request_id for ev in self._pending]

    @property
    def next_id(self) -> int:
        """The id the next add_request gives."""
        return self._next_id

    def reserve_ids(self, next_id: int) -> None:
        """Ids below `next_id` are taken (a restored checkpoint's): add_request gives none of them."""
        self._next_id = max(self._next_id, next_id)

    def enqueue(self, request_id: int) -> None:
        """Queue a request already in `requests` (a restored one) behind those queued."""
        self._queue.append(request_id)

    def report(self, event: StepOutput) -> None:
        """A request that finished outside a step: the next step reports it."""
        self._pending.append(event)

    def has_unfinished(self) -> bool:
        return bool(self._queue or self.slots.request_of or self._pending)

    # ---- the step ------------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Admit + prefill queued requests into free slots, then one decode chunk for everything running.
        -> one StepOutput per request that produced tokens or finished in this step."""
        rec = StepRecord(len(self.timeline), self.clock() - self.t0)
        new: dict[int, list[int]] = collections.OrderedDict()
        ended: dict[int, None] = {}
        for ev in self._pending:
            ended[ev.request_id] = None
        self._pending = []
        self._admit_and_prefill(rec, new, ended)
        if self.slots.any_running():
            if self.spec is not None:
                self.spec.decode(self, rec, new, ended)
            else:
                self._decode(rec, new, ended)
        rec.t_end = self.clock() - self.t0
        rec.queued, rec.running = len(self._queue), len(self.slots.request_of)
        rec.finished = len(ended)
        if rec.prefills or rec.decode_steps or ended:
            self.timeline.append(rec)
        outs = []
        for rid in list(new) + [r for r in ended if r not in new]:
            req = self.requests[rid]
            fin = req.finished
            outs.append(StepOutput(rid, tuple(new.get(rid, ())), fin, req.finish_reason if fin else None,
                                   req.error if fin else None))
        return outs

    def release(self, slot: int) -> None:
        """Free `slot` (its request has ended or failed): its slot-table row, draft slot and cache pages."""
        self.slots.clear(slot)
        if self.spec is not None:
            self.spec.release(slot)
        self.gen.release(slot)

    def _admit_and_prefill(self, rec: StepRecord, new, ended) -> None:
        decoding = self.slots.any_running()
        used = 0
        while self._queue:
            req = self.requests[self._queue[0]]
            if decoding and used and used + len(req.prompt_ids) > self.max_prefill_tokens_per_step:
                break
            try:
                slot = self.gen.admit(len(req.prompt_ids) + req.max_new_tokens, req.prompt_ids)
            except CapacityError as e:
                if not self.slots.request_of:   # nothing will free anything: add_request's checks should prevent this
                    raise RuntimeError(f"request {req.request_id} cannot be admitted into an empty cache: {e}") from e
                break                                   # wait for a slot / host pages to be released
            self._queue.popleft()
            req.slot, req.status, req.t_admitted = slot, "running", self.clock()
            self.slots.request_of[slot] = req.request_id
            used += len(req.prompt_ids)
            bucket = bucket_length(len(req.prompt_ids), self.config.page_size)
            rec.prefill_compiled |= bucket not in self._seen_buckets
            self._seen_buckets.add(bucket)
            t0 = self.clock()
            try:
                logits = self.gen.prefill(slot, req.prompt_ids)
                if self.spec is not None:
                    self.spec.prefill(slot, req.prompt_ids, len(req.prompt_ids) + req.max_new_tokens)
                sp = req.sampling
                # a request's draws depend only on its own seed: the first from counter 2**31 - 1, decode chunk n
                # from counter n (sampling.row_keys), whatever else shares the batch
                seed = (int(sp.seed) if sp.seed is not None else self.seed * 1_000_003 + req.request_id) % 2**32
                self.slots.seed[slot], self.slots.chunk[slot] = seed, 0
                key = row_keys(jnp.asarray([seed], jnp.uint32), jnp.asarray([2**31 - 1], jnp.uint32))
                first = int(_sample_first(logits[None], key,
                                               SamplingArrays.fill(1, float(sp.temperature), float(sp.top_p),
                                                                   int(sp.top_k)))[0])
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
                rec.prefill_s += self.clock() - t0
                self.release(slot)
                self.finish(req, ERROR, error=f"prefill failed: {type(e).__name__}: {e}")
                ended[req.request_id] = None
                continue
            now = self.clock()
            rec.prefill_s += now - t0
            rec.prefills += 1
            rec.prefill_tokens += len(req.prompt_ids)
            req.tokens.append(first)
            req.t_first_token = now
            req.deliveries.append((now, 1, rec.index))
            new.setdefault(req.request_id, []).append(first)
            if first in req.sampling.stop_ids or self._stop_string(req, [])[1]:
                self.finish(req, STOP)
            elif req.max_new_tokens <= 1:
                self.finish(req, LENGTH)
            else:
                self.slots.start(slot, first, req.max_new_tokens - 1, sp)
                continue
            self.release(slot)
            ended[req.request_id] = None

    def _stats_now(self) -> tuple[int, int, int, int]:
        st = jax.device_get(self.gen.stats)
        return int(st.hits), int(st.misses), int(st.overflow), int(st.fetched)

    def _decode(self, rec: StepRecord, new, ended) -> None:
        c, sl = self.config, self.slots
        rec.live_slots = int((~sl.done).sum())
        sampling = sl.sampling_arrays()
        keys = sl.keys()
        # a last chunk runs only the steps its requests can use: the longest remaining, up to a power of two
        steps = min(c.page_size, bucket_length(int(sl.remaining[~sl.done].max()), 1))
        rec.decode_compiled = steps not in self._seen_steps
        self._seen_steps.add(steps)
        t0 = self.clock()
        try:
            out, done, remaining = self.gen.decode_chunk(jnp.asarray(sl.tok), jnp.asarray(sl.done),
                                                         jnp.asarray(sl.remaining), keys, sampling, self.no_stops,
                                                         steps=steps)
            out = np.asarray(out)
            done, remaining = np.asarray(done).copy(), np.asarray(remaining).copy()
        except Exception as e:
            # the cache state was donated to the failed call: every running request is lost with it
            msg = f"decode failed: {type(e).__name__}: {e}"
            for slot, rid in list(sl.request_of.items()):
                self.finish(self.requests[rid], ERROR, error=msg)
                ended[rid] = None
                sl.request_of.pop(slot)
            raise
        now = self.record_chunk(rec, t0, steps)
        for slot, rid in list(sl.request_of.items()):
            if sl.done[slot]:
                continue
            sl.remaining[slot] = remaining[slot]
            # only a stop id (matched here) or the length ends a slot
            self.deliver(rec, slot, [int(t) for t in out[slot] if t >= 0], new, ended, now)

    def deliver(self, rec: StepRecord, slot: int, got: list[int], new, ended, now: float) -> bool:
        """A slot's new tokens `got` (a decode chunk's, or a verification's accepted ones) to the request holding
        it (`_deliver`: cut at a stop id or stop string, recorded in the step's `new`); where that ends the request
        (STOP, LENGTH) it finishes, its slot is released and its id goes into the step's `ended` -> whether it
        ended. The slot's remaining budget must already count these tokens."""
        rid = self.slots.request_of[slot]
        req = self.requests[rid]
        reason = self._deliver(rec, req, slot, got, new, now)
        if reason is None:
            return False
        self.finish(req, reason)
        self.release(slot)
        ended[rid] = None
        return True

    def _deliver(self, rec: StepRecord, req: Request, slot: int, got: list[int], new, now: float) -> str | None:
        """Commit a slot's new tokens `got` (a decode chunk's, or a verification's accepted ones) to its request:
        cut at the first stop id or stop string (tokens the step produced past it are dropped), recorded in the
        step's `new` and the slot's last token -> the finish reason (STOP, LENGTH), or None while it runs on.
        The slot's remaining budget must already count these tokens."""
        stop = next((i for i, t in enumerate(got) if t in req.sampling.stop_ids), None)
        if stop is not None:
            got = got[:stop + 1]
        got, hit = self._stop_string(req, got)
        if hit:
            stop = len(got)
        if got:
            rec.decode_tokens += len(got)
            req.tokens.extend(got)
            req.deliveries.append((now, len(got), rec.index))
            new.setdefault(req.request_id, []).extend(got)
            self.slots.tok[slot] = got[-1]
        if stop is not None:
            return STOP
        return LENGTH if self.slots.remaining[slot] <= 0 else None

    def _stop_string(self, req: Request, got: list[int]) -> tuple[list[int], bool]:
        """New tokens `got` of a request with stop strings -> (those kept, whether a stop string ended it): the
        fewest tokens whose text holds the first stop string; its text and stop string go on the request."""
        if not req.sampling.stop or self.tokenizer is None:
            return got, False
        text, kept, hit = apply_stop(req.tokens + got, self.tokenizer, req.sampling.stop)
        if hit is None:
            return got, False
        req.text, req.stop_reason = text, hit
        if len(kept) < len(req.tokens):      # the first token (already delivered) completed it
            del req.tokens[len(kept):]
        return kept[len(req.tokens):], True

    def finish(self, req: Request, reason: str, *, error: str | None = None) -> None:
        """End `req` with `reason` (and `error`); its text is decoded where the engine has a tokenizer. Its slot,
        if it holds one, is the caller's to release."""
        req.status, req.finish_reason, req.error = "finished", reason, error
        req.t_finished = self.clock()
        req.slot = None
        if self.tokenizer is not None and req.text is None and reason != ERROR:
            req.text = self.tokenizer.decode(req.tokens)

    def abort(self, request_id: int) -> None:
        """End a queued or running request now (finish_reason "stop"); its slot and host pages are freed at once."""
        req = self.requests[request_id]
        if req.finished:
            return
        if req.status == "queued":
            self._queue.remove(request_id)
        else:
            self.release(req.slot)
        self.finish(req, STOP)
        self.report(StepOutput(request_id, (), True, STOP, None))

    # ---- driving loops ------------------------------------------------------------------------------------
    def stream(self) -> Iterator[tuple[int, int]]:
        """(request_id, token) pairs, in arrival order, until every request added so far (and during the
        iteration) has finished. Requests that fail yield no tokens: check `get(id).finish_reason`."""
        while self.has_unfinished():
            for ev in self.step():
                for t in ev.new_tokens:
                    yield ev.request_id, t

    def stream_request(self, request_id: int) -> Iterator[int]:
        """The tokens of one request as they arrive, stepping the engine (and so every other request) as needed."""
        req = self.requests[request_id]
        i = 0
        while True:
            while i < len(req.tokens):
                yield req.tokens[i]
                i += 1
            if req.finished:
                return
            self.step()

    def run(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] | None = None
            ) -> list[Request]:
        """Add every prompt, step until all finish -> their Requests, in order (check finish_reason)."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"{len(sampling)} sampling params for {len(prompts)} prompts")
        ids = [self.add_request(p, s) for p, s in zip(prompts, sampling)]
        while any(not self.requests[i].finished for i in ids):
            self.step()
        return [self.requests[i] for i in ids]

    # ---- checkpoint ------------------------------------------------------------------------------------------
    @property
    def identity(self) -> dict:
        """What decides this engine's tokens (checkpoint.engine_identity: model config, weight digest, cache
        config, attention kind), computed on first use and kept: none of it changes over an engine's life."""
        if self._identity is None:
            self._identity = checkpoint.engine_identity(self)
        return self._identity

    def save(self, directory, *, meta: dict | None = None):
        """Checkpoint every request this engine holds (prompts, tokens, sampling, RNG state; not the cache) as a
        new step under `directory`, atomically (checkpoint.py) -> the step's folder. Call between steps."""
        return checkpoint.save(self, directory, meta=meta)

    def restore(self, directory, *, skip=()):
        """Resume the newest checkpoint under `directory` into this engine (no requests yet; same model, weights
        and cache config, else checkpoint.CheckpointMismatch naming the difference): running requests are
        re-prefilled and continue where they were. skip: request ids to leave out. -> the checkpoint.Checkpoint."""
        return checkpoint.restore(self, directory, skip=skip)

    # ---- accounting ------------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.clock() - self.t0

    def prefix_stats(self):
        """prefix_cache.PrefixStats of this engine's run: prompt tokens attached instead of prefilled, prompt tokens
        prefilled, host pages not allocated (zeros with prefix_cache=False)."""
        return self.gen.prefix_stats().minus(self._prefix0)

    def record_chunk(self, rec, t0, steps: int) -> float:
        """A decode chunk's timeline entry (cache counters since the last chunk's, time since t0, decode steps);
        the chunk counters advance (a sampled request's key is its seed and its chunk count) -> now."""
        now = self.clock()
        before = self._stats0
        self._stats0 = self._stats_now()
        rec.hits, rec.misses, rec.overflow, rec.fetched = (a - b for a, b in zip(self._stats0, before))
        rec.decode_s = now - t0
        rec.decode_steps = steps
        self._chunks += 1
        self.slots.chunk += 1
        return now

    def stats_totals(self) -> dict[str, int]:
        h, m, o, f = (sum(getattr(r, k) for r in self.timeline) for k in ("hits", "misses", "overflow", "fetched"))
        return {"hits": h, "misses": m, "overflow": o, "fetched": f}
