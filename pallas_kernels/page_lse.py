"""Per-page log-sum-exp of approximate logits over the key copy, as a Pallas kernel (the key copy's page scores).

lse[s, j, r, p] = log sum_{t in page p} exp(kc[s, layer, j, p, t, i(r)] . qc[s, j, r])
for each query row r of group j (r = i * H + x: KV head i of the group, its x-th query row; a verification's rows
and a KV head's query heads are all rows here). The caller (ulacache_jax.cache.select.key_copy.page_mass) masks
unflushed pages, normalises each row over the pages (a softmax over every flushed token, done per page so the token
weights are never written) and sums the rows. XLA's version materialises the float32 logits [S, rows, P, page] of
every layer and reads them back; this kernel reads the copy once and writes [S, G, rows, P].
One program per (sequence, group, block of pages), or with `pages_per_program` per (sequence, group, span of
pages) looping over the span's blocks (fewer, longer programs: at the 8B shape one block is 4 pages, 8 KB of 4-bit
codes, and a layer launches S * G * P / 4 programs); the layer is a static index into the full copy (no per-layer
slice is materialised). Rows beyond the caller's (padding to a power of two) compute garbage the caller drops.
4-bit labels with a page and C / 2 code bytes of >= 16 take label_lse_mma instead: the codes made float16 in
registers by inline PTX, times the queries (truncated to 11 bits) on the tensor cores, a span of pages a program
with the codes of later pages in flight (2.1x the label kernel above at the 8B shape, docs/BENCHMARKS.md).
Axis alphabet: S sequences, L layers, G groups, P pages, T tokens of a page, g KV heads per group, C copy channels,
H query rows per KV head, p pages of a block (or of a program's span).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from . import next_pow2, on_gpu, pick_impl

DEFAULT_WARPS = 4
BLOCK_ELEMS = 16384  # fp32 values of one block's copy (pages x T x C): 64 a thread at 4 warps, no spill
# The label kernel's launch: its work a page (unpack, a product and a sum a query row) is instruction-bound, so
# more pages or warps a program only add registers and reductions; one page at one warp was the fastest of blocks
# 1 / 2 x warps 1 / 2 / 4 (bench_labels, H200, docs/BENCHMARKS.md)
LABEL_BLOCK_PAGES = 1
LABEL_WARPS = 1
# Code bytes a token read at a time (a 32-byte row at C = 64, 4 bits, is two 16-byte reads). Measured only together
# with scaling the codes (labels.json run C: 157.4 vs 156.7 us at C = 64, no gain; with the query-row scaling it
# lost, 199.3); at C <= 32 a row is one chunk, so it changes nothing there
CHUNK_BYTES = 16


def _lse_kernel(kc_ref, q_ref, out_ref, *, g: int, rows: int, bp: int | None = None):
    # kc_ref [p, T, g * C] (this sequence, layer, group, page span); q_ref [g * rows, C] float32 (scaled);
    # out_ref [g * rows, p]: one row of page log-sum-exps per query row. bp: pages an iteration (None: the whole
    # block in one step, the default launch; else the span is walked bp pages at a time, see _over_blocks)
    def block(pg):
        p = kc_ref.shape[0] if bp is None else bp
        c = kc_ref.shape[2] // g
        for i in range(g):
            k = kc_ref[pg, :, pl.ds(i * c, c)].astype(jnp.float32)                     # [p, T, C]
            _rows_lse([(k, 0)], q_ref, out_ref, i, rows, pg, p)
    _over_blocks(block, kc_ref.shape[0], bp)


TWO23 = 8388608.0          # 2**23: a float32 whose bits are 0x4B000000 | n (n < 2**23) is exactly 2**23 + n


def small_ints(x, bias: float):
    """x int32 [...] in [0, 2**23) -> float32(x) - bias, exactly, by bits: OR x into 2**23's mantissa and subtract
    (two full-rate ops) instead of an int-to-float conversion, which the SM runs at a fraction of the FMA rate;
    unpacking two conversions a code byte is most of the label kernel's non-FMA work."""
    return jax.lax.bitcast_convert_type(x | 0x4B000000, jnp.float32) - (TWO23 + bias)


