"""Speculative decoding over the cache (DESIGN.md section 7): drafts proposed cheaply, verified by the target in
one forward of K + 1 rows per sequence, accepted by the speculative sampling rule. This module holds the rules,
pure functions that the compiled programs (program.py) trace and the host step (decoder.py) runs: it imports
nothing of the runtime but sampling, so program.py can sit below the decoder that drives a Generator.

- `SpecConfig`: method "ngram" (prompt lookup: the continuation of the latest earlier match of the last n tokens
  in the prompt and the generated text, no second model), "draft" (a smaller model of the same tokenizer
  decoding on its own cache) or "sparse" (exact mode: the target model itself drafts with sparse attention on a
  UlaCache cache of its own and dense attention verifies, so the tokens are dense decoding's; `target_attention`),
  `num_tokens` = K drafts a step at most.
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
- Deterministic mode (`SpecConfig.deterministic`): in bfloat16 the K + 1-row programs round differently from the
  one-row decode step (other matmul and attention shapes), so greedy speculative text drifts from plain text. Every
  op of a verification is row-wise (projections, norms, MLP, the logits) or reads only the row's own causal view
  and its own page selection, so a row's result depends on its token, its position and the committed cache, not on
  the other rows, given the program shape. Deterministic mode runs every step as a K + 1-row verification (never
  the one-row step, the plain chunk or the batch gate), and method "none" decodes plain with those shapes (row 0
  alone, no drafts): the two give the same greedy tokens in any dtype. This rests on the compiled matmuls and
  attention computing a row alike wherever it sits among the S x (K + 1) rows and in either program that verifies
  (the device chunk, the per-step verification): a reduction order per row that the shape fixes, which the bf16
  tests check on CPU (tests/test_speculative_deterministic.py) and nothing checks on the GPU kernels yet.
- `accept`: the standard rule (Leviathan et al. 2023, Chen et al. 2023): draft d with target probability p(d) and
  draft probability q(d) is accepted with probability min(1, p(d) / q(d)); at the first rejection the next token
  is drawn from norm(max(0, p - q)); when all are accepted, from the last row's p. Greedy rows make p a point mass
  on the argmax (accept = longest matching prefix + the target's next token); ngram drafts are point masses.
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np
import jax
import jax.numpy as jnp

from ulacache_jax.runtime.sampling import SamplingArrays, truncated_sorted

METHODS = ("ngram", "draft", "sparse", "none")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: method "ngram" (prompt lookup), "draft" (draft_model: a LlamaModel, or a path or
    pretrained name for models.from_pretrained, of the target's tokenizer) or "sparse" (exact mode: the target
    drafts with sparse attention over a second, UlaCache cache of its own (the target's selection rule, budget and
    page format; parameters shared, not copied) and the target's dense cache verifies: the tokens are dense
    decoding's, at dense's cost per verification; `target_attention`), num_tokens = K drafts a step at most,
    ngram_max = the longest suffix matched by the ngram drafter (it tries ngram_max down to 1).
    draft_attention: the draft model's cache kind (None: the target's).
    min_drafts_per_slot: a verification runs K + 1 rows a slot only where the step's drafts number at least this
    many per running slot, else one row a slot (a plain step; `gate_rows`): the K + 1-row step costs more with
    every slot it carries, while a lone draft of a batch gains at most its own few tokens.
    deterministic: every step runs the K + 1-row verification program, where drafts are few or none too (no
    one-row step, plain chunk or batch gate: min_drafts_per_slot is not applied), so greedy tokens do not depend on
    which drafts were proposed or accepted. Method "none" (deterministic only) proposes nothing: plain decoding
    through those same shapes. Greedy output of any method in this mode equals method "none"'s with the same K
    token for token, in bfloat16 too, where the default mode's K + 1-row and one-row programs round differently
    (the default mode's greedy equality with plain decoding holds in float32). The price: method "none" pays a
    K + 1-row step for each token, and speculation pays K + 1 rows where it would have run one."""
    method: str = "ngram"
    num_tokens: int = 4
    draft_model: Any = None
    ngram_max: int = 3
    draft_attention: str | None = None
    min_drafts_per_slot: float = 1.0
    deterministic: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method = {self.method!r} must be one of {METHODS}")
        for name, lo in (("num_tokens", 1), ("ngram_max", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"speculative {name} = {v!r} must be an int >= {lo}")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("speculative method 'draft' needs draft_model (a model, a path or a pretrained name)")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(f"speculative method {self.method!r} takes no draft_model (use method='draft')")
        if not isinstance(self.deterministic, (bool, np.bool_)):
            raise ValueError(f"speculative deterministic = {self.deterministic!r} must be True or False")
        if self.method == "none" and not self.deterministic:
            raise ValueError("speculative method 'none' (plain decoding through the verification shapes) needs "
                             "deterministic=True; for plain decoding without them, pass speculative=None")
        r = self.min_drafts_per_slot
        if isinstance(r, bool) or not isinstance(r, (int, float, np.integer, np.floating)) \
                or not 0 <= r <= self.num_tokens:
            raise ValueError(f"speculative min_drafts_per_slot = {r!r} must be a number in [0, num_tokens = "
                             f"{self.num_tokens}]")
        if self.draft_attention not in (None, "sparse", "dense"):
            raise ValueError(f"draft_attention = {self.draft_attention!r} must be None, 'sparse' or 'dense'")
        if self.method == "sparse" and self.draft_attention == "dense":
            raise ValueError("speculative method 'sparse' drafts with sparse attention: draft_attention = 'dense' "
                             "would draft with the verifier's own attention (leave it None)")


def target_attention(spec: SpecConfig | None, attention):
    """The target's attention under `spec`: exact mode (method "sparse") verifies with dense attention, so "auto"
    becomes "dense" and "sparse" (or a sparse cost_model.Decision) is refused by name; other methods keep it."""
    if spec is None or spec.method != "sparse":
        return attention
    kind = getattr(attention, "kind", attention)
    if kind == "sparse":
        raise ValueError("speculative method 'sparse' (exact mode) verifies with dense attention: attention = "
                         "'sparse' would verify sparse drafts with sparse attention; use attention 'dense' or 'auto'")
    return "dense" if kind == "auto" else attention


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
    """Traced: the host step's back-off rule (`decoder.SpecDecoder.decode`) after one verification: state = (k_now, fails,
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
