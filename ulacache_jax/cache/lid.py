"""Logical page ids (LIDs): immutable 64-bit names of KV pages, held as two uint32 words (x64 stays off).

LID = seq << 44 | layer << 36 | group << 32 | tok   (DESIGN.md section 4)
hi  = seq << 12 | layer << 4 | group,   lo = tok

Everything here is arrays in, arrays out and jit-able. Range checks run at the Python boundary on concrete inputs
(a traced value cannot be checked without a host sync, so jitted callers are trusted). The hash itself lives with
the kernels (`pallas_kernels/lid_hash.py`: uint32 multiplies and shifts that also run inside the sieve kernel);
`bucket` is its checked entry point.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from ulacache_jax.pallas_kernels.lid_hash import GOLDEN, bucket_bits, mulhi_u32  # noqa: F401  (re-exported)

# field: (bits, shift inside hi); tok is the whole lo word.
SEQ_BITS, LAYER_BITS, GROUP_BITS, TOK_BITS = 20, 8, 4, 32
FIELD_LIMITS = {"seq": 1 << SEQ_BITS, "layer": 1 << LAYER_BITS, "group": 1 << GROUP_BITS, "tok": 1 << TOK_BITS}


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_field(name: str, x) -> None:
    """ValueError naming the field and its range when a concrete value is out of range."""
    if not _is_concrete(x):
        return
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"LID field {name!r} must be an integer array, got dtype {a.dtype}")
    if a.size == 0:
        return
    lo, hi = int(a.min()), int(a.max())
    limit = FIELD_LIMITS[name]
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise ValueError(f"LID field {name!r} = {bad} is out of range [0, {limit - 1}] ({name} has "
                         f"{int(np.log2(limit))} bits)")


def _as_u32(name: str, x) -> jax.Array:
    if _is_concrete(x):
        return jnp.asarray(np.asarray(x).astype(np.uint32))  # range already checked: the cast is exact
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"LID field {name!r} must be an integer array, got dtype {x.dtype}")
    return x.astype(jnp.uint32)


def pack(seq, layer, group, tok) -> tuple[jax.Array, jax.Array]:
    """Fields (broadcastable integer arrays) -> (hi, lo) uint32 arrays of the broadcast shape."""
    for name, v in (("seq", seq), ("layer", layer), ("group", group), ("tok", tok)):
        check_field(name, v)
    s, l, g, t = (_as_u32(n, v) for n, v in (("seq", seq), ("layer", layer), ("group", group), ("tok", tok)))
    hi = (s << np.uint32(12)) | (l << np.uint32(4)) | g
    lo = t
    hi, lo = jnp.broadcast_arrays(hi, lo)
    return hi, lo


def unpack(hi, lo) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(hi, lo) uint32 -> (seq int32, layer int32, group int32, tok uint32)."""
    hi, lo = _check_words(hi, lo)
    seq = (hi >> np.uint32(12)).astype(jnp.int32)
    layer = ((hi >> np.uint32(4)) & np.uint32(0xFF)).astype(jnp.int32)
    group = (hi & np.uint32(0xF)).astype(jnp.int32)
    return seq, layer, group, lo


def _check_words(hi, lo):
    for name, w in (("hi", hi), ("lo", lo)):
        if jnp.result_type(w) != jnp.uint32:
            raise TypeError(f"LID word {name!r} must be uint32, got {jnp.result_type(w)}")
    if np.shape(hi) != np.shape(lo):
        raise ValueError(f"LID words must have one shape, got hi {np.shape(hi)} and lo {np.shape(lo)}")
    return jnp.asarray(hi), jnp.asarray(lo)


def log2_buckets(num_buckets: int) -> int:
    """log2 of a power-of-two bucket count in [1, 2**31]; ValueError otherwise."""
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, (int, np.integer)):
        raise TypeError(f"num_buckets must be a Python int, got {type(num_buckets).__name__}")
    nb = int(num_buckets)
    if nb < 1 or nb > (1 << 31) or nb & (nb - 1):
        raise ValueError(f"num_buckets = {nb} must be a power of two in [1, 2**31]")
    return nb.bit_length() - 1


def bucket(hi, lo, num_buckets: int) -> jax.Array:
    """Bucket of each LID: ((LID * 11400714819323198485) mod 2**64) >> (64 - log2 B), int32; 0 when B == 1."""
    bits = log2_buckets(num_buckets)
    hi, lo = _check_words(hi, lo)
    return bucket_bits(hi, lo, bits)

