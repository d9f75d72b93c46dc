"""Token sampling with per-sequence parameters (so one compiled step serves mixed requests)."""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp


@partial(jax.tree_util.register_dataclass, data_fields=["temperature", "top_p", "top_k"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    temperature: jax.Array  # [S] float32, 0 = greedy
    top_p: jax.Array        # [S] float32 in (0, 1]
    top_k: jax.Array        # [S] int32, 0 = off

    @staticmethod
    def fill(num: int, temperature=0.0, top_p=1.0, top_k=0) -> "SamplingArrays":
        return SamplingArrays(jnp.full(num, temperature, jnp.float32), jnp.full(num, top_p, jnp.float32),
                              jnp.full(num, top_k, jnp.int32))


@jax.jit
def row_keys(seeds, counters):
    """Per-row keys [S] from integer seeds [S] and counters [S] (e.g. a request's chunk index). Jitted: the Engine
    makes them before every chunk or verification, and the vmap run op by op costs ~5 ms of host time a call."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)


def check_sampling(temperature: float, top_p: float, top_k: int, vocab_size: int) -> None:
    if not (temperature >= 0.0):
        raise ValueError(f"temperature = {temperature} must be >= 0 (0 = greedy)")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p = {top_p} must be in (0, 1]")
    if not (isinstance(top_k, int) and 0 <= top_k <= vocab_size):
        raise ValueError(f"top_k = {top_k!r} must be an int in [0, vocab_size = {vocab_size}] (0 = off)")


def truncated_sorted(logits, params: SamplingArrays):
    """logits [S, V] -> (order [S, V]: token ids by descending scaled logit, srt [S, V]: the scaled logits in that
    order, -inf where top-k, then top-p (the smallest prefix whose mass reaches top_p), cut them). The
    distribution `sample` draws from (speculative.token_probs is its softmax)."""
    S, V = logits.shape
    t = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    scaled = logits / t
    order = jnp.argsort(-scaled, axis=-1)                                      # [S, V] descending
    srt = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = (params.top_k[:, None] == 0) | (rank < params.top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, srt, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs                                # mass strictly before each token
    keep &= before < params.top_p[:, None]
    return order, jnp.where(keep, srt, -jnp.inf)


def sample(logits, keys, params: SamplingArrays):
    """logits [S, V] float32, keys [S] (one PRNG key per row, so a request's draws do not depend on its batch
    neighbours) -> token ids [S] int32. Greedy where temperature == 0; else top-k, then top-p (nucleus, the
    smallest prefix of the sorted distribution whose mass reaches top_p), then a categorical draw."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    order, srt = truncated_sorted(logits, params)
    pick = jax.vmap(jax.random.categorical)(keys, srt)                         # [S] index into sorted order
    drawn = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(params.temperature > 0, drawn, greedy)
