"""What a launch needs to know, asked once (per device): whether Triton is installed, whether
kernels run in Triton's interpreter, whether they may launch as programmatic dependents, and the
kernel modules (imported on first launch, so importing llmx on a CPU-only install never imports
triton).
"""

from __future__ import annotations

from functools import cache
from importlib.util import find_spec
from types import ModuleType

import torch

from llmx import settings


@cache
def has_triton() -> bool:
    """Whether Triton is installed (without importing it): GPU weights take these kernels, else the
    emulated path."""
    return find_spec("triton") is not None


@cache
def interpreting() -> bool:
    """Whether Triton runs its kernels in its CPU interpreter (TRITON_INTERPRET=1): no inline PTX."""
    return settings.triton_interpreting()


@cache
def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on `device` may overlap their predecessor's tail (programmatic dependent
    launch, Hopper and later): the integer-dot GEMV starts loading its weights while the kernel that
    writes its x finishes, and waits for it (`gdc_wait`) only before reading x. Off under the
    interpreter, and with LLMX_PDL=0."""
    if interpreting() or device.type != "cuda" or not settings.programmatic_launch():
        return False
    return capability(device) >= (9, 0)


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of `device` (the current GPU where it names no index)."""
    return _capability(_index(device))


@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def sm_count(device: torch.device, interpreted: int) -> int:
    """The SMs of GPU `device` (the current GPU where it names no index); `interpreted` for CPU tensors
    (TRITON_INTERPRET), the stand-in a caller's tests split launches for."""
    if device.type != "cuda":
        return interpreted
    return _sm_count(_index(device))


COUNTERS = 4096  # a device's counters: more than any launch's tiles or tokens that count in them
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def zeroed_counters(device: torch.device) -> torch.Tensor | None:
    """`device`'s COUNTERS int32 words, all 0 between launches: a launch whose last program does the
    rest of a tile's or token's work (mmq's split over K, the router's top-k) counts its programs in
    them and that last program sets its words back to 0, so launches share them where they run one
    after another, as a device's steps do on its one stream. Made once by the first eager call; None
    while a CUDA graph is being captured before then (the buffer must outlive every graph: that
    launch takes its path without counters)."""
    counts = _COUNTERS.get(device)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counts = _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return counts


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@cache
def lut(device: torch.device) -> torch.Tensor:
    """IQ4_NL/IQ4_XS code points on `device` (every kernel takes the pointer; only IQ types read it)."""
    from gguf.quants import IQ4_NL

    return torch.tensor(IQ4_NL.kvalues, dtype=torch.float32, device=device)


@cache
def kernels() -> ModuleType:
    """`llmx.quant.triton.kernels`: the GEMV, GEMM and dequantize kernels."""
    from llmx.quant.triton import kernels

    return kernels


@cache
def moe_kernels() -> ModuleType:
    """`llmx.quant.triton.moe_kernels`: the grouped expert GEMV and GEMM."""
    from llmx.quant.triton import moe_kernels

    return moe_kernels


@cache
def dot8() -> ModuleType:
    """`llmx.quant.triton.dot8`: the integer-dot GEMV and x's quantization."""
    from llmx.quant.triton import dot8

    return dot8


@cache
def dot8_rows() -> ModuleType:
    """`llmx.quant.triton.dot8_rows`: the integer-dot GEMV for several rows of x."""
    from llmx.quant.triton import dot8_rows

    return dot8_rows


@cache
def mmq() -> ModuleType:
    """`llmx.quant.triton.mmq`: the integer tensor-core GEMM for a batched decode step."""
    from llmx.quant.triton import mmq

    return mmq


@cache
def mmh() -> ModuleType:
    """`llmx.quant.triton.mmh`: the half-precision tensor-core GEMM for a batched decode step."""
    from llmx.quant.triton import mmh

    return mmh


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
