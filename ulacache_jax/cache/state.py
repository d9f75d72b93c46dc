"""The cache state: every device array of a UlaCache, as one immutable pytree, plus the host pool beside it.

Layout (R = ranks of the `tp` axis, size 1 without TP; S = max_seqs; L = layers; G = groups per rank;
P = max_pages_per_seq; F = PB-LRU frames; T = TAIL_PAGES; page = page_size; g = kv_heads_per_group; D = head_dim):
- pool_k, pool_v [R, F + S*L*G*T + O, page, g, D]: frames 0..F-1 belong to the PB-LRU; then the tail ring, one
  fixed frame per (seq, layer, group, ring slot) outside the PB-LRU; then O = S*G*select_pages overflow frames
  where a layer call stages the selected pages that found no free PB-LRU slot. So attention reads every page it
  needs, selected, overflowed or tail, from one HBM pool by frame id. The pages are stored in the config's page
  format (cache/codec.py): codes of `config.storage_dtype`, and for a scaled codec (fp8) pool_ks, pool_vs
  [R, N, 1, g, 1] float32 scales per frame and KV head (None otherwise). A scaled codec keeps its tail ring out of
  the pool, in ring_k, ring_v [R, S*L*G*T, page, g, D] of the model's dtype (a page is encoded at its flush, when
  all its tokens are known), so its pool is [R, F + O, ...]; ring_k, ring_v are None when the ring is in the pool.
  `tail_frame` indexes whichever array holds the ring (`ring_arrays`).
- kmin, kmax [R, S, L, G, P * split, g, D]: per-dim min and max of K over each sub-page of page_size // split
  tokens (split = config.summary_split, 1 by default: one summary per page, the Quest summaries); sub-page
  p * split + h is the h-th sub-page of page p, so split = 1 is the plain per-page layout.
- kmin, kmax are kept for every selection rule (quest.py says why); every other write of them is a hook of
  select/quest.Quest.
- sel: the page-selection rule's own state (select/rule.py; CacheConfig.selection_rule): a pytree of [R, ...]
  arrays, or None for Quest, whose state is the summaries. None is no leaf at all, so the programs of a cache
  without a rule state are the ones they were before it existed (no zero-size buffers donated). The key copy's
  (and the labels') is a key_copy.KeyCopyState: kc [R, S, L, G, P, page, g, Cs] the copy (int8 / packed int4
  codes with labels), chan [R, S, L, G, g, C] int32 its channels, ksc [R, S, L, G, P, g, C] bfloat16 the labels'
  scales (None otherwise).
- vtlb (frame, host_page) [R, S, L, G, P]; pb (tag_hi, tag_lo, stamp) [R, B, slots].
- seqs: length, flushed (pages with a host copy), active, each [S], and owner [S, P]: the same on every rank.
  owner[s, p] is the seq field of the LID naming page p of slot s: the slot itself, or the id of a stored shared
  prefix page (prefix_cache.SparsePrefixes, ids in [S, 2**20)) that every sharer names it by, so the PB-LRU sees
  one page and one HBM frame serves every sharer. The host page still comes from the slot's own vTLB row.
- clock: int32 scalar, the PB-LRU's `now`; ticks once per sieve call (each layer of each step); wound back by
  `rebase_clock` at the start of every decode chunk once it reaches 2**30, so it never wraps.
The host pool (`HostPool` = codec.Pages: k and v [R, H, page, g, D], and ks, vs [R, H, 1, g, 1] for a scaled codec)
is kept apart because it lives in memory kind
`pinned_host` on GPU and must never be carried through a loop (DESIGN.md section 1): jitted steps take it as a
read-only argument and write it once per call (donated in, aliased out).
"""
from __future__ import annotations

import dataclasses
import os
from functools import partial

import jax
import jax.numpy as jnp

from ulacache_jax.cache import pb_lru
from ulacache_jax.cache import vtlb as vtlb_mod
from ulacache_jax.cache.codec import Pages
from ulacache_jax.cache.config import CacheConfig, TAIL_PAGES
from ulacache_jax.cache.select import quest


