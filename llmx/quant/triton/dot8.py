"""Decode GEMV on integer dot products: weight codes times activations quantized to int8 per 32.

The float GEMV (`kernels.gemv_kernel`) spends ~10 instructions per weight on extracting a code,
converting it and multiplying. Here, as in llama.cpp's CUDA decode (mmvq), x is first quantized
per group of 32 values (`quantize_x_kernel`: int8 codes, a float scale dx = max|x| / 127 and
dx times the code sums per 16), and the weights are read as 32-bit words whose 4 byte lanes meet
4 x codes in one `dp4a` instruction (int32 accumulate, exact); each group's scales are applied
once to its integer sum, for 2-3.5 instructions a weight in all, so `llmx.quant.choice` takes it
for every M = 1 product of these types. The kernels that produce a decode step's activations
(RMSNorm, the SiLU gate, attention's combine) quantize their output with `store_quantized` as they
write it.

Numerics: integer sums are exact; beyond float32 summation, the one rounding is x's quantization
(at most 1/254 of each group's largest |x| per value), as in llama.cpp's GPU decode.

Types (rows in `layout.prepare`'s layout: Q6_K's and Q8_0's block bodies 16-byte aligned,
Q4_K's 144-byte blocks in place with their scales regrouped by sub-block pair):
    Q8_0: 8 words of int8 codes a block of 32              w = d * q
    Q4_K: 32 words of nibbles a super-block of 256         w = d*sc*q - dmin*m (per 32)
    Q6_K: 32 words of low nibbles + 16 of 2-bit highs      w = d*sc*(q - 32)   (per 16)
Under TRITON_INTERPRET=1 (no PTX) `dp4a` is spelled out with shifts, with the same results.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llmx.quant.triton.bits import code_f32, half_f32, int_f32, lane
from llmx.quant.triton.kquants import paired_scale_min

LOW_NIBBLES = tl.constexpr(0x0F0F0F0F)
HIGH_PAIRS = tl.constexpr(0x30303030)  # bits 4-5 of each byte: where Q6_K's 2 high bits go

# The end of a program of 4 rows on 4 warps with one column of partial sums a thread (Q4_K's
# one-step shape): a reduce-scatter in place of tl.sum's all-reduce, after which thread c holds row
# c % 4's total ($1-$4: the thread's partials of rows 0-3, $5: its column c, $0: the total). Lanes
# pair at distance 1 (each keeps two rows and sends two), then 2 (keeps one, sends one), then sum
# one value over distances 4, 8 and 16; lanes 0-3 of each warp leave their row's warp sum in shared
# memory, one named barrier, and each thread adds its row's four: 6 shuffles, 1 barrier and 1 vector
# load where tl.sum's all-reduce takes 22-28 shuffles and 3-4 barriers (Triton 3.6-3.9), all of it
# after the last load has waited.
SCATTER4_ASM = tl.constexpr("""{
.reg .pred b0, b1, lead;
.reg .u32 t, lane, w, a, base, row;
.reg .f32 sa, sb, ka, kb, ra, rb, s, k, r, y;
.shared .align 16 .f32 red[16];
mov.u32 t, %tid.x;
and.b32 lane, t, 31;
shr.u32 w, t, 5;
and.b32 a, lane, 1;
setp.ne.u32 b0, a, 0;
and.b32 a, lane, 2;
setp.ne.u32 b1, a, 0;
selp.f32 sa, $1, $3, b0;
selp.f32 sb, $2, $4, b0;
selp.f32 ka, $3, $1, b0;
selp.f32 kb, $4, $2, b0;
shfl.sync.bfly.b32 ra, sa, 1, 31, 0xffffffff;
shfl.sync.bfly.b32 rb, sb, 1, 31, 0xffffffff;
add.f32 ka, ka, ra;
add.f32 kb, kb, rb;
selp.f32 s, ka, kb, b1;
selp.f32 k, kb, ka, b1;
shfl.sync.bfly.b32 r, s, 2, 31, 0xffffffff;
add.f32 k, k, r;
shfl.sync.bfly.b32 r, k, 4, 31, 0xffffffff;
add.f32 k, k, r;
shfl.sync.bfly.b32 r, k, 8, 31, 0xffffffff;
add.f32 k, k, r;
shfl.sync.bfly.b32 r, k, 16, 31, 0xffffffff;
add.f32 k, k, r;
and.b32 a, lane, 1;
shl.b32 row, a, 1;
bfe.u32 a, lane, 1, 1;
or.b32 row, row, a;
mov.u32 base, red;
mad.lo.u32 a, row, 4, w;
shl.b32 a, a, 2;
add.u32 a, base, a;
setp.lt.u32 lead, lane, 4;
@lead st.shared.f32 [a], k;
bar.sync 1, 128;
and.b32 a, $5, 3;
shl.b32 a, a, 4;
add.u32 a, base, a;
ld.shared.v4.f32 {sa, sb, ka, kb}, [a];
add.f32 y, sa, sb;
add.f32 r, ka, kb;
add.f32 $0, y, r;
}""")


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
def quantize_x_kernel(
    x_ptr, xq_ptr, dx_ptr, xs_ptr, K, sxm, zero_ptr, zero_n, NG: tl.constexpr, ZB: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One program: NG groups of 32 values of row program_id(0) of x [M, K] (any float dtype),
    quantized by `store_quantized`; with ZB, also ZB of the zero_n float32 values at zero_ptr set to 0
    (the output that the next launch's programs add into). PDL: as `moe_kernels.moe_gemv8_kernel`'s."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    if ZB:
        at = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * ZB + tl.arange(0, ZB)
        tl.store(zero_ptr + at, tl.zeros([ZB], tl.float32), mask=at < zero_n)
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
    [M, K/16] float32 = dx * (the sums of xq per 16), for Q4_K's mins. Kernels that produce an
    activation call this too, sparing a launch per GEMV input."""
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


