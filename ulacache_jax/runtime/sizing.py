"""The sizing rule: how many sequences of one context fit a machine, for either attention backend and page format.

One rule for every entry point and for the capacity table (scripts/capacity.py): the cache an entry point would
build (`generator.default_cache_config`: HBM frames for every sequence's token budget, host pages for every token,
per rank) and its bytes (`backends.<kind>.footprint`) against the machine's memory:
- per GPU: the cache's HBM bytes of one rank plus that rank's share of the weights, within `hbm_bytes` (what XLA's
  allocator may hold: memory_stats' bytes_limit, which XLA_PYTHON_CLIENT_MEM_FRACTION sets);
- on the host: every rank's host pool (the sparse backend's; dense has none) plus the transient of its first
  ingest (`cache.state.host_need`: half the pool more, measured on the H200), within `host_bytes` (what may be
  pinned).
Sizes grow with the batch, so the largest batch is found by bisection over `default_cache_config`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ulacache_jax.cache import state
from ulacache_jax.runtime import backends
from ulacache_jax.runtime.generator import default_cache_config

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Machine:
    """A machine kind: `gpus` GPUs of one host, `hbm_bytes` of each that XLA may allocate, `host_bytes` of host
    RAM that may be pinned (for the whole host: every rank's pool lives there)."""
    name: str
    gpus: int
    hbm_bytes: int
    host_bytes: int

    def __post_init__(self):
        for f in ("gpus", "hbm_bytes", "host_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Machine {self.name!r}: {f} = {v!r} must be an int >= 1")


@dataclasses.dataclass(frozen=True)
class Need:
    """Bytes one configuration asks for: per GPU (cache rank + weights share) and on the host (pools + the ingest's
    transient), with the parts behind them."""
    hbm_per_gpu: int
    host: int
    cache_hbm_per_gpu: int
    weights_per_gpu: int
    host_pool: int
    host_transient: int


@dataclasses.dataclass(frozen=True)
class Fit:
    """The largest batch of `context`-token sequences that fits (0: not one), and what stops one more: "hbm" or
    "host" (the resource the next batch exceeds, its need beside it), "config" (the cache's shapes cannot take it)
    or "cap" (the search's upper bound)."""
    context: int
    batch: int
    limit: str
    need_next: Need | None

    def why(self, machine: Machine) -> str:
        """What stops batch + 1, in words with the numbers."""
        n = self.need_next
        if self.limit == "cap":
            return f"{self.batch} (the search's cap)"
        if n is None:
            return f"{self.batch + 1} x {self.context} tokens is beyond the cache's shapes (CacheConfig refuses it)"
        if self.limit == "hbm":
            return (f"{self.batch + 1} x {self.context} tokens would need {n.hbm_per_gpu / GIB:.1f} GiB a GPU (cache "
                    f"{n.cache_hbm_per_gpu / GIB:.1f} + weights {n.weights_per_gpu / GIB:.1f}) of "
                    f"{machine.hbm_bytes / GIB:.1f}")
        return (f"{self.batch + 1} x {self.context} tokens would need {n.host / GIB:.1f} GiB of host memory (pool "
                f"{n.host_pool / GIB:.1f} + ingest transient {n.host_transient / GIB:.1f}) of "
                f"{machine.host_bytes / GIB:.1f}")


def cache_config(model_config, context: int, batch: int, *, tp: int = 1, dtype: str = "bfloat16",
                 kv_dtype: str = "auto", token_budget: int = 2048, **overrides):
    """The cache an entry point builds for `batch` sequences of `context` tokens (default_cache_config)."""
    return default_cache_config(model_config, num_seqs=batch, max_tokens=context, token_budget=token_budget,
                                dtype=dtype, tp=tp, kv_dtype=kv_dtype, **overrides)


def need(config, attention: str, weight_bytes: int, *, transient: bool = True) -> Need:
    """Bytes of `config` under `attention` ("sparse" | "dense") with `weight_bytes` of weights split over its ranks.
    transient=False: without the first ingest's host transient (what a pool layout without it would hold)."""
    cls = backends.backend_class(attention)
    fp = cls.footprint(config)
    tp = config.tp
    cache = fp["hbm_bytes"] // tp
    weights = -(-weight_bytes // tp)
    pool, extra = state.host_need(config, pinned=True) if cls.host_tier else (0, 0)
    extra = extra if transient else 0
    return Need(hbm_per_gpu=cache + weights, host=pool + extra, cache_hbm_per_gpu=cache, weights_per_gpu=weights,
                host_pool=pool, host_transient=extra)


def largest_batch(model_config, context: int, machine: Machine, *, attention: str = "sparse", tp: int | None = None,
                  dtype: str = "bfloat16", kv_dtype: str = "auto", token_budget: int = 2048,
                  weight_bytes: int | None = None, cap: int = 4096, transient: bool = True, **overrides) -> Fit:
    """The largest batch of `context`-token sequences `machine` holds with the default cache (tp: ranks, default
    every GPU). weight_bytes: default the model's parameters in `dtype`; transient: as `need`. Raises ValueError for
    a context or tp the cache cannot take."""
    tp = machine.gpus if tp is None else tp
    if not 1 <= tp <= machine.gpus:
        raise ValueError(f"tp = {tp} must be in [1, {machine.gpus}] (the GPUs of {machine.name})")
    if weight_bytes is None:
        weight_bytes = model_config.num_params() * np.dtype(dtype).itemsize
    return largest_batch_for(
        lambda b: cache_config(model_config, context, b, tp=tp, dtype=dtype, kv_dtype=kv_dtype,
                               token_budget=token_budget, **overrides),
        machine, context=context, attention=attention, weight_bytes=weight_bytes, cap=cap, transient=transient)


def largest_batch_for(build, machine: Machine, *, context: int, attention: str, weight_bytes: int,
                      cap: int = 4096, transient: bool = True) -> Fit:
    """The largest b <= cap for which the cache build(b) (a CacheConfig of b sequences of `context` tokens, built
    as its entry point builds it) fits `machine` beside weight_bytes of weights. A build that raises ValueError
    (shapes the cache cannot take) does not fit: limit "config"."""
    if not isinstance(context, int) or isinstance(context, bool) or context < 1:
        raise ValueError(f"context = {context!r} must be an int >= 1")
    if not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap = {cap!r} must be an int >= 1")

    backends.backend_class(attention)        # a bad kind is the caller's error, not a batch that does not fit

    def at(b: int) -> Need | None:
        try:
            config = build(b)
        except ValueError:          # a batch the cache's shapes cannot take (e.g. 2**31 frames): it does not fit
            return None
        return need(config, attention, weight_bytes, transient=transient)

    def over(n: Need | None) -> str | None:
        if n is None:
            return "config"
        if n.hbm_per_gpu > machine.hbm_bytes:
            return "hbm"
        if n.host > machine.host_bytes:
            return "host"
        return None

    first = at(1)
    if over(first):
        return Fit(context, 0, over(first), first)
    lo, hi = 1, 2            # lo fits; double hi until it does not (or passes the cap)
    while hi <= cap and not over(at(hi)):
        lo, hi = hi, hi * 2
    if hi > cap:
        if lo == cap or not over(at(cap)):
            return Fit(context, cap, "cap", None)
        hi = cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if over(at(mid)):
            hi = mid
        else:
            lo = mid
    n = at(lo + 1)
    return Fit(context, lo, over(n), n)
