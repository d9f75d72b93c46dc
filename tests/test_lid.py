import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.cache import lid

GOLDEN = np.uint64(11400714819323198485)


def np_lid(seq, layer, group, tok):
    return (seq.astype(np.uint64) << np.uint64(44)) | (layer.astype(np.uint64) << np.uint64(36)) | \
        (group.astype(np.uint64) << np.uint64(32)) | tok.astype(np.uint64)


def split(x):
    return (x >> np.uint64(32)).astype(np.uint32), (x & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def fields(rng, n):
    return (rng.integers(0, 2**20, n), rng.integers(0, 2**8, n), rng.integers(0, 2**4, n),
            rng.integers(0, 2**32, n, dtype=np.uint64))


def test_pack_unpack_matches_uint64():
    rng = np.random.default_rng(0)
    seq, layer, group, tok = fields(rng, 10000)
    # edge values: zeros, each field at its max, all bits set
    seq = np.concatenate([seq, [0, 2**20 - 1, 0, 0, 0, 2**20 - 1]])
    layer = np.concatenate([layer, [0, 0, 255, 0, 0, 255]])
    group = np.concatenate([group, [0, 0, 0, 15, 0, 15]])
    tok = np.concatenate([tok, np.array([0, 0, 0, 0, 2**32 - 1, 2**32 - 1], np.uint64)])
    hi, lo = lid.pack(seq, layer, group, tok)
    want_hi, want_lo = split(np_lid(seq, layer, group, tok))
    assert hi.dtype == jnp.uint32 and lo.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(hi), want_hi)
    np.testing.assert_array_equal(np.asarray(lo), want_lo)
    s, l, g, t = lid.unpack(hi, lo)
    np.testing.assert_array_equal(np.asarray(s), seq)
    np.testing.assert_array_equal(np.asarray(l), layer)
    np.testing.assert_array_equal(np.asarray(g), group)
    np.testing.assert_array_equal(np.asarray(t).astype(np.uint64), tok)
    assert (hi[-1], lo[-1]) == (np.uint32(0xFFFFFFFF), np.uint32(0xFFFFFFFF))


@pytest.mark.parametrize("num_buckets", [1, 2, 64, 128, 1024, 2**20, 2**31])
def test_bucket_bit_exact(num_buckets):
    rng = np.random.default_rng(num_buckets % 97)
    x = rng.integers(0, 2**64, 20000, dtype=np.uint64)
    x = np.concatenate([x, np.array([0, 1, 2**32 - 1, 2**32, 2**64 - 1], np.uint64)])
    hi, lo = split(x)
    got = np.asarray(lid.bucket(jnp.asarray(hi), jnp.asarray(lo), num_buckets))
    bits = num_buckets.bit_length() - 1
    with np.errstate(over="ignore"):
        want = np.zeros_like(x) if bits == 0 else (x * GOLDEN) >> np.uint64(64 - bits)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got.astype(np.uint64), want)


def test_jit_and_traced():
    f = jax.jit(lambda s, l, g, t: lid.bucket(*lid.pack(s, l, g, t), 64))
    s, l, g, t = (jnp.arange(8, dtype=jnp.int32),) * 3 + (jnp.arange(8, dtype=jnp.uint32) * 64,)
    want = lid.bucket(*lid.pack(np.arange(8), np.arange(8), np.arange(8), np.arange(8) * 64), 64)
    np.testing.assert_array_equal(np.asarray(f(s, l, g, t)), np.asarray(want))


@pytest.mark.parametrize("name,args", [
    ("seq", (2**20, 0, 0, 0)), ("seq", (-1, 0, 0, 0)), ("layer", (0, 256, 0, 0)),
    ("group", (0, 0, 16, 0)), ("tok", (0, 0, 0, 2**32)), ("tok", (0, 0, 0, -5))])
def test_out_of_range_fields_raise(name, args):
    with pytest.raises(ValueError, match=f"'{name}'.*out of range"):
        lid.pack(*(np.asarray([a]) for a in args))


@pytest.mark.parametrize("nb", [0, 3, 48, -4, 2**32])
def test_bad_num_buckets(nb):
    hi = jnp.zeros(4, jnp.uint32)
    with pytest.raises(ValueError, match="power of two"):
        lid.bucket(hi, hi, nb)


def test_bad_word_dtype_and_shape():
    with pytest.raises(TypeError, match="uint32"):
        lid.bucket(jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.uint32), 4)
    with pytest.raises(ValueError, match="one shape"):
        lid.unpack(jnp.zeros(4, jnp.uint32), jnp.zeros(5, jnp.uint32))
    with pytest.raises(TypeError, match="integer"):
        lid.pack(np.zeros(2), 0, 0, 0)
