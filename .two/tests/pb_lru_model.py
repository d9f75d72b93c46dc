"""A plain-Python model of the PB-LRU batch semantics (DESIGN.md section 5), written from the text, for tests."""
from __future__ import annotations

GOLDEN = 11400714819323198485


def py_bucket(lid: int, num_buckets: int) -> int:
    bits = num_buckets.bit_length() - 1
    return 0 if bits == 0 else ((lid * GOLDEN) % 2**64) >> (64 - bits)


class PyPBLRU:
    def __init__(self, num_buckets: int, slots: int):
        self.nb, self.ns = num_buckets, slots
        self.tag = [[None] * slots for _ in range(num_buckets)]
        self.stamp = [[-1] * slots for _ in range(num_buckets)]

    def access(self, lids, valid, now):
        n = len(lids)
        frame, hit, evicted, ev_lid = [-1] * n, [False] * n, [False] * n, [None] * n
        where = {}  # lid -> (bucket, slot) for resident lids
        for b in range(self.nb):
            for s in range(self.ns):
                if self.stamp[b][s] >= 0:
                    where[self.tag[b][s]] = (b, s)
        hit_slots = set()
        for i, (x, v) in enumerate(zip(lids, valid)):
            if v and x in where:
                b, s = where[x]
                hit[i], frame[i] = True, b * self.ns + s
                hit_slots.add((b, s))
        misses = {}  # bucket -> distinct missing lids in order of first appearance (with first index)
        for i, (x, v) in enumerate(zip(lids, valid)):
            if v and x not in where:
                lst = misses.setdefault(py_bucket(x, self.nb), [])
                if x not in [y for y, _ in lst]:
                    lst.append((x, i))
        for b, s in hit_slots:
            self.stamp[b][s] = now
        assigned = {}
        for b, lst in misses.items():
            cands = sorted((s for s in range(self.ns) if (b, s) not in hit_slots),
                           key=lambda s: (self.stamp[b][s], s))
            for r, (x, i) in enumerate(lst):
                if r < len(cands):
                    s = cands[r]
                    if self.stamp[b][s] >= 0:
                        evicted[i], ev_lid[i] = True, self.tag[b][s]
                    assigned[x] = b * self.ns + s
                else:
                    assigned[x] = -1
            for r, (x, i) in enumerate(lst[: len(cands)]):
                s = cands[r]
                self.tag[b][s], self.stamp[b][s] = x, now
        for i, (x, v) in enumerate(zip(lids, valid)):
            if v and not hit[i]:
                frame[i] = assigned[x]
        return frame, hit, evicted, ev_lid

    def release(self, seq):
        for b in range(self.nb):
            for s in range(self.ns):
                if self.stamp[b][s] >= 0 and (self.tag[b][s] >> 44) == seq:
                    self.tag[b][s], self.stamp[b][s] = None, -1
