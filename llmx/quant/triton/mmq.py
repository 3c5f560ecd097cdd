"""Integer tensor-core GEMM on quantized weights for a batched decode step (tens of rows of x), as
llama.cpp's CUDA mmq does.

At 16-64 rows of x the integer-dot GEMVs' work grows with the rows (each takes its dp4a's one row at
a time), and "dequant" writes every weight as bf16 and reads it back for cuBLAS. Here x is quantized
to int8 per 32 values as for the GEMVs (`dot8.store_quantized`), and a program computes a BN x BM
tile of out.T: BN weight rows by BM rows of x. Per 32-weight group g of the rows it unpacks the
weight codes into an int8 [BN, 32] tile in registers and takes `tl.dot` with x's codes [32, BM], on
the int8 tensor cores: exact int32 sums, each scaled once by the group's float scales, as
    out[m, n] += dot[n, m] * a[n, g] * dx[m, g]  (- dmin[n] * min[n, g] * xsum[m, g] for Q4_K)
where a is the weights' scale of the group and dx x's. The weights are the dot's first operand,
so their rows fill the tensor cores' 64-row side and the codes made in registers feed them from
there; x, read as it is stored, is the second. The weights are read once for up to BM rows of x.

Types (rows in `layout.prepare`'s layout, as the integer-dot GEMVs read them):
    Q8_0: 32 code bytes a block, then the fp16 d's from byte K      a = d (a block a group)
    Q4_K: 144-byte super-blocks: 16-byte header, 128 nibble bytes   a = d * sc (per 32), mins
    Q6_K: 208-byte bodies ql[128], qh[64], scales[16]; then the d's a = d * sc (per 16: two dots a
          group, each on half of its codes, the other half zeroed)
A program walks K in steps of SU units (a Q8_0 block or a K-quant super-block); a step's units past
the row repeat the last one with its scales set to 0. Rows of W past N repeat row N - 1 and rows of
x past M repeat row M - 1; neither is stored. A decode step's launches hold few output tiles (a
Llama-3-8B o projection: 32 of 128 rows for an H100's 132 SMs), so K is split among several programs
a tile where they would leave SMs idle (`matmul.mmq_splits`), their sums joined in a fixed order.

Numerics: the integer sums are exact and every integer reaches float32 exactly (`bits.int_f32`),
so beyond float32 summation the one rounding is x's quantization, as in the integer-dot GEMVs.
"""

import triton
import triton.language as tl

from llmx.quant.triton.bits import code_f32, f16, half_f32, int_f32, lane
from llmx.quant.triton.dot8 import pick_weight
from llmx.quant.triton.kquants import paired_scale_min


@triton.jit
def _x_codes(xq_ptr, x_row, g):
    """[32, BM] int8: the codes of group g of x's rows starting at x_row [BM] (int64 offsets), as
    the dot's second operand (contiguous along its K axis, as the int8 tensor cores read it)."""
    return tl.load(xq_ptr + x_row[None, :] + g * 32 + tl.arange(0, 32)[:, None])


@triton.jit
def _dot(codes, xq_ptr, x_row, g):
    """[BN, BM] int32: weight codes [BN, 32] (int8) times x's codes of group g."""
    return tl.dot(codes, _x_codes(xq_ptr, x_row, g), out_dtype=tl.int32)


