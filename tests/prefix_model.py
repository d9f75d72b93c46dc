"""A plain-Python model of the shared-prefix bookkeeping (ulacache_jax/runtime/prefix_cache.py + the HostAllocator's
reference counts), for tests/test_cache_stateful.py.

Stored prefixes are keyed by the token tuple they cover (no hashing: the model is the obvious version of the
chained page keys), kept oldest first; a lookup or an insert touches its path leaf first, eviction takes the
oldest node, which must be a leaf. Reference counts are never stored: `refs` recounts them from the holders
(every live sequence's page table and every stored node's pages), so the library's counts are checked against
who actually holds a page, not against a second counter that could drift the same way."""
from __future__ import annotations

import collections

import numpy as np


class PrefixModel:
    """page_size: tokens per page; size: host pages per stored page (layers x groups); budget: host pages the
    stored prefixes may hold (None: no limit)."""

    def __init__(self, page_size: int, size: int, budget: int | None):
        self.P, self.size, self.budget = page_size, size, budget
        self.nodes: collections.OrderedDict[tuple, np.ndarray] = collections.OrderedDict()   # oldest first

    @property
    def held(self) -> int:
        return self.size * len(self.nodes)

    def _touch(self, path: list[tuple]) -> None:
        for key in reversed(path):
            self.nodes.move_to_end(key)

    def match(self, prompt, max_pages: int) -> list[tuple]:
        """Keys of the longest stored prefix of `prompt`: at most (len - 1) // page_size and max_pages pages."""
        n = min((len(prompt) - 1) // self.P if len(prompt) else 0, max_pages)
        path = []
        for i in range(n):
            key = tuple(prompt[:(i + 1) * self.P])
            if key not in self.nodes:
                break
            path.append(key)
        self._touch(path)
        return path

    def insert(self, prompt, num_pages: int, pages: np.ndarray) -> list[tuple]:
        """Store the first num_pages pages of prompt (pages [L, G, n]: the storing sequence's table); a stored page
        keeps its payload. Then evict down to the budget. -> keys newly stored."""
        path, added = [], []
        for i in range(min(num_pages, len(prompt) // self.P)):
            key = tuple(prompt[:(i + 1) * self.P])
            if key not in self.nodes:
                self.nodes[key] = pages[:, :, i].copy()
                added.append(key)
            path.append(key)
        self._touch(path)
        if self.budget is not None:
            self.evict(self.held - self.budget)
        return added

    def evict(self, pages: int) -> int:
        """Evict the oldest nodes until `pages` host pages are given up; -> pages given up."""
        given = 0
        while given < pages and self.nodes:
            key = next(iter(self.nodes))
            assert not any(k[:len(key)] == key and k != key for k in self.nodes), "the oldest node is not a leaf"
            del self.nodes[key]
            given += self.size
        return given

    def refs(self, host_pages: int, tables) -> np.ndarray:
        """Holders per host page: each table [L, G, n] (live sequences) and each stored node's pages."""
        r = np.zeros(host_pages, np.int64)
        for t in list(tables) + list(self.nodes.values()):
            np.add.at(r, np.asarray(t).reshape(-1), 1)
        return r


def library_nodes(index) -> list[tuple[tuple, np.ndarray]]:
    """A library PrefixIndex's nodes, oldest first, as (token tuple of the whole prefix, pages [L, G])."""
    out = []
    for node in index.nodes.values():
        toks, k = [], node.key
        while k in index.nodes:
            n = index.nodes[k]
            toks = n.tokens.tolist() + toks
            k = n.parent
        assert k == b"", f"node {node.index} has a missing ancestor"
        assert len(toks) == (node.index + 1) * index.page_size
        out.append((tuple(toks), np.asarray(node.payload)))
    return out