def _label_kernel(kc_ref, sc_ref, q_ref, out_ref, *, g: int, rows: int, bits: int, bp: int | None = None):
    # kc_ref [p, T, g * Cs] label codes (int8, or uint8 two channels a byte at 4 bits); sc_ref [p, g * C] scales
    # per page and channel as stored (bfloat16: widened here, so no float32 copy of them is written per layer);
    # q_ref, out_ref, bp as _lse_kernel's. Dequantised in registers: codes are read once. At 4 bits the low nibbles
    # are channels [0, C/2) and the high ones [C/2, C): two halves, no interleave. Codes become floats by bits
    # (small_ints: two full-rate ops, not a conversion) and are read CHUNK_BYTES code bytes a token at a time;
    # each value is multiplied by its page's channel scale. Scaling the codes (a product a value) rather than every
    # query row per page (rows x C products in every thread, which holds all of a page's query values) was the
    # faster of the two on an H100 (docs/BENCHMARKS.md, labels.json run C).
    def block(pg):
        p = kc_ref.shape[0] if bp is None else bp
        cs = kc_ref.shape[2] // g
        c = cs * 2 if bits == 4 else cs
        w = min(cs, CHUNK_BYTES)
        for i in range(g):
            parts = []
            for b0 in range(0, cs, w):
                b = kc_ref[pg, :, pl.ds(i * cs + b0, w)].astype(jnp.int32)             # [p, T, w]
                vals = ([(small_ints(b + 128, 128.0), b0)] if bits == 8 else
                        [(small_ints(b & 15, 8.0), b0), (small_ints(b >> 4, 8.0), cs + b0)])
                for v, c0 in vals:
                    s = sc_ref[pg, pl.ds(i * c + c0, w)].astype(jnp.float32)               # [p, w]
                    parts.append((v * s.reshape(p, 1, w), c0))                            # [p, T, w]
            _rows_lse(parts, q_ref, out_ref, i, rows, pg, p)
    _over_blocks(block, kc_ref.shape[0], bp)


