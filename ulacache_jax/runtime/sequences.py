"""Sequence admission, release and prefill ingestion.

Host-side bookkeeping (which slots and host pages are free) is plain Python (`HostAllocator`); the device-side
updates are pure functions of (state, host) that callers jit with the state and host pool donated
(`CacheManager` does that for you, per rank over a mesh). Host memory is allocated by page, so sequences of any
length share the host pool without fragmentation; every rank gets the same page indices in its own host pool.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import jax
import jax.numpy as jnp

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulacache_jax.cache.select.registry import kept_rules
from ulacache_jax.cache import lid as lid_mod
from ulacache_jax.cache import pb_lru
from ulacache_jax.cache import vtlb as vtlb_mod
from ulacache_jax.cache.state import CacheState, HostPool, ring_arrays, tail_frame, with_ring
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.pallas_kernels import page_copy
from ulacache_jax.runtime.tp import host_specs, TP_AXIS, init_sharded, make_mesh, per_rank, state_specs


class CapacityError(ValueError):
    """Admission would exceed a limit; the message names the limit and by how much. State is unchanged."""


class HostAllocator:
    """Free sequence slots and free host pages (the same indices on every rank)."""

    def __init__(self, config: CacheConfig):
        self.config = config
        self.free_slots: list[int] = list(range(config.max_seqs))[::-1]   # pop() gives the lowest slot
        self.free_pages = np.arange(config.host_pages, dtype=np.int32)[::-1].copy()
        self.num_free = config.host_pages                                  # free_pages[:num_free] are free
        self.pages_of: dict[int, np.ndarray] = {}                          # slot -> [L, G, n] host page ids
        # holders per host page (sequences using it + prefix-index nodes keeping it); a page is on the free list
        # iff its count is 0. `reclaim(pages)`, when set, asks the prefix index to give pages back before an
        # admission is refused for lack of host pages; `reclaimable()` (set with it) counts the pages giving up
        # every stored prefix would free. peak_used: the most host pages in use at once.
        self.refs = np.zeros(config.host_pages, np.int32)
        self.reclaim = None
        self.reclaimable = None
        self.peak_used = 0

    def pages_needed(self, num_tokens: int) -> int:
        c = self.config
        return c.num_layers * c.groups_per_rank * math.ceil(num_tokens / c.page_size)

    def check(self, num_tokens: int, shared_pages: int = 0, *, count_pages: bool = True) -> None:
        """Refuse (CapacityError) a sequence of num_tokens tokens whose first `shared_pages` pages are attached
        (count_pages=False: everything but the free host pages)."""
        c = self.config
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 1:
            raise ValueError(f"num_tokens = {num_tokens!r} must be an int >= 1")
        n_pages = math.ceil(num_tokens / c.page_size)
        if n_pages > c.max_pages_per_seq:
            raise CapacityError(f"sequence of {num_tokens} tokens needs {n_pages} pages, over max_pages_per_seq = "
                                f"{c.max_pages_per_seq} by {n_pages - c.max_pages_per_seq} "
                                f"(max context {c.max_context} tokens)")
        if not self.free_slots:
            raise CapacityError(f"all max_seqs = {c.max_seqs} sequence slots are in use (over by 1)")
        need = self.pages_needed(num_tokens) - c.num_layers * c.groups_per_rank * shared_pages
        if count_pages and need > self.num_free:
            raise CapacityError(f"sequence of {num_tokens} tokens needs {need} host pages but only {self.num_free} "
                                f"of host_pages = {c.host_pages} are free (short by {need - self.num_free})")

    def reserve(self, num_tokens: int, shared: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """-> (slot, table [L, G, max_pages_per_seq] int32 of host page ids, -1 past the sequence). shared [L, G, m]:
        host pages of the sequence's first m pages, attached (one more holder each), not allocated."""
        c = self.config
        m = 0 if shared is None else shared.shape[-1]
        if shared is not None:
            if shared.shape != (c.num_layers, c.groups_per_rank, m) or np.any(self.refs[shared.reshape(-1)] < 1):
                raise ValueError(f"shared pages {shared.shape} must be [L, G, m] = [{c.num_layers}, "
                                 f"{c.groups_per_rank}, m] pages that are held")
            self.retain(shared)              # held first: a reclaim below cannot free them
        try:
            self.check(num_tokens, m, count_pages=False)
            need = self.pages_needed(num_tokens) - c.num_layers * c.groups_per_rank * m
            # stored prefixes are given up only when that admits the sequence: a refusal changes nothing
            if self.reclaim is not None and self.num_free < need <= self.num_free + self.reclaimable():
                while need > self.num_free and self.reclaim(need - self.num_free):
                    pass
            self.check(num_tokens, m)
        except Exception:
            if shared is not None:
                self.drop(shared)
            raise
        n_pages = math.ceil(num_tokens / c.page_size)
        slot = self.free_slots.pop()
        taken = self.free_pages[self.num_free - need:self.num_free][::-1].copy()
        self.num_free -= need
        self.refs[taken] = 1
        self.peak_used = max(self.peak_used, c.host_pages - self.num_free)
        own = taken.reshape(c.num_layers, c.groups_per_rank, n_pages - m)
        self.pages_of[slot] = own if shared is None else np.concatenate([shared.astype(np.int32), own], axis=-1)
        table = np.full((c.num_layers, c.groups_per_rank, c.max_pages_per_seq), -1, np.int32)
        table[:, :, :n_pages] = self.pages_of[slot]
        return slot, table

    def retain(self, pages: np.ndarray) -> None:
        """One more holder of each page (a sharer or a prefix-index node); the pages must be allocated."""
        flat = np.asarray(pages, np.int32).reshape(-1)
        if np.any(self.refs[flat] < 1):
            raise ValueError("retain: a page that is not allocated (free pages cannot be shared)")
        np.add.at(self.refs, flat, 1)

    def drop(self, pages: np.ndarray) -> None:
        """One holder fewer of each page; pages nobody holds any more return to the free list."""
        flat = np.asarray(pages, np.int32).reshape(-1)
        np.subtract.at(self.refs, flat, 1)
        if np.any(self.refs[flat] < 0):
            raise ValueError("drop: a page dropped more often than it was held")
        gone = flat[self.refs[flat] == 0]
        freed = gone[np.sort(np.unique(gone, return_index=True)[1])]      # each once, in the order given
        self.free_pages[self.num_free:self.num_free + len(freed)] = freed
        self.num_free += len(freed)

    def free(self, slot: int) -> None:
        if slot not in self.pages_of:
            raise ValueError(f"slot {slot} is not admitted (admitted: {sorted(self.pages_of)})")
        self.drop(self.pages_of.pop(slot).reshape(-1)[::-1])
        self.free_slots.append(slot)
        self.free_slots.sort(reverse=True)