@triton.jit
def _x_scale(dx_ptr, x_m, g, K):
    """[1, BM]: the scale dx of group g of x's rows x_m [BM]."""
    return tl.load(dx_ptr + x_m * (K // 32) + g)[None, :]


@triton.jit
def _code_bytes(w_ptr, off):
    """[BN, 32] uint8: the 32 bytes from byte offsets `off` [BN] (16-byte aligned) of the weight's
    rows, two vector loads a row."""
    return tl.load(w_ptr + off[:, None] + tl.arange(0, 32)[None, :])


@triton.jit
def row_words(w_ptr, off):
    """[BN, 4] int32: the 16 bytes from byte offsets `off` [BN] (16-byte aligned) of the weight's
    rows, one vector load a row."""
    return tl.load((w_ptr + off[:, None]).to(tl.pointer_type(tl.int32)) + tl.arange(0, 4)[None, :])


@triton.jit
def _q8_0(acc, w_ptr, row, xq_ptr, x_row, x_m, dx_ptr, u, n_units, K):
    """acc [BN, BM] plus the products of Q8_0 block u of the rows at byte offsets `row` [BN]
    (int64), 0 past the row's n_units blocks."""
    blk = tl.minimum(u, n_units - 1)
    codes = _code_bytes(w_ptr, row + blk * 32).to(tl.int8, bitcast=True)
    d = tl.where(u < n_units, f16(w_ptr, row + K + 2 * blk), 0.0)[:, None]
    return acc + int_f32(_dot(codes, xq_ptr, x_row, blk)) * d * _x_scale(dx_ptr, x_m, blk, K)


@triton.jit
def _q4_k(acc, w_ptr, row, xq_ptr, x_row, x_m, dx_ptr, xs_ptr, u, n_units, K):
    """acc plus the products of Q4_K super-block u (`_q8_0`'s arguments; xs_ptr: x's sums per 16).
    Code bytes 32p..32p+31 hold sub-block 2p's weights in their low nibbles and 2p + 1's in their
    high ones: each pair is one load. A sub-block's integer dot times its scale, |dot * sc| <= 32 *
    15 * 127 * 63 < 2**22, reaches float32 by `int_f32`. The mins, sum_j dmin m_j (x's sum over
    sub-block j), are one product over the block's 16 sums of x per 16 (`store_quantized`'s), on the
    tensor cores in three tf32 parts (float32's precision): loaded as a dot operand, those sums are
    staged through shared memory with x's codes, where loading each sub-block's for every column of
    the tile took more load instructions than the rest of the step."""
    blk = tl.minimum(u, n_units - 1)
    base = row + blk * 144
    hdr = row_words(w_ptr, base)  # d, dmin, then the scales by pair (`layout.prepare_q4_k_scales`)
    live = u < n_units
    d = tl.where(live, half_f32(lane(hdr, 0), False), 0.0)
    dmin = tl.where(live, half_f32(lane(hdr, 0), True), 0.0)
    for p in tl.static_range(4):
        lows = lane(hdr, 1 + p // 2) >> (16 * (p % 2))
        highs = (lane(hdr, 3) >> (8 * p)) << 4
        codes = _code_bytes(w_ptr, base + 16 + 32 * p)
        for odd in tl.static_range(2):
            sc, _ = paired_scale_min(lows, highs, odd)
            g = blk * 8 + 2 * p + odd
            dot = _dot(((codes >> (4 * odd)) & 15).to(tl.int8), xq_ptr, x_row, g)
            acc += int_f32(dot * sc) * d * _x_scale(dx_ptr, x_m, g, K)
    j = tl.arange(0, 16)[None, :] // 2  # the sub-block of each 16 weights
    pair = j // 2
    lows = tl.where(pair < 2, lane(hdr, 1), lane(hdr, 2)) >> (16 * (pair % 2))
    _, mn = paired_scale_min(lows, (lane(hdr, 3) >> (8 * pair)) << 4, j % 2)
    xs = tl.load(xs_ptr + x_m[None, :] * (K // 16) + blk * 16 + tl.arange(0, 16)[:, None])  # [16, BM]
    return tl.dot(-dmin * code_f32(mn, 0), xs, acc, input_precision="tf32x3")


@triton.jit
def _q6_k(acc, w_ptr, row, xq_ptr, x_row, x_m, dx_ptr, u, n_units, K):
    """acc plus the products of Q6_K super-block u (`_q8_0`'s arguments). Per half h of 128 weights,
    group j (0-3) takes the low (j < 2) or high nibbles of ql bytes 64h + 32 (j % 2) + l and bits
    2j, 2j + 1 of qh byte 32h + l, l = 0..31; scales[i] is that of weights 16i..16i+15. The codes,
    q - 32, are int8; a half's |dot| <= 16 * 32 * 127 reaches float32 by `int_f32`, but times its
    scale may not: the scales are applied in float32."""
    blk = tl.minimum(u, n_units - 1)
    base = row + blk * 208
    d = tl.where(u < n_units, f16(w_ptr, row + n_units * 208 + 2 * blk), 0.0)[:, None]
    scales = row_words(w_ptr, base + 192)
    first = tl.arange(0, 32)[None, :] < 16  # a group's first 16 codes
    for h in tl.static_range(2):
        qh = _code_bytes(w_ptr, base + 128 + 32 * h)
        for c in tl.static_range(2):
            ql = _code_bytes(w_ptr, base + 64 * h + 32 * c)
            for high in tl.static_range(2):
                j = c + 2 * high
                q = (((ql >> (4 * high)) & 15) | (((qh >> (2 * j)) & 3) << 4)).to(tl.int8) - 32
                g = blk * 8 + 4 * h + j
                i = 8 * h + 2 * j  # the scale of the group's first 16 weights; i + 1: its last 16
                sc_a = (lane(scales, i // 4) << (24 - 8 * (i % 4))) >> 24  # the int8 scale
                sc_b = (lane(scales, i // 4) << (16 - 8 * (i % 4))) >> 24
                dot_a = _dot(tl.where(first, q, 0).to(tl.int8), xq_ptr, x_row, g)
                dot_b = _dot(tl.where(first, 0, q).to(tl.int8), xq_ptr, x_row, g)
                part = int_f32(dot_a) * (d * int_f32(sc_a)) + int_f32(dot_b) * (d * int_f32(sc_b))
                acc += part * _x_scale(dx_ptr, x_m, g, K)
    return acc


@triton.jit
def mmq_kernel(
    xq_ptr, dx_ptr, xs_ptr, w0, o0, n0, w1, o1, n1, w2, o2, n2, r_ptr, part_ptr, count_ptr, M, K, row_bytes,
    m_tiles, splits, split_steps,
    QT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SU: tl.constexpr, NW: tl.constexpr,
    RES: tl.constexpr,
):  # fmt: skip
    """One program: outputs of BN weight rows for BM rows of x [M, K] quantized (xq, dx, xs:
    `dot8.store_quantized`'s buffers), SU units (Q8_0 blocks, K-quant super-blocks) a step. Outputs
    are [M, N_i] row-major; rows of W are `row_bytes` apart.

    NW (1-3) weights of one type and width that take the same x (q/k/v, gate/up) share the launch,
    as in `dot8.gemv8_kernel` (`pick_weight`); more rows than BM are taken by neighbouring programs
    (program p: weight tile p // (m_tiles * splits), rows (p % m_tiles) * BM on), so the programs
    that read one weight tile run at about the same time and all but one find it in the L2. RES:
    r [M, N] added at the store.

    Split over K: with `splits` > 1 each output tile's K is cut into `splits` ranges of `split_steps`
    steps, one program each (program p: range (p // m_tiles) % splits), so that a launch of few tiles
    still fills the GPU; `finish_tile` joins them."""
    split, out_tile, w_ptr, out_ptr, N, rn, row, rm, x_m = program_tile(
        m_tiles, splits, w0, o0, n0, w1, o1, n1, w2, o2, n2, M, row_bytes, BN, BM, NW
    )
    x_row = x_m * K
    n_units = K // 32 if QT == "Q8_0" else K // 256
    acc = tl.zeros([BN, BM], tl.float32)
    u_first = split * split_steps * SU
    for u0 in range(u_first, tl.minimum(n_units, u_first + split_steps * SU), SU):
        for s in tl.static_range(SU):
            if QT == "Q8_0":
                acc = _q8_0(acc, w_ptr, row, xq_ptr, x_row, x_m, dx_ptr, u0 + s, n_units, K)
            elif QT == "Q4_K":
                acc = _q4_k(acc, w_ptr, row, xq_ptr, x_row, x_m, dx_ptr, xs_ptr, u0 + s, n_units, K)
            else:
                tl.static_assert(QT == "Q6_K", "no integer tensor-core GEMM for this GGML type")
                acc = _q6_k(acc, w_ptr, row, xq_ptr, x_row, x_m, dx_ptr, u0 + s, n_units, K)
    finish_tile(acc, rn, rm, N, M, split, splits, out_tile, part_ptr, count_ptr, out_ptr, r_ptr, RES)


@triton.jit
def program_tile(
    m_tiles, splits, w0, o0, n0, w1, o1, n1, w2, o2, n2, M, row_bytes,
    BN: tl.constexpr, BM: tl.constexpr, NW: tl.constexpr,
):  # fmt: skip
    """What this program of a tensor-core GEMM launch computes, in `mmq_kernel`'s order of programs:
    its range of K (split), its output tile (for `finish_tile`), its weight's rows, output and row
    count (`pick_weight`), the indices rn [BN] of its weight rows and their byte offsets (rows past N
    repeat row N - 1), the indices rm [BM] of its rows of x and those clamped to M - 1."""
    pid = tl.program_id(0)
    split = (pid // m_tiles) % splits
    tile = pid // (m_tiles * splits)
    w_ptr, out_ptr, N, first = pick_weight(tile, w0, o0, n0, w1, o1, n1, w2, o2, n2, BN, NW)
    rn = (tile - first) * BN + tl.arange(0, BN)
    row = tl.minimum(rn, N - 1).to(tl.int64) * row_bytes
    rm = (pid % m_tiles) * BM + tl.arange(0, BM)
    return split, tile * m_tiles + pid % m_tiles, w_ptr, out_ptr, N, rn, row, rm, tl.minimum(rm, M - 1)


@triton.jit
def finish_tile(
    acc, rn, rm, N, M, split, splits, out_tile, part_ptr, count_ptr, out_ptr, r_ptr, RES: tl.constexpr
):
    """Stores output tile `out_tile`'s sums acc [BN, BM] of weight rows rn by rows of x rm (those
    below N and M), or with `splits` > 1 K-range `split`'s share of them: each range writes its
    float32 sums to `part_ptr` (splits x BN x BM a tile) and counts itself in the tile's `count_ptr`
    word; the last to arrive adds the ranges' sums in the order of K (the same result whichever
    program ends last), stores the output and sets the count back to 0 for the next launch."""
    ok = (rn < N)[:, None] & (rm < M)[None, :]
    off = rm.to(tl.int64)[None, :] * N + rn[:, None]
    if splits > 1:
        BN: tl.constexpr = acc.shape[0]
        BM: tl.constexpr = acc.shape[1]
        local = tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]
        parts = part_ptr + out_tile.to(tl.int64) * splits * BN * BM + local
        tl.store(parts + split * BN * BM, acc)
        # every thread's sums are stored before the count (the barrier), and visible to the program
        # that counts last (acq_rel)
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + out_tile, 1, sem="acq_rel") == splits - 1:
            acc = tl.zeros([BN, BM], tl.float32)
            for s in range(0, splits):
                acc += tl.load(parts + s * BN * BM, cache_modifier=".cg")
            tl.store(count_ptr + out_tile, 0)
            _store(acc, out_ptr, r_ptr, off, ok, RES)
    else:
        _store(acc, out_ptr, r_ptr, off, ok, RES)


@triton.jit
def _store(acc, out_ptr, r_ptr, off, ok, RES: tl.constexpr):
    """acc [BN, BM] stored at `off` where `ok`, in out's dtype, plus r's values there where RES."""
    if RES:
        acc += tl.load(r_ptr + off, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=ok)
