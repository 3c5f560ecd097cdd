"""Weights spread over several GPUs (`-sm row`), and the CUDA device work is issued for.

A `RowSplit` matrix's output rows live on several GPUs; a `PartialSum` is one GPU's columns of a
matrix whose products are added across GPUs. `llmx.ops.matmul` takes both like any weight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmx.quant import weight as qw
from llmx.quant.weight import QWeight


def current_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make `device` CUDA's current device while work for it is issued: Triton launches its kernels
    on the current device, whatever their tensors' device (on another GPU that is an illegal
    memory access)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class RowSplit:
    """A matrix whose output rows are spread over several GPUs (`-sm row`): each GPU multiplies its
    slice, and the slices are gathered on the main GPU. Launches on different GPUs run concurrently."""

    parts: list[QWeight]
    main: torch.device

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return tuple(p.raw.device for p in self.parts)

    @staticmethod
    def linear_many(x: torch.Tensor, ws: list[RowSplit]) -> list[torch.Tensor]:
        """[x @ W^T for W in ws] for matrices split over the same devices (q/k/v, gate/up): each
        device gets x once and multiplies its slices of all of them in one joined call, and sends
        its results back in one copy, so the GPUs meet once per group rather than once per matrix."""
        blocks, widths = [], []
        for j, device in enumerate(ws[0].devices):
            with current_device(device):
                outs = qw.linear_many(x.to(device, non_blocking=True), [w.parts[j] for w in ws])
                joined = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
            blocks.append(joined.to(ws[0].main, non_blocking=True))
            widths.append([o.shape[-1] for o in outs])
        pieces = [block.split(sizes, dim=-1) for block, sizes in zip(blocks, widths, strict=True)]
        return [torch.cat([p[i] for p in pieces], dim=-1) for i in range(len(ws))]


@dataclass
class PartialSum:
    """One GPU's columns of a matrix whose product is summed over GPUs (`-sm row`: the attention
    output and FFN down matrices): `reduce` adds this GPU's partial product to the others'."""

    weight: QWeight
    reduce: Callable[[torch.Tensor], torch.Tensor]
