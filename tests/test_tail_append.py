"""The tail-append kernel (pallas_kernels/tail_append.py) against its XLA-scatter reference, bit for bit: interpret
mode on CPU, compiled on the GPU (`-m gpu`).

Adversarial cases: skipped rows (frame -1 and past the pool, sub-page -1 and past nsub), a token that starts its
sub-page (reset) beside ones that do not, +-0.0, +-inf and NaN in the new rows and in the old summaries, a leading
rank axis of one, speculative leases (Q > 1, no summaries), bf16 and fp32; and the decode's `append_token` with
the kernel equal to it with the reference."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.pallas_kernels import tail_append as ta

ON_GPU = jax.default_backend() == "gpu"


def _bits(x):
    x = np.array(x, copy=True)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _case(rng, *, S, Q, G, g, D, F, page, L, nsub, dtype, summaries, specials):
    def arr(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        if specials:
            flat = x.reshape(-1)
            n = flat.size
            for v in (0.0, -0.0, np.inf, -np.inf, np.nan):
                flat[rng.integers(0, n, max(1, n // 20))] = v
        return jnp.asarray(x, dtype)

    pool_k, pool_v = arr((1, F, page, g, D)), arr((1, F, page, g, D))
    k, v = arr((S, Q, G, g, D)), arr((S, Q, G, g, D))
    # distinct frames, so distinct (frame, off) pairs (the tail ring gives one writer per row); some skipped by
    # -1 or by a frame past the pool
    frame = rng.permutation(F)[:S * Q * G].reshape(S, Q, G).astype(np.int32)
    frame = np.where(rng.random((S, Q, G)) < 0.2, -1, frame)
    frame = np.where(rng.random((S, Q, G)) < 0.1, F + 3, frame)
    off = rng.integers(0, page, (S, Q)).astype(np.int32)
    args = [pool_k, pool_v, k, v, jnp.asarray(frame), jnp.asarray(off)]
    if not summaries:
        return args, {}
    kmin, kmax = arr((1, S, L, G, nsub, g, D)), arr((1, S, L, G, nsub, g, D))
    sub = rng.integers(-1, nsub + 2, S).astype(np.int32)
    first = rng.random(S) < 0.5
    return args, dict(kmin=kmin, kmax=kmax, sub=jnp.asarray(sub), first=jnp.asarray(first))


def _compare(args, kw, layer, interpret):
    want = jax.jit(lambda *a, **k: ta.ref_tail_append(*a, **k, layer=layer))(*args, **kw)
    got = jax.jit(lambda *a, **k: ta.tail_append_pallas(*a, **k, layer=layer, interpret=interpret))(*args, **kw)
    assert len(got) == len(want)
    for name, a, b in zip(("pool_k", "pool_v", "kmin", "kmax"), got, want):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)


CASES = [
    dict(S=3, Q=1, G=2, g=1, D=8, F=7, page=4, L=3, nsub=5, dtype=jnp.bfloat16, summaries=True, specials=False),
    dict(S=2, Q=1, G=4, g=2, D=16, F=9, page=8, L=2, nsub=6, dtype=jnp.float32, summaries=True, specials=True),
    dict(S=2, Q=3, G=2, g=1, D=8, F=13, page=4, L=2, nsub=4, dtype=jnp.bfloat16, summaries=False, specials=True),
]


@pytest.mark.gpu                          # also in `make test-gpu`: compiled there, interpret mode on CPU
@pytest.mark.parametrize("case", CASES, ids=["decode-bf16", "decode-fp32-specials", "leases-bf16"])
def test_kernel_equals_reference(case):
    rng = np.random.default_rng(7)
    for _ in range(3):
        args, kw = _case(rng, **case)
        _compare(args, kw, layer=case["L"] - 1, interpret=not ON_GPU)        # one compile a case


def test_bad_shapes_are_refused():
    rng = np.random.default_rng(0)
    args, kw = _case(rng, **CASES[0])
    pool_k, pool_v, k, v, frame, off = args
    with pytest.raises(ValueError, match="frame"):
        ta.tail_append(pool_k, pool_v, k, v, frame[:, :, :1], off, impl="ref")
    with pytest.raises(ValueError, match="pool"):
        ta.tail_append(pool_k[..., :4], pool_v, k, v, frame, off, impl="ref")
    k3 = jnp.concatenate([k, k], axis=1)
    with pytest.raises(ValueError, match="summaries need one row"):
        ta.tail_append(pool_k, pool_v, k3, k3, jnp.concatenate([frame, frame], 1),
                       jnp.concatenate([off, off], 1), **kw, impl="ref")


@pytest.mark.gpu
def test_append_token_kernel_equals_reference():
    """The decode's append (decode_layer.append_token) through the kernel and through the scatters: equal state."""
    from ulacache_jax.cache import state as cache_state
    from ulacache_jax.cache.config import CacheConfig
    from ulacache_jax.cache.decode_layer import append_token
    c = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, page_size=8, max_seqs=3, max_pages_per_seq=8,
                    num_buckets=2, slots_per_bucket=4, host_pages=64, token_budget=32, dtype="bfloat16")
    state, _ = cache_state.init(c)
    rng = np.random.default_rng(3)
    live = jnp.asarray([True, False, True])
    step = jax.jit(append_token, static_argnums=1, static_argnames="impl")
    a = b = state
    for t in range(11):                                # crosses a page boundary: the summary resets at t = 8
        kn = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float32)
        pos = jnp.full((3,), t, jnp.int32)
        a = step(a, t % 2, kn, -kn, pos, live, impl="ref")
        b = step(b, t % 2, kn, -kn, pos, live, impl="pallas")
    for name in ("pool_k", "pool_v", "kmin", "kmax"):
        np.testing.assert_array_equal(_bits(getattr(a, name)), _bits(getattr(b, name)), err_msg=name)
    assert np.any(_bits(a.kmin) != _bits(state.kmin))                       # the appends did write
