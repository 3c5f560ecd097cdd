"""QWeight, the one weight object of the runtime, and `linear`, the one place that picks a kernel.

A QWeight keeps a tensor's GGUF bytes as they are (uint8 rows of blocks, or a float tensor for
F32/F16/BF16) on its device. `linear(x, w)` chooses the kernel from (type, device, M):

- CUDA:  `llmx.quant.triton_ops.linear` (fused dequant GEMV/GEMM); "emulated" if Triton is missing;
- CPU, Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K matrices: kept as GGUF's blocks and multiplied by the native kernels
  (`cpu_native.py`): one pass over the weights for up to 8 rows of x (and one call for the matrices
  that share x), else chunks of rows dequantized into float32 for `torch.mm`; where no C compiler is
  at hand, the packed path below;
- CPU, other quantized matrices (repacked at load by `prepare_cpu`, see `cpu_pack.py`): up to GEMV_MAX_M
  rows of x, the compiled GEMV on the packed codes, row by row; more rows (prompts), the packed
  rows dequantized a chunk at a time into float32 and multiplied by MKL (`torch.mm`);
- CPU otherwise (float types, LLMX_KERNEL=dequant): the same chunks, dequantized from the raw blocks;
- "emulated": the whole weight dequantized, then one dense float32 matmul; the numerics reference,
  forced for every call with LLMX_KERNEL=emulated (or per call with `kernel="emulated"`).

Every CPU path computes in float32 from the exact weights, so they differ only in summation order.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from llmx import settings
from llmx.errors import LlmxError
from llmx.quant import QType
from llmx.quant import cpu_native as N
from llmx.quant import cpu_pack as P
from llmx.quant import torch_ops as T

KERNELS = settings.CPU_KERNELS
KERNEL = settings.cpu_kernel()  # read once; `linear(..., kernel=)` overrides per call
GEMV_MAX_M = 8  # rows of x up to which the fused GEMV beats dequantize + dense matmul (bench/cpu_matmul.py)
DEQUANT_CHUNK_BYTES = 4 << 20  # float32 rows dequantized at a time: big enough for mm, small enough for L3


@dataclass
class QWeight:
    """A weight as stored in the GGUF, on its device.

    raw:    uint8 [rows, row_bytes] raw blocks, or a float tensor of `shape` for F32/F16/BF16
    qtype:  its GGML type
    shape:  logical row-major shape; (out_features, in_features) for a matrix
    packed: a device form built once at load, or None: cpu_pack.PackedCodes from `prepare_cpu`,
            triton_ops.SPLIT (raw rows rearranged) from `triton_ops.prepare`
    joined: set by `linear_many` when it joined this weight's packed form with its siblings'
    native: the native GEMV call prepared for this weight, alone or first of the weights sharing x
    """

    raw: torch.Tensor
    qtype: QType
    shape: tuple[int, ...]
    name: str = ""
    packed: object | None = None
    joined: Joined | None = field(default=None, repr=False)
    native: tuple[tuple[QWeight, ...], N.Gemv] | None = field(default=None, repr=False)

    def describe(self) -> str:
        """How this weight is computed on the CPU, for the load report: "Q4_1 -> 4-bit codes, ..."."""
        if _native(self):
            return f"{self.qtype.name} (GGUF blocks, native kernel)"
        if not isinstance(self.packed, P.PackedCodes):
            return f"{self.qtype.name} (dequantized per chunk)"
        return f"{self.qtype.name} -> {self.packed.describe()}"


@dataclass(eq=False)
class Joined:
    """Packed weights that multiply the same x, concatenated along N so that one kernel computes them.

    members: the QWeights, in order; each one's `packed` is now a row view of `packed`
    sizes:   their output features, to split the joined result
    """

    members: tuple[QWeight, ...]
    packed: P.PackedCodes
    sizes: list[int]


def linear(
    x: torch.Tensor, w: QWeight, kernel: str | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] float32 @ W^T for W [out, in] -> [..., out] float32, computed on W's device;
    plus `residual` [..., out] where given (on a GPU inside the GEMV where it can be).

    `kernel` forces one of KERNELS for this call (tests, benchmarks); None uses LLMX_KERNEL.
    """
    n, k = w.shape
    if x.shape[-1] != k:
        raise LlmxError(f"{w.name or 'weight'} {w.shape} cannot multiply x of shape {tuple(x.shape)}")
    choice = kernel or KERNEL
    flat = x.dim() == 2  # a decode step's x: no reshapes (each costs about a microsecond)
    x2 = x if flat else x.reshape(-1, k)
    if choice == "emulated":
        y = x2 @ dequantize(w).t()
    elif w.raw.is_cuda:  # x keeps its shape; the integer-dot GEMV adds the residual as it stores
        return _cuda(x, w, residual)
    elif (
        choice in ("auto", "packed")
        and x2.shape[0] <= N.MAX_ROWS
        and (call := _native_call((w,))) is not None
    ):
        y = call(x2)
    elif choice in ("auto", "packed") and x2.shape[0] > N.MAX_ROWS and _native(w):  # fewer: above
        y = _native_matmul(x2, w)
    elif isinstance(w.packed, P.PackedCodes) and choice in ("auto", "packed"):
        y = _packed_matmul(x2.contiguous(), w.packed)
    elif choice == "packed":
        raise LlmxError(f"{w.name or 'weight'} ({w.qtype.name}) has no packed CPU form; see prepare_cpu")
    else:
        y = _dequant_matmul(x2, w)
    y = y if flat else y.reshape(*x.shape[:-1], n)
    return y if residual is None else y.add_(residual)