def _over_blocks(block, span: int, bp: int | None):
    """Runs block(pages) over a program's span of pages: once over all of it (bp None: the slice `:`, the default
    launch's code) or bp pages an iteration of a loop, so a program covers many blocks (fewer, longer programs)
    while each iteration holds only a block's values in registers."""
    if bp is None:
        block(slice(None))
    elif span == bp:
        block(pl.ds(0, bp))
    else:
        def body(b, carry):
            block(pl.ds(pl.multiple_of(b * bp, bp), bp))
            return carry
        jax.lax.fori_loop(0, span // bp, body, 0)


def _rows_lse(parts, q_ref, out_ref, i: int, rows: int, pg, p: int):
    """parts: (k [p, T, w] float32, c0) slices of KV head i's keys over channels [c0, c0 + w), scales applied ->
    out_ref rows i * rows + x at the pages pg (a slice of p pages): each query row's page log-sum-exps."""
    for x in range(rows):
        r = i * rows + x
        logit = 0.0
        for k, c0 in parts:
            w = k.shape[2]
            qr = q_ref[pl.ds(r, 1), pl.ds(c0, w)]                                        # [1, w]
            logit = logit + jnp.sum(k * qr.reshape(1, 1, w), axis=2)                     # [p, T]
        m = jnp.max(logit, axis=1)                                                      # [p]
        out_ref[pl.ds(r, 1), pg] = (m + jnp.log(jnp.sum(jnp.exp(logit - m[:, None]), axis=1))).reshape(1, p)


def _scale_view(scale, kc):
    """The label scales as the kernels read them: scale [S, L, G, P, g, C], every layer's as the cache stores them
    (the kernel indexes the layer, so no per-layer slice is copied out) -> [S, L, G, P, g * C] in the stored
    dtype (row-major: free)."""
    S, L, G, P, T, g, Cs = kc.shape
    return scale.reshape(S, L, G, P, -1)


def default_block_pages(num_pages: int, page: int, channels: int) -> int:
    """Largest power of two dividing num_pages whose block holds at most BLOCK_ELEMS copy values."""
    b = 1
    while num_pages % (b * 2) == 0 and (b * 2) * page * channels <= BLOCK_ELEMS:
        b *= 2
    return b


def _check(kc, qc, *, pow2: bool, bits: int = 0, scale=None):
    S, L, G, P, T, g, Cs = kc.shape
    C = Cs * 2 if bits == 4 else Cs
    if qc.ndim != 5 or qc.shape[:3] != (S, G, g) or qc.shape[4] != C:
        raise ValueError(f"qc shape {qc.shape} must be [S, G, g, H, C] = [{S}, {G}, {g}, H, {C}] for kc {kc.shape}")
    if bits and (scale is None or tuple(scale.shape) != (S, L, G, P, g, C)):
        raise ValueError(f"label scales of shape {None if scale is None else tuple(scale.shape)} must be every "
                         f"layer's [S, L, G, P, g, C] = {(S, L, G, P, g, C)} for kc {kc.shape}")
    for name, v in (("page size", T), ("copy channels", C)):
        if pow2 and v & (v - 1):
            raise ValueError(f"{name} = {v} must be a power of two for the page-lse kernel (Triton blocks)")


def _block_pages(num_pages: int, page: int, channels: int, block_pages: int | None) -> int:
    """The pages of one block, checked: block_pages, or by default the largest within BLOCK_ELEMS; a power of two
    dividing the page count."""
    bp = block_pages or default_block_pages(num_pages, page, channels)
    if num_pages % bp or bp & (bp - 1):
        raise ValueError(f"block_pages = {bp} must be a power of two dividing the page count {num_pages}")
    return bp


def _launch(interpret: bool, num_warps: int | None) -> dict:
    """pallas_call's compiler parameters: the warps of a compiled (Triton) launch; none in interpret mode."""
    return {} if interpret else {"compiler_params": pltr.CompilerParams(num_warps=num_warps or DEFAULT_WARPS)}


def _span(num_pages: int, block_pages: int, pages_per_program: int | None) -> int | None:
    """The pages a program covers, checked: None (one block a program, the default) or a multiple of block_pages
    dividing the page count, walked a block an iteration."""
    if pages_per_program is None:
        return None
    if pages_per_program < block_pages or pages_per_program % block_pages or num_pages % pages_per_program:
        raise ValueError(f"pages_per_program = {pages_per_program} must be a multiple of block_pages = {block_pages} "
                         f"dividing the page count {num_pages}")
    return pages_per_program


@functools.partial(jax.jit, static_argnames=("layer", "interpret", "block_pages", "num_warps", "bits",
                                             "pages_per_program"))
def page_lse_pallas(kc, qc, *, layer: int, interpret: bool = False, block_pages: int | None = None,
                    num_warps: int | None = None, scale=None, bits: int = 0, pages_per_program: int | None = None):
    """kc [S, L, G, P, T, g, C] the key copy (any float dtype); qc [S, G, g, H, C] float32 query rows at the copy's
    channels, already scaled -> lse [S, G, g * H, P] float32 for `layer`. block_pages: a power of two dividing P
    (default: the largest within BLOCK_ELEMS). Labels (bits 8 / 4): kc [S, L, G, P, T, g, Cs] codes and scale
    [S, L, G, P, g, C] every layer's scales per page and channel, read in place (select/labels.py).
    pages_per_program: None (default) launches one program a block of pages; a multiple of block_pages dividing P
    launches one program a span of that many pages, looping over its blocks (S * G * P / pages_per_program
    programs instead of S * G * P / block_pages: fewer launches of more work, the same registers an iteration).
    Labels default to one page a program at LABEL_WARPS warps (LABEL_BLOCK_PAGES; the fastest launch measured at
    the 8B shape, docs/BENCHMARKS.md); the key copy to the largest block within BLOCK_ELEMS at DEFAULT_WARPS."""
    _check(kc, qc, pow2=True, bits=bits, scale=scale)
    if bits:
        block_pages = block_pages or LABEL_BLOCK_PAGES
        num_warps = num_warps or LABEL_WARPS
    S, L, G, P, T, g, Cs = kc.shape
    C = qc.shape[4]
    H = qc.shape[3]
    Hp = next_pow2(H)    # Triton blocks are powers of two: padded rows are zeros, their lse is dropped below
    qp = jnp.pad(qc.astype(jnp.float32), ((0, 0),) * 3 + ((0, Hp - H), (0, 0))).reshape(S, G, g * Hp, C)
    bp = _block_pages(P, T, C, block_pages)
    span = _span(P, bp, pages_per_program)
    sp = span or bp                                                                     # pages a program
    kwargs = _launch(interpret, num_warps)
    view = kc.reshape(S, L, G, P, T, g * Cs)                                            # row-major: free
    kspec = pl.BlockSpec((None, None, None, sp, T, g * Cs), lambda s, j, b: (s, layer, j, b, 0, 0))
    qspec = pl.BlockSpec((None, None, g * Hp, C), lambda s, j, b: (s, j, 0, 0))
    common = dict(grid=(S, G, P // sp), interpret=interpret,
                  out_specs=pl.BlockSpec((None, None, g * Hp, sp), lambda s, j, b: (s, j, 0, b)),
                  out_shape=jax.ShapeDtypeStruct((S, G, g * Hp, P), jnp.float32), **kwargs)
    inner = dict(g=g, rows=Hp, bp=bp if span else None)
    if bits:
        out = pl.pallas_call(
            functools.partial(_label_kernel, bits=bits, **inner),
            in_specs=[kspec, pl.BlockSpec((None, None, None, sp, g * C), lambda s, j, b: (s, layer, j, b, 0)), qspec],
            name="label_page_lse" if span is None else "label_page_lse_span",
            **common)(view, _scale_view(scale, kc), qp)
    else:
        out = pl.pallas_call(functools.partial(_lse_kernel, **inner), in_specs=[kspec, qspec],
                             name="key_copy_page_lse" if span is None else "key_copy_page_lse_span",
                             **common)(view, qp)
    return out.reshape(S, G, g, Hp, P)[:, :, :, :H].reshape(S, G, g * H, P)


# ---------------------------------------------------------------------------------------------------------------
# 4-bit labels on the tensor cores: a span of pages a program (the 4-bit labels' kernel where T, C / 2 >= 16)
# ---------------------------------------------------------------------------------------------------------------
MMA_MIN = 16        # Triton's dot needs every dimension >= 16: tokens a page, code bytes a KV head, matrix columns
F16_1024 = 0x6400   # float16 bits of 1024.0: 0x6400 | n (n < 16) is exactly 1024 + n (one OR, no conversion)
# The launch measured fastest at the 8B shape (bench_labels, docs/BENCHMARKS.md): one warp a program, 32 pages a
# program (fewer programs or more warps were slower), three pipeline stages (the codes of later pages in flight)
MMA_SPAN = 32
MMA_WARPS = 1
MMA_STAGES = 3


def mma_shape(rows: int) -> tuple[int, int]:
    """(N, pages a dot) of the tensor-core label kernel for `rows` query rows a KV head: the rows padded to a power
    of two (Hp), N = max(16, Hp) matrix columns, N / Hp pages side by side in them (so at 4 rows, four pages fill
    the 16 columns instead of 12 columns of padding: no exp is spent on padding)."""
    hp = next_pow2(rows)
    n = max(MMA_MIN, hp)
    return n, n // hp


def mma_span(num_pages: int, rows: int, pages_per_program: int | None = None) -> int | None:
    """Pages a program of the tensor-core label kernel: pages_per_program, checked (a multiple of the pages a dot
    dividing the page count), or by default the largest of MMA_SPAN, 16, 8, 4, 2, 1 that is one; None where the
    default finds none."""
    pd = mma_shape(rows)[1]
    if pages_per_program is not None:
        if pages_per_program % pd or num_pages % pages_per_program:
            raise ValueError(f"pages_per_program = {pages_per_program} must be a multiple of {pd} pages dividing "
                             f"the page count {num_pages}")
        return pages_per_program
    for span in (MMA_SPAN, 16, 8, 4, 2, 1):
        if span % pd == 0 and num_pages % span == 0:
            return span
    return None


def mma_fits(kc, qc, bits: int) -> bool:
    """Whether the tensor-core kernel scores these labels: 4 bits, a page and C / 2 code bytes of >= 16 (Triton's
    dot), and a span of pages dividing the page count."""
    T, Cs, P, H = kc.shape[4], kc.shape[6], kc.shape[3], qc.shape[3]
    return bits == 4 and T >= MMA_MIN and Cs >= MMA_MIN and mma_span(P, H) is not None


def truncate_f16(q):
    """q float32 -> float32 keeping q's top 11 significant bits (a float16 value where in float16's range): the
    mantissa masked, not rounded, so every backend gives the same bits (XLA on GPU may drop a float32 -> float16 ->
    float32 round trip: excess precision allowed)."""
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(q, jnp.uint32) & jnp.uint32(0xFFFFE000),
                                        jnp.float32)


def unpack_bits(raw, s_lo, s_hi):
    """raw [T, Cs] uint8 two 4-bit codes a byte (stored + 8); s_lo, s_hi [1, Cs] bf16 the scales of the low / high
    nibbles' channels -> (low, high) [T, Cs] float16 values times their scales, exact (jnp ops: 1024 + n by bits).
    unpack_asm's values, in interpret mode (no PTX there)."""
    b = raw.astype(jnp.int32)
    out = []
    for nib, sc in ((b & 15, s_lo), (b >> 4, s_hi)):
        v = jax.lax.bitcast_convert_type((nib | F16_1024).astype(jnp.uint16), jnp.float16)
        out.append((v - jnp.float16(1032.0)) * sc.astype(jnp.float16))
    return out


# Four code bytes (one register $2, byte k = element k) -> one nibble of each as float16 pairs ($0: elements 0, 1;
# $1: 2, 3) times its scale pair ($3, $4): bytes spread to the two halves by PRMT, nibble OR 1024 by LOP3 (0xEA:
# (a & b) | c), the offset off by one packed subtract, the scale on by one packed multiply: 8 instructions for 4
# values. MASK / OFFSET: the low nibble (0x000F000F, 1024 + 8) or the high one in place (0x00F000F0: 1024 + 16 n
# - 1152 = 16 (n - 8), its scale pair divided by 16, exact). One call a nibble: Pallas lowers one result an asm.
UNPACK4_ASM = """{
.reg .b32 t0, t1, k;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
mov.b32 k, OFFSET;
lop3.b32 $0, t0, MASK, 0x64006400, 0xEA;
lop3.b32 $1, t1, MASK, 0x64006400, 0xEA;
sub.f16x2 $0, $0, k;
sub.f16x2 $1, $1, k;
mul.f16x2 $0, $0, $3;
mul.f16x2 $1, $1, $4;
}"""


def unpack_asm(raw, s_lo, s_hi):
    """unpack_bits by inline PTX (UNPACK4_ASM), the same values in packed half2 arithmetic, which the compiler
    does not make of the jnp form (measured: the kernel 77 vs 126 us with the query split in two parts)."""
    T, cs = raw.shape
    out = []
    for mask, offset, sc in (("0x000F000F", "0x64086408", s_lo.astype(jnp.float16)),
                             ("0x00F000F0", "0x64806480", (s_hi.astype(jnp.float32) * 0.0625).astype(jnp.float16))):
        [v] = pltr.elementwise_inline_asm(
            UNPACK4_ASM.replace("MASK", mask).replace("OFFSET", offset),
            args=[raw, jnp.broadcast_to(sc, (T, cs))], constraints="=r,=r,r,r,r", pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct((T, cs), jnp.float16)])
        out.append(v)
    return out


