"""What each forward pass measured (`StepCounters`), and what a CPU segment reads from RAM a step.

perf_counter readings only, no added device sync: the engine turns them into the host-time and
CPU-segment timings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmx.models.common import Model
from llmx.quant.weight import QWeight
from llmx.runtime.cache import KVCache
from llmx.runtime.segments import Segment


@dataclass
class StepCounters:
    """What one `Executor.forward` call measured, with perf_counter readings only.

    A CPU segment's clock starts once its input is on the CPU: a copy from a GPU waits for the GPU
    (that wait is `waited`, not CPU time), and CPU ops then run synchronously on the host.
    """

    issued_at: float = 0.0  # perf_counter when every op was issued, before waiting for the logits
    waited: float = 0.0  # seconds spent waiting for a GPU at GPU -> CPU boundaries inside the step
    cpu_seconds: float = 0.0  # seconds in CPU segments
    cpu_bytes: int = 0  # weight and KV bytes those segments read (weights as stored in the GGUF)


def host_reads(seg: Segment, model: Model, cache: KVCache) -> tuple[int, tuple[tuple[float, int], ...]]:
    """What a one-token step of a CPU segment reads from RAM: its weight bytes (of an expert stack, the
    share of the experts a token uses), and its caches as (K+V bytes a position, positions held) for
    `plan.memory.kv_read_bytes`."""
    if seg.device.type != "cpu":
        return 0, ()
    # a token reads only its n_expert_used experts of each stack
    used = model.config.n_expert_used / model.config.n_expert if model.config.n_expert else 1.0
    values = [v for i in seg.layers for _, v in model.layers[i].items()]
    weights = sum(round(_nbytes(v) * used) if _is_stack(v) else _nbytes(v) for v in values)
    caches = [(cache.k[i], cache.v[i]) for i in seg.layers]
    on_cpu = [(k, v) for k, v in caches if k.device.type == "cpu"]
    kv = tuple(((k.nbytes + v.nbytes) / k.shape[0], k.shape[0]) for k, v in on_cpu)
    if seg.with_head:  # the final norm and the output matrix (the embedding table when tied)
        top = model.top
        output = top.optional("output")
        weights += _nbytes(top.optional("output_norm")) + _nbytes(
            top.optional("token_embd") if output is None else output
        )
    return weights, kv


def _is_stack(value: object) -> bool:
    return isinstance(value, QWeight) and bool(value.experts)


def _nbytes(value: object) -> int:
    """Bytes of a layer tensor that live in host memory (a row-split matrix lives on GPUs)."""
    if isinstance(value, QWeight):
        return value.raw.nbytes if value.raw.device.type == "cpu" else 0
    if isinstance(value, torch.Tensor):
        return value.nbytes if value.device.type == "cpu" else 0
    return 0
