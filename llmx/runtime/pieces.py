"""A GPU step captured in pieces around the expert stacks it leaves in RAM (`--cpu-moe`, `-ncmoe`).

A layer on a GPU whose routed experts live on the CPU sends its normed hidden state, routing weights
and expert ids to the host and takes the experts' sum back: a host wait inside the step, which one
CUDA graph cannot hold. So the step is captured as graphs between those trips to the CPU: the first
piece runs up to the first such layer's router; each trip copies its inputs to pinned host buffers,
runs the experts on the CPU (`ops.moe_ffn` on the stacks) and copies the result into the next
piece's input; that piece runs the rest of the layer (shared expert, residual) and everything up to
the next trip. Attention, routers and shared experts stay in graphs: only the CPU experts and
the few KB a token that cross pay Python's time.

The pieces share one memory pool and replay in the order they were captured (the condition on which
torch lets captures share a pool): a tensor made by one piece and read by a later one is still
referenced (by the block being captured) while that later piece is captured, so no capture in
between reuses its memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmx.ops import moe
from llmx.quant.weight import QWeight


@dataclass
class Trip:
    """One layer's trip to its CPU experts between two pieces of a captured step.

    x, weights, ids:  the piece before's outputs (normed hidden state [T, E], routing [T, k])
    y:                the piece after's input, the experts' weighted sum [T, E] float32
    stacks:           the layer's gate, up and down expert stacks (on the CPU)
    after:            the piece that follows
    host:             pinned copies of x, weights, ids and y
    """

    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    y: torch.Tensor
    stacks: tuple[QWeight, QWeight, QWeight]
    fused: bool
    after: torch.cuda.CUDAGraph
    host: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        tensors = (self.x, self.weights, self.ids, self.y)
        self.host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)

    def replay(self) -> None:
        """The CPU experts on the last replayed piece's outputs, then the piece after them."""
        x, weights, ids, y = self.host
        for host, dev in zip((x, weights, ids), (self.x, self.weights, self.ids), strict=True):
            host.copy_(dev, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        # Also orders the host's write of `y` below after the previous step's copy out of it.
        copied.synchronize()
        y.copy_(moe.moe_ffn(x, *self.stacks, weights, ids, self.fused))
        self.y.copy_(y, non_blocking=True)
        self.after.replay()


def capture_in_pieces(
    run: Callable[[], torch.Tensor], stream: torch.cuda.Stream, pool: tuple[int, int] | None
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple[Trip, ...]]:
    """Capture `run` (a step's work, issued on `stream`) as a first graph and the trips to the CPU
    experts that follow it, each holding its next piece: replay the first, then each trip in order.
    Returns (first graph, run's output, trips). `pool`: the memory pool to capture into (None: a new one)."""
    first = torch.cuda.CUDAGraph()
    capturing = [first]
    trips: list[Trip] = []

    def cross(x, gate, up, down, weights, ids, fused) -> torch.Tensor:  # an `ops.moe.Crossing`
        before = capturing[-1]
        before.capture_end()
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        after = torch.cuda.CUDAGraph()
        trips.append(Trip(x, weights, ids, y, (gate, up, down), fused, after))
        capturing.append(after)
        after.capture_begin(pool=before.pool())
        return y

    torch.cuda.synchronize()  # as torch.cuda.graph does: no earlier work runs into the capture
    with torch.cuda.stream(stream), moe.crossing(cross):
        first.capture_begin(pool=pool)
        try:
            out = run()
        finally:
            capturing[-1].capture_end()
    return first, out, tuple(trips)
