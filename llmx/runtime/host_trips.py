"""A GPU decode step that crosses to its experts in RAM inside one CUDA graph (`--cpu-moe`, `-ncmoe`).

A layer on a GPU whose routed experts live on the CPU needs the host in the middle of the step: its
normed hidden state, routing weights and expert ids go to the CPU's experts, and their weighted sum
comes back. The step is still one graph: each such layer's crossing is a trip, a pair of kernels
(`kernels.host_handoff`) that hand the operands to pinned host memory and wait there for the result,
and while the graph runs the host serves the trips in order (`HostTrips.run`): it watches a trip's
flag, runs the layer's experts on the CPU and raises the trip's done flag. Where every trip's experts
are one native call on their GGUF blocks (`quant.weight.moe_swiglu`, writing straight into the trip's
host buffer), one native call serves the whole step (`cpu_native.Program.serve_trips`: no Python
between layers); otherwise Python serves each trip (`ops.moe_ffn` for stacks the native kernels do
not read). Between layers the host makes no CUDA call, and the GPU's work between trips (attention,
router, shared expert) is never relaunched.

A trip's buffers are made by the eager run before the first capture (the warm-up), which crosses
through them exactly as the replays will (the same kernels, the host serving each trip as it comes),
so no pinned memory is allocated and no kernel compiled while a graph is captured; the capture hands
the same trips, in the same order, to its kernels. A segment's graphs of one step size (every context
bucket of its decode steps, every table width of a batch bucket) share one set of trips.
"""

from __future__ import annotations

import ctypes
import operator
import time
from collections.abc import Callable

import numpy as np
import torch

from llmx.errors import LlmxError
from llmx.kernels import host_handoff as handoff
from llmx.ops import moe
from llmx.quant import cpu_native
from llmx.quant import weight as qw
from llmx.quant.weight import QWeight

FLAG_STRIDE = 16  # int32s from one flag to the next: each on its own 64-byte line
HOST_WAIT = 30.0  # seconds the host waits for a trip's operands before it gives the step up


def _host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Host memory the GPU reaches directly (pinned, so mapped into its address space)."""
    return torch.zeros(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


def _not_reached() -> LlmxError:
    return LlmxError(f"the GPU did not reach a layer whose experts are in RAM within {HOST_WAIT:.0f} s; "
                     "the step was abandoned")  # fmt: skip


class Trip:
    """One layer's trip: host buffers x [T, E], weights [T, k], ids [T, k] and y [T, E], its ready and
    done flags, the experts that compute y (`recorded`: as one native call, where they are one), and on
    the device its row of addresses and its count."""

    def __init__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        stacks: tuple[QWeight, ...],
        fused: bool,
        alarms: torch.Tensor,
    ) -> None:
        self.x = _host(tuple(x.shape), torch.float32)
        self.weights = _host(tuple(weights.shape), torch.float32)
        self.ids = _host(tuple(weights.shape), torch.int64)
        self.y = _host(tuple(x.shape), torch.float32)
        self.flags = _host((2 * FLAG_STRIDE,), torch.int32)  # ready (the GPU's), done (the host's)
        self.ready, self.done = self.flags.data_ptr(), self.flags[FLAG_STRIDE:].data_ptr()
        self.stacks, self.fused = stacks, fused
        addresses = [t.data_ptr() for t in (self.x, self.weights, self.ids, self.y)]
        addresses += [self.ready, self.done, alarms.data_ptr(), alarms[FLAG_STRIDE:].data_ptr()]
        self.row = torch.tensor(addresses, dtype=torch.int64, device=x.device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=x.device)
        with cpu_native.recording_calls(0) as recorded:  # runs the experts once, on zeros
            native = self.experts()
        one_call = native and len(recorded.calls) == 1 and cpu_native.unreplayable(recorded) is None
        self.recorded = recorded if one_call else None

    def experts(self) -> bool:
        """The experts on the host buffers, into y; whether that was the native call."""
        gate, up, down = self.stacks
        if qw.moe_swiglu(self.x, gate, up, down, self.weights, self.ids, out=self.y) is not None:
            return True
        self.y.copy_(moe.moe_ffn(self.x, gate, up, down, self.weights, self.ids, self.fused))
        return False

    def cross(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Issue the trip's kernels for x, weights and ids (on the GPU): the experts' sum [T, E] float32
        there, once the host has served the trip."""
        assert x.shape == self.x.shape and weights.shape == ids.shape == self.weights.shape
        handoff.hand_over(x.contiguous(), weights.contiguous(), ids.contiguous(), self.row, self.counter)
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        handoff.take_back(y, self.row, self.counter)
        return y

    def serve(self) -> None:
        """Wait for the trip's operands (at most HOST_WAIT), run the experts, raise done."""
        flags = self.flags.numpy()
        deadline = time.monotonic() + HOST_WAIT
        while flags[0] == flags[FLAG_STRIDE]:
            if time.monotonic() > deadline:
                raise _not_reached()
        count = int(flags[0])
        self.experts()
        flags[FLAG_STRIDE] = count  # x86 keeps the stores to y before this one

    def caught_up(self) -> None:
        """Done set to ready, after a step whose trips were not all served (the GPU having finished)."""
        flags = self.flags.numpy()
        flags[FLAG_STRIDE] = flags[0]


