"""UlaCache-JAX: a two-tier (HBM + pinned host) paged KV cache with query-aware sparse attention for
long-context decoding. See README.md for the architecture and DESIGN.md (shared) for the contract."""
# ulacache_jax.pallas_kernels and ulacache_jax.models: in a checkout, ulacache_jax/pallas_kernels and
# ulacache_jax/models are links to the top-level folders; installed, setuptools' package-dir mapping (pyproject).
from . import lid, pb_lru, vtlb  # noqa: E402
# Binding the function after the submodule loads makes `ulacache_jax.generate` the function (the API);
# `from ulacache_jax.generation import Generator` still finds the module through sys.modules.
from .generation import generate  # noqa: E402

__all__ = ["lid", "pb_lru", "vtlb", "generate", "Engine"]


def __getattr__(name):
    # lazy: the engine pulls in tokenizers and reporting
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(f"module 'ulacache_jax' has no attribute {name!r}")