def admit_device(state: CacheState, slot, table, owner=None) -> CacheState:
    """Device side of admission: the slot's host page table (same on every rank), an empty sequence. owner
    [max_pages_per_seq] int32: the LID seq field of each of its pages (None: the slot itself everywhere; a shared
    prefix's first pages are named by their stored ids, see `set_owner_device`)."""
    r = state.config.tp
    host_page = state.vtlb.host_page.at[:, slot].set(jnp.broadcast_to(table, (r,) + table.shape))
    frame = state.vtlb.frame.at[:, slot].set(-1)
    row = jnp.full(state.seqs.owner.shape[1:], slot, jnp.int32) if owner is None else owner
    seqs = dataclasses.replace(state.seqs, length=state.seqs.length.at[slot].set(0),
                               flushed=state.seqs.flushed.at[slot].set(0), active=state.seqs.active.at[slot].set(True),
                               owner=state.seqs.owner.at[slot].set(row))
    return dataclasses.replace(state, vtlb=dataclasses.replace(state.vtlb, frame=frame, host_page=host_page), seqs=seqs)


def release_device(state: CacheState, slot) -> CacheState:
    """Free a slot's frames (PB-LRU slots and vTLB entries), host page table, summaries and sequence row. Frames
    of shared prefix pages (LIDs whose seq field is a stored id, not the slot) are not the slot's: they stay, for
    the other sharers (`release_owner_device` clears them when the id is given up)."""
    pb = jax.vmap(pb_lru.release_traced, in_axes=(0, None))(state.pb, jnp.asarray(slot, jnp.uint32))
    table = jax.vmap(vtlb_mod.release, in_axes=(0, None))(state.vtlb, slot)
    seqs = dataclasses.replace(state.seqs, length=state.seqs.length.at[slot].set(0),
                               flushed=state.seqs.flushed.at[slot].set(0), active=state.seqs.active.at[slot].set(False),
                               owner=state.seqs.owner.at[slot].set(slot))
    state = dataclasses.replace(state, pb=pb, vtlb=table, seqs=seqs)
    for rule in kept_rules(state.config):    # the summaries, the rule's own state
        state = rule.release(state, slot)
    return state


