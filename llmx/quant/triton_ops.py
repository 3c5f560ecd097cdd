"""Triton matmul, embedding and dequantize on raw GGUF blocks (the GPU path of `llmx.quant`).

Weights stay as the uint8 rows of the GGUF file; the kernels (`llmx.quant.triton.kernels`) unpack
blocks in registers. triton is imported on first use, so importing this module costs nothing on
CPU-only installs. Under TRITON_INTERPRET=1 the same code runs on CPU tensors (the tests do that).

Which kernel runs:
- M <= 8 rows of x: GEMV, fp32 FMAs on the unpacked codes, one program per few weight rows;
  memory-bound, so its speed is the weight bytes over HBM bandwidth.
- M > 8: GEMM, tiles dequantized into registers and multiplied with tl.dot on the tensor cores,
  autotuned per (type, M bucket, N, K).

Output dtype is x's dtype; accumulation is always float32. GEMM multiplies in x's dtype (fp16 or
bf16 weights tiles; tf32 for float32 x).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

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
GEMV_MAX_M = 8


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of the GEMV kernel: BN weight rows per program, BK weights per loop step."""

    bn: int
    bk: int
    num_warps: int


def supports(w: QWeight) -> bool:
    """Whether these kernels can run weight `w` (its type has an unpack helper, or is a float)."""
    return w.qtype.name in GROUP or w.qtype.name in FLOAT_TYPES


# --- public API ---------------------------------------------------------------------------------


def linear(x: torch.Tensor, w: QWeight, gemv: GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) @ W.T for W [N, K] -> [..., N] in x's dtype.

    M (the product of x's leading dims) <= 8 runs the GEMV kernel, larger M the GEMM kernel.
    `gemv` overrides the GEMV launch shape (benchmarks sweep it); None picks the default.
    """
    n, k = w.shape
    if x.shape[-1] != k:
        raise LlmxError(f"{_label(w)} {tuple(w.shape)} cannot multiply x of shape {tuple(x.shape)}")
    if w.qtype.name in FLOAT_TYPES:
        return torch.nn.functional.linear(x, w.raw.to(x.dtype))
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    raw, name = _raw(w)
    kern = _kernels()
    if m <= GEMV_MAX_M:
        bm = 1 << (m - 1).bit_length()
        cfg = gemv or default_gemv(name, bm)
        kern.gemv_kernel[(_cdiv(n, cfg.bn),)](
            x2, raw, _lut(raw.device), out, m, n, k, x2.stride(0), raw.stride(0), out.stride(0),
            QT=name, G=GROUP[name], BM=bm, BN=cfg.bn, BK=cfg.bk, num_warps=cfg.num_warps,
        )  # fmt: skip
    else:
        m_bucket = min(1 << (m - 1).bit_length(), 4096)

        def grid(meta: dict[str, Any]) -> tuple[int]:
            return (_cdiv(m, meta["BM"]) * _cdiv(n, meta["BN"]),)

        _gemm()[grid](
            x2, raw, _lut(raw.device), out, m, n, k, x2.stride(0), raw.stride(0), out.stride(0), m_bucket,
            QT=name, G=GROUP[name],
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def embedding(ids: torch.Tensor, w: QWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` (any shape, integer) of W [N, K], dequantized: [*ids.shape, K] in `dtype`.

    Only the selected rows are read; with dtype float32 the values equal gguf-py's bit for bit.
    """
    n, k = w.shape
    if w.qtype.name in FLOAT_TYPES:
        return w.raw[ids].to(dtype)
    flat = ids.reshape(-1).to(device=w.raw.device, dtype=torch.int64)
    out = torch.empty((flat.numel(), k), dtype=dtype, device=w.raw.device)
    if flat.numel():
        raw, name = _raw(w)
        br, bk = 4, 512
        _kernels().dequant_kernel[(_cdiv(flat.numel(), br), _cdiv(k, bk))](
            raw, _lut(raw.device), flat, out, flat.numel(), n, k, raw.stride(0), out.stride(0),
            QT=name, G=GROUP[name], BR=br, BK=bk, num_warps=4,
        )  # fmt: skip
    return out.reshape(*ids.shape, k)


def dequantize(w: QWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight W [N, K] in `dtype` (float32: bit-exact with gguf-py)."""
    return embedding(torch.arange(w.shape[0], device=w.raw.device), w, dtype)


# --- launch details -----------------------------------------------------------------------------


def default_gemv(name: str, bm: int) -> GemvConfig:
    """GEMV launch shape for type `name` and BM input rows (measured on an H200, bench/RESULTS.md)."""
    return GemvConfig(bn=4 if bm <= 2 else 2, bk=512, num_warps=4)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _raw(w: QWeight) -> tuple[torch.Tensor, str]:
    """The raw [N, row_bytes] uint8 rows of `w`, checked, and its type name."""
    name = w.qtype.name
    if name not in GROUP:
        raise LlmxError(f"{_label(w)} has no Triton kernel; types with one: {', '.join(GROUP)}")
    raw = w.raw
    n, k = w.shape
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[0] != n or raw.stride(1) != 1:
        raise LlmxError(f"{_label(w)}: raw blocks must be uint8 [{n}, row bytes] with contiguous rows")
    if raw.shape[1] != w.qtype.row_bytes(k):
        raise LlmxError(f"{_label(w)}: {raw.shape[1]} bytes a row, {k} weights need {w.qtype.row_bytes(k)}")
    return raw, name


def _label(w: QWeight) -> str:
    return f"{w.name or 'weight'} ({w.qtype.name})"


@cache
def _kernels() -> Any:
    from llmx.quant.triton import kernels

    return kernels


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
    else:
        configs = [
            config(128, 128, 64, 8, 3),
            config(128, 256, 64, 8, 3),
            config(64, 128, 64, 4, 4),
            config(128, 128, 128, 8, 3),
        ]
    return triton.autotune(configs=configs, key=["M_BUCKET", "N", "K", "QT"])(_kernels().gemm_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
