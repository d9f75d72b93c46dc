"""The bucket hash of a logical page id (DESIGN.md section 4), as uint32 operations that run in plain jnp and
inside Pallas kernels alike (the PB-LRU sieve hashes requests in its programs).

bucket(LID) = ((LID * GOLDEN) mod 2**64) >> (64 - bits), with the LID held as two uint32 words (hi, lo), since
x64 stays off. Constants are numpy scalars (a Python int constant would be traced as int32 inside a kernel).
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

GOLDEN = 11400714819323198485  # 2**64 / phi, Fibonacci hashing
_C_HI, _C_LO = np.uint32(GOLDEN >> 32), np.uint32(GOLDEN & 0xFFFFFFFF)
_M16 = np.uint32(0xFFFF)


def mulhi_u32(a, b):
    """High 32 bits of the 64-bit product of two uint32 arrays, from 16-bit halves (lax.mulhi has no Pallas GPU
    lowering)."""
    a0, a1, b0, b1 = a & _M16, a >> np.uint32(16), b & _M16, b >> np.uint32(16)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    t = (p00 >> np.uint32(16)) + (p01 & _M16) + (p10 & _M16)
    return p11 + (p01 >> np.uint32(16)) + (p10 >> np.uint32(16)) + (t >> np.uint32(16))


def bucket_bits(hi, lo, bits: int):
    """hi, lo [...] uint32 -> bucket [...] int32 in [0, 2**bits); `bits` a static int in [0, 31]. No checks:
    callers validate (`ulacache_jax.cache.lid.bucket` is the checked entry point)."""
    if bits == 0:
        return jnp.zeros(jnp.shape(lo), jnp.int32)
    # high word of (hi:lo * GOLDEN) mod 2**64 = mulhi(lo, C_LO) + lo*C_HI + hi*C_LO (mod 2**32)
    top = mulhi_u32(lo, _C_LO) + lo * _C_HI + hi * _C_LO
    return (top >> np.uint32(32 - bits)).astype(jnp.int32)
