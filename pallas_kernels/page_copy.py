"""Page copies across the HBM <-> pinned-host boundary: `fetch` (host pool -> HBM frames) and `flush` (HBM pages ->
host pool), zero-copy Pallas kernels (Triton lowering) that touch only the addressed pages.

Why a kernel (DESIGN.md section 1): XLA gather on a `pinned_host` operand fails inside jit and XLA scatter into one
becomes slow host compute, while a Pallas kernel given the host array with `memory_space=ANY` reads and writes it
directly over PCIe (UVA), near the rate of a bulk device_put of the same bytes (docs/BENCHMARKS.md, page copies).
Both functions copy whole pages by index; an entry whose source or destination index is negative (or out of
range) is skipped, so callers pass fixed-size index vectors padded with -1 (no recompilation per miss count).

Kernel design:
- One program copies `pages_per_program` consecutive entries of the index vectors (static unroll; the vectors are
  padded with -1 to a multiple). Each entry reads its two int32 indices as scalars and, under `pl.when`, copies
  the page as a few power-of-two tiles (Triton needs power-of-two block sizes; a page of 64 x 1 x 128 bf16 is one
  16 KiB tile). An invalid entry costs two scalar loads and a branch: no page traffic.
- The destination is aliased (`input_output_aliases`): only the addressed pages are written, never the whole pool.
  For `flush` the caller's jit donates the host pool and gives `out_shardings` with memory kind `pinned_host`
  (`flush_donated` does exactly that); for `fetch` the HBM pool is donated the same way.
- Offsets: the Triton lowering switches to 64-bit offsets when an operand exceeds 2**32 bytes (jax 0.11.2 and
  0.12), and the page index is a scalar on the leading axis, so pools over 2**31 elements are addressed correctly
  (probed on the H200: a 5 GiB pinned pool and a 5 GiB HBM pool round-trip exactly past element 2**31).
- Pages per program (1..8) and the warp count do not change the rate (PCIe bound: docs/BENCHMARKS.md), so the
  default is one page per program. K and V go in one launch by passing lists.
- A leading rank axis ([R, pages, ...], the cache state's layout) is indexed inside the kernel (`rank=`), so no XLA
  slice of a pinned_host operand is needed; under `jax.shard_map` the output type carries the input's manual axes.

Contract for duplicates: valid destination indices must be distinct within one call (the copies run in parallel,
like any scatter); the references then agree with the kernels bit for bit.

On CPU `impl="auto"` runs the jnp references (interpret mode is for tests); on GPU the kernels.
"""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from . import on_gpu, pick_impl

PAGES_PER_PROGRAM = 1      # entries per program: 1, 2, 4, 8 copy at one rate (PCIe bound)
NUM_WARPS = 4              # 128 threads move a 16 KiB tile as 8 x 16-byte loads each
MAX_TILE_BYTES = 16384     # a larger page is split into several power-of-two tiles of at most this size
_ANY = pl.BlockSpec(memory_space=pl.ANY)


def _pow2_parts(n: int) -> list[tuple[int, int]]:
    """(start, size) pieces of [0, n) with power-of-two sizes, largest first (binary decomposition)."""
    parts, start = [], 0
    for bit in reversed(range(n.bit_length())):
        size = 1 << bit
        if n & size:
            parts.append((start, size))
            start += size
    return parts


