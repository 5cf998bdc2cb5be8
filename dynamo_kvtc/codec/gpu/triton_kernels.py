"""Triton kernels of the fused GPU codec. PRIVATE: imported only lazily, by :mod:`dynamo_kvtc.codec.gpu.ops`, after
checking that Triton is importable (``import dynamo_kvtc.codec`` never imports Triton or touches CUDA).

Every kernel has a plain-torch twin in ``ops.TorchOps`` computing the same function; tests compare the two (on CUDA,
or on the CPU under ``TRITON_INTERPRET=1``).

- :func:`prep_kernel`: one layer of K or V rows gathered from wherever the engine keeps them (paged blocks or a dense
  tensor, addressed by a per-row element offset), RoPE removed (keys), calibration mean subtracted, written as fp16
  (or bf16) into the projection GEMM's input matrix. Flags non-finite inputs and fp16 overflow.
- :func:`quant_kernel`: one bucket of a DP plan (kind x group size) quantized straight from the fp32 GEMM output and
  packed into the blob's byte layout (shift, scale, component-major codes; int4 two per byte, int2 four).
- :func:`dequant_kernel`: the inverse, writing fp16 coefficients for the inverse-projection GEMM.
- :func:`post_kernel`: one layer of the inverse-projection output + mean, RoPE re-applied (keys), cast to the cache
  dtype and scattered to per-row destination offsets (paged blocks or a dense tensor); rows with offset -1 are skipped.
- :func:`scatter_kernel`: rows ``[n, H*D]`` (sinks, raw window) cast to the cache dtype and scattered like
  ``post_kernel`` (offset -1: skipped), without arithmetic: a same-dtype row is copied bit for bit.
- :func:`crc_kernel`: CRC-32 (zlib's) of byte ranges on the device: byte-serial CRC of 512-byte pieces in parallel,
  each advanced over the bytes that follow it with precomputed GF(2) matrices, XOR-reduced per section.
- :func:`copy_chunks_kernel`: gathers variable-length byte chunks (compaction of nvCOMP outputs, realignment of
  compressed chunks for nvCOMP's input alignment).
"""

from __future__ import annotations

import triton
import triton.language as tl

F16_MAX = tl.constexpr(65504.0)
RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + M) - M rounds |v| < 2^22 to the nearest integer, ties to even


