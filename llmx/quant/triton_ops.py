"""Triton matmul, embedding and dequantize on raw GGUF blocks (the GPU path of `llmx.quant`).

Weights stay as the uint8 rows of the GGUF file; the kernels (`llmx.quant.triton.kernels`) unpack
blocks in registers. triton is imported on first use, so importing this module costs nothing on
CPU-only installs. Under TRITON_INTERPRET=1 the same code runs on CPU tensors (the tests do that).

Which kernel runs (`pick_kernel`, by type and M = rows of x; measured on an H200, bench/RESULTS.md):
- M = 1, Q4_K, Q6_K and Q8_0: "dot8", x quantized to int8 per 32 values, then int8 dot products
  (dp4a) on the weight codes read as 32-bit words (`llmx.quant.triton.dot8`, llama.cpp's mmvq);
  1.4-1.8x the float GEMV's GPU time on an H200;
- M <= 4 (IQ4 types: 8): "gemv", fp32 FMAs on the unpacked codes, one program per few weight
  rows; its time grows with M, since every input row costs an FMA per weight.
- M < DEQUANT_MATMUL_MIN_M: "gemm", tiles dequantized in registers and multiplied with tl.dot on
  the tensor cores, autotuned per (type, M bucket, N, K); its time is flat in M up to its tile.
  Not for IQ4 types, whose per-code table lookups make it slower than the next path.
- larger M: "dequant", the weight dequantized a chunk of rows at a time (DEQUANT_CHUNK_BYTES) to
  fp16 (or x's dtype when that is fp16/bf16), then torch's matmul (cuBLAS, fp32 accumulation):
  faster here than the fused GEMM from M = 16 on (2.5-4x at M = 512, where it reaches 51-62% of
  the bf16 matrix rate for every type; a dense bf16 weight 82-94%). Float32 x is scaled per row
  into [-1, 1] and rounded to fp16 for it: a float32 matmul would run at the FP32 rate, about a
  twelfth of the half-precision tensor cores.

`prepare(w)` is an optional one-time repack at load, in the same bytes a row: for the types whose
fp16 block scales leave their codes 2-byte aligned (Q4_0, Q8_0, Q6_K, ...) each row's scales move
after its block bodies, so codes load as 16-byte vectors; Q4_K's 6-bit sub-block scales and mins
are regrouped by sub-block pair (`prepare_q4_k_scales`), so that the integer-dot GEMV takes a
pair's four apart with a few shifts. Every kernel reads both layouts exactly.

Output dtype is x's dtype; accumulation is always float32. GEMM multiplies in x's dtype (fp16 or
bf16 weight tiles; tf32 for float32 x).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

from llmx import settings
from llmx.errors import LlmxError

if TYPE_CHECKING:
    from llmx.quant.weight import QWeight

# Weights per unpack group: the granularity of each type's sub-block scales.
GROUP = {
    "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32,
    "Q2_K": 16, "Q3_K": 16, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16,
    "IQ4_NL": 32, "IQ4_XS": 32,
}  # fmt: skip
FLOAT_TYPES = ("F32", "F16", "BF16")
# Types `prepare` repacks: (bytes a block, fp16 fields a block, fields at the block's start?).
# The unpack helpers read the same facts (their `block_parts` calls); the tests check they agree.
SPLIT_FIELDS = {
    "Q4_0": (18, 1, True), "Q4_1": (20, 2, True), "Q5_0": (22, 1, True), "Q5_1": (24, 2, True),
    "Q8_0": (34, 1, True), "IQ4_NL": (18, 1, True),
    "Q2_K": (84, 2, False), "Q3_K": (110, 1, False), "Q6_K": (210, 1, False),
}  # fmt: skip
PREPARED_TYPES = (*SPLIT_FIELDS, "Q4_K")  # the types `prepare` repacks
KERNELS = ("dot8", "gemv", "gemm", "dequant")
GEMV_MAX_M = 8  # the GEMV kernel's limit (a static loop over input rows)
DOT8_UNIT = {"Q8_0": 32, "Q4_K": 256, "Q6_K": 256}  # integer-dot GEMV types: weights a block
DOT8_QUADS = {"Q8_0": 2, "Q4_K": 8, "Q6_K": 4}  # its partial sums a block (see dot8.gemv8_kernel)
DOT8_MAX_M = 1  # decode; a few rows are faster on "gemv" than on repeated integer-dot passes
DOT8_MAX_WEIGHTS = 3  # weights sharing one integer-dot launch (q/k/v)
DOT8_BY_DEFAULT = ("Q4_K", "Q6_K", "Q8_0")  # 1.4-1.7x "gemv" in GPU time on an H200 (bench/RESULTS.md)
# Half-precision weight rows dequantized at a time for "dequant": Llama-3-8B's FFN matrices (112 MiB)
# in one piece; 4096 x 14336 in two chunks of rows gave cuBLAS too few output tiles (H200: 148 us
# against 81 for the matmul alone, bench/RESULTS.md).
DEQUANT_CHUNK_BYTES = 128 << 20
DEQUANT_ROW_ALIGN = 256  # chunks of "dequant" are whole multiples of this many rows where they can be
DEQUANT_MATMUL_MIN_M = 16


@dataclass(frozen=True)
class SplitFields:
    """QWeight.packed marker: rows are in `prepare`'s layout (bodies first, then fp16 fields;
    Q4_K: scales by sub-block pair)."""

    def describe(self) -> str:
        return "block scales rearranged for the Triton kernels (16-byte aligned codes)"


SPLIT = SplitFields()


@dataclass(frozen=True)
class QuantizedX:
    """x [M, K] as the integer-dot GEMV reads it: int8 codes, a float32 scale per 32 values, and
    the code sums per 16 times their scale; made once and shared by the weights that multiply the same x."""

    q: torch.Tensor  # int8 [M, K]
    dx: torch.Tensor  # float32 [M, K/32]
    sums: torch.Tensor  # float32 [M, K/16]: dx * (sum of q) per 16


HalfX = tuple[torch.Tensor, torch.Tensor]  # float32 x as fp16 rows scaled into [-1, 1], and the scales


@dataclass(frozen=True)
class LaunchShape:
    """Launch shape of a kernel over weight rows: BN rows a program, BK weights a loop step (the
    GEMVs) or a program (dequantize), and its warps. `late_headers` (the integer-dot GEMV, Q4_K):
    a step's block headers are loaded as it is computed, from the L1 lines its codes brought in,
    not a step ahead with the codes: half the registers a thread, so twice the warps an SM.
    `max_registers` caps a thread's registers (ptxas' maxnreg; None: its own choice). `stagger`
    (the integer-dot GEMV, launched as a programmatic dependent): one program in `stagger` waits for
    the kernel before it and only then loads its weights, where the others load theirs first; when
    the wait ends, those programs' loads keep the memory busy while the rest compute what they
    loaded ahead (1: none waits first)."""

    bn: int
    bk: int
    num_warps: int
    late_headers: bool = False
    max_registers: int | None = None
    stagger: int = 1

    def __str__(self) -> str:
        """BN/BK/warps, then /late, /rN and /sN where set: the benchmarks' name for a shape, which
        `bench/kernels.py --shapes` reads back."""
        late = "/late" if self.late_headers else ""
        regs = f"/r{self.max_registers}" if self.max_registers else ""
        stagger = f"/s{self.stagger}" if self.stagger > 1 else ""
        return f"{self.bn}/{self.bk}/{self.num_warps}{late}{regs}{stagger}"


# The dequantize kernel's launch: 4 rows x 2048 weights a program on 4 warps was the best or within
# 5% of it for every type swept on an H200 (bench/kernels.py --dequant-sweep; 16 shapes, 10-20% apart).
DEQUANT_SHAPE = LaunchShape(4, 2048, 4)


# --- public API ---------------------------------------------------------------------------------


def linear(
    x: torch.Tensor,
    w: QWeight,
    kernel: str | None = None,
    gemv: LaunchShape | None = None,
    qx: QuantizedX | None = None,
    half: HalfX | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) @ W.T for W [N, K] -> [..., N] in x's dtype, plus `residual`
    ([..., N] in x's dtype) where given: the integer-dot GEMV adds it as it stores its output (a
    block's residual add then costs no kernel of its own), the other paths after.

    The kernel is chosen by type and M (the product of x's leading dims), see the module docstring;
    `kernel` (one of KERNELS) forces one and `gemv` the GEMV launch shape, for benchmarks. `qx` is
    x already quantized by `quantize_x`, `half` x already scaled to fp16 by `_half_rows` (both
    made once by `linear_many` for the weights that share x).
    """
    n, k = w.shape
    if x.shape[-1] != k:
        raise LlmxError(f"{_label(w)} {tuple(w.shape)} cannot multiply x of shape {tuple(x.shape)}")
    x2 = _unit_rows(x)
    m = x2.shape[0]
    choice = "float" if w.qtype.name in FLOAT_TYPES else kernel_for(w, m, kernel)
    if choice == "dot8":
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        res = None if residual is None else residual.reshape(m, n).contiguous()
        _gemv8(qx or attached_quantized(x) or quantize_x(x2), [w], [out], gemv, res)
        return out.reshape(*x.shape[:-1], n)
    y = _matmul(x2, w, choice, gemv, half).reshape(*x.shape[:-1], n)
    return y if residual is None else y.add_(residual)


