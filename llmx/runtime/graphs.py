"""CUDA graphs of the executor's GPU segments: decode steps by context bucket, prompt batches by shape.

One-token decode steps on a GPU segment replay a captured graph, so Python and kernel-launch
overhead is paid once at capture instead of on every token. A decode graph reads the KV cache in
fixed-size buckets (positions past the current one are masked), so one graph serves a whole range
of context lengths. A prompt batch is captured too, the second time its exact shape (tokens,
position) comes: a prompt of 512 tokens launches ~1800 kernels, and issuing them from Python takes
about twice as long as the GPU takes to run them. Repeated shapes are common: every full `-ub` chunk
of a long prompt, a benchmark's repetitions, a server's prompts re-read from the start. Prompt
graphs of one device share one memory pool (they never run at the same time, and each one's output
is consumed before the next replays), so they reuse one another's blocks; that pool is memory the
plan does not count, and a capture that runs out of it turns prompt graphs off.

A decode step whose row-split matrices or split layers (`-sm row`) span GPUs is one graph too,
holding every GPU's kernels and the exchanges between them (see `GraphCache.capture`); where this
torch or driver cannot capture or replay it exactly, a warning says so and those steps run eagerly.
A decode step of a segment whose layers keep their expert stacks in RAM is one graph too, which
meets the host at those layers while the host serves their experts (`runtime.host_trips`); its
prompts run eagerly.
Prompts across GPUs run eagerly (capturing them beside the decode graphs crashed a later decode
replay on torch 2.11; not understood yet).

A server's batched decode step (`runtime.batch.decode_padded`: every chunk one token) replays a graph
per segment, batch bucket and table-width bucket (`batch_bucket`, `width_bucket`): its hidden state,
positions and block tables are copied into the graph's static buffers, padding rows fill the bucket.
Those graphs of one device share one memory pool, as prompt graphs do; a capture that fails (out of
memory, an op that cannot be captured) turns them off for that segment with a warning. Segments with
peers run batched steps eagerly; those with experts in RAM meet the host in their graphs as decode
steps do.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from llmx.errors import first_line
from llmx.models.common import Step
from llmx.ops import current_device
from llmx.runtime.host_trips import HostTrips, capture_with_trips
from llmx.runtime.segments import Segment

GRAPH_BUCKET = 256  # tokens: a decode graph attends over the cache rounded up to this
# Prompt graphs kept per executor, the least recently used going first: enough for every -ub chunk
# of a 16k-token prompt read again (each graph holds only its kernels' parameters; the activations
# live in the device's shared pool).
PROMPT_GRAPHS = 32
PROMPT_SHAPES_REMEMBERED = 4096  # prompt shapes seen once, waiting for a second sighting
# A server's batched decode step (`runtime.batch`) of B sequences replays the graph of the smallest
# of these at least B (padding rows fill it), its block tables as wide as the longest sequence's
# context rounded up to GRAPH_BUCKET; past the last, steps run eagerly.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)
# Batched decode graphs kept per executor, the least recently used going first: every batch bucket
# at 6 widths (1.5K positions) of one segment; their activations share one pool per device.
BATCH_GRAPHS = 48

# Runs a segment eagerly (what a capture records): (segment, hidden state, step, all logits) -> output
RunSegment = Callable[[Segment, torch.Tensor, Step, bool], torch.Tensor]
PromptKey = tuple[int, int, int, bool]  # (segment, tokens, position, all logits)
BatchKey = tuple[int, int, int]  # (segment, batch bucket, table width in blocks)
# Runs a segment's batched decode step eagerly: (hidden state [B, E], positions [B], tables [B, W]) -> output
RunBatch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def batch_bucket(n: int) -> int | None:
    """The batch size a decode step of `n` sequences is padded to: the smallest of BATCH_BUCKETS at
    least n; None past the last (the step runs eagerly)."""
    return next((b for b in BATCH_BUCKETS if b >= n), None)


def width_bucket(n_read: int, block_rows: int, seq_ctx: int) -> int:
    """The blocks of a batched decode graph's tables for sequences whose longest reads `n_read`
    positions: rounded up to GRAPH_BUCKET positions (a decode graph's bucket), at most a sequence's
    `seq_ctx` (whole blocks), so one graph serves every context in that range."""
    positions = min(-(-n_read // GRAPH_BUCKET) * GRAPH_BUCKET, seq_ctx)
    return -(-positions // block_rows)


@dataclass
class Graph:
    """One captured step of one segment: fill `x_in`/`positions`, replay, read `x_out`. A step that
    meets CPU experts serves its `trips` while it replays."""

    graph: torch.cuda.CUDAGraph
    x_in: torch.Tensor
    positions: torch.Tensor
    x_out: torch.Tensor
    pools: tuple = ()  # the peer GPUs' memory pools (row split): alive as long as the graph
    trips: HostTrips | None = None
    tables: torch.Tensor | None = None  # a batched decode step's block tables [B, W]

    def replay(self) -> None:
        if self.trips is None:
            self.graph.replay()
        else:
            self.trips.run(self.graph.replay)


@dataclass
class GraphCache:
    """The graphs of one executor's segments (numbered as its segments are), captured on first use."""

    run: RunSegment
    n_ctx: int
    with_trips: frozenset[int] = frozenset()  # segments with experts in RAM (`runtime.host_trips`)
    decode: dict[tuple[int, int], Graph] = field(default_factory=dict)  # by (segment, bucket)
    prompt: dict[PromptKey, Graph] = field(default_factory=dict)  # least recently used first
    prompt_off: bool = False  # a prompt capture ran out of memory: prompts run eagerly from then on
    uncaptured: set[int] = field(default_factory=set)  # segments across GPUs this torch cannot capture
    batch: dict[BatchKey, Graph] = field(default_factory=dict)  # least recently used first
    batch_off: set[int] = field(default_factory=set)  # segments whose batched steps run eagerly
    batch_captures: int = 0  # batched decode graphs captured, and steps replayed (tests count them)
    batch_replays: int = 0
    _prompt_shapes_seen: set[PromptKey] = field(default_factory=set)
    _pools: dict[torch.device, tuple[int, int]] = field(default_factory=dict)
    _batch_pools: dict[torch.device, tuple[int, int]] = field(default_factory=dict)
    _batch_outs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # by (segment, bucket)
    _streams: dict[torch.device, torch.cuda.Stream] = field(default_factory=dict)
    _trips: dict[tuple[int, int], HostTrips] = field(default_factory=dict)  # by (segment, rows)

    def trips(self, k: int, seg: Segment, rows: int) -> HostTrips | None:
        """Segment k's trips to its experts in RAM for steps of `rows` tokens, shared by all its graphs
        of that many rows (they never run at once: one set of pinned buffers, not one a context or
        width bucket); None for a segment without such layers."""
        if k not in self.with_trips:
            return None
        if (k, rows) not in self._trips:
            self._trips[(k, rows)] = HostTrips(seg.device)
        return self._trips[(k, rows)]

    def replay_decode(
        self, k: int, seg: Segment, x: torch.Tensor, n_past: int, peers: Sequence[torch.device]
    ) -> torch.Tensor | None:
        """One decode step of segment k from a graph of its bucket (captured on first use; with trips to
        the CPU for the segments `with_trips`); None when a segment that spans GPUs (`peers`) cannot be
        captured here (from then on at once): the step runs eagerly."""
        if k in self.uncaptured:
            return None
        bucket = min(-(-(n_past + 1) // GRAPH_BUCKET) * GRAPH_BUCKET, self.n_ctx)
        g = self.decode.get((k, bucket))
        if g is None:
            positions = torch.full((1,), n_past, dtype=torch.long, device=seg.device)
            try:
                with current_device(seg.device):
                    g = self.capture(
                        seg, x, positions, bucket, False, True, peers=peers, trips=self.trips(k, seg, 1)
                    )
            except Exception as e:  # across GPUs any failure (CUDA, this torch's API) means eager steps
                if not peers:
                    raise
                self.uncaptured.add(k)
                warnings.warn(
                    f"llmx: a decode step across {len(peers) + 1} GPUs could not be captured in "
                    f"one CUDA graph here ({first_line(e)}); it runs without one",
                    stacklevel=3,
                )
                return None
            self.decode[(k, bucket)] = g
        with current_device(seg.device):
            g.x_in.copy_(x)
            g.positions.fill_(n_past)
            g.replay()
        return g.x_out

    def prompt_wanted(self, key: PromptKey) -> bool:
        """Whether a prompt batch of this (segment, tokens, position, logits) runs from a graph: once
        one is captured, or when the shape comes a second time (the first ran eagerly); never after
        a capture ran out of memory."""
        if self.prompt_off:
            return False
        if key in self.prompt or key in self._prompt_shapes_seen:
            return True
        if len(self._prompt_shapes_seen) >= PROMPT_SHAPES_REMEMBERED:
            self._prompt_shapes_seen.clear()
        self._prompt_shapes_seen.add(key)
        return False

    def replay_prompt(
        self, k: int, seg: Segment, x: torch.Tensor, n_past: int, all_logits: bool
    ) -> torch.Tensor:
        """A prompt batch of segment k from its graph: the attention reads exactly the rows up to the
        batch's last token, as the eager step does, so the key holds the position."""
        t = x.shape[0]
        key = (k, t, n_past, all_logits)
        g = self.prompt.pop(key, None)
        if g is None:
            if len(self.prompt) >= PROMPT_GRAPHS:  # dicts keep order: the first is the oldest
                del self.prompt[next(iter(self.prompt))]
            positions = torch.arange(n_past, n_past + t, device=seg.device)
            pool = self._pools.setdefault(seg.device, torch.cuda.graph_pool_handle())
            try:  # the same shape already ran eagerly: kernels are compiled and tuned, no warm-up needed
                g = self.capture(seg, x, positions, n_past + t, all_logits, warm_up=False, pool=pool)
            except torch.OutOfMemoryError:
                self._stop_prompt_graphs()
                return self.run(seg, x, Step(positions, masked=True, n_read=n_past + t), all_logits)
        self.prompt[key] = g  # most recently used last
        g.x_in.copy_(x)
        g.graph.replay()
        return g.x_out

    def _stop_prompt_graphs(self) -> None:
        """A prompt graph's pool is memory the plan does not count: where it does not fit, prompts
        run eagerly from then on, as the plan assumed, rather than fail."""
        self.prompt_off = True
        self.prompt.clear()
        self._pools.clear()
        torch.cuda.empty_cache()
        warnings.warn(
            "llmx: no GPU memory left to capture prompt graphs; prompts run without them", stacklevel=4
        )

    def replay_batch(
        self,
        k: int,
        seg: Segment,
        x: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        run: RunBatch,
    ) -> torch.Tensor | None:
        """A batched decode step of segment k from the graph of its shape (`x` [B, E] of a batch
        bucket, `tables` [B, W] of a width bucket; captured on first use after a warm-up that `run`s
        the step eagerly): the inputs are copied into the graph's (`positions` and `tables` may be on
        the host, pinned: copied without waiting), the graph replayed, its output returned (valid
        until this segment's next step). None where a capture failed, for this segment from then on
        (a warning says so): the step runs eagerly."""
        if k in self.batch_off:
            return None
        key = (k, x.shape[0], tables.shape[1])
        g = self.batch.pop(key, None)
        if g is None:
            if len(self.batch) >= BATCH_GRAPHS:  # dicts keep order: the first is the oldest
                del self.batch[next(iter(self.batch))]
            try:
                g = self._capture_batch(k, seg, x, positions, tables, run)
            except Exception as e:  # any failure (memory, an op that cannot be captured): eager steps
                self._stop_batch_graphs(k, e)
                return None
            self.batch_captures += 1
        self.batch[key] = g  # most recently used last
        assert g.tables is not None
        with current_device(seg.device):
            g.x_in.copy_(x)
            g.positions.copy_(positions, non_blocking=True)
            g.tables.copy_(tables, non_blocking=True)
            g.replay()
        self.batch_replays += 1
        return g.x_out

    def _capture_batch(
        self,
        k: int,
        seg: Segment,
        x: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        run: RunBatch,
    ) -> Graph:
        """Capture segment `seg`'s batched decode step into its device's pool of batched graphs (they
        never run at the same time, and each one's output is consumed before the segment's next step).
        The step ends by copying its output into one buffer of its segment and batch bucket, which
        every width's graph shares: so the pool reuses the memory of each graph's output (the logits
        of 64 rows of a 128K vocabulary are 32 MB) rather than keeping one a graph."""
        d, bucket = seg.device, x.shape[0]
        x_in = x.clone()
        p_in = positions.to(d, non_blocking=True).clone()
        t_in = tables.to(d, non_blocking=True).clone()
        pool = self._batch_pools.setdefault(d, torch.cuda.graph_pool_handle())

        def body() -> torch.Tensor:
            y = run(x_in, p_in, t_in)
            out = self._batch_outs.get((k, bucket))
            if out is None or out.shape != y.shape or out.dtype != y.dtype:  # the warm-up: not captured
                out = self._batch_outs[(k, bucket)] = torch.empty_like(y)
            return out.copy_(y)

        with current_device(d):
            trips = self.trips(k, seg, bucket)
            graph, x_out, _ = self.record(d, body, warm_up=True, pool=pool, trips=trips)
        return Graph(graph, x_in, p_in, x_out, trips=trips, tables=t_in)

    def _stop_batch_graphs(self, k: int, e: Exception) -> None:
        """Segment k's batched steps run eagerly from now on: a capture failed (out of memory: the
        graphs' pool is memory the plan does not count; or an op this torch cannot capture)."""
        self.batch_off.add(k)
        for key in [key for key in self.batch if key[0] == k]:
            del self.batch[key]
        for key in [key for key in self._batch_outs if key[0] == k]:
            del self._batch_outs[key]
        if not self.batch:
            self._batch_pools.clear()
        torch.cuda.empty_cache()
        warnings.warn(
            f"llmx: a batched decode step could not be captured in a CUDA graph ({first_line(e)}); "
            "batched steps run without one",
            stacklevel=4,
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

    def capture(
        self,
        seg: Segment,
        x: torch.Tensor,
        positions: torch.Tensor,
        n_read: int,
        all_logits: bool,
        warm_up: bool,
        pool: tuple[int, int] | None = None,
        peers: Sequence[torch.device] = (),
        trips: HostTrips | None = None,
    ) -> Graph:
        """Capture a step of `seg` (see `record`): its hidden state copied into `x_in`, which the
        replays read."""
        x_in = x.clone()
        # a fresh Step each call, so the capture records its per-step gathers rather than reusing them
        step = lambda: Step(positions, masked=True, n_read=n_read)  # noqa: E731
        graph, x_out, pools = self.record(
            seg.device, lambda: self.run(seg, x_in, step(), all_logits), warm_up, pool, peers, trips
        )
        return Graph(graph, x_in, positions, x_out, pools, trips)

    def record(
        self,
        device: torch.device,
        body: Callable[[], torch.Tensor],
        warm_up: bool,
        pool: tuple[int, int] | None = None,
        peers: Sequence[torch.device] = (),
        trips: HostTrips | None = None,
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple]:
        """Capture `body` (a step's work on `device`, reading static inputs, each call making its
        per-step tensors afresh) -> (graph, its output, peer pools). With `warm_up` it runs once
        outside the graph first (Triton autotuning, lazy allocations, RoPE tables) on the side stream,
        as capture requires; it computes exactly what the replay will. With `peers` (the other GPUs of
        row-split matrices and split layers) their work runs on side streams forked from and joined to
        the capture stream, so one graph records every GPU's kernels and copies; their allocations go
        to memory pools the graph keeps. Such a graph is replayed once and must give the warm-up's
        output bit for bit, else RuntimeError. `trips` (never with peers): the graph meets the host at
        its layers with experts in RAM, through these trips (its warm-up makes those not yet made;
        `runtime.host_trips`)."""
        stream = self._side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        sides = {d: self._side_stream(d) for d in peers}
        if trips is not None:
            with collection_paused():
                return *capture_with_trips(body, stream, pool, trips), ()
        warm = None
        if warm_up:
            with torch.cuda.stream(stream), forked(stream, sides, {}):
                warm = body()
            torch.cuda.current_stream(device).wait_stream(stream)
        pools = {d: torch.cuda.MemPool() for d in peers}
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.graph(graph, pool=pool, stream=stream)
        with collection_paused(), capture, forked(stream, sides, pools):
            x_out = body()
        if peers and warm is not None:
            graph.replay()
            if not torch.equal(x_out, warm):
                raise RuntimeError("the captured step differs from the eager one")
        return graph, x_out, tuple(pools.values())


@contextlib.contextmanager
def collection_paused():
    """Python's garbage collector held off while a graph is captured: what it collects may hold pinned
    host memory (an earlier model's trips to its CPU experts), which torch frees through CUDA calls
    that a capture forbids, invalidating it (cudaErrorStreamCaptureInvalidated). Nothing is collected
    first (torch.cuda.graph does that only under torch.compiler.config.force_cudagraph_gc): garbage
    waits for the next collection after the capture, where a full one before each capture cost ~100 ms
    (SmolLM2 loaded, the 2-core CPU), and a server captures a graph per batch bucket."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