def set_owner_device(state: CacheState, slot, owner) -> CacheState:
    """The LID seq field of each page of `slot`: owner [max_pages_per_seq] int32 (the slot, or stored ids)."""
    return dataclasses.replace(state, seqs=dataclasses.replace(state.seqs, owner=state.seqs.owner.at[slot].set(owner)))


def release_owner_device(state: CacheState, ident) -> CacheState:
    """Empty every PB-LRU frame tagged with LID seq field `ident` (a stored prefix page's id), on every rank: run
    before the id names another page, so no stale tag can hand a new page an old page's bytes. The vTLB holds no
    entry for such LIDs (they lie outside its slots), so only the tags change."""
    pb = jax.vmap(pb_lru.release_traced, in_axes=(0, None))(state.pb, jnp.asarray(ident, jnp.uint32))
    return dataclasses.replace(state, pb=pb)


def split_groups(config: CacheConfig, x):
    """[..., KV, D] -> [..., R, G, g, D]: KV heads to (rank, local group, head in group)."""
    c = config
    return x.reshape(x.shape[:-2] + (c.tp, c.groups_per_rank, c.kv_heads_per_group, c.head_dim))


def block_pages(config: CacheConfig, x):
    """Prefill K or V [Lc, C, KV, D] (C whole pages) -> [R, Lc, G, n, page, g, D] in the model's dtype: the layout
    the selection rules' `ingest` takes."""
    c = config
    L, C = x.shape[0], x.shape[1]
    x = x.astype(c.jnp_dtype).reshape(L, C // c.page_size, c.page_size, c.num_kv_heads, c.head_dim)
    return split_groups(c, x).transpose(3, 0, 4, 1, 2, 5, 6)


def ingest_rules(state: CacheState, rules, slot, layer0, kp, start, length):
    """Each of `rules`' `ingest` of a prefill block kp [R, Lc, G, n, page, g, D] (layers [layer0, layer0 + Lc),
    tokens [start, start + n * page), start page-aligned) of a prompt `length` long; a sequence's first block
    starts at 0."""
    n, page = kp.shape[3], kp.shape[4]
    tok = start + jnp.arange(n * page).reshape(n, page)                              # [n, page]
    live = tok < jnp.minimum(length, start + n * page)
    for rule in rules:
        state = rule.ingest(state, slot, layer0, start // page, kp, live, jnp.asarray(start) == 0)
    return state


def reingest_selection(state: CacheState, slot, k, start, length, *, layer0):
    """The selection rule's `ingest` of a stored prefill block again: k [Lc, C, KV, D] tokens [start, start + C) of
    layers [layer0, layer0 + Lc). A sharer's rest is stored before its attached prefix is read (program.py's order:
    the host pool is written before it is read), but a rule that calibrates on the prompt's first tokens (online
    label channels) picks its channels when the prefix is attached: the rest is encoded again with them."""
    c = state.config
    return ingest_rules(state, (c.selection_rule,), slot, layer0, block_pages(c, k), start, length)


def ingest_chunk(state: CacheState, host: HostPool, slot, k, v, start, length, *, layer0: int = 0,
                 impl: str = "auto"):
    """Write prefill K/V of tokens [start, start + C) of sequence `slot` into the cache.

    k, v [Lc, C, KV, D] for layers [layer0, layer0 + Lc) (C a multiple of page_size; start page-aligned and
    start + C <= max_context, else the slices clamp back onto earlier pages; tokens at or past `length`, the
    sequence's total prompt length, are padding). `layer0` may be traced, so one compiled
    per-layer prefill serves every layer. Complete pages go to the host pool (write-through), the page holding the
    last token, if partial, goes to the tail ring; summaries are filled for every page touched. The sequence's
    length becomes min(length, start + C) and its flushed count the complete pages. Returns (state, host)."""
    c = state.config
    L, C = k.shape[0], k.shape[1]
    page, R, G = c.page_size, c.tp, c.groups_per_rank
    n = C // page
    p0 = start // page
    kp, vp = block_pages(c, k), block_pages(c, v)                                    # [R, L, G, n, page, g, D]
    end = jnp.minimum(length, start + C)
    page_ids = p0 + jnp.arange(n)
    has_tok = page_ids * page < end                                                  # [n]
    zero = jnp.zeros((), jnp.int32)
    at = (zero, jnp.asarray(slot, jnp.int32), jnp.asarray(layer0, jnp.int32), zero, jnp.asarray(p0, jnp.int32))

    complete = (page_ids + 1) * page <= end                                          # [n]
    partial = has_tok & ~complete
    # host write-through of complete pages: src rows [R][L*G*n], host ids from the vTLB
    host_ids = jax.lax.dynamic_slice(state.vtlb.host_page, at, (R, 1, L, G, n))[:, 0]           # [R, L, G, n]
    host_ids = jnp.where(complete[None, None, None, :], host_ids, -1).reshape(R, L * G * n)
    src_idx = jnp.arange(L * G * n, dtype=jnp.int32)
    page_shape = (L * G * n, page, c.kv_heads_per_group, c.head_dim)
    # the page format (cache/codec.py): complete pages are encoded once here, on their way to the host pool
    enc = c.codec.encode(kp.reshape((R,) + page_shape), vp.reshape((R,) + page_shape), c.jnp_dtype)   # [R, L*G*n, ..]
    arrays = host.arrays()
    for r in range(R):
        # the rank is indexed inside the kernel (rank=r): no XLA slice or stack of the pinned_host pool, which
        # XLA may run as host copies of the whole pool (page_copy's contract)
        pages = [x[r] for x in enc.arrays()]
        arrays = page_copy.flush(arrays, pages, src_idx, host_ids[r], rank=r, impl=impl)   # K and V: one launch
    host = HostPool.of(arrays)
    # the partial last page goes to its tail-ring frame (the ring holds pages in the model's dtype, or encoded
    # token by token where it lives in the pool: the same values for a codec without scales)
    li, gi, ni = jnp.meshgrid(jnp.arange(L), jnp.arange(G), jnp.arange(n), indexing="ij")
    frames = tail_frame(c, slot, layer0 + li, gi, p0 + ni)                                    # [L, G, n]
    ring_k, ring_v = ring_arrays(state)
    frames = jnp.where(partial[None, None, :], frames, ring_k.shape[1]).reshape(-1)
    ring_k = ring_k.at[:, frames].set(kp.reshape((R,) + page_shape).astype(ring_k.dtype), mode="drop")
    ring_v = ring_v.at[:, frames].set(vp.reshape((R,) + page_shape).astype(ring_v.dtype), mode="drop")
    state = with_ring(state, ring_k, ring_v)
    seqs = dataclasses.replace(state.seqs, length=state.seqs.length.at[slot].set(end),
                               flushed=state.seqs.flushed.at[slot].set(end // page))
    state = dataclasses.replace(state, seqs=seqs)
    # the summaries of every page touched, the rule's own state (a sequence's first block: start 0)
    state = ingest_rules(state, kept_rules(c), slot, layer0, kp, start, length)
    return state, host


class CacheManager:
    """Owns one cache (device state, host pool, allocator) over a mesh and the jitted, donating entry points
    around it. Every entry point runs per rank under `jax.shard_map` over the mesh's "tp" axis (a single device
    is a mesh of one): the state and host pool are sharded by rank, no collective runs. Host bookkeeping
    (`HostAllocator`) is shared: every rank uses the same host page indices in its own pool."""

    def __init__(self, config: CacheConfig, *, mesh: Mesh | None = None, impl: str = "auto"):
        self.config, self.impl = config, impl
        self.mesh = make_mesh(config.tp) if mesh is None else mesh
        self.state, self.host = init_sharded(config, self.mesh)
        self.alloc = HostAllocator(config)
        self.specs = st = state_specs(self.state)
        hs, r, mesh = host_specs(config), P(), self.mesh
        # outputs placed by their specs explicitly: on a mesh of one an inferred sharding comes back as an
        # equivalent but different one, and the next program to see the state would compile again
        sh = jax.tree.map(lambda s: NamedSharding(mesh, s), st, is_leaf=lambda x: isinstance(x, P))
        self._admit = jax.jit(per_rank(admit_device, mesh, config, (st, r, r, r), st), donate_argnums=0,
                              out_shardings=sh)
        self._set_owner = jax.jit(per_rank(set_owner_device, mesh, config, (st, r, r), st), donate_argnums=0,
                                  out_shardings=sh)
        self._release_owner = jax.jit(per_rank(release_owner_device, mesh, config, (st, r), st), donate_argnums=0,
                                      out_shardings=sh)
        self._release = jax.jit(per_rank(release_device, mesh, config, (st, r), st), donate_argnums=0,
                                out_shardings=sh)

        def ingest(s, h, slot, k, v, start, length):
            return ingest_chunk(s, h, slot, k, v, start, length, impl=impl)
        kv = P(None, None, TP_AXIS)      # prefill K/V [L, C, KV, D] split on KV heads, like the k/v projections
        self._ingest = jax.jit(per_rank(ingest, mesh, config, (st, hs, r, kv, kv, r, r), (st, hs)),
                               donate_argnums=(0, 1), out_shardings=(sh, self.host_shardings()))

    def host_shardings(self) -> HostPool:
        return jax.tree.map(lambda x: x.sharding, self.host)

    def admit(self, num_tokens: int, shared: np.ndarray | None = None, owner: np.ndarray | None = None) -> int:
        """Reserve a slot and host pages for a sequence of up to num_tokens tokens (prompt + new tokens); shared
        [L, G, m]: host pages of its first m pages, attached instead of allocated (HostAllocator.reserve); owner
        [k] int: the LID seq field of its first k pages (stored prefix ids; the slot itself past them)."""
        slot, table = self.alloc.reserve(num_tokens, shared)
        self.state = self._admit(self.state, slot, jnp.asarray(table), jnp.asarray(self.owner_row(slot, owner)))
        return slot

    def owner_row(self, slot: int, owner=None) -> np.ndarray:
        """[max_pages_per_seq] int32: `owner` (the LID seq field of the first pages), then `slot` for the rest."""
        c = self.config
        row = np.full(c.max_pages_per_seq, slot, np.int32)
        if owner is not None and len(owner):
            ids = np.asarray(owner, np.int64)
            if len(ids) > c.max_pages_per_seq or ids.min() < 0 or ids.max() >= lid_mod.FIELD_LIMITS["seq"]:
                raise ValueError(f"owner ids {ids.tolist()} must be at most max_pages_per_seq = "
                                 f"{c.max_pages_per_seq} LID seq fields in [0, {lid_mod.FIELD_LIMITS['seq'] - 1}]")
            row[:len(ids)] = ids
        return row

    def host_pages(self, slot: int) -> np.ndarray:
        """The host page ids of an admitted slot [L, G, n] (its shared prefix pages first), as the allocator holds
        them: callers copy what they keep."""
        return self.alloc.pages_of[slot]

    def set_owner(self, slot: int, owner) -> None:
        """Name the first len(owner) pages of an admitted slot by the LID seq fields `owner` (the rest by the slot)."""
        if slot not in self.alloc.pages_of:
            raise ValueError(f"slot {slot} is not admitted")
        self.state = self._set_owner(self.state, slot, jnp.asarray(self.owner_row(slot, owner)))

    def release_owner(self, ident: int) -> None:
        """Empty every frame (all ranks) of the pages named by LID seq field `ident`, a stored prefix page's id in
        [max_seqs, 2**20): before the id is reused."""
        if not self.config.max_seqs <= ident < lid_mod.FIELD_LIMITS["seq"]:
            raise ValueError(f"owner id {ident} must be in [max_seqs = {self.config.max_seqs}, "
                             f"{lid_mod.FIELD_LIMITS['seq']}) (a slot's frames are released with the slot)")
        self.state = self._release_owner(self.state, ident)

    def release(self, slot: int) -> None:
        self.alloc.free(slot)
        self.state = self._release(self.state, slot)

    def ingest(self, slot: int, k, v, length: int, chunk: int | None = None) -> None:
        """Prefill K/V [L, T, KV, D] of a whole prompt, in page-aligned chunks of `chunk` tokens (padded)."""
        c = self.config
        T = k.shape[1]
        if length > T:
            raise ValueError(f"length = {length} exceeds the {T} tokens of K/V given")
        if slot not in self.alloc.pages_of:
            raise ValueError(f"slot {slot} is not admitted")
        have = self.alloc.pages_of[slot].shape[-1] * c.page_size
        if length > have:
            raise CapacityError(f"prompt of {length} tokens exceeds the {have} tokens reserved at admission")
        chunk = chunk or max(c.page_size, 1 << max(0, (T - 1).bit_length()))
        chunk = -(-chunk // c.page_size) * c.page_size
        for start in range(0, length, chunk):
            size = min(chunk, c.max_context - start)   # a chunk past the context would clamp its slices back
            kc, vc = k[:, start:start + size], v[:, start:start + size]   # onto earlier pages (ingest_chunk)
            pad = size - kc.shape[1]
            if pad:
                kc = jnp.pad(kc, ((0, 0), (0, pad), (0, 0), (0, 0)))
                vc = jnp.pad(vc, ((0, 0), (0, pad), (0, 0), (0, 0)))
            self.state, self.host = self._ingest(self.state, self.host, slot, kc, vc, start, length)