def _matmul(
    x2: torch.Tensor, w: QWeight, choice: str, gemv: LaunchShape | None, half: HalfX | None
) -> torch.Tensor:
    """x2 [M, K] @ W.T -> [M, N] by `choice` (not the integer-dot GEMV), a new tensor."""
    (n, k), m = w.shape, x2.shape[0]
    if choice == "float":
        return torch.nn.functional.linear(x2, w.raw.to(x2.dtype))
    if choice == "dequant":
        return _dequant_matmul(x2, w, half)
    if choice == "gemv" and m > GEMV_MAX_M:
        raise LlmxError(f"the GEMV kernel takes at most {GEMV_MAX_M} rows of x, got {m}")
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    raw, name, packed = _raw(w)
    lut = _lut(raw.device)
    strides = (x2.stride(0), raw.stride(0), out.stride(0))
    if choice == "gemv":
        bm = 1 << (m - 1).bit_length()
        cfg = gemv or default_gemv(name, bm)
        _kernels().gemv_kernel[(_cdiv(n, cfg.bn),)](
            x2, raw, lut, out, m, n, k, *strides,
            QT=name, PACKED=packed, G=GROUP[name], BM=bm, BN=cfg.bn, BK=cfg.bk, num_warps=cfg.num_warps,
        )  # fmt: skip
    elif choice == "gemm":
        m_bucket = min(1 << (m - 1).bit_length(), 4096)

        def grid(meta: dict[str, Any]) -> tuple[int]:
            return (_cdiv(m, meta["BM"]) * _cdiv(n, meta["BN"]),)

        _gemm()[grid](x2, raw, lut, out, m, n, k, *strides, m_bucket, QT=name, PACKED=packed, G=GROUP[name])
    else:
        raise LlmxError(f"unknown kernel {choice!r}; choose one of {', '.join(KERNELS)}")
    return out


