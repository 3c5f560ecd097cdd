"""Op offload's threshold when `-ot` rules left CPU layers without CPU-resident matrices (on the CPU:
meta tensors stand in for matrices on a GPU; tests/test_gpu.py measures a real one)."""

from __future__ import annotations

import torch

from llmx.models.common import TensorGroup
from llmx.quant import BY_NAME
from llmx.quant.weight import QWeight
from llmx.runtime.offload import NEVER, offload_threshold


def layer(i: int) -> TensorGroup:
    """A layer whose one matrix lives off the CPU (its norm, a vector, on it)."""
    raw = torch.empty(8, 34, dtype=torch.uint8, device="meta")  # 8 rows of one Q8_0 block
    off_cpu = QWeight(raw, BY_NAME["Q8_0"], (8, 32), f"blk.{i}.attn_output.weight")
    return TensorGroup(f"blk.{i}.", {"attn_output": off_cpu, "attn_norm": torch.ones(32)})


def test_layers_without_cpu_matrices_never_stream() -> None:
    # never reaches the measurement (which needs a GPU): nothing would be streamed
    assert offload_threshold([layer(0), layer(1)], torch.device("cuda:0")) == NEVER
