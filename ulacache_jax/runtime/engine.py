"""Continuous batching over a Generator's sequence slots: requests in, tokens streamed out.

One `step()`:
1. prefill: the next chunk goes to the prompt with the fewest tokens left, the queue's head (admitted into a free
   slot, FIFO, when it wins) competing with the prompts being prefilled in chunks, except that a prompt passed
   over in the previous step goes first (so a short prompt queued behind a 32K one starts within a step, and the
   long one still gets a chunk at least every other step). While other requests are decoding, at most
   `max_prefill_tokens_per_step` prompt tokens are prefilled per step (at least one prompt, or one chunk), so
   running requests keep producing tokens between prefills; when nothing is decoding, every free slot is filled
   at once and every prompt prefilled to its end.
   With `prefill_chunk_tokens` = C (page_size times a power of two; None = whole prompts), a prompt is
   prefilled C tokens (whole pages) at a time, and the per-step budget defaults to C: a prompt longer than that
   is prefilled across steps, a decode chunk of the running requests between its chunks, so their inter-token
   latency stays bounded by one chunk of prefill while a long prompt is admitted. A chunk attends to the earlier
   chunks' K/V read back from the cache (Generator.prefill_next: sparse, from the host pool, s x L x KV x D x 2
   x dtype bytes over PCIe for a chunk starting at token s; dense, from HBM); its tokens are a whole prefill's
   (up to the order of float sums in attention, as with shared prefixes). A selection rule that calibrates on a
   prompt's first N tokens (online label channels: SelectionRule.calibration_tokens) needs C >= N;
2. one decode chunk (`decode_chunk_steps` steps, default page_size; one host sync) for every running request:
   sampled tokens reach the caller, and a queued prompt starts its prefill, within that many steps (a server
   wants <= 8). When every running request needs fewer tokens, the chunk runs only the next power of two >= the
   most any of them needs (short answers pay for what they use; one compiled program per power of two). Flushes
   stay where page_size chunks put them: each slot flushes its completed tail pages every page_size steps from
   its own prefill, and step t of a request draws from its key of chunk t // page_size folded with t %
   page_size, so tokens (greedy or seeded) do not depend on the cadence;
3. finished requests (a stop id, max_new_tokens, or an error) release their slot and host pages at once, so the
   next step admits queued requests into them.
When the slots or the host pool are full (`CapacityError`), requests wait in the queue. A request that can never
fit (prompt + max_new_tokens past the context limit, more host pages than the whole pool, an empty prompt, a
token outside the vocabulary, bad sampling parameters) finishes at once with finish_reason "error" and a message;
the other requests are not affected.

Sampling parameters are per request (temperature, top_p, top_k, min_p, the penalties, max_new_tokens, stop ids,
logprobs, token_budget): the compiled decode chunk takes per-slot SamplingArrays and per-slot remaining counts.
The options that need more than that have programs of their own, run only for a chunk where some running request
uses them: penalties carry per-slot token counts [S, V] through the chunk (seeded from the prompt at admission),
logprobs return each step's raw model logprobs, token budgets below the engine's pass per-slot page budgets to the
selection (Program.decode_steps). Stop ids are matched on the host, per
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
from ulacache_jax.runtime.generator import Generator, PrefillProgress, bucket_length, default_cache_config
from ulacache_jax.runtime.prefix_cache import prefix_bucket
from ulacache_jax.runtime import validate
from ulacache_jax.runtime.requests import (ERROR, LENGTH, STOP, Request, RequestError, SamplingParams, StepOutput,
                                           StepRecord, TokenLogprob)
from ulacache_jax.runtime.sampling import MAX_LOGPROBS, PenaltyState, SamplingArrays, row_keys, sample_step
from ulacache_jax.runtime.sequences import CapacityError
from ulacache_jax.runtime.slots import SlotTable
from ulacache_jax.runtime.speculative.decoder import SpecDecoder
from ulacache_jax.runtime.speculative.rules import SpecConfig, target_attention
from ulacache_jax.runtime.text import apply_stop, encode_prompt
from ulacache_jax.runtime.tp import prepare_model

_NO_STOPS = 8  # the chunk's stop-id array: all -1 (never sampled), stops are matched on the host
# a request's first token, from its prefill logits [1, V] (its penalties see the prompt alone)
_sample_first = jax.jit(sample_step, static_argnames="num_top")


def as_token_logprobs(tokens, lp, top_ids, top_lp, k: int) -> list[TokenLogprob]:
    """One slot's tokens [n] and the program's raw logprobs (lp [n], top_ids / top_lp [n, MAX_LOGPROBS], host
    arrays) -> TokenLogprobs with the k best alternatives."""
    return [TokenLogprob(int(t), float(lp[j]), tuple((int(top_ids[j, i]), float(top_lp[j, i])) for i in range(k)))
            for j, t in enumerate(tokens)]


def _check_prefill_chunk(tokens: int | None, c: CacheConfig) -> int | None:
    """prefill_chunk_tokens: None, or page_size times a power of two (chunks reuse the compiled prefill
    buckets), at least the tokens the selection rule calibrates on (its first chunk holds them)."""
    if tokens is None:
        return None
    P = c.page_size
    if (isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < P or tokens % P
            or (tokens // P) & (tokens // P - 1)):
        raise ValueError(f"prefill_chunk_tokens = {tokens!r} must be page_size = {P} times a power of two "
                         f"({P}, {2 * P}, {4 * P}, ...) or None (whole prompts)")
    need = c.selection_rule.calibration_tokens(c)
    if tokens < need:
        raise ValueError(f"prefill_chunk_tokens = {tokens} is under the {need} tokens the selection rule "
                         f"({c.rule}) picks its label channels from, which a prompt's first chunk must "
                         f"hold: give at least {need}, or a channel table (CacheConfig.channel_table)")
    return int(tokens)


def _check_decode_chunk(steps: int | None, c: CacheConfig, speculative) -> int:
    """decode_chunk_steps: a power of two in [1, page_size] (None: page_size); page_size with speculative
    decoding, whose chunks keep their own flush points."""
    P = c.page_size
    if steps is None:
        return P
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 1 <= steps <= P \
            or steps & (steps - 1):
        raise ValueError(f"decode_chunk_steps = {steps!r} must be a power of two in [1, page_size = {P}]")
    if speculative is not None and steps != P:
        raise ValueError(f"decode_chunk_steps = {steps} must be page_size = {P} with speculative decoding (its "
                         "verification chunks run to their own flush points)")
    return int(steps)


class Engine:
    """Continuous-batching inference over one Generator (sparse UlaCache or the dense baseline).

    Engine(model, cache_config) builds the Generator; Engine(generator=gen) reuses a compiled one (its slots
    must all be free). Without a cache_config, one is made by `default_cache_config` for `max_seqs` sequences of
    up to `max_context` tokens (default: the model's max_position_embeddings, at most 4096) with `page_size` and
    `token_budget`, over `tp` local devices (the model's KV heads replicated where tp exceeds them). attention:
    'auto' (the default: chosen once, when the Generator is built, cost_model.resolve_attention), 'sparse' or
    'dense'; `attention` is the kind that runs, `gen.decision` why. kv_dtype: the K/V page format
    (CacheConfig.kv_dtype: "auto" or "float8_e4m3fn"), for the cache made here or replacing a given config's.

    Latency (module docstring, step): prefill_chunk_tokens (None: whole prompts) is the size of one prefill
    chunk, page_size times a power of two so chunks reuse the compiled buckets; max_prefill_tokens_per_step the
    prompt tokens a step prefills while others decode (default: one chunk when chunking, else the context). Two
    options because the first is a shape (it also sets how often a long prompt's earlier K/V are read back: a
    sparse prompt of n tokens moves about n^2 / (2 C) tokens' K/V over PCIe) and the second a latency budget (two
    chunks a step halve the steps a long prompt takes). decode_chunk_steps (a power of two <= page_size; default
    page_size) is how many decode steps run between host syncs: tokens reach the caller, and queued prompts get
    their turn, that often; it does not change tokens."""

    def __init__(self, model=None, cache_config: CacheConfig | None = None, *, generator: Generator | None = None,
                 attention: str = "auto", options: DecodeOptions = DecodeOptions(), max_seqs: int = 4,
                 max_context: int | None = None, page_size: int = 64, token_budget: int = 2048, tp: int = 1,
                 seed: int = 0, max_prefill_tokens_per_step: int | None = None, tokenizer=None, prefix_cache=None,
                 clock=time.perf_counter, speculative=None, prefill_chunk_tokens: int | None = None,
                 decode_chunk_steps: int | None = None, kv_dtype: str = "auto"):
        if (model is None) == (generator is None):
            raise ValueError("give exactly one of model or generator")
        if model is not None:
            validate.check_model(model, "Engine")
        tp = validate.check_tp_count(tp)
        validate.check_speculative(speculative, SpecConfig)
        if generator is None:
            attention = target_attention(speculative, attention)   # exact mode verifies with dense attention
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
        c = generator.config if generator is not None else cache_config
        # checked before anything is built or changed (set_prefix_cache below changes a given generator)
        if max_prefill_tokens_per_step is not None and max_prefill_tokens_per_step < 1:
            raise ValueError(f"max_prefill_tokens_per_step = {max_prefill_tokens_per_step} must be >= 1")
        self.prefill_chunk_tokens = _check_prefill_chunk(prefill_chunk_tokens, c)
        self.max_prefill_tokens_per_step = max_prefill_tokens_per_step or prefill_chunk_tokens or c.max_context
        self.decode_chunk_steps = _check_decode_chunk(decode_chunk_steps, c, speculative)
        if generator is None:
            generator = Generator(model, cache_config, attention=attention, options=options)
        self.gen = generator
        # shared prefixes (prefix_cache.py), on by default (None) unless the selection rule refuses them
        # (Generator.set_prefix_cache): prompts that start with the complete pages of a stored prompt attach them
        # instead of prefilling them; prefix_cache=False prefills every prompt whole
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
        S = c.max_seqs
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
        # slot -> the prompt being prefilled into it in chunks (admitted, its request "running", the slot not yet
        # decoding), oldest first: each step's chunks go to these and the queue's head by _admit_and_prefill's order
        self._prefilling: collections.OrderedDict[int, PrefillProgress] = collections.OrderedDict()
        self._passed_over: set[int] = set()    # slots of prompts that got no prefill chunk in the last step
        self._chunks = 0
        self._seen_buckets: set[tuple[int, int]] = set()     # (chunk bucket, earlier-tokens bucket) prefilled
        self._seen_steps: set[int] = set()
        self.no_stops = jnp.full(_NO_STOPS, -1, jnp.int32)   # the chunk's stop ids: none (matched on the host)
        self.timeline: list[StepRecord] = []
        self._stats0 = self._stats_now()
        self._identity: dict | None = None
        # the penalties' per-slot token counts and prompt masks [S, V] on the device (sampling.PenaltyState), made
        # when the first request with a penalty is admitted and carried (donated) through the chunks that need it
        self.penalties: PenaltyState | None = None
        self._step_logprobs: dict[int, list[TokenLogprob]] = {}   # this step's new logprobs, per request

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
                self._check_engine_options(sampling)
                req.max_new_tokens, req.capped = self._fit(len(prompt), int(sampling.max_new_tokens))
                self._check_budget(sampling, len(prompt), req.max_new_tokens)
            except RequestError as e:
                err = str(e)
        if err is not None:
            self.finish(req, ERROR, error=err)
            self.report(StepOutput(rid, (), True, ERROR, err))
        else:
            self._queue.append(rid)
        return rid

    def _check_engine_options(self, sp: SamplingParams) -> None:
        """The options this engine cannot serve for a request whose parameters are valid in themselves.
        Speculative decoding verifies drafts against the distribution `sampling.truncated_sorted` describes, which
        min-p is part of (exact); the penalties would need each verification row's counts to include the drafts
        before it, and the logprobs each accepted row's logits, which the verification programs do not carry:
        refused rather than approximated. Stop strings are matched on decoded text: without a tokenizer they could
        never match (refused, not silently ignored)."""
        if sp.stop and self.tokenizer is None:
            raise RequestError(f"stop strings {list(sp.stop)!r} need the engine's tokenizer to decode the text (build "
                               "the Engine with tokenizer=...), or use stop_ids")
        if self.spec is not None:
            if sp.penalized:
                raise RequestError("presence_penalty / frequency_penalty / repetition_penalty are not supported with "
                                   "speculative decoding (this engine has speculative=...): build the engine "
                                   "without it")
            if sp.logprobs is not None:
                raise RequestError(f"logprobs = {sp.logprobs} is not supported with speculative decoding (this "
                                   "engine has speculative=...): build the engine without it")

    def budget_pages(self, sp: SamplingParams) -> int:
        """Pages a step the request selects: its token_budget // page_size, 0 for the engine's budget (None, or
        attention 'sparse' / 'dense' without a budget: dense is the engine's budget covering the context)."""
        return 0 if sp.token_budget is None else int(sp.token_budget) // self.config.page_size

    def _check_budget(self, sp: SamplingParams, n_prompt: int, max_new: int) -> None:
        """A request's token_budget and attention against this engine: a budget is a multiple of page_size between
        the always-attended sink + recent pages and the engine's token_budget (the cap: the pool and the top-k are
        sized for it); 'dense' needs the cap to cover the request's whole context (then every page is selected);
        both need a sparse engine (a dense one attends every token; 'dense' is what it does), and a budget below
        the cap is refused with speculative decoding (its verifications select with the engine's budget)."""
        c = self.config
        cap, P = c.token_budget, c.page_size
        tb, kind = sp.token_budget, sp.attention
        if tb is None and kind is None:
            return
        if self.attention != "sparse":
            if kind == "dense" and tb is None:
                return
            raise RequestError(f"{'token_budget = %d' % tb if tb is not None else 'attention = %r' % kind} needs a "
                               f"sparse engine: this engine attends every token (attention = {self.attention!r})")
        if kind == "dense":
            ctx = n_prompt + max_new
            if cap < ctx:
                raise RequestError(f"attention = 'dense' needs the engine's token_budget ({cap}) >= the request's "
                                   f"context ({ctx} tokens: prompt {n_prompt} + max_new_tokens {max_new})")
            return
        if tb is None:
            return
        lo = (c.sink_pages + c.recent_pages) * P
        if tb > cap:
            raise RequestError(f"token_budget = {tb} exceeds the engine's token_budget {cap} (the cap)")
        if tb % P or tb < lo:
            raise RequestError(f"token_budget = {tb} must be a multiple of page_size = {P} and >= {lo} (the sink and "
                               f"recent pages, {c.sink_pages} + {c.recent_pages}, always attended)")
        if self.spec is not None and tb < cap:
            raise RequestError(f"token_budget = {tb} below the engine's {cap} is not supported with speculative "
                               "decoding (its verifications select with the engine's budget)")

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
    def prefilling_ids(self) -> list[int]:
        """Ids of the requests admitted and partly prefilled (chunked prefill; no token yet), oldest first: they
        hold a slot (a checkpoint queues them first again)."""
        return [self.slots.request_of[slot] for slot in self._prefilling]

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
        step_lp, self._step_logprobs = self._step_logprobs, {}
        for rid in list(new) + [r for r in ended if r not in new]:
            req = self.requests[rid]
            fin = req.finished
            toks = tuple(new.get(rid, ()))
            outs.append(StepOutput(rid, toks, fin, req.finish_reason if fin else None, req.error if fin else None,
                                   tuple(step_lp.get(rid, ())[:len(toks)])))
        return outs

    def release(self, slot: int) -> None:
        """Free `slot` (its request has ended or failed): its slot-table row, draft slot and cache pages."""
        self.slots.clear(slot)
        self._prefilling.pop(slot, None)
        self._passed_over.discard(slot)
        if self.spec is not None:
            self.spec.release(slot)
        self.gen.release(slot)

    def _admit_and_prefill(self, rec: StepRecord, new, ended) -> None:
        """The step's prefill work (module docstring, 1.): the next chunk goes to the prompt with the fewest tokens
        left, the queue's head (admitted when it wins) competing with the prompts being prefilled, except that a
        prompt passed over in the previous step goes first: a short prompt queued behind a long one starts
        within a step instead of after the long one's last chunk, and the long one still gets a chunk at least
        every other step."""
        decoding = self.slots.any_running()
        used, served, full = 0, set(), False

        def fits(n: int) -> bool:                      # the per-step budget, while others decode
            return not (decoding and used and used + min(n, self.prefill_chunk_tokens or n)
                        > self.max_prefill_tokens_per_step)

        while True:
            order = {slot: i for i, slot in enumerate(self._prefilling)}
            best = min(self._prefilling.values(), default=None,
                       key=lambda j: (j.slot not in self._passed_over, j.remaining, order[j.slot]))
            head = self.requests[self._queue[0]] if self._queue and not full else None
            if head is not None and (best is None or (best.slot not in self._passed_over
                                                      and len(head.prompt_ids) < best.remaining)):
                if not fits(len(head.prompt_ids)):
                    break
                job = self._admit(head, ended)
                if job is None:
                    full = True                         # wait for a slot / host pages; the admitted ones go on
                    continue
                if not job:
                    continue                            # it failed alone
            elif best is not None:
                if not fits(best.remaining):
                    break
                job = best
            else:
                break
            served.add(job.slot)
            used += self._prefill_chunk(rec, job, new, ended)
        self._passed_over = {slot for slot in self._prefilling if slot not in served}

    def _admit(self, req: Request, ended) -> PrefillProgress | bool | None:
        """Admit the first queued request into a slot and start its prefill -> its PrefillProgress (also kept in
        `_prefilling` until complete), None when the cache is full (it stays queued), False when it failed."""
        try:
            slot = self.gen.admit(len(req.prompt_ids) + req.max_new_tokens, req.prompt_ids)
        except CapacityError as e:
            if not self.slots.request_of:   # nothing will free anything: add_request's checks should prevent this
                raise RuntimeError(f"request {req.request_id} cannot be admitted into an empty cache: {e}") from e
            return None
        self._queue.popleft()
        req.slot, req.status, req.t_admitted = slot, "running", self.clock()
        self.slots.request_of[slot] = req.request_id
        try:
            job = self.gen.begin_prefill(slot, req.prompt_ids)
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
            self.release(slot)
            self.finish(req, ERROR, error=f"prefill failed: {type(e).__name__}: {e}")
            ended[req.request_id] = None
            return False
        self._prefilling[slot] = job
        return job

    def _prefill_chunk(self, rec: StepRecord, job: PrefillProgress, new, ended) -> int:
        """The next chunk of `job` (its whole rest without prefill_chunk_tokens); where that completes the prompt,
        its first token is sampled and the slot starts decoding -> prompt tokens prefilled (and attached)."""
        slot, c = job.slot, self.config
        req = self.requests[self.slots.request_of[slot]]
        start = job.done
        end = self.gen.chunk_end(start, len(job.prompt), self.prefill_chunk_tokens)
        shape = (bucket_length(end - start, c.page_size), start and prefix_bucket(start // c.page_size,
                                                                                  c.max_pages_per_seq))
        rec.prefill_compiled |= shape not in self._seen_buckets
        self._seen_buckets.add(shape)
        t0 = self.clock()
        try:
            logits = self.gen.prefill_next(job, self.prefill_chunk_tokens)
            if job.finished:
                if self.spec is not None:
                    self.spec.prefill(slot, req.prompt_ids, len(req.prompt_ids) + req.max_new_tokens)
                sp = req.sampling
                # a request's draws depend only on its own seed: the first from counter 2**31 - 1, decode chunk n
                # from counter n (sampling.row_keys), whatever else shares the batch
                seed = (int(sp.seed) if sp.seed is not None else self.seed * 1_000_003 + req.request_id) % 2**32
                self.slots.seed[slot], self.slots.chunk[slot] = seed, 0
                key = row_keys(jnp.asarray([seed], jnp.uint32), jnp.asarray([2**31 - 1], jnp.uint32))
                pen = None
                if sp.penalized:
                    seen = np.zeros((1, self.vocab_size), bool)
                    seen[0, req.prompt_ids] = True
                    pen = PenaltyState(jnp.zeros((1, self.vocab_size), jnp.int32), jnp.asarray(seen))
                params = SamplingArrays.fill(1, float(sp.temperature), float(sp.top_p), int(sp.top_k),
                                             float(sp.min_p), float(sp.presence_penalty),
                                             float(sp.frequency_penalty), float(sp.repetition_penalty))
                first, lp = _sample_first(logits[None], key, params, pen,
                                          num_top=MAX_LOGPROBS if sp.logprobs is not None else 0)
                first = int(first[0])
                first_lp = None if lp is None else as_token_logprobs([first], *(np.asarray(a) for a in lp), sp.logprobs)
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
            rec.prefill_s += self.clock() - t0
            self.release(slot)
            self.finish(req, ERROR, error=f"prefill failed: {type(e).__name__}: {e}")
            ended[req.request_id] = None
            return end - start
        now = self.clock()
        rec.prefill_s += now - t0
        # prompt tokens, counted once each: a shared prefix with the first chunk
        rec.prefill_tokens += job.done - (start if start > job.shared * c.page_size else 0)
        if not job.finished:
            return end - start
        del self._prefilling[slot]
        rec.prefills += 1
        req.tokens.append(first)
        if first_lp is not None:
            req.logprobs.extend(first_lp)
            self._step_logprobs.setdefault(req.request_id, []).extend(first_lp)
        req.t_first_token = now
        req.deliveries.append((now, 1, rec.index))
        new.setdefault(req.request_id, []).append(first)
        stopped = first in req.sampling.stop_ids or self._stop_string(req, [])[1]
        del req.logprobs[len(req.tokens):]          # a stop string the first token completed cut it
        if stopped:
            self.finish(req, STOP)
        elif req.max_new_tokens <= 1:
            self.finish(req, LENGTH)
        else:
            self.slots.start(slot, first, req.max_new_tokens - 1, sp, self.budget_pages(sp))
            if sp.penalized:
                self.seed_penalties(slot, req.prompt_ids, req.tokens)
            return end - start
        self.release(slot)
        ended[req.request_id] = None
        return end - start

    def seed_penalties(self, slot: int, prompt_ids, tokens) -> None:
        """The slot's row of the penalty state: its prompt's tokens seen, its generated `tokens` counted (at
        admission the first token; at a checkpoint restore every generated token: the counts are recomputed, not
        saved)."""
        S, V = self.config.max_seqs, self.vocab_size
        if self.penalties is None:
            self.penalties = jax.device_put(PenaltyState.zeros(S, V), self.gen.replicated)
        seen = np.zeros(V, bool)
        seen[list(prompt_ids)] = True
        counts = np.bincount(np.asarray(tokens, np.int64), minlength=V).astype(np.int32)
        set_row, rep, s = self.gen.program.set_row, self.gen.replicated, jnp.int32(slot)
        self.penalties = PenaltyState(set_row(self.penalties.counts, s, jax.device_put(counts, rep)),
                                      set_row(self.penalties.seen, s, jax.device_put(seen, rep)))

    def _stats_now(self) -> tuple[int, int, int, int]:
        st = jax.device_get(self.gen.stats)
        return int(st.hits), int(st.misses), int(st.overflow), int(st.fetched)

    def _decode(self, rec: StepRecord, new, ended) -> None:
        c, sl = self.config, self.slots
        rec.live_slots = int((~sl.done).sum())
        sampling = sl.sampling_arrays()
        keys = sl.keys()
        # a last chunk runs only the steps its requests can use: the longest remaining, up to a power of two
        steps = min(self.decode_chunk_steps, bucket_length(int(sl.remaining[~sl.done].max()), 1))
        decoded = ~sl.done
        rec.decode_compiled = steps not in self._seen_steps
        self._seen_steps.add(steps)
        pen = self.penalties if sl.penalties_on() else None      # no request penalizes: the plain program
        want_lp = sl.logprobs_on()
        t0 = self.clock()
        try:
            self.penalties = None if pen is not None else self.penalties   # donated to the chunk
            out, done, remaining, pen, lp = self.gen.decode_chunk_with(
                jnp.asarray(sl.tok), jnp.asarray(sl.done), jnp.asarray(sl.remaining), keys, sampling, self.no_stops,
                steps=steps, penalties=pen, logprobs=want_lp, budget=sl.budgets(c.select_pages), phase=sl.phase)
            if pen is not None:
                self.penalties = pen
            out = np.asarray(out)
            done, remaining = np.asarray(done).copy(), np.asarray(remaining).copy()
            lp = None if lp is None else tuple(np.asarray(a) for a in lp)
        except Exception as e:
            # the cache state was donated to the failed call: every running request is lost with it
            msg = f"decode failed: {type(e).__name__}: {e}"
            for slot, rid in list(sl.request_of.items()):
                self.finish(self.requests[rid], ERROR, error=msg)
                ended[rid] = None
                sl.request_of.pop(slot)
            self._prefilling.clear()
            raise
        now = self.record_chunk(rec, t0, steps, advance=False)
        sl.advance(steps, c.page_size, decoded)
        for slot, rid in list(sl.request_of.items()):
            if sl.done[slot]:
                continue
            sl.remaining[slot] = remaining[slot]
            got = [int(t) for t in out[slot] if t >= 0]       # a prefix of the row: a slot ends, never resumes
            lps = None
            if lp is not None and sl.logprobs[slot] >= 0:
                lps = as_token_logprobs(got, lp[0][slot], lp[1][slot], lp[2][slot], int(sl.logprobs[slot]))
            # only a stop id (matched here) or the length ends a slot
            self.deliver(rec, slot, got, new, ended, now, lps)

    def deliver(self, rec: StepRecord, slot: int, got: list[int], new, ended, now: float,
                logprobs: list[TokenLogprob] | None = None) -> bool:
        """A slot's new tokens `got` (a decode chunk's, or a verification's accepted ones) to the request holding
        it (`_deliver`: cut at a stop id or stop string, recorded in the step's `new`; `logprobs` aligned with
        `got`, cut with it); where that ends the request (STOP, LENGTH) it finishes, its slot is released and its
        id goes into the step's `ended` -> whether it ended. The slot's remaining budget must already count these
        tokens."""
        rid = self.slots.request_of[slot]
        req = self.requests[rid]
        reason = self._deliver(rec, req, slot, got, new, now, logprobs)
        if reason is None:
            return False
        self.finish(req, reason)
        self.release(slot)
        ended[rid] = None
        return True

    def _deliver(self, rec: StepRecord, req: Request, slot: int, got: list[int], new, now: float,
                 logprobs: list[TokenLogprob] | None = None) -> str | None:
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
        if logprobs is not None:
            kept = logprobs[:len(got)]
            req.logprobs.extend(kept)
            self._step_logprobs.setdefault(req.request_id, []).extend(kept)
            del req.logprobs[len(req.tokens) + len(got):]     # a stop string may have cut delivered tokens too
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
            self.release(req.slot)          # a partly prefilled one too: its chunks so far are dropped
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

    def record_chunk(self, rec, t0, steps: int, advance: bool = True) -> float:
        """A decode chunk's timeline entry (cache counters since the last chunk's, time since t0, decode steps);
        the chunk counters advance (a sampled request's key is its seed and its chunk count; advance=False: the
        caller advances them, SlotTable.advance) -> now."""
        now = self.clock()
        before = self._stats0
        self._stats0 = self._stats_now()
        rec.hits, rec.misses, rec.overflow, rec.fetched = (a - b for a, b in zip(self._stats0, before))
        rec.decode_s = now - t0
        rec.decode_steps = steps
        self._chunks += 1
        if advance:
            self.slots.chunk += 1
        return now

    def occupancy(self) -> dict[str, int]:
        """What the cache holds now: sequence slots in use and in all; host pool pages in use (by requests and
        stored prefixes), held by requests (shared pages counted per holder), in all and at most so far; HBM
        frames holding a page (the PB-LRU pool, all ranks; a finished sequence's own pages are emptied with its
        slot, its pages stored as a shared prefix stay until evicted) and in
        all (host pages and frames: 0 with the dense cache, which has neither); speculative draft tokens proposed
        and accepted so far (0 without speculation). A server's metrics read it between steps (the frame count is
        one small device read)."""
        c = self.config
        out = {"slots_used": len(self.slots.request_of), "slots_total": c.max_seqs, "host_pages_used": 0,
               "host_pages_of_requests": 0, "host_pages_total": 0, "host_pages_peak": 0, "hbm_frames_used": 0,
               "hbm_frames_total": 0, "spec_proposed": 0, "spec_accepted": 0}
        manager = getattr(self.gen.backend, "manager", None)      # the sparse cache's host tier
        if manager is not None:
            alloc = manager.alloc
            out.update(host_pages_used=int(c.host_pages - alloc.num_free), host_pages_total=int(c.host_pages),
                       host_pages_of_requests=int(sum(p.size for p in alloc.pages_of.values())),
                       host_pages_peak=int(alloc.peak_used))
            stamp = np.asarray(jax.device_get(manager.state.pb.stamp))     # [R, B, slots], -1 = empty
            out.update(hbm_frames_used=int((stamp >= 0).sum()), hbm_frames_total=int(stamp.size))
        if self.spec is not None:
            out.update(spec_proposed=int(self.spec.proposed), spec_accepted=int(self.spec.accepted))
        return out

    def stats_totals(self) -> dict[str, int]:
        h, m, o, f = (sum(getattr(r, k) for r in self.timeline) for k in ("hits", "misses", "overflow", "fetched"))
        return {"hits": h, "misses": m, "overflow": o, "fetched": f}
