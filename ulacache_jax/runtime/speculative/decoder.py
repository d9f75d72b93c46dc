"""The Engine's speculative step (DESIGN.md section 7; the rules it applies are in rules.py).

`SpecDecoder` over the Engine's slot table. ngram: a device chunk (program.Program.spec_chunk) of up to
page_size verifications with one host sync: each proposes from a device history of every slot
(ngram_device.propose, the host NgramIndex's rule), verifies, commits and appends on the device. A slot that
reaches its flush point waits there (no rows) for the rest of the chunk, since the flush writes the host pool
once, after the loop; the chunk ends when every running slot waits or is done. A verification where no slot
has a draft runs one row a slot (a plain step), so a chunk costs plain decoding's steps where drafts stop.
So a chunk carries every slot about a page (the slots' flush points need not coincide), and the slots leave
it flushed together. Without a host pool (dense) nothing waits. The draft model (and oracle
drafters in tests): one verification per Engine step, one host sync.
It backs off by itself (the same rule on the host and in the chunk, `backoff`): a slot's draft length grows on
full acceptance and shrinks on rejection, a slot rejected verification after verification stops drafting for
a while, a step whose drafts number fewer than `min_drafts_per_slot` per running slot verifies one row a slot
(`gate_rows`: a large batch of rejecting slots must not pay K + 1 rows for one slot's draft), and a step where
no slot drafts (ngram) runs a plain decode chunk instead (up to the flush point).
The row count of a per-step verification is a power of two up to K + 1 (the longest proposal of the step): at
most log2(K + 1) + 1 verification programs compile; a chunk verifies K + 1 rows, or one where no slot drafts
(both in its one program); none compiles per acceptance pattern.
Deterministic mode (SpecConfig.deterministic; rules.py says why): every verification runs K + 1 rows (`fixed_rows`:
no gate, no plain chunk, no one-row step; the chunk's steps are K + 1-row verifications too), and method "none"
starts every slot's draft length at 0, so it proposes nothing and decodes plain through the same programs.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from ulacache_jax.models import from_pretrained
from ulacache_jax.runtime.cost_model import pool_headroom
from ulacache_jax.runtime.generator import Generator, default_cache_config
from ulacache_jax.runtime.speculative.rules import NgramIndex, SpecConfig, gate_rows, next_flush
from ulacache_jax.runtime.tp import prepare_model

_DRAFT_KEY = 0x5bd1e995   # folded into a step's keys for the draft model's own draws


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class SpecDecoder:
    """The speculative step of an Engine over its Generator (and, for method "draft", a draft Generator with the
    same slots, page size and flush points). Counters: steps (verifications), proposed (drafts verified),
    accepted, chunks (device calls of the ngram chunk)."""

    def __init__(self, gen, spec: SpecConfig, *, draft_gen=None):
        c = gen.config
        if spec.num_tokens >= c.page_size:
            raise ValueError(f"speculative num_tokens = {spec.num_tokens} must be < page_size = {c.page_size}")
        if gen.backend.host_tier and c.verify_rows < spec.num_tokens + 1:
            raise ValueError(f"speculative num_tokens = {spec.num_tokens} needs cache_config.verify_rows >= "
                             f"{spec.num_tokens + 1} (it is {c.verify_rows}): build the generator's cache with it")
        self.gen, self.spec, self.K = gen, spec, spec.num_tokens
        S = c.max_seqs
        self.prompt_len = np.zeros(S, np.int64)        # where each slot's flush points start (its prefill)
        self.length = np.zeros(S, np.int64)            # committed tokens per slot, host mirror
        # drafts a step per slot (back-off); method "none" starts at 0, which the back-off never moves (it changes
        # k_now only after a step that verified drafts)
        self.k_first = 0 if spec.method == "none" else spec.num_tokens
        self.k_now = np.full(S, self.k_first, np.int64)
        self.fails = np.zeros(S, np.int64)                     # consecutive steps with no draft accepted
        self.skip = np.zeros(S, np.int64)                      # tokens to go before the slot drafts again
        self.steps = self.proposed = self.accepted = 0
        self.chunks = 0                                        # device calls of the ngram chunk (Program.spec_chunk)
        self._seen_rows: set[int] = set()
        # a drafter (slot, history, k) -> up to k tokens in place of the ngram index (tests: oracle drafters)
        self._ngram = [NgramIndex(spec.ngram_max) for _ in range(S)]
        self.drafter = None
        self.fixed_rows = spec.deterministic     # True: every verification runs K + 1 rows (one program)
        # ngram: verifications run on the device in chunks of up to chunk_steps (Program.spec_chunk) over a device
        # history [S, max_context] (rows uploaded once per request); 0 = one verification per step (the path of
        # oracle drafters and the draft model; tests compare the two)
        self.chunk_steps = c.page_size if spec.method in ("ngram", "none") else 0
        self._hist = None
        self._hist_len = np.full(S, -1, np.int64)      # tokens of the slot's request in the device history, -1: none
        self.draft = None
        if spec.method in ("draft", "sparse"):
            self.draft = draft_gen if draft_gen is not None else make_draft_generator(gen, spec)
            dc = self.draft.config
            if dc.page_size != c.page_size or dc.max_seqs != c.max_seqs:
                raise ValueError(f"draft cache page_size/max_seqs = {dc.page_size}/{dc.max_seqs} must equal the "
                                 f"target's {c.page_size}/{c.max_seqs}")
            if self.draft.model_config.vocab_size != gen.model_config.vocab_size:
                raise ValueError(f"draft model vocab_size = {self.draft.model_config.vocab_size} differs from the "
                                 f"target's {gen.model_config.vocab_size}: it needs the same tokenizer")
            self.d_of = np.full(S, -1, np.int64)       # target slot -> draft slot

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    # slots
    def prefill(self, slot: int, prompt: list[int], num_tokens: int) -> None:
        self.prompt_len[slot] = self.length[slot] = len(prompt)
        self.k_now[slot], self.fails[slot], self.skip[slot] = self.k_first, 0, 0
        self._ngram[slot] = NgramIndex(self.spec.ngram_max)
        self._hist_len[slot] = -1
        if self.draft is not None:
            d = self.draft.admit(num_tokens)
            self.d_of[slot] = d
            try:
                self.draft.prefill(d, prompt)
            except Exception:
                self.release(slot)
                raise

    def release(self, slot: int) -> None:
        if self.draft is not None and self.d_of[slot] >= 0:
            self.draft.release(int(self.d_of[slot]))
            self.d_of[slot] = -1

    # the step
    def decode(self, eng, rec, new, ended) -> None:
        """One step for every running request of Engine `eng` (the Engine's `_decode`, speculative; its slot table
        `eng.slots` holds each slot's last token, remaining budget, sampling and RNG state): ngram, when a
        slot drafts: a device chunk of verifications (`_chunk`); otherwise a verification of each slot's drafts;
        or, when no slot drafts (ngram: no match, or every slot backing off), a plain decode chunk that ends where
        no flush point differs from plain decoding's (`_plain_steps`), else one row. The host proposal decides
        the branch (the chunk proposes again on the device, by the same rule)."""
        gen, c, K = self.gen, self.gen.config, self.K
        S, P = c.max_seqs, c.page_size
        tokens = np.zeros((S, K + 1), np.int32)
        nrows = np.zeros(S, np.int32)
        bound = np.zeros(S, np.int32)
        sl = eng.slots
        running = sl.running()
        for slot, rid in running:
            req = eng.requests[rid]
            L = int(self.length[slot])
            b = next_flush(int(self.prompt_len[slot]), L, P)
            k = int(min(self.k_now[slot], b - L - 1, sl.remaining[slot] - 1))
            if self.skip[slot] > 0:
                k = 0
            tokens[slot, 0] = sl.tok[slot]
            if self.draft is None:
                if self.drafter is None:
                    d = self._ngram[slot].propose(req.prompt_ids, max(k, 0), req.tokens)
                else:
                    d = list(self.drafter(slot, req.prompt_ids + req.tokens, k))[:max(k, 0)]
                tokens[slot, 1:1 + len(d)] = d
                k = len(d)
            nrows[slot], bound[slot] = 1 + max(k, 0), b
        if not self.fixed_rows:
            nrows = gate_rows(nrows, self.spec.min_drafts_per_slot)
        rec.live_slots = len(running)
        keys = sl.keys()
        sampling = sl.sampling_arrays()
        t0 = eng.clock()
        steps = 1
        if self.draft is None and not self.fixed_rows and nrows.max() <= 1:
            steps = self._plain_steps(running, P)
        # the chunk where some slot drafts; in deterministic mode always (its steps verify K + 1 rows each)
        if (steps == 1 and (nrows.max() > 1 or self.fixed_rows) and self.draft is None and self.drafter is None
                and self.chunk_steps):
            return self._chunk(eng, rec, new, ended, running, keys, sampling)
        if steps > 1:                      # nobody drafts: a plain chunk (one host sync for `steps` tokens)
            rec.decode_compiled = ("plain", steps) not in self._seen_rows
            self._seen_rows.add(("plain", steps))
            out, _, _ = gen.decode_chunk(jnp.asarray(sl.tok), jnp.asarray(sl.done), jnp.asarray(sl.remaining),
                                         keys, sampling, eng.no_stops, steps=steps)
            out = np.asarray(out)
            n_new = (out >= 0).sum(axis=1)
            nrows[:] = 1
        else:
            rows = K + 1 if self.fixed_rows else min(K + 1, _bucket(int(nrows.max())))
            nrows = np.minimum(nrows, rows)
            rec.decode_compiled = rows not in self._seen_rows
            self._seen_rows.add(rows)
            probs = jnp.zeros((), jnp.float32)
            if self.draft is not None:     # always: the draft cache needs the row-0 token's K/V too
                drafts, dprobs = self._propose(tokens[:, 0], nrows, rows, keys, sampling)
                if rows > 1:
                    tokens[:, 1:rows], probs = drafts, dprobs
            args = jax.device_put((tokens[:, :rows], nrows, bound, keys, sampling, probs), gen.replicated)
            b = gen.backend
            verify = gen.program.verify(rows, self.draft is not None and rows > 1)
            b.cache, b.host, out, n_new, length, flush, stats = verify(gen.params, b.cache, b.host, *args)
            gen.add_stats(stats)
            if self.draft is not None:
                self._commit_draft(length, flush)
            out, n_new = np.asarray(out), np.asarray(n_new)
            self.steps += 1
        now = eng.record_chunk(rec, t0, steps)
        for slot, rid in running:
            got = [int(t) for t in out[slot, :n_new[slot]]]
            drafted, acc = int(nrows[slot]) - 1, int(n_new[slot]) - 1
            self.length[slot] += n_new[slot]
            self.skip[slot] = max(0, self.skip[slot] - int(n_new[slot]))
            if drafted:
                self.proposed += drafted
                self.accepted += acc
                # draft length: grows on a full acceptance, shrinks on a rejection; drafting pauses for 2, 4, ...
                # up to page_size tokens after consecutive steps with nothing accepted (speculation backs off)
                self.k_now[slot] = min(K, self.k_now[slot] + 2) if acc == drafted else max(1, self.k_now[slot] - 1)
                self.fails[slot] = 0 if acc else self.fails[slot] + 1
                if self.fails[slot] >= 2:
                    self.skip[slot] = min(P, 2 ** (int(self.fails[slot]) - 1))
            sl.remaining[slot] -= len(got)
            eng.deliver(rec, slot, got, new, ended, now)

    def _chunk(self, eng, rec, new, ended, running, keys, sampling) -> None:
        """ngram: up to chunk_steps verifications in one device call (Program.spec_chunk), one host sync. The
        device history of each running slot is its prompt + delivered tokens (a row is uploaded where it is not).
        Tokens past a stop id or stop string that the device produced are cut by Engine.deliver (the request
        ends and its slot is released, so its cache length no longer matters), as for plain chunks."""
        gen, c, K = self.gen, self.gen.config, self.K
        S, C, rep, sl = c.max_seqs, c.max_context, gen.replicated, eng.slots
        if self._hist is None:
            self._hist = jax.device_put(np.zeros((S, C), np.int32), rep)
        stops = np.full((S, eng.no_stops.shape[0]), -1, np.int32)
        for slot, rid in running:
            req = eng.requests[rid]
            want = len(req.prompt_ids) + len(req.tokens)
            if self._hist_len[slot] != want:
                row = np.zeros(C, np.int32)
                h = (list(req.prompt_ids) + list(req.tokens))[:C]
                row[:len(h)] = h
                self._hist = gen.program.set_row(self._hist, jnp.int32(slot), jax.device_put(row, rep))
                self._hist_len[slot] = len(h)
            ids = list(req.sampling.stop_ids)[:stops.shape[1]]
            stops[slot, :len(ids)] = ids
        steps = self.chunk_steps
        rec.live_slots = len(running)
        rec.decode_compiled = ("chunk", steps) not in self._seen_rows
        self._seen_rows.add(("chunk", steps))
        state = tuple(a.astype(np.int32) for a in (self.k_now, self.fails, self.skip))
        args = jax.device_put((np.maximum(self._hist_len, 0).astype(np.int32), sl.done.copy(),
                               sl.remaining.copy(), self.prompt_len.astype(np.int32), state, keys, sampling, stops),
                              rep)
        t0 = eng.clock()
        b = gen.backend
        min_drafts = 0.0 if self.fixed_rows else self.spec.min_drafts_per_slot
        chunk = gen.program.spec_chunk(steps, K, self.spec.ngram_max, min_drafts, fixed=self.fixed_rows)
        b.cache, b.host, self._hist, hlen, out, n_new, _, _, state, counts, stats = chunk(
            gen.params, b.cache, b.host, self._hist, *args)
        gen.add_stats(stats)
        hlen, out, state, (iters, proposed, accepted) = jax.device_get((hlen, out, state, counts))
        self.k_now, self.fails, self.skip = (np.asarray(a, np.int64) for a in state)
        self._hist_len = np.asarray(hlen, np.int64)
        self.steps += int(iters)
        self.chunks += 1
        self.proposed += int(proposed.sum())
        self.accepted += int(accepted.sum())
        now = eng.record_chunk(rec, t0, int(iters))
        for slot, rid in running:
            got = out[:, slot].reshape(-1)
            got = [int(t) for t in got[got >= 0]]
            self.length[slot] += len(got)
            sl.remaining[slot] -= len(got)
            eng.deliver(rec, slot, got, new, ended, now)

    def _plain_steps(self, running, P: int) -> int:
        """The longest plain decode chunk (a power of two) that every running slot can take without a flush plain
        decoding would not do: it ends exactly at the slot's next flush point, or before its next page completes
        (the chunk's end flushes every complete page). 1 when none of 2 .. page_size fits."""
        n = P
        while n >= 2:
            ok = True
            for slot, _ in running:
                L = int(self.length[slot])
                b = next_flush(int(self.prompt_len[slot]), L, P)
                complete = ((b - P) // P + 1) * P          # where the first unflushed page completes
                if not (n == b - L or L + n < complete):
                    ok = False
                    break
            if ok:
                return n
            n //= 2
        return 1

    def _propose(self, tok, nrows, rows, keys, sampling):
        """The draft model's proposals for the target's slots -> (drafts [S, rows - 1] host, probs [S, rows - 1,
        V] device), in target slot order."""
        dg = self.draft
        S = tok.shape[0]
        d_of = self.d_of
        on = d_of >= 0
        tok_d = np.zeros(S, np.int32)
        nrows_d = np.zeros(S, np.int32)
        idx = np.zeros(S, np.int32)          # draft slot of each target slot (0 where none)
        tok_d[d_of[on]] = tok[on]
        nrows_d[d_of[on]] = nrows[on]
        idx[on] = d_of[on]
        perm = np.zeros(S, np.int32)          # target slot of each draft slot
        perm[d_of[on]] = np.nonzero(on)[0]
        kd = jax.vmap(jax.random.fold_in, (0, None))(keys, _DRAFT_KEY)
        kd, sd = jax.tree.map(lambda a: a[perm], (kd, sampling))
        args = jax.device_put((tok_d, nrows_d, kd, sd), dg.replicated)
        b = dg.backend
        b.cache, drafts, probs = dg.program.propose(rows)(dg.params, b.cache, b.host, *args)
        drafts = np.asarray(drafts)[idx]
        probs = jax.device_put(probs[jnp.asarray(idx)], self.gen.replicated)
        return drafts, probs

    def _commit_draft(self, length, flush) -> None:
        """The draft cache follows the target's commit (its K/V for the accepted rows is already in its ring)."""
        dg = self.draft
        S = length.shape[0]
        on = self.d_of >= 0
        src = np.zeros(S, np.int32)
        keep = np.zeros(S, bool)
        src[self.d_of[on]] = np.nonzero(on)[0]
        keep[self.d_of[on]] = True
        length_d, flush_d = jax.device_put((length[jnp.asarray(src)], flush[jnp.asarray(src)]), dg.replicated)
        b = dg.backend
        b.cache, b.host = dg.program.commit(b.cache, b.host, length_d, flush_d,
                                            jax.device_put(keep, dg.replicated))


def make_draft_generator(gen, spec: SpecConfig):
    """A Generator for spec.draft_model with the target's slots, context, page size and token budget; for exact
    mode (method "sparse"), `sparse_drafter`."""
    if spec.method == "sparse":
        return sparse_drafter(gen)
    model = spec.draft_model
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        model = from_pretrained(model, dtype=gen.config.jnp_dtype)
    c = gen.config
    model = prepare_model(model, c.tp)
    cfg = default_cache_config(model.config, num_seqs=c.max_seqs, max_tokens=c.max_context, page_size=c.page_size,
                               token_budget=c.token_budget, dtype=model.dtype, tp=c.tp)
    return Generator(model, cfg, attention=spec.draft_attention or gen.attention, mesh=gen.mesh)


# the cache fields that say how a sparse cache selects and stores pages: exact mode's drafter keeps the target's
SELECTION_FIELDS = ("summary_split", "key_channels", "label_bits", "channel_table", "selection", "kv_dtype",
                    "page_codec")


def drafter_config(model_config, c):
    """Exact mode's drafter cache for a target cache `c`: UlaCache with the target's slots, context, page size,
    token budget and selection fields (SELECTION_FIELDS: rule, channels, bits, page format), its HBM pool sized as
    attention="auto" sizes one (cost_model.pool_headroom)."""
    same = {f: getattr(c, f) for f in SELECTION_FIELDS}
    return default_cache_config(model_config, num_seqs=c.max_seqs, max_tokens=c.max_context, page_size=c.page_size,
                                token_budget=c.token_budget, dtype=c.dtype, tp=c.tp,
                                pool_headroom=pool_headroom("auto"), **same)


def sparse_drafter(gen):
    """Exact mode's drafter: the target's own model (parameters shared: Generator.sibling) decoding with sparse
    attention on the cache `drafter_config` gives. The target must be dense: it verifies."""
    if gen.attention != "dense":
        raise ValueError(f"speculative method 'sparse' (exact mode) verifies with dense attention: the target's "
                         f"attention is {gen.attention!r}; build it with attention 'dense' (or 'auto')")
    return gen.sibling(drafter_config(gen.model_config, gen.config), attention="sparse")
