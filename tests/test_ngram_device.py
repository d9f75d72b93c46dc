"""The device ngram drafter (ngram_device.py) against its numpy reference and the host NgramIndex (the rule the
per-step speculative path uses), on random and adversarial histories; the traced flush bound and back-off rule
(speculative.spec_bounds, backoff) against the host's."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.runtime.speculative.ngram import append, propose, ref_propose
from ulacache_jax.runtime.speculative.rules import NgramIndex, backoff, next_flush, ngram_propose, spec_bounds

K, NMAX = 4, 3


@pytest.fixture(scope="module")
def device_propose():
    return jax.jit(lambda h, l, k: propose(h, l, k, num_tokens=K, ngram_max=NMAX))


def _host(hist, hlen, k):
    """The host rule, slot by slot: NgramIndex (incremental) and ngram_propose (the scan) must agree."""
    out = []
    for s in range(hist.shape[0]):
        h = [int(t) for t in hist[s, :hlen[s]]]
        want = int(min(max(int(k[s]), 0), K))
        a = NgramIndex(NMAX).propose(h, want)
        assert a == ngram_propose(h, want, NMAX)
        out.append(a)
    return out


def _check(device_propose, hist, hlen, k):
    hist, hlen, k = (np.asarray(a, np.int32) for a in (hist, hlen, k))
    d, nd = (np.asarray(a) for a in device_propose(hist, hlen, k))
    rd, rnd = ref_propose(hist, hlen, k, num_tokens=K, ngram_max=NMAX)
    assert np.array_equal(d, rd) and np.array_equal(nd, rnd), (hist, hlen, k, d, nd, rd, rnd)
    for s, want in enumerate(_host(hist, hlen, k)):
        assert d[s, :nd[s]].tolist() == want and (d[s, nd[s]:] == 0).all(), (s, want, d[s], nd[s])


def test_random_histories(device_propose):
    rng = np.random.default_rng(0)
    S, C = 6, 48
    for vocab in (2, 3, 5, 50):
        for _ in range(25):
            hist = rng.integers(0, vocab, (S, C))
            hlen = rng.integers(0, C + 1, S)
            k = rng.integers(-1, K + 2, S)
            _check(device_propose, hist, hlen, k)


def test_adversarial_histories(device_propose):
    C = 24
    cases = [
        ([], 3),                                      # empty
        ([7], 3),                                     # one token: nothing earlier
        ([7, 7], 3),                                  # the 1-gram matches at 0: proposes the last token
        ([7, 7, 7, 7, 7, 7], 4),                      # a run: the latest earlier 3-gram, overlapping the suffix
        ([1, 2, 3, 4, 5, 6], 4),                      # no match
        ([1, 2, 3, 1, 2, 3], 4),                      # match right before the suffix: continuation runs into it
        ([5, 1, 2, 9, 1, 2], 4),                      # 2-gram wins over the later 1-gram [2]
        ([1, 2, 3, 8, 2, 3, 9, 1, 2, 3], 4),          # the 3-gram's latest match, not the 2-gram's
        ([4, 2, 3, 8, 1, 3, 9, 2, 3], 4),             # [2, 3] at 1 and 7? only 1 is earlier than the suffix's
        ([3, 1, 3, 1, 3], 1),                         # k = 1
        ([3, 1, 3, 1, 3], 0),                         # k = 0: nothing
        (list(range(20)) + [0], 4),                   # match at the very start: 1-gram [0] -> 1, 2, 3, 4
        ([9] * 23 + [1], 4),                          # the last token never seen before
        ([2, 5] * 12, 4),                             # full buffer, period 2
    ]
    hist = np.full((len(cases), C), 99, np.int32)     # stale tokens past each length must not matter
    for s, (h, _) in enumerate(cases):
        hist[s, :len(h)] = h
    hlen = [len(h) for h, _ in cases]
    k = [kk for _, kk in cases]
    _check(device_propose, hist, hlen, k)
    d, nd = device_propose(jnp.asarray(hist), jnp.asarray(hlen, jnp.int32), jnp.asarray(k, jnp.int32))
    assert np.asarray(d)[3].tolist() == [7, 0, 0, 0] and int(nd[3]) == 1        # stops at the history's end
    assert np.asarray(d)[7].tolist() == [8, 2, 3, 9] and int(nd[7]) == 4


def test_append_then_propose_follows_the_incremental_index(device_propose):
    """A history grown on the device by `append` (ragged counts, some zero) proposes what NgramIndex proposes as
    it is extended with the same tokens."""
    rng = np.random.default_rng(1)
    S, C = 3, 64
    hist = jnp.zeros((S, C), jnp.int32)
    hlen = jnp.zeros(S, jnp.int32)
    idx = [NgramIndex(NMAX) for _ in range(S)]
    seen = [[] for _ in range(S)]
    app = jax.jit(append)
    while max(map(len, seen)) < C - K - 1:        # every history fits the buffer
        tok = rng.integers(0, 4, (S, K + 1)).astype(np.int32)
        n = rng.integers(0, K + 2, S).astype(np.int32)
        hist, hlen = app(hist, hlen, jnp.asarray(tok), jnp.asarray(n))
        for s in range(S):
            seen[s] += tok[s, :n[s]].tolist()
        k = rng.integers(0, K + 1, S).astype(np.int32)
        d, nd = device_propose(hist, hlen, jnp.asarray(k))
        for s in range(S):
            assert np.asarray(d)[s, :int(nd[s])].tolist() == idx[s].propose(seen[s], int(k[s]))
    assert np.asarray(hlen).tolist() == [len(x) for x in seen]
    assert [np.asarray(hist)[s, :len(x)].tolist() for s, x in enumerate(seen)] == seen


def test_append_drops_past_the_buffer():
    hist, hlen = append(jnp.zeros((1, 4), jnp.int32), jnp.asarray([2], jnp.int32), jnp.asarray([[5, 6, 7]]),
                        jnp.asarray([3], jnp.int32))
    assert np.asarray(hist).tolist() == [[0, 0, 5, 6]] and int(hlen[0]) == 5


def _host_backoff(k_now, fails, skip, n_new, drafted, P):
    """SpecDecoder.decode's rule, one slot."""
    skip = max(0, skip - n_new)
    if drafted:
        acc = n_new - 1
        k_now = min(K, k_now + 2) if acc == drafted else max(1, k_now - 1)
        fails = 0 if acc else fails + 1
        if fails >= 2:
            skip = min(P, 2 ** (fails - 1))
    return k_now, fails, skip