@triton.jit
def prep_kernel(
    src_ptr,
    roff_ptr,
    out_ptr,
    mean_ptr,
    a_ptr,
    b_ptr,
    partner_ptr,
    flag_ptr,
    R,
    out_stride,
    col0,
    stride_h,
    stride_d,
    H: tl.constexpr,
    D: tl.constexpr,
    DB: tl.constexpr,
    BR: tl.constexpr,
    ROPE: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    rmask = rows < R
    d = tl.arange(0, DB)
    dmask = d < D
    m2 = rmask[:, None] & dmask[None, :]
    roff = tl.load(roff_ptr + rows, mask=rmask, other=0)
    rows64 = rows.to(tl.int64)
    if ROPE:
        part = tl.load(partner_ptr + d, mask=dmask, other=0)
        A = tl.load(a_ptr + rows64[:, None] * D + d[None, :], mask=m2, other=0.0)
        B = tl.load(b_ptr + rows64[:, None] * D + d[None, :], mask=m2, other=0.0)
    bad = tl.zeros([BR, DB], dtype=tl.int32)  # non-finite input
    big = tl.zeros([BR, DB], dtype=tl.int32)  # finite but beyond fp16
    for h in tl.static_range(H):
        base = src_ptr + roff[:, None] + h * stride_h
        x = tl.load(base + d[None, :] * stride_d, mask=m2, other=0.0).to(tl.float32)
        bad = bad | ((x - x) != 0).to(tl.int32)  # NaN or +-inf
        if ROPE:
            xp = tl.load(base + part[None, :] * stride_d, mask=m2, other=0.0).to(tl.float32)
            x = x * A + xp * B
        mu = tl.load(mean_ptr + h * D + d, mask=dmask, other=0.0)
        y = x - mu[None, :]
        dst = out_ptr + rows64[:, None] * out_stride + col0 + h * D + d[None, :]
        if OUT_BF16:
            tl.store(dst, y.to(tl.bfloat16), mask=m2)
        else:
            big = big | ((tl.abs(y) > F16_MAX) & ((y - y) == 0)).to(tl.int32)
            tl.store(dst, y.to(tl.float16), mask=m2)
    bad = tl.where(m2, bad, 0)
    big = tl.where(m2, big, 0)
    tl.atomic_or(flag_ptr, tl.max(tl.max(bad, axis=1), axis=0) | (tl.max(tl.max(big, axis=1), axis=0) * 2))


@triton.jit
def quant_kernel(
    c_ptr,
    c_stride,
    T,
    starts_ptr,
    shift_ptr,
    scale_ptr,
    codes_ptr,
    SIZE: tl.constexpr,
    KIND: tl.constexpr,  # 0 int2, 1 int4, 2 fp8
    BITS: tl.constexpr,
    LEVELS: tl.constexpr,
    BT: tl.constexpr,
    CJ: tl.constexpr,
    PACK: tl.constexpr,
):
    tb = tl.program_id(0)
    g = tl.program_id(1)
    start = tl.load(starts_ptr + g).to(tl.int64)
    t = tb * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    jj = tl.arange(0, CJ)
    lo = tl.full([BT], 3.0e38, tl.float32)
    hi = tl.full([BT], -3.0e38, tl.float32)
    for j0 in range(0, SIZE, CJ):
        x = tl.load(c_ptr + t64[:, None] * c_stride + start + j0 + jj[None, :], mask=tmask[:, None], other=0.0)
        lo = tl.minimum(lo, tl.min(x, axis=1))
        hi = tl.maximum(hi, tl.max(x, axis=1))
    if KIND == 2:
        s16 = tl.minimum(tl.maximum((lo + hi) * 0.5, -F16_MAX), F16_MAX).to(tl.float16)
        sf = s16.to(tl.float32)
        amax = tl.maximum(tl.abs(hi - sf), tl.abs(lo - sf))
        c16 = tl.minimum(tl.maximum(amax / 448.0, -F16_MAX), F16_MAX).to(tl.float16)
    else:
        s16 = tl.minimum(tl.maximum(lo, -F16_MAX), F16_MAX).to(tl.float16)
        sf = s16.to(tl.float32)
        c16 = tl.minimum(tl.maximum((hi - sf) / LEVELS, -F16_MAX), F16_MAX).to(tl.float16)
    cf = c16.to(tl.float32)
    inv = tl.where(cf > 0, 1.0 / cf, 0.0)
    tl.store(shift_ptr + g * T + t64, s16, mask=tmask)
    tl.store(scale_ptr + g * T + t64, c16, mask=tmask)
    PER: tl.constexpr = 8 // BITS
    for j0 in range(0, SIZE, CJ):
        x = tl.load(c_ptr + t64[:, None] * c_stride + start + j0 + jj[None, :], mask=tmask[:, None], other=0.0)
        v = (x - sf[:, None]) * inv[:, None]
        if KIND == 2:
            v = tl.minimum(tl.maximum(v, -448.0), 448.0)
            code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            v = (v + RNE_MAGIC) - RNE_MAGIC
            v = tl.minimum(tl.maximum(v, 0.0), LEVELS)
            code = v.to(tl.uint8)
        coord = (g * SIZE + j0 + jj).to(tl.int64)  # row of the [n*size, T] code matrix
        if PACK and BITS < 8:
            ct = tl.trans(code.to(tl.int32))  # [CJ, BT]
            ct = tl.reshape(ct, (CJ, BT // PER, PER))
            sh = tl.arange(0, PER) * BITS
            packed = tl.sum(ct << sh[None, None, :], axis=2)  # disjoint bit fields: sum == or
            kk = tl.arange(0, BT // PER)
            bidx = (coord[:, None] * T + tb * BT) // PER + kk[None, :]
            bmask = (tb * BT + kk * PER)[None, :] < T
            tl.store(codes_ptr + bidx, packed.to(tl.uint8), mask=bmask)
        else:
            tl.store(codes_ptr + coord[None, :] * T + t64[:, None], code, mask=tmask[:, None])


@triton.jit
def dequant_kernel(
    codes_ptr,
    shift_ptr,
    scale_ptr,
    starts_ptr,
    out_ptr,
    out_stride,
    T,
    SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BT: tl.constexpr,
    CJ: tl.constexpr,
):
    tb = tl.program_id(0)
    g = tl.program_id(1)
    start = tl.load(starts_ptr + g).to(tl.int64)
    t = tb * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    jj = tl.arange(0, CJ)
    sf = tl.load(shift_ptr + g * T + t64, mask=tmask, other=0.0).to(tl.float32)
    cf = tl.load(scale_ptr + g * T + t64, mask=tmask, other=0.0).to(tl.float32)
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    for j0 in range(0, SIZE, CJ):
        coord = (g * SIZE + j0 + jj).to(tl.int64)
        flat = coord[None, :] * T + t64[:, None]
        if BITS == 8:
            raw = tl.load(codes_ptr + flat, mask=tmask[:, None], other=0)
            v = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            byte = tl.load(codes_ptr + flat // PER, mask=tmask[:, None], other=0).to(tl.int32)
            v = ((byte >> ((flat % PER) * BITS).to(tl.int32)) & MASK).to(tl.float32)
        y = v * cf[:, None] + sf[:, None]
        y = tl.minimum(tl.maximum(y, -F16_MAX), F16_MAX)
        tl.store(out_ptr + t64[:, None] * out_stride + start + j0 + jj[None, :], y.to(tl.float16), mask=tmask[:, None])


@triton.jit
def post_kernel(
    y_ptr,
    y_stride,
    doff_ptr,
    dst_ptr,
    mean_ptr,
    a_ptr,
    b_ptr,
    partner_ptr,
    R,
    stride_h,
    stride_d,
    H: tl.constexpr,
    D: tl.constexpr,
    DB: tl.constexpr,
    BR: tl.constexpr,
    ROPE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    rmask = rows < R
    d = tl.arange(0, DB)
    dmask = d < D
    doff = tl.load(doff_ptr + rows, mask=rmask, other=-1)
    valid = rmask & (doff >= 0)
    m2 = valid[:, None] & dmask[None, :]
    rows64 = rows.to(tl.int64)
    if ROPE:
        part = tl.load(partner_ptr + d, mask=dmask, other=0)
        A = tl.load(a_ptr + rows64[:, None] * D + d[None, :], mask=m2, other=0.0)
        B = tl.load(b_ptr + rows64[:, None] * D + d[None, :], mask=m2, other=0.0)
    for h in tl.static_range(H):
        mu = tl.load(mean_ptr + h * D + d, mask=dmask, other=0.0)
        x = tl.load(y_ptr + rows64[:, None] * y_stride + h * D + d[None, :], mask=m2, other=0.0) + mu[None, :]
        if ROPE:
            mup = tl.load(mean_ptr + h * D + part, mask=dmask, other=0.0)
            xp = tl.load(y_ptr + rows64[:, None] * y_stride + h * D + part[None, :], mask=m2, other=0.0)
            x = x * A + (xp + mup[None, :]) * B
        dst = dst_ptr + doff[:, None] + h * stride_h + d[None, :] * stride_d
        tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=m2)


@triton.jit
def scatter_kernel(
    src_ptr,
    src_stride,
    doff_ptr,
    dst_ptr,
    R,
    stride_h,
    stride_d,
    H: tl.constexpr,
    D: tl.constexpr,
    DB: tl.constexpr,
    BR: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    rmask = rows < R
    d = tl.arange(0, DB)
    dmask = d < D
    doff = tl.load(doff_ptr + rows, mask=rmask, other=-1)
    m2 = (rmask & (doff >= 0))[:, None] & dmask[None, :]
    rows64 = rows.to(tl.int64)
    for h in tl.static_range(H):
        x = tl.load(src_ptr + rows64[:, None] * src_stride + h * D + d[None, :], mask=m2)
        dst = dst_ptr + doff[:, None] + h * stride_h + d[None, :] * stride_d
        tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _xor_combine(a, b):
    return a ^ b


@triton.jit
def crc_kernel(
    data_ptr,
    item_sec_ptr,
    item_blk_ptr,
    sec_off_ptr,
    sec_len_ptr,
    table_ptr,
    mats_ptr,
    acc_ptr,
    PIECE: tl.constexpr,
    LANES: tl.constexpr,
    NBITS: tl.constexpr,
):
    item = tl.program_id(0)
    s = tl.load(item_sec_ptr + item)
    blk = tl.load(item_blk_ptr + item).to(tl.int64)
    off = tl.load(sec_off_ptr + s)
    n = tl.load(sec_len_ptr + s)
    p0 = (blk * LANES + tl.arange(0, LANES).to(tl.int64)) * PIECE
    plen = tl.minimum(tl.maximum(n - p0, 0), PIECE)
    state = tl.zeros([LANES], dtype=tl.uint32)
    for k in range(PIECE):
        m = k < plen
        b = tl.load(data_ptr + off + p0 + k, mask=m, other=0).to(tl.uint32)
        idx = ((state ^ b) & 0xFF).to(tl.int32)
        t = tl.load(table_ptr + idx).to(tl.uint32, bitcast=True)
        state = tl.where(m, t ^ (state >> 8), state)
    sh = n - p0 - plen  # bytes after this piece up to the end of its section
    for j in range(NBITS):
        acc = tl.zeros([LANES], dtype=tl.uint32)
        for bit in tl.static_range(32):
            col = tl.load(mats_ptr + j * 32 + bit).to(tl.uint32, bitcast=True)
            acc = acc ^ tl.where(((state >> bit) & 1) != 0, col, tl.zeros_like(acc))
        state = tl.where(((sh >> j) & 1) != 0, acc, state)
    state = tl.where(plen > 0, state, tl.zeros_like(state))
    part = tl.reduce(state, 0, _xor_combine)
    tl.atomic_xor(acc_ptr + s, part.to(tl.int32, bitcast=True))


@triton.jit
def copy_chunks_kernel(src_ptr, dst_ptr, src_off_ptr, dst_off_ptr, len_ptr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    so = tl.load(src_off_ptr + c)
    do = tl.load(dst_off_ptr + c)
    n = tl.load(len_ptr + c)
    for k in range(0, n, BLOCK):
        idx = k + tl.arange(0, BLOCK).to(tl.int64)
        m = idx < n
        tl.store(dst_ptr + do + idx, tl.load(src_ptr + so + idx, mask=m, other=0), mask=m)
