"""GEMV, GEMM and dequantize kernels over raw GGUF rows, written once for every type.

`unpack` picks the type's helper at compile time (QT is a constexpr type name), so each kernel
is compiled per type and holds no branches at run time. Shapes, for weight W [N, K] stored as
raw uint8 rows of `swn` bytes (whole blocks; K a multiple of the group size G):
    gemv_kernel:     out[M, N] = x[M, K] @ W.T, M <= BM <= 8, fp32 FMA (memory-bound decode)
    gemm_kernel:     out[M, N] = x[M, K] @ W.T, tiles dequantized into registers for tl.dot
    dequant_kernel:  out[R, K] = W[ids[R], :]  (embedding rows), or W[row0:row0+R, :]
    half_rows_kernel: x [M, K] float32 -> fp16 x / s and s [M] = max |x| of each row
Their steps (`group_dot`, `weight_tile`, `grouped_tile`) serve the grouped expert kernels
(`moe_kernels.py`) too.
Out-of-range rows and groups are clamped to valid ones instead of masked in the helpers: their
x is masked to 0 (GEMV, GEMM) or their store is masked (dequantize), so they never count.
"""

import triton
import triton.language as tl

from llmx.quant.triton import iq, kquants, legacy


@triton.jit
def unpack(
    QT: tl.constexpr, w_ptr, row_off, sb, K, PACKED: tl.constexpr, lut_ptr, WORDS: tl.constexpr = False
):
    """Codes q [R, S, G] and per-group a, b [R, S] (weight = a*q + b) of type QT; see legacy.py.
    WORDS: the 2- and 3-bit K-quants and Q6_K take their codes apart 4 at a time (`bits.code_bytes`)."""
    if QT == "Q4_0":
        q, a, b = legacy.q4_0(w_ptr, row_off, sb, K, PACKED)
    elif QT == "Q4_1":
        q, a, b = legacy.q4_1(w_ptr, row_off, sb, K, PACKED)
    elif QT == "Q5_0":
        q, a, b = legacy.q5_0(w_ptr, row_off, sb, K, PACKED)
    elif QT == "Q5_1":
        q, a, b = legacy.q5_1(w_ptr, row_off, sb, K, PACKED)
    elif QT == "Q8_0":
        q, a, b = legacy.q8_0(w_ptr, row_off, sb, K, PACKED)
    elif QT == "Q2_K":
        q, a, b = kquants.q2_k(w_ptr, row_off, sb, K, PACKED, WORDS)
    elif QT == "Q3_K":
        q, a, b = kquants.q3_k(w_ptr, row_off, sb, K, PACKED, WORDS)
    elif QT == "Q4_K":
        q, a, b = kquants.q4_k(w_ptr, row_off, sb, PACKED)
    elif QT == "Q5_K":
        q, a, b = kquants.q5_k(w_ptr, row_off, sb)
    elif QT == "Q6_K":
        q, a, b = kquants.q6_k(w_ptr, row_off, sb, K, PACKED, WORDS)
    elif QT == "IQ4_NL":
        q, a, b = iq.iq4_nl(w_ptr, row_off, sb, K, PACKED, lut_ptr)
    else:
        tl.static_assert(QT == "IQ4_XS", "no Triton unpack helper for this GGML type")
        q, a, b = iq.iq4_xs(w_ptr, row_off, sb, lut_ptr)
    return q, a, b


@triton.jit
def _row_offsets(rows, N, swn):
    """[R, 1] int64 byte offsets of weight rows, out-of-range rows clamped to the last one."""
    return tl.minimum(rows, N - 1).to(tl.int64)[:, None] * swn


@triton.jit
def group_dot(q, a, b, x):
    """[R, S] dot products of weight groups (codes q [R, S, G], weight = a*q + b per group) with x
    [S, G]: the codes' sum times a, plus b times x's sum (one FMA a weight, as llama.cpp's mmvq)."""
    return a * tl.sum(q * x[None, :, :], axis=2) + b * tl.sum(x, axis=1)[None, :]


