"""Grouped GEMV and GEMM over stacked expert weights in raw GGUF rows (the launches are `moe.py`).

A stacked expert tensor W [E, N, K] is E * N raw rows of `swn` bytes, expert e's rows from e * N
on. A (token, slot) pair p = t * k + j of a routing with k slots a token multiplies x row p // x_div
(x_div = k: every slot of a token takes the token's x; 1: each pair its own row) by the expert
ids[p]. Both kernels decode blocks with `kernels`' per-type steps, so they take every type those
unpack, and both may multiply two weights at once (GATED: out = silu(x @ W.T) * (x @ W2.T), the
gate and up projections of a SwiGLU expert, ik_llama.cpp's -fmoe), whose types may differ.

    moe_gemv_kernel: grid (N / BN, pairs), or (N / BN, tokens) with SUM: one program, BN outputs of
                     one pair, or of one token summed over its k slots weighted by topw (the down
                     projection's weighted sum, with no [T, k, N] buffer and no atomics), plus the
                     token's residual row with RES (the layer's residual add, in the same launch)
    moe_gemv8_kernel: `moe_gemv_kernel` on integer dot products (`dot8`): x quantized per 32 values,
                     the weights' words met in dp4a, for the types `dot8` reads (Q4_K, Q6_K, Q8_0) in
                     `layout.prepare`'s layout
    moe_gemm_kernel: grid (blocks * N / BN): one program, a BM x BN tile of one block of `moe.Route`'s
                     pairs sorted by expert (all of one expert); its rows are scattered to out[pair],
                     times topw[pair] with SCALE
Expert ids are read on the device: no host sync, and launches that a CUDA graph can capture.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llmx.quant.triton.dot8 import dot_step, load_step, row_dots
from llmx.quant.triton.kernels import group_dot, grouped_tile, unpack, weight_tile


@triton.jit
def _expert_rows(e, rn, N, swn):
    """[BN, 1] int64 byte offsets of rows rn of expert e (rows past N clamped to the last one)."""
    return (e.to(tl.int64) * N + tl.minimum(rn, N - 1))[:, None] * swn


@triton.jit
def _gemv_step(QT: tl.constexpr, w_ptr, row_off, lut_ptr, x_ptr, k0, K, PACKED: tl.constexpr, G: tl.constexpr,
               BK: tl.constexpr):  # fmt: skip
    """[BN, BK / G] partial dot products of the rows at `row_off` with x's weights k0..k0+BK."""
    n_groups = K // G
    sb = k0 // G + tl.arange(0, BK // G)
    q, a, b = unpack(QT, w_ptr, row_off, tl.minimum(sb, n_groups - 1)[None, :], K, PACKED, lut_ptr)
    x_off = sb[:, None] * G + tl.arange(0, G)[None, :]
    x = tl.load(x_ptr + x_off, mask=(sb < n_groups)[:, None], other=0.0).to(tl.float32)
    return group_dot(q, a, b, x)


