"""Every environment variable llmx reads, read here and nowhere else (a test keeps it so).

Each setting is one entry of `SETTINGS` (name, values, default, what it does: the README's table
is this table) and one function that reads and checks it. The functions read the environment when
called, so a test's `monkeypatch.setenv` takes effect; modules that decide once (at import or at
load) call them once and keep the answer. A value outside a setting's choices is one `LlmxError`
line naming the variable.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from llmx.errors import LlmxError

CPU_GEMV_PATHS = ("auto", "aot", "jit", "eager")
CPU_KERNELS = ("auto", "packed", "dequant", "emulated")
GPU_KERNELS = (
    "auto",
    "dot8",
    "dot8_rows",
    "mmq",
    "mmh",
    "gemv",
    "gemm",
    "dequant",
)  # `quant.choice.GPU_KERNELS`, and auto
FUSED_MODES = ("auto", "on", "off")
FLAG = ("1", "0")


def _listed(choices: tuple[str, ...]) -> str:
    """A setting's choices as the README's table shows them."""
    return ", ".join(f"`{c}`" for c in choices)


@dataclass(frozen=True)
class Setting:
    name: str
    values: str  # as the README's table shows them
    default: str
    doc: str
    user: bool = True  # False: for tests and benchmarks, left out of the README's table


SETTINGS = (
    Setting(
        "LLMX_CACHE_DIR",
        "a folder",
        "~/.cache/llmx",
        "where compiled kernels and measured ceilings/thresholds are kept",
    ),
    Setting(
        "LLMX_CPU_GEMV",
        _listed(CPU_GEMV_PATHS),
        "auto",
        "the CPU decode kernel of repacked types: AOTInductor packages, else `torch.compile`, else "
        "dequantize + matmul (`eager` also turns the native C kernels off)",
    ),
    Setting(
        "LLMX_KERNEL",
        _listed(CPU_KERNELS),
        "auto",
        "force one CPU matmul path (`emulated`: the whole weight dequantized, the numerics reference)",
    ),
    Setting(
        "LLMX_PDL",
        _listed(FLAG),
        "1",
        "on Hopper GPUs, let each decode GEMV start loading its weights while the kernel that writes "
        "its input finishes (programmatic dependent launch); `0` turns it off",
    ),
    Setting(
        "LLMX_FUSED_ATTENTION",
        _listed(FUSED_MODES),
        "auto",
        "one-token steps: RoPE (after the per-head q/k norms of Qwen3 and Gemma 3), KV write and "
        "attention in fused kernels (Triton on GPUs, native on the "
        "CPU); `off`: PyTorch's ops everywhere; `on` forces the Triton kernel on the CPU too (tests)",
    ),
    Setting(
        "LLMX_FUSED_NORM",
        _listed(FUSED_MODES),
        "auto",
        "RMSNorm, residual add + RMSNorm and SwiGLU's gate in one kernel each for small steps; `off`: "
        "PyTorch's ops; `on` forces the Triton kernels on the CPU too (tests)",
    ),
    Setting(
        "LLMX_CPU_PREFETCH",
        "BYTES[/FAR]",
        "measured",
        "how far ahead of its rows a native CPU GEMV thread asks for weights into the L1, and FAR times "
        "that into the L2 (0 or absent: not); default: the fastest of 1-8 KiB with FAR 0 or 4, "
        "measured once per machine and thread count",
    ),
    Setting(
        "LLMX_PIN_THREADS",
        _listed(FLAG),
        "1",
        "`0`: leave torch's OpenMP workers unpinned (by default each runs on a CPU of its own)",
    ),
    Setting(
        "LLMX_GPU_KERNEL",
        _listed(GPU_KERNELS),
        "auto",
        "force one GPU matmul kernel at every M, where it reads the weight (benchmarks: which kernel a "
        "batch size should take)",
        user=False,
    ),
    Setting(
        "LLMX_TRITON_AUTOTUNE",
        _listed(FLAG),
        "1",
        "`0`: one GEMM configuration instead of autotuning (quicker tests)",
        user=False,
    ),
    Setting("TRITON_INTERPRET", "`1`", "unset", "Triton's own: run kernels on the CPU (tests)", user=False),
    Setting("CC", "a compiler", "cc, else gcc", "the C compiler of the native CPU kernels", user=False),
)


_DEFAULTS = {s.name: s.default for s in SETTINGS}


def _get(name: str) -> str | None:
    return os.environ.get(name)


def _choice(name: str, choices: tuple[str, ...]) -> str:
    value = _get(name) or _DEFAULTS[name]
    if value not in choices:
        raise LlmxError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value


def _flag(name: str) -> bool:
    return _choice(name, FLAG) == "1"


def cache_dir() -> Path:
    """Where llmx keeps what it measures or builds once per machine."""
    return Path(_get("LLMX_CACHE_DIR") or Path(_DEFAULTS["LLMX_CACHE_DIR"]).expanduser())


def cpu_gemv() -> str:
    return _choice("LLMX_CPU_GEMV", CPU_GEMV_PATHS)


def cpu_kernel() -> str:
    return _choice("LLMX_KERNEL", CPU_KERNELS)


def gpu_kernel() -> str:
    return _choice("LLMX_GPU_KERNEL", GPU_KERNELS)


def programmatic_launch() -> bool:
    return _flag("LLMX_PDL")


def fused_attention() -> str:
    return _choice("LLMX_FUSED_ATTENTION", FUSED_MODES)


def fused_norm() -> str:
    return _choice("LLMX_FUSED_NORM", FUSED_MODES)


def cpu_prefetch() -> tuple[int, int] | None:
    """(bytes ahead, far multiple), or None: measure."""
    value = _get("LLMX_CPU_PREFETCH")
    if value is None:
        return None
    ahead, _, far = value.partition("/")
    if not ahead.isdigit() or not (far.isdigit() or not far and "/" not in value):
        raise LlmxError(f"LLMX_CPU_PREFETCH={value!r} is not BYTES or BYTES/FAR (e.g. 2048 or 2048/4)")
    return int(ahead), int(far or 0)


def pin_threads() -> bool:
    return _flag("LLMX_PIN_THREADS")


def triton_autotune() -> bool:
    return _flag("LLMX_TRITON_AUTOTUNE")


def triton_interpreting() -> bool:
    """Whether Triton runs its kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return (_get("TRITON_INTERPRET") or "0") != "0"


def c_compiler() -> str | None:
    return _get("CC") or shutil.which("cc") or shutil.which("gcc")