def linear_many(x: torch.Tensor, ws: Sequence[QWeight], kernel: str | None = None) -> list[torch.Tensor]:
    """[linear(x, w) for w in ws] (e.g. q/k/v, or gate/up), in one kernel call where possible.

    CPU weights packed alike are joined on the first call (their packed forms become row views of
    one concatenation: no extra memory), which saves a call per extra weight at every token; the
    results are then views of one [..., sum(out)] tensor. On a GPU, x is quantized once for all the
    integer-dot GEMVs among them.
    """
    if (kernel or KERNEL) == "auto" and all(w.raw.is_cuda for w in ws):
        return _cuda_many(x, ws)
    k = ws[0].shape[1]
    rows = x.numel() // max(x.shape[-1], 1)
    call = _native_call(ws) if (kernel or KERNEL) in ("auto", "packed") and rows <= N.MAX_ROWS else None
    if call is not None and x.shape[-1] == k:
        outs = call(x if x.dim() == 2 else x.reshape(-1, k)).split_with_sizes(call.sizes, dim=1)
        return list(outs) if x.dim() == 2 else [y.reshape(*x.shape[:-1], -1) for y in outs]
    joined = ws[0].joined
    if (
        joined is None
        or len(joined.members) != len(ws)
        or any(a is not b for a, b in zip(joined.members, ws, strict=False))
    ):
        joined = _join(ws)
    if joined is None or (kernel or KERNEL) not in ("auto", "packed"):
        return [linear(x, w, kernel) for w in ws]
    k = ws[0].shape[1]
    if x.shape[-1] != k:
        raise LlmxError(f"{ws[0].name or 'weight'} {ws[0].shape} cannot multiply x of shape {tuple(x.shape)}")
    y = _packed_matmul(x.reshape(-1, k).contiguous(), joined.packed)
    return list(y.reshape(*x.shape[:-1], -1).split(joined.sizes, dim=-1))


def swiglu(x: torch.Tensor, gate: QWeight, up: QWeight, down: QWeight) -> torch.Tensor | None:
    """down(silu(gate(x)) * up(x)) in one native call for a decode step's x [M, K] (M <= MAX_ROWS)
    when all three matrices take the native kernels (`cpu_native.Gemv.swiglu`); None otherwise."""
    if KERNEL not in ("auto", "packed") or x.dim() != 2 or x.shape[0] > N.MAX_ROWS or not x.is_cpu:
        return None
    gate_up, down_call = _native_call((gate, up)), _native_call((down,))
    if gate_up is None or down_call is None or gate.shape[0] != up.shape[0] or down.shape[1] != gate.shape[0]:
        return None
    return gate_up.swiglu(x, down_call)


