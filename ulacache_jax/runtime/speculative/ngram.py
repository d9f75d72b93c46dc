"""The ngram drafter (prompt lookup) on the device, for the speculative chunk (program.Program.spec_chunk): each
slot's history (prompt + generated tokens) lives in a device buffer [S, C], so a chunk proposes, verifies and
appends many times without returning to the host.

The rule is the host's (speculative.ngram_propose / NgramIndex): for n = min(ngram_max, T - 1) down to 1, the
latest earlier occurrence of the history's last n tokens (a window ending at T - 2 at most, so never the suffix
itself) -> the up to k tokens that followed it (fewer where the history ends first); none when no suffix recurs.
`ref_propose` is the plain-numpy reference, written as that scan."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp


def propose(hist, hlen, k, *, num_tokens: int, ngram_max: int):
    """hist [S, C] int32 token histories, hlen [S] int32 their lengths T, k [S] int32 drafts wanted (clipped to
    [0, num_tokens]) -> (drafts [S, num_tokens] int32, 0 past nd; nd [S] int32 drafts found).
    Cost O(S * C * ngram_max) compares in one fused pass over the buffer."""
    S, C = hist.shape
    T = hlen[:, None]                                                                 # [S, 1]
    e = jnp.arange(C, dtype=jnp.int32)[None, :]                                       # [1, C] window end
    back = jnp.arange(ngram_max, dtype=jnp.int32)[None, :]                            # [1, N]
    tails = jnp.take_along_axis(hist, jnp.clip(T - 1 - back, 0, C - 1), axis=1)       # [S, N] suffix, m back
    # One pass over the buffer: the window ending at e matches the last n tokens where its m-th token back equals
    # the suffix's for every m < n; key n * C + e ranks a longer match above any shorter one, then the latest.
    # Elementwise terms feeding one max, which XLA can fuse into a single reduction, where a loop over n ran a
    # compare pass and a reduction per n on the speculative chunk's per-step path (its GPU cost is not yet measured
    # apart: BENCHMARKS, speculative decoding).
    match = jnp.ones((S, C), bool)
    key = jnp.full((S, C), -1, jnp.int32)
    for n in range(1, ngram_max + 1):
        m = n - 1
        shifted = hist if m == 0 else jnp.pad(hist[:, :C - m], ((0, 0), (m, 0)), constant_values=-1)
        match = match & (shifted == tails[:, m:m + 1])                                # window [e - m, e] == suffix
        ok = match & (e >= m) & (e <= T - 2) & (n <= T - 1)
        key = jnp.where(ok, n * C + e, key)                                           # n ascending: longer wins
    best = jnp.max(key, axis=1)                                                       # [S]
    start = jnp.where(best >= 0, best % C + 1, -1)
    avail = jnp.where(start >= 0, hlen - start, 0)
    nd = jnp.clip(jnp.minimum(k, avail), 0, num_tokens).astype(jnp.int32)
    j = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    idx = jnp.clip(start[:, None] + j, 0, C - 1)
    drafts = jnp.where(j < nd[:, None], jnp.take_along_axis(hist, idx, axis=1), 0)
    return drafts.astype(jnp.int32), nd


def append(hist, hlen, tokens, n):
    """tokens [S, Q] int32, the first n [S] of each row appended to hist [S, C] at hlen [S] -> (hist, hlen + n).
    Positions past C are dropped (the caller sizes C for the longest request)."""
    S, C = hist.shape
    Q = tokens.shape[1]
    j = jnp.arange(Q, dtype=jnp.int32)[None, :]
    w = jnp.where(j < n[:, None], hlen[:, None] + j, C)                              # C = dropped
    hist = hist.at[jnp.arange(S)[:, None], w].set(tokens.astype(hist.dtype), mode="drop")
    return hist, hlen + n


def ref_propose(hist, hlen, k, *, num_tokens: int, ngram_max: int):
    """`propose` in plain numpy, as the scan of the host rule (one slot at a time)."""
    hist, hlen, k = np.asarray(hist), np.asarray(hlen), np.asarray(k)
    S = hist.shape[0]
    drafts = np.zeros((S, num_tokens), np.int32)
    nd = np.zeros(S, np.int32)
    for s in range(S):
        h = [int(t) for t in hist[s, :hlen[s]]]
        T = len(h)
        want = int(min(max(int(k[s]), 0), num_tokens))
        for n in range(min(ngram_max, T - 1), 0, -1):
            hit = next((j for j in range(T - n - 1, -1, -1) if h[j:j + n] == h[T - n:]), None)
            if hit is not None:
                d = h[hit + n:hit + n + want]
                drafts[s, :len(d)] = d
                nd[s] = len(d)
                break
    return drafts, nd