class HostTrips:
    """The trips of a segment's captured steps of one shape on `device`, in the order its layers meet the
    CPU. Graphs that never run at once share them (a segment's decode steps of every context bucket):
    each meets every trip, and a trip's counted flags go on from graph to graph.

    `warm` is the crossing (`ops.moe.Crossing`) for a step's eager run before its capture, which makes
    each trip the first time (`add`) and crosses through it; `cross` the crossing during the capture,
    handing out those trips in order (`restart` before each run); `seal`, once captured, makes them one
    native call where each is one; `run` replays a graph and serves its trips."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.trips: list[Trip] = []
        self._alarms = _host((2 * FLAG_STRIDE,), torch.int32)  # abandon (the host's), late (the GPU's)
        self._next = 0  # the trip the step being run or captured meets next
        self.native: cpu_native.Program | None = None
        self._flags: tuple[ctypes.Array, ...] = ()  # the trips' ready and done flags' addresses, for `native`

    def __len__(self) -> int:
        return len(self.trips)

    def add(self, x: torch.Tensor, weights: torch.Tensor, stacks: tuple[QWeight, ...], fused: bool) -> Trip:
        """A new trip, last, for operands shaped as x [T, E] and weights [T, k]."""
        trip = Trip(x, weights, stacks, fused, self._alarms)
        self.trips.append(trip)
        return trip

    def restart(self) -> None:
        """A step's run or capture begins: its first crossing meets the first trip."""
        self._next = 0

    @property
    def met(self) -> int:
        """The trips the step being run or captured has met."""
        return self._next

    def _meet(self, x: torch.Tensor, weights: torch.Tensor, stacks: tuple[QWeight, ...], fused: bool) -> Trip:
        """The trip of the step's next crossing: made by an earlier run, else now."""
        i, self._next = self._next, self._next + 1
        if i == len(self.trips):
            return self.add(x, weights, stacks, fused)
        trip = self.trips[i]
        same = all(map(operator.is_, trip.stacks, stacks)) and trip.x.shape == x.shape
        assert same, "a step meets the CPU in another order or shape than the steps that share its trips"
        return trip

    def warm(self, x, gate, up, down, weights, ids, fused) -> torch.Tensor:
        """The next trip, crossed through eagerly (the host serving it at once)."""
        trip = self._meet(x, weights, (gate, up, down), fused)
        return self._served(lambda: trip.cross(x, weights, ids), trip.serve)

    def cross(self, x, gate, up, down, weights, ids, fused) -> torch.Tensor:
        """The next trip's kernels, captured."""
        assert self._next < len(self.trips), "a capture meets the CPU more often than its warm-up"
        return self._meet(x, weights, (gate, up, down), fused).cross(x, weights, ids)

    def seal(self) -> None:
        """The trips served by one native call a step (`native`) where each is one native call."""
        if self.native is None and self.trips and all(t.recorded is not None for t in self.trips):
            whole = cpu_native.Recording(0)
            for t in self.trips:
                whole.calls += t.recorded.calls
                whole.kept += t.recorded.kept
            self.native = cpu_native.Program(whole)
            ready = cpu_native.addresses([t.ready for t in self.trips])
            self._flags = (ready, cpu_native.addresses([t.done for t in self.trips]))

    def run(self, launch: Callable[[], None]) -> None:
        """launch() (the graph's replay), then serve every trip in order while it runs."""
        self._served(launch, self._serve_all)

    def _serve_all(self) -> None:
        if self.native is None:
            for trip in self.trips:
                trip.serve()
        elif self.native.serve_trips(*self._flags, HOST_WAIT):
            raise _not_reached()

    def _served(self, launch: Callable[[], torch.Tensor | None], serve: Callable[[], None]):
        """launch(), then serve(). A host that fails or is interrupted raises the abandon flag, so the
        GPU's waits end at once; the step's output is then lost and the error raised."""
        alarms = self._alarms.numpy()
        try:
            out = launch()
            serve()
        except BaseException:
            alarms[0] = 1
            self._recover()
            raise
        if alarms[FLAG_STRIDE]:
            self._recover()
            raise LlmxError("the GPU stopped waiting for the experts in RAM (the host took over "
                            f"{handoff.MAX_SPINS} polls); the step was abandoned")  # fmt: skip
        return out

    def _recover(self) -> None:
        """After an abandoned step: the GPU's work finished, the flags set for the next one."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for trip in self.trips:
            trip.caught_up()
        np.copyto(self._alarms.numpy(), 0)


def capture_with_trips(
    run: Callable[[], torch.Tensor], stream: torch.cuda.Stream, pool: tuple[int, int] | None, trips: HostTrips
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run `run` (a step's work, issued on `stream`) eagerly, crossing through `trips` (made as it
    first meets them), then capture it in one graph that crosses through them. Returns (graph, run's
    output): replay with `trips.run`."""
    trips.restart()
    with torch.cuda.stream(stream), moe.crossing(trips.warm):
        run()
    trips.restart()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream), moe.crossing(trips.cross):
        out = run()
    assert trips.met == len(trips), "a capture meets the CPU less often than its warm-up"
    trips.seal()
    return graph, out
