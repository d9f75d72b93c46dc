"""A projected key copy: every flushed key's coordinates in the top principal subspace of the sequence's own keys.

Why: the key copy (key_copy.py) keeps C channels of each key, the labels (labels.py) C channels as whole rotary
pairs; both drop the other D - C coordinates whole. On Qwen2.5-Coder-0.5B at 1/32 of the context the copy of all
64 channels (exact page mass) keeps every needle dense finds, 16 channels about half (docs/BENCHMARKS.md): the
scorer's precision, not the page granularity, loses them. Keys of one head live near a low-dimensional subspace
after RoPE (Loki, arXiv 2406.02542), so C coordinates in the keys' principal basis can keep more of q.k than C
channels: the copy stores (k - mean) @ B and a page scores the softmax mass of (q @ B) . ((k - mean) @ B) / sqrt(D)
(the mean's term q . mean is the same for every key, so the mass does not depend on it), with B [D, C] the
eigenvectors of the C largest eigenvalues of the covariance of the live keys of the sequence's first prefill
block, per (sequence, layer, KV head), fixed for the sequence's life (as the copy's channels are).

Storage and scoring are the key copy's (and, with bits 8 / 4, the labels': codes with a scale per page and
coordinate, dequantised in the page-mass kernel): only `pick` (the basis instead of channel ids) and the state's
`chan` (a float32 affine projection [.., g, D + 1, C]: the basis, then minus the mean's coordinates; instead of
int32 ids [.., g, C]) differ; key_copy.compress and page_mass project where `chan` is one. A free slot's basis is the first C unit vectors (channels 0..C-1) until its
first block picks its own. No prefix sharing: the basis is a sequence's own.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ulacache_jax.cache.select.labels import Labels


def pick_basis(k, live, num_channels: int):
    """k [..., T, g, D] keys; live [..., T] bool -> [..., g, D + 1, C] float32, an affine projection: rows 0..D-1 the
    C principal directions of the live keys around their mean (eigenvectors of their covariance, largest
    eigenvalue first), row D minus the mean's coordinates in them, so [k, 1] @ it = (k - mean) @ basis. Centred
    because a page's softmax mass is blind to what every key shares (q . mean adds the same to every logit):
    uncentred, the top directions go to the keys' large common offset and carry no ranking. Where no token is
    live: unit vectors 0..C-1 and a zero mean."""
    kf = k.astype(jnp.float32)
    w = live.astype(jnp.float32)[..., None, None]                                        # [..., T, 1, 1]
    n = jnp.maximum(jnp.sum(w, axis=-3), 1.0)                                           # [..., 1, 1]
    mean = jnp.sum(kf * w, axis=-3) / n                                                 # [..., g, D]
    x = (kf - mean[..., None, :, :]) * w
    m = jnp.einsum("...tgd,...tge->...gde", x, x)                                       # [..., g, D, D]
    _, vec = jnp.linalg.eigh(m)                                                         # ascending eigenvalues
    top = vec[..., ::-1][..., :num_channels]                                            # [..., g, D, C]
    D = k.shape[-1]
    any_live = jnp.any(live, axis=-1)[..., None, None, None]
    top = jnp.where(any_live, top, jnp.eye(D, num_channels, dtype=jnp.float32))
    shift = -jnp.einsum("...gd,...gdc->...gc", jnp.where(any_live[..., 0], mean, 0.0), top)   # [..., g, C]
    return jnp.concatenate([top, shift[..., None, :]], axis=-2)


@dataclasses.dataclass(frozen=True)
class KeyPCA(Labels):
    """C = `channels` principal coordinates of every flushed key: in the model's dtype (bits 0) or as labels
    (bits 8 / 4, a scale per page and coordinate)."""
    bits: int = 0
    name: ClassVar[str] = "key_pca"

    def check(self, config):
        if not 0 < self.channels <= config.head_dim:
            raise ValueError(f"KeyPCA: channels = {self.channels} must be in [1, head_dim = {config.head_dim}]")
        if self.bits not in (0, 4, 8) or (self.bits == 4 and self.channels % 2):
            raise ValueError(f"KeyPCA: bits = {self.bits} must be 0 (the model's dtype), 8 or 4 (with an even "
                             f"channels = {self.channels})")
        if self.table is not None:
            raise ValueError("KeyPCA: the basis is each sequence's own; an offline channel table does not apply")

    def pick(self, k, live, num_channels):
        return pick_basis(k, live, num_channels)

    def encode(self, x, dtype):
        return (x.astype(dtype), None) if self.bits == 0 else super().encode(x, dtype)

    def initial_channels(self, config, ranks: int = 1):
        c, C = config, self.channels
        shape = (ranks, c.max_seqs, c.num_layers, c.groups_per_rank, c.kv_heads_per_group, c.head_dim + 1, C)
        return jnp.broadcast_to(jnp.eye(c.head_dim + 1, C, dtype=jnp.float32), shape)    # unit vectors, no shift

    def step_bytes(self, *, context, num_layers, kv_heads, head_dim, itemsize, page_size):
        if self.bits == 0:
            return context * num_layers * kv_heads * self.channels * itemsize
        return super().step_bytes(context=context, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim,
                                  itemsize=itemsize, page_size=page_size)