def _label_mma_kernel(kc_ref, sc_ref, b_ref, out_ref, *, g: int, pd: int, unpack):
    # One program = (sequence, group, span of pages), a loop over the span pd pages at a time. kc_ref [p, T, g * Cs]
    # 4-bit codes; sc_ref [p, g * C] bf16 scales; b_ref [g, 2, pd, Cs, N] float16 query matrices (KV head, nibble
    # half, page slot, channel, column): slot j holds the query rows in columns [j * hp, j * hp + rows) and zeros
    # elsewhere, so the pd pages' dots add into one [T, N] accumulator whose column j * hp + r is page j's logit of
    # row r. out_ref [g, p * hp]: (page, row) flattened. The query matrices are loaded once, before the loop (read
    # in the loop, the pipeline staged them every iteration beside the codes). code * scale is exact in float16 (a
    # 4-bit value times a bfloat16 scale has <= 11 significant bits) for scales from 6.1e-5 (float16's smallest
    # normal; below, a subnormal rounds) to 8192 (labels.SCALE_MAX4); the products with the float16 queries are
    # exact in the float32 accumulator.
    span, T = kc_ref.shape[0], kc_ref.shape[1]
    cs = kc_ref.shape[2] // g
    n = b_ref.shape[-1]
    bq = [[[b_ref[i, h, j] for j in range(pd)] for h in range(2)] for i in range(g)]      # [Cs, N] f16 each

    def body(it, carry):
        p0 = pl.multiple_of(it * pd, pd)
        for i in range(g):
            acc = jnp.zeros((T, n), jnp.float32)
            for j in range(pd):
                raw = kc_ref[p0 + j, :, pl.ds(i * cs, cs)]                                      # [T, Cs] uint8
                s = [sc_ref[pl.ds(p0 + j, 1), pl.ds((2 * i + h) * cs, cs)] for h in range(2)]  # 2 x [1, Cs]
                for h, a in enumerate(unpack(raw, *s)):                                         # [T, Cs] f16
                    acc = acc + jax.lax.dot_general(a, bq[i][h][j], (((1,), (0,)), ((), ())),
                                                    preferred_element_type=jnp.float32)       # [T, N]
            m = jnp.max(acc, axis=0)                                                             # [N]
            lse = m + jnp.log(jnp.sum(jnp.exp(acc - m[None, :]), axis=0))
            out_ref[pl.ds(i, 1), pl.ds(pl.multiple_of(it * n, n), n)] = lse.reshape(1, n)
        return carry

    jax.lax.fori_loop(0, span // pd, body, 0)


def mma_queries(qc, rows: int):
    """qc [S, G, g, H, C] float32 scaled query rows -> [S, G, g, 2, pd, C/2, N] float16: per KV head, nibble half
    (channels [0, C/2), [C/2, C)) and page slot j, the rows truncated to 11 bits (truncate_f16) and transposed into
    columns [j * hp, j * hp + H) (zeros elsewhere)."""
    S, G, g, H, C = qc.shape
    n, pd = mma_shape(rows)
    hp = n // pd
    q = jnp.pad(qc.astype(jnp.float32), ((0, 0),) * 3 + ((0, hp - H), (0, 0)))             # [S, G, g, hp, C]
    q = truncate_f16(q).astype(jnp.float16).reshape(S, G, g, hp, 2, C // 2)
    q = q.transpose(0, 1, 2, 4, 5, 3)                                                      # [S, G, g, 2, C/2, hp]
    on = (jnp.arange(pd)[:, None] == jnp.arange(pd)[None, :])[:, None, :, None]            # [pd, 1, pd, 1]
    b = jnp.where(on, q[:, :, :, :, None, :, None, :], jnp.float16(0))                      # slot j -> block j
    return b.reshape(S, G, g, 2, pd, C // 2, n)           # a select, one elementwise fusion (an einsum with an
                                                          # identity was a matrix product of its own)


@functools.partial(jax.jit, static_argnames=("layer", "interpret", "pages_per_program", "num_warps",
                                             "num_stages"))
def label_lse_mma(kc, qc, *, layer: int, scale, interpret: bool = False, pages_per_program: int | None = None,
                  num_warps: int = MMA_WARPS, num_stages: int = MMA_STAGES):
    """The 4-bit labels' page lse on the tensor cores: kc [S, L, G, P, T, g, C/2] codes, scale [S, L, G, P, g, C]
    bf16, qc [S, G, g, H, C] float32 -> lse [S, G, g * H, P] float32 for `layer`, = ref_page_lse(f16_queries=True)
    (the queries truncated to 11 bits: a relative logit error of <= 2^-10, far under the 4-bit codes' own; the
    queries split into two float16 parts for float32 products ran at half the speed, 77 vs 43 us). One program per
    (sequence, group, pages_per_program pages; default mma_span), looping over them a dot's pages at a time
    (mma_shape), the query matrices loaded once a program; codes to float16 by inline PTX (unpack_asm; interpret
    mode: unpack_bits, the same values). Needs T >= 16 and C/2 >= 16 (mma_fits)."""
    S, L, G, P, T, g, Cs = kc.shape
    H, C = qc.shape[3], qc.shape[4]
    _check(kc, qc, pow2=True, bits=4, scale=scale)
    if T < MMA_MIN or Cs < MMA_MIN:
        raise ValueError(f"the tensor-core label kernel needs a page size and C / 2 code bytes of at least "
                         f"{MMA_MIN}; got page {T}, {Cs} code bytes (C = {C})")
    span = mma_span(P, H, pages_per_program)
    if span is None:
        raise ValueError(f"no span of pages divides the page count {P} in whole dots of {mma_shape(H)[1]} pages")
    n, pd = mma_shape(H)
    hp = n // pd
    params = {} if interpret else {"compiler_params": pltr.CompilerParams(num_warps=num_warps,
                                                                             num_stages=num_stages)}
    out = pl.pallas_call(
        functools.partial(_label_mma_kernel, g=g, pd=pd, unpack=unpack_bits if interpret else unpack_asm),
        grid=(S, G, P // span), interpret=interpret, name="label_page_lse_mma",
        in_specs=[pl.BlockSpec((None, None, None, span, T, g * Cs), lambda s, j, b: (s, layer, j, b, 0, 0)),
                  pl.BlockSpec((None, None, None, span, g * C), lambda s, j, b: (s, layer, j, b, 0)),
                  pl.BlockSpec((None, None, g, 2, pd, Cs, n), lambda s, j, b: (s, j, 0, 0, 0, 0, 0))],
        out_specs=pl.BlockSpec((None, None, g, span * hp), lambda s, j, b: (s, j, 0, b)),
        out_shape=jax.ShapeDtypeStruct((S, G, g, P * hp), jnp.float32), **params,
    )(kc.reshape(S, L, G, P, T, g * Cs), _scale_view(scale, kc), mma_queries(qc, H))
    lse = out.reshape(S, G, g, P, hp)[..., :H]                                            # [S, G, g, P, H]
    return lse.transpose(0, 1, 2, 4, 3).reshape(S, G, g * H, P)


def ref_dequant(codes, scale, bits: int):
    """codes [..., P, T, g, Cs], scale [..., P, g, C] -> [..., P, T, g, C] float32: the labels' values (int8, or
    two int4 a byte: channel j low nibble, j + C/2 high, each stored + 8)."""
    if bits == 8:
        v = codes.astype(jnp.float32)
    else:
        b = codes.astype(jnp.int32)
        v = jnp.concatenate([(b & 15) - 8, (b >> 4) - 8], axis=-1).astype(jnp.float32)
    return v * scale.astype(jnp.float32)[..., None, :, :]


def ref_page_lse(kc, qc, *, layer: int, scale=None, bits: int = 0, f16_queries: bool = False):
    """Plain jnp reference of `page_lse_pallas` (float32 products at full precision). f16_queries: the queries
    truncated to 11 significant bits first (truncate_f16: label_lse_mma's arithmetic)."""
    S, L, G, P, T, g, _ = kc.shape
    if f16_queries:
        qc = truncate_f16(qc.astype(jnp.float32))
    k = ref_dequant(kc[:, layer], scale[:, layer], bits) if bits else kc[:, layer].astype(jnp.float32)
    logit = jnp.einsum("sjptic,sjihc->sjihpt", k, qc.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)                             # [S, G, g, H, P, T]
    return jax.nn.logsumexp(logit, axis=-1).reshape(S, G, g * qc.shape[3], P)


def page_lse(kc, qc, *, layer: int, impl: str = "auto", scale=None, bits: int = 0):
    """impl: 'auto' (kernel on GPU, reference elsewhere), 'pallas' (kernel; interpret mode off GPU) or 'ref'.
    A copy whose page size or channel count is not a power of two takes the reference. bits 8 / 4: kc holds
    label codes and scale their scales, every layer's [S, L, G, P, g, C]. 4-bit labels score with the queries
    truncated to 11 bits on every path (truncate_f16), the arithmetic of their tensor-core kernel (label_lse_mma,
    taken where mma_fits), so a rule selects the same pages whichever kernel or reference runs."""
    _check(kc, qc, pow2=False, bits=bits, scale=scale)
    T, C, Cs = kc.shape[4], qc.shape[4], kc.shape[6]
    if bits == 4:
        qc = truncate_f16(qc.astype(jnp.float32))
    if pick_impl(impl) == "ref" or T & (T - 1) or C & (C - 1) or Cs & (Cs - 1):
        return ref_page_lse(kc, qc, layer=layer, scale=scale, bits=bits)
    if mma_fits(kc, qc, bits):
        return label_lse_mma(kc, qc, layer=layer, scale=scale, interpret=not on_gpu())
    return page_lse_pallas(kc, qc, layer=layer, interpret=not on_gpu(), scale=scale, bits=bits)
