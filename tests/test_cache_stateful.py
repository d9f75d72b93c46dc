"""A stateful model of the cache manager (issue 23, part 3; shared prefixes, issue 24): hypothesis drives admit /
ingest / a decode step's sieve (PB-LRU access + vTLB update, as decode_layer.plan_layer does it) / release /
capacity refusals / save-restore, and the shared-prefix path (admit a prompt that attaches a stored prefix, prefill
the rest, store a sequence's complete pages, evict stored prefixes), against plain-Python models (slots, host page
holders, tests/pb_lru_model.PyPBLRU, tests/prefix_model.PrefixModel). The shared-prefix calls are the ones the
Generator makes: SparsePrefixes.admit / sources / stored / released around the backend's prefill_attach and
prefill_store (program.prefill_layer_from's cache side), per layer. After every step:
- vTLB and PB-LRU tags agree: vtlb[lid] == f  <=>  tag[f] == lid (DESIGN.md section 3) for slot LIDs; a tag whose
  seq field is a stored prefix page's id (>= max_seqs) has no vTLB entry and its id is held; no frame is owned
  twice and no LID is in two frames;
- the owner table (the LID seq field per page) names a sequence's attached pages, then the leading stored pages of
  its prompt that are its own after it is stored, by their ids and every other page by the slot; one id names one
  page (one page index, one set of host pages: its node's while the node is stored) in every sequence; an id is
  held by its node and by every sequence naming it, and an id nobody holds has no frame (emptied on release);
- host page reference counts are the holders' (every live sequence's table, every stored prefix node); a page
  with a holder is never on the free list, and free + held pages are the whole pool, each page once;
- the vTLB's host page table is the allocator's; a released sequence leaves nothing (frame, tag, length, summary);
- the prefix index is the model's (nodes, LRU order, payloads, its host-page budget);
- no shared page is written: a host page's K/V bytes are recorded when it becomes shared (stored by the index,
  attached to a sharer) and must not change until the page is free again, so a sharer's own tokens land on its
  own pages after the shared ones;
- the device PB-LRU equals the Python model's, and each sieve's frames and hits equal the model's (the sieve names
  pages through the owner table, as the decode does).
A save-restore rule does what Engine.restore does to the cache (the cache is not saved: every live sequence is
released, admitted again with its tokens as the prompt and prefilled from its saved K/V).

CI runs a short search (test_cache_manager_state_machine). The long run counts the rules it executed and keeps
running non-derandomized searches until it reaches a number of steps:
`ULACACHE_STATEFUL_TOTAL_STEPS=100000 pytest -s tests/test_cache_stateful.py -k long_run` (it prints the counts;
the last ones are in docs/BENCHMARKS.md). ULACACHE_STATEFUL_EXAMPLES / ULACACHE_STATEFUL_STEPS size the short run.
"""
import collections
import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from pb_lru_model import PyPBLRU
from prefix_model import PrefixModel, library_nodes
from ulacache_jax.cache import lid as lid_mod
from ulacache_jax.cache import pb_lru
from ulacache_jax.cache import vtlb as vtlb_mod
from ulacache_jax.runtime.backends import make_backend
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.runtime.generator import bucket_length
from ulacache_jax.runtime.prefix_cache import max_shared_pages, page_keys, prefix_bucket
from ulacache_jax.runtime.sequences import CapacityError
from ulacache_jax.runtime.tp import make_mesh

CFG = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=4, kv_heads_per_group=1, max_seqs=3, max_pages_per_seq=6,
                  page_size=4, num_buckets=2, slots_per_bucket=2, host_pages=40, token_budget=16, dtype="float32")
P = CFG.page_size
MAX_TOKENS = CFG.max_pages_per_seq * P                  # 24 (not a power of two: prefill buckets must stop at it)
G = CFG.groups_per_rank
LG = CFG.num_layers * G                                 # host pages per page of a sequence
EXAMPLES = int(os.environ.get("ULACACHE_STATEFUL_EXAMPLES", "40"))
STEPS = int(os.environ.get("ULACACHE_STATEFUL_STEPS", "40"))
TOTAL_STEPS = int(os.environ.get("ULACACHE_STATEFUL_TOTAL_STEPS", "0"))   # > 0: run the long search
N_ACCESS = 8                                            # LIDs per sieve batch (fixed: one compiled program)
K_TOKENS = MAX_TOKENS + P                               # tokens of a drawn K/V (covers a refused over-long ingest)
# prompts are cut from a few documents (and a small alphabet of tails) so that stored prefixes are hit often
DOCS = [[1000 * (d + 1) + i for i in range(MAX_TOKENS)] for d in range(3)]
BUDGETS = [None, LG, 3 * LG, 5 * LG]                    # host pages the stored prefixes may hold


