"""Token sampling with per-sequence parameters (so one compiled step serves mixed requests).

One step of a row, in vLLM's order (v1 sampler): the raw logits' log-softmax is kept for logprobs (vLLM's default
"raw_logprobs": the model's own distribution, before any penalty or temperature); the penalties (repetition over
the prompt and the generated tokens, then frequency and presence over the generated tokens) change the logits;
greedy is the argmax of the penalized logits; otherwise temperature, min-p (keep p >= min_p * p_max), top-k, then
top-p (nucleus over what is left), then a categorical draw. Each option's neutral value (0, or 1 for top_p and the
repetition penalty) leaves the logits bit-identical, so a neutral request samples as it did without the option.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20   # alternatives a request may ask for (vLLM's default max_logprobs): the programs' static top-k

_FIELDS = ["temperature", "top_p", "top_k", "min_p", "presence", "frequency", "repetition"]


@partial(jax.tree_util.register_dataclass, data_fields=_FIELDS, meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    temperature: jax.Array  # [S] float32, 0 = greedy
    top_p: jax.Array        # [S] float32 in (0, 1]
    top_k: jax.Array        # [S] int32, 0 = off
    min_p: jax.Array        # [S] float32 in [0, 1], 0 = off
    presence: jax.Array     # [S] float32 presence penalty, 0 = off
    frequency: jax.Array    # [S] float32 frequency penalty, 0 = off
    repetition: jax.Array   # [S] float32 repetition penalty, 1 = off

    @staticmethod
    def fill(num: int, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, presence=0.0, frequency=0.0,
             repetition=1.0) -> "SamplingArrays":
        f = lambda v: jnp.full(num, v, jnp.float32)
        return SamplingArrays(f(temperature), f(top_p), jnp.full(num, top_k, jnp.int32), f(min_p), f(presence),
                              f(frequency), f(repetition))


@partial(jax.tree_util.register_dataclass, data_fields=["counts", "seen"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PenaltyState:
    """What the penalties read, per slot: counts [S, V] int32 (times each token was generated), seen [S, V] bool
    (the token occurs in the prompt). The repetition penalty applies where seen or counts > 0; frequency and
    presence use counts only (OpenAI: over the generated tokens)."""
    counts: jax.Array
    seen: jax.Array

    @staticmethod
    def zeros(num: int, vocab_size: int) -> "PenaltyState":
        return PenaltyState(jnp.zeros((num, vocab_size), jnp.int32), jnp.zeros((num, vocab_size), bool))

    def add(self, tokens, live) -> "PenaltyState":
        """tokens [S] int32 generated this step where live [S]: counted."""
        S = tokens.shape[0]
        return dataclasses.replace(self, counts=self.counts.at[jnp.arange(S), jnp.maximum(tokens, 0)].add(
            live.astype(jnp.int32)))


@jax.jit
def row_keys(seeds, counters):
    """Per-row keys [S] from integer seeds [S] and counters [S] (e.g. a request's chunk index). Jitted: the Engine
    makes them before every chunk or verification, and the vmap run op by op costs ~5 ms of host time a call."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)


def check_sampling(temperature: float, top_p: float, top_k: int, vocab_size: int) -> None:
    if not (0.0 <= temperature < float("inf")):
        raise ValueError(f"temperature = {temperature} must be a finite number >= 0 (0 = greedy)")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p = {top_p} must be in (0, 1]")
    if not (isinstance(top_k, int) and 0 <= top_k <= vocab_size):
        raise ValueError(f"top_k = {top_k!r} must be an int in [0, vocab_size = {vocab_size}] (0 = off)")


def check_extra(min_p: float, presence: float, frequency: float, repetition: float) -> None:
    """The ranges of the options past temperature / top-p / top-k (NaN fails every comparison, so it is refused)."""
    if not (0.0 <= min_p <= 1.0):
        raise ValueError(f"min_p = {min_p} must be in [0, 1] (0 = off)")
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not (-2.0 <= v <= 2.0):
            raise ValueError(f"{name} = {v} must be in [-2, 2] (0 = off)")
    if not (0.0 < repetition < float("inf")):
        raise ValueError(f"repetition_penalty = {repetition} must be finite and > 0 (1 = off)")


def penalize(logits, pen: PenaltyState, params: SamplingArrays):
    """logits [S, V] float32 -> the penalized logits (vLLM's order): the repetition penalty r divides a positive
    logit and multiplies a negative one of every token in the prompt or generated; then frequency * count and
    presence * (count > 0) are subtracted (counts over the generated tokens). Neutral rows are unchanged bit for
    bit (x / 1, x * 1 and x - 0 are exact)."""
    r = params.repetition[:, None]
    hit = pen.seen | (pen.counts > 0)
    logits = jnp.where(hit, jnp.where(logits > 0, logits / r, logits * r), logits)
    c = pen.counts.astype(jnp.float32)
    return logits - params.frequency[:, None] * c - params.presence[:, None] * (c > 0)


def truncated_sorted(logits, params: SamplingArrays):
    """logits [S, V] -> (order [S, V]: token ids by descending scaled logit, srt [S, V]: the scaled logits in that
    order, -inf where min-p (p < min_p * p_max), top-k, then top-p (the smallest prefix whose mass, renormalized
    over what min-p and top-k kept, reaches top_p), cut them). The distribution `sample` draws from
    (speculative.token_probs is its softmax)."""
    S, V = logits.shape
    t = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    scaled = logits / t
    order = jnp.argsort(-scaled, axis=-1)                                      # [S, V] descending
    srt = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = (params.top_k[:, None] == 0) | (rank < params.top_k[:, None])
    # p / p_max = exp(x - x_max) >= min_p; min_p = 0: log(0) = -inf keeps everything (the max itself always stays)
    keep &= (srt - srt[:, :1] >= jnp.log(params.min_p)[:, None]) | (rank == 0)
    probs = jax.nn.softmax(jnp.where(keep, srt, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs                                # mass strictly before each token
    keep &= before < params.top_p[:, None]
    return order, jnp.where(keep, srt, -jnp.inf)


def sample(logits, keys, params: SamplingArrays):
    """logits [S, V] float32 (already penalized, `penalize`), keys [S] (one PRNG key per row, so a request's draws
    do not depend on its batch neighbours) -> token ids [S] int32. Greedy where temperature == 0; else min-p,
    top-k, then top-p (`truncated_sorted`), then a categorical draw."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    order, srt = truncated_sorted(logits, params)
    pick = jax.vmap(jax.random.categorical)(keys, srt)                         # [S] index into sorted order
    drawn = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(params.temperature > 0, drawn, greedy)


def token_logprobs(logits, tokens, num_top: int):
    """The raw model logprobs (vLLM's default): logits [S, V] as the model gave them (no penalty, temperature or
    truncation), tokens [S] the sampled ids -> (logprob [S] float32 of each token, top_ids [S, num_top] int32,
    top_lp [S, num_top] float32: the best num_top tokens, best first; ties by lower id, as lax.top_k)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, num_top)
    got = jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
    return got, top_ids.astype(jnp.int32), top_lp


def sample_step(logits, keys, params: SamplingArrays, pen: PenaltyState | None = None, num_top: int = 0):
    """One sampling step with the options a program was built for: pen None = no penalties (the program for
    batches where no request uses one), num_top 0 = no logprobs -> (tokens [S] int32, (logprob [S], top_ids
    [S, num_top], top_lp [S, num_top]) or None)."""
    logits = logits.astype(jnp.float32)
    nxt = sample(logits if pen is None else penalize(logits, pen, params), keys, params)
    return nxt, (token_logprobs(logits, nxt, num_top) if num_top else None)
