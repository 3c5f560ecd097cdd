"""Matrix products computed where the weight lives: only the activation moves between devices."""

from __future__ import annotations

import torch

from llmx.ops.split import PartialSum, RowSplit
from llmx.quant import weight as qw
from llmx.quant.weight import QWeight, embedding, with_biases

__all__ = ["embedding", "linear", "linear_many"]


def linear(
    x: torch.Tensor, w: QWeight | RowSplit | PartialSum, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] @ W^T -> [..., out], computed where W lives (only the activation moves); plus
    `residual` (on x's device) where given: a decode step's GPU GEMV adds it as it stores."""
    if isinstance(w, QWeight) and x.device == w.raw.device:
        return qw.linear(x, w, residual=residual)
    if isinstance(w, PartialSum):
        y = w.reduce(qw.linear(x, w.weight))
    elif isinstance(w, RowSplit):
        y = RowSplit.linear_many(x, [w])[0].to(x.device)
    else:
        y = qw.linear(x.to(w.raw.device), w).to(x.device)
    return y if residual is None else y + residual


def linear_many(
    x: torch.Tensor, ws: list[QWeight | RowSplit], biases: list[torch.Tensor | None] | None = None
) -> list[torch.Tensor]:
    """[linear(x, w) for w in ws] for weights sharing an input (q/k/v, gate/up): one joined kernel
    call where they live together on x's device, separate calls otherwise; plus biases[j] (a vector,
    or None) on output j where `biases` is given (in the joined CPU call, as a residual)."""
    device = x.device
    if all(isinstance(w, QWeight) and w.raw.device == device for w in ws):
        return qw.linear_many(x, ws, biases=biases)
    if all(isinstance(w, RowSplit) for w in ws) and len({w.devices for w in ws}) == 1:
        return with_biases([y.to(x.device) for y in RowSplit.linear_many(x, ws)], biases)
    return with_biases([linear(x, w) for w in ws], biases)
