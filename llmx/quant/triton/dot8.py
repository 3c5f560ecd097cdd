"""Decode GEMV on integer dot products: weight codes times activations quantized to int8 per 32.

The float GEMV (`kernels.gemv_kernel`) spends ~10 instructions per weight on extracting a code,
converting it and multiplying, so on a GPU it is bound by instruction issue at a fraction of the
memory bandwidth. Here, as in llama.cpp's CUDA decode (mmvq), x is first quantized per group of
32 values (`quantize_x_kernel`: int8 codes, a float scale dx = max|x| / 127 and the code sums
per 16), and the weights are read as 32-bit words whose 4 byte lanes meet 4 x codes in one
`dp4a` instruction (int32 accumulate, exact). Each group's scales are applied once to its
integer sum, so a weight costs about one instruction.

Numerics: integer sums are exact; beyond float32 summation, the one rounding is x's quantization
(at most 1/254 of each group's largest |x| per value), as in llama.cpp's GPU decode.

Types (rows of Q6_K and Q8_0 must be in `triton_ops.prepare`'s layout, where block bodies are
16-byte aligned; Q4_K blocks are 144 bytes with codes at byte 16, aligned as stored):
    Q8_0: 8 words of int8 codes a block of 32              w = d * q
    Q4_K: 32 words of nibbles a super-block of 256         w = d*sc*q - dmin*m (per 32)
    Q6_K: 32 words of low nibbles + 16 of 2-bit highs      w = d*sc*(q - 32)   (per 16)
Under TRITON_INTERPRET=1 (no PTX) `dp4a` is spelled out with shifts, with the same results.
"""

import triton
import triton.language as tl

from llmx.quant.triton.bits import f16, u8
from llmx.quant.triton.kquants import scale_min_k4

LOW_NIBBLES = tl.constexpr(0x0F0F0F0F)
HIGH_PAIRS = tl.constexpr(0x30303030)  # bits 4-5 of each byte: where Q6_K's 2 high bits go


