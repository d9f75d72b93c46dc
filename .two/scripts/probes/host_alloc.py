"""Probe: how fast XLA's pinned-host allocator hands out FRESH host memory, one allocation or many in parallel.

Why: a sparse cache's setup time grows ~0.6-0.75 s per GB of host pool (bench_decode's `setup_s`; 86.7 s for the
117 GB pool of 32K x 27) while ingestion moves ~47 GB/s. This isolates the allocation: each run is its own
process, so the allocator starts cold, as a server's does.
    python3 scripts/probes/host_alloc.py {seq|par} GB PIECES      (GPU only; prints one line)
"""
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "200")  # above XLA's 64 GiB default (cache_state)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def main(mode: str, gb: int, pieces: int) -> None:
    hs = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    shape = (gb * 2**30 // 2 // 4096 // pieces, 4096)                    # bf16 rows of 8 KiB, one piece
    zeros = jax.jit(lambda: jnp.zeros(shape, jnp.bfloat16), out_shardings=hs)  # as cache_state.init makes the pool
    zeros.lower().compile()                                              # compile outside the timing
    t0 = time.perf_counter()
    if mode == "par":
        with ThreadPoolExecutor(pieces) as ex:
            xs = list(ex.map(lambda _: jax.block_until_ready(zeros()), range(pieces)))
    else:
        xs = [jax.block_until_ready(zeros()) for _ in range(pieces)]
    dt = time.perf_counter() - t0
    again = time.perf_counter()
    del xs
    jax.block_until_ready([zeros() for _ in range(pieces)])              # the allocator now reuses its memory
    print(f"{mode} {gb} GB in {pieces} pieces: {dt:.2f} s = {gb / dt:.2f} GB/s fresh; "
          f"{time.perf_counter() - again:.2f} s reused", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("seq", "par"):
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
