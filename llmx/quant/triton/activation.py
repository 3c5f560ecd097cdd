"""Activations in the forms the matmuls read: int8 per 32 values for the integer-dot GEMV, fp16 rows
for the half-precision matmul, and the owner of a decode step's already quantized activation.

The kernels that produce a decode step's GEMV inputs on a GPU (RMSNorm, the SiLU gate, attention's
combine) write their output quantized as well (`quantized_output`): the GEMV that takes it next then
spends no launch on quantizing it. The model code between them passes plain tensors, so the pair
(output, its quantized form) is handed over through `PENDING`, one slot per issuing thread, which
the producer fills and the GEMV reads: the GEMV takes the quantized form only for the very tensor
object the producer wrote (the slot holds it, so no other tensor can stand at its address), else it
quantizes x itself. An activation is never written in place once a kernel produced it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from llmx.quant.choice import INT8_X_MAX_M
from llmx.quant.triton.launch import cdiv, dot8, kernels, programmatic_launch


@dataclass(frozen=True)
class QuantizedX:
    """x [M, K] as the integer-dot GEMV reads it: int8 codes, a float32 scale per 32 values, and
    the code sums per 16 times their scale; made once and shared by the weights that multiply the same x."""

    q: torch.Tensor  # int8 [M, K]
    dx: torch.Tensor  # float32 [M, K/32]
    sums: torch.Tensor  # float32 [M, K/16]: dx * (sum of q) per 16


HalfX = tuple[torch.Tensor, torch.Tensor]  # float32 x as fp16 rows scaled into [-1, 1], and the scales


class Pending(threading.local):
    """The latest activation a kernel on this thread wrote quantized too, and that form."""

    x: torch.Tensor | None = None
    qx: QuantizedX | None = None

    def offer(self, x: torch.Tensor, qx: QuantizedX) -> None:
        self.x, self.qx = x, qx

    def quantized(self, x: torch.Tensor) -> QuantizedX | None:
        """x's quantized form, where the latest producer wrote exactly this tensor; else None."""
        return self.qx if x is self.x else None


PENDING = Pending()


def quantize_x(x2: torch.Tensor, zero: torch.Tensor | None = None) -> QuantizedX:
    """x2 [M, K] (K a multiple of 32, unit stride) quantized for the integer-dot GEMV; `zero` (float32,
    contiguous), where given, set to 0 in the same launch."""
    m, k = x2.shape
    qx = empty_quantized(m, k, x2.device)
    groups = 4
    grid = (m, cdiv(k // 32, groups))
    n_zero = 0 if zero is None else zero.numel()
    zb = 0 if zero is None else 1 << (cdiv(n_zero, grid[0] * grid[1]) - 1).bit_length()  # a power of two
    pdl = programmatic_launch(x2.device)
    dot8().quantize_x_kernel[grid](
        x2, qx.q, qx.dx, qx.sums, k, x2.stride(0), qx.dx if zero is None else zero, n_zero, NG=groups, ZB=zb,
        PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return qx


def empty_quantized(m: int, k: int, device: torch.device) -> QuantizedX:
    """Buffers for M rows of K values quantized (by `quantize_x`, or by a kernel that produces them)."""
    return QuantizedX(
        torch.empty((m, k), dtype=torch.int8, device=device),
        torch.empty((m, k // 32), dtype=torch.float32, device=device),
        torch.empty((m, k // 16), dtype=torch.float32, device=device),
    )


def wants_quantized(x: torch.Tensor) -> bool:
    """Whether a kernel producing x [..., K] should also write it quantized: x is a decode step's
    activation on a GPU, of as many rows as the integer-dot GEMVs take."""
    k = x.shape[-1]
    return x.is_cuda and k % 32 == 0 and x.numel() // max(k, 1) <= INT8_X_MAX_M


def quantized_output(out: torch.Tensor, quantize: bool | None = None) -> QuantizedX | None:
    """Buffers for a kernel to write its output `out` [..., K] quantized into (`dot8.store_quantized`),
    offered with `out` to the next GEMV (`PENDING`); where asked (None: `wants_quantized`) and K is a
    multiple of 32, else None."""
    k = out.shape[-1]
    if not (wants_quantized(out) if quantize is None else quantize and k % 32 == 0):
        return None
    qx = empty_quantized(out.numel() // k, k, out.device)
    PENDING.offer(out, qx)
    return qx


def quantized_pointers(out: torch.Tensor, qx: QuantizedX | None) -> tuple[torch.Tensor, ...]:
    """`qx`'s buffers as kernel arguments (`out` stands in for them, unread, without qx)."""
    return (out, out, out) if qx is None else (qx.q, qx.dx, qx.sums)


def half_rows(x2: torch.Tensor) -> HalfX:
    """x2 [M, K] float32 as fp16 rows scaled into [-1, 1], and the scales [M, 1] (float32)."""
    m, k = x2.shape
    xh = torch.empty((m, k), dtype=torch.float16, device=x2.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x2.device)
    kernels().half_rows_kernel[(m,)](x2, xh, scale, k, x2.stride(0), BK=1024, num_warps=4)
    return xh, scale
