"""Half-precision tensor-core GEMM on quantized weights for a batched decode step (tens of rows of x):
each weight block dequantized to f16 in registers, its scales folded in as it is made, then `tl.dot`
with x scaled into f16 rows (`activation.half_rows`), float32 sums.

"mmq" takes the int8 tensor cores a 32-weight group at a time and scales every [BN, BM] group result
in float32: that work grows with the rows of x (a Llama-3-8B FFN matrix in Q4_K at 64 rows: 135-160 us
on an H100, where this kernel takes 58-62, bench/RESULTS.md). Here a
weight costs about two instructions to dequantize whatever the rows (on a GPU four codes at a time by
inline PTX: bytes placed under f16's exponent of 1024, the offset subtracted, the group's scale and
minimum applied as f16x2), and a step's 256 weights a row meet x in two dots of K = 128 with nothing
after them. A program computes a BN x BM tile of out.T: BN weight rows (the dot's first operand, which
fills the tensor cores' 64-row side) by BM rows of x.

Types (rows in `layout.prepare`'s layout, as the integer-dot kernels read them):
    Q4_K: 144-byte super-blocks: 16-byte header, 128 nibble bytes   w = d*sc*q - dmin*m (per 32)
    Q6_K: 208-byte bodies ql[128], qh[64], scales[16]; then the d's w = d*sc*(q - 32)   (per 16)
    Q8_0: 32 code bytes a block, then the fp16 d's from byte K       w = d*q             (per 32)
A step is 256 weights of a row (a K-quant super-block, eight Q8_0 blocks; Q8_0 blocks past the row
repeat its last one with scale 0). The weights of a dot are taken in whatever order their bytes hold
them, and x's values gathered in the same order. Rows of W past N repeat row N - 1 and rows of x past
M repeat row M - 1; neither is stored. K is split among programs as in "mmq" (`mmq.finish_tile`).

Numerics: a weight is rounded to f16 once (Q4_K: its scale d*sc and its minimum dmin*m each rounded to
f16 first, Q6_K and Q8_0 their scale), x to f16 after its row's scaling into [-1, 1]; products and
sums in float32. The interpreter, which cannot run PTX, takes float32 for the same steps.
"""

import triton
import triton.language as tl

from llmx.quant.triton.bits import code_f32, f16, half_f32, lane, nibbles_times_f16, q8_times_f16
from llmx.quant.triton.kquants import paired_scale_min
from llmx.quant.triton.mmq import finish_tile, program_tile, row_words

# Four Q6_K codes from their ql bytes (4 bits from shift $4) and qh bytes (2 bits from shift $5),
# minus 32, times their f16 scales -> two f16x2 words: the 6-bit codes joined a word at a time, placed
# under f16's 1024 and 1056 subtracted (code - 32, exactly), then the scale multiplied, rounded once.
Q6_F16_ASM: tl.constexpr = tl.constexpr("""{
.reg .b32 s, w, v, lo, hi, k;
and.b32 s, $4, 0xff;
shr.b32 w, $2, s;
and.b32 w, w, 0x0f0f0f0f;
and.b32 s, $5, 0xff;
shr.b32 v, $3, s;
and.b32 v, v, 0x03030303;
shl.b32 v, v, 4;
or.b32 w, w, v;
prmt.b32 lo, w, 0x64646464, 0x4140;
prmt.b32 hi, w, 0x64646464, 0x4342;
mov.b32 k, 0x64206420;
sub.f16x2 lo, lo, k;
sub.f16x2 hi, hi, k;
mul.rn.f16x2 $0, lo, $6;
mul.rn.f16x2 $1, hi, $7;
}""")


@triton.jit
def _nibbles_f16(codes, shift: tl.constexpr, a, b, ASM: tl.constexpr):
    """f16 (code * a + b) for the nibbles at `shift` of the uint8 `codes`; a, b float32, broadcast
    to the codes' shape (each rounded to f16 first)."""
    a, b = tl.broadcast_to(a.to(tl.float16), codes.shape), tl.broadcast_to(b.to(tl.float16), codes.shape)
    if ASM:
        w = nibbles_times_f16(codes, tl.full(codes.shape, shift, tl.uint8), a, b)
    else:
        q = code_f32((codes.to(tl.int32) >> shift) & 15, 0)
        w = (q * a.to(tl.float32) + b.to(tl.float32)).to(tl.float16)
    return w


