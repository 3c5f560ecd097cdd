"""Running `-sm row` layers (`plan.tensor_parallel`): every GPU of the split runs each such layer on its
own heads and FFN columns, with its own copy of the residual stream and its own KV heads.

Each GPU gets a model of its own over the same config: its layer groups hold its parts of the
`Sharded` tensors, and its two column-cut matrices (attention output, FFN down) are `PartialSum`s
whose products `kernels.exchange` adds across the GPUs. The model code is unchanged: a block on GPU
j reads like any other, its heads counted from the weights it holds.

How the GPUs' work is issued matters, because a GPU waiting in an exchange for a partner whose work
was never issued waits for ever. Inside a CUDA-graph capture nothing runs, so one thread issues the
GPUs layer by layer. Outside one (prompts, and the warm-up before a capture) each GPU's part is
issued from a thread of its own, and at every exchange each thread waits until all of them have
issued it (`Rendezvous`): a thread that then blocks (a host sync such as a Triton autotuner timing
its candidates, or CUDA loading a kernel on first use, which may wait for its GPU to go idle while
holding Python's lock) waits only for kernels already issued, never for a partner it holds back.
When one GPU's part fails, the others' threads are freed and the error is raised.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import torch

from llmx.model_config import ModelConfig
from llmx.models.common import Model, Step, TensorGroup
from llmx.ops import PartialSum, current_device
from llmx.runtime.cache import KVCache
from llmx.runtime.weights import Sharded


class Rendezvous:
    """Where the threads issuing a split's GPUs meet at each exchange (outside a capture)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._barrier: threading.Barrier | None = None

    @contextlib.contextmanager
    def threads(self) -> Iterator[None]:
        """While each GPU's part is issued from a thread of its own."""
        self._barrier = threading.Barrier(self.n)
        try:
            yield
        finally:
            self._barrier = None

    def met(self) -> None:
        """Return once every thread has issued this exchange (at once when not in `threads`)."""
        if self._barrier is not None:
            self._barrier.wait()

    def abandon(self) -> None:
        """A thread failed: the others, waiting at an exchange it will never issue, raise
        threading.BrokenBarrierError."""
        if self._barrier is not None:
            self._barrier.abort()


@dataclass
class TensorParallel:
    """The GPUs of a split (the main one first), a model and KV cache on each, and the split layers.
    `models[0]` and `caches[0]` are the executor's own."""

    devices: list[torch.device]
    models: list[Model]
    caches: list[KVCache]
    layers: frozenset[int]
    rendezvous: Rendezvous
    _pool: ThreadPoolExecutor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._pool = ThreadPoolExecutor(len(self.devices) - 1, thread_name_prefix="llmx-split")

    def run(self, layers: list[int], x: torch.Tensor, step: Step) -> torch.Tensor:
        """Layers `layers` (all split) on every GPU from the main GPU's hidden state `x`; returns the
        main GPU's copy of the result."""
        devices, cuda = self.devices, self.devices[0].type == "cuda"  # (the CPU: tests)
        # a capture's or warm-up's side streams, which the threads must issue to
        streams = [torch.cuda.current_stream(d) if cuda else None for d in devices]
        xs = [x] + [x.to(d, non_blocking=True) for d in devices[1:]]
        steps = [step] + [Step(step.positions.to(d), step.masked, step.n_read) for d in devices[1:]]

        def block(j: int, i: int) -> None:
            writer = self.caches[j].writer(i, steps[j].positions, steps[j].n_read)
            model = self.models[j]
            xs[j] = model.block(i, model.layers[i], xs[j], steps[j], writer)

        errors: list[BaseException] = []

        def shard(j: int) -> None:
            try:
                with current_device(devices[j]), torch.cuda.stream(streams[j]):
                    for i in layers:
                        block(j, i)
            except BaseException as e:  # Ctrl-C too: no thread may stay waiting for a failed one
                errors.append(e)
                self.rendezvous.abandon()

        if cuda and torch.cuda.is_current_stream_capturing():
            for i in layers:
                for j, d in enumerate(devices):
                    with current_device(d):
                        block(j, i)
            return xs[0]
        with self.rendezvous.threads():
            others = [self._pool.submit(shard, j) for j in range(1, len(devices))]
            shard(0)
            for f in others:
                f.result()
        if errors:  # the first failure, not the partners' broken rendezvous it caused
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return xs[0]


def exchange_reducers(
    devices: list[torch.device], capacity: int, rendezvous: Rendezvous
) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """For each GPU of a split, the function adding its partial sums of up to `capacity` values to
    the other GPUs' (`kernels.exchange`), meeting the other threads once it is issued."""
    from llmx.kernels.exchange import Exchange  # Triton: only where a split runs

    exchange = Exchange(devices, capacity)
    return [meeting(partial(exchange.all_reduce, rank=j), rendezvous) for j in range(len(devices))]


def meeting(
    reduce: Callable[[torch.Tensor], torch.Tensor], rendezvous: Rendezvous
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`reduce`, returning only once every thread has issued the same exchange."""

    def reduce_and_meet(partial_sum: torch.Tensor) -> torch.Tensor:
        total = reduce(partial_sum)
        rendezvous.met()
        return total

    return reduce_and_meet


def deal(
    cls: type[Model],
    config: ModelConfig,
    top: TensorGroup,
    groups: list[TensorGroup],
    reducers: list[Callable[[torch.Tensor], torch.Tensor]],
    fused_moe: bool = True,
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
            fused_moe,
        )
        for j in range(max(len(reducers), 1))
    ]