@triton.jit
def weight_tile(QT: tl.constexpr, w_ptr, row_off, k0, K, PACKED: tl.constexpr, lut_ptr, G: tl.constexpr,
                BK: tl.constexpr):  # fmt: skip
    """[R, BK] float32 weights k0..k0+BK of the rows at `row_off` [R, 1], dequantized (columns past
    K read a valid group: their x must be 0)."""
    sb = k0 // G + tl.arange(0, BK // G)
    q, a, b = unpack(QT, w_ptr, row_off, tl.minimum(sb, K // G - 1)[None, :], K, PACKED, lut_ptr)
    return tl.reshape(a[:, :, None] * q + b[:, :, None], (row_off.shape[0], BK))


@triton.jit
def grouped_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(tile row, tile column) of program `pid`: programs walk GROUP_M tiles down M before moving
    along N, so the weight tiles a group shares are still in L2 (the weight is read from HBM about
    once)."""
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, lut_ptr, out_ptr, M, N, K, sxm, swn, som,
    QT: tl.constexpr, PACKED: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):  # fmt: skip
    """One program: BN output rows for all M (<= BM) inputs, walking K in BK steps.

    Each group's dot product sum_l q_l x_l is taken on the codes, then scaled once by a and
    offset by b * sum_l x_l (llama.cpp's mmvq does the same), so the per-weight work is one
    unpack and one FMA per input row. Input rows are a static loop, not a tensor dimension: a
    [BM, BN, S, G] product would need its operands re-laid out through shared memory.
    """
    S: tl.constexpr = BK // G
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    row_off = _row_offsets(rn, N, swn)
    rm = tl.arange(0, BM)[:, None]
    n_groups = K // G
    acc = tl.zeros([BM, BN], tl.float32)
    acc1 = tl.zeros([BN, S], tl.float32)  # M = 1 sums per group, reduced once after the loop
    for k0 in range(0, K, BK):
        sb = k0 // G + tl.arange(0, S)
        q, a, b = unpack(QT, w_ptr, row_off, tl.minimum(sb, n_groups - 1)[None, :], K, PACKED, lut_ptr)
        x_off = sb[:, None] * G + tl.arange(0, G)[None, :]  # [S, G]
        for m in tl.static_range(BM):
            x_ok = (sb < n_groups)[:, None] & (tl.full([1, 1], m, tl.int32) < M)
            x = tl.load(x_ptr + m * sxm + x_off, mask=x_ok, other=0.0).to(tl.float32)
            part = group_dot(q, a, b, x)
            if BM == 1:
                acc1 += part
            else:
                acc += tl.where(rm == m, tl.sum(part, axis=1)[None, :], 0.0)
    if BM == 1:
        acc = tl.sum(acc1, axis=1)[None, :]
    o_ptr = out_ptr + rm * som + rn[None, :]
    tl.store(o_ptr, acc.to(out_ptr.dtype.element_ty), mask=(rm < M) & (rn[None, :] < N))


@triton.jit
def gemm_kernel(
    x_ptr, w_ptr, lut_ptr, out_ptr, M, N, K, sxm, swn, som, M_BUCKET,
    QT: tl.constexpr, PACKED: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One program: a BM x BN output tile. Weight tiles are dequantized to x's dtype for tl.dot.

    Programs are ordered by `grouped_tile`. M_BUCKET only keys autotuning.
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    row_off = _row_offsets(rn, N, swn)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(
            x_ptr + rm[:, None] * sxm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0
        )
        w = weight_tile(QT, w_ptr, row_off, k0, K, PACKED, lut_ptr, G, BK).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc)
    o_ptr = out_ptr + rm[:, None] * som + rn[None, :]
    tl.store(o_ptr, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def dequant_kernel(
    w_ptr, lut_ptr, ids_ptr, row0, out_ptr, R, N, K, swn, so,
    QT: tl.constexpr, PACKED: tl.constexpr, G: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
    BY_ID: tl.constexpr,
):  # fmt: skip
    """One program: BR selected rows x BK weights. Bit-exact with gguf-py when out is float32.
    Rows are ids[0..R) when BY_ID, else row0..row0+R (a block of rows: no index tensor to make)."""
    S: tl.constexpr = BK // G
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    ids = tl.load(ids_ptr + tl.minimum(r, R - 1)) if BY_ID else row0 + r
    row_off = _row_offsets(ids, N, swn)
    n_groups = K // G
    sb = tl.program_id(1) * S + tl.arange(0, S)
    # codes by words: nothing here sums across a group, so their bytes may sit on any lane
    q, a, b = unpack(QT, w_ptr, row_off, tl.minimum(sb, n_groups - 1)[None, :], K, PACKED, lut_ptr, True)
    w = a[:, :, None] * q + b[:, :, None]
    k = sb[None, :, None] * G + tl.arange(0, G)[None, None, :]
    r3 = r[:, None, None]
    mask = (r3 < R) & (k < K)
    tl.store(out_ptr + r3.to(tl.int64) * so + k, w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def half_rows_kernel(x_ptr, out_ptr, scale_ptr, K, sxm, BK: tl.constexpr):
    """One program: row program_id(0) of x scaled into [-1, 1] and rounded to fp16, and its scale.

    Two passes over the row (max, then scale), the second from L2. An all-zero row gets scale 1.
    """
    m = tl.program_id(0)
    amax = tl.zeros([BK], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + m * sxm + k, mask=k < K, other=0.0)))
    top = tl.max(amax, axis=0)
    scale = tl.where(top > 0, top, 1.0)
    tl.store(scale_ptr + m, scale)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + m * sxm + k, mask=k < K, other=0.0)
        tl.store(out_ptr + m * K + k, (x / scale).to(tl.float16), mask=k < K)
