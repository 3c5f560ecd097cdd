"""Matmul, embedding and dequantize on raw GGUF blocks on a GPU: the launches of the Triton kernels.

Weights stay as the uint8 rows of the GGUF file (`layout.Blocks`); the kernels (`kernels.py`,
`dot8.py`, `dot8_rows.py`, `mmq.py`, `mmh.py`) unpack blocks in registers. Which kernel runs is
`llmx.quant.choice`'s table: a `QWeight` keeps its answer per M bucket and hands it to `run`;
`linear` asks the table itself (for weights that do not keep one, and to force a kernel). Launch
shapes come from the device's tuning (`tuning.py`), the GEMM's tiles from the autotuner
(`autotune.py`). Under TRITON_INTERPRET=1 the same code runs on CPU tensors (the tests do that).

"dequant" dequantizes a chunk of rows at a time (DEQUANT_CHUNK_BYTES) to fp16 (or x's dtype when
that is fp16/bf16), then multiplies with torch's matmul (cuBLAS, fp32 accumulation). Float32 x is
scaled per row into [-1, 1] and rounded to fp16 for it: a float32 matmul would run at the FP32 rate,
about a twelfth of the half-precision tensor cores.

Output dtype is x's dtype; accumulation is always float32. GEMM multiplies in x's dtype (fp16 or
bf16 weight tiles; tf32 for float32 x).
"""

from __future__ import annotations

import torch

from llmx.errors import LlmxError
from llmx.quant import choice as C
from llmx.quant.triton import autotune, layout
from llmx.quant.triton.activation import PENDING, HalfX, QuantizedX, half_rows, quantize_x
from llmx.quant.triton.launch import (
    cdiv,
    dot8,
    dot8_rows,
    interpreting,
    kernels,
    lut,
    mmh,
    mmq,
    programmatic_launch,
    sm_count,
    zeroed_counters,
)
from llmx.quant.triton.layout import Blocks, label, rows
from llmx.quant.triton.tuning import GemmConfig, LaunchShape, for_device

DOT8_QUADS = {"Q8_0": 2, "Q4_K": 8, "Q6_K": 4}  # the integer-dot GEMV's partial sums a block
DOT8_MAX_WEIGHTS = 3  # weights sharing one integer-dot launch (q/k/v)
INT8_KERNELS = ("dot8", "dot8_rows", "mmq")  # the integer-dot kernels: x quantized to int8 first
SHARED_KERNELS = (*INT8_KERNELS, "mmh")  # kernels whose launch takes up to DOT8_MAX_WEIGHTS weights
MMH_STEP = 256  # the weights of a row "mmh" takes a loop step
MMQ_MIN_BM = 16  # the fewest rows of x a program of "mmq" takes: tl.dot's least side
# "mmq"'s split over K: a launch of fewer output tiles than the GPU has SMs cuts K into ranges until
# there are about this many programs an SM, each range at least MMQ_MIN_SPLIT_STEPS loop steps
# (a Llama-3-8B o projection is 32 tiles of 128 rows for 132 SMs). Its batched decode step with every
# weight on "mmq" (H100): 9.8 / 13.1 ms at 16 / 32 rows, 4 programs an SM 10.1 / 13.6, unsplit 20.1 / 22.8
MMQ_PROGRAMS_PER_SM = 2
MMQ_MIN_SPLIT_STEPS = 2
INTERPRETED_SMS = 8  # the interpreter's stand-in for the SMs: the tests' small launches split
ROWS8_BM = 8  # rows of x a program of "dot8_rows" takes (llama.cpp's mmvq: up to 8), to be measured
# Half-precision weight rows dequantized at a time for "dequant": a Llama-3-8B FFN matrix (112 MiB)
# in one piece, since chunks of rows that split it give cuBLAS too few output tiles.
DEQUANT_CHUNK_BYTES = 128 << 20
DEQUANT_ROW_ALIGN = 256  # chunks of "dequant" are whole multiples of this many rows where they can be


def layout_of(w: Blocks) -> str:
    """`w`'s row layout, as `llmx.quant.choice` names it."""
    if not layout.word_rows(w):
        return C.SPLIT if w.packed is layout.SPLIT else C.GGUF
    return C.WORDS


