"""Token decode attention (pallas_kernels/token_decode_attention.py): kernel (interpret mode, and compiled on the
GPU) against the reference, and the reference against plain attention over the listed tokens."""
import math

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.pallas_kernels import token_decode_attention as tda


def make_case(seed, *, B=2, Q=1, H=8, G=2, g=1, D=32, F=24, page=16, N=100, unused=0.3, dtype=jnp.float32):
    """A pool of random pages and, per (b, group), N distinct random (frame, row) tokens at random positions below
    the sequence length (a share `unused` marked -1)."""
    rng = np.random.default_rng(seed)
    pool_k = jnp.asarray(rng.normal(size=(F, page, g, D)), dtype)
    pool_v = jnp.asarray(rng.normal(size=(F, page, g, D)), dtype)
    q = jnp.asarray(rng.normal(size=(B, Q, H, D)), dtype)
    seq_len = rng.integers(F * page // 2, F * page, size=B).astype(np.int32)
    frame = np.zeros((B, G, N), np.int32)
    row = np.zeros((B, G, N), np.int32)
    pos = np.zeros((B, G, N), np.int32)
    for b in range(B):
        for gr in range(G):
            slots = rng.choice(F * page, size=N, replace=False)
            frame[b, gr], row[b, gr] = slots // page, slots % page
            pos[b, gr] = rng.choice(seq_len[b], size=N, replace=False)
    pos = np.where(rng.random(pos.shape) < unused, -1, pos)
    return q, pool_k, pool_v, jnp.asarray(frame), jnp.asarray(row), jnp.asarray(pos), jnp.asarray(seq_len)


def plain(q, pool_k, pool_v, frame, row, pos, seq_len):
    """numpy: each query head attends its group's listed tokens at or before its position."""
    q, pk, pv = (np.asarray(x, np.float64) for x in (q, pool_k, pool_v))
    frame, row, pos, seq_len = (np.asarray(x) for x in (frame, row, pos, seq_len))
    B, Q, H, D = q.shape
    G, g = frame.shape[1], pk.shape[2]
    r = H // (G * g)
    out = np.zeros_like(q)
    for b in range(B):
        for i in range(Q):
            for h in range(H):
                kvh = h // r
                gr, j = kvh // g, kvh % g
                ok = (pos[b, gr] >= 0) & (pos[b, gr] <= seq_len[b] - Q + i)
                if not ok.any():
                    continue
                k = pk[frame[b, gr][ok], row[b, gr][ok], j]
                v = pv[frame[b, gr][ok], row[b, gr][ok], j]
                s = k @ q[b, i, h] / math.sqrt(D)
                p = np.exp(s - s.max())
                out[b, i, h] = p @ v / p.sum()
    return out


@pytest.mark.parametrize("kw", [dict(), dict(Q=3, g=2, H=8, G=2), dict(N=7, unused=0.0), dict(unused=1.0)])
def test_reference_is_plain_attention_over_the_listed_tokens(kw):
    case = make_case(0, **kw)
    np.testing.assert_allclose(np.asarray(tda.ref_token_decode_attention(*case)), plain(*case), atol=1e-5)


@pytest.mark.parametrize("kw,tuning", [(dict(), None), (dict(Q=2, g=2, H=8, G=2), dict(num_splits=2)),
                                       (dict(N=130, unused=0.9), dict(num_splits=4, tokens_per_block=32)),
                                       (dict(unused=1.0), None)])
def test_kernel_matches_the_reference_in_interpret_mode(kw, tuning):
    """Random lists, several splits and blocks, padding, mostly-unused and empty lists (a row that sees nothing
    is 0 in both)."""
    case = make_case(1, **kw)
    want = tda.ref_token_decode_attention(*case)
    got = tda.token_decode_attention(*case, impl="pallas", tuning=tuning)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_softcap_and_scale_reach_both():
    case = make_case(2)
    want = tda.ref_token_decode_attention(*case, scale=0.3, softcap=5.0)
    got = tda.token_decode_attention(*case, scale=0.3, softcap=5.0, impl="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    assert not np.allclose(np.asarray(want), np.asarray(tda.ref_token_decode_attention(*case)), atol=1e-3)


@pytest.mark.parametrize("bad, needle", [("q", "q must be"), ("list", "tok_frame/tok_row/tok_pos"),
                                         ("len", "seq_len must be")])
def test_bad_shapes_are_named(bad, needle):
    q, pk, pv, fr, rw, pos, sl = make_case(3)
    if bad == "q":
        q = q[0]
    elif bad == "list":
        rw = rw[..., :-1]
    else:
        sl = sl[:1]
    with pytest.raises(ValueError, match=needle):
        tda.token_decode_attention(q, pk, pv, fr, rw, pos, sl, impl="ref")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_compiled_matches_the_reference(dtype):
    """On the GPU, compiled: the 8B shape's heads (D 128, 4 query heads a KV head) and a 0.5B-like one (D 64)."""
    for kw in (dict(B=3, H=32, G=8, D=128, F=1024, page=16, N=4096 + 32), dict(B=2, H=14, G=2, D=64, F=256, N=1024)):
        case = make_case(4, dtype=dtype, unused=0.1, **kw)
        want = np.asarray(tda.ref_token_decode_attention(*case), np.float32)
        got = np.asarray(jax.block_until_ready(tda.token_decode_attention(*case, impl="pallas")), np.float32)
        tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
        np.testing.assert_allclose(got, want, atol=tol)
