"""The hybrid forward pass: walk the blocks in device segments, move the hidden state between them.

A segment is a run of consecutive blocks on one device (the head joins the last one when it lives
there). Every op runs where its weight lives; only the activation (a few KB per token) crosses
devices. One-token decode steps on a GPU segment replay a captured CUDA graph, so Python and
kernel-launch overhead is paid once at capture instead of on every token. A decode graph reads the
KV cache in fixed-size buckets (positions past the current one are masked), so one graph serves a
whole range of context lengths. A prompt batch is captured too, the second time its exact shape
(tokens, position) comes: a prompt of 512 tokens launches ~1800 kernels, and issuing them from
Python takes about twice as long as the GPU takes to run them. Repeated shapes are common: every
full `-ub` chunk of a long prompt, a benchmark's repetitions, a server's prompts re-read from the
start. Prompt graphs of one device share one memory pool (they never run at the same time, and
each one's output is consumed before the next replays), so they reuse one another's blocks; that pool
is memory the plan does not count, and a capture that runs out of it turns prompt graphs off. A
decode step whose row-split matrices or split layers (`-sm row`) span GPUs is one graph too, holding
every GPU's kernels and the exchanges between them (see `_capture`); where this torch or driver
cannot capture or replay it exactly, a warning says so and those steps run eagerly. Prompts across
GPUs run eagerly (capturing them beside the decode graphs crashed a later decode replay on
torch 2.11; not understood yet).

Each call also leaves `StepCounters` behind (perf_counter readings only, no added device sync):
when the step was fully issued, how long it waited for a GPU at a GPU -> CPU boundary, and the time
and bytes of its CPU segments. The engine turns them into the host-time and CPU-segment timings.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from llmx.errors import first_line
from llmx.models.common import Model, Step
from llmx.ops import PartialSum, RowSplit, current_device
from llmx.plan.memory import kv_read_bytes
from llmx.quant.weight import QWeight
from llmx.runtime.cache import KVCache
from llmx.runtime.offload import WeightStreamer, offload_threshold
from llmx.runtime.tensor_parallel import TensorParallel

GRAPH_BUCKET = 256  # tokens: a decode graph attends over the cache rounded up to this
# Prompt graphs kept per executor, the least recently used going first: enough for every -ub chunk
# of a 16k-token prompt read again (each graph holds only its kernels' parameters; the activations
# live in the device's shared pool).
PROMPT_GRAPHS = 32
PROMPT_SHAPES_REMEMBERED = 4096  # prompt shapes seen once, waiting for a second sighting


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


def _devices(value: QWeight | RowSplit | PartialSum | torch.Tensor) -> set[torch.device]:
    """Every device a layer's tensor lives on (a row-split matrix spans several GPUs)."""
    if isinstance(value, RowSplit):
        return {p.raw.device for p in value.parts}
    if isinstance(value, PartialSum):
        value = value.weight
    return {value.raw.device if isinstance(value, QWeight) else value.device}


@dataclass
class _Graph:
    """One captured decode step of one segment: fill `x_in`/`positions`, replay, read `x_out`."""

    graph: torch.cuda.CUDAGraph
    x_in: torch.Tensor
    positions: torch.Tensor
    x_out: torch.Tensor
    pools: tuple = ()  # the peer GPUs' memory pools (row split): alive as long as the graph


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


def _nbytes(value: object) -> int:
    """Bytes of a layer tensor that live in host memory (a row-split matrix lives on GPUs)."""
    if isinstance(value, QWeight):
        return value.raw.nbytes if value.raw.device.type == "cpu" else 0
    if isinstance(value, torch.Tensor):
        return value.nbytes if value.device.type == "cpu" else 0
    return 0