@jax.jit
def _sieve(state, hi, lo, valid):
    """The decode's step 2 (decode_layer.plan_layer): PB-LRU access at the clock, the vTLB follows, clock + 1."""
    pb = jax.tree.map(lambda a: a[0], state.pb)
    pb, out = pb_lru.access(pb, hi, lo, valid, state.clock)
    table = vtlb_mod.apply_access(jax.tree.map(lambda a: a[0], state.vtlb), hi, lo, out, 0)
    state = state.__class__(**{**state.__dict__, "pb": jax.tree.map(lambda a: a[None], pb),
                               "vtlb": jax.tree.map(lambda a: a[None], table), "clock": state.clock + 1})
    return state, out


def _lid(seq, layer, group, tok) -> int:
    return seq << 44 | layer << 36 | group << 32 | tok


_SHARED = {"counts": collections.Counter()}    # the backend, its jitted prefill ops, how many times each rule ran


def _backend():
    """One sparse backend (CacheManager + the ops the program calls) per process, reset between examples: the stored
    prefixes are dropped and every slot released (jit caches stay warm)."""
    b = _SHARED.get("b")
    if b is None:
        b = _SHARED["b"] = make_backend("sparse", CFG, make_mesh(1))
        ops = b.ops
        # program.prefill_layer_from's cache side, one layer per call (layer, slot, start, length traced)
        _SHARED["attach"] = jax.jit(lambda s, h, layer, slot, src, start:
                                    ops.prefill_attach((s, h), layer, slot, src, start))
        _SHARED["store"] = jax.jit(lambda s, h, layer, slot, k, v, length, start:
                                   ops.prefill_store((s, h), layer, slot, k, v, length, start))
    old = _SHARED.pop("prefixes", None)
    m = b.manager
    try:
        for slot in list(m.alloc.pages_of):
            m.release(slot)
            if old is not None:
                old.released(slot)
        if old is not None:
            old.close()
        assert m.alloc.num_free == CFG.host_pages and not m.alloc.refs.any()
        assert (np.asarray(m.state.pb.stamp) < 0).all()
    except Exception:                  # a failed example left it inconsistent: a fresh one (recompiles)
        _SHARED.pop("b")
        return _backend()
    return b


