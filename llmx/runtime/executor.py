"""The hybrid forward pass: walk the blocks in device segments, move the hidden state between them.

A segment is a run of consecutive blocks on one device (`runtime.segments`). Every op runs where
its weight lives; only the activation (a few KB per token) crosses devices. GPU segments replay
CUDA graphs where they can (`runtime.graphs`; meeting the host at layers whose experts live in RAM,
`runtime.host_trips`), and a model wholly on the CPU replays its decode steps' native calls
(`runtime.cpu_replay`); a CPU segment's prompt batch may run on a GPU with its weights streamed there
(`runtime.offload`), the streamed copies handed to the blocks as values, and a GPU segment's prompt
batch may copy the experts it uses from RAM (`runtime.expert_staging`).

Each call also leaves `StepCounters` behind (`runtime.counters`): when the step was fully issued,
how long it waited for a GPU at a GPU -> CPU boundary, and the time and bytes of its CPU segments.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from llmx.models.common import Model, Step
from llmx.ops import current_device
from llmx.ops.moe import crossing
from llmx.ops.rope import Rope
from llmx.plan.memory import kv_read_bytes
from llmx.runtime.cache import KVCache
from llmx.runtime.counters import StepCounters, host_reads
from llmx.runtime.cpu_replay import CpuBatchReplay, CpuReplay
from llmx.runtime.expert_staging import ExpertStager
from llmx.runtime.graphs import GraphCache
from llmx.runtime.offload import WeightStreamer
from llmx.runtime.segments import Segment, capturable, host_expert_layers, peer_gpus, segments
from llmx.runtime.tensor_parallel import TensorParallel


class PinnedStaging:
    """A reused pinned host buffer through which the hidden state crosses from the CPU to a GPU.

    A copy from pageable memory first has the host copy the rows into the driver's own staging
    memory, competing with whatever else the host does at that moment, which made a prompt's time
    vary between repetitions (bench/RESULTS.md); from pinned memory the GPU reads the rows itself.
    The buffer is written again only after the copy out of it has ended.
    """

    def __init__(self) -> None:
        self._buffer = torch.empty(0)
        self._copied: torch.cuda.Event | None = None

    def to_gpu(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """x (on the CPU) on `device`, copied from the pinned buffer."""
        if self._copied is not None:
            self._copied.synchronize()
        n = x.numel()
        if self._buffer.numel() < n or self._buffer.dtype != x.dtype:
            self._buffer = torch.empty(n, dtype=x.dtype, pin_memory=True)
        staged = self._buffer[:n].view(x.shape)
        staged.copy_(x)
        out = staged.to(device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(device))
        return out


@dataclass
class Executor:
    model: Model
    cache: KVCache
    layer_devices: list[torch.device]
    embed_device: torch.device
    head_device: torch.device
    use_graphs: bool = True
    op_offload: torch.device | None = None  # the GPU that runs CPU layers' prompt batches
    stage_experts: bool = False  # prompts copy the experts they use from RAM to their layer's GPU
    split: TensorParallel | None = None  # -sm row: the layers every GPU of the split runs a part of
    segments: list[Segment] = field(init=False)
    graphs: GraphCache = field(init=False)
    last: StepCounters = field(default_factory=StepCounters, init=False)
    _graphable: list[bool] = field(init=False)
    _peers: list[list[torch.device]] = field(init=False)  # per segment: other GPUs of row-split matrices
    _host_experts: list[tuple[int, ...]] = field(init=False)  # per segment: `host_expert_layers`
    _streamer: WeightStreamer | None = field(default=None, init=False)
    _stager: ExpertStager | None = field(default=None, init=False)
    _staging: PinnedStaging = field(default_factory=PinnedStaging, init=False)
    _cpu_replay: CpuReplay | None = field(default=None, init=False)  # a CPU-only model's decode steps
    _cpu_batch: CpuBatchReplay | None = field(default=None, init=False)  # and its batches' (`cpu_batch`)
    # per segment: (weight bytes, its CPU caches as (K+V bytes a position, positions held))
    _cpu_reads: list[tuple[int, tuple[tuple[float, int], ...]]] = field(init=False)

    def __post_init__(self) -> None:
        self.segments = segments(self.layer_devices, self.head_device)
        self._peers = [peer_gpus(seg, self.model, self.split) for seg in self.segments]
        self._host_experts = [host_expert_layers(seg, self.model) for seg in self.segments]
        # a step with trips to the host holds one GPU's work: with peers, such a segment runs eagerly
        self._graphable = [
            capturable(seg, self.model, self.cache) and not (self._host_experts[k] and self._peers[k])
            for k, seg in enumerate(self.segments)
        ]
        with_trips = frozenset(k for k, layers in enumerate(self._host_experts) if layers)
        self.graphs = GraphCache(self._run_segment, self.cache.n_ctx, with_trips)
        self._cpu_reads = [host_reads(seg, self.model, self.cache) for seg in self.segments]
        devices = {*self.layer_devices, self.embed_device, self.head_device}
        if self.split is None and {d.type for d in devices} == {"cpu"}:
            ropes = [r for r in vars(self.model).values() if isinstance(r, Rope)]
            vocab = self.model.top.token_embd.shape[0]
            self._cpu_replay = CpuReplay(ropes, vocab)
        if self.op_offload is not None and any(d.type == "cpu" for d in self.layer_devices):
            self._streamer = WeightStreamer(self.op_offload, self.model.layers)
        if self.stage_experts and any(self._host_experts):
            layers = [self.model.layers[i] for host in self._host_experts for i in host]
            stacks = [(w.ffn_gate_exps, w.ffn_up_exps, w.ffn_down_exps) for w in layers]
            self._stager = ExpertStager(self.model.config.n_expert_used, stacks)

    @property
    def bytes_streamed(self) -> int:
        """Weight bytes copied to a GPU for prompt processing (op offload, staged experts) so far."""
        streamed = self._streamer.bytes_streamed if self._streamer else 0
        return streamed + (self._stager.bytes_streamed if self._stager else 0)

    def batch_graphs(self, k: int) -> bool:
        """Whether segment k's batched decode steps (`runtime.batch.decode_padded`) replay CUDA graphs:
        graphs on (`use_graphs`, the engine's switch), a GPU segment whose weights and KV all live on
        its GPU (no row-split matrices; experts in RAM are served by its trips to the host), no
        capture of it failed."""
        seg = self.segments[k]
        return (
            self.use_graphs
            and seg.device.type == "cuda"
            and self._graphable[k]
            and not self._peers[k]
            and k not in self.graphs.batch_off
        )

    def cpu_batch(self, cache: object) -> CpuBatchReplay | None:
        """The replays of a CPU-only model's batched decode steps over the paged cache `cache`
        (`runtime.batch.cpu_decode`), made anew for another cache (their calls hold its pools); None
        where steps are not replayed (`use_graphs` off, a GPU in the placement)."""
        if not self.use_graphs or self._cpu_replay is None:
            return None
        if self._cpu_batch is None or self._cpu_batch.cache is not cache:
            self._cpu_batch = CpuBatchReplay(cache, self._cpu_replay.ropes, self._cpu_replay.vocab)
        return self._cpu_batch

    def _offloads(self, seg: Segment, t: int) -> bool:
        """Whether this CPU segment's prompt batch of `t` tokens runs on the GPU with streamed weights."""
        if self._streamer is None or seg.device.type != "cpu" or not seg.layers or t < 2:
            return False
        cpu_layers = (i for s in self.segments if s.device.type == "cpu" for i in s.layers)
        return self._streamer.worth_it(t, cpu_layers)

    def _stages(self, k: int, t: int) -> bool:
        """Whether GPU segment k's prompt batch of `t` tokens copies the experts it uses from RAM to
        its GPU (`runtime.expert_staging`)."""
        if self._stager is None or not self._host_experts[k] or t < 2:
            return False
        return self._stager.worth_it(t, self.segments[k].device)

    def _run_segment(
        self, seg: Segment, x: torch.Tensor, step: Step, all_logits: bool = False
    ) -> torch.Tensor:
        split = self.split.layers if self.split else frozenset()
        layers = self.model.layers
        for is_split, run in itertools.groupby(seg.layers, key=lambda i: i in split):
            if is_split:
                x = self.split.run(list(run), x, step)
                continue
            for i in run:
                x = self.model.block(i, layers[i], x, step, self.cache.writer(i, step.positions, step.n_read))
        if not seg.with_head:
            return x
        return self.model.head(x if all_logits else x[-1:])

    def forward(
        self, ids: list[int] | torch.Tensor, n_past: int, all_logits: bool, on_device: bool = False
    ) -> torch.Tensor:
        """Logits [T or 1, vocab] (float32; on the CPU, or left on the head's device if `on_device`)
        for `ids` placed at positions n_past, n_past+1, ... `ids` may be a tensor on a device (ids
        sampled there): an embedding table on the CPU then waits for them, one on that GPU does not.
        Logits left on the device may be a decode graph's output buffer, or on the CPU a replayed
        step's (`runtime.cpu_replay`): valid until the next step. A CPU-only model's one-token steps
        are replayed from the native calls of the first, where `use_graphs` and the step allow."""
        t = len(ids)
        counters = self.last = StepCounters()
        if t == 1 and self.use_graphs and self._cpu_replay is not None:
            started = time.perf_counter()
            logits = self._cpu_replay.decode(ids, n_past, self._cpu_step)
            if logits is not None:
                counters.issued_at = time.perf_counter()
                counters.cpu_seconds = counters.issued_at - started
                counters.cpu_bytes = sum(
                    w + round(kv_read_bytes(kv, n_past + 1)) for w, kv in self._cpu_reads
                )
                return logits if on_device else logits.clone()  # the replay's buffer: valid until the next
        with current_device(self.embed_device):
            x = self.model.embed(ids_on(ids, self.embed_device))
        positions = torch.arange(n_past, n_past + t)
        for k, seg in enumerate(self.segments):
            arriving = time.perf_counter()
            x = self.move(x, seg.device)
            graphs = self.use_graphs and seg.device.type == "cuda" and self._graphable[k]
            if (
                graphs
                and t == 1
                and (y := self.graphs.replay_decode(k, seg, x, n_past, self._peers[k])) is not None
            ):
                x = y
            elif (
                graphs
                and not self._peers[k]
                and not self._host_experts[k]  # their prompts wait for the host: eager
                and self.graphs.prompt_wanted((k, t, n_past, all_logits))
            ):
                with current_device(seg.device):
                    x = self.graphs.replay_prompt(k, seg, x, n_past, all_logits)
            elif self._offloads(seg, t):
                with current_device(self._streamer.device):
                    x = self._run_streamed(
                        seg, self.move(x, self._streamer.device), positions, n_past + t, all_logits
                    )
            else:
                step = Step(positions.to(seg.device), masked=t > 1, n_read=n_past + t)
                started = time.perf_counter()
                staged = crossing(self._stager) if self._stages(k, t) else contextlib.nullcontext()
                with current_device(seg.device), staged:
                    x = self._run_segment(seg, x, step, all_logits)
                if seg.device.type == "cpu":
                    counters.waited += started - arriving
                    counters.cpu_seconds += time.perf_counter() - started
                    weights, kv = self._cpu_reads[k]
                    counters.cpu_bytes += weights + round(kv_read_bytes(kv, n_past + t))
        counters.issued_at = time.perf_counter()
        return x.float() if on_device else x.float().cpu()

    def _cpu_step(self, ids: torch.Tensor, step: Step) -> torch.Tensor:
        """A CPU-only model's one-token step, eagerly (what `CpuReplay` records): logits [1, vocab]."""
        with current_device(self.embed_device):
            x = self.model.embed(ids)
            for seg in self.segments:
                x = self._run_segment(seg, x, step)
        return x

    def move(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """x on `device`: from the CPU to a GPU through the pinned staging buffer; from a GPU to the CPU
        this waits for the GPU's work so far."""
        if x.is_cpu and device.type == "cuda":
            return self._staging.to_gpu(x, device)
        return x.to(device)

    def _run_streamed(
        self, seg: Segment, x: torch.Tensor, positions: torch.Tensor, n_read: int, all_logits: bool
    ) -> torch.Tensor:
        """A CPU segment computed on the streaming GPU, each block given its streamed weights."""
        step = Step(positions.to(self._streamer.device), masked=True, n_read=n_read)
        for i, w in self._streamer.streamed(list(seg.layers)):
            x = self.model.block(i, w, x, step, self.cache.writer(i, step.positions, step.n_read))
        x = x.to(seg.device)
        if not seg.with_head:
            return x
        return self.model.head(x if all_logits else x[-1:])


def ids_on(ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Token ids on `device` (ids sampled on a GPU reach a CPU embedding table once they exist)."""
    if isinstance(ids, torch.Tensor):
        return ids.to(device)
    return torch.tensor(ids, dtype=torch.long, device=device)