@dataclass
class Executor:
    model: Model
    cache: KVCache
    layer_devices: list[torch.device]
    embed_device: torch.device
    head_device: torch.device
    use_graphs: bool = True
    op_offload: torch.device | None = None  # the GPU that runs CPU layers' prompt batches
    split: TensorParallel | None = None  # -sm row: the layers every GPU of the split runs a part of
    _segments: list[Segment] = field(init=False)
    _graphable: list[bool] = field(init=False)
    _peers: list[list[torch.device]] = field(init=False)  # per segment: other GPUs of row-split matrices
    _graphs: dict[tuple[int, int], _Graph] = field(default_factory=dict, init=False)
    _prompt_graphs: dict[tuple[int, int, int, bool], _Graph] = field(default_factory=dict, init=False)
    _prompt_shapes_seen: set[tuple[int, int, int, bool]] = field(default_factory=set, init=False)
    _pools: dict[torch.device, tuple[int, int]] = field(default_factory=dict, init=False)
    _prompt_graphs_off: bool = field(default=False, init=False)
    _streams: dict[torch.device, torch.cuda.Stream] = field(default_factory=dict, init=False)
    _streamer: WeightStreamer | None = field(default=None, init=False)
    _offload_from: int | None = field(default=None, init=False)
    last: StepCounters = field(default_factory=StepCounters, init=False)
    # per segment: (weight bytes, its CPU caches as (K+V bytes a position, positions held))
    _cpu_reads: list[tuple[int, tuple[tuple[float, int], ...]]] = field(init=False)

    def __post_init__(self) -> None:
        self._segments = segments(self.layer_devices, self.head_device)
        self._graphable = [self._capturable(seg) for seg in self._segments]
        self._peers = [self._peer_gpus(seg) for seg in self._segments]
        self._cpu_reads = [self._host_reads(seg) for seg in self._segments]
        if self.op_offload is not None and any(d.type == "cpu" for d in self.layer_devices):
            self._streamer = WeightStreamer(self.op_offload, self.model.layers)

    def _capturable(self, seg: Segment) -> bool:
        """Whether a segment's weights and KV all live on its device, or (row-split matrices) on
        GPUs: then a CUDA graph can hold its decode step."""
        for i in seg.layers:
            if self.cache.k[i].device != seg.device:
                return False
            for _, value in self.model.layers[i].items():
                devices = _devices(value)
                on_gpus = isinstance(value, RowSplit) and all(d.type == "cuda" for d in devices)
                if devices != {seg.device} and not on_gpus:
                    return False
        return True

    def _peer_gpus(self, seg: Segment) -> list[torch.device]:
        """The other GPUs a segment's row-split matrices (its layers', and the head's) and split layers
        reach into."""
        values = [v for i in seg.layers for _, v in self.model.layers[i].items()]
        if seg.with_head:
            values += [v for _, v in self.model.top.items()]
        peers = {d for v in values if isinstance(v, RowSplit) for d in _devices(v)}
        if self.split and any(i in self.split.layers for i in seg.layers):
            peers |= set(self.split.devices)
        return sorted(peers - {seg.device}, key=str)

    def _host_reads(self, seg: Segment) -> tuple[int, tuple[tuple[float, int], ...]]:
        """What a one-token step of a CPU segment reads from RAM: its weight bytes, and its caches as
        (K+V bytes a position, positions held) for `kv_read_bytes`."""
        if seg.device.type != "cpu":
            return 0, ()
        weights = sum(_nbytes(v) for i in seg.layers for _, v in self.model.layers[i].items())
        caches = [(self.cache.k[i], self.cache.v[i]) for i in seg.layers]
        on_cpu = [(k, v) for k, v in caches if k.device.type == "cpu"]
        kv = tuple(((k.nbytes + v.nbytes) / k.shape[0], k.shape[0]) for k, v in on_cpu)
        if seg.with_head:  # the final norm and the output matrix (the embedding table when tied)
            top = self.model.top
            output = top.optional("output")
            weights += _nbytes(top.optional("output_norm")) + _nbytes(
                top.optional("token_embd") if output is None else output
            )
        return weights, kv

    @property
    def bytes_streamed(self) -> int:
        """Weight bytes copied to a GPU for prompt processing (op offload) so far."""
        return self._streamer.bytes_streamed if self._streamer else 0

    def _offloads(self, seg: Segment, t: int) -> bool:
        """Whether this CPU segment's prompt batch of `t` tokens runs on the GPU with streamed weights."""
        if self._streamer is None or seg.device.type != "cpu" or not seg.layers or t < 2:
            return False
        if self._offload_from is None:
            cpu_layers = (
                self.model.layers[i] for s in self._segments if s.device.type == "cpu" for i in s.layers
            )
            self._offload_from = offload_threshold(cpu_layers, self._streamer.device)
        return t >= self._offload_from

    def _run_segment(
        self, seg: Segment, x: torch.Tensor, step: Step, all_logits: bool = False
    ) -> torch.Tensor:
        split = self.split.layers if self.split else frozenset()
        for is_split, run in itertools.groupby(seg.layers, key=lambda i: i in split):
            if is_split:
                x = self.split.run(list(run), x, step)
                continue
            for i in run:
                x = self.model.block(i, x, step, self.cache.writer(i, step.positions, step.n_read))
        if not seg.with_head:
            return x
        return self.model.head(x if all_logits else x[-1:])

    def forward(self, ids: list[int], n_past: int, all_logits: bool) -> torch.Tensor:
        """Logits [T or 1, vocab] (float32, CPU) for `ids` placed at positions n_past, n_past+1, ..."""
        t = len(ids)
        counters = self.last = StepCounters()
        with current_device(self.embed_device):
            x = self.model.embed(torch.tensor(ids, dtype=torch.long, device=self.embed_device))
        positions = torch.arange(n_past, n_past + t)
        for k, seg in enumerate(self._segments):
            arriving = time.perf_counter()
            x = x.to(seg.device)  # from a GPU to the CPU this waits for the GPU's work so far
            graphs = self.use_graphs and seg.device.type == "cuda" and self._graphable[k]
            if graphs and t == 1 and (y := self._replay(k, seg, x, n_past)) is not None:
                x = y
            elif graphs and not self._peers[k] and self._prompt_graph_wanted((k, t, n_past, all_logits)):
                with current_device(seg.device):
                    x = self._replay_prompt(k, seg, x, n_past, all_logits)
            elif self._offloads(seg, t):
                with current_device(self._streamer.device):
                    x = self._run_streamed(
                        seg, x.to(self._streamer.device), positions, n_past + t, all_logits
                    )
            else:
                step = Step(positions.to(seg.device), masked=t > 1, n_read=n_past + t)
                started = time.perf_counter()
                with current_device(seg.device):
                    x = self._run_segment(seg, x, step, all_logits)
                if seg.device.type == "cpu":
                    counters.waited += started - arriving
                    counters.cpu_seconds += time.perf_counter() - started
                    weights, kv = self._cpu_reads[k]
                    counters.cpu_bytes += weights + round(kv_read_bytes(kv, n_past + t))
        counters.issued_at = time.perf_counter()
        return x.float().cpu()

    def _run_streamed(
        self, seg: Segment, x: torch.Tensor, positions: torch.Tensor, n_read: int, all_logits: bool
    ) -> torch.Tensor:
        """A CPU segment computed on the streaming GPU: layer i+1 is copied while layer i computes."""
        streamer, layers = self._streamer, self.model.layers
        step = Step(positions.to(streamer.device), masked=True, n_read=n_read)
        order = list(seg.layers)
        pending = streamer.prefetch(order[0])
        for n, i in enumerate(order):
            group, ready = pending
            if n + 1 < len(order):
                pending = streamer.prefetch(order[n + 1])
            torch.cuda.current_stream(streamer.device).wait_event(ready)
            resident, layers[i] = layers[i], group  # the block reads its weights from model.layers
            try:
                x = self.model.block(i, x, step, self.cache.writer(i, step.positions, step.n_read))
            finally:
                layers[i] = resident
        x = x.to(seg.device)
        if not seg.with_head:
            return x
        return self.model.head(x if all_logits else x[-1:])

    # --- CUDA graphs ------------------------------------------------------------------------------

    def _replay(self, k: int, seg: Segment, x: torch.Tensor, n_past: int) -> torch.Tensor | None:
        """One decode step of segment k from a graph of its bucket (captured on first use); None
        when a segment that spans GPUs cannot be captured here (it then runs eagerly from now on)."""
        bucket = min(-(-(n_past + 1) // GRAPH_BUCKET) * GRAPH_BUCKET, self.cache.n_ctx)
        g = self._graphs.get((k, bucket))
        if g is None:
            positions = torch.full((1,), n_past, dtype=torch.long, device=seg.device)
            try:
                with current_device(seg.device):
                    g = self._capture(seg, x, positions, bucket, False, warm_up=True, peers=self._peers[k])
            except Exception as e:  # across GPUs any failure (CUDA, this torch's API) means eager steps
                if not self._peers[k]:
                    raise
                self._graphable[k] = False
                warnings.warn(
                    f"llmx: a decode step across {len(self._peers[k]) + 1} GPUs could not be captured in "
                    f"one CUDA graph here ({first_line(e)}); it runs without one",
                    stacklevel=3,
                )
                return None
            self._graphs[(k, bucket)] = g
        with current_device(seg.device):
            g.x_in.copy_(x)
            g.positions.fill_(n_past)
            g.graph.replay()
        return g.x_out

    def _prompt_graph_wanted(self, key: tuple[int, int, int, bool]) -> bool:
        """Whether a prompt batch of this (segment, tokens, position, logits) runs from a graph: once
        one is captured, or when the shape comes a second time (the first ran eagerly); never after
        a capture ran out of memory."""
        if self._prompt_graphs_off:
            return False
        if key in self._prompt_graphs or key in self._prompt_shapes_seen:
            return True
        if len(self._prompt_shapes_seen) >= PROMPT_SHAPES_REMEMBERED:
            self._prompt_shapes_seen.clear()
        self._prompt_shapes_seen.add(key)
        return False

    def _replay_prompt(
        self, k: int, seg: Segment, x: torch.Tensor, n_past: int, all_logits: bool
    ) -> torch.Tensor:
        """A prompt batch of segment k from its graph: the attention reads exactly the rows up to the
        batch's last token, as the eager step does, so the key holds the position."""
        t = x.shape[0]
        key = (k, t, n_past, all_logits)
        g = self._prompt_graphs.pop(key, None)
        if g is None:
            if len(self._prompt_graphs) >= PROMPT_GRAPHS:  # dicts keep order: the first is the oldest
                del self._prompt_graphs[next(iter(self._prompt_graphs))]
            positions = torch.arange(n_past, n_past + t, device=seg.device)
            pool = self._pools.setdefault(seg.device, torch.cuda.graph_pool_handle())
            try:  # the same shape already ran eagerly: kernels are compiled and tuned, no warm-up needed
                g = self._capture(seg, x, positions, n_past + t, all_logits, warm_up=False, pool=pool)
            except torch.OutOfMemoryError:
                self._stop_prompt_graphs()
                return self._run_segment(seg, x, Step(positions, masked=True, n_read=n_past + t), all_logits)
        self._prompt_graphs[key] = g  # most recently used last
        g.x_in.copy_(x)
        g.graph.replay()
        return g.x_out

    def _stop_prompt_graphs(self) -> None:
        """A prompt graph's pool is memory the plan does not count: where it does not fit, prompts
        run eagerly from then on, as the plan assumed, rather than fail."""
        self._prompt_graphs_off = True
        self._prompt_graphs.clear()
        self._pools.clear()
        torch.cuda.empty_cache()
        warnings.warn(
            "llmx: no GPU memory left to capture prompt graphs; prompts run without them", stacklevel=4
        )

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The one stream a GPU's captures (and their warm-ups) run on. Its own GPU's: torch.cuda.graph's
        default capture stream is made once, on whichever GPU captures first, and a second GPU's
        kernels must not land on it. One per GPU: torch keeps a cuBLAS workspace (32 MiB on a Hopper
        GPU) for every stream that ever ran a matmul, so a stream per capture grew the memory of
        prompts 8192 tokens deep past the plan (992 MB against 745 MB, bench/RESULTS.md)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _capture(
        self,
        seg: Segment,
        x: torch.Tensor,
        positions: torch.Tensor,
        n_read: int,
        all_logits: bool,
        warm_up: bool,
        pool: tuple[int, int] | None = None,
        peers: Sequence[torch.device] = (),
    ) -> _Graph:
        """Capture a step of `seg`. With `peers` (the other GPUs of row-split matrices and split
        layers) their work runs on side streams forked from and joined to the capture stream, so one
        graph records every GPU's kernels and copies; their allocations go to memory pools the graph
        keeps. Such a graph is replayed once and must give the warm-up's output bit for bit, else
        RuntimeError."""
        x_in = x.clone()
        stream = self._side_stream(seg.device)
        stream.wait_stream(torch.cuda.current_stream(seg.device))
        sides = {d: self._side_stream(d) for d in peers}
        warm = None
        if warm_up:
            # Warm up outside the graph (Triton autotuning, lazy allocations, RoPE tables) on the side
            # stream, as capture requires; it computes exactly what the replay will. The capture gets
            # a fresh Step so its per-step gathers are recorded, not reused.
            with torch.cuda.stream(stream), forked(stream, sides, {}):
                warm = self._run_segment(seg, x_in, Step(positions, masked=True, n_read=n_read), all_logits)
            torch.cuda.current_stream(seg.device).wait_stream(stream)
        pools = {d: torch.cuda.MemPool() for d in peers}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream), forked(stream, sides, pools):
            x_out = self._run_segment(seg, x_in, Step(positions, masked=True, n_read=n_read), all_logits)
        g = _Graph(graph, x_in, positions, x_out, tuple(pools.values()))
        if peers and warm is not None:
            graph.replay()
            if not torch.equal(x_out, warm):
                raise RuntimeError("the captured step differs from the eager one")
        return g


@contextlib.contextmanager
def forked(stream: torch.cuda.Stream, sides: dict[torch.device, torch.cuda.Stream], pools: dict):
    """Work on the GPUs of `sides` goes to their streams, forked from `stream` and joined back at the
    end (a capture on `stream` then records it), allocating from `pools` where given; the current
    device stays `stream`'s."""
    for side in sides.values():
        side.wait_stream(stream)
    with contextlib.ExitStack() as stack:
        for d, side in sides.items():
            if d in pools:
                stack.enter_context(torch.cuda.use_mem_pool(pools[d], device=d))
            stack.enter_context(torch.cuda.stream(side))  # also makes `d` the current device
        stack.enter_context(torch.cuda.device(stream.device))
        yield
    for side in sides.values():
        stream.wait_stream(side)