def _join(ws: Sequence[QWeight]) -> Joined | None:
    """Concatenate the packed forms of `ws` along N, or None when they are not all packed alike."""
    pks = [w.packed for w in ws]
    if len(ws) < 2 or not all(isinstance(p, P.PackedCodes) for p in pks):
        return None
    first = pks[0]
    alike = all(
        p.codes.dtype == first.codes.dtype
        and p.codes.shape[1:] == first.codes.shape[1:]
        and (p.offset is None) == (first.offset is None)
        for p in pks
    )
    if not alike:
        return None
    offsets = None if first.offset is None else torch.cat([p.offset for p in pks])
    packed = P.PackedCodes(torch.cat([p.codes for p in pks]), torch.cat([p.scale for p in pks]), offsets)
    joined = Joined(tuple(ws), packed, [p.codes.shape[0] for p in pks])
    r0 = 0
    for w, size in zip(ws, joined.sizes, strict=True):  # each weight keeps working alone, on views
        w.packed, w.joined = packed.rows(r0, r0 + size), joined
        r0 += size
    return joined


def embedding(ids: torch.Tensor, w: QWeight) -> torch.Tensor:
    """Rows `ids` (integer, any shape) of the table W [rows, cols] -> float32 [*ids.shape, cols]."""
    cols = w.shape[-1]
    if w.raw.is_floating_point():
        return w.raw[ids.to(w.raw.device)].float()
    if _triton_layout(w):
        from llmx.quant import triton_ops

        return triton_ops.embedding(ids.to(w.raw.device), w)
    if _native_blocks(w):  # a repacked tied table keeps its raw rows for lookups
        flat = ids.reshape(-1).to(device="cpu", dtype=torch.long)
        return N.embedding_rows(w.raw, w.qtype, flat, cols).reshape(*ids.shape, cols)
    return T.embedding_rows(w.raw, w.qtype, cols, ids).reshape(*ids.shape, cols)


def dequantize(w: QWeight) -> torch.Tensor:
    """The whole weight as float32 of `w.shape`, on its device (bit-exact with gguf-py)."""
    if _triton_layout(w):
        from llmx.quant import triton_ops

        return triton_ops.dequantize(w)
    return T.dequantize(w.raw, w.qtype).reshape(w.shape)


def _triton_layout(w: QWeight) -> bool:
    """A CUDA weight whose rows `triton_ops.prepare` rearranged: only Triton's kernels read it."""
    return w.raw.device.type == "cuda" and w.packed is not None


def prepare_cpu(w: QWeight, repack: bool = True) -> QWeight:
    """Build the CPU packed form once at load when the type allows it and the native kernels do not
    take it (they read the raw blocks); the raw bytes stay for `embedding`.

    After repacking, the raw bytes' pages are handed back to the kernel (a tied embedding table reads
    its rows back on demand), so an mmap-backed weight does not count twice in the process's memory.
    """
    if not repack or w.raw.device.type != "cpu" or _native(w) or not P.packable(w.qtype, w.shape):
        return w
    w.packed = P.pack(w.raw, w.qtype)
    P.release_pages(w.raw)
    P.compiled_kernels()  # load (or build once) the GEMV kernels now rather than at the first token
    return w


def _native(w: QWeight) -> bool:
    """A CPU matrix the native kernels multiply as GGUF stores it (`cpu_native`; never repacked)."""
    return w.packed is None and _native_blocks(w)


def _native_blocks(w: QWeight) -> bool:
    """Whether `w.raw` holds GGUF blocks on the CPU that the native kernels read."""
    cpu_blocks = w.raw.device.type == "cpu" and w.raw.is_contiguous()
    return cpu_blocks and N.supports(w.qtype, w.shape) and N.available()


def _native_call(ws: Sequence[QWeight]) -> N.Gemv | None:
    """The native GEMV for weights sharing x, all `_native` with the same K, prepared on the first
    weight the first time (a weight is first of one group in a model: q of q/k/v, gate of gate/up)
    and again if a weight's `raw` was replaced (op offload pins it); None where they do not all
    take it."""
    cached = ws[0].native
    if cached is not None and _still_prepared(cached, ws):
        return cached[1]
    k = ws[0].shape[1]
    if len(ws) > N.MAX_WEIGHTS or not all(_native(w) and w.shape[1] == k for w in ws):
        return None
    call = N.Gemv([(w.raw, w.qtype) for w in ws])
    ws[0].native = (tuple(ws), call)
    return call


