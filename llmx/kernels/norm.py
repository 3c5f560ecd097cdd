"""RMSNorm, residual add + RMSNorm, and SiLU-gating for decode steps, one launch each.

A decode step's norms are a handful of [1, E] rows: ATen spends ~5 µs a call on them, and the
residual add before a norm and the `F.silu(g) * u` of a SwiGLU FFN are separate launches again.

- `rms_norm_kernel`, grid (rows,): one program holds a whole row (E <= MAX_WIDTH) in registers,
  optionally adds the residual delta first (writing the sum too), and scales the row by
  weight / sqrt(mean(x^2) + eps).
- `rms_norm_pair_kernel`, grid (rows of both,): two such norms, each of its own rows and weight (a
  layer's per-head q and k norms), in one launch.
- `silu_mul_kernel`, grid (rows, column blocks): silu(g) * u for gate and up rows that may be
  column views of one joined [T, 2F] projection.

Both also write their output quantized for the integer-dot GEMV that takes it next, when it is one
row on a GPU (`activation.wants_quantized`), and offer it with the output to that GEMV
(`activation.PENDING`): a decode step then spends no launch on quantizing the inputs of its q/k/v,
gate/up and down projections. Then, on Hopper, they let that GEMV launch as they start
(`gdc_launch_dependents`): it loads its first weights while they run and waits for them before
reading x (`launch.programmatic_launch`).
They are launched the same way themselves (WAIT): after a GEMV, which lets its successor launch as
it starts, they are resident when its last wave ends and wait for it before touching memory.

Math is float32; outputs take the input's dtype. Intermediates that eager PyTorch rounds to the
input's dtype (x + delta, silu(g)) are rounded here too, so f16/bf16 results match it closely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llmx.quant.triton.activation import quantized_output, quantized_pointers
from llmx.quant.triton.dot8 import store_quantized_block
from llmx.quant.triton.launch import programmatic_launch

MAX_WIDTH = 16384  # widest row held in registers (16 warps x 32 floats a thread)
SILU_BLOCK = 1024  # columns per silu_mul program


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool | None = None) -> torch.Tensor:
    """`F.rms_norm(x, (E,), weight, eps)` for x [..., E] (E <= MAX_WIDTH), weight [E]: x's dtype out.
    `quantize`: also write the output quantized for the next GEMV (None: where the integer-dot GEMV
    would take it)."""
    return _launch(x, None, weight, eps, quantize)[1]


def rms_norm_pair(
    a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(a, wa, eps), rms_norm(b, wb, eps)) in one launch: a [..., E] and b [..., E] of one
    dtype and width (a layer's queries and keys, normalized per head: Qwen3, Gemma 3), each row as
    `rms_norm` computes it."""
    e = a.shape[-1]
    if e > MAX_WIDTH or b.shape[-1] != e or b.dtype != a.dtype:
        raise ValueError(f"a pair of norms takes rows of one width <= {MAX_WIDTH} and dtype")
    a2, b2 = _rows(a), _rows(b)
    ya = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    yb = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    rows = a2.shape[0] + b2.shape[0]
    block = triton.next_power_of_2(e)
    if rows:
        pdl = programmatic_launch(ya.device)
        rms_norm_pair_kernel[(rows,)](
            a2, _unit(wa), ya, a2.shape[0], a2.stride(0), b2, _unit(wb), yb, b2.stride(0), e, eps,
            WAIT=pdl, BLOCK=block, num_warps=min(max(block // 512, 1), 16), launch_pdl=pdl,
        )  # fmt: skip
    return ya, yb


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + delta and rms_norm(h, weight, eps) in one pass: (h, normed), both [..., E] in x's dtype
    (`quantize`: as `rms_norm`'s, for normed)."""
    return _launch(x, delta, weight, eps, quantize)


def silu_mul(g: torch.Tensor, u: torch.Tensor, quantize: bool | None = None) -> torch.Tensor:
    """silu(g) * u for g, u [..., F] of one dtype (last axis contiguous, rows may be strided);
    `quantize` as `rms_norm`'s."""
    f = g.shape[-1]
    g2, u2 = _rows(g), _rows(u)
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    rows = g2.shape[0]
    qx = quantized_output(out, quantize)
    if rows:
        grid = (rows, triton.cdiv(f, SILU_BLOCK))
        pdl = programmatic_launch(out.device)
        silu_mul_kernel[grid](
            g2, u2, out, g2.stride(0), u2.stride(0), f, *quantized_pointers(out, qx),
            QUANT=qx is not None, TRIGGER=qx is not None and pdl, WAIT=pdl,
            BLOCK=SILU_BLOCK, num_warps=4, launch_pdl=pdl,
        )  # fmt: skip
    return out


def _launch(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, quantize: bool | None
) -> tuple[torch.Tensor, torch.Tensor]:
    e = x.shape[-1]
    if e > MAX_WIDTH:
        raise ValueError(f"rows of {e} exceed the kernel's {MAX_WIDTH}")
    x2 = _rows(x)
    d2 = x2 if delta is None else _rows(delta)
    h = x2 if delta is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    qx = quantized_output(y, quantize)
    weight = _unit(weight)
    block = triton.next_power_of_2(e)
    if x2.shape[0]:
        pdl = programmatic_launch(y.device)
        rms_norm_kernel[(x2.shape[0],)](
            x2, d2, weight, h, y, x2.stride(0), d2.stride(0), e, eps, *quantized_pointers(y, qx),
            ADD=delta is not None, QUANT=qx is not None, TRIGGER=qx is not None and pdl, WAIT=pdl,
            BLOCK=block, num_warps=min(max(block // 512, 1), 16), launch_pdl=pdl,
        )  # fmt: skip
    return h, y


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last] with a unit stride along the last axis (a view where possible)."""
    return _unit(t).reshape(-1, t.shape[-1])


def _unit(t: torch.Tensor) -> torch.Tensor:
    """t with a unit stride along its last axis."""
    return t if t.stride(-1) == 1 else t.contiguous()


# --- kernels ------------------------------------------------------------------------------------


@triton.jit
def rms_norm_kernel(
    x_ptr, d_ptr, w_ptr, h_ptr, y_ptr, sx, sd, n, eps, xq_ptr, dx_ptr, xs_ptr,
    ADD: tl.constexpr, QUANT: tl.constexpr, TRIGGER: tl.constexpr, WAIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Row r of y = rms_norm(x (+ d)); with ADD the sum also goes to h. h and y are contiguous [rows, n].
    With QUANT, y also goes to xq, dx, xs quantized (`dot8.store_quantized`; n a multiple of 32).
    WAIT: launched as a programmatic dependent, so first wait for the kernel before it. TRIGGER: the
    next kernel (a GEMV launched as a programmatic dependent) may start now."""
    if WAIT:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        d = tl.load(d_ptr + row * sd + cols, mask=mask, other=0.0).to(tl.float32)
        h = (x + d).to(h_ptr.dtype.element_ty)  # rounded as eager's x + delta, then normalized
        tl.store(h_ptr + row * n + cols, h, mask=mask)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd * w).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * n + cols, y, mask=mask)
    if QUANT:
        store_quantized_block(y, 0, row, n, xq_ptr, dx_ptr, xs_ptr)


@triton.jit
def rms_norm_pair_kernel(
    a_ptr, wa_ptr, ya_ptr, rows_a, sa, b_ptr, wb_ptr, yb_ptr, sb, n, eps,
    WAIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Row r of ya = rms_norm(a, wa) for r < rows_a, else row r - rows_a of yb = rms_norm(b, wb), as
    `rms_norm_kernel` computes a row (ya, yb contiguous [rows, n]). WAIT: as `rms_norm_kernel`'s; the
    next kernel (the fused RoPE and attention) may launch at once, as it waits for this one first."""
    if WAIT:
        gdc_wait()
        gdc_launch_dependents()
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    if r < rows_a:
        x = tl.load(a_ptr + r * sa + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(wa_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(b_ptr + (r - rows_a) * sb + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(wb_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
    y = x * rstd * w
    if r < rows_a:
        tl.store(ya_ptr + r * n + cols, y.to(ya_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(yb_ptr + (r - rows_a) * n + cols, y.to(yb_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_kernel(
    g_ptr, u_ptr, out_ptr, sg, su, n, xq_ptr, dx_ptr, xs_ptr,
    QUANT: tl.constexpr, TRIGGER: tl.constexpr, WAIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    if WAIT:  # as rms_norm_kernel's
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(g_ptr + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)  # eager rounds silu(g)
    out = (act * u).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n + cols, out, mask=mask)
    if QUANT:
        store_quantized_block(out, tl.program_id(1) * (BLOCK // 32), row, n, xq_ptr, dx_ptr, xs_ptr)