def kernel_for(w: Blocks, m: int, kernel: str | None = None) -> str:
    """The kernel that multiplies `w` by M = m rows of x: the table's, or `kernel` forced ("dot8"
    becomes "gemv" for rows it cannot read)."""
    return C.choose(w.qtype, "cuda", layout_of(w), m, kernel or "auto")


def linear(
    x: torch.Tensor,
    w: Blocks,
    kernel: str | None = None,
    gemv: LaunchShape | None = None,
    qx: QuantizedX | None = None,
    half: HalfX | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) @ W.T for W [N, K] -> [..., N] in x's dtype, plus `residual`
    ([..., N] in x's dtype) where given: the integer-dot GEMV adds it as it stores its output (a
    block's residual add then costs no kernel of its own), the other paths after.

    The kernel is the table's for M (the product of x's leading dims); `kernel` (one of
    choice.GPU_KERNELS) forces one and `gemv` the GEMV launch shape, for benchmarks. `qx` is x
    already quantized by `quantize_x`, `half` x already scaled to fp16 by `half_rows` (both made
    once by `linear_many` for the weights that share x).
    """
    check_width(x, w)
    x2 = unit_rows(x)
    return run(x, x2, w, kernel_for(w, x2.shape[0], kernel), gemv, qx, half, residual)


def run(
    x: torch.Tensor,
    x2: torch.Tensor,
    w: Blocks,
    choice: str,
    gemv: LaunchShape | None = None,
    qx: QuantizedX | None = None,
    half: HalfX | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`linear` by the kernel `choice`, for x and its rows x2 [M, K] (`unit_rows`)."""
    if choice in SHARED_KERNELS:
        m, n = x2.shape[0], w.shape[0]
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        res = None if residual is None else residual.reshape(m, n).contiguous()
        _shared_launch(choice, x, x2, [w], [out], qx, half, gemv, res)
        return out.reshape(*x.shape[:-1], n)
    y = _matmul(x2, w, choice, gemv, half).reshape(*x.shape[:-1], w.shape[0])
    return y if residual is None else y.add_(residual)


def check_width(x: torch.Tensor, w: Blocks) -> None:
    if x.shape[-1] != w.shape[1]:
        raise LlmxError(f"{label(w)} {tuple(w.shape)} cannot multiply x of shape {tuple(x.shape)}")


def _matmul(
    x2: torch.Tensor, w: Blocks, choice: str, gemv: LaunchShape | None, half: HalfX | None
) -> torch.Tensor:
    """x2 [M, K] @ W.T -> [M, N] by `choice` (not the integer-dot GEMV), a new tensor."""
    (n, k), m = w.shape, x2.shape[0]
    if choice == "float":
        return torch.nn.functional.linear(x2, w.raw.to(x2.dtype))
    if choice == "dequant":
        return _dequant_matmul(x2, w, half)
    if choice == "gemv" and m > C.GEMV_MAX_M:
        raise LlmxError(f"the GEMV kernel takes at most {C.GEMV_MAX_M} rows of x, got {m}")
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    raw, name, packed = rows(w)
    table = lut(raw.device)
    strides = (x2.stride(0), raw.stride(0), out.stride(0))
    group = w.qtype.scale_group
    if choice == "gemv":
        bm = 1 << (m - 1).bit_length()
        cfg = gemv or for_device(raw.device).gemv(name, bm)
        kernels().gemv_kernel[(cdiv(n, cfg.bn),)](
            x2, raw, table, out, m, n, k, *strides,
            QT=name, PACKED=packed, G=group, BM=bm, BN=cfg.bn, BK=cfg.bk, num_warps=cfg.num_warps,
        )  # fmt: skip
    elif choice == "gemm":
        m_bucket = min(1 << (m - 1).bit_length(), 4096)

        def launch(c: GemmConfig) -> None:
            kernels().gemm_kernel[(cdiv(m, c.bm) * cdiv(n, c.bn),)](
                x2, raw, table, out, m, n, k, *strides, m_bucket,
                QT=name, PACKED=packed, G=group, BM=c.bm, BN=c.bn, BK=c.bk, GROUP_M=8,
                num_warps=c.num_warps, num_stages=c.num_stages,
            )  # fmt: skip

        def key() -> str:
            return autotune.problem_key(raw.device, name, packed, m_bucket, n, k, x2.dtype)

        launch(autotune.gemm_config(raw.device, key, launch))
    else:
        raise LlmxError(f"unknown kernel {choice!r}; choose one of {', '.join(C.GPU_KERNELS)}")
    return out


