"""Device ceilings, measured rather than assumed, and cached per device name.

Every floor and roofline in llmx divides by these numbers, so they come from this machine: a
vendor's peak is never reached and differs between boards of one name (clocks, memory config,
PCIe link). Per device:

- memory bandwidth: GPU device-to-device copy (read + write bytes / time), CPU RAM read (a
  multi-threaded sum over a buffer far larger than the caches);
- host-to-device copy, pinned and pageable (GPUs only): what streaming CPU weights costs;
- matrix rate: bf16 matmul on GPUs, f32 matmul on the CPU.

Results go to ~/.cache/llmx/ceilings.json (or $LLMX_CACHE_DIR) keyed by device name, the CPU's with
its thread count since RAM bandwidth grows with threads. `llmx bench --ceilings` re-measures.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from llmx.cpu_info import cpu_name
from llmx.errors import LlmxError
from llmx.measured import best_seconds
from llmx.settings import cache_dir

CACHE_VERSION = 2  # 2: the CPU read over 4 GiB (ram_probe_bytes), not 1
GIB = 1 << 30


@dataclass(frozen=True)
class Ceiling:
    """What one device can do at best, measured."""

    key: str  # cache key: device name (CPU: name and thread count)
    kind: str  # "cpu" or "cuda"
    mem_gbs: float  # memory bandwidth, GB/s (decimal)
    matmul_tflops: float  # dense matrix rate, TFLOP/s
    matmul_dtype: str
    h2d_pinned_gbs: float | None = None  # host -> device copy from page-locked memory
    h2d_pageable_gbs: float | None = None  # host -> device copy from ordinary memory
    threads: int | None = None
    torch_version: str = ""
    measured_at: str = ""


def cache_path() -> Path:
    return cache_dir() / "ceilings.json"


def device_key(device: str) -> str:
    """Cache key of an engine device string ('cpu', 'cuda:1')."""
    dev = torch.device(device)
    if dev.type == "cpu":
        n = torch.get_num_threads()
        return f"{cpu_name()} ({n} thread{'s' if n > 1 else ''})"
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    raise LlmxError(f"no ceiling measurement for device {device!r}; llmx measures cpu and cuda devices")


# --- measurements -----------------------------------------------------------------------------------


def ram_probe_bytes() -> int:
    """The RAM read's buffer: 4 GiB, or a quarter of the free memory where that is less. Last-level
    caches reach hundreds of MiB (300 MiB on the H200 host): there a 1 GiB sum read 92 and 121 GB/s
    in two runs, 4 GiB 98 and 97."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return GIB
    return max(GIB // 4, min(4 * GIB, free // 4))


def measure_cpu(size_bytes: int | None = None, matmul_n: int = 2048, reps: int = 5) -> Ceiling:
    """RAM read bandwidth (sum of a float32 buffer) and f32 matmul rate, with torch's thread count."""
    size_bytes = size_bytes or ram_probe_bytes()
    x = torch.ones(size_bytes // 4, dtype=torch.float32)
    read = best_seconds(lambda: x.sum(), reps)
    a = torch.randn(matmul_n, matmul_n)
    mm = best_seconds(lambda: a @ a, reps)
    return Ceiling(
        key=device_key("cpu"),
        kind="cpu",
        mem_gbs=size_bytes / read / 1e9,
        matmul_tflops=2 * matmul_n**3 / mm / 1e12,
        matmul_dtype="f32",
        threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


def measure_cuda(device: str, size_bytes: int | None = None, matmul_n: int = 8192, reps: int = 10) -> Ceiling:
    """Device-to-device copy, pinned and pageable host-to-device copies, and bf16 matmul rate.

    The copy moves 4 GiB by default (a quarter of the free memory on small GPUs): at 4 TB/s a
    smaller copy lasts so little that launch and timer overheads start to count.
    """
    dev = torch.device(device)
    if size_bytes is None:
        size_bytes = min(4 * GIB, torch.cuda.mem_get_info(dev)[0] // 4)

    def sync() -> None:
        torch.cuda.synchronize(dev)

    src = torch.empty(size_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    d2d = best_seconds(lambda: dst.copy_(src), reps, sync)
    # Host copies are slower: a quarter of the size keeps the measurement short and still steady.
    host_bytes = size_bytes // 4
    pinned = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(host_bytes, dtype=torch.uint8)
    on_dev = dst[:host_bytes]
    h2d_pinned = best_seconds(lambda: on_dev.copy_(pinned, non_blocking=True), reps, sync)
    h2d_pageable = best_seconds(lambda: on_dev.copy_(pageable), reps, sync)
    a = torch.randn(matmul_n, matmul_n, device=dev, dtype=torch.bfloat16)
    mm = best_seconds(lambda: a @ a, reps, sync)
    return Ceiling(
        key=device_key(device),
        kind="cuda",
        mem_gbs=2 * size_bytes / d2d / 1e9,
        matmul_tflops=2 * matmul_n**3 / mm / 1e12,
        matmul_dtype="bf16",
        h2d_pinned_gbs=host_bytes / h2d_pinned / 1e9,
        h2d_pageable_gbs=host_bytes / h2d_pageable / 1e9,
        torch_version=torch.__version__,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


def measure(device: str) -> Ceiling:
    return measure_cpu() if torch.device(device).type == "cpu" else measure_cuda(device)


# --- the cache ----------------------------------------------------------------------------------------


def load_cache(path: Path | None = None) -> dict[str, Ceiling]:
    """Cached ceilings by key; an absent, old-format or unreadable cache is empty (it is re-measurable)."""
    path = path or cache_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if data.get("version") != CACHE_VERSION:
        return {}
    return {key: Ceiling(**entry) for key, entry in data.get("devices", {}).items()}


def save_cache(ceilings: dict[str, Ceiling], path: Path | None = None) -> Path:
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"version": CACHE_VERSION, "devices": {k: asdict(c) for k, c in sorted(ceilings.items())}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # atomic: two benches measuring at once never leave half a file
    return path


def ceilings_for(
    devices: list[str], remeasure: bool = False, notify: Callable[[str], None] | None = None
) -> dict[str, Ceiling]:
    """device string -> Ceiling, measuring (and caching) the devices not in the cache yet."""
    cached = load_cache()
    out: dict[str, Ceiling] = {}
    for device in dict.fromkeys(devices):
        key = device_key(device)
        if remeasure or key not in cached:
            if notify:
                notify(f"measuring the ceilings of {device} ({key}) ...")
            cached[key] = measure(device)
            save_cache(cached)
        out[device] = cached[key]
    return out


def visible_devices() -> list[str]:
    """The CPU and every CUDA device torch can see, as engine device strings."""
    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
