"""UlaCache-JAX: a two-tier (HBM + pinned host) paged KV cache with query-aware sparse attention for
long-context decoding. See README.md for the architecture and DESIGN.md (shared) for the contract.

Every public name loads on first use: importing the package imports no JAX, so the `ulacache` command starts
its signal handling (Ctrl-C, SIGTERM: one line, no traceback) before the seconds JAX takes to import.
ulacache_jax.pallas_kernels and ulacache_jax.models: in a checkout, ulacache_jax/pallas_kernels and
ulacache_jax/models are links to the top-level folders; installed, setuptools' package-dir mapping (pyproject).
"""
import importlib

__all__ = ["lid", "pb_lru", "vtlb", "generate", "Engine", "SamplingParams", "SpecConfig"]

# public name -> (module, attribute or None for the module itself)
_LAZY = {"lid": ("cache.lid", None), "pb_lru": ("cache.pb_lru", None), "vtlb": ("cache.vtlb", None),
         "generate": ("runtime.generation", "generate"), "Engine": ("runtime.engine", "Engine"),
         "SamplingParams": ("runtime.engine", "SamplingParams"),
         "SpecConfig": ("runtime.speculative.rules", "SpecConfig")}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'ulacache_jax' has no attribute {name!r}")
    module, attr = _LAZY[name]
    mod = importlib.import_module(f".{module}", __name__)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
