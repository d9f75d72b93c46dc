"""Pallas kernels: the PB-LRU sieve, page copies between tiers, Quest page scores, page top-k, sparse decode
attention; and what they share: the backend test, the impl choice and the power-of-two rounding of block sizes."""
import jax


def on_gpu() -> bool:
    """Whether `impl="auto"` runs the compiled kernels (the default backend is a GPU) or the references."""
    return jax.default_backend() == "gpu"


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (sm_90: wgmma and TMA, what the Mosaic GPU kernels are written
    for; a Blackwell or Ampere GPU takes the Triton kernels)."""
    if not on_gpu():
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).split(".")[0] == "9"


def pick_impl(impl: str) -> str:
    """'auto' -> 'pallas' on GPU, 'ref' elsewhere; 'pallas' and 'ref' as given; anything else is refused."""
    if impl not in ("auto", "pallas", "ref"):
        raise ValueError(f"impl = {impl!r} must be 'auto', 'pallas' or 'ref'")
    if impl == "auto":
        return "pallas" if on_gpu() else "ref"
    return impl


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): Triton block shapes are powers of two."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()
