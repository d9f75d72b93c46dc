"""A stateful model of the cache manager (issue 23, part 3): hypothesis drives admit / ingest / a decode step's
sieve (PB-LRU access + vTLB update, as decode_layer.plan_layer does it) / release / capacity refusals against a
plain-Python model (slots, host pages, tests/pb_lru_model.PyPBLRU). After every step:
- vTLB and PB-LRU tags agree: vtlb[lid] == f  <=>  tag[f] == lid (DESIGN.md section 3);
- no frame is owned twice;
- host pages are conserved (free + owned = all, disjoint) and the vTLB's host page table is the allocator's;
- a released sequence leaves nothing (no frame, tag, host page, length or summary);
- the device PB-LRU equals the Python model's, and each sieve's frames and hits equal the model's.
A save-restore rule does what Engine.restore does to the cache (the cache is not saved: every live sequence is
released and admitted + ingested again from its saved tokens), and the invariants must hold after it.

CI runs a short search (test_cache_manager_state_machine). The long run counts the rules it executed and keeps
running non-derandomized searches until it reaches a number of steps:
`ULACACHE_STATEFUL_TOTAL_STEPS=100000 pytest -s tests/test_cache_stateful.py -k long_run` (it prints the counts;
the last ones are in docs/BENCHMARKS.md). ULACACHE_STATEFUL_EXAMPLES / ULACACHE_STATEFUL_STEPS size the short run.
"""
import collections
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
from ulacache_jax import lid as lid_mod, pb_lru, vtlb as vtlb_mod
from ulacache_jax.config import CacheConfig
from ulacache_jax.sequences import CacheManager, CapacityError

CFG = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=4, kv_heads_per_group=1, max_seqs=3, max_pages_per_seq=6,
                  page_size=4, num_buckets=2, slots_per_bucket=2, host_pages=40, token_budget=16, dtype="float32")
MAX_TOKENS = CFG.max_pages_per_seq * CFG.page_size      # 24
G = CFG.groups_per_rank
EXAMPLES = int(os.environ.get("ULACACHE_STATEFUL_EXAMPLES", "12"))
STEPS = int(os.environ.get("ULACACHE_STATEFUL_STEPS", "25"))
TOTAL_STEPS = int(os.environ.get("ULACACHE_STATEFUL_TOTAL_STEPS", "0"))   # > 0: run the long search
N_ACCESS = 8                                            # LIDs per sieve batch (fixed: one compiled program)


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


_SHARED = {"counts": collections.Counter()}    # the manager, and how many times each rule ran