@dataclasses.dataclass
class Seq:
    """The model of one live sequence: tokens reserved, its host page table [L, G, n] (first m pages attached),
    pages that are read-only for it (attached or stored as a prefix), its token ids and K (V = -K) so far."""
    tokens: int
    table: np.ndarray
    m: int = 0
    frozen: int = 0
    length: int = 0
    ids: list = dataclasses.field(default_factory=list)
    k: np.ndarray | None = None          # [L, K_TOKENS, KV, D]
    named: list = dataclasses.field(default_factory=list)   # model keys of the leading pages named by stored ids
    pending: bool = False                # admitted with a prompt (ids), not prefilled yet


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.b = _backend()
        self.m = self.b.manager
        self.prefixes = None                         # SparsePrefixes, made by the initialize rule (its budget)
        self.model = None                            # PrefixModel
        self.pb_model = PyPBLRU(CFG.num_buckets, CFG.slots_per_bucket)
        assert (np.asarray(self.m.state.pb.stamp) < 0).all()     # every example starts with an empty PB-LRU
        self.seqs: dict[int, Seq] = {}
        self.shared_bytes: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # host page -> K, V when it was shared
        self.rng = np.random.default_rng(0)
        real, m, model = type(self.m).release_owner, self.m, self.pb_model

        def release_owner(ident):            # an id given up: the model's frames of it are emptied too
            real(m, ident)
            model.release(ident)
        self.m.release_owner = release_owner

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _refs(self, extra=()) -> np.ndarray:
        return self.model.refs(CFG.host_pages, [s.table for s in self.seqs.values()] + list(extra))

    def _forget_free(self, refs) -> None:
        """Pages nobody holds may be allocated and written again: they stop being shared."""
        for page in [p for p in self.shared_bytes if refs[p] == 0]:
            del self.shared_bytes[page]

    def _new_k(self):
        return self.rng.standard_normal((CFG.num_layers, K_TOKENS, CFG.num_kv_heads, CFG.head_dim)).astype(np.float32)

    def _admit(self, tokens, prompt=None):
        """Generator.admit with shared prefixes on (SparsePrefixes.admit): the model predicts the pages attached,
        the stored prefixes the allocator reclaims, the slot, or the refusal. -> slot or None (refused)."""
        keys = []
        if prompt is not None:
            keys = self.model.match(prompt, max_shared_pages(len(prompt), P, MAX_TOKENS))
            keys = keys[:max_shared_pages(len(prompt), P, MAX_TOKENS, at_most=len(keys))]
        m = len(keys)
        shared = np.stack([self.model.nodes[k] for k in keys], -1) if keys else np.zeros((CFG.num_layers, G, 0), np.int32)
        n_pages = math.ceil(tokens / P)
        need = LG * (n_pages - m)
        slots_left = len(self.seqs) < CFG.max_seqs
        refs = self._refs([shared])
        free = int((refs == 0).sum())
        # HostAllocator.reclaim, LRU leaves first, only when giving up every stored page nobody else holds admits it
        reclaimable = sum(int((refs[np.asarray(t).reshape(-1)] == 1).sum()) for t in self.model.nodes.values())
        if slots_left and n_pages <= CFG.max_pages_per_seq and free < need <= free + reclaimable:
            while need > free and self.model.evict(need - free):
                refs = self._refs([shared])
                free = int((refs == 0).sum())
            self._forget_free(refs)
        free_pages = set(np.flatnonzero(self._refs([shared]) == 0).tolist())
        if n_pages > CFG.max_pages_per_seq or not slots_left or need > free:
            slots = list(self.m.alloc.free_slots)
            with pytest.raises(CapacityError):
                self.prefixes.admit(tokens, prompt)
            assert list(self.m.alloc.free_slots) == slots
            self._forget_free(self._refs())
            _SHARED["counts"]["admit_refused"] += 1
            return None
        expect = min(set(range(CFG.max_seqs)) - set(self.seqs))
        slot = self.prefixes.admit(tokens, prompt)
        assert slot == expect
        table = self.m.alloc.pages_of[slot].copy()
        assert table.shape == (CFG.num_layers, G, n_pages)
        np.testing.assert_array_equal(table[:, :, :m], shared)      # the stored prefix's pages, attached
        own = table[:, :, m:].reshape(-1).tolist()
        assert len(set(own)) == len(own) and set(own) <= free_pages, "an own page was not free"
        if m and any(np.isin(shared, s.table).any() for s in self.seqs.values()):
            _SHARED["counts"]["attached_beside_another_sharer"] += 1
        self.seqs[slot] = Seq(tokens, table, m=m, frozen=m, ids=list(prompt or []), pending=prompt is not None,
                              named=list(keys))
        _SHARED["counts"]["attached" if m else "admitted_unshared"] += 1
        return slot

    def _store_rest(self, slot, k, start, length):
        """Tokens [start, length) of `slot` through the backend's prefill_store, per layer, in the prefill's bucket
        (pages of P tokens where the bucket would pass the context)."""
        C = bucket_length(length - start, P)
        if start + C > MAX_TOKENS:
            C = P
        k = k.copy()
        k[:, :start] = 1e6            # not the sequence's K (read-only pages): a write of them would show
        state, host = self.m.state, self.m.host
        for s in range(start, length, C):
            for layer in range(CFG.num_layers):
                kc = jnp.asarray(k[layer, s:s + C])
                state, host = _SHARED["store"](state, host, layer, slot, kc, -kc, length, s)
        self.m.state, self.m.host = state, host

    def _prefill(self, slot, k=None):
        """Generator._prefill_shared's cache side: the attached pages read back (prefill_attach), the rest of the
        prompt stored from the first own page (prefill_store), then the prompt's complete pages stored."""
        s = self.seqs[slot]
        prompt, n = s.ids, len(s.ids)
        m, src = self.prefixes.sources(slot, prompt)
        assert src is None and m == s.m
        _SHARED["counts"]["prefilled_after_attached" if m else "prefilled_whole"] += 1
        start = m * P
        assert start + bucket_length(n - start, P) <= MAX_TOKENS or m == 0      # max_shared_pages' promise
        k = self._new_k() if k is None else k.copy()
        if m:
            hk, hv = np.asarray(self.m.host.k[0]), np.asarray(self.m.host.v[0])
            Tp = prefix_bucket(m, CFG.max_pages_per_seq) * P
            state, host = self.m.state, self.m.host
            for layer in range(CFG.num_layers):
                (state, host), kp, vp = _SHARED["attach"](state, host, layer, slot, jnp.zeros(Tp, jnp.int32), start)
                # the prefix operand is the attached pages' host K/V, token-major, heads in group order
                want_k = np.concatenate([hk[s.table[layer, :, p]][:, :, 0].transpose(1, 0, 2) for p in range(m)])
                want_v = np.concatenate([hv[s.table[layer, :, p]][:, :, 0].transpose(1, 0, 2) for p in range(m)])
                np.testing.assert_array_equal(np.asarray(kp)[:start], want_k)
                np.testing.assert_array_equal(np.asarray(vp)[:start], want_v)
                assert not np.asarray(kp)[start:].any() and not np.asarray(vp)[start:].any()
                k[layer, :start] = want_k
            self.m.state, self.m.host = state, host
        self._store_rest(slot, k, start, n)
        s.pending, s.length, s.k = False, n, k
        self._check_written(slot, start)
        self.prefixes.stored(slot, prompt, m, src)
        self.model.insert(prompt, n // P, s.table)
        s.frozen = max(s.frozen, n // P)
        self._name_stored(s, prompt)
        self._forget_free(self._refs())

    def _name_stored(self, s, prompt):
        """After SparsePrefixes.stored: the leading pages of the prompt that are stored nodes holding this
        sequence's own host pages are named by their ids."""
        s.named = []
        for i in range(len(prompt) // P):
            key = tuple(prompt[:(i + 1) * P])
            if key not in self.model.nodes or not np.array_equal(self.model.nodes[key], s.table[:, :, i]):
                break
            s.named.append(key)

    def _check_written(self, slot, start):
        """After an ingest or prefill from `start`: length, flushed, the complete pages' host K/V, the summaries."""
        s = self.seqs[slot]
        st_ = self.m.state
        assert int(st_.seqs.length[slot]) == s.length and int(st_.seqs.flushed[slot]) == s.length // P
        hk, hv = np.asarray(self.m.host.k[0]), np.asarray(self.m.host.v[0])
        kmin, kmax = np.asarray(st_.kmin[0, slot]), np.asarray(st_.kmax[0, slot])          # [L, G, P, g, D]
        for p in range(math.ceil(s.length / P)):
            for layer in range(CFG.num_layers):
                for g in range(G):
                    want = s.k[layer, p * P:min(s.length, (p + 1) * P), g:g + 1]
                    np.testing.assert_array_equal(kmin[layer, g, p], want.min(0))
                    np.testing.assert_array_equal(kmax[layer, g, p], want.max(0))
                    if (p + 1) * P <= s.length:
                        np.testing.assert_array_equal(hk[s.table[layer, g, p]], want)
                        np.testing.assert_array_equal(hv[s.table[layer, g, p]], -want)

    def _release(self, slot):
        """Generator.release: the backend's slot, then the prefix bookkeeping."""
        self.m.release(slot)
        self.prefixes.released(slot)
        self.pb_model.release(slot)
        self.seqs.pop(slot)
        self._forget_free(self._refs())
        s, t = self.m.state, self.m.state.vtlb
        assert (np.asarray(t.frame[0, slot]) == -1).all() and (np.asarray(t.host_page[0, slot]) == -1).all()
        assert int(s.seqs.length[slot]) == 0 and not bool(s.seqs.active[slot])
        assert not np.asarray(s.kmin[0, slot]).any() and not np.asarray(s.kmax[0, slot]).any()

    # ---- rules ------------------------------------------------------------------------------------------------
    @initialize(budget=st.sampled_from(BUDGETS), a=st.integers(P, MAX_TOKENS), b=st.integers(P, MAX_TOKENS))
    def two_prefilled_sequences(self, budget, a, b):
        """Shared prefixes on with a host-page budget; two prompts over one document admitted and prefilled, so the
        second attaches the first's stored pages and the sieve has pages to request from step one."""
        _SHARED["counts"]["two_prefilled_sequences"] += 1
        self.prefixes = _SHARED["prefixes"] = self.b.prefixes(budget)
        self.model = PrefixModel(P, LG, budget)
        for tokens in (a, b):
            slot = self._admit(tokens, DOCS[0][:tokens])
            if slot is not None:                     # (both may not fit the host pool)
                self._prefill(slot)

    @rule(tokens=st.integers(1, MAX_TOKENS + 8))
    def admit(self, tokens):
        """A sequence without a prompt (nothing to attach)."""
        _SHARED["counts"]["admit"] += 1
        self._admit(tokens)

    @rule(doc=st.integers(0, len(DOCS) - 1), a=st.integers(0, MAX_TOKENS),
          tail=st.lists(st.integers(0, 3), max_size=6), extra=st.integers(0, 6), now=st.booleans())
    def admit_prompt(self, doc, a, tail, extra, now):
        """A prompt (a document's first tokens and a tail), attaching the longest stored prefix of it; prefilled
        at once (as the Engine does) or by a later rule, other rules in between."""
        prompt = DOCS[doc][:a] + tail
        if not prompt:
            return
        _SHARED["counts"]["admit_prompt"] += 1
        slot = self._admit(len(prompt) + extra, prompt)
        if slot is not None and now:
            self._prefill(slot)

    @precondition(lambda self: any(s.pending for s in self.seqs.values()))
    @rule(data=st.data())
    def prefill(self, data):
        _SHARED["counts"]["prefill"] += 1
        self._prefill(data.draw(st.sampled_from(sorted(k for k, s in self.seqs.items() if s.pending))))

    @precondition(lambda self: any(not s.pending for s in self.seqs.values()))
    @rule(data=st.data())
    def ingest(self, data):
        """Tokens from the first page that is not read-only (0 for a sequence that shares nothing) to a drawn
        length: through CacheManager.ingest (in a drawn chunk) from 0, else through the prefill's store."""
        _SHARED["counts"]["ingest"] += 1
        slot = data.draw(st.sampled_from(sorted(k for k, s in self.seqs.items() if not s.pending)))
        s = self.seqs[slot]
        reserved = math.ceil(s.tokens / P) * P
        start = s.frozen * P
        if start >= reserved:
            return
        doc = data.draw(st.integers(0, len(DOCS) - 1))
        if start == 0:
            length = data.draw(st.integers(1, reserved + P))
            chunk = data.draw(st.sampled_from([MAX_TOKENS, 16, 8]))
            k = self._new_k()
            if length > reserved:
                with pytest.raises(CapacityError):
                    self.m.ingest(slot, jnp.asarray(k), jnp.asarray(k), length, chunk=chunk)
                return
            self.m.ingest(slot, jnp.asarray(k), jnp.asarray(-k), length, chunk=chunk)
        else:
            _SHARED["counts"]["ingest_after_shared"] += 1
            length = data.draw(st.integers(start + 1, reserved))
            k = s.k.copy()
            k[:, start:] = self._new_k()[:, start:]
            self._store_rest(slot, k, start, length)
        s.length, s.k = length, k
        s.ids = s.ids[:start] + DOCS[doc][start:length]
        self._check_written(slot, start)

    @precondition(lambda self: any(not s.pending and s.length >= P for s in self.seqs.values()))
    @rule(data=st.data())
    def store(self, data):
        """A sequence's complete pages stored as a prefix (SparsePrefixes.stored, as after a prefill)."""
        _SHARED["counts"]["store"] += 1
        slot = data.draw(st.sampled_from(sorted(k for k, s in self.seqs.items() if not s.pending and s.length >= P)))
        s = self.seqs[slot]
        prompt = s.ids[:s.length]
        self.prefixes.stored(slot, prompt, 0, None)
        self.model.insert(prompt, s.length // P, s.table)
        s.frozen = max(s.frozen, s.length // P)
        self._name_stored(s, prompt)
        self._forget_free(self._refs())

    @precondition(lambda self: self.model is not None and self.model.nodes)
    @rule(data=st.data())
    def evict(self, data):
        """Stored prefixes given up, least recently used first (as the budget and the allocator's reclaim do)."""
        _SHARED["counts"]["evict"] += 1
        pages = data.draw(st.integers(0, self.model.held + LG))
        assert self.prefixes.index.evict(pages) == self.model.evict(pages)
        self._forget_free(self._refs())

    @precondition(lambda self: any(s.length >= P for s in self.seqs.values()))
    @rule(data=st.data())
    def sieve(self, data):
        """One decode layer's page requests: flushed pages of the ingested sequences (attached ones included), each
        named by its owner (the slot or a stored page's id, decode_layer._sieve_pages), duplicates allowed."""
        _SHARED["counts"]["sieve"] += 1
        cands = [(slot, layer, g, p) for slot, s in self.seqs.items() for layer in range(CFG.num_layers)
                 for g in range(G) for p in range(s.length // P)]
        picks = data.draw(st.lists(st.sampled_from(cands), min_size=1, max_size=N_ACCESS))
        n = len(picks)
        picks = picks + [picks[0]] * (N_ACCESS - n)
        valid = np.arange(N_ACCESS) < n
        owner = np.asarray(self.m.state.seqs.owner)
        arr = np.asarray([(int(owner[a, d]), b, c, d) for a, b, c, d in picks], np.int64)
        if (arr[:n, 0] >= CFG.max_seqs).any():
            _SHARED["counts"]["sieve_shared_pages"] += 1
        hi, lo = lid_mod.pack(arr[:, 0], arr[:, 1], arr[:, 2], (arr[:, 3] * P).astype(np.uint32))
        lids = [_lid(a, b, c, d * P) for a, b, c, d in arr.tolist()]
        now = int(self.m.state.clock)
        self.m.state, out = _sieve(self.m.state, hi, lo, jnp.asarray(valid))
        frame, hit, _, _ = self.pb_model.access(lids, list(valid), now)
        np.testing.assert_array_equal(np.asarray(out.frame), frame)
        np.testing.assert_array_equal(np.asarray(out.hit), hit)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data):
        """Any sequence, sharer or owner, in any order."""
        _SHARED["counts"]["release"] += 1
        slot = data.draw(st.sampled_from(sorted(self.seqs)))
        if self.seqs[slot].m:
            _SHARED["counts"]["release_sharer"] += 1
        self._release(slot)

    @precondition(lambda self: self.seqs)
    @rule()
    def save_restore(self):
        """Engine.restore's cache side: every live sequence released, then admitted again (in slot order, so into
        the lowest free slots) with its tokens so far as the prompt (attaching what is stored) and prefilled from
        its saved K/V; a sequence with no tokens is admitted again only."""
        _SHARED["counts"]["save_restore"] += 1
        saved = [self.seqs[slot] for slot in sorted(self.seqs)]
        for slot in sorted(self.seqs):
            self._release(slot)
        for s in saved:
            ids = s.ids if s.pending else s.ids[:s.length]
            slot = self._admit(s.tokens, ids or None)
            if slot is not None and ids and not s.pending:
                self._prefill(slot, k=s.k)

    @rule(slot=st.integers(0, CFG.max_seqs - 1))
    def release_unknown(self, slot):
        _SHARED["counts"]["release_unknown"] += 1
        if slot in self.seqs:
            return
        with pytest.raises(ValueError, match="not admitted"):
            self.m.release(slot)

    # ---- invariants -------------------------------------------------------------------------------------------
    @invariant()
    def vtlb_and_tags_agree_no_frame_twice(self):
        frames = np.asarray(self.m.state.vtlb.frame[0])                  # [S, L, G, P]
        pb = self.m.state.pb
        tag_hi, tag_lo, stamp = (np.asarray(a[0]).reshape(-1) for a in (pb.tag_hi, pb.tag_lo, pb.stamp))
        owned = frames[frames >= 0]
        assert len(owned) == len(set(owned.tolist())), "a frame is owned twice"
        mapped = {}
        for (seq, layer, g, p), f in np.ndenumerate(frames):
            if f >= 0:
                assert stamp[f] >= 0, (seq, layer, g, p, f)
                assert (int(tag_hi[f]), int(tag_lo[f])) == (seq << 12 | layer << 4 | g, p * P)
                mapped[int(f)] = (seq, layer, g, p)
        held = self.prefixes.id_holders if self.prefixes is not None else {}
        live = np.flatnonzero(stamp >= 0)
        tags = [(int(tag_hi[f]), int(tag_lo[f])) for f in live]
        assert len(set(tags)) == len(tags), "a LID is in two frames"
        for f in live:
            seq = int(tag_hi[f]) >> 12
            if seq >= CFG.max_seqs:                  # a stored prefix page's id: frames in the tags only
                assert held.get(seq, 0) > 0, f"frame {f} holds a page of id {seq}, which nobody holds"
                assert int(f) not in mapped
                continue
            assert seq in self.seqs, f"frame {f} holds a page of released sequence {seq}"
            assert int(f) in mapped, f"tag in frame {f} has no vTLB entry"
        # the device PB-LRU is the model's
        for b in range(CFG.num_buckets):
            for s in range(CFG.slots_per_bucket):
                f = b * CFG.slots_per_bucket + s
                want = self.pb_model.tag[b][s] if self.pb_model.stamp[b][s] >= 0 else None
                got = (int(tag_hi[f]) << 32 | int(tag_lo[f])) if stamp[f] >= 0 else None
                assert got == want, (f, got, want)
                if want is not None:
                    assert stamp[f] == self.pb_model.stamp[b][s]

    @invariant()
    def owner_table_names_shared_pages_once(self):
        owner = np.asarray(self.m.state.seqs.owner)                          # [S, P]
        for slot in range(CFG.max_seqs):
            if slot not in self.seqs:
                assert (owner[slot] == slot).all(), f"released slot {slot} still names pages by {owner[slot]}"
        if self.model is None:
            return
        pre = self.prefixes
        names = {}                                                           # id -> (page, host pages [L, G])
        holders = collections.Counter(pre.ids.values())
        for slot, s in self.seqs.items():
            k = len(s.named)
            assert (owner[slot, k:] == slot).all(), (slot, owner[slot], k)
            ids = owner[slot, :k].tolist()
            assert all(i >= CFG.max_seqs for i in ids) and len(set(ids)) == k, (slot, ids)
            assert pre.owner_of.get(slot, []) == ids
            holders.update(ids)
            for i, (ident, key) in enumerate(zip(ids, s.named)):
                got = names.setdefault(ident, (i, s.table[:, :, i]))
                assert got[0] == i and np.array_equal(got[1], s.table[:, :, i]), f"id {ident} names two pages"
                lib = page_keys(list(key), P)[-1]
                if key in self.model.nodes and np.array_equal(self.model.nodes[key], s.table[:, :, i]) \
                        and lib in pre.ids:                                  # its stored node's id: one name
                    assert pre.ids[lib] == ident, (slot, i, pre.ids[lib], ident)
        for key, ident in pre.ids.items():                                   # a stored node: its pages
            node = pre.index.nodes[key]
            if ident in names:
                assert names[ident][0] == node.index and np.array_equal(names[ident][1], node.payload)
        assert dict(pre.id_holders) == dict(holders), "id holders are not the nodes and the sequences naming them"
        issued = set(range(CFG.max_seqs, pre._next_id))
        assert len(set(pre.free_ids)) == len(pre.free_ids) and not set(pre.free_ids) & set(holders)
        assert set(pre.free_ids) | set(holders) == issued, "an id was lost"

    @invariant()
    def host_pages_held_never_free_and_conserved(self):
        a = self.m.alloc
        if self.model is None:
            return
        refs = self._refs()
        np.testing.assert_array_equal(a.refs, refs, err_msg="reference counts are not the holders'")
        free = a.free_pages[:a.num_free].tolist()
        assert len(set(free)) == len(free), "a page is on the free list twice"
        assert not refs[free].any(), f"held pages on the free list: {[p for p in free if refs[p]]}"
        held = np.flatnonzero(refs > 0).tolist()
        assert sorted(free + held) == list(range(CFG.host_pages)), "host pages lost"
        hp = np.asarray(self.m.state.vtlb.host_page[0])                    # [S, L, G, P]
        active = np.asarray(self.m.state.seqs.active)
        assert sorted(a.pages_of) == sorted(self.seqs)
        for slot in range(CFG.max_seqs):
            if slot in self.seqs:
                t = self.seqs[slot].table
                np.testing.assert_array_equal(a.pages_of[slot], t)
                np.testing.assert_array_equal(hp[slot, :, :, :t.shape[-1]], t)
                assert (hp[slot, :, :, t.shape[-1]:] == -1).all() and active[slot]
            else:
                assert (hp[slot] == -1).all() and not active[slot]

    @invariant()
    def prefix_index_is_the_model(self):
        if self.model is None:
            return
        idx = self.prefixes.index
        idx.check()
        got = library_nodes(idx)
        assert [k for k, _ in got] == list(self.model.nodes), "stored prefixes or their LRU order differ"
        for (key, pages), want in zip(got, self.model.nodes.values()):
            np.testing.assert_array_equal(pages, want)
        assert idx.held_pages == self.model.held
        if self.model.budget is not None:
            assert idx.held_pages <= self.model.budget
        assert self.m.alloc.reclaim == idx.evict

    @invariant()
    def shared_pages_never_written(self):
        if self.model is None:
            return
        hk, hv = np.asarray(self.m.host.k[0]), np.asarray(self.m.host.v[0])
        refs = self._refs()
        shared = {int(p) for p in np.flatnonzero(refs > 1)}
        shared |= {int(p) for pages in self.model.nodes.values() for p in pages.reshape(-1)}
        shared |= {int(p) for s in self.seqs.values() for p in s.table[:, :, :s.frozen].reshape(-1)}
        for page, (k, v) in self.shared_bytes.items():
            assert refs[page] > 0
            np.testing.assert_array_equal(hk[page], k, err_msg=f"shared host page {page} was written")
            np.testing.assert_array_equal(hv[page], v, err_msg=f"shared host page {page} was written")
        for page in shared - set(self.shared_bytes):
            self.shared_bytes[page] = hk[page].copy(), hv[page].copy()
        _SHARED["counts"]["most_shared_pages_at_once"] = max(_SHARED["counts"]["most_shared_pages_at_once"],
                                                             len(self.shared_bytes))


CacheMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                          suppress_health_check=list(HealthCheck),
                                          derandomize="ULACACHE_STATEFUL_EXAMPLES" not in os.environ)
test_cache_manager_state_machine = CacheMachine.TestCase


def test_ingest_chunk_past_the_context_stays_on_its_pages():
    """Regression: CacheManager.ingest in chunks that do not divide the context (16-token chunks, 24-token context)
    wrote its last chunk onto earlier pages (ingest_chunk's slices clamp back at the end of the table)."""
    m = _backend().manager
    slot = m.admit(MAX_TOKENS)
    k = np.arange(CFG.num_layers * MAX_TOKENS * CFG.num_kv_heads * CFG.head_dim, dtype=np.float32)
    k = k.reshape(CFG.num_layers, MAX_TOKENS, CFG.num_kv_heads, CFG.head_dim)
    m.ingest(slot, jnp.asarray(k), jnp.asarray(-k), MAX_TOKENS, chunk=16)
    hk = np.asarray(m.host.k[0])
    pages = m.alloc.pages_of[slot]
    for p in range(CFG.max_pages_per_seq):
        for layer in range(CFG.num_layers):
            for g in range(G):
                np.testing.assert_array_equal(hk[pages[layer, g, p]], k[layer, p * P:(p + 1) * P, g:g + 1])
    m.release(slot)


@pytest.mark.skipif(TOTAL_STEPS <= 0, reason="the long run: set ULACACHE_STATEFUL_TOTAL_STEPS (e.g. 100000)")
def test_cache_manager_long_run():
    """Random (not derandomized) searches of 200 examples of up to 50 steps until TOTAL_STEPS rules have run."""
    counts = _SHARED["counts"]
    counts.clear()
    t0, searches = time.perf_counter(), 0
    while sum(v for k, v in counts.items() if k in RULES) < TOTAL_STEPS:
        run_state_machine_as_test(CacheMachine, settings=settings(
            max_examples=200, stateful_step_count=50, deadline=None, database=None,
            suppress_health_check=list(HealthCheck), derandomize=False))
        searches += 1
        print(f"search {searches}: {sum(counts[r] for r in RULES)} steps, {time.perf_counter() - t0:.0f} s",
              flush=True)
    print(f"long run: {sum(counts[r] for r in RULES)} steps in {searches} searches, {time.perf_counter() - t0:.0f} s;"
          f" per rule: {dict(sorted((k, v) for k, v in counts.items() if k in RULES))}; "
          f"outcomes: {dict(sorted((k, v) for k, v in counts.items() if k not in RULES))}")


RULES = ("two_prefilled_sequences", "admit", "admit_prompt", "prefill", "ingest", "store", "evict", "sieve", "release",
         "save_restore", "release_unknown")
