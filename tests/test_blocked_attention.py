"""blocked_attention (flash-style, online softmax over query x key blocks) must equal dense_attention on every
row, and its compiled temporary memory must not grow with the context the way dense's [T, S] scores do."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulacache_jax.models.attention import blocked_attention, dense_attention

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # max abs error / max |dense|


def _inputs(seed, b, t, s, h, kv, d, dtype):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)  # [B, T, H, D]
    k = jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)  # [B, S, K, D]
    v = jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)  # [B, S, K, D]
    return rng, q, k, v


def _check(q, k, v, q_positions, k_positions, *, block_q, block_k, sliding_window=None, k_valid=None):
    # under jit: one compile per case instead of one per eager op (the file stays well inside a minute)
    dense = jax.jit(functools.partial(dense_attention, sliding_window=sliding_window))
    blocked = jax.jit(functools.partial(blocked_attention, sliding_window=sliding_window, block_q=block_q,
                                        block_k=block_k))
    want = dense(q, k, v, q_positions, k_positions, k_valid=k_valid)
    got = blocked(q, k, v, q_positions, k_positions, k_valid=k_valid)
    assert got.shape == want.shape and got.dtype == want.dtype == q.dtype
    # numpy, not jnp: XLA's CPU max reduction may drop NaN, which would hide a leak
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all() and np.isfinite(want).all()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= TOL[q.dtype.type], err


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("h,kv", [(4, 4), (4, 2), (14, 2)])  # G = H / K = 1, 2, 7
def test_causal_prefill_gqa_ratios(h, kv, dtype):
    # T = 45 is not a multiple of block_q = 16 nor of block_k = 8: padded queries and keys in the last blocks
    b, t, d = 1, 45, 16
    _, q, k, v = _inputs(0, b, t, t, h, kv, d, dtype)
    pos = jnp.arange(t)[None]
    _check(q, k, v, pos, pos, block_q=16, block_k=8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_offset_queries_against_all_keys_before_them(dtype):
    # a chunk of 21 queries at positions 40..60 against 61 keys 0..60 (a later prefill chunk over its history)
    b, t, s, offset = 1, 21, 61, 40
    _, q, k, v = _inputs(1, b, t, s, 6, 2, 16, dtype)
    _check(q, k, v, jnp.arange(t)[None] + offset, jnp.arange(s)[None], block_q=8, block_k=16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_k_valid_with_nan_in_invalid_slots(dtype):
    b, t, s = 2, 19, 40
    rng, q, k, v = _inputs(2, b, t, s, 4, 2, 16, dtype)
    k_valid = rng.random((b, s)) < 0.6
    k_valid[:, 0] = True  # every query sees at least key 0 (fully masked rows are tested below)
    nan = jnp.asarray(np.nan, dtype)
    k = jnp.where(k_valid[:, :, None, None], k, nan)
    v = jnp.where(k_valid[:, :, None, None], v, nan)
    q_pos = jnp.stack([jnp.arange(t) + s - t, jnp.arange(t) + 7])
    k_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    _check(q, k, v, q_pos, k_pos, block_q=8, block_k=16, k_valid=jnp.asarray(k_valid))


@pytest.mark.parametrize("window,dtype", [(1, jnp.float32), (5, jnp.bfloat16), (23, jnp.float32)])
def test_sliding_window(window, dtype):
    b, t, s = 1, 50, 50
    _, q, k, v = _inputs(3, b, t, s, 4, 2, 16, dtype)
    pos = jnp.arange(t)[None]
    _check(q, k, v, pos, pos, block_q=16, block_k=8, sliding_window=window)


def test_batch_with_different_positions_and_window():
    # row 0: a fresh prompt at 0..T-1; row 1: a chunk at 30.. over cache slots holding positions 0..S-1
    b, t, s = 2, 24, 54
    _, q, k, v = _inputs(4, b, t, s, 6, 3, 16, jnp.float32)
    q_pos = jnp.stack([jnp.arange(t), jnp.arange(t) + 30])
    k_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    _check(q, k, v, q_pos, k_pos, block_q=8, block_k=8)
    _check(q, k, v, q_pos, k_pos, block_q=8, block_k=8, sliding_window=10)


def test_unsorted_key_positions():
    # cache slots in any order: the block-skip table must stay conservative, the mask exact
    b, t, s = 1, 32, 48
    rng, q, k, v = _inputs(5, b, t, s, 4, 2, 16, jnp.float32)
    perm = rng.permutation(s)
    k_pos = jnp.asarray(perm)[None]
    q_pos = jnp.arange(t)[None] + 16
    _check(q, k, v, q_pos, k_pos, block_q=8, block_k=8)
    _check(q, k, v, q_pos, k_pos, block_q=8, block_k=8, sliding_window=6)


def test_fully_masked_rows_match_dense():
    # dense's finite fill gives a row with no visible key the uniform average of V over all S keys (invalid ones
    # zeroed); blocked returns the same for such rows: queries before every key, a window that excludes all,
    # and a batch row whose slots are all invalid (with NaN in them)
    b, t, s = 2, 12, 20
    _, q, k, v = _inputs(6, b, t, s, 4, 2, 8, jnp.float32)
    k_valid = np.ones((b, s), bool)
    k_valid[1] = False
    k_valid[0, :3] = False
    v = jnp.where(k_valid[:, :, None, None], v, jnp.nan)
    # row 0: positions -6..-1 precede every key, 0..2 see only invalid keys
    q_pos = jnp.stack([jnp.arange(t) - 6, jnp.arange(t)])
    k_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    _check(q, k, v, q_pos, k_pos, block_q=4, block_k=8, k_valid=jnp.asarray(k_valid))
    _, q, k, v = _inputs(7, 1, t, s, 4, 2, 8, jnp.float32)
    # queries at 100.. with window 5 over keys 0..19: nothing visible at all
    _check(q, k, v, jnp.arange(t)[None] + 100, jnp.arange(s)[None], block_q=4, block_k=8, sliding_window=5)


def test_decode_and_default_blocks_under_jit():
    # T = 1 (decode) and T, S below the default 512 blocks: blocks shrink to T and S
    b, s = 2, 33
    _, q, k, v = _inputs(8, b, 1, s, 14, 2, 16, jnp.float32)
    q_pos = jnp.asarray([[s - 1], [20]])
    k_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    want = dense_attention(q, k, v, q_pos, k_pos)
    got = jax.jit(blocked_attention)(q, k, v, q_pos, k_pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


# --- memory: compile only (no execution) at the Qwen2.5-0.5B layer shape, float32 ---
QWEN = dict(b=1, h=14, kv=2, d=64)


def _temp_bytes(fn, t, dtype=jnp.float32):
    b, h, kv, d = QWEN["b"], QWEN["h"], QWEN["kv"], QWEN["d"]
    spec = jax.ShapeDtypeStruct
    compiled = (
        jax.jit(fn)
        .lower(spec((b, t, h, d), dtype), spec((b, t, kv, d), dtype), spec((b, t, kv, d), dtype),
               spec((b, t), jnp.int32), spec((b, t), jnp.int32))
        .compile()
    )
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.skip(f"memory_analysis() returns None on the {jax.default_backend()} backend")
    return analysis.temp_size_in_bytes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_blocked_temp_memory_is_linear_in_context(dtype):
    small, large = (_temp_bytes(blocked_attention, t, dtype) for t in (2048, 4096))
    assert large <= 2.5 * small, (small, large)
    # far below the dense float32 score matrix T * S * H * 4 B (940 MB at 4096)
    assert large < 4096 * 4096 * QWEN["h"] * 4 / 8, large


def test_dense_temp_memory_is_quadratic():
    # shows the measurement sees the [T, S] scores: doubling the context quadruples dense's temporaries
    small, large = (_temp_bytes(dense_attention, t) for t in (2048, 4096))
    assert 3.5 * small <= large <= 4.5 * small, (small, large)
    assert small >= 2048 * 2048 * QWEN["h"] * 4, small