def page_tiles(page_shape: tuple[int, ...], itemsize: int, max_tile_bytes: int = MAX_TILE_BYTES):
    """Static tiling of one page [rows, heads, dim] into power-of-two blocks of <= max_tile_bytes (>= one row
    piece). Returns a list of ((r0, rs), (h0, hs), (d0, ds))."""
    rows, heads, dim = page_shape
    max_elems = max(1, max_tile_bytes // itemsize)
    tiles = []
    for h0, hs in _pow2_parts(heads):
        for d0, ds in _pow2_parts(dim):
            # rows per tile: the largest power of two with rs * hs * ds <= max_elems (at least 1)
            rs_cap = max(1, max_elems // (hs * ds))
            rs_cap = 1 << (rs_cap.bit_length() - 1)
            for r0, rn in _pow2_parts(rows):
                rs = min(rn, rs_cap)
                for r in range(r0, r0 + rn, rs):
                    tiles.append(((r, rs), (h0, hs), (d0, ds)))
    return tiles


def _copy_kernel(*refs, num_arrays, pages_per_program, tiles, src_sizes, dst_sizes, src_rank, dst_rank):
    # refs: src_idx [Np] int32, dst_idx [Np] int32, then one [1] int32 ref per traced rank (source, destination),
    #       src_0..src_{A-1} [(R,) M, rows, heads, dim] (HBM or pinned host),
    #       dst_in_0..dst_in_{A-1} (aliased to the outputs, never read), dst_0..dst_{A-1} [(R,) F, rows, heads, dim].
    # src_rank / dst_rank (static): None (no rank axis), an int (baked in) or "ref" (read from its [1] ref).
    # The rank axis is indexed by scalar inside the kernel: no XLA slice of a pinned_host operand outside it.
    src_idx_ref, dst_idx_ref = refs[0], refs[1]
    k = 2
    pre = []
    for r in (src_rank, dst_rank):
        if r is None:
            pre.append(())
        elif r == "ref":
            pre.append((refs[k][0],))
            k += 1
        else:
            pre.append((r,))
    s_pre, d_pre = pre
    srcs = refs[k:k + num_arrays]
    dsts = refs[k + 2 * num_arrays:]
    base = pl.program_id(0) * pages_per_program
    entries = []
    for j in range(pages_per_program):
        s = src_idx_ref[base + j]
        d = dst_idx_ref[base + j]
        ok = (s >= 0) & (d >= 0) & (s < src_sizes) & (d < dst_sizes)
        entries.append((s, d, ok))
    for s, d, ok in entries:
        @pl.when(ok)
        def _copy(s=s, d=d):
            for a in range(num_arrays):
                for (r0, rs), (h0, hs), (c0, cs) in tiles[a]:
                    sl = (pl.ds(r0, rs), pl.ds(h0, hs), pl.ds(c0, cs))
                    dsts[a][d_pre + (d,) + sl] = srcs[a][s_pre + (s,) + sl]


def _as_list(x) -> tuple[list[jax.Array], bool]:
    if isinstance(x, (list, tuple)):
        return list(x), True
    return [x], False


def _prepare(dst, src, src_idx, dst_idx, src_rank, dst_rank):
    """Validate shapes; returns (dsts, srcs, is_seq, src_idx, dst_idx, src_ranked, dst_ranked)."""
    dsts, is_seq = _as_list(dst)
    srcs, _ = _as_list(src)
    src_idx = jnp.asarray(src_idx, jnp.int32)
    dst_idx = jnp.asarray(dst_idx, jnp.int32)
    if len(dsts) != len(srcs) or not dsts:
        raise ValueError(f"page_copy: {len(srcs)} source arrays but {len(dsts)} destination arrays")
    src_ranked, dst_ranked = src_rank is not None, dst_rank is not None
    for a, (d, s) in enumerate(zip(dsts, srcs)):
        if d.ndim != 4 + dst_ranked or s.ndim != 4 + src_ranked:
            raise ValueError(f"page_copy: array {a}: expected [{'R, ' * src_ranked}pages, page, heads, dim] -> "
                             f"[{'R, ' * dst_ranked}pages, page, heads, dim], got {s.shape} -> {d.shape}")
        if d.shape[-3:] != s.shape[-3:] or d.dtype != s.dtype:
            raise ValueError(f"page_copy: array {a}: page {s.shape[-3:]} {s.dtype} does not match "
                             f"{d.shape[-3:]} {d.dtype}")
    if len({s.shape[:-3] for s in srcs}) != 1 or len({d.shape[:-3] for d in dsts}) != 1:
        raise ValueError("page_copy: all source (destination) arrays of one call need the same leading shape")
    if src_idx.ndim != 1 or src_idx.shape != dst_idx.shape:
        raise ValueError(f"page_copy: index vectors must be 1-D and equal: {src_idx.shape} vs {dst_idx.shape}")
    return dsts, srcs, is_seq, src_idx, dst_idx, src_ranked, dst_ranked


def _rank_spec(r):
    """(static spec, operand or None): a Python int is baked into the kernel, a traced scalar becomes a [1] ref
    (a reshape: a bitcast in XLA, no extra kernel)."""
    if r is None:
        return None, None
    if isinstance(r, (int, np.integer)):
        return int(r), None
    return "ref", jnp.reshape(jnp.asarray(r, jnp.int32), (1,))


def _out_struct(x):
    """The aliased output's type; under `jax.shard_map` (check_vma) it varies over the same mesh axes as x."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    if mat is None:
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, manual_axis_type=mat)


def copy_pages_pallas(dst, src, src_idx, dst_idx, *, src_rank=None, dst_rank=None,
                      pages_per_program: int = PAGES_PER_PROGRAM, num_warps: int = NUM_WARPS,
                      interpret: bool | None = None, name: str = "page_copy"):
    """dst[dst_idx[i]] = src[src_idx[i]] for every valid i, by one Pallas kernel; dst is aliased (donate it).

    dst [F, page, heads, dim] or a list of such (K and V: one launch), src [M, page, heads, dim] (a list of the
    same length), src_idx / dst_idx [N] int32 (-1 or out of range = skip). With `src_rank` / `dst_rank` (int or
    traced int32 scalar) that side carries a leading rank axis [R, ...] indexed inside the kernel."""
    dsts, srcs, is_seq, src_idx, dst_idx, _, _ = _prepare(
        dst, src, src_idx, dst_idx, src_rank, dst_rank)
    n = src_idx.shape[0]
    if n == 0:
        return dst
    ppp = max(1, min(int(pages_per_program), n))
    n_pad = -(-n // ppp) * ppp
    if n_pad != n:
        pad = (0, n_pad - n)
        src_idx = jnp.pad(src_idx, pad, constant_values=-1)
        dst_idx = jnp.pad(dst_idx, pad, constant_values=-1)
    (s_spec, s_arg), (d_spec, d_arg) = _rank_spec(src_rank), _rank_spec(dst_rank)
    rank_args = [a for a in (s_arg, d_arg) if a is not None]
    if interpret is None:
        interpret = not on_gpu()
    num = len(dsts)
    tiles = tuple(tuple(page_tiles(d.shape[-3:], d.dtype.itemsize)) for d in dsts)
    body = functools.partial(_copy_kernel, num_arrays=num, pages_per_program=ppp, tiles=tiles,
                             src_sizes=srcs[0].shape[-4], dst_sizes=dsts[0].shape[-4],
                             src_rank=s_spec, dst_rank=d_spec)
    body.__name__ = name  # the Triton kernel's name: profiles tell variants apart by it
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = pltr.CompilerParams(num_warps=num_warps, num_stages=1)
    out = pl.pallas_call(
        body, grid=(n_pad // ppp,), interpret=interpret, name=name,
        out_shape=[_out_struct(d) for d in dsts],
        in_specs=[_ANY] * (2 + len(rank_args) + 2 * num), out_specs=[_ANY] * num,
        input_output_aliases={2 + len(rank_args) + num + a: a for a in range(num)}, **kwargs,
    )(src_idx, dst_idx, *rank_args, *srcs, *dsts)
    return list(out) if is_seq else out[0]


def ref_copy_pages(dst, src, src_idx, dst_idx, *, src_rank=None, dst_rank=None):
    """Plain-jnp reference of copy_pages_pallas (same skipping rule, same signature)."""
    dsts, srcs, is_seq, src_idx, dst_idx, _, _ = _prepare(dst, src, src_idx, dst_idx, src_rank, dst_rank)
    out = []
    for d, s in zip(dsts, srcs):
        s_r = s if src_rank is None else s[src_rank]
        d_r = d if dst_rank is None else d[dst_rank]
        ok = (src_idx >= 0) & (dst_idx >= 0) & (src_idx < s_r.shape[0]) & (dst_idx < d_r.shape[0])
        pages = s_r[jnp.where(ok, src_idx, 0)]
        at = jnp.where(ok, dst_idx, d_r.shape[0])
        # with a rank, one scatter into the whole [R, ...] array: d[rank].at[..].set(..) put back with d.at[rank]
        # made XLA copy the whole destination (the host pool) on every call
        out.append(d_r.at[at].set(pages, mode="drop") if dst_rank is None
                   else d.at[dst_rank, at].set(pages, mode="drop"))
    return out if is_seq else out[0]


def fetch(pool, host, host_idx, frame_idx, *, rank=None, impl: str = "auto", **kernel_kwargs):
    """Copy host pages into HBM frames: pool[frame_idx[i]] = host[host_idx[i]] where both indices are valid.

    pool [F, page, g, D] in HBM (aliased: donate it at the jit boundary); host [H, page, g, D] (pinned_host on GPU,
    read zero-copy); host_idx, frame_idx [N] int32, -1 = skip. pool and host may be lists (K and V together: one
    kernel launch). With `rank` (int or traced scalar) both carry the leading rank axis ([R, F, ...], [R, H, ...])
    and that rank's pages are copied, indexed inside the kernel. Returns the new pool."""
    if pick_impl(impl) == "ref":
        return ref_fetch(pool, host, host_idx, frame_idx, rank=rank)
    kernel_kwargs.setdefault("name", "fetch_pages")
    return copy_pages_pallas(pool, host, host_idx, frame_idx, src_rank=rank, dst_rank=rank, **kernel_kwargs)


def ref_fetch(pool, host, host_idx, frame_idx, *, rank=None):
    return ref_copy_pages(pool, host, host_idx, frame_idx, src_rank=rank, dst_rank=rank)


def flush(host, src, src_idx, host_idx, *, rank=None, impl: str = "auto", **kernel_kwargs):
    """Write pages through to the host pool: host[host_idx[i]] = src[src_idx[i]] where both indices are valid.

    host [H, page, g, D] (pinned_host on GPU; aliased: the caller's jit donates it and gives out_shardings with
    memory kind pinned_host, see `flush_donated`); src [M, page, g, D] in HBM (the pool or a batch of new pages);
    src_idx, host_idx [N] int32, -1 = skip. Lists allowed as in `fetch`. With `rank`, host is [R, H, ...] and so is
    src if it has 5 axes (the pool), else src is one batch [M, ...]. Returns the new host pool.
    The reference (an XLA scatter) is for CPU and tests: on GPU, XLA scatter into pinned_host is slow host compute."""
    src_rank = rank if rank is not None and _as_list(src)[0][0].ndim == 5 else None
    if pick_impl(impl) == "ref":
        return ref_copy_pages(host, src, src_idx, host_idx, src_rank=src_rank, dst_rank=rank)
    kernel_kwargs.setdefault("name", "flush_pages")
    return copy_pages_pallas(host, src, src_idx, host_idx, src_rank=src_rank, dst_rank=rank, **kernel_kwargs)


def ref_flush(host, src, src_idx, host_idx, *, rank=None):
    src_rank = rank if rank is not None and _as_list(src)[0][0].ndim == 5 else None
    return ref_copy_pages(host, src, src_idx, host_idx, src_rank=src_rank, dst_rank=rank)


def _sharding_key(x):
    return tuple(a.sharding for a in x) if isinstance(x, (list, tuple)) else x.sharding


@functools.lru_cache(maxsize=64)
def _donating_jit(fn, shardings, impl: str, kw: tuple):
    out = list(shardings) if isinstance(shardings, tuple) else shardings
    return jax.jit(functools.partial(fn, impl=impl, **dict(kw)), donate_argnums=0, out_shardings=out)


def flush_donated(host, src, src_idx, host_idx, *, rank: int | None = None, impl: str = "auto", **kernel_kwargs):
    """Jitted `flush` that donates `host` and keeps its sharding (memory kind pinned_host stays pinned_host): the
    pattern callers use. Do not touch `host` afterwards, and never np.asarray it before (a numpy view blocks its
    donation: 'Donation requested for buffer with external reference')."""
    kw = tuple(sorted({**kernel_kwargs, "rank": rank}.items()))
    return _donating_jit(flush, _sharding_key(host), impl, kw)(host, src, src_idx, host_idx)


def fetch_donated(pool, host, host_idx, frame_idx, *, rank: int | None = None, impl: str = "auto",
                  **kernel_kwargs):
    """Jitted `fetch` that donates `pool` and keeps its sharding (`rank` is static here)."""
    kw = tuple(sorted({**kernel_kwargs, "rank": rank}.items()))
    return _donating_jit(fetch, _sharding_key(pool), impl, kw)(pool, host, host_idx, frame_idx)
