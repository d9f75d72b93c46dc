"""The environment of a test's subprocess that needs several CPU devices: jax reads XLA_FLAGS once, at start, so
the main pytest process (one device) runs multi-device checks in a child with the forced device count appended to
whatever flags the suite runs under (the Makefile's compile flags)."""
from __future__ import annotations

import os


def forced_devices(n: int) -> dict:
    """os.environ for a child on the CPU backend with n host devices."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
