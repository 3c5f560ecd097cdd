"""What a benchmark needs from a loaded model: where its bytes live and how fast those devices read.

`llmx bench` and `llmx sweep-bench` load a model per placement, then ask this module for its
roofline inputs: bytes read per generated token on each device (from the plan the loader
executed), the measured bandwidth of those devices (from the ceilings cache, measured on first
use), the placement facts a result records, and each GPU's allocated bytes before and after
loading (`llmx.bench.gpumem`), against which the tests' compute peaks are measured.
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass
from typing import Any

from llmx.api import LoadedModel, load_with_options
from llmx.bench.ceilings import ceilings_for
from llmx.bench.floor import Roofline, TokenBytes, plan_token_bytes, roofline
from llmx.bench.gpumem import GpuMemory, allocated, cuda_devices, release_cuda_memory
from llmx.bench.rows import placement_summary
from llmx.plan.options import Options


@dataclass(frozen=True)
class BenchModel:
    """A loaded model with its per-token bytes and the bandwidth of the devices holding them."""

    model: LoadedModel
    options: Options  # as planned and loaded (after --fit, when it chose the placement)
    token_bytes: TokenBytes
    bandwidth_gbs: dict[str, float]
    placement: dict[str, Any]  # devices, summary, plan, bandwidth_gbs, load_seconds, n_offloaded
    memory: GpuMemory  # the GPUs in use: allocated before/after loading, planned bytes

    @property
    def n_vocab(self) -> int:
        return self.model.file.tensors["token_embd.weight"].shape[0]

    def roofline(self, n_depth: int, n_gen: int) -> Roofline:
        """The floor of generating `n_gen` tokens after `n_depth` cached ones."""
        return roofline(self.token_bytes, n_depth, n_gen, self.bandwidth_gbs)


def _note(message: str) -> None:
    print(message, file=sys.stderr)


def load_for_bench(path: str | os.PathLike | None, opts: Options, progress=None) -> BenchModel:
    """Load `path` with `opts` (`progress`: the loader's progress callback, as `load_with_options`
    takes it) and work out its roofline inputs (measuring missing ceilings)."""
    before = allocated(cuda_devices())
    model = load_with_options(path, opts, progress=progress)
    plan = model.plan
    memory = GpuMemory.of_load(plan, before, model.warm_up and model.warm_up.retained)
    tb = plan_token_bytes(
        plan,
        ((t.name, t.nbytes) for t in model.file.tensors.values()),
        n_expert_used=model.config.n_expert_used,
        n_expert=model.config.n_expert,
    )
    per_device = tb.at_depth(0)
    devices = sorted((d for d, n in per_device.items() if n), key=per_device.__getitem__, reverse=True)
    ceilings = ceilings_for(devices, notify=_note)
    bandwidth = {d: c.mem_gbs for d, c in ceilings.items()}
    placement = {
        "devices": devices,
        "summary": placement_summary(plan.options, plan.n_offloaded, plan.n_layer),
        "n_offloaded": plan.n_offloaded,
        "plan": plan.to_dict(),
        "bandwidth_gbs": bandwidth,
        "load_seconds": model.load_seconds,
    }
    return BenchModel(model, plan.options, tb, bandwidth, placement, memory)


def free_memory() -> None:
    """Return the memory of models no longer referenced before the next placement loads (GPU arenas
    especially: the caching allocator would otherwise keep them for itself)."""
    gc.collect()
    release_cuda_memory()
