"""The split merge kernel (pallas_kernels/split_merge.py) against its reference: interpret mode on CPU, compiled on
the GPU (`-m gpu`). The kernel sums the splits in another order than XLA, so outputs agree to float32 rounding
before the cast: one unit in the last place of bf16, 1e-6 relative in fp32.

Adversarial partials: padding splits holding NaN (never written by the partials kernel), rows no split saw (every
lse -inf: output 0), splits that saw nothing beside ones that did, lse spread over +-80 (exp underflows to 0 for
all but the top split), padding rows past M holding NaN; shapes of the decode (17 splits of 32, 8 kv heads x 4
rows, D = 128), of SmolLM2 (r = 3: rows not a power of two), and of a verification (Q = 4: rows in chunks)."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.pallas_kernels import split_merge as sm


def _partials(seed, b, kv, splits, sp, nq, r, d, dtype):
    rng = np.random.default_rng(seed)
    mr = max(64, 1 << (nq * r - 1).bit_length())
    o = rng.standard_normal((b, kv, sp, mr, d)).astype(np.float32)
    lse = rng.uniform(-80, 80, (b, kv, sp, mr)).astype(np.float32)
    lse[:, :, splits:] = np.nan                                   # padding splits
    o[:, :, splits:] = np.nan
    o[:, :, :, nq * r:] = np.nan                                  # padding rows
    lse[0, 0, :splits, 0] = -np.inf                               # a row nobody saw
    lse[-1, -1, : splits // 2 + 1, -1] = -np.inf                  # some splits saw nothing
    return jnp.asarray(o, dtype), jnp.asarray(lse)


CASES = [dict(b=1, kv=8, splits=17, sp=32, nq=1, r=4, d=128), dict(b=3, kv=3, splits=5, sp=8, nq=1, r=3, d=64),
         dict(b=2, kv=2, splits=3, sp=4, nq=4, r=4, d=128), dict(b=1, kv=1, splits=1, sp=1, nq=1, r=1, d=64)]


@pytest.mark.gpu                          # also in `make test-gpu`: compiled there, interpret mode on CPU
@pytest.mark.parametrize("case", CASES, ids=["decode", "smollm2", "verify", "one-split"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_kernel_equals_reference(case, dtype):
    o, lse = _partials(len(CASES) + case["splits"], case["b"], case["kv"], case["splits"], case["sp"], case["nq"],
                       case["r"], case["d"], dtype)
    kw = dict(splits=case["splits"], nq=case["nq"], r=case["r"])
    got = sm.merge_splits(o, lse, impl="pallas", **kw)
    want = sm.ref_merge_splits(o, lse, **kw)
    assert got.shape == want.shape == (case["b"], case["nq"], case["kv"] * case["r"], case["d"])
    assert got.dtype == dtype
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(g).all() and np.isfinite(w).all()
    assert (g[0, 0, 0] == 0).all()                                # the row nobody saw
    rtol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-6)


def test_bad_arguments_are_refused():
    o, lse = _partials(0, 1, 2, 3, 4, 1, 2, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="splits = 5"):
        sm.merge_splits(o, lse, splits=5, nq=1, r=2)
    with pytest.raises(ValueError, match="nq \\* r = 40 \\* 2"):
        sm.merge_splits(o, lse, splits=3, nq=40, r=2)
    with pytest.raises(ValueError, match="float32"):
        sm.merge_splits(o, lse.astype(jnp.bfloat16), splits=3, nq=1, r=2)
    with pytest.raises(ValueError, match="powers of two"):
        sm.merge_splits(o[:, :, :3], lse[:, :, :3], splits=3, nq=1, r=2, impl="pallas")
    with pytest.raises(ValueError, match="impl"):
        sm.merge_splits(o, lse, splits=3, nq=1, r=2, impl="xla")