def _manager() -> CacheManager:
    """One CacheManager per process, reset between examples by releasing its slots (jit caches stay warm)."""
    m = _SHARED.get("m")
    if m is None:
        m = _SHARED["m"] = CacheManager(CFG)
    for slot in list(m.alloc.pages_of):
        m.release(slot)
    return m


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = _manager()
        self.clock0 = int(self.m.state.clock)
        self.pb_model = PyPBLRU(CFG.num_buckets, CFG.slots_per_bucket)
        self._sync_model_pb()
        self.seqs: dict[int, dict] = {}          # slot -> {"tokens": reserved, "length": ingested}
        self.free_pages = CFG.host_pages
        self.rng = np.random.default_rng(0)

    def _sync_model_pb(self):
        # the shared manager starts each example with its PB-LRU empty (every slot released); check, then mirror
        st_ = self.m.state.pb
        assert (np.asarray(st_.stamp) < 0).all()

    # ---- rules ------------------------------------------------------------------------------------------------
    @rule(tokens=st.integers(1, MAX_TOKENS + 8))
    def admit(self, tokens):
        _SHARED["counts"]["admit"] += 1
        self._admit(tokens)

    def _admit(self, tokens):
        n_pages = math.ceil(tokens / CFG.page_size)
        need = CFG.num_layers * G * n_pages
        refuse = n_pages > CFG.max_pages_per_seq or len(self.seqs) == CFG.max_seqs or need > self.free_pages
        if refuse:
            before = (self.m.alloc.num_free, list(self.m.alloc.free_slots))
            with pytest.raises(CapacityError):
                self.m.admit(tokens)
            assert (self.m.alloc.num_free, list(self.m.alloc.free_slots)) == before   # state unchanged
            return
        expect = min(set(range(CFG.max_seqs)) - set(self.seqs))
        slot = self.m.admit(tokens)
        assert slot == expect
        self.seqs[slot] = {"tokens": tokens, "length": 0, "k": None}
        self.free_pages -= need

    @initialize(a=st.integers(CFG.page_size, MAX_TOKENS), b=st.integers(CFG.page_size, MAX_TOKENS))
    def two_prefilled_sequences(self, a, b):
        """Start with two sequences admitted and prefilled, so the sieve has pages to request from step one."""
        _SHARED["counts"]["two_prefilled_sequences"] += 1
        for tokens in (a, b):
            self._admit(tokens)
            slot = max(self.seqs)
            self._ingest(slot, tokens)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def ingest(self, data):
        _SHARED["counts"]["ingest"] += 1
        slot = data.draw(st.sampled_from(sorted(self.seqs)))
        reserved = math.ceil(self.seqs[slot]["tokens"] / CFG.page_size) * CFG.page_size
        self._ingest(slot, data.draw(st.integers(1, reserved + CFG.page_size)))

    def _ingest(self, slot, length, k=None):
        reserved = math.ceil(self.seqs[slot]["tokens"] / CFG.page_size) * CFG.page_size
        if k is None:
            k = jnp.asarray(self.rng.standard_normal((CFG.num_layers, MAX_TOKENS + CFG.page_size, CFG.num_kv_heads,
                                                      CFG.head_dim)), jnp.float32)
        if length > reserved:
            with pytest.raises(CapacityError):
                self.m.ingest(slot, k, k, length, chunk=MAX_TOKENS)
            return
        self.m.ingest(slot, k, -k, length, chunk=MAX_TOKENS)
        self.seqs[slot]["length"], self.seqs[slot]["k"] = length, k
        s = self.m.state.seqs
        assert int(s.length[slot]) == length and int(s.flushed[slot]) == length // CFG.page_size
        # the complete pages went to their host pages
        pages = self.m.alloc.pages_of[slot]                      # [L, G, n]
        hk, hv = np.asarray(self.m.host.k[0]), np.asarray(self.m.host.v[0])
        kk = np.asarray(k)
        for p in range(length // CFG.page_size):
            for layer in range(CFG.num_layers):
                for g in range(G):
                    want = kk[layer, p * CFG.page_size:(p + 1) * CFG.page_size, g:g + 1]
                    np.testing.assert_array_equal(hk[pages[layer, g, p]], want)
                    np.testing.assert_array_equal(hv[pages[layer, g, p]], -want)

    @precondition(lambda self: any(s["length"] >= CFG.page_size for s in self.seqs.values()))
    @rule(data=st.data())
    def sieve(self, data):
        """One decode layer's page requests: flushed pages of the ingested sequences, duplicates allowed."""
        _SHARED["counts"]["sieve"] += 1
        cands = [(slot, layer, g, p) for slot, s in self.seqs.items() for layer in range(CFG.num_layers)
                 for g in range(G) for p in range(s["length"] // CFG.page_size)]
        picks = data.draw(st.lists(st.sampled_from(cands), min_size=1, max_size=N_ACCESS))
        n = len(picks)
        picks = picks + [picks[0]] * (N_ACCESS - n)
        valid = np.arange(N_ACCESS) < n
        arr = np.asarray(picks, np.int64)
        hi, lo = lid_mod.pack(arr[:, 0], arr[:, 1], arr[:, 2], (arr[:, 3] * CFG.page_size).astype(np.uint32))
        lids = [_lid(a, b, c, d * CFG.page_size) for a, b, c, d in picks]
        now = int(self.m.state.clock)
        self.m.state, out = _sieve(self.m.state, hi, lo, jnp.asarray(valid))
        frame, hit, _, _ = self.pb_model.access(lids, list(valid), now)
        np.testing.assert_array_equal(np.asarray(out.frame), frame)
        np.testing.assert_array_equal(np.asarray(out.hit), hit)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data):
        _SHARED["counts"]["release"] += 1
        slot = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = self.seqs.pop(slot)["tokens"]
        self.m.release(slot)
        self.pb_model.release(slot)
        self.free_pages += CFG.num_layers * G * math.ceil(tokens / CFG.page_size)
        s, t = self.m.state, self.m.state.vtlb
        assert (np.asarray(t.frame[0, slot]) == -1).all() and (np.asarray(t.host_page[0, slot]) == -1).all()
        assert int(s.seqs.length[slot]) == 0 and not bool(s.seqs.active[slot])
        assert not np.asarray(s.kmin[0, slot]).any() and not np.asarray(s.kmax[0, slot]).any()

    @precondition(lambda self: self.seqs)
    @rule()
    def save_restore(self):
        """Engine.restore's cache side: every live sequence released, then admitted again (in slot order, so into
        the lowest free slots) and ingested from its saved K/V to its saved length."""
        _SHARED["counts"]["save_restore"] += 1
        saved = [(slot, dict(self.seqs[slot])) for slot in sorted(self.seqs)]
        for slot, _ in saved:
            self.m.release(slot)
            self.pb_model.release(slot)
            self.free_pages += CFG.num_layers * G * math.ceil(self.seqs.pop(slot)["tokens"] / CFG.page_size)
        for slot, s in saved:
            self._admit(s["tokens"])
            new = max(self.seqs)
            if s["length"]:
                self._ingest(new, s["length"], k=s["k"])

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
                assert (int(tag_hi[f]), int(tag_lo[f])) == (seq << 12 | layer << 4 | g, p * CFG.page_size)
                mapped[int(f)] = (seq, layer, g, p)
        for f in np.flatnonzero(stamp >= 0):
            seq = int(tag_hi[f]) >> 12
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
    def host_pages_conserved(self):
        a = self.m.alloc
        free = a.free_pages[:a.num_free].tolist()
        owned = [int(x) for pages in a.pages_of.values() for x in pages.reshape(-1)]
        assert a.num_free == self.free_pages
        assert sorted(free + owned) == list(range(CFG.host_pages)), "host pages lost or duplicated"
        hp = np.asarray(self.m.state.vtlb.host_page[0])                    # [S, L, G, P]
        active = np.asarray(self.m.state.seqs.active)
        for slot in range(CFG.max_seqs):
            if slot in a.pages_of:
                n = a.pages_of[slot].shape[-1]
                np.testing.assert_array_equal(hp[slot, :, :, :n], a.pages_of[slot])
                assert (hp[slot, :, :, n:] == -1).all() and active[slot]
            else:
                assert (hp[slot] == -1).all() and not active[slot]
        assert sorted(a.pages_of) == sorted(self.seqs)


CacheMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                          suppress_health_check=list(HealthCheck), derandomize=EXAMPLES <= 12)
test_cache_manager_state_machine = CacheMachine.TestCase


@pytest.mark.skipif(TOTAL_STEPS <= 0, reason="the long run: set ULACACHE_STATEFUL_TOTAL_STEPS (e.g. 100000)")
def test_cache_manager_long_run():
    """Random (not derandomized) searches of 200 examples of up to 50 steps until TOTAL_STEPS rules have run."""
    counts = _SHARED["counts"]
    counts.clear()
    t0, searches = time.perf_counter(), 0
    while sum(counts.values()) < TOTAL_STEPS:
        run_state_machine_as_test(CacheMachine, settings=settings(
            max_examples=200, stateful_step_count=50, deadline=None, database=None,
            suppress_health_check=list(HealthCheck), derandomize=False))
        searches += 1
        print(f"search {searches}: {sum(counts.values())} steps, {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"long run: {sum(counts.values())} steps in {searches} searches, {time.perf_counter() - t0:.0f} s; "
          f"per rule: {dict(sorted(counts.items()))}")