@triton.jit
def _q6_f16(ql, qh, QL_SHIFT: tl.constexpr, QH_SHIFT: tl.constexpr, a, ASM: tl.constexpr):
    """f16 (code - 32) * a for the Q6_K codes whose low 4 bits are ql's at QL_SHIFT and high 2 bits
    qh's at QH_SHIFT (uint8, one shape); a float32 (rounded to f16 first), broadcast to it. The PTX
    takes one shift for its four codes: constant over the tile, whatever codes the compiler packs."""
    a = tl.broadcast_to(a.to(tl.float16), ql.shape)
    if ASM:
        low, high = tl.full(ql.shape, QL_SHIFT, tl.uint8), tl.full(ql.shape, QH_SHIFT, tl.uint8)
        w = tl.inline_asm_elementwise(
            Q6_F16_ASM, "=r,=r,r,r,r,r,r,r", [ql, qh, low, high, a], dtype=tl.float16, is_pure=True, pack=4
        )
    else:
        q = ((ql.to(tl.int32) >> QL_SHIFT) & 15) | (((qh.to(tl.int32) >> QH_SHIFT) & 3) << 4)
        w = (code_f32(q, 32) * a.to(tl.float32)).to(tl.float16)
    return w


@triton.jit
def _times(acc, scale, ASM: tl.constexpr):
    """acc * scale rounded once on its own: the GPU's compiler would otherwise fuse it with the
    residual's add at the store into one multiply-add, whose rounding differs from the sum of the
    output and the residual that the kernels' residual contract gives."""
    if ASM:
        scale = tl.broadcast_to(scale, acc.shape)
        acc = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [acc, scale], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        acc = acc * scale
    return acc


@triton.jit
def _x_tile(xh_ptr, x_row, k):
    """[len(k), BM] f16: x's values at columns k (int64 [n]) of its rows starting at x_row [BM]."""
    return tl.load(xh_ptr + x_row[None, :] + k[:, None])


