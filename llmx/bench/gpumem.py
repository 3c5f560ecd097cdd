"""GPU memory during a benchmark, measured beside what the plan said it would take.

Per GPU the plan has three numbers: weights, KV cache and compute (scratch). Right after loading,
the bytes torch has allocated on a GPU, less what the load's warm-up keeps (captured graphs' pools),
are its weights and KV (issue #4 asks for 5% of the plan); while the tests run, the peak allocated
beyond that is its compute memory: the warm-up's graphs, activations, weights dequantized for
large batches, attention scores, cuBLAS workspaces, layers streamed by op offload. The plan's
compute estimate is meant to err high, so a measured peak above it is a bug in the estimate
(`llmx.plan.memory`). The peak reserved by the caching allocator (what the process holds from the
driver, fragmentation and CUDA-graph pools included) is kept too: that is what must stay within
the GPU's free memory for a run not to fail.

Only memory allocated through torch is seen (not the CUDA context, nor cuBLAS's own handles).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from llmx.plan.placement import Plan


def cuda_devices() -> list[str]:
    """Every visible GPU as an engine device string; empty without CUDA."""
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def allocated(devices: Iterable[str]) -> dict[str, int]:
    """Bytes torch has allocated on each device now (after its queued work is done)."""
    out = {}
    for d in devices:
        torch.cuda.synchronize(d)
        out[d] = torch.cuda.memory_allocated(d)
    return out


@dataclass
class GpuMemory:
    """The GPUs a plan uses: allocated bytes before and after loading, and the plan's bill for each."""

    before: dict[str, int]  # allocated before loading (other models freed)
    loaded: dict[str, int]  # allocated after loading, less the warm-up's: weights and KV on top of `before`
    planned: dict[str, dict[str, int]]  # device -> {"weights", "kv", "compute"} from the plan

    @classmethod
    def of_load(cls, plan: Plan, before: dict[str, int], warm_up: dict[str, int] | None = None) -> GpuMemory:
        """Call right after loading `plan`, with `allocated(...)` taken just before loading and the bytes
        the load's warm-up left allocated (`WarmUp.retained`): those are compute memory, not weights."""
        used = [u for u in plan.usage if u.device.startswith("cuda") and u.used and u.device in before]
        planned = {u.device: {"weights": u.weights, "kv": u.kv, "compute": u.compute} for u in used}
        kept = warm_up or {}
        loaded = {d: n - kept.get(d, 0) for d, n in allocated(planned).items()}
        return cls({d: before[d] for d in planned}, loaded, planned)

    @property
    def devices(self) -> list[str]:
        return list(self.planned)

    def start(self) -> None:
        """Start a peak measurement (one per test)."""
        for d in self.devices:
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)

    def measure(self) -> dict[str, dict[str, Any]]:
        """Per GPU since `start`: measured and planned weights+KV and compute, and the peak reserved."""
        out = {}
        for d in self.devices:
            torch.cuda.synchronize(d)
            plan = self.planned[d]
            out[d] = {
                "weights_kv": self.loaded[d] - self.before[d],
                "weights_kv_planned": plan["weights"] + plan["kv"],
                "compute_peak": max(0, torch.cuda.max_memory_allocated(d) - self.loaded[d]),
                "compute_planned": plan["compute"],
                "reserved_peak": torch.cuda.max_memory_reserved(d),
            }
        return out


def release_cuda_memory() -> None:
    """Give cached GPU memory back, cuBLAS's per-stream workspaces included (torch keeps those until
    told), so the next placement's measurement starts from what it allocates itself. Only while no
    model is alive: a captured CUDA graph may still point into a workspace."""
    if not torch.cuda.is_available():
        return
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
