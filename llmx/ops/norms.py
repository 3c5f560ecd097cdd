"""RMSNorm, and the residual add + RMSNorm of a block's second half; a layer's per-head query and key
norms (`HeadNorms`), which the fused decode attention kernels apply in their launch.

One kernel a call: `cpu_native.rms_norm` for float32 rows on the CPU (any number of them), and
`llmx.kernels.norm` (Triton) for steps of at most FUSED_NORM_MAX_TOKENS tokens on a GPU; larger GPU
steps and other cases PyTorch's ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmx import settings
from llmx.quant import cpu_native
from llmx.quant.triton.launch import has_triton

# "auto": the kernels above; "off": PyTorch's ops everywhere (to compare); "on": the Triton kernels on
# the CPU too (tests, under TRITON_INTERPRET=1). Read once at import; tests set the module attribute.
FUSED_NORM = settings.fused_norm()
FUSED_NORM_MAX_TOKENS = 16
FUSED_NORM_MAX_WIDTH = 16384  # the widest row the norm kernels hold in registers (norm.MAX_WIDTH)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, ..., E] scaled to unit root-mean-square, then by `weight` [E] (brought to x: a few KB);
    plus `residual` (x's shape) where given: a norm after a sublayer, then the residual add (Gemma)."""
    if _native_cpu_rows(x, weight) and (residual is None or _same(residual, x)):
        return cpu_native.rms_norm(x, weight, eps, residual=residual)[1]
    if fused_rows(x) and x.shape[-1] <= FUSED_NORM_MAX_WIDTH:
        from llmx.kernels import norm

        y = norm.rms_norm(x, weight.to(x.device), eps)
    else:
        y = F.rms_norm(x, (x.shape[-1],), weight.to(x.device), eps)
    return y if residual is None else residual + y


def rms_norm_pair(
    a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(a, wa, eps), rms_norm(b, wb, eps)): a layer's per-head query and key norms, one launch
    for decode steps on a GPU (see FUSED_NORM) where a and b share a device, dtype and width."""
    if (
        fused_rows(a) and fused_rows(b) and a.device == b.device and a.dtype == b.dtype
        and a.shape[-1] == b.shape[-1] <= FUSED_NORM_MAX_WIDTH
    ):  # fmt: skip
        from llmx.kernels import norm

        return norm.rms_norm_pair(a, wa.to(a.device), b, wb.to(b.device), eps)
    return rms_norm(a, wa, eps), rms_norm(b, wb, eps)


@dataclass(frozen=True)
class HeadNorms:
    """A layer's RMSNorm of each query head and each key head (Qwen3, Gemma 3), by `q` and `k` [D]
    (either may be absent), before RoPE. `ops.rope_attention` hands them to the cache's fused kernel,
    which applies them as it loads q and k (a decode step on a GPU: one launch a layer fewer), or
    calls this first."""

    q: torch.Tensor | None
    k: torch.Tensor | None
    eps: float

    def weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """(q's weights, k's, eps), as the fused kernels take them (`kernels.decode_attention.Norms`)."""
        return self.q, self.k, self.eps

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q is not None and self.k is not None:
            return rms_norm_pair(q, self.q, k, self.k, self.eps)
        q = q if self.q is None else rms_norm(q, self.q, self.eps)
        return q, k if self.k is None else rms_norm(k, self.k, self.eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's next value and its norm: h = x + delta, (h, rms_norm(h, weight, eps)).
    One launch for decode steps on a GPU (see FUSED_NORM)."""
    same = _same(delta, x)
    if same and _native_cpu_rows(x, weight):
        return cpu_native.rms_norm(x, weight, eps, delta)
    if same and fused_rows(x) and x.shape[-1] <= FUSED_NORM_MAX_WIDTH:
        from llmx.kernels import norm

        return norm.add_rms_norm(x, delta, weight.to(x.device), eps)
    h = x + delta
    return h, rms_norm(h, weight, eps)


def _same(a: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a is of x's shape, dtype and device (a fused kernel adds the two)."""
    return a.shape == x.shape and a.dtype == x.dtype and a.device == x.device


def _native_cpu_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a CPU step's norm takes the native kernel (`cpu_native.rms_norm`): float32 tokens,
    contiguous, their weight on the CPU in float32 (not with FUSED_NORM "off"). Any number of them: a
    prompt step's rows are shared out among the threads, one pass over each where PyTorch's ops made
    several (the 2-core Xeon, 512 x 640: 0.07 ms against 0.3-1.2)."""
    return (
        FUSED_NORM == "auto"
        and x.is_cpu
        and weight.is_cpu
        and x.dtype == weight.dtype == torch.float32
        and x.dim() > 1
        and x.is_contiguous()
        and cpu_native.available()
    )


def fused_rows(x: torch.Tensor) -> bool:
    """Whether `llmx.kernels.norm` takes x [T, ..., E]: a few tokens of a float dtype, and Triton
    at hand (FUSED_NORM "auto" also wants x on a GPU)."""
    if FUSED_NORM == "off" or x.dim() == 0 or (x.dim() > 1 and x.shape[0] > FUSED_NORM_MAX_TOKENS):
        return False
    if FUSED_NORM == "auto" and not (x.is_cuda and has_triton()):
        return False
    return x.dtype in (torch.float32, torch.float16, torch.bfloat16)