def linear_many(x: torch.Tensor, ws: list[Blocks], qx: QuantizedX | None = None) -> list[torch.Tensor]:
    """[linear(x, w) for w in ws] for weights that multiply the same x (q/k/v, gate/up): x is
    quantized once for all the integer-dot GEMVs among them (or `qx` given), and those of one type
    share launches."""
    x2 = unit_rows(x)
    m = x2.shape[0]
    return run_many(x, x2, ws, [kernel_for(w, m) for w in ws], qx)


def run_many(
    x: torch.Tensor, x2: torch.Tensor, ws: list[Blocks], chosen: list[str], qx: QuantizedX | None = None
) -> list[torch.Tensor]:
    """`linear_many` by the kernels `chosen` (one a weight)."""
    m = x2.shape[0]
    shared = [kernel in SHARED_KERNELS for kernel in chosen]
    half = None
    if "mmh" in chosen or ("dequant" in chosen and x2.dtype not in (torch.float16, torch.bfloat16)):
        half = half_rows(x2)  # once for all of them
    if not any(shared):
        return [run(x, x2, w, kernel, half=half) for w, kernel in zip(ws, chosen, strict=True)]
    if any(kernel in INT8_KERNELS for kernel in chosen):
        qx = qx or PENDING.quantized(x) or quantize_x(x2)
    outs: dict[int, torch.Tensor] = {}
    groups: dict[tuple[str, str, int], list[int]] = {}  # weights one launch can serve
    for i, w in enumerate(ws):
        if shared[i]:
            groups.setdefault((chosen[i], w.qtype.name, w.raw.stride(0)), []).append(i)
        else:
            outs[i] = run(x, x2, w, chosen[i], half=half)
    for (kernel, _, _), members in groups.items():
        for part in (members[j : j + DOT8_MAX_WEIGHTS] for j in range(0, len(members), DOT8_MAX_WEIGHTS)):
            ys = [torch.empty((m, ws[i].shape[0]), dtype=x.dtype, device=x.device) for i in part]
            _shared_launch(kernel, x, x2, [ws[i] for i in part], ys, qx, half)
            for i, y in zip(part, ys, strict=True):
                outs[i] = y.reshape(*x.shape[:-1], ws[i].shape[0])
    return [outs[i] for i in range(len(ws))]


