"""The prefix index: prompts that start with the same complete pages share them instead of prefilling them again.

A prompt is cut into page-aligned blocks of `page_size` tokens; block i is named by a hash chained over every
block before it (`page_keys`), so one key names one whole prefix. An index node per stored block keeps the
block's tokens (a lookup is verified on the tokens themselves: a hash collision can only miss, never give wrong
K/V), its parent's key and a payload saying where the block's K/V live:
- sparse (UlaCache): the host page ids [L, G] of the block (the same on every rank). The index holds one
  reference on each of them in the `HostAllocator`, so a stored prefix outlives the sequence that computed it;
  a page returns to the free list only when no sequence and no index node holds it.
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
    payload (sparse: the allocator's page reference counts; dense: nothing)."""

    def __init__(self, page_size: int, *, budget_pages: int | None = None,
                 retain: Callable[[object], None] = lambda p: None, release: Callable[[object], None] = lambda p: None):
        if budget_pages is not None and budget_pages < 0:
            raise ValueError(f"budget_pages = {budget_pages} must be >= 0 or None")
        self.page_size, self.budget_pages = page_size, budget_pages
        self._retain, self._release = retain, release
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
