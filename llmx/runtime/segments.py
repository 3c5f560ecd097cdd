"""Segments: runs of consecutive blocks on one device, and what a segment's tensors say about it.

The head joins the last segment when it lives on the same device. A segment is capturable in a
CUDA graph when its weights and KV cache all live on its device (or, row-split matrices, on GPUs)
and its expert stacks, if any, take the grouped kernels (which keep the routing on the GPU) or, on
a GPU segment, live in RAM: its layers with host experts are where a captured step crosses to the
CPU (`runtime.host_trips`); its peers are the other GPUs its row-split matrices and split layers reach
into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmx.models.common import Model
from llmx.ops import PartialSum, RowSplit
from llmx.ops.moe import on_grouped_kernels
from llmx.quant.weight import QWeight
from llmx.runtime.cache import KVCache
from llmx.runtime.tensor_parallel import TensorParallel


@dataclass(frozen=True)
class Segment:
    device: torch.device
    layers: range
    with_head: bool


def segments(layer_devices: list[torch.device], head_device: torch.device) -> list[Segment]:
    """Group consecutive layers by device; the head joins the last segment when they share a device."""
    out: list[Segment] = []
    start = 0
    for i in range(1, len(layer_devices) + 1):
        if i == len(layer_devices) or layer_devices[i] != layer_devices[start]:
            out.append(Segment(layer_devices[start], range(start, i), False))
            start = i
    if out and out[-1].device == head_device:
        out[-1] = Segment(head_device, out[-1].layers, True)
    else:
        out.append(Segment(head_device, range(0), True))
    return out


def devices_of(value: QWeight | RowSplit | PartialSum | torch.Tensor) -> set[torch.device]:
    """Every device a layer's tensor lives on (a row-split matrix spans several GPUs)."""
    if isinstance(value, RowSplit):
        return {p.raw.device for p in value.parts}
    if isinstance(value, PartialSum):
        value = value.weight
    return {value.raw.device if isinstance(value, QWeight) else value.device}


def host_expert_layers(seg: Segment, model: Model) -> tuple[int, ...]:
    """The layers of a GPU segment whose expert stacks all live on the CPU (`--cpu-moe`, `-ncmoe`,
    `-ot exps=CPU`)."""
    if seg.device.type != "cuda":
        return ()
    return tuple(i for i in seg.layers if (stacks := _stacks(model, i)) and all(s.raw.is_cpu for s in stacks))


def _stacks(model: Model, i: int) -> list[QWeight]:
    return [v for _, v in model.layers[i].items() if isinstance(v, QWeight) and v.experts]


def capturable(seg: Segment, model: Model, cache: KVCache) -> bool:
    """Whether a segment's weights and KV all live on its device, or (row-split matrices) on GPUs,
    except the expert stacks of its `host_expert_layers`: then CUDA graphs can hold its decode step
    (meeting the host at those layers' experts, `runtime.host_trips`)."""
    crossings = host_expert_layers(seg, model)
    for i in seg.layers:
        if cache.k[i].device != seg.device:
            return False
        for _, value in model.layers[i].items():
            if isinstance(value, QWeight) and value.experts:
                if i in crossings:
                    continue
                if not on_grouped_kernels(value):
                    return False  # `ops.moe_ffn` reads how many tokens each expert has on the host
            devices = devices_of(value)
            on_gpus = isinstance(value, RowSplit) and all(d.type == "cuda" for d in devices)
            if devices != {seg.device} and not on_gpus:
                return False
    return True


def peer_gpus(seg: Segment, model: Model, split: TensorParallel | None) -> list[torch.device]:
    """The other GPUs a segment's row-split matrices (its layers', and the head's) and split layers
    reach into."""
    values = [v for i in seg.layers for _, v in model.layers[i].items()]
    if seg.with_head:
        values += [v for _, v in model.top.items()]
    peers = {d for v in values if isinstance(v, RowSplit) for d in devices_of(v)}
    if split and any(i in split.layers for i in seg.layers):
        peers |= set(split.devices)
    return sorted(peers - {seg.device}, key=str)