def test_backoff_and_bounds_equal_the_host_rule():
    rng = np.random.default_rng(2)
    P, N = 16, 4000
    k_now = rng.integers(1, K + 1, N)
    fails = rng.integers(0, 40, N)                        # large fails: 2 ** (fails - 1) far past P
    skip = rng.integers(0, 20, N)
    drafted = rng.integers(0, K + 1, N)
    n_new = np.minimum(rng.integers(1, K + 2, N), drafted + 1)
    got = backoff(tuple(jnp.asarray(a, jnp.int32) for a in (k_now, fails, skip)), jnp.asarray(n_new, jnp.int32),
                  jnp.asarray(drafted, jnp.int32), K, P)
    want = np.array([_host_backoff(*map(int, a), P) for a in zip(k_now, fails, skip, n_new, drafted)]).T
    assert np.array_equal(np.stack([np.asarray(g) for g in got]), want)

    prompt = rng.integers(1, 100, N)
    length = prompt + rng.integers(0, 100, N)
    remaining = rng.integers(0, 10, N)
    k, bound = spec_bounds(*(jnp.asarray(a, jnp.int32) for a in (length, prompt, remaining)),
                           tuple(jnp.asarray(a, jnp.int32) for a in (k_now, fails, skip)), P)
    for i in range(0, N, 7):
        b = next_flush(int(prompt[i]), int(length[i]), P)
        kk = 0 if skip[i] > 0 else max(0, min(int(k_now[i]), b - int(length[i]) - 1, int(remaining[i]) - 1))
        assert int(bound[i]) == b and int(k[i]) == kk
