"""Decode GEMV on integer dot products: weight codes times activations quantized to int8 per 32.

The float GEMV (`kernels.gemv_kernel`) spends ~10 instructions per weight on extracting a code,
converting it and multiplying. Here, as in llama.cpp's CUDA decode (mmvq), x is first quantized
per group of 32 values (`quantize_x_kernel`: int8 codes, a float scale dx = max|x| / 127 and
dx times the code sums per 16), and the weights are read as 32-bit words whose 4 byte lanes meet
4 x codes in one `dp4a` instruction (int32 accumulate, exact); each group's scales are applied
once to its integer sum, for 2-3.5 instructions a weight in all. On an H200 it takes 0.55-0.7x
the float GEMV's time (bench/RESULTS.md), so `triton_ops.pick_kernel` takes it for every M = 1
product of these types. The kernels that produce a decode step's activations (RMSNorm, the SiLU
gate, attention's combine) quantize their output with `store_quantized` as they write it.

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

from llmx.quant.triton.bits import code_f32, f16, int_f32
from llmx.quant.triton.kquants import k4_scale_min

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
    """One program: NG groups of 32 values of row program_id(0) of x [M, K] (any float dtype),
    quantized by `store_quantized`."""
    m = tl.program_id(0)
    g = tl.program_id(1) * NG + tl.arange(0, NG)
    ok = g < K // 32
    off = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + m * sxm + off, mask=ok[:, None], other=0.0).to(tl.float32)
    store_quantized(x, g, ok, m, K, xq_ptr, dx_ptr, xs_ptr)


@triton.jit
def store_quantized(x, g, ok, m, K, xq_ptr, dx_ptr, xs_ptr):
    """Groups g [NG] (those `ok`) of row m of x, given as float32 [NG, 32], stored quantized: xq
    [M, K] int8 = round(x / dx) (half away from zero), dx [M, K/32] float32 = max|x| / 127, and xs
    [M, K/16] float32 = dx * (the sums of xq per 16), for the types whose codes carry an offset
    or a min. Kernels that produce an activation call this too, sparing a launch per GEMV input."""
    NG: tl.constexpr = x.shape[0]
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    v = x * inv[:, None]
    q = (v + tl.where(v >= 0, 0.5, -0.5)).to(tl.int32)
    off = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(xq_ptr + m * K + off, q.to(tl.int8), mask=ok[:, None])
    tl.store(dx_ptr + m * (K // 32) + g, amax / 127.0, mask=ok)
    sums = tl.sum(tl.reshape(q, (NG, 2, 16)), axis=2).to(tl.float32) * (amax / 127.0)[:, None]
    halves = g[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store(xs_ptr + m * (K // 16) + halves, sums, mask=ok[:, None])


@triton.jit
def store_quantized_block(v, g0, row, n, xq_ptr, dx_ptr, xs_ptr):
    """`store_quantized` for values v [BLOCK] (a multiple of 32) that are groups g0.. of row `row`
    of n values; groups past n are not stored."""
    NG: tl.constexpr = v.shape[0] // 32
    g = g0 + tl.arange(0, NG)
    store_quantized(tl.reshape(v.to(tl.float32), (NG, 32)), g, g < n // 32, row, n, xq_ptr, dx_ptr, xs_ptr)


@triton.jit
def _quad(base, unit_words, u, QUADS: tl.constexpr, STRIDE: tl.constexpr):
    """[BN, U, QUADS, 4] word offsets: 4 consecutive words at `base + q * STRIDE` for quad q of
    each block `u` (`unit_words` words a block) of the rows at `base` [BN]. The last axis is
    contiguous, so a thread loads its 4 words as one 16-byte vector and sums them in registers."""
    q = tl.arange(0, QUADS)[None, None, :, None]
    lane = tl.arange(0, 4)[None, None, None, :]
    return base[:, None, None, None] + u[None, :, None, None] * unit_words + q * STRIDE + lane


@triton.jit
def _x_quad(u, unit_words, QUADS: tl.constexpr, STRIDE: tl.constexpr):
    """`_quad`'s offsets into x's codes, [1, U, QUADS, 4]: every row meets the same x, and a tensor
    without the row axis, broadcast over it, lets one thread's loads serve all the rows it holds
    (spelled per row, each row's copy was loaded again). With the launch shapes that keep rows in
    threads (`triton_ops.default_dot8`) Q4_K ran 4-6% faster on an H200 (bench/RESULTS.md)."""
    return _quad(tl.zeros([1], tl.int64), unit_words, u, QUADS, STRIDE)


@triton.jit
def _words(ptr, word, ok):
    """The 32-bit words at word offsets `word` of a weight's rows or of x's codes (any shape, x's
    broadcast over rows), 0 where not `ok`: the step after the last one is loaded ahead like any
    other, and its blocks must cost no memory traffic."""
    return tl.load(ptr.to(tl.pointer_type(tl.int32)) + word, mask=ok, other=0)


@triton.jit
def _q8_0_load(w_ptr, row_w, u, ok, K):
    """Q8_0 blocks `u` of the rows (prepared: 32-byte bodies, then the fp16 d's): codes
    [BN, U, 2, 4] words and d [BN, U, 2] (each block's d twice: shaped like the partial sums, so
    that both land in one register layout without a shared-memory shuffle)."""
    codes = _words(w_ptr, _quad(row_w, 8, u, 2, 4), ok[None, :, None, None])
    half = tl.arange(0, 2)[None, None, :]
    d = f16(w_ptr, row_w[:, None, None] * 4 + (K // 32) * 32 + u[None, :, None] * 2 + 0 * half)
    return codes, d


@triton.jit
def _q8_0(codes, d, xq_ptr, dx_ptr, u, ok, ASM: tl.constexpr):
    """[BN, U, 2] partial dots of loaded Q8_0 blocks `u`."""
    xw = _words(xq_ptr, _x_quad(u, 8, 2, 4), ok[None, :, None, None])
    dot = tl.sum(dp4a(codes, xw, True, ASM), 3)
    dx = tl.load(
        dx_ptr + u[None, :, None] + 0 * tl.arange(0, 2)[None, None, :], mask=ok[None, :, None], other=0.0
    )
    return dot.to(tl.float32) * d * dx


@triton.jit
def _q4_k_load(w_ptr, row_w, u, ok):
    """Q4_K super-blocks `u` (144 bytes: d, dmin, 12 scale bytes, 128 code bytes): the codes and
    the header, both [BN, U, 8, 4] words. Every quad's thread loads its block's 16-byte header as
    one vector (one L1 request for all of them, where byte-wise loads made ten), and takes its
    scales apart in registers."""
    ok4 = ok[None, :, None, None]
    return _words(w_ptr, _quad(row_w, 36, u, 8, 4) + 4, ok4), _words(w_ptr, _quad(row_w, 36, u, 8, 0), ok4)


@triton.jit
def _word(v, i: tl.constexpr):
    """Word i of the 4-word last axis of v (held by one thread: no data moves)."""
    return tl.sum(tl.where(tl.arange(0, 4)[None, None, None, :] == i, v, 0), 3)


@triton.jit
def _half(word, high: tl.constexpr):
    """The fp16 in the low (or high) half of int32 `word`, as float32."""
    bits = (word >> 16) if high else word
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q4_k(codes, hdr, xq_ptr, dx_ptr, xs_ptr, u, ok, ASM: tl.constexpr):
    """[BN, U, 8] partial dots of loaded Q4_K super-blocks `u`. Code word i holds weights
    4(i%8)..+3 of sub-block 2(i//8) in its low nibbles and of sub-block 2(i//8)+1 in its high
    nibbles; quad e is words 4e..4e+3, so it meets sub-blocks j = 2(e//2) and j + 1."""
    xw = _x_quad(u, 64, 8, 4)  # x words of the same weights if they were all low nibbles
    e4 = tl.arange(0, 8)[None, None, :, None]
    x_lo = xw + 8 * (e4 // 2)  # low nibbles of quad e: x words 16(e//2) + 4(e%2) + lane; high: 8 on
    ok4 = ok[None, :, None, None]
    s_lo = tl.sum(dp4a(codes & LOW_NIBBLES, _words(xq_ptr, x_lo, ok4), False, ASM), 3)
    s_hi = tl.sum(dp4a((codes >> 4) & LOW_NIBBLES, _words(xq_ptr, x_lo + 8, ok4), False, ASM), 3)
    e = tl.arange(0, 8)[None, None, :]
    pair = e // 2
    # Sub-blocks j and j + 1 have their scale bytes side by side in each of header words 1-3.
    shift = 16 * (pair % 2)
    s_w, m_w, sm_w = _word(hdr, 1) >> shift, _word(hdr, 2) >> shift, _word(hdr, 3) >> shift
    sc_lo, mn_lo = k4_scale_min(s_w & 255, m_w & 255, sm_w & 255, pair < 2)
    sc_hi, mn_hi = k4_scale_min((s_w >> 8) & 255, (m_w >> 8) & 255, (sm_w >> 8) & 255, pair < 2)
    grp = u[None, :, None] * 8 + 2 * pair  # 32-group of the low sub-block in the row
    ok3 = ok[None, :, None]
    dx_lo = tl.load(dx_ptr + grp, mask=ok3, other=0.0)
    dx_hi = tl.load(dx_ptr + grp + 1, mask=ok3, other=0.0)
    xs_lo = tl.load(xs_ptr + 2 * grp + e % 2, mask=ok3, other=0.0)  # this quad's 16 of each
    xs_hi = tl.load(xs_ptr + 2 * grp + 2 + e % 2, mask=ok3, other=0.0)
    scaled = dx_lo * int_f32(sc_lo * s_lo) + dx_hi * int_f32(sc_hi * s_hi)  # |sc * s| <= 63*16*15*127 < 2**22
    mins = code_f32(mn_lo, 0) * xs_lo + code_f32(mn_hi, 0) * xs_hi
    hdr0 = _word(hdr, 0)
    return _half(hdr0, False) * scaled - _half(hdr0, True) * mins


@triton.jit
def _q6_k_load(w_ptr, row_w, u, ok):
    """Q6_K super-blocks `u` (prepared rows: 208-byte bodies of ql[128], qh[64], scales[16]):
    ql_a, ql_b, qh [BN, U, 4, 4] words and the two scale words of each quad, [BN, U, 4].

    Per half h of 128 weights: ql word c (c < 8) holds the low nibbles of quarter 0 (and, high
    nibbles, quarter 2) at weights 4c..4c+3, ql word 8 + c those of quarters 1 and 3, and qh word c
    the 2 high bits of all four quarters at bits 0-1, 2-3, 4-5, 6-7 of each byte. Quad e = (h,
    c//4) of the qh words meets quads of ql at 16h + 4(e%2) and 8 words on; its scales (one per
    16 weights, 8h + 2 * quarter + e%2) are in scale words 2h (quarters 0, 1) and 2h + 1.
    """
    e4 = tl.arange(0, 4)[None, None, :, None]
    qh_w = _quad(row_w, 52, u, 4, 4) + 32
    ql_w = qh_w - 32 + 8 * (e4 // 2)
    e = tl.arange(0, 4)[None, None, :]
    sc_w = (row_w[:, None] + u[None, :] * 52)[:, :, None] + 48 + 2 * (e // 2)
    ok4, ok3 = ok[None, :, None, None], ok[None, :, None]
    return (
        _words(w_ptr, ql_w, ok4),
        _words(w_ptr, ql_w + 8, ok4),
        _words(w_ptr, qh_w, ok4),
        _words(w_ptr, sc_w, ok3),
        _words(w_ptr, sc_w + 1, ok3),
    )


@triton.jit
def _q6_k(ql_a, ql_b, qh, sc01, sc23, w_ptr, xq_ptr, dx_ptr, xs_ptr, row_w, u, ok, K, ASM: tl.constexpr):
    """[BN, U, 4] partial dots of loaded Q6_K super-blocks `u` (see `_q6_k_load`)."""
    quarters = (
        (ql_a & LOW_NIBBLES) | ((qh << 4) & HIGH_PAIRS),
        (ql_b & LOW_NIBBLES) | ((qh << 2) & HIGH_PAIRS),
        ((ql_a >> 4) & LOW_NIBBLES) | (qh & HIGH_PAIRS),
        ((ql_b >> 4) & LOW_NIBBLES) | ((qh >> 2) & HIGH_PAIRS),
    )
    e4 = tl.arange(0, 4)[None, None, :, None]
    x0 = _x_quad(u, 64, 4, 4) + 24 * (e4 // 2)  # quarter 0's x: word 32h + 4(e%2) + lane
    ok4 = ok[None, :, None, None]
    e = tl.arange(0, 4)[None, None, :]
    ok3 = ok[None, :, None]
    acc = tl.zeros(sc01.shape, tl.float32)
    for kq in tl.static_range(4):
        s = tl.sum(dp4a(quarters[kq], _words(xq_ptr, x0 + 8 * kq, ok4), False, ASM), 3)
        word = sc01 if kq < 2 else sc23
        byte = 2 * (kq % 2) + e % 2
        sc = int_f32((word << (24 - 8 * byte)) >> 24)  # the int8 scale
        row16 = u[None, :, None] * 16 + 8 * (e // 2) + 2 * kq + e % 2
        dx = tl.load(dx_ptr + row16 // 2, mask=ok3, other=0.0)
        xsum = tl.load(xs_ptr + row16, mask=ok3, other=0.0)
        acc += sc * (dx * int_f32(s) - 32.0 * xsum)
    d = f16(w_ptr, row_w[:, None, None] * 4 + (K // 256) * 208 + u[None, :, None] * 2)
    return d * acc


@triton.jit
def _units(u0, BU: tl.constexpr, n_units):
    """Blocks u0..u0+BU-1, clamped to the last one (for loads), and which of them exist."""
    u = u0 + tl.arange(0, BU)
    return tl.minimum(u, n_units - 1), u < n_units


@triton.jit
def gemv8_kernel(
    xq_ptr, dx_ptr, xs_ptr, w0, o0, n0, w1, o1, n1, w2, o2, n2, K, swn_words,
    QT: tl.constexpr, UNIT: tl.constexpr, QUADS: tl.constexpr, BN: tl.constexpr, BU: tl.constexpr,
    NW: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """One program: BN outputs of one quantized x row, BU blocks of UNIT weights a step (UNIT = 32
    for Q8_0, 256 for the K-quants; QUADS: partial sums a block).

    One launch serves NW (1-3) weights w0..w2 of one type and width that take the same x (q/k/v,
    gate/up), each with its output o and row count n: a decode step saves the launches, and the
    small projections share their waves of programs instead of each leaving the GPU part idle.

    Each step loads the next step's weights before computing on the current ones (Triton does not
    pipeline loads that feed no tl.dot), so two steps of codes are in flight. Partial sums stay
    in registers, [BN, BU, QUADS], and are reduced once after the loop: the loop has no
    cross-thread traffic. Out-of-range rows are clamped to the last one (and not stored);
    out-of-range blocks are not read (their weights and x load as 0).
    """
    pid = tl.program_id(0)
    w_ptr, out_ptr, N, first = w0, o0, n0, 0
    if NW > 1:  # the programs after weight 0's take weight 1, then weight 2
        p1 = tl.cdiv(n0, BN)
        if pid >= p1:
            w_ptr, out_ptr, N, first = w1, o1, n1, p1
            if NW > 2:
                p2 = p1 + tl.cdiv(n1, BN)
                if pid >= p2:
                    w_ptr, out_ptr, N, first = w2, o2, n2, p2
    rn = (pid - first) * BN + tl.arange(0, BN)
    row_w = tl.minimum(rn, N - 1).to(tl.int64) * swn_words
    n_units = K // UNIT
    acc = tl.zeros([BN, BU, QUADS], tl.float32)
    u, ok = _units(0, BU, n_units)
    if QT == "Q8_0":
        codes, d = _q8_0_load(w_ptr, row_w, u, ok, K)
        for u0 in range(0, n_units, BU):
            u_next, ok_next = _units(u0 + BU, BU, n_units)
            codes_next, d_next = _q8_0_load(w_ptr, row_w, u_next, ok_next, K)
            acc += _q8_0(codes, d, xq_ptr, dx_ptr, u, ok, ASM)
            codes, d, u, ok = codes_next, d_next, u_next, ok_next
    elif QT == "Q4_K":
        codes, hdr = _q4_k_load(w_ptr, row_w, u, ok)
        for u0 in range(0, n_units, BU):
            u_next, ok_next = _units(u0 + BU, BU, n_units)
            codes_next, hdr_next = _q4_k_load(w_ptr, row_w, u_next, ok_next)
            acc += _q4_k(codes, hdr, xq_ptr, dx_ptr, xs_ptr, u, ok, ASM)
            codes, hdr, u, ok = codes_next, hdr_next, u_next, ok_next
    else:
        tl.static_assert(QT == "Q6_K", "no integer-dot GEMV for this GGML type")
        ql_a, ql_b, qh, sc01, sc23 = _q6_k_load(w_ptr, row_w, u, ok)
        for u0 in range(0, n_units, BU):
            u_next, ok_next = _units(u0 + BU, BU, n_units)
            na, nb, nh, n01, n23 = _q6_k_load(w_ptr, row_w, u_next, ok_next)
            acc += _q6_k(ql_a, ql_b, qh, sc01, sc23, w_ptr, xq_ptr, dx_ptr, xs_ptr, row_w, u, ok, K, ASM)
            ql_a, ql_b, qh, sc01, sc23, u, ok = na, nb, nh, n01, n23, u_next, ok_next
    tl.store(out_ptr + rn, tl.sum(tl.sum(acc, axis=2), axis=1).to(out_ptr.dtype.element_ty), mask=rn < N)
