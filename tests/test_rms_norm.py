"""The residual add + RMSNorm kernel (pallas_kernels/rms_norm.py) against its reference: interpret mode on CPU,
compiled on the GPU (`-m gpu`). h = x + delta is bit-exact; y may differ from the reference by the float32 sum's
order only, which can flip each of its two roundings to the output dtype (the normalised row, then its product
with the weight): at most two units in the last place.

Adversarial rows: all zeros (the norm is rsqrt(eps) * 0), one huge element among small ones, values near the
dtype's range, +-inf (NaN out, as the reference), a row width that is not a power of two (SmolLM2's 576: masked
lanes) and one that is (the 8B's 4096), one row and an odd number of rows, no delta (a plain norm)."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from flax import nnx

from ulacache_jax.models import LlamaModel
from ulacache_jax.models.config import get_preset
from ulacache_jax.pallas_kernels import rms_norm as rn

ON_GPU = jax.default_backend() == "gpu"


def _rows(rng, n, e, dtype, special: bool):
    x = rng.standard_normal((n, e)).astype(np.float32) * 3
    d = rng.standard_normal((n, e)).astype(np.float32)
    if special:
        x[0], d[0] = 0.0, 0.0                                    # zero row
        if n > 1:
            x[1, 5] = 3e4 if dtype == jnp.bfloat16 else 3e30     # one huge element
        if n > 2:
            x[2, -1] = np.inf                                    # NaN row in both
    w = 1 + 0.1 * rng.standard_normal(e).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(d, dtype), jnp.asarray(w, dtype)


def _close(y, yr, dtype):
    y, yr = np.asarray(y, np.float32), np.asarray(yr, np.float32)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(yr))
    ok = ~np.isnan(y)
    two_ulps = 2.0**-6 if dtype == jnp.bfloat16 else 2.0**-21
    np.testing.assert_allclose(y[ok], yr[ok], rtol=two_ulps, atol=1e-30)


@pytest.mark.gpu                          # also in `make test-gpu`: compiled there, interpret mode on CPU
@pytest.mark.parametrize("e", [4096, 576, 48])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_kernel_equals_reference(e, dtype):
    rng = np.random.default_rng(e)
    for n, special, with_delta in ((3, True, True), (1, False, True), (5, True, False)):
        x, d, w = _rows(rng, n, e, dtype, special)
        d = d if with_delta else None
        h, y = rn.add_rms_norm(x, d, w, 1e-5, impl="pallas")
        hr, yr = rn.ref_add_rms_norm(x, d, w, 1e-5)
        assert h.dtype == y.dtype == x.dtype and y.shape == x.shape
        np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(hr, np.float32))
        _close(y, yr, dtype)


def test_leading_axes_and_auto():
    """[B, T, E] in, same shape out; impl="auto" off GPU (or past MAX_ROWS) is the reference itself."""
    rng = np.random.default_rng(1)
    x, d, w = _rows(rng, 6, 64, jnp.bfloat16, False)
    x3, d3 = x.reshape(2, 3, 64), d.reshape(2, 3, 64)
    h, y = rn.add_rms_norm(x3, d3, w, 1e-6, impl="pallas")
    hr, yr = rn.ref_add_rms_norm(x3, d3, w, 1e-6)
    assert h.shape == y.shape == (2, 3, 64)
    _close(y, yr, jnp.bfloat16)
    big = jnp.zeros((rn.MAX_ROWS + 1, 64), jnp.bfloat16)
    for xs, ds in ((x3, d3), (big, big)):
        if ON_GPU and xs is x3:
            continue
        ha, ya = rn.add_rms_norm(xs, ds, w, 1e-6)
        hb, yb = rn.ref_add_rms_norm(xs, ds, w, 1e-6)
        np.testing.assert_array_equal(np.asarray(ya, np.float32), np.asarray(yb, np.float32))


def test_bad_arguments_are_refused():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    w = jnp.ones((64,), jnp.bfloat16)
    with pytest.raises(ValueError, match="delta"):
        rn.add_rms_norm(x, jnp.zeros((2, 32), jnp.bfloat16), w, 1e-6)
    with pytest.raises(ValueError, match="delta"):
        rn.add_rms_norm(x, jnp.zeros((2, 64), jnp.float32), w, 1e-6)
    with pytest.raises(ValueError, match=r"weight \(32,\)"):
        rn.add_rms_norm(x, None, jnp.ones((32,), jnp.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="impl"):
        rn.add_rms_norm(x, None, w, 1e-6, impl="cuda")
    with pytest.raises(ValueError, match="weight is float32"):
        rn.add_rms_norm(x, None, jnp.ones((64,), jnp.float32), 1e-6, impl="pallas")


def test_layer_step_equals_layer_call():
    """DecoderLayer.step (the residual adds moved into the norms, the output left as h + mlp_out) computes what
    __call__ computes, and run_layers (steps chained) what a loop of __call__ computes: bit for bit off GPU."""
    model = LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(3))
    b, t = 2, 5
    x = jax.random.normal(jax.random.key(0), (b, t, model.config.hidden_size), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))

    def attn(cache, q, k, v, meta, layer_idx):
        from ulacache_jax.models.attention import dense_attention
        return cache, dense_attention(q, k, v, meta, meta)

    y_loop = x
    for i, layer in enumerate(model.layers):
        _, y_loop = layer(None, y_loop, pos, positions=pos, attn_fn=attn, layer_idx=i)
    _, y = model.run_layers(None, x, pos, pos, attn)
    tol = dict(rtol=1e-5, atol=1e-5) if ON_GPU else dict(rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_loop), **tol)
