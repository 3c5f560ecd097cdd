"""Running `-sm row` layers (`plan.tensor_parallel`): every GPU of the split runs each such layer on its
own heads and FFN columns, with its own copy of the residual stream and its own KV heads.

Each GPU gets a model of its own over the same config: its layer groups hold its parts of the
`Sharded` tensors, and its two column-cut matrices (attention output, FFN down) are `PartialSum`s
whose products `kernels.exchange` adds across the GPUs. The model code is unchanged: a block on GPU
j reads like any other, its heads counted from the weights it holds.

How the GPUs' work is issued matters, because a GPU waiting in an exchange for a partner whose work
was never issued waits for ever. Inside a CUDA-graph capture nothing runs, so one thread issues the
GPUs layer by layer; outside one (prompts, and the warm-up before a capture) each GPU's part is
issued from its own thread, so a host sync in one (a Triton autotuner timing its candidates) cannot
hold back the others.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import torch

from llmx.models.common import Config, Model, Step, TensorGroup
from llmx.ops import PartialSum
from llmx.runtime.cache import KVCache
from llmx.runtime.weights import Sharded


@dataclass
class TensorParallel:
    """The GPUs of a split (the main one first), a model and KV cache on each, and the split layers.
    `models[0]` and `caches[0]` are the executor's own."""

    devices: list[torch.device]
    models: list[Model]
    caches: list[KVCache]
    layers: frozenset[int]
    _pool: ThreadPoolExecutor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._pool = ThreadPoolExecutor(len(self.devices) - 1, thread_name_prefix="llmx-split")

    def run(self, layers: list[int], x: torch.Tensor, step: Step) -> torch.Tensor:
        """Layers `layers` (all split) on every GPU from the main GPU's hidden state `x`; returns the
        main GPU's copy of the result."""
        devices = self.devices
        streams = [torch.cuda.current_stream(d) for d in devices]  # a capture's or warm-up's side streams
        xs = [x] + [x.to(d, non_blocking=True) for d in devices[1:]]
        steps = [step] + [Step(step.positions.to(d), step.masked, step.n_read) for d in devices[1:]]

        def block(j: int, i: int) -> None:
            writer = self.caches[j].writer(i, steps[j].positions, steps[j].n_read)
            xs[j] = self.models[j].block(i, xs[j], steps[j], writer)

        def shard(j: int) -> None:
            with torch.cuda.device(devices[j]), torch.cuda.stream(streams[j]):
                for i in layers:
                    block(j, i)

        if torch.cuda.is_current_stream_capturing():
            for i in layers:
                for j, d in enumerate(devices):
                    with torch.cuda.device(d):
                        block(j, i)
        else:
            others = [self._pool.submit(shard, j) for j in range(1, len(devices))]
            shard(0)
            for f in others:
                f.result()
        return xs[0]


def exchange_reducers(devices: list[str], capacity: int) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """For each GPU of a split, the function adding its partial sums of up to `capacity` values to
    the other GPUs' (`kernels.exchange`)."""
    from llmx.kernels.exchange import Exchange  # Triton: only where a split runs

    exchange = Exchange([torch.device(d) for d in devices], capacity)
    return [partial(exchange.all_reduce, rank=j) for j in range(len(devices))]


def deal(
    cls: type[Model],
    config: Config,
    top: TensorGroup,
    groups: list[TensorGroup],
    reducers: list[Callable[[torch.Tensor], torch.Tensor]],
) -> list[Model]:
    """One model a GPU of a split, `Sharded` tensors dealt out and GPU j's column-cut matrices adding
    their products with `reducers[j]`; without reducers (no split) just the one model."""

    def part(value: object, j: int) -> object:
        if not isinstance(value, Sharded):
            return value
        w = value.parts[j]
        return PartialSum(w, reducers[j]) if value.partial else w

    return [
        cls(
            config,
            top,
            [TensorGroup(f"blk.{i}.", {k: part(v, j) for k, v in g.items()}) for i, g in enumerate(groups)],
        )
        for j in range(max(len(reducers), 1))
    ]