def linear_many(x: torch.Tensor, ws: list[QWeight]) -> list[torch.Tensor]:
    """[linear(x, w) for w in ws] for weights that multiply the same x (q/k/v, gate/up): x is
    quantized once for all the integer-dot GEMVs among them, and those of one type share launches."""
    x2 = _unit_rows(x)
    m = x2.shape[0]
    kernels = [kernel_for(w, m) for w in ws]
    dot8 = [kernel == "dot8" for kernel in kernels]
    if not any(dot8):
        half = None
        if "dequant" in kernels and x2.dtype not in (torch.float16, torch.bfloat16):
            half = _half_rows(x2)  # once for all of them
        return [linear(x, w, half=half) for w in ws]
    qx = attached_quantized(x) or quantize_x(x2)
    outs: dict[int, torch.Tensor] = {}
    groups: dict[tuple[str, int], list[int]] = {}  # integer-dot weights that one launch can serve
    for i, w in enumerate(ws):
        if dot8[i]:
            groups.setdefault((w.qtype.name, w.raw.stride(0)), []).append(i)
        else:
            outs[i] = linear(x, w)
    for members in groups.values():
        for part in (members[j : j + DOT8_MAX_WEIGHTS] for j in range(0, len(members), DOT8_MAX_WEIGHTS)):
            ys = [torch.empty((m, ws[i].shape[0]), dtype=x.dtype, device=x.device) for i in part]
            _gemv8(qx, [ws[i] for i in part], ys, None)
            for i, y in zip(part, ys, strict=True):
                outs[i] = y.reshape(*x.shape[:-1], ws[i].shape[0])
    return [outs[i] for i in range(len(ws))]


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as rows [M, K] with a unit stride along K, as the kernels read them (a view
    where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _gemv8(
    qx: QuantizedX,
    ws: list[QWeight],
    outs: list[torch.Tensor],
    gemv: LaunchShape | None,
    residual: torch.Tensor | None = None,
) -> None:
    """outs[i] [1, N_i] = x @ ws[i].T on the integer-dot GEMV, one launch for all (up to
    DOT8_MAX_WEIGHTS of one type and row width); with one weight, plus `residual` [1, N_0]."""
    assert residual is None or (len(ws) == 1 and residual.shape == outs[0].shape)
    raws = [_raw(w)[0] for w in ws]
    name, k = ws[0].qtype.name, ws[0].shape[1]
    cfg = gemv or default_dot8(name, k)
    unit = DOT8_UNIT[name]
    bu = max(1, cfg.bk // unit)
    row_words = 4 if raws[0].stride(0) % 16 == 0 else 1
    args = [(raw, out, w.shape[0]) for raw, out, w in zip(raws, outs, ws, strict=True)]
    args += [args[0][:2] + (0,)] * (DOT8_MAX_WEIGHTS - len(args))  # unused slots: no programs
    pdl = programmatic_launch(raws[0].device)
    _dot8().gemv8_kernel[(sum(_cdiv(w.shape[0], cfg.bn) for w in ws),)](
        qx.q, qx.dx, qx.sums, *(a for slot in args for a in slot), outs[0] if residual is None else residual,
        k, raws[0].stride(0) // (4 * row_words),
        QT=name, UNIT=unit, QUADS=DOT8_QUADS[name], BN=cfg.bn, BU=bu, NW=len(ws),
        ASM=not _interpreting(), EVEN=k % (bu * unit) == 0, ROW_WORDS=row_words, PDL=pdl,
        RES=residual is not None, LATE=cfg.late_headers, STAGGER=cfg.stagger, SCATTER4=scatter_end(name, cfg),
        num_warps=cfg.num_warps, launch_pdl=pdl, maxnreg=cfg.max_registers,
    )  # fmt: skip


def scatter_end(name: str, cfg: LaunchShape) -> bool:
    """Whether the integer-dot GEMV at `cfg` ends in `dot8.SCATTER4_ASM`'s reduce-scatter: Q4_K's
    programs of 4 rows and one 4096-weight step on 4 warps, whose threads hold one column of partial
    sums each (other types' 128-column shapes lay them out otherwise: `bench/ptx_gemv.py`'s end
    column), compiled (inline PTX, which the interpreter cannot run: it takes tl.sum's end)."""
    return name == "Q4_K" and (cfg.bn, cfg.bk, cfg.num_warps) == (4, 4096, 4) and not _interpreting()


def _dequant_matmul(x2: torch.Tensor, w: QWeight, half: HalfX | None = None) -> torch.Tensor:
    """x2 [M, K] @ W.T on the half-precision tensor cores, W dequantized a chunk of rows at a time
    (so the transient buffer stays under DEQUANT_CHUNK_BYTES); the result in x2's dtype. `half` is
    float32 x2 already scaled into fp16 (`_half_rows`, shared by the weights that take the same x).

    A prompt runs this for every weight of every layer, so it keeps to few launches: one to scale
    x into fp16, one dequantize and one matmul a chunk, one multiply back to x's dtype."""
    m, k = x2.shape
    n = w.shape[0]
    scale = None
    if x2.dtype in (torch.float16, torch.bfloat16):
        xh = x2
    else:  # per-row scaling keeps any activation inside fp16's range
        xh, scale = half or _half_rows(x2)
    step = max(1, DEQUANT_CHUNK_BYTES // (2 * k))
    if step >= DEQUANT_ROW_ALIGN:  # whole tiles of the matmul: 4096 x 14336 took 2340-row chunks
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


def _half_rows(x2: torch.Tensor) -> HalfX:
    """x2 [M, K] float32 as fp16 rows scaled into [-1, 1], and the scales [M, 1] (float32)."""
    m, k = x2.shape
    xh = torch.empty((m, k), dtype=torch.float16, device=x2.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x2.device)
    _kernels().half_rows_kernel[(m,)](x2, xh, scale, k, x2.stride(0), BK=1024, num_warps=4)
    return xh, scale


def quantize_x(x2: torch.Tensor) -> QuantizedX:
    """x2 [M, K] (K a multiple of 32, unit stride) quantized for the integer-dot GEMV."""
    m, k = x2.shape
    qx = empty_quantized(m, k, x2.device)
    groups = 4
    grid = (m, _cdiv(k // 32, groups))
    _dot8().quantize_x_kernel[grid](x2, qx.q, qx.dx, qx.sums, k, x2.stride(0), NG=groups)
    return qx


def empty_quantized(m: int, k: int, device: torch.device) -> QuantizedX:
    """Buffers for M rows of K values quantized (by `quantize_x`, or by a kernel that produces them)."""
    return QuantizedX(
        torch.empty((m, k), dtype=torch.int8, device=device),
        torch.empty((m, k // 32), dtype=torch.float32, device=device),
        torch.empty((m, k // 16), dtype=torch.float32, device=device),
    )


def wants_quantized(x: torch.Tensor) -> bool:
    """Whether a kernel producing x [..., K] should also write it quantized (`attach_quantized`):
    x is a decode step's activation on a GPU, as the integer-dot GEMV takes it."""
    k = x.shape[-1]
    return x.is_cuda and k % 32 == 0 and x.numel() // max(k, 1) <= DOT8_MAX_M


def quantized_output(out: torch.Tensor, quantize: bool | None = None) -> QuantizedX | None:
    """Buffers for a kernel to write its output `out` [..., K] quantized into (`dot8.store_quantized`),
    attached to `out`; where asked (None: `wants_quantized`) and K is a multiple of 32, else None."""
    k = out.shape[-1]
    if not (wants_quantized(out) if quantize is None else quantize and k % 32 == 0):
        return None
    qx = empty_quantized(out.numel() // k, k, out.device)
    attach_quantized(out, qx)
    return qx


def quantized_pointers(out: torch.Tensor, qx: QuantizedX | None) -> tuple[torch.Tensor, ...]:
    """`qx`'s buffers as kernel arguments (`out` stands in for them, unread, without qx)."""
    return (out, out, out) if qx is None else (qx.q, qx.dx, qx.sums)


def attach_quantized(x: torch.Tensor, qx: QuantizedX) -> None:
    """Record on x that `qx` is its quantized form (written by the kernel that produced x), for the
    GEMVs that take x next. Views and reshapes of x are new objects without it, and x must not be
    written in place afterwards (llmx writes no activation in place once a kernel produced it)."""
    setattr(x, _QUANTIZED, qx)


def attached_quantized(x: torch.Tensor) -> QuantizedX | None:
    return getattr(x, _QUANTIZED, None)


_QUANTIZED = "llmx_quantized"


def embedding(ids: torch.Tensor, w: QWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` (any shape, integer) of W [N, K], dequantized: [*ids.shape, K] in `dtype`.

    Only the selected rows are read; with dtype float32 the values equal gguf-py's bit for bit.
    """
    n, k = w.shape
    if w.qtype.name in FLOAT_TYPES:
        return w.raw[ids].to(dtype)
    flat = ids.reshape(-1).to(device=w.raw.device, dtype=torch.int64)
    return _dequant(w, flat, 0, flat.numel(), dtype).reshape(*ids.shape, k)


def dequantize_rows(
    w: QWeight, r0: int, r1: int, dtype: torch.dtype = torch.float32, shape: LaunchShape | None = None
) -> torch.Tensor:
    """Rows r0..r1 of W [N, K] dequantized, [r1 - r0, K] in `dtype` (float32: bit-exact with gguf-py).
    `shape` forces the kernel's launch shape (benchmarks)."""
    if w.qtype.name in FLOAT_TYPES:
        return w.raw[r0:r1].to(dtype)
    return _dequant(w, None, r0, r1 - r0, dtype, shape)


def dequantize(w: QWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight W [N, K] in `dtype` (float32: bit-exact with gguf-py)."""
    return dequantize_rows(w, 0, w.shape[0], dtype)


def _dequant(
    w: QWeight,
    ids: torch.Tensor | None,
    r0: int,
    rows: int,
    dtype: torch.dtype,
    shape: LaunchShape | None = None,
) -> torch.Tensor:
    """[rows, K] in `dtype`: rows `ids` of W, or when `ids` is None rows r0..r0+rows."""
    n, k = w.shape
    out = torch.empty((rows, k), dtype=dtype, device=w.raw.device)
    if rows:
        raw, name, packed = _raw(w)
        cfg = shape or DEQUANT_SHAPE
        id_ptr = raw if ids is None else ids  # unread without ids
        _kernels().dequant_kernel[(_cdiv(rows, cfg.bn), _cdiv(k, cfg.bk))](
            raw, _lut(raw.device), id_ptr, r0, out, rows, n, k, raw.stride(0), out.stride(0),
            QT=name, PACKED=packed, G=GROUP[name], BR=cfg.bn, BK=cfg.bk, BY_ID=ids is not None,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    return out


def prepare(w: QWeight) -> QWeight:
    """`w` with its rows repacked for these kernels where that helps, else `w` itself.

    For the SPLIT_FIELDS types each row of blocks [fields | body] (or [body | fields]) becomes
    [body 0 | body 1 | ... | fields of block 0 | fields of block 1 | ...]; Q4_K blocks keep their
    place and get their scale bytes regrouped (`prepare_q4_k_scales`). Either way the same row
    width, so sizes and offsets elsewhere do not change. Costs one copy of the tensor.
    """
    if w.qtype.name not in PREPARED_TYPES or w.packed is SPLIT:
        return w
    raw, name, _ = _raw(w)
    if name == "Q4_K":
        packed = prepare_q4_k_scales(raw.reshape(raw.shape[0], -1, 144)).reshape(raw.shape)
    else:
        nbytes, nf, fields_first = SPLIT_FIELDS[name]
        blocks = raw.reshape(raw.shape[0], -1, nbytes)
        cut = 2 * nf if fields_first else nbytes - 2 * nf
        head, tail = blocks[:, :, :cut], blocks[:, :, cut:]
        body, fields = (tail, head) if fields_first else (head, tail)
        packed = torch.cat([body.reshape(raw.shape[0], -1), fields.reshape(raw.shape[0], -1)], dim=1)
    out = copy.copy(w)
    out.raw, out.packed = packed, SPLIT
    return out


def prepare_q4_k_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks [..., 144] (uint8) with bytes 4-15, the 6-bit scales sc and mins m of sub-blocks
    0-7, regrouped by pair p = j // 2 (sub-blocks 2p and 2p + 1, which one quad of the integer-dot
    GEMV meets):
        byte 4 + 2p: low 4 bits of sc[2p] (bits 0-3) and sc[2p + 1] (bits 4-7)
        byte 5 + 2p: the same for m[2p] and m[2p + 1]
        byte 12 + p: their top 2 bits, sc[2p], sc[2p + 1], m[2p], m[2p + 1] at bits 0-1, 2-3, 4-5, 6-7
    (`kquants.paired_scale_min` reads them). The GGUF order (`kquants.k4_scale_min`) puts scales
    0-3 and 4-7 in different bytes and bits, which cost the GEMV ~30 instructions a quad."""
    s = blocks[..., 4:16]  # uint8 throughout: no value below exceeds a byte, and the load's transient
    lo, hi, mid = s[..., 0:4], s[..., 4:8], s[..., 8:12]  # memory stays a fraction of the tensor's
    sc = torch.cat([lo & 63, (mid & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([hi & 63, (mid >> 4) | ((hi >> 6) << 4)], dim=-1)
    sc0, sc1, mn0, mn1 = sc[..., 0::2], sc[..., 1::2], mn[..., 0::2], mn[..., 1::2]  # [..., pair]
    lows = torch.stack([(sc0 & 15) | ((sc1 & 15) << 4), (mn0 & 15) | ((mn1 & 15) << 4)], dim=-1)
    out = blocks.clone()
    out[..., 4:12] = lows.flatten(-2)
    out[..., 12:16] = (sc0 >> 4) | ((sc1 >> 4) << 2) | ((mn0 >> 4) << 4) | ((mn1 >> 4) << 6)
    return out


# --- launch details -----------------------------------------------------------------------------


def pick_kernel(name: str, m: int) -> str:
    """The fastest kernel measured for type `name` at M rows of x (see the module docstring)."""
    if name in DOT8_BY_DEFAULT and m <= DOT8_MAX_M:
        return "dot8"
    iq4 = name.startswith("IQ4")
    if m <= (GEMV_MAX_M if iq4 else 4):
        return "gemv"
    return "dequant" if iq4 or m >= DEQUANT_MATMUL_MIN_M else "gemm"


# Best M = 1 launch shapes of an H200 sweep (bench/kernels.py --sweep) on both Llama-3-8B FFN shapes.
_GEMV_M1 = {"Q8_0": LaunchShape(2, 512, 2), "Q6_K": LaunchShape(2, 512, 2), "Q4_K": LaunchShape(8, 1024, 4)}


def default_gemv(name: str, bm: int) -> LaunchShape:
    """GEMV launch shape for type `name` and BM input rows.

    Two warps over 4 rows x 512 weights give each thread 32 codes a step (fewer and the per-group
    scale and reduction work dominates) while leaving N/4 programs to hide memory latency; the
    swept types use their measured best at M = 1.
    """
    if bm == 1 and name in _GEMV_M1:
        return _GEMV_M1[name]
    return LaunchShape(bn=4, bk=512 if bm == 1 else 256, num_warps=2)


def kernel_for(w: QWeight, m: int, kernel: str | None = None) -> str:
    """The kernel that multiplies `w` by M = m rows of x: `kernel` if given, else `pick_kernel`'s;
    "dot8" becomes "gemv" for rows it cannot read (see `_dot8_reads`)."""
    choice = kernel or pick_kernel(w.qtype.name, m)
    return "gemv" if choice == "dot8" and not _dot8_reads(w, m) else choice


def default_dot8(name: str, k: int) -> LaunchShape:
    """Integer-dot GEMV launch shape (M = 1) for rows of k weights: BN rows a program, BK weights a
    step (a multiple of the type's block); the best on both Llama-3-8B FFN shapes in an H200 sweep
    timed on the GPU alone (bench/kernels.py --sweep, bench/RESULTS.md).

    Q4_K runs 4 rows a program, its headers loaded late on short rows (a step's headers from the L1
    lines its codes brought in: half the registers) but not on long ones (the FFN's down
    projection, 4096 x 14336: 3404-3426 GB/s against 2655-2666 late), where a program's 7 steps keep
    enough loads in flight and the late loads would wait on the L1. Rows of exactly 4096 weights
    (Llama-3-8B's attention projections, gate and up) are one step on 4 warps: each warp computes
    one slice of the program's rows once, where 2 steps on 2 warps (the same registers and
    instructions a thread) computed two slices in turn, and all of a program's loads go out before
    it waits on x's kernel (PDL), not half; 14336 x 4096: 3266-3289 GB/s against 3017-3036, a decode
    step's GEMVs 1553 against 1601 us. Those programs end in a reduce-scatter (`scatter_end`),
    capped at 64 registers (Triton 3.6 takes 71 with it, and an SM holds 7 programs instead of 8;
    uncapped, one probe process: 3374-3388 GB/s against 3449-3465 with tl.sum's end): trees
    alternating, 14336 x 4096 3442-3449 GB/s against 3363-3364 with tl.sum's end, the decode step's
    graph 1.842-1.847 ms against 1.891-1.900. Other short rows take 2 steps of 2048 on 2 warps
    (3240-3273 GB/s against 2785-2794 for 2 rows on 1 warp, on another machine).

    Q6_K runs 2 rows on one warp, its registers capped at 128 (ptxas takes 123 instead of 126 and
    schedules the loop in 307 instructions instead of 318): 4096 x 14336 3415-3519 GB/s against
    3257-3342, 14336 x 4096 3129-3335 against 3046-3320. 4 rows a program were 3% faster on short
    rows on one machine and up to 10% slower on another; one step of 4096 on 2-8 warps was slower.
    One program in 4 waits for the kernel before it ahead of its loads (`LaunchShape.stagger`; one
    process timing both): 14336 x 4096 3488-3494 GB/s against 3445, 4096 x 14336 3755-3756 against
    3688-3703 (one in 2 or 3 lost on the long rows; Q4_K's one-step rows lost 2-4% at every stagger
    tried).

    Q8_0 runs 2 rows a program: rows of 4096 weights as one step on 2 warps, long rows in steps of
    2048 on one warp capped at 128 registers, other rows 2 steps of 2048 on 2 warps. Trees
    alternating on one machine: 14336 x 4096 3908-3946 GB/s against 3823-3836, 4096 x 14336
    3915-3964 against 3608-3637 (91-93% of the copy against 84-85%)."""
    if k >= DOT8_LONG_ROW and name in _DOT8_M1_LONG_ROWS:
        return _DOT8_M1_LONG_ROWS[name]
    one_step = _DOT8_M1_ONE_STEP.get(name)
    if one_step is not None and k == one_step.bk:
        return one_step
    return _DOT8_M1.get(name, LaunchShape(4, 1024, 4))


_DOT8_M1 = {
    "Q8_0": LaunchShape(2, 2048, 2),
    "Q4_K": LaunchShape(4, 2048, 2, late_headers=True),
    "Q6_K": LaunchShape(2, 2048, 1, max_registers=128, stagger=4),
}
_DOT8_M1_ONE_STEP = {  # for rows of exactly bk weights
    "Q4_K": LaunchShape(4, 4096, 4, late_headers=True, max_registers=64),
    "Q8_0": LaunchShape(2, 4096, 2),
}
DOT8_LONG_ROW = 8192  # weights a row from which `_DOT8_M1_LONG_ROWS` applies
_DOT8_M1_LONG_ROWS = {"Q4_K": LaunchShape(4, 2048, 2), "Q8_0": LaunchShape(2, 2048, 1, max_registers=128)}


def _dot8_reads(w: QWeight, m: int) -> bool:
    """Whether the integer-dot GEMV takes `w` at M = m: it reads `prepare`d rows (Q6_K's and Q8_0's
    codes aligned, Q4_K's scales by pair) as 32-bit words, so every row must start 4-byte aligned
    (an even number of blocks a row for Q8_0)."""
    name = w.qtype.name
    return (
        name in DOT8_UNIT
        and m <= DOT8_MAX_M
        and w.packed is SPLIT
        and w.raw.stride(0) % 4 == 0
        and w.raw.data_ptr() % 4 == 0
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _raw(w: QWeight) -> tuple[torch.Tensor, str, bool]:
    """The raw [N, row_bytes] uint8 rows of `w`, checked; its type name; whether `prepare`d."""
    name = w.qtype.name
    if name not in GROUP:
        raise LlmxError(f"{_label(w)} has no Triton kernel; types with one: {', '.join(GROUP)}")
    raw = w.raw
    n, k = w.shape
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[0] != n or raw.stride(1) != 1:
        raise LlmxError(f"{_label(w)}: raw blocks must be uint8 [{n}, row bytes] with contiguous rows")
    if raw.shape[1] != w.qtype.row_bytes(k):
        raise LlmxError(f"{_label(w)}: {raw.shape[1]} bytes a row, {k} weights need {w.qtype.row_bytes(k)}")
    return raw, name, w.packed is SPLIT


def _label(w: QWeight) -> str:
    return f"{w.name or 'weight'} ({w.qtype.name})"


@cache
def _kernels() -> Any:
    from llmx.quant.triton import kernels

    return kernels


@cache
def _dot8() -> Any:
    from llmx.quant.triton import dot8

    return dot8


@cache
def _lut(device: torch.device) -> torch.Tensor:
    """IQ4_NL/IQ4_XS code points on `device` (every kernel takes the pointer; only IQ types read it)."""
    from gguf.quants import IQ4_NL

    return torch.tensor(IQ4_NL.kvalues, dtype=torch.float32, device=device)


@cache
def _gemm() -> Any:
    """The GEMM kernel, autotuned on first use per (type, M bucket, N, K, dtypes)."""
    import triton

    def config(bm: int, bn: int, bk: int, warps: int, stages: int) -> triton.Config:
        return triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=warps, num_stages=stages)

    if _interpreting():
        # The interpreter cannot time configs; small tiles keep it quick.
        configs = [config(16, 32, 64, 4, 1)]
    elif not settings.triton_autotune():
        configs = [config(64, 128, 64, 4, 4)]  # one compile per type: for tests
    else:
        configs = [
            config(128, 128, 64, 8, 3),
            config(128, 256, 64, 8, 3),
            config(64, 128, 64, 4, 4),
            config(128, 128, 128, 8, 3),
            config(16, 64, 128, 4, 3),  # small M: more programs, less padding
            config(32, 128, 64, 4, 3),
        ]

    def bench(fn: Any, quantiles: Any) -> Any:
        # Short timings: tuning runs once per (type, M bucket, N, K), inside the first call. Not
        # triton.testing.do_bench: it allocates a 256 MB buffer to flush the L2 between calls, a
        # memory peak the plan would have to reserve on every GPU for one first call.
        fn()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ordered = torch.tensor(times).quantile(torch.tensor(quantiles or [0.5])).tolist()
        return ordered if quantiles else ordered[0]

    key = ["M_BUCKET", "N", "K", "QT", "PACKED"]
    return triton.autotune(configs=configs, key=key, do_bench=bench)(_kernels().gemm_kernel)


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on `device` may overlap their predecessor's tail (programmatic dependent
    launch, Hopper and later): the integer-dot GEMV starts loading its weights while the kernel that
    writes its x finishes, and waits for it (`gdc_wait`) only before reading x. Off under the
    interpreter, and with LLMX_PDL=0."""
    if _interpreting() or device.type != "cuda" or not settings.programmatic_launch():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _interpreting() -> bool:
    return settings.triton_interpreting()