@triton.jit
def dp4a(a, b, A_SIGNED: tl.constexpr, ASM: tl.constexpr):
    """sum over the 4 byte lanes of int32 a and b of a_i * b_i; b's lanes are signed, a's signed
    when A_SIGNED (else unsigned)."""
    if ASM:
        if A_SIGNED:
            asm: tl.constexpr = "dp4a.s32.s32 $0, $1, $2, $3;"
        else:
            asm: tl.constexpr = "dp4a.u32.s32 $0, $1, $2, $3;"
        zero = tl.zeros_like(a)
        out = tl.inline_asm_elementwise(asm, "=r,r,r,r", [a, b, zero], dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = tl.zeros_like(a)
        for i in tl.static_range(4):
            a_i = (a >> (8 * i)) & 0xFF
            if A_SIGNED:
                a_i = (a << (24 - 8 * i)) >> 24
            out += a_i * ((b << (24 - 8 * i)) >> 24)
    return out


@triton.jit
def quantize_x_kernel(x_ptr, xq_ptr, dx_ptr, xs_ptr, K, sxm, NG: tl.constexpr):
    """One program: NG groups of 32 values of row program_id(0) of x [M, K] (any float dtype).

    xq [M, K] int8 = round(x / dx) (half away from zero), dx [M, K/32] float32, xs [M, K/16] int32
    (the sums of xq per 16, for the types whose codes carry an offset).
    """
    m = tl.program_id(0)
    g = tl.program_id(1) * NG + tl.arange(0, NG)
    ok = g < K // 32
    off = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + m * sxm + off, mask=ok[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    v = x * inv[:, None]
    q = (v + tl.where(v >= 0, 0.5, -0.5)).to(tl.int32)
    tl.store(xq_ptr + m * K + off, q.to(tl.int8), mask=ok[:, None])
    tl.store(dx_ptr + m * (K // 32) + g, amax / 127.0, mask=ok)
    sums = tl.sum(tl.reshape(q, (NG, 2, 16)), axis=2)
    halves = g[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store(xs_ptr + m * (K // 16) + halves, sums, mask=ok[:, None])


@triton.jit
def _x_words(xq_ptr, x_row, word, ok):
    """int32 words (4 x codes each) at word offsets `word` [U, W] of x row `x_row` (0 where not ok)."""
    return tl.load(xq_ptr.to(tl.pointer_type(tl.int32)) + x_row + word, mask=ok, other=0)


@triton.jit
def _q8_0(w_ptr, xq_ptr, dx_ptr, row_w, u, ok, m, K, ASM: tl.constexpr):
    """[BN] partial dots of rows `row_w` (word offsets) over Q8_0 blocks `u` [U] for x row m."""
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    i = tl.arange(0, 8)
    codes = tl.load(w32 + row_w[:, None, None] + u[None, :, None] * 8 + i[None, None, :])  # [BN, U, 8]
    xw = _x_words(xq_ptr, m * (K // 4), u[:, None] * 8 + i[None, :], ok[:, None])
    dot = tl.sum(dp4a(codes, tl.broadcast_to(xw[None, :, :], codes.shape), True, ASM), axis=2)
    d = f16(w_ptr, row_w[:, None] * 4 + (K // 32) * 32 + u[None, :] * 2)
    dx = tl.load(dx_ptr + m * (K // 32) + u, mask=ok, other=0.0)
    return tl.sum(dot.to(tl.float32) * d * dx[None, :], axis=1)


@triton.jit
def _q4_k(w_ptr, xq_ptr, dx_ptr, xs_ptr, row_w, u, ok, m, K, ASM: tl.constexpr):
    """[BN] partial dots over Q4_K super-blocks `u` [U]. Word i of a super-block's codes holds
    weights 4(i%8)..+3 of sub-block 2(i//8) in its low nibbles and of sub-block 2(i//8)+1 in its
    high nibbles."""
    bn: tl.constexpr = row_w.shape[0]
    nu: tl.constexpr = u.shape[0]
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    blk_w = row_w[:, None] + u[None, :] * 36  # [BN, U], 144 bytes a super-block
    i = tl.arange(0, 32)
    codes = tl.load(w32 + blk_w[:, :, None] + 4 + i[None, None, :])
    x_word = u[:, None] * 64 + 16 * (i // 8)[None, :] + (i % 8)[None, :]  # the low nibbles' x
    x_lo = tl.broadcast_to(_x_words(xq_ptr, m * (K // 4), x_word, ok[:, None])[None], codes.shape)
    x_hi = tl.broadcast_to(_x_words(xq_ptr, m * (K // 4), x_word + 8, ok[:, None])[None], codes.shape)
    s_lo = tl.sum(tl.reshape(dp4a(codes & LOW_NIBBLES, x_lo, False, ASM), (bn, nu, 4, 8)), axis=3)
    s_hi = tl.sum(tl.reshape(dp4a((codes >> 4) & LOW_NIBBLES, x_hi, False, ASM), (bn, nu, 4, 8)), axis=3)
    j = 2 * tl.arange(0, 4)  # sub-blocks of the low nibbles; +1 for the high ones
    blk_b = blk_w[:, :, None] * 4
    sc_lo, mn_lo = scale_min_k4(w_ptr, blk_b, j[None, None, :])
    sc_hi, mn_hi = scale_min_k4(w_ptr, blk_b, j[None, None, :] + 1)
    grp = u[:, None] * 8 + j[None, :]  # [U, 4] index of the low sub-blocks' 32-groups in the row
    dx_lo = tl.load(dx_ptr + m * (K // 32) + grp, mask=ok[:, None], other=0.0)[None]
    dx_hi = tl.load(dx_ptr + m * (K // 32) + grp + 1, mask=ok[:, None], other=0.0)[None]
    xs = xs_ptr + m * (K // 16) + 2 * grp
    sum_lo = (tl.load(xs, mask=ok[:, None], other=0) + tl.load(xs + 1, mask=ok[:, None], other=0))[None]
    sum_hi = (tl.load(xs + 2, mask=ok[:, None], other=0) + tl.load(xs + 3, mask=ok[:, None], other=0))[None]
    scaled = sc_lo * dx_lo * s_lo.to(tl.float32) + sc_hi * dx_hi * s_hi.to(tl.float32)
    mins = mn_lo * dx_lo * sum_lo.to(tl.float32) + mn_hi * dx_hi * sum_hi.to(tl.float32)
    d = f16(w_ptr, blk_w * 4)
    dmin = f16(w_ptr, blk_w * 4 + 2)
    return tl.sum(d * tl.sum(scaled, axis=2) - dmin * tl.sum(mins, axis=2), axis=1)


@triton.jit
def _q6_k_quarter(w_ptr, xq_ptr, dx_ptr, xs_ptr, q, body_b, u, ok, m, K, KQ: tl.constexpr, ASM: tl.constexpr):
    """The term of quarter KQ (weights 32KQ..32KQ+31 of each 128-weight half) of Q6_K codes q
    [BN, U, 16] (lane t: half t//8, weights 4(t%8)..+3 of the quarter), scaled: [BN, U]."""
    bn: tl.constexpr = q.shape[0]
    nu: tl.constexpr = q.shape[1]
    t = tl.arange(0, 16)
    x_word = u[:, None] * 64 + (32 * (t // 8) + 8 * KQ + t % 8)[None, :]
    xw = tl.broadcast_to(_x_words(xq_ptr, m * (K // 4), x_word, ok[:, None])[None], q.shape)
    s = tl.sum(tl.reshape(dp4a(q, xw, False, ASM), (bn, nu, 4, 4)), axis=3)  # per 16 weights
    v = tl.arange(0, 4)  # (half, which 16 of the quarter)
    grp16 = (8 * (v // 2) + 2 * KQ + v % 2)[None, :]  # [1, 4] 16-group within the super-block
    sc = (u8(w_ptr, body_b[:, :, None] + 192 + grp16[None]) ^ 0x80) - 128  # int8 scales
    row16 = u[:, None] * 16 + grp16  # [U, 4]
    dx = tl.load(dx_ptr + m * (K // 32) + row16 // 2, mask=ok[:, None], other=0.0)[None]
    xsum = tl.load(xs_ptr + m * (K // 16) + row16, mask=ok[:, None], other=0)[None]
    return tl.sum(sc.to(tl.float32) * dx * (s - 32 * xsum).to(tl.float32), axis=2)


@triton.jit
def _q6_k(w_ptr, xq_ptr, dx_ptr, xs_ptr, row_w, u, ok, m, K, ASM: tl.constexpr):
    """[BN] partial dots over Q6_K super-blocks `u` [U] (prepared rows: 208-byte bodies first).

    Per half of 128 weights: ql word c (c < 8) holds the low nibbles of quarter 0 (and, high
    nibbles, quarter 2) at weights 4c..4c+3, ql word 8 + c those of quarters 1 and 3, and qh word c
    the 2 high bits of all four quarters at bits 0-1, 2-3, 4-5, 6-7 of each byte.
    """
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    body_w = row_w[:, None] + u[None, :] * 52
    t = tl.arange(0, 16)
    lane = body_w[:, :, None] + (t + 8 * (t // 8))[None, None, :]
    ql_a = tl.load(w32 + lane)
    ql_b = tl.load(w32 + lane + 8)
    qh = tl.load(w32 + body_w[:, :, None] + 32 + t[None, None, :])
    quarters = (
        (ql_a & LOW_NIBBLES) | ((qh << 4) & HIGH_PAIRS),
        (ql_b & LOW_NIBBLES) | ((qh << 2) & HIGH_PAIRS),
        ((ql_a >> 4) & LOW_NIBBLES) | (qh & HIGH_PAIRS),
        ((ql_b >> 4) & LOW_NIBBLES) | ((qh >> 2) & HIGH_PAIRS),
    )
    body_b = body_w * 4
    acc = tl.zeros(body_w.shape, tl.float32)
    for kq in tl.static_range(4):
        acc += _q6_k_quarter(w_ptr, xq_ptr, dx_ptr, xs_ptr, quarters[kq], body_b, u, ok, m, K, kq, ASM)
    d = f16(w_ptr, row_w[:, None] * 4 + (K // 256) * 208 + u[None, :] * 2)
    return tl.sum(d * acc, axis=1)


@triton.jit
def gemv8_kernel(
    xq_ptr, dx_ptr, xs_ptr, w_ptr, out_ptr, M, N, K, swn, som,
    QT: tl.constexpr, UNIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BU: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """One program: BN output rows for all M (<= BM) quantized inputs, BU blocks of UNIT weights a
    step (UNIT = 32 for Q8_0, 256 for the K-quants). Out-of-range rows are clamped to the last one
    (their results are not stored); out-of-range blocks read x as 0."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    row_w = tl.minimum(rn, N - 1).to(tl.int64) * (swn // 4)
    n_units = K // UNIT
    rm = tl.arange(0, BM)[:, None]
    acc = tl.zeros([BM, BN], tl.float32)
    for u0 in range(0, n_units, BU):
        u = u0 + tl.arange(0, BU)
        uc = tl.minimum(u, n_units - 1)
        for m in tl.static_range(BM):
            ok = (u < n_units) & (tl.full([BU], m, tl.int32) < M)
            if QT == "Q8_0":
                part = _q8_0(w_ptr, xq_ptr, dx_ptr, row_w, uc, ok, m, K, ASM)
            elif QT == "Q4_K":
                part = _q4_k(w_ptr, xq_ptr, dx_ptr, xs_ptr, row_w, uc, ok, m, K, ASM)
            else:
                tl.static_assert(QT == "Q6_K", "no integer-dot GEMV for this GGML type")
                part = _q6_k(w_ptr, xq_ptr, dx_ptr, xs_ptr, row_w, uc, ok, m, K, ASM)
            acc += tl.where(rm == m, part[None, :], 0.0)
    o_ptr = out_ptr + rm * som + rn[None, :]
    tl.store(o_ptr, acc.to(out_ptr.dtype.element_ty), mask=(rm < M) & (rn[None, :] < N))