# --- the GEMV ----------------------------------------------------------------------------------
# Every tensor of a step is laid out along one axis of W 32-bit words a row: weight tensors are
# [BN, W], x's [W] (broadcast over the rows), and a thread holds 4 consecutive words (a "quad",
# one 16-byte load) of every row, so the rows and the x they share sit in one thread. With the
# word axis wide enough for all of a warp's threads (W >= 128), Triton has one layout to choose,
# whatever its version: spelled as [BN, blocks, quads, 4], Triton 3.6 spread the rows over threads
# and moved x and the partial sums between them with ~30 warp shuffles a step, which the L1 serves
# beside the loads (bench/RESULTS.md, session 9). Word offsets are written straight from the axis
# index (`w % 8`, not `(w % 32) % 8`): Triton proves 16-byte vectors only from such forms. A load
# with no contiguous axis (one d a block) is made flat and reshaped (`_block_d`), as Triton lays
# out one axis the same way in both versions.


@triton.jit
def _quads(v):
    """[BN, W] -> [BN, W/4]: the sum of each quad's 4 words (within a thread: no data moves)."""
    return tl.sum(tl.reshape(v, [v.shape[0], v.shape[1] // 4, 4]), 2)


@triton.jit
def _load(ptr, blk, n_units, EVEN: tl.constexpr):
    """*ptr, 0 where block `blk` (broadcast to ptr's shape) is past the row's n_units. EVEN (every
    step's blocks whole) loads with no mask: a masked load costs a predicate and a zero fill of its
    registers, ~10% of Q4_K's instructions."""
    return tl.load(ptr) if EVEN else tl.load(ptr, mask=blk < n_units, other=0)


@triton.jit
def _words(ptr, word, blk, n_units, EVEN: tl.constexpr):
    """The 32-bit words at word offsets `word` of a weight's rows or of x's codes (`_load`)."""
    return _load(ptr.to(tl.pointer_type(tl.int32)) + word, blk, n_units, EVEN)


@triton.jit
def _block_d(w_ptr, row_w, first, blk, n_units, EVEN: tl.constexpr):
    """[BN, Q]: the fp16 d of block `blk` [Q] of each quad (`_load`), from the d's that prepared
    rows store one after another from word `first`, as float32. Loaded as one flat axis and
    reshaped: a [BN, Q] load has no contiguous axis (two or four quads share a d), and Triton 3.6
    then lays its rows across threads and moves every d to the codes' layout with shuffles."""
    BN: tl.constexpr = row_w.shape[0]
    Q: tl.constexpr = blk.shape[0]
    byte = row_w[:, None] * 4 + first * 4 + blk[None, :] * 2
    blks = tl.reshape(tl.broadcast_to(blk[None, :], [BN, Q]), [BN * Q])
    flat = _load((w_ptr + tl.reshape(byte, [BN * Q])).to(tl.pointer_type(tl.float16)), blks, n_units, EVEN)
    return tl.reshape(flat, [BN, Q]).to(tl.float32)


@triton.jit
def _q8_0_load(w_ptr, row_w, u0, n_units, BU: tl.constexpr, EVEN: tl.constexpr):
    """Q8_0 blocks u0.. (prepared rows: 32-byte bodies, then the fp16 d's): [BN, 8 BU] code words."""
    w = tl.arange(0, BU * 8)
    return _words(w_ptr, row_w[:, None] + u0 * 8 + w[None, :], (u0 + w // 8)[None, :], n_units, EVEN)


@triton.jit
def _q8_0(codes, w_ptr, xq_ptr, dx_ptr, row_w, u0, n_units, K, ASM: tl.constexpr, EVEN: tl.constexpr):
    """[BN, Q] partial dots of loaded Q8_0 blocks (2 quads a block)."""
    Q: tl.constexpr = codes.shape[1] // 4
    w = tl.arange(0, 4 * Q)
    xw = _words(xq_ptr, u0 * 8 + w, u0 + w // 8, n_units, EVEN)
    dot = _quads(dp4a(codes, xw[None, :], True, ASM))
    blk = u0 + tl.arange(0, Q) // 2
    dx = _load(dx_ptr + blk, blk, n_units, EVEN)
    return int_f32(dot) * _block_d(w_ptr, row_w, K // 4, blk, n_units, EVEN) * dx[None, :]


@triton.jit
def _q4_k_codes(w_ptr, row_w, u0, n_units, BU: tl.constexpr, EVEN: tl.constexpr):
    """Q4_K super-blocks u0.. (144 bytes: d, dmin, 12 scale bytes, 128 code bytes): [BN, 32 BU] code
    words."""
    w = tl.arange(0, BU * 32)
    blk = (u0 + w // 32)[None, :]
    return _words(w_ptr, row_w[:, None] + blk * 36 + 4 + (w % 32)[None, :], blk, n_units, EVEN)


@triton.jit
def _q4_k_headers(w_ptr, row_w, u0, n_units, BU: tl.constexpr, EVEN: tl.constexpr):
    """For each quad of Q4_K super-blocks u0.. its block's 16-byte header, [BN, 32 BU] words: loaded
    as one vector (one L1 request for all of a block's quads, where byte-wise loads made ten) and
    taken apart in registers."""
    w = tl.arange(0, BU * 32)
    blk = (u0 + w // 32)[None, :]
    return _words(w_ptr, row_w[:, None] + blk * 36 + (w % 4)[None, :], blk, n_units, EVEN)


@triton.jit
def _q4_k(codes, hdr, xq_ptr, dx_ptr, xs_ptr, u0, n_units, ASM: tl.constexpr, EVEN: tl.constexpr):
    """[BN, Q] partial dots of loaded Q4_K super-blocks (8 quads a block). Code word c of a block
    holds weights c%8 of sub-block 2(c//8) in its low nibbles and of sub-block 2(c//8) + 1 in its
    high nibbles, so quad e meets the sub-block pair e//2, whose x words are 16(e//2) + c%8 (low)
    and 8 words on (high)."""
    Q: tl.constexpr = codes.shape[1] // 4
    w = tl.arange(0, 4 * Q)
    x_lo = (u0 + w // 32) * 64 + 16 * ((w // 8) % 4) + w % 8
    x_blk = u0 + w // 32
    s_lo = _quads(dp4a(codes & LOW_NIBBLES, _words(xq_ptr, x_lo, x_blk, n_units, EVEN)[None, :], False, ASM))
    s_hi = _quads(
        dp4a((codes >> 4) & LOW_NIBBLES, _words(xq_ptr, x_lo + 8, x_blk, n_units, EVEN)[None, :], False, ASM)
    )
    q = tl.arange(0, Q)
    blk = u0 + q // 8
    pair = (q % 8) // 2
    # The pair's low scale bits: header bytes 4 + 2 pair, 5 + 2 pair (word 1 or 2); its top bits:
    # byte 12 + pair (word 3), see layout.prepare_q4_k_scales.
    lows = tl.where((pair < 2)[None, :], lane(hdr, 1), lane(hdr, 2)) >> (16 * (pair % 2))[None, :]
    highs = (lane(hdr, 3) >> (8 * pair)[None, :]) << 4
    sc_lo, mn_lo = paired_scale_min(lows, highs, 0)
    sc_hi, mn_hi = paired_scale_min(lows, highs, 1)
    grp = blk * 8 + 2 * pair  # 32-group of the low sub-block in the row
    dx_lo = _load(dx_ptr + grp, blk, n_units, EVEN)[None, :]
    dx_hi = _load(dx_ptr + grp + 1, blk, n_units, EVEN)[None, :]
    xs_lo = _load(xs_ptr + 2 * grp + q % 2, blk, n_units, EVEN)[None, :]  # this quad's 16 of each
    xs_hi = _load(xs_ptr + 2 * grp + 2 + q % 2, blk, n_units, EVEN)[None, :]
    scaled = dx_lo * int_f32(sc_lo * s_lo) + dx_hi * int_f32(sc_hi * s_hi)  # |sc * s| <= 63*16*15*127 < 2**22
    mins = code_f32(mn_lo, 0) * xs_lo + code_f32(mn_hi, 0) * xs_hi
    hdr0 = lane(hdr, 0)
    return half_f32(hdr0, False) * scaled - half_f32(hdr0, True) * mins


@triton.jit
def _q6_k_load(w_ptr, row_w, u0, n_units, BU: tl.constexpr, EVEN: tl.constexpr):
    """Q6_K super-blocks u0.. (prepared rows: 208-byte bodies of ql[128], qh[64], scales[16]), along
    the qh words (16 a block): ql_a, ql_b, qh and the scale words, [BN, 16 BU] each.

    Per half h of 128 weights: ql word c (c < 8) holds the low nibbles of quarter 0 (and, high
    nibbles, quarter 2) at weights 4c..4c+3, ql word 8 + c those of quarters 1 and 3, and qh word c
    the 2 high bits of all four quarters at bits 0-1, 2-3, 4-5, 6-7 of each byte. qh word c of the
    block (h = c//8) meets ql words 16h + c%8 and 8 words on; the scales of its quad (one per 16
    weights, 8h + 2 * quarter + quad%2) are in scale words 2h (quarters 0, 1) and 2h + 1 of the
    block's four, which every quad loads as one vector."""
    w = tl.arange(0, BU * 16)
    blk = (u0 + w // 16)[None, :]
    base = row_w[:, None] + blk * 52
    ql_a = base + (16 * ((w // 8) % 2) + w % 8)[None, :]
    return (
        _words(w_ptr, ql_a, blk, n_units, EVEN),
        _words(w_ptr, ql_a + 8, blk, n_units, EVEN),
        _words(w_ptr, base + 32 + (w % 16)[None, :], blk, n_units, EVEN),
        _words(w_ptr, base + 48 + (w % 4)[None, :], blk, n_units, EVEN),
    )


@triton.jit
def _q6_k(
    ql_a, ql_b, qh, scales, w_ptr, xq_ptr, dx_ptr, row_w, u0, n_units, K, ASM: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    """[BN, Q] partial dots of loaded Q6_K super-blocks (4 quads a block, see `_q6_k_load`)."""
    quarters = (
        (ql_a & LOW_NIBBLES) | ((qh << 4) & HIGH_PAIRS),
        (ql_b & LOW_NIBBLES) | ((qh << 2) & HIGH_PAIRS),
        ((ql_a >> 4) & LOW_NIBBLES) | (qh & HIGH_PAIRS),
        ((ql_b >> 4) & LOW_NIBBLES) | ((qh >> 2) & HIGH_PAIRS),
    )
    Q: tl.constexpr = qh.shape[1] // 4
    w = tl.arange(0, 4 * Q)
    x_blk = u0 + w // 16
    x0 = x_blk * 64 + 32 * ((w // 8) % 2) + w % 8  # quarter 0's x words; quarter kq's 8 kq on
    q = tl.arange(0, Q)
    blk = u0 + q // 4
    h = ((q % 4) // 2)[None, :, None]
    words = (lane(scales, 2 * h), lane(scales, 2 * h + 1))
    thirty_two = tl.full([1, 4 * Q], 0x20202020, tl.int32)
    acc = tl.zeros([qh.shape[0], Q], tl.float32)
    for kq in tl.static_range(4):
        xw = _words(xq_ptr, x0 + 8 * kq, x_blk, n_units, EVEN)[None, :]
        # The integer sum of (q - 32) x: the offset's part is 32 times the sum of x's codes, taken
        # from the words already loaded (a dp4a each) where loading `store_quantized`'s x sums
        # cost 4 loads a quad and 1-5% of the time (bench/RESULTS.md, session 14).
        s = _quads(dp4a(quarters[kq], xw, False, ASM) - dp4a(thirty_two, xw, False, ASM))
        byte = (2 * (kq % 2) + q % 2)[None, :]
        sc = (words[kq // 2] << (24 - 8 * byte)) >> 24  # the int8 scale
        row16 = blk * 16 + 8 * ((q % 4) // 2) + 2 * kq + q % 2
        dx = _load(dx_ptr + row16 // 2, blk, n_units, EVEN)[None, :]
        # exact: |sc * s| <= 128 * 16 * 32 * 127 < 2**24, but past int_f32's 2**22
        acc += dx * (sc * s).to(tl.float32)
    return _block_d(w_ptr, row_w, (K // 256) * 52, blk, n_units, EVEN) * acc


@triton.jit
def load_step(
    QT: tl.constexpr, w_ptr, row_w, u0, n_units, BU: tl.constexpr, EVEN: tl.constexpr, LATE: tl.constexpr
):
    """The weights of blocks u0..u0+BU of the rows at word offsets row_w [BN] (int64), as `dot_step`
    takes them: four tensors (Q8_0: its codes four times; Q4_K: codes, headers (codes again with
    LATE: `dot_step` loads them), codes twice; Q6_K: `_q6_k_load`'s)."""
    if QT == "Q8_0":
        codes = _q8_0_load(w_ptr, row_w, u0, n_units, BU, EVEN)
        a, b, c, d = codes, codes, codes, codes
    elif QT == "Q4_K":
        codes = _q4_k_codes(w_ptr, row_w, u0, n_units, BU, EVEN)
        hdr = codes if LATE else _q4_k_headers(w_ptr, row_w, u0, n_units, BU, EVEN)
        a, b, c, d = codes, hdr, codes, codes
    else:
        tl.static_assert(QT == "Q6_K", "no integer-dot GEMV for this GGML type")
        a, b, c, d = _q6_k_load(w_ptr, row_w, u0, n_units, BU, EVEN)
    return a, b, c, d


@triton.jit
def late_step(
    QT: tl.constexpr, a, b, c, d, w_ptr, row_w, u0, n_units, EVEN: tl.constexpr, LATE: tl.constexpr
):
    """`load_step`'s a, b, c, d for blocks u0.. as `dot_step` computes on them: with LATE, Q4_K's
    headers loaded now, from the L1 (the first sector of their block's codes holds them)."""
    if QT == "Q4_K" and LATE:
        BU: tl.constexpr = a.shape[1] // 32
        b = _q4_k_headers(w_ptr, row_w, u0, n_units, BU, EVEN)
    return a, b, c, d


@triton.jit
def dot_step(
    QT: tl.constexpr, a, b, c, d, w_ptr, row_w, xq_ptr, dx_ptr, xs_ptr, u0, n_units, K, ASM: tl.constexpr,
    EVEN: tl.constexpr, LATE: tl.constexpr,
):  # fmt: skip
    """[BN, BU * QUADS] partial dots of the blocks u0.. that `load_step` loaded (a, b, c, d) with x
    (xq_ptr, dx_ptr, xs_ptr: `store_quantized`'s buffers, at x's row)."""
    a, b, c, d = late_step(QT, a, b, c, d, w_ptr, row_w, u0, n_units, EVEN, LATE)
    if QT == "Q8_0":
        out = _q8_0(a, w_ptr, xq_ptr, dx_ptr, row_w, u0, n_units, K, ASM, EVEN)
    elif QT == "Q4_K":
        out = _q4_k(a, b, xq_ptr, dx_ptr, xs_ptr, u0, n_units, ASM, EVEN)
    else:
        out = _q6_k(a, b, c, d, w_ptr, xq_ptr, dx_ptr, row_w, u0, n_units, K, ASM, EVEN)
    return out


@triton.jit
def row_dots(
    QT: tl.constexpr, w_ptr, row_w, xq_ptr, dx_ptr, xs_ptr, K, UNIT: tl.constexpr, QUADS: tl.constexpr,
    BU: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr, LATE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """[BN, BU * QUADS] partial sums of the dot products of the rows at word offsets row_w [BN] (int64)
    of w_ptr with one quantized x (xq_ptr, dx_ptr, xs_ptr: its row), BU blocks of UNIT weights a
    step; their sum along axis 1 is the rows' products. The loop of the one-row integer-dot kernels
    (`gemv8_kernel`, `moe_kernels.moe_gemv8_kernel`): each step loads the next step's weights
    (`load_step`) before computing on the current ones (`dot_step`), and the last step is taken
    after the loop (see `gemv8_kernel` for LATE and PDL: with PDL, x is read only after `gdc_wait`,
    the first step's weights before)."""
    BN: tl.constexpr = row_w.shape[0]
    n_units = K // UNIT
    last = (n_units - 1) // BU * BU  # the last step's first block
    acc = tl.zeros([BN, BU * QUADS], tl.float32)
    a, b, c, d = load_step(QT, w_ptr, row_w, 0, n_units, BU, EVEN, LATE)
    if PDL:
        gdc_wait()
    for u0 in range(0, last, BU):
        na, nb, nc, nd = load_step(QT, w_ptr, row_w, u0 + BU, n_units, BU, EVEN, LATE)
        acc += dot_step(QT, a, b, c, d, w_ptr, row_w, xq_ptr, dx_ptr, xs_ptr, u0, n_units, K, ASM, EVEN, LATE)
        a, b, c, d = na, nb, nc, nd
    acc += dot_step(QT, a, b, c, d, w_ptr, row_w, xq_ptr, dx_ptr, xs_ptr, last, n_units, K, ASM, EVEN, LATE)
    return acc


@triton.jit
def pick_weight(tile, w0, o0, n0, w1, o1, n1, w2, o2, n2, BN: tl.constexpr, NW: tl.constexpr):
    """The weight (its rows, output and row count) of output tile `tile` of a launch over NW weights
    whose tiles of BN rows are numbered one weight after another, and that weight's first tile."""
    w_ptr, out_ptr, N, first = w0, o0, n0, 0
    if NW > 1:  # the tiles after weight 0's are weight 1's, then weight 2's
        p1 = tl.cdiv(n0, BN)
        if tile >= p1:
            w_ptr, out_ptr, N, first = w1, o1, n1, p1
            if NW > 2:
                p2 = p1 + tl.cdiv(n1, BN)
                if tile >= p2:
                    w_ptr, out_ptr, N, first = w2, o2, n2, p2
    return w_ptr, out_ptr, N, first


@triton.jit
def gemv8_kernel(
    xq_ptr, dx_ptr, xs_ptr, w0, o0, n0, w1, o1, n1, w2, o2, n2, r_ptr, K, row_units,
    QT: tl.constexpr, UNIT: tl.constexpr, QUADS: tl.constexpr, BN: tl.constexpr, BU: tl.constexpr,
    NW: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr, ROW_WORDS: tl.constexpr, PDL: tl.constexpr,
    RES: tl.constexpr, LATE: tl.constexpr, STAGGER: tl.constexpr, SCATTER4: tl.constexpr,
):  # fmt: skip
    """One program: BN outputs of one quantized x row, BU blocks of UNIT weights a step (UNIT = 32
    for Q8_0, 256 for the K-quants; QUADS: partial sums a block).

    One launch serves NW (1-3) weights w0..w2 of one type and width that take the same x (q/k/v,
    gate/up), each with its output o and row count n: a decode step saves the launches, and the
    small projections share their waves of programs instead of each leaving the GPU part idle.

    Each step loads the next step's weights before computing on the current ones (Triton does not
    pipeline loads that feed no tl.dot into registers: with `num_stages` it stages them through
    shared memory, at half the speed on an H200), so two steps of codes are in flight; the last
    step, which loads nothing ahead, is taken after the loop. Partial sums stay in registers,
    [BN, BU * QUADS], and are reduced once after the loop: at Q4_K's and Q8_0's default shapes the
    loop moves no data between threads (a test compiles it to check). Out-of-range rows are
    clamped to the last one (and not stored). EVEN: the row's blocks fill whole steps (K a
    multiple of BU * UNIT, as in Llama-shaped models), so no load is masked; otherwise the last
    step's blocks past the row are not read (their weights and x load as 0). Rows are row_units *
    ROW_WORDS words apart, ROW_WORDS = 4 where rows are whole 16-byte units: Triton proves 16-byte
    vector loads only from what it can see, and it sees an integer argument's divisibility by 16
    at most (a Q6_K row of 4096 weights is 840 words: without the 4, every load took 4 bytes). PDL
    (launched as a programmatic dependent of the kernel that wrote x): the first step's weights are
    loaded before waiting for that kernel, so their latency hides in its tail; x and the output only
    after. It also lets its own successor launch at once: that kernel waits for it to finish before
    touching memory, and is resident when the last wave ends. RES (one weight): the output is
    r + x @ W.T, r [N] read at the store (a block's residual add, which took a kernel of its own).
    LATE: a step's block headers are loaded when it is computed instead of a step ahead with its
    codes. Each header shares a 32-byte sector with its block's first codes, which are in the L1 by
    then, so the load waits on the L1 only, and a thread holds about half the registers, so an SM
    holds twice the warps: what short rows (a few steps a program) need to keep enough loads in
    flight. STAGGER (with PDL): programs whose id is a multiple of it wait before loading their
    first step, so that some loads go out as the wait ends, while the programs that loaded ahead
    compute. SCATTER4 (compiled, 4 rows on 4 warps, one column of partial sums a thread): the sums
    end in `SCATTER4_ASM`'s reduce-scatter instead of tl.sum's all-reduce, which the interpreter
    cannot run.
    """
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    w_ptr, out_ptr, N, first = pick_weight(pid, w0, o0, n0, w1, o1, n1, w2, o2, n2, BN, NW)
    rn = (pid - first) * BN + tl.arange(0, BN)
    row_w = tl.minimum(rn, N - 1).to(tl.int64) * row_units * ROW_WORDS
    if PDL and STAGGER > 1:  # noqa: SIM102 (decided at compile time: unstaggered kernels carry no test)
        if pid % STAGGER == 0:
            gdc_wait()  # the wait after the loads below then returns at once
    acc = row_dots(QT, w_ptr, row_w, xq_ptr, dx_ptr, xs_ptr, K, UNIT, QUADS, BU, ASM, EVEN, LATE, PDL)
    if SCATTER4:  # thread c gets row c % 4's total from SCATTER4_ASM; threads 0-3 store the 4 rows
        c = tl.arange(0, BU * QUADS)
        rows = tl.arange(0, BN)[:, None]  # a column's 4 rows are in one thread: no shuffles here
        v0 = tl.sum(tl.where(rows == 0, acc, 0.0), axis=0)
        v1 = tl.sum(tl.where(rows == 1, acc, 0.0), axis=0)
        v2 = tl.sum(tl.where(rows == 2, acc, 0.0), axis=0)
        v3 = tl.sum(tl.where(rows == 3, acc, 0.0), axis=0)
        y = tl.inline_asm_elementwise(
            SCATTER4_ASM, "=f,f,f,f,f,r", [v0, v1, v2, v3, c], dtype=tl.float32, is_pure=False, pack=1
        )
        rn = (pid - first) * BN + c  # each thread's row from here on, stored by threads 0-3
        ok = (c < BN) & (rn < N)
    else:
        y = tl.sum(acc, axis=1)
        ok = rn < N
    if RES:
        y += tl.load(r_ptr + rn, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=ok)