@triton.jit
def _q4_k(acc, w_ptr, row, xh_ptr, x_row, u, ASM: tl.constexpr):
    """acc [BN, BM] plus the products of Q4_K super-block u of the rows at byte offsets `row` [BN].
    Code bytes 32p + l hold weight l of sub-block 2p in their low nibbles and of 2p + 1 in their high
    ones: one dot takes every low nibble (x's columns 64p + l), one every high nibble (64p + 32 + l)."""
    BN: tl.constexpr = row.shape[0]
    base = row + u * 144
    hdr = row_words(w_ptr, base)  # d, dmin, then the scales by pair (`layout.prepare_q4_k_scales`)
    d = half_f32(lane(hdr, 0), False)  # [BN, 1]
    dmin = half_f32(lane(hdr, 0), True)
    p = tl.arange(0, 4)[None, :]  # sub-block pairs
    lows = tl.where(p < 2, lane(hdr, 1), lane(hdr, 2)) >> (16 * (p % 2))
    highs = (lane(hdr, 3) >> (8 * p)) << 4
    byte = 32 * tl.arange(0, 4)[:, None] + tl.arange(0, 32)[None, :]  # [4, 32]
    codes = tl.load(w_ptr + base[:, None, None] + 16 + byte[None, :, :])  # [BN, 4, 32]
    i = tl.arange(0, 128)
    for odd in tl.static_range(2):
        sc, mn = paired_scale_min(lows, highs, odd)
        a = (d * code_f32(sc, 0))[:, :, None]
        b = (-(dmin * code_f32(mn, 0)))[:, :, None]
        w = tl.reshape(_nibbles_f16(codes, 4 * odd, a, b, ASM), (BN, 128))
        acc = tl.dot(w, _x_tile(xh_ptr, x_row, u * 256 + i + 32 * (i // 32) + 32 * odd), acc)
    return acc


@triton.jit
def _q6_k(acc, w_ptr, row, xh_ptr, x_row, u, n_units, ASM: tl.constexpr):
    """acc plus the products of Q6_K super-block u (`_q4_k`'s arguments; n_units: the row's
    super-blocks). Weight 128h + 32j + 16g + t takes the nibble j // 2 of ql byte 64h + 32 (j % 2) +
    16g + t, bits 2j, 2j + 1 of qh byte 32h + 16g + t, and scale 8h + 2j + g: one dot of K = 64 for
    each j, over the tile [h, g, t], whose shifts are the same for all its codes."""
    BN: tl.constexpr = row.shape[0]
    base = (row + u * 208)[:, None, None, None]
    d = f16(w_ptr, row + n_units * 208 + 2 * u)[:, None, None, None]
    h = tl.arange(0, 2)[None, :, None, None]
    g = tl.arange(0, 2)[None, None, :, None]
    t = tl.arange(0, 16)[None, None, None, :]
    qh = tl.load(w_ptr + base + 128 + 32 * h + 16 * g + t)  # [BN, 2, 2, 16]
    i = tl.arange(0, 64)
    for j in tl.static_range(4):
        ql = tl.load(w_ptr + base + 64 * h + 32 * (j % 2) + 16 * g + t)  # read twice: the second from L1
        sc = tl.load((w_ptr + base + 192 + 8 * h + 2 * j + g).to(tl.pointer_type(tl.int8)))  # [BN, 2, 2, 1]
        w = tl.reshape(_q6_f16(ql, qh, 4 * (j // 2), 2 * j, d * sc.to(tl.float32), ASM), (BN, 64))
        acc = tl.dot(w, _x_tile(xh_ptr, x_row, u * 256 + i + 96 * (i // 32) + 32 * j), acc)
    return acc


@triton.jit
def _q8_0(acc, w_ptr, row, xh_ptr, x_row, s, n_units, K, ASM: tl.constexpr):
    """acc plus the products of Q8_0 blocks 8s..8s+7 of the rows (`_q4_k`'s arguments; n_units: the
    row's blocks), two dots of four blocks; blocks past the row take its last one's codes, scale 0."""
    BN: tl.constexpr = row.shape[0]
    l = tl.arange(0, 32)[None, None, :]
    i = tl.arange(0, 128)
    for half in tl.static_range(2):
        blk = 8 * s + 4 * half + tl.arange(0, 4)[None, :]  # [1, 4]
        last = tl.minimum(blk, n_units - 1)
        d = tl.where(blk < n_units, f16(w_ptr, row[:, None] + K + 2 * last), 0.0)  # [BN, 4]
        codes = tl.load((w_ptr + row[:, None, None] + 32 * last[:, :, None] + l).to(tl.pointer_type(tl.int8)))
        if ASM:
            w = q8_times_f16(codes, d[:, :, None].to(tl.float16))
        else:
            w = (codes.to(tl.float32) * d.to(tl.float16).to(tl.float32)[:, :, None]).to(tl.float16)
        k = tl.minimum(32 * (8 * s + 4 * half) + i, K - 1)
        acc = tl.dot(tl.reshape(w, (BN, 128)), _x_tile(xh_ptr, x_row, k), acc)
    return acc


@triton.jit
def mmh_kernel(
    xh_ptr, xs_ptr, w0, o0, n0, w1, o1, n1, w2, o2, n2, r_ptr, part_ptr, count_ptr, M, K, row_bytes,
    m_tiles, splits, split_steps,
    QT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NW: tl.constexpr, RES: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """One program: outputs of BN weight rows for BM rows of x [M, K] given as f16 rows xh scaled
    into [-1, 1] and their float32 scales xs [M] (`half_rows`), 256 weights a row a step. Outputs are
    [M, N_i] row-major; rows of W are `row_bytes` apart. NW, RES, the programs' order and the split
    over K (`splits` ranges of `split_steps` steps) as in `mmq.mmq_kernel`."""
    split, out_tile, w_ptr, out_ptr, N, rn, row, rm, x_m = program_tile(
        m_tiles, splits, w0, o0, n0, w1, o1, n1, w2, o2, n2, M, row_bytes, BN, BM, NW
    )
    x_row = x_m.to(tl.int64) * K
    n_units = K // 32 if QT == "Q8_0" else K // 256
    steps = tl.cdiv(K, 256)
    acc = tl.zeros([BN, BM], tl.float32)
    for s in range(split * split_steps, tl.minimum(steps, (split + 1) * split_steps)):
        if QT == "Q4_K":
            acc = _q4_k(acc, w_ptr, row, xh_ptr, x_row, s, ASM)
        elif QT == "Q6_K":
            acc = _q6_k(acc, w_ptr, row, xh_ptr, x_row, s, n_units, ASM)
        else:
            tl.static_assert(QT == "Q8_0", "no half-precision tensor-core GEMM for this GGML type")
            acc = _q8_0(acc, w_ptr, row, xh_ptr, x_row, s, n_units, K, ASM)
    acc = _times(acc, tl.load(xs_ptr + x_m)[None, :], ASM)
    finish_tile(acc, rn, rm, N, M, split, splits, out_tile, part_ptr, count_ptr, out_ptr, r_ptr, RES)