def _shared_launch(
    kernel: str,
    x: torch.Tensor,
    x2: torch.Tensor,
    ws: list[Blocks],
    outs: list[torch.Tensor],
    qx: QuantizedX | None,
    half: HalfX | None,
    gemv: LaunchShape | None = None,
    residual: torch.Tensor | None = None,
) -> None:
    """outs[i] [M, N_i] = x @ ws[i].T by `kernel` (one of SHARED_KERNELS), one launch for all (up to
    DOT8_MAX_WEIGHTS of one type and row width); with one weight, plus `residual` [M, N_0]. x2 goes in
    the form the kernel reads: `half` (`half_rows`) for "mmh", else int8 (`qx`, or the latest
    producer's quantized x, or x quantized now). `gemv`: the integer-dot GEMVs' launch shape, else the
    tuned one (the tensor-core GEMMs take their tuned tiles)."""
    assert residual is None or (len(ws) == 1 and residual.shape == outs[0].shape)
    if kernel == "mmh":
        _mmh(half or half_rows(x2), ws, outs, residual)
        return
    qx = qx or PENDING.quantized(x) or quantize_x(x2)
    if kernel == "mmq":
        _mmq(qx, ws, outs, residual)
    else:
        _gemv8(qx, ws, outs, gemv, residual)


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as rows [M, K] with a unit stride along K, as the kernels read them (a view
    where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _weight_slots(raws: list[torch.Tensor], outs: list[torch.Tensor], ws: list[Blocks]) -> list[object]:
    """The (rows, output, N) arguments of the DOT8_MAX_WEIGHTS weights an integer-dot launch takes,
    flat; unused slots repeat the first weight's with N = 0 (no programs)."""
    args = [(raw, out, w.shape[0]) for raw, out, w in zip(raws, outs, ws, strict=True)]
    args += [args[0][:2] + (0,)] * (DOT8_MAX_WEIGHTS - len(args))
    return [a for slot in args for a in slot]


def _mmq(
    qx: QuantizedX,
    ws: list[Blocks],
    outs: list[torch.Tensor],
    residual: torch.Tensor | None,
    cfg: GemmConfig | None = None,
) -> None:
    """`_shared_launch` on the integer tensor-core GEMM (`mmq.mmq_kernel`), at `cfg`'s tile, else the
    tuned one for the weights' type (`_tiles`)."""
    qt, k = ws[0].qtype, ws[0].shape[1]
    cfg = cfg or for_device(ws[0].raw.device).mmq(qt.name)
    su = max(1, cfg.bk // qt.block_elems)
    steps = cdiv(k // qt.block_elems, su)
    _tiles(mmq().mmq_kernel, (qx.q, qx.dx, qx.sums), ws, outs, residual, cfg, steps, QT=qt.name, SU=su)


def _mmh(
    half: HalfX,
    ws: list[Blocks],
    outs: list[torch.Tensor],
    residual: torch.Tensor | None,
    cfg: GemmConfig | None = None,
) -> None:
    """outs[i] [M, N_i] = x @ ws[i].T (plus `residual` with one weight) on the half-precision
    tensor-core GEMM (`mmh.mmh_kernel`), x given as `half_rows`' f16 rows and scales, at `cfg`'s tile,
    else the tuned one for the weights' type (`_tiles`)."""
    xh, scale = half
    qt, k = ws[0].qtype, ws[0].shape[1]
    cfg = cfg or for_device(ws[0].raw.device).mmh(qt.name, tile_rows(xh.shape[0]))
    steps = cdiv(k, MMH_STEP)
    _tiles(mmh().mmh_kernel, (xh, scale), ws, outs, residual, cfg, steps, QT=qt.name, ASM=not interpreting())


def _tiles(
    kernel: object,
    x_args: tuple[torch.Tensor, ...],
    ws: list[Blocks],
    outs: list[torch.Tensor],
    residual: torch.Tensor | None,
    cfg: GemmConfig,
    steps: int,
    **constexprs: object,
) -> None:
    """One launch of a tensor-core GEMM over output tiles of cfg.bn weight rows (of up to
    DOT8_MAX_WEIGHTS weights, `_weight_slots`) by rows of x, x's buffers `x_args` first: a program
    takes M rounded up to a power of two rows of x, from MMQ_MIN_BM to the tile's BM, and K's `steps`
    loop steps, split where a launch of fewer output tiles than MMQ_PROGRAMS_PER_SM programs for each
    of the GPU's SMs would leave them idle (`mmq_splits`, joined by `mmq.finish_tile`)."""
    m = x_args[0].shape[0]
    raws = [rows(w)[0] for w in ws]
    k, device = ws[0].shape[1], raws[0].device
    bm = min(cfg.bm, tile_rows(m))
    m_tiles = cdiv(m, bm)
    tiles = sum(cdiv(w.shape[0], cfg.bn) for w in ws)
    splits, split_steps = mmq_splits(tiles * m_tiles, steps, sm_count(device, INTERPRETED_SMS))
    counts = zeroed_counters(device)
    if counts is None:  # a capture before any eager call: no split
        splits, split_steps, counts = 1, steps, torch.zeros(1, dtype=torch.int32, device=device)
    parts = outs[0]  # unread without a split
    if splits > 1:
        parts = torch.empty((tiles * m_tiles * splits, cfg.bn, bm), dtype=torch.float32, device=device)
    res = outs[0] if residual is None else residual  # unread without a residual
    kernel[(tiles * m_tiles * splits,)](  # type: ignore[index]
        *x_args, *_weight_slots(raws, outs, ws), res, parts, counts, m, k, raws[0].stride(0),
        m_tiles, splits, split_steps,
        BM=bm, BN=cfg.bn, NW=len(ws), RES=residual is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **constexprs,
    )  # fmt: skip


def tile_rows(m: int) -> int:
    """The rows of x a tensor-core GEMM's program takes for M = m, before its tile's limit: m rounded up
    to a power of two, at least MMQ_MIN_BM (tl.dot's least side)."""
    return max(MMQ_MIN_BM, 1 << (m - 1).bit_length())


def mmq_splits(programs: int, steps: int, sms: int) -> tuple[int, int]:
    """(ranges, steps a range) that K's `steps` loop steps are cut into for a launch of `programs`
    output tiles on a GPU of `sms` SMs: enough ranges for MMQ_PROGRAMS_PER_SM programs an SM where
    the tiles alone leave SMs idle, none empty, each range at least MMQ_MIN_SPLIT_STEPS steps."""
    wanted = cdiv(MMQ_PROGRAMS_PER_SM * sms, programs) if programs < sms else 1
    splits = max(1, min(wanted, steps // MMQ_MIN_SPLIT_STEPS))
    split_steps = cdiv(steps, splits)
    return cdiv(steps, split_steps), split_steps


def _gemv8(
    qx: QuantizedX,
    ws: list[Blocks],
    outs: list[torch.Tensor],
    gemv: LaunchShape | None,
    residual: torch.Tensor | None = None,
) -> None:
    """`_shared_launch` on the integer-dot GEMV (M = 1) or its several-row form, at `gemv`'s launch shape,
    else the tuned one."""
    m = qx.q.shape[0]
    raws = [rows(w)[0] for w in ws]
    qt, k = ws[0].qtype, ws[0].shape[1]
    name, device = qt.name, raws[0].device
    tuned = for_device(device)
    cfg = gemv or (tuned.dot8_rows(name) if m > 1 else tuned.dot8(name, k))
    unit = qt.block_elems
    bu = max(1, cfg.bk // unit)
    row_words = 4 if raws[0].stride(0) % 16 == 0 else 1
    slots = _weight_slots(raws, outs, ws)
    pdl = programmatic_launch(device)
    res = outs[0] if residual is None else residual  # unread without a residual
    tiles = sum(cdiv(w.shape[0], cfg.bn) for w in ws)
    if m > 1:
        chunks, bm = row_chunks(m)
        dot8_rows().gemv8_rows_kernel[(tiles * chunks,)](
            qx.q, qx.dx, qx.sums, *slots, res, m, k,
            raws[0].stride(0) // (4 * row_words), chunks,
            QT=name, UNIT=unit, BN=cfg.bn, BU=bu, BM=bm, BMP=1 << (bm - 1).bit_length(), NW=len(ws),
            ASM=not interpreting(), EVEN=k % (bu * unit) == 0, ROW_WORDS=row_words, PDL=pdl,
            RES=residual is not None, LATE=cfg.late_headers, num_warps=cfg.num_warps, launch_pdl=pdl,
            maxnreg=cfg.max_registers,
        )  # fmt: skip
        return
    dot8().gemv8_kernel[(tiles,)](
        qx.q, qx.dx, qx.sums, *slots, res,
        k, raws[0].stride(0) // (4 * row_words),
        QT=name, UNIT=unit, QUADS=DOT8_QUADS[name], BN=cfg.bn, BU=bu, NW=len(ws),
        ASM=not interpreting(), EVEN=k % (bu * unit) == 0, ROW_WORDS=row_words, PDL=pdl,
        RES=residual is not None, LATE=cfg.late_headers, STAGGER=cfg.stagger, SCATTER4=scatter_end(name, cfg),
        num_warps=cfg.num_warps, launch_pdl=pdl, maxnreg=cfg.max_registers,
    )  # fmt: skip


def row_chunks(m: int) -> tuple[int, int]:
    """(chunks, rows a chunk) for the several-row integer-dot GEMV at M = m: the fewest chunks of at
    most ROWS8_BM rows, of equal size (17 rows: 3 chunks of 6, not 8, 8 and 1 in 3 of 8)."""
    chunks = cdiv(m, ROWS8_BM)
    return chunks, cdiv(m, chunks)


def scatter_end(name: str, cfg: LaunchShape) -> bool:
    """Whether the integer-dot GEMV at `cfg` ends in `dot8.SCATTER4_ASM`'s reduce-scatter: Q4_K's
    programs of 4 rows and one 4096-weight step on 4 warps, whose threads hold one column of partial
    sums each (other types' 128-column shapes lay them out otherwise: `bench/ptx_gemv.py`'s end
    column), compiled (inline PTX, which the interpreter cannot run: it takes tl.sum's end)."""
    return name == "Q4_K" and (cfg.bn, cfg.bk, cfg.num_warps) == (4, 4096, 4) and not interpreting()


def _dequant_matmul(x2: torch.Tensor, w: Blocks, half: HalfX | None = None) -> torch.Tensor:
    """x2 [M, K] @ W.T on the half-precision tensor cores, W dequantized a chunk of rows at a time
    (so the transient buffer stays under DEQUANT_CHUNK_BYTES); the result in x2's dtype. `half` is
    float32 x2 already scaled into fp16 (`half_rows`, shared by the weights that take the same x).

    A prompt runs this for every weight of every layer, so it keeps to few launches: one to scale
    x into fp16, one dequantize and one matmul a chunk, one multiply back to x's dtype."""
    m, k = x2.shape
    n = w.shape[0]
    scale = None
    if x2.dtype in (torch.float16, torch.bfloat16):
        xh = x2
    else:  # per-row scaling keeps any activation inside fp16's range
        xh, scale = half or half_rows(x2)
    step = max(1, DEQUANT_CHUNK_BYTES // (2 * k))
    if step >= DEQUANT_ROW_ALIGN:  # whole tiles of the matmul
        step -= step % DEQUANT_ROW_ALIGN
    if step >= n:
        y = xh @ dequantize_rows(w, 0, n, xh.dtype).t()
    else:
        y_t = torch.empty((n, m), dtype=xh.dtype, device=x2.device)  # rows of W give rows of y.T
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            torch.mm(dequantize_rows(w, r0, r1, xh.dtype), xh.t(), out=y_t[r0:r1])
        y = y_t.t()
    return y.to(x2.dtype) if scale is None else torch.mul(y, scale)  # fp16 * float32 -> float32


def embedding(ids: torch.Tensor, w: Blocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` (any shape, integer) of W [N, K], dequantized: [*ids.shape, K] in `dtype`.

    Only the selected rows are read; with dtype float32 the values equal gguf-py's bit for bit.
    """
    n, k = w.shape
    if w.qtype.is_float:
        return w.raw[ids].to(dtype)
    flat = ids.reshape(-1).to(device=w.raw.device, dtype=torch.int64)
    return _dequant(w, flat, 0, flat.numel(), dtype).reshape(*ids.shape, k)


def dequantize_rows(
    w: Blocks, r0: int, r1: int, dtype: torch.dtype = torch.float32, shape: LaunchShape | None = None
) -> torch.Tensor:
    """Rows r0..r1 of W [N, K] dequantized, [r1 - r0, K] in `dtype` (float32: bit-exact with gguf-py).
    `shape` forces the kernel's launch shape (benchmarks)."""
    if w.qtype.is_float:
        return w.raw[r0:r1].to(dtype)
    return _dequant(w, None, r0, r1 - r0, dtype, shape)


def dequantize(w: Blocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight W [N, K] in `dtype` (float32: bit-exact with gguf-py)."""
    return dequantize_rows(w, 0, w.shape[0], dtype)


def _dequant(
    w: Blocks,
    ids: torch.Tensor | None,
    r0: int,
    rows_: int,
    dtype: torch.dtype,
    shape: LaunchShape | None = None,
) -> torch.Tensor:
    """[rows_, K] in `dtype`: rows `ids` of W, or when `ids` is None rows r0..r0+rows_."""
    n, k = w.shape
    out = torch.empty((rows_, k), dtype=dtype, device=w.raw.device)
    if rows_:
        raw, name, packed = rows(w)
        cfg = shape or for_device(raw.device).dequantize
        id_ptr = raw if ids is None else ids  # unread without ids
        kernels().dequant_kernel[(cdiv(rows_, cfg.bn), cdiv(k, cfg.bk))](
            raw, lut(raw.device), id_ptr, r0, out, rows_, n, k, raw.stride(0), out.stride(0),
            QT=name, PACKED=packed, G=w.qtype.scale_group, BR=cfg.bn, BK=cfg.bk, BY_ID=ids is not None,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    return out