@triton.jit
def moe_gemv_kernel(
    x_ptr, w_ptr, w2_ptr, lut_ptr, ids_ptr, topw_ptr, res_ptr, out_ptr, N, K, E, SLOTS, x_div, sxm, swn, swn2,
    som, QT: tl.constexpr, QT2: tl.constexpr, PACKED: tl.constexpr, PACKED2: tl.constexpr, G: tl.constexpr,
    G2: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr, SUM: tl.constexpr,
    RES: tl.constexpr,
):  # fmt: skip
    """One program: BN outputs of pair program_id(1), or with SUM of token program_id(1) over its
    SLOTS pairs. Per-group sums stay [BN, BK / G] until the end of a pair, as in `gemv_kernel`."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    row = tl.program_id(1)
    first, count = row, 1
    if SUM:
        first, count = row * SLOTS, SLOTS
    y = tl.zeros([BN], tl.float32)
    y2 = tl.zeros([BN], tl.float32)
    for j in range(count):
        pair = first + j
        # clamped: an id out of range reads a wrong expert rather than past the tensor
        e = tl.minimum(tl.maximum(tl.load(ids_ptr + pair), 0), E - 1)
        x_row = x_ptr + (pair // x_div).to(tl.int64) * sxm
        row_off = _expert_rows(e, rn, N, swn)
        row_off2 = _expert_rows(e, rn, N, swn2)
        acc = tl.zeros([BN, BK // G], tl.float32)
        acc2 = tl.zeros([BN, BK // G2], tl.float32)
        for k0 in range(0, K, BK):  # gate and up in one loop: both rows' loads in flight at once
            acc += _gemv_step(QT, w_ptr, row_off, lut_ptr, x_row, k0, K, PACKED, G, BK)
            if GATED:
                acc2 += _gemv_step(QT2, w2_ptr, row_off2, lut_ptr, x_row, k0, K, PACKED2, G2, BK)
        if SUM:
            y += tl.load(topw_ptr + pair).to(tl.float32) * tl.sum(acc, axis=1)
        else:
            y += tl.sum(acc, axis=1)
        if GATED:
            y2 += tl.sum(acc2, axis=1)
    if GATED:
        y = y * tl.sigmoid(y) * y2
    _store(out_ptr, res_ptr, row, som, rn, N, y, RES)


@triton.jit
def _store(out_ptr, res_ptr, row, som, rn, N, y, RES: tl.constexpr):
    """Row `row`'s outputs rn (y [BN], float32) to out, plus the same row of res (out's shape and
    strides) with RES."""
    at = row.to(tl.int64) * som + rn
    if RES:
        y += tl.load(res_ptr + at, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _add_half(out_ptr, res_ptr, row, som, rn, N, y, first, RES: tl.constexpr):
    """`_store` for one of the two programs of a token's halves of slots (HALVES): y added into out
    (float32, zeroed before the launch), the first half's plus res's row with RES. Two sums added to
    zero give the same bits in either order, so the output does not depend on which program ends
    first (with more parts it would)."""
    at = row.to(tl.int64) * som + rn
    if RES:
        y += tl.where(first, tl.load(res_ptr + at, mask=rn < N, other=0.0).to(tl.float32), 0.0)
    tl.atomic_add(out_ptr + at, y, mask=rn < N, sem="relaxed")


@triton.jit
def _pair(ids_ptr, pair, E, N, rn, row_units, ROW_WORDS: tl.constexpr):
    """The word offsets [BN] (int64) of rows rn of pair `pair`'s expert (rows past N clamped to the
    last one; an id out of range clamped too: a wrong expert rather than a read past the tensor)."""
    e = tl.minimum(tl.maximum(tl.load(ids_ptr + pair), 0), E - 1)
    return (e.to(tl.int64) * N + tl.minimum(rn, N - 1)) * row_units * ROW_WORDS


@triton.jit
def _x_of(xq_ptr, dx_ptr, xs_ptr, pair, x_div, K):
    """Pair `pair`'s row of the quantized x (row pair // x_div): its codes, scales and sums."""
    x_row = (pair // x_div).to(tl.int64)
    return xq_ptr + x_row * K, dx_ptr + x_row * (K // 32), xs_ptr + x_row * (K // 16)


@triton.jit
def _pair_dots(
    QT: tl.constexpr, a, b, c, d, w_ptr, row_w, xq_ptr, dx_ptr, xs_ptr, topw_ptr, pair, x_div, K,
    UNIT: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr, LATE: tl.constexpr, SUM: tl.constexpr,
):  # fmt: skip
    """`dot8.dot_step` of one-step rows loaded for pair `pair` (`dot8.load_step`) with its x row,
    times its topw with SUM."""
    xq, dx, xs = _x_of(xq_ptr, dx_ptr, xs_ptr, pair, x_div, K)
    part = dot_step(QT, a, b, c, d, w_ptr, row_w, xq, dx, xs, 0, K // UNIT, K, ASM, EVEN, LATE)
    return tl.load(topw_ptr + pair).to(tl.float32) * part if SUM else part


@triton.jit
def moe_gemv8_kernel(
    xq_ptr, dx_ptr, xs_ptr, w_ptr, w2_ptr, ids_ptr, topw_ptr, res_ptr, out_ptr, N, K, E, x_div, row_units,
    row_units2, som, QT: tl.constexpr, QT2: tl.constexpr, UNIT: tl.constexpr, UNIT2: tl.constexpr,
    QUADS: tl.constexpr, QUADS2: tl.constexpr, BN: tl.constexpr, BU: tl.constexpr, BU2: tl.constexpr,
    EVEN: tl.constexpr, EVEN2: tl.constexpr, ROW_WORDS: tl.constexpr, ROW_WORDS2: tl.constexpr,
    LATE: tl.constexpr, SLOTS: tl.constexpr, ONE_STEP: tl.constexpr, ASM: tl.constexpr, GATED: tl.constexpr,
    SUM: tl.constexpr, RES: tl.constexpr, HALVES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program: BN outputs of pair program_id(1), or with SUM of token program_id(1) over its
    SLOTS pairs (plus its residual row with RES), from x quantized per 32 values (xq, dx, xs:
    `dot8.store_quantized`'s buffers, one row a token, or a pair with x_div = 1), by `dot8`'s steps.
    The partial sums stay [BN, BU * QUADS] (with SUM, each pair's weighted by topw) and are reduced
    once, at the end.

    ONE_STEP (rows of at most one step, as a decode step's experts: 2048 and 768 weights): the
    pairs are the pipeline's steps, each pair's weights (gate's and up's) loaded before the previous
    pair's dots, so a program keeps two pairs' loads in flight where its rows are few (the down
    projection's weighted sum: 2048 rows a token in all, ~16 an SM). Longer rows take each pair in
    turn through `dot8.row_dots`, pipelined along the row.

    HALVES (2, with SUM; SLOTS even): program_id(1) is a token's half, each program sums half of its
    pairs and adds that into out (zeroed by the launch before: `_add_half`), so a program waits for
    half as many pairs' loads in turn, and twice as many programs share the reads.

    PDL (launched as a programmatic dependent): the next kernel may launch at once; this one waits
    for the kernel before it before reading anything (its rows follow the expert ids), so only its
    launch hides in that kernel's tail."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    row = tl.program_id(1) // HALVES
    half = tl.program_id(1) % HALVES
    COUNT: tl.constexpr = SLOTS // HALVES if SUM else 1
    first = row * (COUNT * HALVES) + half * COUNT
    acc = tl.zeros([BN, BU * QUADS], tl.float32)
    acc2 = tl.zeros([BN, BU2 * QUADS2], tl.float32)
    n_units, n_units2 = K // UNIT, K // UNIT2
    if ONE_STEP:
        row_w = _pair(ids_ptr, first, E, N, rn, row_units, ROW_WORDS)
        a, b, c, d = load_step(QT, w_ptr, row_w, 0, n_units, BU, EVEN, LATE)
        if GATED:  # same expert, the up projection's rows
            row_w2 = _pair(ids_ptr, first, E, N, rn, row_units2, ROW_WORDS2)
            a2, b2, c2, d2 = load_step(QT2, w2_ptr, row_w2, 0, n_units2, BU2, EVEN2, LATE)
        for j in range(1, COUNT):  # pair j's weights loaded, then pair j - 1's dots
            next_w = _pair(ids_ptr, first + j, E, N, rn, row_units, ROW_WORDS)
            na, nb, nc, nd = load_step(QT, w_ptr, next_w, 0, n_units, BU, EVEN, LATE)
            acc += _pair_dots(
                QT, a, b, c, d, w_ptr, row_w, xq_ptr, dx_ptr, xs_ptr, topw_ptr, first + j - 1, x_div, K, UNIT,
                ASM, EVEN, LATE, SUM,
            )  # fmt: skip
            a, b, c, d, row_w = na, nb, nc, nd, next_w
        acc += _pair_dots(
            QT, a, b, c, d, w_ptr, row_w, xq_ptr, dx_ptr, xs_ptr, topw_ptr, first + COUNT - 1, x_div, K, UNIT,
            ASM, EVEN, LATE, SUM,
        )  # fmt: skip
        if GATED:  # (one pair a program: no loop above)
            acc2 += _pair_dots(
                QT2, a2, b2, c2, d2, w2_ptr, row_w2, xq_ptr, dx_ptr, xs_ptr, topw_ptr, first, x_div, K, UNIT2,
                ASM, EVEN2, LATE, False,
            )  # fmt: skip
    else:
        for j in range(COUNT):
            pair = first + j
            xq, dx, xs = _x_of(xq_ptr, dx_ptr, xs_ptr, pair, x_div, K)
            row_w = _pair(ids_ptr, pair, E, N, rn, row_units, ROW_WORDS)
            part = row_dots(QT, w_ptr, row_w, xq, dx, xs, K, UNIT, QUADS, BU, ASM, EVEN, LATE, False)
            acc += tl.load(topw_ptr + pair).to(tl.float32) * part if SUM else part
            if GATED:  # gate and up of one pair in one program: silu(gate) * up at the end
                row_w2 = _pair(ids_ptr, pair, E, N, rn, row_units2, ROW_WORDS2)
                acc2 += row_dots(
                    QT2, w2_ptr, row_w2, xq, dx, xs, K, UNIT2, QUADS2, BU2, ASM, EVEN2, LATE, False
                )
    y = tl.sum(acc, axis=1)
    if GATED:
        y2 = tl.sum(acc2, axis=1)
        y = y * tl.sigmoid(y) * y2
    if HALVES > 1:
        _add_half(out_ptr, res_ptr, row, som, rn, N, y, half == 0, RES)
    else:
        _store(out_ptr, res_ptr, row, som, rn, N, y, RES)


@triton.jit
def _operand(v, DOT: tl.constexpr):
    """A tile as tl.dot's operand type DOT: "bf16", "fp16" or "fp32"."""
    if DOT == "bf16":
        v = v.to(tl.bfloat16)
    elif DOT == "fp16":
        v = v.to(tl.float16)
    else:
        v = v.to(tl.float32)
    return v


@triton.jit
def moe_gemm_kernel(
    x_ptr, w_ptr, w2_ptr, lut_ptr, pairs_ptr, block_expert_ptr, topw_ptr, out_ptr,
    n_pairs, N, K, E, n_blocks, x_div, sxm, swn, swn2, som,
    QT: tl.constexpr, QT2: tl.constexpr, PACKED: tl.constexpr, PACKED2: tl.constexpr, G: tl.constexpr,
    G2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    GATED: tl.constexpr, SCALE: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """One program: a BM x BN tile of one block of sorted pairs. Blocks past the last one in use
    (their expert E) return at once: the grid is sized for the most blocks a routing can take.
    x and the dequantized weight tiles meet in tl.dot as DOT ("bf16", "fp16", "fp32": `_operand`),
    summed in float32."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), n_blocks, tl.cdiv(N, BN), GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:
        return
    pairs = tl.load(pairs_ptr + pid_m * BM + tl.arange(0, BM))
    ok = pairs < n_pairs  # padding holds n_pairs
    x_rows = x_ptr + (tl.minimum(pairs, n_pairs - 1) // x_div).to(tl.int64)[:, None] * sxm
    rn = pid_n * BN + tl.arange(0, BN)
    row_off = _expert_rows(e, rn, N, swn)
    row_off2 = _expert_rows(e, rn, N, swn2)
    acc = tl.zeros([BM, BN], tl.float32)
    acc2 = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = _operand(tl.load(x_rows + rk[None, :], mask=ok[:, None] & (rk[None, :] < K), other=0.0), DOT)
        w = _operand(weight_tile(QT, w_ptr, row_off, k0, K, PACKED, lut_ptr, G, BK), DOT)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            w2 = _operand(weight_tile(QT2, w2_ptr, row_off2, k0, K, PACKED2, lut_ptr, G2, BK), DOT)
            acc2 = tl.dot(x, tl.trans(w2), acc2)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc2
    if SCALE:
        acc = acc * tl.load(topw_ptr + pairs, mask=ok, other=0.0).to(tl.float32)[:, None]
    o_ptr = out_ptr + pairs.to(tl.int64)[:, None] * som + rn[None, :]
    tl.store(o_ptr, acc.to(out_ptr.dtype.element_ty), mask=ok[:, None] & (rn[None, :] < N))
