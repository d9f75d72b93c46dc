"""The vTLB: a dense translation table from a page's logical id to where the page lives.

Indexed by (seq slot, layer, local group, page) with page = tok // page_size, it gives the HBM frame (>= 0
resident, -1 not) and the host page index (an index, not a byte offset: bytes overflow int32; -1 unallocated).
It changes only for the LIDs a PB-LRU access filled or evicted, so after every operation, for every slot LID
(seq field < max_seqs)
    vtlb.frame[lid] == f  <=>  pb_lru.tag[f] == lid.
A page of a stored shared prefix is named by the prefix page's id (seq field in [max_seqs, 2**20); the owner table
in cache_state.SeqTable), which lies outside the table (`index` says not inside): `apply_access` ignores it, so
its frame lives in the PB-LRU tags only. The decode takes frames from the PB-LRU access, never from `frame`; the
host page of every page, shared or not, is read from the sequence's own row here.
One rank's table; the cache state stacks ranks. `group_base` is the first global group this rank owns (LIDs keep
the global group id so all ranks share one address space).
"""
from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import jax
import jax.numpy as jnp

from ulacache_jax.cache import lid as lid_mod
from ulacache_jax.cache.pb_lru import AccessOut


@partial(jax.tree_util.register_dataclass, data_fields=["frame", "host_page"], meta_fields=["page_size"])
@dataclasses.dataclass(frozen=True)
class VTLB:
    frame: jax.Array      # [max_seqs, num_layers, num_groups, max_pages_per_seq] int32, -1 = not in HBM
    host_page: jax.Array  # [max_seqs, num_layers, num_groups, max_pages_per_seq] int32, -1 = no host page
    page_size: int


def init(max_seqs: int, num_layers: int, num_groups: int, max_pages_per_seq: int, page_size: int) -> VTLB:
    for name, v, limit in (("max_seqs", max_seqs, lid_mod.FIELD_LIMITS["seq"]),
                           ("num_layers", num_layers, lid_mod.FIELD_LIMITS["layer"]),
                           ("num_groups", num_groups, lid_mod.FIELD_LIMITS["group"]),
                           ("max_pages_per_seq", max_pages_per_seq, 2**31 - 1),
                           ("page_size", page_size, 2**31 - 1)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not (1 <= v <= limit):
            raise ValueError(f"{name} = {v!r} must be an int in [1, {limit}]")
    if max_pages_per_seq * page_size > 2**32:
        raise ValueError(f"max_pages_per_seq * page_size = {max_pages_per_seq * page_size} exceeds 2**32 tokens "
                         "(the tok field of a LID)")
    shape = (max_seqs, num_layers, num_groups, max_pages_per_seq)
    return VTLB(frame=jnp.full(shape, -1, jnp.int32), host_page=jnp.full(shape, -1, jnp.int32),
                page_size=int(page_size))


def index(vtlb: VTLB, hi, lo, group_base=0):
    """(hi, lo) [N] -> flat index into the table [N] int32, and whether the LID lies inside the table [N]."""
    seq, layer, group, tok = lid_mod.unpack(hi, lo)
    s, l, g, p = vtlb.frame.shape
    page = (tok // np.uint32(vtlb.page_size)).astype(jnp.int32)
    group = group - group_base
    inside = (seq < s) & (layer < l) & (group >= 0) & (group < g) & (page < p) & (page >= 0)
    flat = ((seq * l + layer) * g + group) * p + page
    return jnp.where(inside, flat, 0), inside


def translate(vtlb: VTLB, hi, lo, group_base=0):
    """(hi, lo) [N] uint32 -> (resident [N] bool, frame [N] int32, host_page [N] int32).

    Concrete LIDs outside the table raise ValueError; traced ones read as not resident with host_page -1."""
    flat, inside = index(vtlb, hi, lo, group_base)
    if not isinstance(inside, jax.core.Tracer) and not bool(np.all(np.asarray(inside))):
        bad = int(np.argmin(np.asarray(inside)))
        seq, layer, group, tok = (int(np.asarray(a)[bad]) for a in lid_mod.unpack(hi, lo))
        raise ValueError(f"LID {bad} (seq={seq}, layer={layer}, group={group}, tok={tok}) lies outside the vTLB "
                         f"of shape {vtlb.frame.shape} (page_size {vtlb.page_size}, group_base {group_base})")
    frame = jnp.where(inside, vtlb.frame.reshape(-1)[flat], -1)
    host = jnp.where(inside, vtlb.host_page.reshape(-1)[flat], -1)
    return frame >= 0, frame, host


@jax.jit
def apply_access(vtlb: VTLB, hi, lo, out: AccessOut, group_base=0) -> VTLB:
    """Record a PB-LRU access: evicted LIDs become non-resident, filled LIDs map to their new frames.
    Evicted and filled LIDs are disjoint (a resident LID in the batch is a hit, never a candidate), and the
    requests of one filled LID share its frame, so both go in one scatter (one launch a decode layer, not two):
    no index gets two different values."""
    size = vtlb.frame.size
    ev_flat, ev_in = index(vtlb, out.evicted_hi, out.evicted_lo, group_base)
    flat, inside = index(vtlb, hi, lo, group_base)
    filled = ~out.hit & (out.frame >= 0) & inside
    at = jnp.concatenate([jnp.where(out.evicted & ev_in, ev_flat, size), jnp.where(filled, flat, size)])   # [2N]
    val = jnp.concatenate([jnp.full_like(out.frame, -1), out.frame])
    frame = vtlb.frame.reshape(-1).at[at].set(val, mode="drop")
    return dataclasses.replace(vtlb, frame=frame.reshape(vtlb.frame.shape))


@jax.jit
def release(vtlb: VTLB, seq) -> VTLB:
    """Forget every page of sequence slot `seq` (its frames are emptied by pb_lru.release)."""
    return dataclasses.replace(vtlb, frame=vtlb.frame.at[seq].set(-1), host_page=vtlb.host_page.at[seq].set(-1))