@partial(jax.tree_util.register_dataclass, data_fields=["length", "flushed", "active", "owner"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SeqTable:
    length: jax.Array   # [S] int32  committed tokens
    flushed: jax.Array  # [S] int32  leading pages that have their host copy (complete pages only)
    active: jax.Array   # [S] bool
    owner: jax.Array    # [S, P] int32  LID seq field of each page: the slot, or a shared prefix page's id


def own_rows(max_seqs: int, max_pages_per_seq: int) -> jax.Array:
    """The owner table where every page is named by its own slot: [S, P] int32, row s all s."""
    return jnp.broadcast_to(jnp.arange(max_seqs, dtype=jnp.int32)[:, None], (max_seqs, max_pages_per_seq))


@partial(jax.tree_util.register_dataclass,
         data_fields=["pb", "vtlb", "pool_k", "pool_v", "kmin", "kmax", "sel", "seqs", "clock", "pool_ks", "pool_vs",
                      "ring_k", "ring_v"], meta_fields=["config"])
@dataclasses.dataclass(frozen=True)
class CacheState:
    config: CacheConfig
    pb: pb_lru.PBLRUState   # arrays [R, B, slots]
    vtlb: vtlb_mod.VTLB     # arrays [R, S, L, G, P]
    pool_k: jax.Array       # [R, N, page, g, D] codes (N = config.pool_pages)
    pool_v: jax.Array       # [R, N, page, g, D]
    kmin: jax.Array         # [R, S, L, G, P * split, g, D]
    kmax: jax.Array         # [R, S, L, G, P * split, g, D]
    sel: object             # the selection rule's state: a pytree of [R, ...] arrays, or None (Quest)
    seqs: SeqTable
    clock: jax.Array        # [] int32
    pool_ks: jax.Array | None = None   # [R, N, 1, g, 1] float32 page scales (a scaled codec), else None
    pool_vs: jax.Array | None = None
    ring_k: jax.Array | None = None    # [R, S*L*G*T, page, g, D] model dtype (a scaled codec's ring), else None
    ring_v: jax.Array | None = None


HostPool = Pages   # the host pool: k, v [R, H, page, g, D] (pinned_host on GPU); ks, vs [R, H, 1, g, 1] or None


def pool_pages(state: CacheState) -> Pages:
    """The HBM pool as stored pages (leading [R, N])."""
    return Pages(state.pool_k, state.pool_v, state.pool_ks, state.pool_vs)


def with_pool(state: CacheState, pages: Pages) -> CacheState:
    """`state` with its pool replaced by `pages` (leading [R, N])."""
    return dataclasses.replace(state, pool_k=pages.k, pool_v=pages.v, pool_ks=pages.ks, pool_vs=pages.vs)


def ring_arrays(state: CacheState):
    """(k, v) [R, N, page, g, D]: the arrays that hold the tail ring, indexed by `tail_frame`: the pool, or the
    ring's own arrays (a scaled codec)."""
    if state.ring_k is None:
        return state.pool_k, state.pool_v
    return state.ring_k, state.ring_v


def with_ring(state: CacheState, k, v) -> CacheState:
    """`state` with the ring-holding arrays (see `ring_arrays`) replaced."""
    if state.ring_k is None:
        return dataclasses.replace(state, pool_k=k, pool_v=v)
    return dataclasses.replace(state, ring_k=k, ring_v=v)


def overflow_frame(config: CacheConfig, index):
    """HBM frame of the index-th overflow page of a layer call (after the PB-LRU frames and the tail ring, when
    the ring is in the pool)."""
    c = config
    return c.num_frames + (c.ring_pages if c.codec.ring_in_pool else 0) + index


def tail_frame(config: CacheConfig, seq, layer, group, page):
    """Index of the tail-ring slot holding page `page` of (seq, layer, local group) in the array that holds the
    ring (`ring_arrays`): a pool frame after the PB-LRU's, or a row of the ring's own arrays."""
    base = config.num_frames if config.codec.ring_in_pool else 0
    return base + ((seq * config.num_layers + layer) * config.groups_per_rank + group) * TAIL_PAGES + page % TAIL_PAGES


def host_memory_kind(device=None) -> str | None:
    """'pinned_host' where the backend has it (GPU), else None (plain device memory on CPU, same code path)."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":  # CPU also lists pinned_host, but there it is the same RAM: keep one code path
        return None
    kinds = {m.kind for m in device.addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else None


def host_sharding(device=None) -> jax.sharding.Sharding:
    device = device or jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(device, memory_kind=host_memory_kind(device))


def pinnable_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable")
    except OSError:
        return None


def device_memory_bytes(device=None, *, free: bool = False) -> tuple[int | None, str]:
    """-> (bytes the device can hold, what that is): the allocator's limit on an accelerator (memory_stats
    'bytes_limit'; free: less the bytes its live arrays hold now, for a check made after the weights loaded); on
    CPU, whose 'device memory' is host RAM, MemAvailable (free already). None where neither is known."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:   # noqa: BLE001 - CPU devices may not report memory stats
        stats = {}
    limit = stats.get("bytes_limit")
    if limit:
        if free:
            return int(limit) - int(stats.get("bytes_in_use", 0)), f"the {device.device_kind}'s free memory"
        return int(limit), f"the {device.device_kind}'s memory"
    return pinnable_host_bytes(), "the available host memory (MemAvailable, the CPU backend's device memory)"


CLOCK_REBASE_AT = 2**30   # clock value at which a decode chunk winds the clock back (far below int32 overflow)
CLOCK_KEEP = 2**29        # ticks of recency kept exact by the rebase (~46 h at 3200 sieve calls per second)


def rebase_clock(state: CacheState, at: int = CLOCK_REBASE_AT, keep: int = CLOCK_KEEP) -> CacheState:
    """Wind the PB-LRU clock back by clock - keep once it reaches `at` (a no-op before): stamps older than `keep`
    ticks tie at 0, recent order is unchanged. Run at the start of every decode chunk, so the int32 clock (one
    tick per sieve call) never wraps; a wrapped stamp would read as an empty slot while the vTLB still maps it."""
    if not 0 < keep < at < 2**31 - 2**20:
        raise ValueError(f"rebase_clock: need 0 < keep = {keep} < at = {at} < 2**31 - 2**20")
    off = jnp.where(state.clock >= at, state.clock - keep, 0).astype(jnp.int32)
    pb = jax.vmap(pb_lru.rebase, in_axes=(0, None))(state.pb, off)
    return dataclasses.replace(state, pb=pb, clock=state.clock - off)


HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_HOST_LIMIT_GB = 64  # XLA's pinned-host BFC allocator default (measured on the H200, jax 0.11.2)


def xla_host_limit_bytes() -> int:
    """What XLA's pinned-host allocator may hold in all: $XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB GiB, default 64.
    Host pools beyond it fail at allocation with RESOURCE_EXHAUSTED however much RAM the machine has."""
    raw = os.environ.get(HOST_LIMIT_ENV)
    try:
        gb = float(raw) if raw else DEFAULT_HOST_LIMIT_GB
    except ValueError:
        raise ValueError(f"{HOST_LIMIT_ENV} = {raw!r} must be a number of GiB") from None
    return int(gb * 2**30)


def pinned_host_limit() -> int:
    """The most a pinned host pool may take: the smaller of what the machine can pin (MemAvailable, where known)
    and XLA's pinned-host allocator's limit. check_fits refuses past either (with which one in its message); the
    CLI's check before the engine (app/cli.py) and its sizing answer use this one number."""
    return min(x for x in (pinnable_host_bytes(), xla_host_limit_bytes()) if x is not None)


def raise_host_limit(fraction: float = 0.9) -> int | None:
    """Entry points call this first: set XLA's pinned-host limit to `fraction` of MemAvailable (unless the user
    set it). It only takes effect before the GPU backend starts; returns the limit in GiB it set, else None."""
    if os.environ.get(HOST_LIMIT_ENV):
        return None
    avail = pinnable_host_bytes()
    if not avail:
        return None
    gb = max(DEFAULT_HOST_LIMIT_GB, int(fraction * avail / 2**30))
    os.environ[HOST_LIMIT_ENV] = str(gb)
    return gb


def host_need(config: CacheConfig, pinned: bool) -> tuple[int, int]:
    """-> (the host pool's bytes, the transient its first ingest needs beside it). pinned (a GPU's pinned_host
    pool): every rank's pool is pinned in the one host, and the ingest, compiled with the pool aliased, still has
    XLA's pinned allocator ask for one more array the size of the pool's K part (measured on the H200: 256K x 3 of
    the 8B shape pinned its 2 x 48 GiB pool, then the first ingest asked for another 48 GiB and failed), so half the
    pool must stay free. Not pinned (CPU): one rank's pool, plain memory updated in place, no transient."""
    if not pinned:
        return config.host_pool_bytes, 0
    pool = config.host_pool_bytes * config.tp
    return pool, pool // 2


def check_fits(config: CacheConfig, device=None, host_bytes: int | None = None) -> dict[str, int]:
    """Refuse, with the numbers, a config whose pools do not fit the device or the host, before allocating."""
    device = device or jax.devices()[0]
    fp = config.footprint()
    dev_bytes = sum(v for k, v in fp.items() if k != "host")
    limit = None
    try:
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
    except Exception:  # CPU devices may not report memory stats
        limit = None
    if limit is not None and dev_bytes > limit:
        raise ValueError(f"cache needs {dev_bytes / 2**30:.2f} GiB of device memory per rank "
                         f"({', '.join(f'{k} {v / 2**30:.2f}' for k, v in fp.items() if k != 'host')} GiB) "
                         f"but the device has {limit / 2**30:.2f} GiB")
    host_limit = host_bytes if host_bytes is not None else pinnable_host_bytes()
    pinned = bool(host_memory_kind(device))
    pool, transient = host_need(config, pinned)
    need = pool + transient
    parts = (f"host_pages = {config.host_pages} x {2 * config.page_bytes} B x {config.tp} ranks"
             + (f", plus {transient / 2**30:.2f} GiB its first ingest asks XLA for" if transient else ""))
    if host_limit is not None and need > host_limit:
        raise ValueError(f"host pool needs {need / 2**30:.2f} GiB ({parts}) but only {host_limit / 2**30:.2f} GiB "
                         "of host memory is available to pin")
    if host_bytes is None and pinned and need > xla_host_limit_bytes():
        raise ValueError(f"host pool needs {need / 2**30:.2f} GiB ({parts}) but XLA's pinned host allocator is "
                         f"limited to {xla_host_limit_bytes() / 2**30:.0f} GiB: set {HOST_LIMIT_ENV} (GiB) before "
                         "JAX starts, or call ulacache_jax.cache.state.raise_host_limit() first")
    return fp


def init(config: CacheConfig, *, device=None, check: bool = True) -> tuple[CacheState, HostPool]:
    """A fresh cache (device state and host pool) for one device; `tp.shard_cache` spreads ranks over a mesh."""
    if check:
        check_fits(config, device)
    c, r = config, config.tp
    dt, sdt = c.jnp_dtype, c.storage_dtype
    page_shape = (c.page_size, c.kv_heads_per_group, c.head_dim)
    scale_shape = (1, c.kv_heads_per_group, 1)
    num_pool = c.pool_pages
    scaled, ring_apart = c.codec.scaled, not c.codec.ring_in_pool
    one = pb_lru.init(c.num_buckets, c.slots_per_bucket)
    pb = jax.tree.map(lambda a: jnp.broadcast_to(a, (r,) + a.shape), one)
    table = vtlb_mod.init(c.max_seqs, c.num_layers, c.groups_per_rank, c.max_pages_per_seq, c.page_size)
    table = jax.tree.map(lambda a: jnp.broadcast_to(a, (r,) + a.shape), table)
    kmin, kmax = quest.init_summaries(c, r)
    state = CacheState(
        config=c, pb=pb, vtlb=table,
        pool_k=jnp.zeros((r, num_pool) + page_shape, sdt), pool_v=jnp.zeros((r, num_pool) + page_shape, sdt),
        kmin=kmin, kmax=kmax, sel=c.selection_rule.init(c, r),
        seqs=SeqTable(length=jnp.zeros(c.max_seqs, jnp.int32), flushed=jnp.zeros(c.max_seqs, jnp.int32),
                      active=jnp.zeros(c.max_seqs, bool), owner=own_rows(c.max_seqs, c.max_pages_per_seq)),
        clock=jnp.zeros((), jnp.int32),
        pool_ks=jnp.ones((r, num_pool) + scale_shape, jnp.float32) if scaled else None,
        pool_vs=jnp.ones((r, num_pool) + scale_shape, jnp.float32) if scaled else None,
        ring_k=jnp.zeros((r, c.ring_pages) + page_shape, dt) if ring_apart else None,
        ring_v=jnp.zeros((r, c.ring_pages) + page_shape, dt) if ring_apart else None)
    # committed to the device from the start, so the first donated call compiles the same program as later ones
    state = jax.device_put(state, jax.sharding.SingleDeviceSharding(device or jax.devices()[0]))
    hs = host_sharding(device)
    make = jax.jit(lambda shape, dtype, fill: jnp.full(shape, fill, dtype), static_argnums=(0, 1, 2),
                   out_shardings=hs)
    host = HostPool(k=make((r, c.host_pages) + page_shape, sdt, 0), v=make((r, c.host_pages) + page_shape, sdt, 0))
    if scaled:
        host = HostPool(host.k, host.v, make((r, c.host_pages) + scale_shape, jnp.float32, 1),
                        make((r, c.host_pages) + scale_shape, jnp.float32, 1))
    return state, host
