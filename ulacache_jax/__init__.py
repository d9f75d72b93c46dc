"""UlaCache-JAX: a two-tier (HBM + pinned host) paged KV cache with query-aware sparse attention for
long-context decoding. See README.md for the architecture and DESIGN.md (shared) for the contract."""
import os as _os

# Installed, setuptools maps pallas_kernels/ and models/ into this package. Run from a source tree without an
# install (the GPU machine gets a bare copy of the repo), they sit beside it: let submodule lookup see them.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pallas_kernels", "__init__.py")) and _root not in __path__:
    __path__.append(_root)

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
