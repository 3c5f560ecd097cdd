"""Op offload for prompts: stream CPU-resident layers to a GPU and compute them there.

During decode a CPU layer's weights are used on the CPU (one token reads each weight once, and
PCIe is slower than RAM). A prompt batch of T tokens does T times the arithmetic per weight byte,
so past some T it is faster to copy the weights over PCIe and multiply on the GPU. The copies come
from page-locked memory (made once, on first use, and kept as the weights' only host copy) on a
side stream, one layer ahead of the compute, so transfer and compute overlap. The threshold T is
measured on this machine and cached.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from llmx.measured import best_seconds, remember, remembered
from llmx.models.common import TensorGroup
from llmx.quant.weight import QWeight, linear

MEASURE_TOKENS = 64
THRESHOLD_FILE = "offload.json"  # the thresholds measured, by GPU and thread count
NEVER = sys.maxsize  # the threshold where no CPU layer holds a CPU-resident matrix


@dataclass
class WeightStreamer:
    """Copies one layer's tensors at a time from pinned host memory to `device`. The copies are
    values handed to the caller; the model's own layers are never changed."""

    device: torch.device
    layers: list[TensorGroup]
    bytes_streamed: int = 0
    _stream: torch.cuda.Stream | None = None
    _threshold: int | None = None

    def worth_it(self, tokens: int, cpu_layers: Iterable[int]) -> bool:
        """Whether a prompt batch of `tokens` through CPU layers runs faster streamed to the GPU
        (`offload_threshold`, measured on the first call over `cpu_layers`)."""
        if self._threshold is None:
            self._threshold = offload_threshold((self.layers[i] for i in cpu_layers), self.device)
        return tokens >= self._threshold

    def streamed(self, order: list[int]) -> Iterator[tuple[int, TensorGroup]]:
        """(i, layer i's weights on the GPU) for i in `order`, each ready for the current stream when
        yielded: layer i+1 is copied while the caller computes layer i."""
        pending = self.prefetch(order[0])
        for n, i in enumerate(order):
            group, ready = pending
            if n + 1 < len(order):
                pending = self.prefetch(order[n + 1])
            torch.cuda.current_stream(self.device).wait_event(ready)
            yield i, group

    def prefetch(self, layer: int) -> tuple[TensorGroup, torch.cuda.Event]:
        """Start copying layer `layer` to the GPU; returns its GPU tensors and an event to wait on."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream, compute = self._stream, torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)  # buffers freed by the previous layer's compute are reusable
        moved: dict[str, object] = {}
        with torch.cuda.stream(stream):
            for key, value in self.layers[layer].items():
                if isinstance(value, QWeight) and value.raw.device.type == "cpu":
                    raw = pinned_raw(value).to(self.device, non_blocking=True)
                    raw.record_stream(compute)  # allocated on the copy stream, used on the compute one
                    moved[key] = QWeight(raw, value.qtype, value.shape, value.name)
                    self.bytes_streamed += raw.nbytes
                elif isinstance(value, torch.Tensor) and value.device.type == "cpu":
                    moved[key] = t = value.to(self.device, non_blocking=True)
                    t.record_stream(compute)
                else:
                    moved[key] = value
            done = torch.cuda.Event()
            done.record(stream)
        return TensorGroup(f"blk.{layer}.", moved), done


def pinned_raw(w: QWeight) -> torch.Tensor:
    """The weight's bytes in page-locked memory, made on first use. The pinned copy becomes the
    weight's own storage (the CPU reads it as fast for decode), so host memory holds each layer
    once; the file's pages it was read from stay only as reclaimable page cache."""
    if not w.raw.is_pinned():
        w.raw = w.raw.pin_memory()
    return w.raw


def offload_threshold(layers: Iterable[TensorGroup], device: torch.device) -> int:
    """Prompt tokens from which streaming CPU layers to `device` beats computing them on the CPU.

    Measured once per (CPU, GPU, thread count) on the first of `layers` that holds CPU-resident
    matrices (an `-ot` rule may have put some or all of a layer's on a GPU: those are neither
    computed on the CPU nor streamed): the CPU's time per token for them at MEASURE_TOKENS rows,
    against the time to copy their bytes from pinned memory. Without any, nothing streams.
    """
    # the matrices: an expert stack's time depends on the routing, which a random x does not show
    resident = (
        [w for _, w in g.items() if isinstance(w, QWeight) and w.raw.device.type == "cpu" and not w.experts]
        for g in layers
    )
    mats = next((m for m in resident if m), None)
    if mats is None:
        return NEVER
    key = f"offload|{torch.cuda.get_device_name(device)}|{torch.get_num_threads()} threads"
    kept = remembered(THRESHOLD_FILE).get(key)
    if kept is not None:
        return int(kept)
    x = {w.shape[1]: torch.randn(MEASURE_TOKENS, w.shape[1]) for w in mats}
    pinned = [w.raw.pin_memory() for w in mats]

    def compute() -> None:
        for w in mats:
            linear(x[w.shape[1]], w)

    def copy() -> None:
        for p in pinned:
            p.to(device, non_blocking=True)

    # each the quickest of three runs: the threshold is kept for every later process
    cpu_per_token = best_seconds(compute, 3) / MEASURE_TOKENS
    copy_seconds = best_seconds(copy, 3, lambda: torch.cuda.synchronize(device))
    threshold = max(2, math.ceil(copy_seconds / cpu_per_token))
    remember(THRESHOLD_FILE, key, threshold)
    return threshold