def _still_prepared(cached: tuple[tuple[QWeight, ...], N.Gemv], ws: Sequence[QWeight]) -> bool:
    """Whether a prepared call is for exactly these weights and their current raws (a decode step asks
    some hundred times: one weight, the common case, is checked without building iterators)."""
    members, call = cached
    if len(ws) == 1:
        return len(members) == 1 and members[0] is ws[0] and call.raws[0] is ws[0].raw
    return (
        len(members) == len(ws)
        and all(map(operator.is_, members, ws))
        and all(map(operator.is_, call.raws, (w.raw for w in ws)))
    )


def _native_matmul(x2: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x2 [M, K] @ W^T on the GGUF blocks for more rows than a GEMV call takes: W dequantized in chunks
    of rows for `torch.mm` (fewer rows take `_native_call`)."""
    n, k = w.shape
    buf = _scratch(min(n, _chunk_rows(k)) * k)
    return _chunked_matmul(
        x2, n, lambda r0, r1: N.dequantize_rows(w.raw, w.qtype, r0, r1, k, buf[: (r1 - r0) * k].view(-1, k))
    )


def _packed_matmul(x2: torch.Tensor, pk: P.PackedCodes) -> torch.Tensor:
    """x2 [M, K] @ W^T from the packed form: the compiled GEMV per row for few rows, else dense chunks."""
    m, k = x2.shape
    gemv = pk.gemv
    if gemv is not None and m == 1:
        return gemv(x2)
    if gemv is not None and m <= GEMV_MAX_M:
        return torch.cat([gemv(x2[i : i + 1]) for i in range(m)])
    buf = _scratch(min(pk.scale.shape[0], _chunk_rows(k)) * k)
    return _chunked_matmul(
        x2,
        pk.scale.shape[0],
        lambda r0, r1: P.dequantize_into(pk.rows(r0, r1), buf[: (r1 - r0) * k].view(-1, k)),
    )


def _dequant_matmul(x2: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x2 [M, K] @ W^T with W dequantized from its raw blocks a chunk of rows at a time."""
    if w.qtype.name == "F32":
        return x2 @ w.raw.t()
    return _chunked_matmul(x2, w.shape[0], lambda r0, r1: T.dequantize(w.raw[r0:r1], w.qtype))


def _chunked_matmul(x2: torch.Tensor, n: int, rows_of_w: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """x2 [M, K] @ W^T -> [M, N], where rows_of_w(r0, r1) is W[r0:r1] in float32."""
    step = _chunk_rows(x2.shape[1])
    if step >= n:  # one chunk: no need for the transposed output
        return x2 @ rows_of_w(0, n).t()
    # y^T, so that each chunk of W's rows writes a contiguous slice
    out_t = torch.empty(n, x2.shape[0], device=x2.device)
    x_t = x2.t()
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        torch.mm(rows_of_w(r0, r1), x_t, out=out_t[r0:r1])
    return out_t.t().contiguous()


def _chunk_rows(k: int) -> int:
    return max(16, DEQUANT_CHUNK_BYTES // (4 * k))


_SCRATCH = threading.local()  # a reused float32 buffer per thread: fresh large allocations page-fault


def _scratch(numel: int) -> torch.Tensor:
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < numel:
        # a normal tensor even when first needed under inference_mode: it is reused outside it too
        with torch.inference_mode(False):
            buf = _SCRATCH.buf = torch.empty(numel)
    return buf


def _cuda_many(x: torch.Tensor, ws: Sequence[QWeight]) -> list[torch.Tensor]:
    try:
        from llmx.quant import triton_ops
    except ImportError:
        return [linear(x, w) for w in ws]
    return triton_ops.linear_many(x, list(ws))


def _cuda(x: torch.Tensor, w: QWeight, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernels, or the emulated path where Triton cannot be imported. x keeps its shape
    (and so any quantized form a kernel attached to it, see `triton_ops.attach_quantized`)."""
    try:
        from llmx.quant import triton_ops
    except ImportError:
        y = x @ dequantize(w).t()
        return y if residual is None else y.add_(residual)
    return triton_ops.linear(x, w, residual=residual)
