"""The integer-dot GEMV for several rows of x (a batched decode step): each weight block is read
once for up to BM rows of x quantized to int8 per 32 values, as llama.cpp's mmvq does for up to 8.

A program holds BN weight rows and BM rows of x. It loads a step of weights (`dot8.load_step`, the
next step's before computing on the current one, as `dot8.gemv8_kernel`), then takes `dot8.dot_step`
with each x row in turn on the same registers. The one-row GEMV keeps its partial sums
[BN, BU * QUADS] until its loop ends; BM rows of them would not fit a thread's registers, so here
each row's are reduced (`tl.sum`) as its step ends, into [BM, BN] sums.

More rows than BM are taken in chunks by neighbouring programs (program p: output tile p // chunks,
rows chunk p % chunks), so the chunks of one tile run at about the same time and all but one read
its weights from the L2. The launch splits M into chunks of equal size (`matmul.row_chunks`); the
last chunk's rows past M repeat row M - 1 and are not stored.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llmx.quant.triton.dot8 import dot_step, late_step, load_step, pick_weight


@triton.jit
def _rows_step(
    QT: tl.constexpr, a, b, c, d, w_ptr, row_w, xq_ptr, dx_ptr, xs_ptr, m0, M, u0, n_units, K,
    BM: tl.constexpr, BMP: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr, LATE: tl.constexpr,
):  # fmt: skip
    """[BMP, BN]: the dots of the blocks u0.. that `load_step` loaded with x rows m0..m0+BM (row i
    of the result; rows from BM on are 0)."""
    BN: tl.constexpr = row_w.shape[0]
    a, b, c, d = late_step(QT, a, b, c, d, w_ptr, row_w, u0, n_units, EVEN, LATE)  # once for all rows
    rows = tl.arange(0, BMP)[:, None]
    out = tl.zeros([BMP, BN], tl.float32)
    for i in tl.static_range(BM):
        m = tl.minimum(m0 + i, M - 1).to(tl.int64)
        xq, dx, xs = xq_ptr + m * K, dx_ptr + m * (K // 32), xs_ptr + m * (K // 16)
        part = dot_step(QT, a, b, c, d, w_ptr, row_w, xq, dx, xs, u0, n_units, K, ASM, EVEN, False)
        out += tl.where(rows == i, tl.sum(part, axis=1)[None, :], 0.0)
    return out


@triton.jit
def gemv8_rows_kernel(
    xq_ptr, dx_ptr, xs_ptr, w0, o0, n0, w1, o1, n1, w2, o2, n2, r_ptr, M, K, row_units, chunks,
    QT: tl.constexpr, UNIT: tl.constexpr, BN: tl.constexpr, BU: tl.constexpr, BM: tl.constexpr,
    BMP: tl.constexpr, NW: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr, ROW_WORDS: tl.constexpr,
    PDL: tl.constexpr, RES: tl.constexpr, LATE: tl.constexpr,
):  # fmt: skip
    """One program: BN outputs of BM rows of x (BMP: BM rounded up to a power of 2), BU blocks of
    UNIT weights a step, from x [M, K] quantized (xq, dx, xs: `dot8.store_quantized`'s buffers).
    Outputs are [M, N_i] row-major. NW, EVEN, ROW_WORDS, PDL, RES (r [M, N] added at the store) and
    LATE as in `dot8.gemv8_kernel`."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    tile = pid // chunks
    m0 = (pid % chunks) * BM
    w_ptr, out_ptr, N, first = pick_weight(tile, w0, o0, n0, w1, o1, n1, w2, o2, n2, BN, NW)
    rn = (tile - first) * BN + tl.arange(0, BN)
    row_w = tl.minimum(rn, N - 1).to(tl.int64) * row_units * ROW_WORDS
    n_units = K // UNIT
    last = (n_units - 1) // BU * BU  # the last step's first block
    acc = tl.zeros([BMP, BN], tl.float32)
    a, b, c, d = load_step(QT, w_ptr, row_w, 0, n_units, BU, EVEN, LATE)
    if PDL:
        gdc_wait()
    for u0 in range(0, last, BU):
        na, nb, nc, nd = load_step(QT, w_ptr, row_w, u0 + BU, n_units, BU, EVEN, LATE)
        acc += _rows_step(
            QT, a, b, c, d, w_ptr, row_w, xq_ptr, dx_ptr, xs_ptr, m0, M, u0, n_units, K, BM, BMP, ASM,
            EVEN, LATE,
        )  # fmt: skip
        a, b, c, d = na, nb, nc, nd
    acc += _rows_step(
        QT, a, b, c, d, w_ptr, row_w, xq_ptr, dx_ptr, xs_ptr, m0, M, last, n_units, K, BM, BMP, ASM,
        EVEN, LATE,
    )  # fmt: skip
    i = tl.arange(0, BMP)
    mi = m0 + i
    ok = ((i < BM) & (mi < M))[:, None] & (rn < N)[None, :]
    off = mi.to(tl.int64)[:, None] * N + rn[None, :]
    if RES:
        acc += tl.load(r_ptr + off, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=ok)
