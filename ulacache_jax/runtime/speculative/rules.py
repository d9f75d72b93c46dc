"""Speculative decoding over the cache (DESIGN.md section 7): drafts proposed cheaply, verified by the target in
one forward of K + 1 rows per sequence, accepted by the speculative sampling rule.

- `SpecConfig`: method "ngram" (prompt lookup: the continuation of the latest earlier match of the last n tokens
  in the prompt and the generated text, no second model) or "draft" (a smaller model of the same tokenizer
  decoding on its own cache), `num_tokens` = K drafts a step at most.
- Verification (program.Program.verify): row j of a sequence is its token at position length + j, and computes
  what a plain decode step at that position computes (its own page selection and causal view of the tail ring;
  the S x (K + 1) rows are one virtual decode batch: one sieve access, one attention launch: decode_layer.
  verify_layer). The drafts' K/V go into the tail ring as leases; accepted rows commit by advancing the length
  (the tail pages' key summaries recomputed from committed tokens); a rejected row writes no vTLB entry, frame,
  PB-LRU slot or host page (its verification's page reads and recency updates are reads).
- Flush points are those of plain decode: a sequence flushes its complete pages when its length reaches
  prompt + c * page_size (where a plain decode chunk ends), and a verification never runs rows past the next
  flush point (the rows are cut there). So every row sees the flushed pages a plain decode step sees, greedy
  speculative output equals plain greedy output token for token (float32), and the tail ring keeps its two pages.
- `accept`: the standard rule (Leviathan et al. 2023, Chen et al. 2023): draft d with target probability p(d) and
  draft probability q(d) is accepted with probability min(1, p(d) / q(d)); at the first rejection the next token
  is drawn from norm(max(0, p - q)); when all are accepted, from the last row's p. Greedy rows make p a point mass
  on the argmax (accept = longest matching prefix + the target's next token); ngram drafts are point masses.
- `SpecDecoder`: the Engine's speculative step. ngram: a device chunk (program.Program.spec_chunk) of up to
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
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np
import jax
import jax.numpy as jnp

from ulacache_jax.runtime.sampling import SamplingArrays, row_keys, truncated_sorted

METHODS = ("ngram", "draft")
_DRAFT_KEY = 0x5bd1e995   # folded into a step's keys for the draft model's own draws


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: method "ngram" (prompt lookup) or "draft" (draft_model: a LlamaModel, or a path or
    pretrained name for models.from_pretrained, of the target's tokenizer), num_tokens = K drafts a step at most,
    ngram_max = the longest suffix matched by the ngram drafter (it tries ngram_max down to 1).
    draft_attention: the draft model's cache kind (None: the target's).
    min_drafts_per_slot: a verification runs K + 1 rows a slot only where the step's drafts number at least this
    many per running slot, else one row a slot (a plain step; `gate_rows`): the K + 1-row step costs more with
    every slot it carries, while a lone draft of a batch gains at most its own few tokens."""
    method: str = "ngram"
    num_tokens: int = 4
    draft_model: Any = None
    ngram_max: int = 3
    draft_attention: str | None = None
    min_drafts_per_slot: float = 1.0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method = {self.method!r} must be one of {METHODS}")
        for name, lo in (("num_tokens", 1), ("ngram_max", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"speculative {name} = {v!r} must be an int >= {lo}")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("speculative method 'draft' needs draft_model (a model, a path or a pretrained name)")
        if self.method == "ngram" and self.draft_model is not None:
            raise ValueError("speculative method 'ngram' takes no draft_model (use method='draft')")
        r = self.min_drafts_per_slot
        if isinstance(r, bool) or not isinstance(r, (int, float, np.integer, np.floating)) \
                or not 0 <= r <= self.num_tokens:
            raise ValueError(f"speculative min_drafts_per_slot = {r!r} must be a number in [0, num_tokens = "
                             f"{self.num_tokens}]")
        if self.draft_attention not in (None, "sparse", "dense"):
            raise ValueError(f"draft_attention = {self.draft_attention!r} must be None, 'sparse' or 'dense'")


# ---- the acceptance rule (traced) -------------------------------------------------------------------------------
def token_probs(logits, params: SamplingArrays):
    """logits [N, V] -> the distribution `sampling.sample` draws from, [N, V] float32: temperature, top-k, then
    top-p over the sorted scaled logits; a point mass on the argmax where temperature == 0."""
    N, V = logits.shape
    logits = logits.astype(jnp.float32)
    order, srt = truncated_sorted(logits, params)
    ps = jax.nn.softmax(srt, axis=-1)
    p = jnp.zeros((N, V), jnp.float32).at[jnp.arange(N)[:, None], order].set(ps)
    point = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    return jnp.where((params.temperature > 0)[:, None], p, point)


def draw(probs, logits, keys, params: SamplingArrays):
    """One token per row from probs [N, V] (token_probs' output), keys [N]; the argmax of logits where greedy."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.vmap(jax.random.categorical)(keys, jnp.log(probs)).astype(jnp.int32)
    return jnp.where(params.temperature > 0, drawn, greedy)


def _rows(params: SamplingArrays, q: int) -> SamplingArrays:
    return jax.tree.map(lambda a: jnp.repeat(a, q, axis=0), params)


def accept(logits, drafts, nrows, keys, params: SamplingArrays, draft_probs=None):
    """The speculative sampling rule, per sequence. logits [S, Q, V] the target's rows (row j scores the token
    after row j's), drafts [S, Q - 1] (draft j is row j + 1's token), nrows [S] rows in use (nrows - 1 drafts;
    0 = not running), keys [S], params [S], draft_probs [S, Q - 1, V] the draft's distributions (None: point
    masses). -> (out [S, Q] int32: the accepted drafts then one token of the target, -1 after; n_new [S] = accepted
    drafts + 1, 0 where nrows == 0)."""
    S, Q, V = logits.shape
    K = Q - 1
    p = token_probs(logits.reshape(S * Q, V), _rows(params, Q)).reshape(S, Q, V)
    ku = jax.vmap(jax.random.fold_in, (0, None))(keys, 0)
    kf = jax.vmap(jax.random.fold_in, (0, None))(keys, 1)
    if K:
        pd = jnp.take_along_axis(p[:, :K], drafts[..., None], axis=-1)[..., 0]      # [S, K] p_j(d_j)
        if draft_probs is None:
            qd = jnp.ones_like(pd)
            q = jax.nn.one_hot(drafts, V, dtype=jnp.float32)                          # [S, K, V]
        else:
            q = draft_probs.astype(jnp.float32)
            qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        u = jax.vmap(lambda k: jax.random.uniform(k, (K,)))(ku)                       # [S, K] in [0, 1)
        ok = (u * qd < pd) & (jnp.arange(K)[None, :] + 1 < nrows[:, None])          # u < min(1, p / q)
        a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)                # [S] accepted drafts
        q = jnp.concatenate([q, jnp.zeros((S, 1, V), jnp.float32)], axis=1)           # row K: nothing to reject
    else:
        a = jnp.zeros((S,), jnp.int32)
        q = jnp.zeros((S, 1, V), jnp.float32)
    s = jnp.arange(S)
    pa, qa = p[s, a], q[s, a]                                                         # [S, V]
    rejected = a + 1 < nrows
    resid = jnp.where(rejected[:, None], jnp.maximum(pa - qa, 0.0), pa)
    resid = jnp.where(resid.sum(-1, keepdims=True) > 0, resid, pa)
    final = draw(resid, logits[s, a], kf, params)                                     # [S]
    j = jnp.arange(Q)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((S, 1), drafts.dtype)], axis=1) if K else jnp.zeros((S, 1), jnp.int32)
    out = jnp.where(j < a[:, None], padded, jnp.where(j == a[:, None], final[:, None], -1))
    on = nrows > 0
    return jnp.where(on[:, None], out, -1).astype(jnp.int32), jnp.where(on, a + 1, 0).astype(jnp.int32)


# ---- the ngram drafter (host) -------------------------------------------------------------------------------------
def ngram_propose(history, k: int, ngram_max: int) -> list[int]:
    """Prompt lookup: for n = ngram_max down to 1, the latest earlier occurrence of the last n tokens of `history`
    (prompt + generated) -> the up to k tokens that followed it; [] when no suffix recurs (or k < 1)."""
    if k < 1:
        return []
    h = np.asarray(history, dtype=np.int64)
    T = len(h)
    for n in range(min(ngram_max, T - 1), 0, -1):
        pat = h[T - n:]
        # windows starting at 0 .. T - n - 1 (excluding the suffix itself)
        win = np.lib.stride_tricks.sliding_window_view(h[:T - 1], n)                 # [T - n, n]
        hits = np.nonzero((win == pat).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in h[start:start + k]]
    return []


class NgramIndex:
    """`ngram_propose` incrementally, for one sequence: the latest start of every n-gram (n <= ngram_max) seen so
    far, updated with each new token, so a proposal costs O(ngram_max) instead of a scan of the history. An n-gram's
    key is the bytes of its tokens as little-endian int64 (any vocabulary size), so a prompt is indexed with numpy
    windows in one pass (a per-token Python loop took ~20 ms a 6K-token prompt: 16 prompts, ~0.3 s at admission)."""

    _BULK = 32          # new tokens from which extend indexes with numpy windows rather than token by token

    def __init__(self, ngram_max: int):
        self.ngram_max = ngram_max
        self.h: list[int] = []
        self.after = [dict() for _ in range(ngram_max + 1)]     # n -> {n-gram key: index after its latest occurrence}

    @staticmethod
    def _key(tokens) -> bytes:
        return struct.pack(f"<{len(tokens)}q", *tokens)          # == the numpy windows' "<i8" bytes

    def extend(self, tokens) -> None:
        h, old = self.h, len(self.h)
        h.extend(int(t) for t in tokens)
        lo, hi = max(old - 1, 0), len(h) - 2       # n-grams ending at lo..hi (all but the newest token) become matchable
        if hi < lo:
            return
        if hi - lo + 1 < self._BULK:
            for i in range(lo, hi + 1):
                for n in range(1, min(self.ngram_max, i + 1) + 1):
                    self.after[n][self._key(h[i - n + 1:i + 1])] = i + 1
            return
        base = max(lo - self.ngram_max + 1, 0)
        a = np.asarray(h[base:hi + 1], dtype="<i8")                                    # [hi + 1 - base]
        for n in range(1, self.ngram_max + 1):
            first = max(lo, n - 1)                 # an n-gram ending at i starts at i - n + 1 >= 0
            if first > hi:
                continue
            win = np.lib.stride_tricks.sliding_window_view(a, n)[first - n + 1 - base:hi - n + 2 - base]
            keys = np.ascontiguousarray(win).view(f"V{8 * n}").ravel().tolist()       # [hi - first + 1] bytes
            self.after[n].update(zip(keys, range(first + 1, hi + 2)))   # in order: the latest occurrence wins

    def propose(self, history, k: int, more=()) -> list[int]:
        """ngram_propose(history + more, k, ngram_max), given that history + more extends what this index has seen
        (two lists, e.g. a prompt and its generated tokens, so the caller need not join them)."""
        seen = len(self.h)
        if seen > len(history) + len(more) or (seen and (history[:1] or more[:1]) != self.h[:1]):
            self.__init__(self.ngram_max)
            seen = 0
        if seen < len(history):
            self.extend(list(history[seen:]) + list(more))
        else:
            self.extend(more[seen - len(history):])
        if k < 1:
            return []
        h = self.h
        for n in range(min(self.ngram_max, len(h) - 1), 0, -1):
            start = self.after[n].get(self._key(h[len(h) - n:]))
            if start is not None:
                return h[start:start + k]
        return []


def next_flush(prompt_len: int, length: int, page_size: int) -> int:
    """The next flush point of a sequence with `length` committed tokens: where plain decode's chunk ends (chunks
    of page_size steps from the prompt's end)."""
    return prompt_len + page_size * ((length - prompt_len) // page_size + 1)


def spec_bounds(length, prompt_len, remaining, state, page_size: int):
    """Traced: the drafts a slot may propose for its next verification and its next flush point, as the host
    step computes them: length, prompt_len, remaining [S] int32, state = (k_now, fails, skip) [S] ->
    (k [S] = min(k_now, bound - length - 1, remaining - 1), 0 while skip > 0; bound [S] = next_flush)."""
    k_now, _, skip = state
    bound = prompt_len + page_size * ((length - prompt_len) // page_size + 1)
    k = jnp.minimum(jnp.minimum(k_now, bound - length - 1), remaining - 1)
    return jnp.where(skip > 0, 0, jnp.maximum(k, 0)).astype(jnp.int32), bound.astype(jnp.int32)


def backoff(state, n_new, drafted, num_tokens: int, page_size: int):
    """Traced: the host step's back-off rule (`SpecDecoder.decode`) after one verification: state = (k_now, fails,
    skip) [S], n_new [S] new tokens, drafted [S] drafts verified -> the new state. skip counts down by the new
    tokens; where drafts were verified, k_now grows by 2 on a full acceptance (up to K) and shrinks by 1 on a
    rejection (down to 1), fails counts consecutive verifications with nothing accepted, and from 2 fails on the
    slot pauses drafting for min(page_size, 2 ** (fails - 1)) tokens."""
    k_now, fails, skip = state
    skip = jnp.maximum(0, skip - n_new)
    acc = n_new - 1
    did = drafted > 0
    k2 = jnp.where(acc == drafted, jnp.minimum(num_tokens, k_now + 2), jnp.maximum(1, k_now - 1))
    f2 = jnp.where(acc > 0, 0, fails + 1)
    s2 = jnp.where(f2 >= 2, jnp.minimum(page_size, jnp.left_shift(1, jnp.clip(f2 - 1, 0, 30))), skip)
    return tuple(jnp.where(did, new, old).astype(jnp.int32) for new, old in ((k2, k_now), (f2, fails), (s2, skip)))


def gate_rows(nrows, min_drafts_per_slot: float):
    """A step's rows after the batch gate (host numpy or traced): nrows [S] (0 = no row, 1 + drafts otherwise) ->
    nrows, cut to one row a slot unless the step's drafts number at least min_drafts_per_slot per slot with rows.
    A verification's cost grows with the rows of every slot (S x (K + 1) where one slot drafts), so a few drafts
    in a large batch of rejecting slots (sampled text) would make every step slower than plain decoding; a cut
    slot's back-off state is left as it is (it drafted nothing)."""
    xp = jnp if isinstance(nrows, jax.Array) else np
    drafts = xp.sum(xp.maximum(nrows - 1, 0))
    ok = drafts >= min_drafts_per_slot * xp.sum(nrows > 0)
    return xp.where(ok, nrows, xp.minimum(nrows, 1)).astype(nrows.dtype)


# ---- the Engine's speculative step ----------------------------------------------------------------------------------
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
        self.k_now = np.full(S, spec.num_tokens, np.int64)   # drafts a step per slot (back-off)
        self.fails = np.zeros(S, np.int64)                     # consecutive steps with no draft accepted
        self.skip = np.zeros(S, np.int64)                      # tokens to go before the slot drafts again
        self.steps = self.proposed = self.accepted = 0
        self.chunks = 0                                        # device calls of the ngram chunk (Program.spec_chunk)
        self._seen_rows: set[int] = set()
        # a drafter (slot, history, k) -> up to k tokens in place of the ngram index (tests: oracle drafters)
        self._ngram = [NgramIndex(spec.ngram_max) for _ in range(S)]
        self.drafter = None
        self.fixed_rows = False      # True: every verification runs K + 1 rows (one program; tests)
        # ngram: verifications run on the device in chunks of up to chunk_steps (Program.spec_chunk) over a device
        # history [S, max_context] (rows uploaded once per request); 0 = one verification per step (the path of
        # oracle drafters and the draft model; tests compare the two)
        self.chunk_steps = c.page_size if spec.method == "ngram" else 0
        self._hist = None
        self._hist_len = np.full(S, -1, np.int64)      # tokens of the slot's request in the device history, -1: none
        self.draft = None
        if spec.method == "draft":
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
        self.k_now[slot], self.fails[slot], self.skip[slot] = self.K, 0, 0
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
        """One step for every running request of Engine `eng` (the Engine's `_decode`, speculative): ngram, when a
        slot drafts: a device chunk of verifications (`_chunk`); otherwise a verification of each slot's drafts;
        or, when no slot drafts (ngram: no match, or every slot backing off), a plain decode chunk that ends where
        no flush point differs from plain decoding's (`_plain_steps`), else one row. The host proposal decides
        the branch (the chunk proposes again on the device, by the same rule)."""
        gen, c, K = self.gen, self.gen.config, self.K
        S, P = c.max_seqs, c.page_size
        tokens = np.zeros((S, K + 1), np.int32)
        nrows = np.zeros(S, np.int32)
        bound = np.zeros(S, np.int32)
        running = [(s, r) for s, r in eng._slot_req.items() if not eng._done[s]]
        for slot, rid in running:
            req = eng.requests[rid]
            L = int(self.length[slot])
            b = next_flush(int(self.prompt_len[slot]), L, P)
            k = int(min(self.k_now[slot], b - L - 1, eng._remaining[slot] - 1))
            if self.skip[slot] > 0:
                k = 0
            tokens[slot, 0] = eng._tok[slot]
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
        keys = row_keys(jnp.asarray(eng._seed), jnp.asarray(eng._chunk_of))
        sampling = SamplingArrays(jnp.asarray(eng._temp), jnp.asarray(eng._top_p), jnp.asarray(eng._top_k))
        before = eng._stats0
        t0 = eng._clock()
        steps = 1
        if self.draft is None and not self.fixed_rows and nrows.max() <= 1:
            steps = self._plain_steps(running, P)
        if steps == 1 and nrows.max() > 1 and self.draft is None and self.drafter is None and self.chunk_steps:
            return self._chunk(eng, rec, new, ended, running, keys, sampling)
        if steps > 1:                      # nobody drafts: a plain chunk (one host sync for `steps` tokens)
            rec.decode_compiled = ("plain", steps) not in self._seen_rows
            self._seen_rows.add(("plain", steps))
            out, _, _ = gen.decode_chunk(jnp.asarray(eng._tok), jnp.asarray(eng._done), jnp.asarray(eng._remaining),
                                         keys, sampling, eng._no_stops, steps=steps)
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
            args = jax.device_put((tokens[:, :rows], nrows, bound, keys, sampling, probs), gen._replicated)
            b = gen.backend
            verify = gen.program.verify(rows, self.draft is not None and rows > 1)
            b.cache, b.host, out, n_new, length, flush, stats = verify(gen.params, b.cache, b.host, *args)
            gen.add_stats(stats)
            if self.draft is not None:
                self._commit_draft(length, flush)
            out, n_new = np.asarray(out), np.asarray(n_new)
            self.steps += 1
        now = eng._record_chunk(rec, before, t0, steps)
        for slot, rid in running:
            req = eng.requests[rid]
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
            eng._remaining[slot] -= len(got)
            self._deliver(eng, rec, slot, rid, got, new, ended, now)

    @staticmethod
    def _deliver(eng, rec, slot: int, rid: int, got: list[int], new, ended, now: float) -> None:
        """A slot's new tokens to its request (Engine._deliver: cut at a stop id or stop string); the request ends
        and the slot is released where it stopped or reached its length."""
        reason = eng._deliver(rec, eng.requests[rid], slot, got, new, now)
        if reason is None:
            return
        eng._finish(eng.requests[rid], reason)
        eng._release(slot)
        ended[rid] = None

    def _chunk(self, eng, rec, new, ended, running, keys, sampling) -> None:
        """ngram: up to chunk_steps verifications in one device call (Program.spec_chunk), one host sync. The
        device history of each running slot is its prompt + delivered tokens (a row is uploaded where it is not).
        Tokens past a stop id or stop string that the device produced are cut by Engine._deliver (the request
        ends and its slot is released, so its cache length no longer matters), as for plain chunks."""
        gen, c, K = self.gen, self.gen.config, self.K
        S, C, rep = c.max_seqs, c.max_context, gen._replicated
        if self._hist is None:
            self._hist = jax.device_put(np.zeros((S, C), np.int32), rep)
        stops = np.full((S, eng._no_stops.shape[0]), -1, np.int32)
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
        args = jax.device_put((np.maximum(self._hist_len, 0).astype(np.int32), eng._done.copy(),
                               eng._remaining.copy(), self.prompt_len.astype(np.int32), state, keys, sampling, stops),
                              rep)
        before = eng._stats0
        t0 = eng._clock()
        b = gen.backend
        chunk = gen.program.spec_chunk(steps, K, self.spec.ngram_max, self.spec.min_drafts_per_slot)
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
        now = eng._record_chunk(rec, before, t0, int(iters))
        for slot, rid in running:
            got = out[:, slot].reshape(-1)
            got = [int(t) for t in got[got >= 0]]
            self.length[slot] += len(got)
            eng._remaining[slot] -= len(got)
            self._deliver(eng, rec, slot, rid, got, new, ended, now)

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
        args = jax.device_put((tok_d, nrows_d, kd, sd), dg._replicated)
        b = dg.backend
        b.cache, drafts, probs = dg.program.propose(rows)(dg.params, b.cache, b.host, *args)
        drafts = np.asarray(drafts)[idx]
        probs = jax.device_put(probs[jnp.asarray(idx)], self.gen._replicated)
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
        length_d, flush_d = jax.device_put((length[jnp.asarray(src)], flush[jnp.asarray(src)]), dg._replicated)
        b = dg.backend
        b.cache, b.host = dg.program.commit(b.cache, b.host, length_d, flush_d,
                                            jax.device_put(keep, dg._replicated))


def make_draft_generator(gen, spec: SpecConfig):
    """A Generator for spec.draft_model with the target's slots, context, page size and token budget."""
    from ulacache_jax.runtime.generator import Generator, default_cache_config
    from ulacache_jax.runtime.tp import prepare_model
    model = spec.draft_model
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        from ulacache_jax.models import from_pretrained
        model = from_pretrained(model, dtype=gen.config.jnp_dtype)
    c = gen.config
    model = prepare_model(model, c.tp)
    cfg = default_cache_config(model.config, num_seqs=c.max_seqs, max_tokens=c.max_context, page_size=c.page_size,
                               token_budget=c.token_budget, dtype=model.dtype, tp=c.tp)
    return Generator(model, cfg, attention=spec.draft_attention or gen.attention, mesh=gen.mesh)
