"""The prefix index: prompts that start with the same complete pages share them instead of prefilling them again.

A prompt is cut into page-aligned blocks of `page_size` tokens; block i is named by a hash chained over every
block before it (`page_keys`), so one key names one whole prefix. An index node per stored block keeps the
block's tokens (a lookup is verified on the tokens themselves: a hash collision can only miss, never give wrong
K/V), its parent's key and a payload saying where the block's K/V live:
- sparse (UlaCache): the host page ids [L, G] of the block (the same on every rank). The index holds one
  reference on each of them in the `HostAllocator`, so a stored prefix outlives the sequence that computed it;
  a page returns to the free list only when no sequence and no index node holds it. The node's page also has
  one name in HBM: an id every sharer's LIDs use (`SparsePrefixes`), so one frame serves every sharer.
- dense: the set of sequence slots whose HBM rows hold the block (nothing is held: a slot's rows stay valid
  until they are written again, and `forget_slot` drops them then). A dense sharer copies the rows instead of
  recomputing them.

Only complete pages are stored, and at most (len(prompt) - 1) // page_size of them are matched, so every sharer
prefills at least its last token (the first sampled token needs its logits) and its own tokens start on its
own page after the shared ones: a shared page is never written again.

Eviction is least recently used, whole leaves first: a lookup or insert touches a path leaf to root, so a node is
always more recent than its descendants and the oldest node is a leaf (evicting it never strands a child). The
budget is in host pages held by the index (`budget_pages`); the allocator also asks the index to give pages back
(`reclaim`) before it refuses an admission for lack of host pages.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Callable

import numpy as np
import jax
import jax.numpy as jnp

from ulacache_jax.cache.codec import Pages
from ulacache_jax.cache.lid import FIELD_LIMITS
from ulacache_jax.cache.select.registry import kept_rules
from ulacache_jax.models.attention import blocked_attention
from ulacache_jax.pallas_kernels import pick_impl
from ulacache_jax.pallas_kernels.page_copy import copy_pages_pallas, ref_copy_pages

_ROOT = b""


def page_keys(tokens, page_size: int, num_pages: int | None = None) -> list[bytes]:
    """Chained keys of the first `num_pages` complete pages of `tokens` (default: all complete pages): key i is a
    hash of key i - 1 and the tokens of page i, so it names the whole prefix up to the end of page i."""
    if page_size < 1:
        raise ValueError(f"page_size = {page_size} must be >= 1")
    toks = np.asarray(tokens, np.int64)
    full = len(toks) // page_size
    n = full if num_pages is None else min(num_pages, full)
    keys, prev = [], _ROOT
    for i in range(n):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(toks[i * page_size:(i + 1) * page_size].tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


@dataclasses.dataclass
class Node:
    """One stored page of a prefix: its chained key, its parent's key, its index in the chain, its tokens (the
    lookup checks them), its payload (sparse: host page ids [L, G]; dense: a set of slots) and its child count."""
    key: bytes
    parent: bytes
    index: int
    tokens: np.ndarray        # [page_size] int64
    payload: object
    size: int                 # host pages this node holds (sparse: L * G; dense: 0)
    children: int = 0


@dataclasses.dataclass
class PrefixStats:
    """Counters of one index: prompt tokens attached instead of prefilled, prompt tokens prefilled, host pages not
    allocated thanks to sharing, lookups and hits, nodes evicted."""
    hit_tokens: int = 0
    prefill_tokens: int = 0
    saved_host_pages: int = 0
    lookups: int = 0
    hits: int = 0
    evicted: int = 0

    def minus(self, other: "PrefixStats") -> "PrefixStats":
        return PrefixStats(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                              for f in dataclasses.fields(self)})


class PrefixIndex:
    """Stored prefixes by chained page key (see the module docstring).

    page_size: tokens per page. budget_pages: host pages the index may hold (None: no limit beyond what the
    allocator reclaims). retain(payload) / release(payload): take and give back the index's reference on a node's
    payload (sparse: the allocator's page reference counts; dense: nothing). removed(node): called after a node
    left the index (sparse: gives up the node's hold on its page id)."""

    def __init__(self, page_size: int, *, budget_pages: int | None = None,
                 retain: Callable[[object], None] = lambda p: None, release: Callable[[object], None] = lambda p: None,
                 removed: Callable[[Node], None] = lambda n: None):
        if budget_pages is not None and budget_pages < 0:
            raise ValueError(f"budget_pages = {budget_pages} must be >= 0 or None")
        self.page_size, self.budget_pages = page_size, budget_pages
        self._retain, self._release, self._removed = retain, release, removed
        self.nodes: collections.OrderedDict[bytes, Node] = collections.OrderedDict()   # oldest first
        self.held_pages = 0
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self.nodes)

    # ---- lookup ----------------------------------------------------------------------------------------------
    def match(self, prompt, *, max_pages: int | None = None) -> list[Node]:
        """The stored nodes of the longest stored prefix of `prompt`, in page order (verified on the tokens), at
        most (len(prompt) - 1) // page_size pages and at most `max_pages`. Touches the path (recently used)."""
        P = self.page_size
        n = (len(prompt) - 1) // P if len(prompt) else 0
        if max_pages is not None:
            n = min(n, max_pages)
        toks = np.asarray(prompt, np.int64)
        out = []
        for i, key in enumerate(page_keys(toks, P, n)):
            node = self.nodes.get(key)
            if node is None or not np.array_equal(node.tokens, toks[i * P:(i + 1) * P]):
                break
            out.append(node)
        self._touch(out)
        return out

    def _touch(self, path: list[Node]) -> None:
        for node in reversed(path):          # leaf first: every node ends more recent than its descendants
            self.nodes.move_to_end(node.key)

    # ---- insert ----------------------------------------------------------------------------------------------
    def insert(self, prompt, num_pages: int, payload_of: Callable[[int], object], *, size: int = 0,
               merge: Callable[[Node, int], None] | None = None) -> int:
        """Store the first `num_pages` complete pages of `prompt`. A page already stored is kept (and `merge(node,
        i)` called: the dense index adds a slot); a new one gets `payload_of(i)`, retained. Then evicts down to the
        budget. -> pages newly stored."""
        P = self.page_size
        toks = np.asarray(prompt, np.int64)
        path, added, parent = [], 0, _ROOT
        for i, key in enumerate(page_keys(toks, P, num_pages)):
            block = toks[i * P:(i + 1) * P]
            node = self.nodes.get(key)
            if node is not None and not np.array_equal(node.tokens, block):
                break                        # a hash collision: keep the stored one, store nothing past it
            if node is None:
                payload = payload_of(i)
                self._retain(payload)
                node = Node(key, parent, i, block.copy(), payload, size)
                self.nodes[key] = node
                self.held_pages += size
                if parent != _ROOT:
                    self.nodes[parent].children += 1
                added += 1
            elif merge is not None:
                merge(node, i)
            path.append(node)
            parent = key
        self._touch(path)
        if self.budget_pages is not None:
            self.evict(self.held_pages - self.budget_pages)
        return added

    # ---- eviction ----------------------------------------------------------------------------------------------
    def remove(self, node: Node) -> None:
        """Drop one leaf node and its reference on the payload."""
        if node.children:
            raise ValueError(f"node {node.index} has {node.children} stored children: evict leaves first")
        del self.nodes[node.key]
        if node.parent != _ROOT and node.parent in self.nodes:
            self.nodes[node.parent].children -= 1
        self.held_pages -= node.size
        self.stats.evicted += 1
        self._release(node.payload)
        self._removed(node)

    def evict(self, pages: int) -> int:
        """Evict least recently used leaves until `pages` host pages are given up (or the index is empty).
        -> pages given up (to the allocator; a page still used by a live sequence stays allocated)."""
        given = 0
        while given < pages and self.nodes:
            node = next(iter(self.nodes.values()))    # the oldest node is a leaf (see _touch)
            self.remove(node)
            given += node.size
        return given

    def clear(self) -> None:
        self.evict(self.held_pages + len(self.nodes) + 1)
        while self.nodes:                             # size-0 nodes (dense)
            self.remove(next(iter(self.nodes.values())))

    def prune(self, keep: Callable[[Node], bool]) -> None:
        """Remove every node for which keep(node) is False, and its descendants (deepest first)."""
        doomed = {k for k, n in self.nodes.items() if not keep(n)}
        if not doomed:
            return
        changed = True
        while changed:                                # descendants of a doomed node are doomed too
            changed = False
            for k, n in self.nodes.items():
                if k not in doomed and n.parent in doomed:
                    doomed.add(k)
                    changed = True
        for node in sorted((self.nodes[k] for k in doomed), key=lambda n: -n.index):
            self.remove(node)
            self.stats.evicted -= 1                   # invalidated, not evicted for room

    def check(self) -> None:
        """Internal consistency (tests): child counts, parents present, held pages, LRU order (node after its
        descendants)."""
        kids = collections.Counter(n.parent for n in self.nodes.values() if n.parent != _ROOT)
        for k, n in self.nodes.items():
            assert n.children == kids.get(k, 0), (n.index, n.children, kids.get(k, 0))
            assert n.parent == _ROOT or n.parent in self.nodes, f"node {n.index} lost its parent"
        assert self.held_pages == sum(n.size for n in self.nodes.values())
        order = {k: i for i, k in enumerate(self.nodes)}
        for k, n in self.nodes.items():
            if n.parent != _ROOT:
                assert order[n.parent] > order[k], f"node {n.index} is more recent than its parent"


# ---- sizing ----------------------------------------------------------------------------------------------------
def max_shared_pages(num_tokens: int, page_size: int, max_context: int, at_most: int | None = None) -> int:
    """The most whole pages of a prompt of num_tokens tokens that may be shared, at most `at_most` (the pages the
    index matched): at least its last token is prefilled, and the rest, bucketed to a power of two
    (bucket_length), must fit the context after them (the prefill writes its whole bucket: past max_context a
    slice would clamp onto earlier pages). The rule is not monotone in the page count (fewer shared pages leave a
    longer rest, whose bucket may double), so it is checked for the count actually shared."""
    m = max(0, (num_tokens - 1) // page_size)
    if at_most is not None:
        m = min(m, at_most)
    while m > 0:
        rest = num_tokens - m * page_size
        if m * page_size + max(page_size, 1 << max(0, (rest - 1).bit_length())) <= max_context:
            return m
        m -= 1
    return 0


def prefix_bucket(pages: int, max_pages: int) -> int:
    """Pages of the shared-prefix operand of a prefill: a power of two >= pages, at most max_pages (few shapes)."""
    return min(max(1, 1 << max(0, (pages - 1).bit_length())), max_pages)


# ---- host halves: what a backend keeps about its shared prefixes --------------------------------------------------
class SparsePrefixes:
    """UlaCache's stored prefixes: an index node holds the host pages [L, G] of one page of a prompt (one reference
    each, in the allocator). A new sequence's first pages are attached at admission (its vTLB rows point at the
    stored host pages; nothing is allocated or written for them) and its prefill computes only the rest.

    One page, one name: a node gets an id in [max_seqs, 2**20) (the LID seq field past every slot), and every
    sequence whose vTLB rows point at the node's host pages names that page by the id (the owner table,
    cache_state.SeqTable.owner): its LIDs are (id, layer, global group, page * page_size), so the PB-LRU sees one
    page and one HBM frame serves every sharer. The sequence that stored a page switches to the id too (right after
    its prefill, which fills no frame). An id is held by its node and by every live sequence naming a page by it;
    when the last holder goes, its frames are emptied on every rank (CacheManager.release_owner) before the id
    returns to the free list, so a reused id never finds another page's bytes under its tags. A sequence names a
    page by a node's id only where its own host pages are the node's, so whoever fills the frame fills it with the
    same bytes."""

    def __init__(self, manager, budget_pages: int | None = None):
        c = manager.config
        self.manager, self.config = manager, c
        alloc = manager.alloc
        self.index = PrefixIndex(c.page_size, budget_pages=budget_pages, retain=alloc.retain, release=alloc.drop,
                                 removed=self._node_removed)
        alloc.reclaim, alloc.reclaimable = self.index.evict, self._reclaimable
        self._attached: dict[int, tuple[int, bytes]] = {}     # slot -> (pages attached, key of the last one)
        self.ids: dict[bytes, int] = {}                        # node key -> its id (given when first named)
        self.id_holders: collections.Counter[int] = collections.Counter()   # id -> node (0/1) + sequences naming it
        self.owner_of: dict[int, list[int]] = {}                # slot -> the ids naming its first pages
        self.free_ids: list[int] = []                           # released ids (frames emptied), reused first
        self._id_by_page: dict[int, int] = {}                  # first host page of a held id's page -> the id
        self._page_of_id: dict[int, int] = {}
        self._next_id = c.max_seqs

    # ---- page ids ----------------------------------------------------------------------------------------------
    def _id_of(self, node: Node) -> int:
        """The node's id, given on first use (held by the node until it is removed). A node stored again over
        host pages that a live sequence still names by an id (its earlier node was evicted) gets that id back."""
        ident = self.ids.get(node.key)
        if ident is None:
            page = int(np.asarray(node.payload).reshape(-1)[0])
            ident = self._id_by_page.get(page)
            if ident is None and self.free_ids:
                ident = self.free_ids.pop()
            elif ident is None:
                if self._next_id >= FIELD_LIMITS["seq"]:
                    raise RuntimeError(f"stored prefix page ids exhausted ({FIELD_LIMITS['seq'] - self.config.max_seqs}"
                                       " ids in use: the LID seq field has 20 bits)")
                ident, self._next_id = self._next_id, self._next_id + 1
            self._id_by_page[page], self._page_of_id[ident] = ident, page
            self.ids[node.key] = ident
            self.id_holders[ident] += 1
        return ident

    def _drop_id(self, ident: int) -> None:
        self.id_holders[ident] -= 1
        if self.id_holders[ident] == 0:
            del self.id_holders[ident]
            del self._id_by_page[self._page_of_id.pop(ident)]
            self.manager.release_owner(ident)                  # its frames emptied on every rank before reuse
            self.free_ids.append(ident)

    def _node_removed(self, node: Node) -> None:
        ident = self.ids.pop(node.key, None)
        if ident is not None:
            self._drop_id(ident)

    def _name(self, slot: int, ids: list[int], *, device: bool = True) -> None:
        """`slot`'s first len(ids) pages named by `ids` (held), the ids it named before given up."""
        old = self.owner_of.pop(slot, [])
        for ident in ids:
            self.id_holders[ident] += 1
        if ids:
            self.owner_of[slot] = list(ids)
        if device and ids != old:
            self.manager.set_owner(slot, ids)
        for ident in old:
            self._drop_id(ident)

    def admit(self, num_tokens: int, prompt) -> int:
        """Admit a sequence, its prompt's stored prefix attached and named by the stored pages' ids. -> slot."""
        c = self.config
        nodes = []
        if prompt is not None:
            self.index.stats.lookups += 1
            nodes = self.index.match(prompt, max_pages=max_shared_pages(len(prompt), c.page_size, c.max_context))
            nodes = nodes[:max_shared_pages(len(prompt), c.page_size, c.max_context, at_most=len(nodes))]
            if len(nodes) * c.page_size < c.selection_rule.calibration_tokens(c):
                nodes = []     # the rule calibrates on more of the prompt than this prefix: prefill it whole
        shared = np.stack([n.payload for n in nodes], axis=-1) if nodes else None     # [L, G, m]
        ids = [self._id_of(n) for n in nodes]
        for ident in ids:              # held first: a reclaim evicting these nodes cannot release the ids
            self.id_holders[ident] += 1
        try:
            slot = self.manager.admit(num_tokens, shared, np.asarray(ids, np.int32) if ids else None)
        except Exception:
            for ident in ids:
                self._drop_id(ident)
            raise
        if ids:
            self.owner_of[slot] = ids                           # admit wrote the owner row
        if nodes:
            self._attached[slot] = (len(nodes), nodes[-1].key)
        return slot

    def sources(self, slot: int, prompt) -> tuple[int, np.ndarray | None]:
        """-> (pages attached to `slot` at admission, None): its prefill starts after them."""
        m, key = self._attached.pop(slot, (0, b""))
        if m and page_keys(prompt, self.config.page_size, m)[-1:] != [key]:
            raise ValueError(f"slot {slot} was admitted with a {m}-page prefix that this prompt does not start with")
        return m, None

    def stored(self, slot: int, prompt, m: int, src) -> None:
        """After the prefill of `slot`: its prompt's complete pages become stored prefixes, and the slot names each
        of its leading pages that is a stored node's (its host pages are the node's) by the node's id. (The prefill
        fills no PB-LRU frame, so no frame is left under the slot's own LIDs; where one is, as when this runs later,
        it only holds the same host page's bytes until it is evicted or the slot released.)"""
        c = self.config
        pages = self.manager.host_pages(slot)                                              # [L, G, n]
        n = len(prompt) // c.page_size
        self.index.insert(prompt, n, lambda i: pages[:, :, i].copy(), size=c.num_layers * c.groups_per_rank)
        ids = []
        for key in page_keys(prompt, c.page_size, n):
            node = self.index.nodes.get(key)
            if node is None or not np.array_equal(node.payload, pages[:, :, len(ids)]):
                break                                   # ids name a leading run of pages (the owner row's prefix)
            ids.append(self._id_of(node))
        self._name(slot, ids)

    def released(self, slot: int) -> None:
        """After the backend released `slot` (its owner row is back to the slot): its ids given up."""
        self._attached.pop(slot, None)
        self._name(slot, [], device=False)

    def _reclaimable(self) -> int:
        """Host pages that evicting every stored prefix would free: stored pages no sequence holds (each host page
        belongs to at most one node: a prompt that attached stored pages keeps their nodes when it is stored)."""
        refs = self.manager.alloc.refs
        return sum(int((refs[n.payload.reshape(-1)] == 1).sum()) for n in self.index.nodes.values())

    def saved_host_pages(self, m: int) -> int:
        return m * self.config.num_layers * self.config.groups_per_rank

    def close(self) -> None:
        """Drop every stored prefix; a live sequence goes back to naming every page by its own slot, so every id
        is released (its frames emptied) and a later SparsePrefixes over this cache can give the ids again."""
        self.index.clear()
        for slot in list(self.owner_of):
            self._name(slot, [])
        self.manager.alloc.reclaim = self.manager.alloc.reclaimable = None


class DensePrefixes:
    """The dense baseline's stored prefixes: an index node lists the slots whose HBM rows hold one page of a
    prompt. A sharer copies those rows into its own (sharing = copying the stored K/V instead of recomputing it:
    every sequence keeps its whole K/V in HBM) and prefills the rest. A slot's rows stay valid after its release
    until a prefill writes them again (`stored` forgets them first)."""

    def __init__(self, config, budget_pages: int | None = None):
        self.config = config
        self.index = PrefixIndex(config.page_size)

    def admit(self, num_tokens: int, prompt) -> None:
        return None                                            # nothing to attach: rows are copied at prefill

    def sources(self, slot: int, prompt) -> tuple[int, np.ndarray | None]:
        """-> (pages to copy, source slot per page [m]): the slot itself where it already holds the page."""
        c = self.config
        self.index.stats.lookups += 1
        nodes = self.index.match(prompt, max_pages=max_shared_pages(len(prompt), c.page_size, c.max_context))
        nodes = nodes[:max_shared_pages(len(prompt), c.page_size, c.max_context, at_most=len(nodes))]
        return len(nodes), np.asarray([slot if slot in n.payload else min(n.payload) for n in nodes], np.int32)

    def stored(self, slot: int, prompt, m: int, src) -> None:
        """After the prefill of `slot` (rows [0, m) pages copied from src, the rest written): forget what its rows
        held before, then store its prompt's complete pages."""
        kept = m if src is None else next((i for i, s in enumerate(src) if s != slot), m)
        for node in list(self.index.nodes.values()):
            if node.index >= kept:
                node.payload.discard(slot)
        self.index.prune(lambda n: bool(n.payload))
        self.index.insert(prompt, len(prompt) // self.config.page_size, lambda i: {slot},
                          merge=lambda node, i: node.payload.add(slot))

    def released(self, slot: int) -> None:
        """Nothing: the rows stay valid until the slot is prefilled again."""

    def saved_host_pages(self, m: int) -> int:
        return 0

    def close(self) -> None:
        self.index.clear()


# ---- traced halves: the shared prefix inside one layer's prefill -------------------------------------------------
def _gather_host(host, ids, impl: str):
    """Host pages -> device: host [R, H, ...] (every array of the stored pages: codes, and scales of a scaled
    codec), ids [R, N] (-1: zeros) -> Pages with a leading [R, N]."""
    R, N = ids.shape
    arrays = host.arrays()
    outs = []
    for r in range(R):
        dst = [jnp.zeros((N,) + a.shape[2:], a.dtype) for a in arrays]
        idx = jnp.arange(N, dtype=jnp.int32)
        if pick_impl(impl) == "ref":
            outs.append(ref_copy_pages(dst, arrays, ids[r], idx, src_rank=r))
        else:    # the host pool is read in place over PCIe (page_copy's contract: no XLA gather of pinned_host)
            outs.append(copy_pages_pallas(dst, arrays, ids[r], idx, src_rank=r, name="prefix_pages"))
    return Pages.of([jnp.stack([o[a] for o in outs]) for a in range(len(arrays))])


def sparse_attach(state, host, layer, slot, start, num_tokens: int, *, impl: str = "auto"):
    """One layer of a sequence's attached prefix (its first `start` tokens, whole pages): its K/V read from the host
    pool through the sequence's vTLB rows, and its selection state filled in by every kept rule's `attach` (the
    page summaries, min/max of K, as ingestion computes them; the rule's own). num_tokens: static length of the
    prefix operand (a multiple of page_size >= start).
    -> (state, k, v [num_tokens, KVr, D]; rows at or past `start` are zeros)."""
    c = state.config
    R, G, P = c.tp, c.groups_per_rank, c.page_size
    n = num_tokens // P
    zero = jnp.zeros((), jnp.int32)
    at = (zero, jnp.asarray(slot, jnp.int32), jnp.asarray(layer, jnp.int32), zero, zero)
    ids = jax.lax.dynamic_slice(state.vtlb.host_page, at, (R, 1, 1, G, n))[:, 0, 0]            # [R, G, n]
    live = jnp.arange(n) * P < start                                                           # [n]
    ids = jnp.where(live[None, None], ids, -1).reshape(R, G * n)
    # stored pages decoded by the page format (cache/codec.py): the model's dtype for attention and the rules
    kp, vp = c.codec.decode(_gather_host(host, ids, impl), c.jnp_dtype)                       # [R, G*n, P, g, D]
    kp = kp.reshape(R, G, n, P, c.kv_heads_per_group, c.head_dim)
    vp = vp.reshape(R, G, n, P, c.kv_heads_per_group, c.head_dim)
    for rule in kept_rules(c):    # the summaries (as ingestion computes them), the selection rule's own state
        state = rule.attach(state, slot, layer, kp, live)

    def tokens(x):    # [R, G, n, P, g, D] -> [n * P, R * G * g, D] (KV heads in split_groups order)
        return x.transpose(2, 3, 0, 1, 4, 5).reshape(n * P, R * G * c.kv_heads_per_group, c.head_dim)
    return state, tokens(kp), tokens(vp)


def dense_attach(ck, cv, slot, src, start):
    """One layer of the dense cache: rows [0, start) of `slot` copied from the slots that hold them. ck, cv
    [S, T_max, KVr, D]; src [Tp] int32 source slot per token (Tp static). -> (ck, cv, k, v [Tp, KVr, D])."""
    Tp, T_max = src.shape[0], ck.shape[1]
    tok = jnp.arange(Tp)
    live = tok < start
    s = jnp.where(live, src, slot)
    kp, vp = ck[s, tok], cv[s, tok]
    rows = jnp.where(live, tok, T_max)
    return ck.at[slot, rows].set(kp, mode="drop"), cv.at[slot, rows].set(vp, mode="drop"), kp, vp


PREFIX_Q_CHUNK = 1024        # query rows per cuDNN call over [prefix | rest]: its mask is [rows, Tp + Ts]


def prefix_attention(q, k, v, kp, vp, start, impl: str):
    """Attention of the rest of a prompt over its shared prefix and itself. q [1, Ts, H, D] (positions start + i),
    k, v [1, Ts, KV, D] (its own K/V, causal), kp, vp [1, Tp, KV, D] (the prefix's, rows < start valid).
    impl: 'cudnn' (flash attention over [prefix | rest] with a mask), 'masked' (the same masked calls through XLA:
    how CPU tests check the cuDNN path's mask) or 'xla' (the jnp reference with positions). Query rows go in
    chunks (lax.map), so the mask or the reference's scores stay bounded for a long rest over a long prefix."""
    Ts, Tp, H = q.shape[1], kp.shape[1], q.shape[2]
    S = Tp + Ts
    keys = jnp.concatenate([kp.astype(k.dtype), k], axis=1)                  # [1, S, KV, D]
    vals = jnp.concatenate([vp.astype(v.dtype), v], axis=1)
    j = jnp.arange(S)
    if impl in ("cudnn", "masked"):
        C = min(Ts, PREFIX_Q_CHUNK)

        def rows(qc, i0):
            i = i0 + jnp.arange(qc.shape[1])
            ok = (j[None] < start) | ((j[None] >= Tp) & (j[None] - Tp <= i[:, None]))          # [C, S]
            return jax.nn.dot_product_attention(qc, keys, vals, mask=ok[None, None],
                                                implementation="cudnn" if impl == "cudnn" else None)
    else:   # the blocked jnp attention: memory linear in S, so no query chunks
        kpos = jnp.where(j < Tp, j, start + j - Tp)[None]
        valid = ((j < start) | (j >= Tp))[None]
        return blocked_attention(q, keys, vals, (start + jnp.arange(Ts))[None], kpos, k_valid=valid)
    if C == Ts:
        return rows(q, 0)
    n = Ts // C
    out = jax.lax.map(lambda a: rows(a[0][None], a[1]), (q.reshape(n, C, *q.shape[2:]), jnp.arange(n) * C))
    return out.reshape(q.shape)
