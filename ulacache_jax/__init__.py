"""UlaCache-JAX: a two-tier (HBM + pinned host) paged KV cache with query-aware sparse attention for
long-context decoding. See README.md for the architecture and DESIGN.md (shared) for the contract."""
from . import lid, pb_lru, vtlb

__all__ = ["lid", "pb_lru", "vtlb"]
