"""The hybrid forward pass: walk the blocks in device segments, move the hidden state between them.

A segment is a run of consecutive blocks on one device (the head joins the last one when it lives
there). Every op runs where its weight lives; only the activation (a few KB per token) crosses
devices. One-token decode steps on a GPU segment replay a captured CUDA graph, so Python and
kernel-launch overhead is paid once at capture instead of on every token. A graph reads the KV
cache in fixed-size buckets (positions past the current one are masked), so one graph serves a
whole range of context lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmx.models.common import Model, Step
from llmx.runtime.cache import KVCache

GRAPH_BUCKET = 256  # tokens: a decode graph attends over the cache rounded up to this


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


@dataclass
class _Graph:
    """One captured decode step of one segment: fill `x_in`/`positions`, replay, read `x_out`."""

    graph: torch.cuda.CUDAGraph
    x_in: torch.Tensor
    positions: torch.Tensor
    x_out: torch.Tensor


@dataclass
class Executor:
    model: Model
    cache: KVCache
    layer_devices: list[torch.device]
    embed_device: torch.device
    head_device: torch.device
    use_graphs: bool = True
    _segments: list[Segment] = field(init=False)
    _graphs: dict[tuple[int, int], _Graph] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._segments = segments(self.layer_devices, self.head_device)

    def _run_segment(
        self, seg: Segment, x: torch.Tensor, step: Step, n_read: int, all_logits: bool = False
    ) -> torch.Tensor:
        for i in seg.layers:
            x = self.model.block(i, x, step, self.cache.writer(i, step.positions, n_read))
        if not seg.with_head:
            return x
        return self.model.head(x if all_logits else x[-1:])

    def forward(self, ids: list[int], n_past: int, all_logits: bool) -> torch.Tensor:
        """Logits [T or 1, vocab] (float32, CPU) for `ids` placed at positions n_past, n_past+1, ..."""
        t = len(ids)
        x = self.model.embed(torch.tensor(ids, dtype=torch.long, device=self.embed_device))
        positions = torch.arange(n_past, n_past + t)
        for k, seg in enumerate(self._segments):
            x = x.to(seg.device)
            if t == 1 and self.use_graphs and seg.device.type == "cuda":
                x = self._replay(k, seg, x, n_past)
            else:
                step = Step(positions.to(seg.device), masked=t > 1)
                x = self._run_segment(seg, x, step, n_past + t, all_logits)
        return x.float().cpu()

    # --- CUDA graphs ------------------------------------------------------------------------------

    def _replay(self, k: int, seg: Segment, x: torch.Tensor, n_past: int) -> torch.Tensor:
        bucket = min(-(-(n_past + 1) // GRAPH_BUCKET) * GRAPH_BUCKET, self.cache.n_ctx)
        g = self._graphs.get((k, bucket))
        if g is None:
            g = self._graphs[(k, bucket)] = self._capture(seg, x, n_past, bucket)
        g.x_in.copy_(x)
        g.positions.fill_(n_past)
        g.graph.replay()
        return g.x_out

    def _capture(self, seg: Segment, x: torch.Tensor, n_past: int, bucket: int) -> _Graph:
        x_in = x.clone()
        positions = torch.full((1,), n_past, dtype=torch.long, device=seg.device)
        step = Step(positions, masked=True)
        # Warm up outside the graph (Triton autotuning, lazy allocations), on a side stream as
        # CUDA graph capture requires; it computes exactly what the replay will.
        side = torch.cuda.Stream(seg.device)
        side.wait_stream(torch.cuda.current_stream(seg.device))
        with torch.cuda.stream(side):
            self._run_segment(seg, x_in, step, bucket)
        torch.cuda.current_stream(seg.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x_out = self._run_segment(seg, x_in, step, bucket)
        return _Graph(graph, x_in, positions, x_out)
