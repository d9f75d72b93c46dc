"""Pallas kernels: the PB-LRU sieve, page copies between tiers, Quest page scores, sparse decode attention."""
import jax


def on_gpu() -> bool:
    """Whether `impl="auto"` runs the compiled kernels (the default backend is a GPU) or the references."""
    return jax.default_backend() == "gpu"
