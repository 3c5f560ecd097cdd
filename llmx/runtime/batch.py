"""One forward over several sequences: decode tokens and prompt chunks share a step, over a paged cache.

The rows of every sequence in the step form one activation [T, E], so the embedding, the norms, every
matmul (`ops.linear` on the QWeights, which reads each weight once for all T rows) and the FFN run
once for the whole batch: that is where batching pays. Attention reads each sequence's own blocks of
the paged cache (`runtime.paged`): the decode tokens of all sequences in one call a layer
(`DecodeTokens`: the native kernel on the CPU, Triton's paged decode kernel on a GPU), the prompt
chunks of all sequences in one more (`PromptChunks`: one store, then Triton's flash kernel over the
pool, on a GPU). On the CPU, a step's short prompt chunks go to the native kernel with the decode
tokens, every row a token of its sequence (`TOKEN_CHUNK_ROWS`); where neither takes them, each
sequence's rows run the existing attention ops over its rows gathered. RoPE rotates each row by its
own position.

A step of decode tokens alone (every chunk one token: the usual step while no prompt is being read)
replays a CUDA graph on GPUs where every segment can hold one (`decode_padded`, `Executor.batch_graphs`):
its B sequences are padded to a batch bucket and its block tables to a width bucket
(`runtime.graphs.batch_bucket`, `width_bucket`), so a graph serves every step of that shape. A padding
row decodes token 0 at position 0 of the pool's scratch block (`BlockPool.scratch`): it writes nowhere
a sequence reads, and its logits are dropped. Steps with prompt chunks, and placements a graph cannot
hold (CPU layers, row splits), run eagerly (experts in RAM are served inside the graph,
`runtime.host_trips`); so does everything else (no op offload or
expert staging yet). The single-sequence path (`Engine`, `Executor.forward`) is not changed by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate, pairwise

import numpy as np
import torch

from llmx.errors import LlmxError
from llmx.models.common import Step
from llmx.ops import current_device
from llmx.ops.cached_attention import cached_attention
from llmx.ops.hadamard import rotate, rotate_qkv
from llmx.ops.norms import HeadNorms
from llmx.ops.rope import Rope
from llmx.quant.weight import decode_tokens
from llmx.runtime.blocks import BlockTable
from llmx.runtime.cpu_replay import CpuBatchReplay
from llmx.runtime.executor import Executor, ids_on
from llmx.runtime.graphs import batch_bucket, width_bucket
from llmx.runtime.paged import ChunkRows, PagedKVCache, SequenceKV
from llmx.runtime.segments import Segment

# On the CPU, a step whose prompt chunks are this long at most attends every row in one native call,
# each a token of its sequence (`PagedKVCache.decodes_chunks`), not each chunk over its own gathered rows
# (ten-odd ops a layer a chunk): a row attends alone, so long chunks read their keys once a row.
# SmolLM2 on the 2-core EPYC, one thread: eight short prompts (54 rows) 224-241 ms against 292-304,
# one prompt of 64 rows 265 against 278, of 128 rows 487 against 489, of 256 rows 3-5% slower.
TOKEN_CHUNK_ROWS = 128


@dataclass(frozen=True)
class Chunk:
    """One sequence's tokens in a step, placed after the positions its table holds; `logits`: whether
    the step returns the logits of its last token (a prompt's last chunk, a decode token). `ids` may
    be a tensor on a device (a token sampled there, not yet known to the host): the step does not
    commit it to the table, the caller does (`BlockPool.commit`) once it has read it."""

    table: BlockTable
    ids: Sequence[int] | torch.Tensor
    logits: bool = True


@dataclass(frozen=True)
class BatchStep(Step):
    """The step of the whole batch: `positions` [T] of every row, for the RoPE tables shared by all
    layers. There is no batch-wide mask: each sequence's comes from its own `Step` (`BatchKV`)."""

    def mask(self, window: int | None) -> None:
        return None


@dataclass(frozen=True)
class BatchKV:
    """A layer's cache for the batch, as the model's `ops.rope_attention` sees it: it takes every step
    in `rope_store_attend` (so it needs none of the `ops.LayerKV` members that the eager path after
    that call uses), its attention on `device`."""

    layout: _Layout
    layer: int
    device: torch.device

    def rope_store_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope, cos: torch.Tensor,
        sin: torch.Tensor, mask: torch.Tensor | None, window: int | None, scale: float | None,
        softcap: float | None, norms: HeadNorms | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """q [T, H, D], k and v [T, Hk, D] of the whole batch -> [T, H * D]. Every row goes in one
        call, a token of its sequence, where the prompt chunks are short and the paged cache's kernel
        takes several tokens of a sequence (`PagedKVCache.decodes_chunks`: the CPU's native one, with the
        `norms`). Else the decode tokens (chunks of one) go in one call where that kernel takes them;
        the other rows get the norms and RoPE at once, then are stored and attended in one more call
        where Triton's flash kernel takes them (`PromptChunks`), else each sequence's are stored and
        attended over its own gathered rows; `mask` (the batch's: None) is replaced by each
        sequence's."""
        layout, decoded = self.layout, None
        pool = layout.cache.k[self.layer].device
        chunked = len(layout.singles) < len(layout.chunks) and layout.longest <= TOKEN_CHUNK_ROWS
        if chunked and layout.cache.decodes_chunks(q):
            every = tuple(range(len(layout.chunks)))
            tokens = layout.cache.decode(self.layer, *layout.token_tables(every, pool))
            out = tokens.rope_store_attend(q, k, v, rope, cos, sin, window, scale, softcap, norms)
            if out is not None:
                return out
        if layout.singles:
            every = len(layout.singles) == len(layout.chunks)
            rows = None if every else layout.activation_rows(layout.singles, q.device)
            q1, k1, v1, cos1, sin1 = (t if rows is None else t[rows] for t in (q, k, v, cos, sin))
            tokens = layout.cache.decode(self.layer, *layout.token_tables(layout.singles, pool))
            decoded = tokens.rope_store_attend(q1, k1, v1, rope, cos1, sin1, window, scale, softcap, norms)
            if decoded is not None and rows is None:
                return decoded  # every row a decode token: the usual step
        eager = tuple(j for j in range(len(layout.chunks)) if decoded is None or j not in layout.singles)
        rows = None if len(eager) == len(layout.chunks) else layout.activation_rows(eager, q.device)
        if rows is not None:
            q, k, v, cos, sin = (t[rows] for t in (q, k, v, cos, sin))
        if norms is not None:
            q, k = norms(q, k)
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        rotation = layout.cache.rotation[self.layer]  # the pools' (`ops.rope_attention`'s eager path)
        q, k, v = rotate_qkv(q, k, v, rotation)
        prompts = layout.cache.prompts(self.layer)
        if prompts.takes(q):
            rows_in_pool = layout.prompt_rows(eager, q.device)
            out = prompts.store_attend(q, k, v, rows_in_pool, window, scale, softcap)
        else:
            starts = [0, *accumulate(len(layout.chunks[j].ids) for j in eager)]
            out = torch.cat([
                self._attend_alone(j, q[a:b], k[a:b], v[a:b], window, scale, softcap)
                for j, (a, b) in zip(eager, pairwise(starts), strict=True)
            ])  # fmt: skip
        out = rotate(out, rotation[1])
        if decoded is None:
            return out
        full = torch.empty(layout.bounds[-1][1], decoded.shape[1], dtype=decoded.dtype, device=decoded.device)
        full[layout.activation_rows(layout.singles, q.device)] = decoded
        full[rows] = out
        return full

    def _attend_alone(
        self, j: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
        scale: float | None, softcap: float | None,
    ) -> torch.Tensor:  # fmt: skip
        """Chunk j's rows q, k, v stored and attended over its sequence's rows gathered (`SequenceKV`)."""
        layout = self.layout
        kv, mask = layout.view(self.layer, j, self.device), layout.steps(self.device)[j].mask(window)
        return cached_attention(q, k, v, kv, mask, window, scale, softcap)


@dataclass
class _Layout:
    """Where each chunk's rows sit, in the activation and in the pool; tensors made once per device."""

    cache: PagedKVCache
    chunks: Sequence[Chunk]
    bounds: list[tuple[int, int]] = field(init=False)
    singles: tuple[int, ...] = field(init=False)  # the chunks of one token (decode steps), ascending
    longest: int = field(init=False)  # the most tokens a chunk has
    _steps: dict[torch.device, list[Step]] = field(default_factory=dict, init=False)
    # per pool device, per chunk: the pool rows it writes and those it reads
    _rows: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict, init=False
    )
    # per pool device and set of chunks: their rows' block tables and positions
    _token_tables: dict[tuple[torch.device, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False
    )
    # per device and set of chunks: their rows of the activation, and where they lie in the pools
    _activation_rows: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = field(
        default_factory=dict, init=False
    )
    _prompt_rows: dict[tuple[torch.device, tuple[int, ...]], ChunkRows] = field(
        default_factory=dict, init=False
    )

    def __post_init__(self) -> None:
        ends = torch.tensor([len(c.ids) for c in self.chunks]).cumsum(0).tolist()
        self.bounds = [(end - len(c.ids), end) for c, end in zip(self.chunks, ends, strict=True)]
        self.singles = tuple(j for j, c in enumerate(self.chunks) if len(c.ids) == 1)
        self.longest = max((len(c.ids) for c in self.chunks), default=0)

    def steps(self, device: torch.device) -> list[Step]:
        if device not in self._steps:
            self._steps[device] = [
                Step(torch.arange(c.table.length, c.table.length + len(c.ids), device=device),
                     masked=len(c.ids) > 1, n_read=c.table.length + len(c.ids))
                for c in self.chunks
            ]  # fmt: skip
        return self._steps[device]

    def batch_step(self, device: torch.device) -> BatchStep:
        steps = self.steps(device)
        return BatchStep(torch.cat([s.positions for s in steps]), True, max(s.n_read for s in steps))

    def kv(self, i: int, device: torch.device) -> BatchKV:
        """Layer i's cache for the batch, its attention on `device`."""
        return BatchKV(self, i, device)

    def view(self, i: int, j: int, device: torch.device) -> SequenceKV:
        """Layer i's view for chunk j, its attention on `device`."""
        pool = self.cache.k[i].device
        if pool not in self._rows:
            self._rows[pool] = [self._pool_rows(c, pool) for c in self.chunks]
        slots, rows = self._rows[pool][j]
        return self.cache.layer(i, self.steps(device)[j].positions, slots, rows)

    def token_tables(
        self, chunks: tuple[int, ...], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block tables and positions of `chunks`' rows (indices, ascending), as `DecodeTokens`
        takes them: a chunk's table once for each of its rows. On `device`, copied there once a step
        (every layer of a device reads the same)."""
        key = (device, chunks)
        if key not in self._token_tables:
            picked = [self.chunks[j] for j in chunks]
            spans = [range(c.table.length, c.table.length + len(c.ids)) for c in picked]
            positions = torch.tensor([p for span in spans for p in span], dtype=torch.long)
            counts = torch.tensor([len(c.ids) for c in picked])
            tables = self.cache.tables([c.table for c in picked]).repeat_interleave(counts, dim=0)
            self._token_tables[key] = tables.to(device), positions.to(device)
        return self._token_tables[key]

    def activation_rows(self, chunks: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The rows of the activation that `chunks` (indices, ascending) hold, on `device`."""
        key = (device, chunks)
        if key not in self._activation_rows:
            rows = torch.cat([torch.arange(*self.bounds[j]) for j in chunks])
            self._activation_rows[key] = rows.to(device, non_blocking=True)
        return self._activation_rows[key]

    def prompt_rows(self, chunks: tuple[int, ...], device: torch.device) -> ChunkRows:
        """Where `chunks` (indices, ascending) lie in the pools on `device` (`PagedKVCache.chunk_rows`)."""
        key = (device, chunks)
        if key not in self._prompt_rows:
            picked = [self.chunks[j] for j in chunks]
            lengths = [len(c.ids) for c in picked]
            self._prompt_rows[key] = self.cache.chunk_rows([c.table for c in picked], lengths, device)
        return self._prompt_rows[key]

    def _pool_rows(self, c: Chunk, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool rows this step writes for chunk `c`, and those its attention reads."""
        rows = self.cache.rows(c.table, c.table.length + len(c.ids), device)
        return rows[c.table.length :], rows

    def last_rows(self, device: torch.device) -> torch.Tensor:
        """The activation rows whose logits are wanted: each such chunk's last."""
        rows = [b - 1 for c, (_, b) in zip(self.chunks, self.bounds, strict=True) if c.logits]
        return torch.tensor(rows, dtype=torch.long, device=device)


@torch.inference_mode()
def forward_batch(
    executor: Executor, cache: PagedKVCache, chunks: Sequence[Chunk], on_device: bool = False
) -> torch.Tensor:
    """Run every chunk in one step; logits [chunks with `logits`, vocab] (float32, on the CPU or, if
    `on_device`, left on the head's device), in the chunks' order. Each table of a chunk of host ids
    grows by them (blocks are taken as needed), and the blocks they fill are known to the prefix
    cache once the step is over."""
    if executor.split is not None:
        raise LlmxError("serving with -np > 1 does not support -sm row yet; use -sm layer or -np 1")
    graphs = range(len(executor.segments))
    if all(len(c.ids) == 1 for c in chunks) and all(executor.batch_graphs(k) for k in graphs):
        out = decode_padded(executor, cache, chunks, on_device)
        if out is not None:
            return out
    replays = executor.cpu_batch(cache)
    if replays is not None and all(len(c.ids) == 1 for c in chunks):
        out = cpu_decode(executor, cache, chunks, replays, on_device)
        if out is not None:
            return out
    for c in chunks:
        cache.blocks.reserve(c.table, len(c.ids))
    layout = _Layout(cache, chunks)
    model = executor.model
    ids = torch.cat([ids_on(c.ids, executor.embed_device) for c in chunks])
    with current_device(executor.embed_device):
        x = model.embed(ids)
    for seg in executor.segments:
        x = executor.move(x, seg.device)
        step = layout.batch_step(seg.device)
        with current_device(seg.device):
            for i in seg.layers:
                x = model.block(i, model.layers[i], x, step, layout.kv(i, seg.device))
            if seg.with_head:
                wanted = layout.last_rows(seg.device)
                x = model.head(x[wanted]) if len(wanted) else x.new_zeros(0, model.config.n_vocab)
    for c in chunks:
        if not isinstance(c.ids, torch.Tensor):
            cache.blocks.commit(c.table, c.ids)
    return x.float() if on_device else x.float().cpu()


@dataclass(frozen=True)
class PaddedKV:
    """A layer's cache for a padded decode step (`decode_padded`): every row one token, all of them
    taken by `DecodeTokens` in one call; `tables` [B, W] and `positions` [B] on the pool's device."""

    cache: PagedKVCache
    layer: int
    tables: torch.Tensor
    positions: torch.Tensor

    def rope_store_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope, cos: torch.Tensor,
        sin: torch.Tensor, mask: torch.Tensor | None, window: int | None, scale: float | None,
        softcap: float | None, norms: HeadNorms | None = None,
    ) -> torch.Tensor:  # fmt: skip
        tokens = self.cache.decode(self.layer, self.tables, self.positions)
        out = tokens.rope_store_attend(q, k, v, rope, cos, sin, window, scale, softcap, norms)
        if out is None:
            raise LlmxError("a padded batched decode step needs the paged decode kernel on the pools' device")
        return out


def decode_rows(
    executor: Executor, cache: PagedKVCache, seg: Segment, x: torch.Tensor, positions: torch.Tensor,
    tables: torch.Tensor, step: BatchStep | None = None,
) -> torch.Tensor:  # fmt: skip
    """Segment `seg` of a padded decode step, eagerly (what its CUDA graph holds): x [B, E] -> its
    output (the logits of every row, padding rows too, where the head is in it). Reads nothing back
    to the host: the launches' shapes come from B and the tables' width W alone. `step`: the step of
    `positions` over W blocks, where the caller holds it (its RoPE angles)."""
    model = executor.model
    step = step or BatchStep(positions, True, tables.shape[1] * cache.block_rows)
    for i in seg.layers:
        x = model.block(i, model.layers[i], x, step, PaddedKV(cache, i, tables, positions))
    return model.head(x) if seg.with_head else x


def padded_inputs(
    cache: PagedKVCache, chunks: Sequence[Chunk], bucket: int, scratch: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's positions (int64 [bucket]) and block tables (int32 [bucket, width]) on the
    host: each sequence's row, then the padding rows', at position 0 of the `scratch` block (a
    sequence's row past its blocks holds `scratch` too: never read)."""
    tables = np.full((bucket, width), scratch, dtype=np.int32)
    positions = np.zeros(bucket, dtype=np.int64)
    for j, c in enumerate(chunks):
        tables[j, : len(c.table.blocks)] = c.table.blocks
        positions[j] = c.table.length
    return torch.from_numpy(positions), torch.from_numpy(tables)


@torch.inference_mode()
def decode_padded(
    executor: Executor, cache: PagedKVCache, chunks: Sequence[Chunk], on_device: bool = False
) -> torch.Tensor | None:
    """`forward_batch` of decode tokens alone (each chunk one token), padded to
    a batch bucket and a width bucket: segments that can (`Executor.batch_graphs`) replay the graph
    of that shape, the others run it eagerly (`decode_rows`). Logits of the chunks that want them,
    as `forward_batch`'s (left on the device, they may be a graph's output: valid until the next
    step). None, nothing run, where the step cannot be padded: more sequences than the last bucket,
    no block free for the padding rows to write into, or a layer the paged decode kernel does not
    take; `forward_batch` then runs it unpadded."""
    b, model = len(chunks), executor.model
    bucket = batch_bucket(b)
    if bucket is None or not cache.decodes_every_layer(model.config.head_dim):
        return None
    for c in chunks:
        cache.blocks.reserve(c.table, 1)
    scratch = cache.blocks.scratch() if bucket > b else 0  # without padding rows nothing reads it
    if scratch is None:
        return None
    width = width_bucket(max(c.table.length for c in chunks) + 1, cache.block_rows, cache.seq_ctx)
    positions, tables = padded_inputs(cache, chunks, bucket, scratch, width)
    cuda = torch.cuda.is_available()
    if cuda:  # pinned, so the copies to the GPUs need not wait (torch keeps them until copied)
        positions, tables = positions.pin_memory(), tables.pin_memory()
    embed = executor.embed_device
    if any(isinstance(c.ids, torch.Tensor) for c in chunks):  # ids sampled on a device
        pad = torch.zeros(bucket - b, dtype=torch.long, device=embed)
        ids = torch.cat([ids_on(c.ids, embed) for c in chunks] + [pad])
    else:
        host = torch.tensor([c.ids[0] for c in chunks] + [0] * (bucket - b), dtype=torch.long)
        ids = (host.pin_memory() if cuda and embed.type == "cuda" else host).to(embed, non_blocking=True)
    with current_device(embed):
        x = model.embed(ids)
    on_device_inputs: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for k, seg in enumerate(executor.segments):
        x = executor.move(x, seg.device)
        run = partial(decode_rows, executor, cache, seg)
        y = None
        if executor.batch_graphs(k):
            y = executor.graphs.replay_batch(k, seg, x, positions, tables, run)
        if y is None:
            if seg.device not in on_device_inputs:
                on_device_inputs[seg.device] = (positions.to(seg.device, non_blocking=True),
                                                tables.to(seg.device, non_blocking=True))  # fmt: skip
            with current_device(seg.device):
                y = run(x, *on_device_inputs[seg.device])
        x = y
    for c in chunks:
        if not isinstance(c.ids, torch.Tensor):
            cache.blocks.commit(c.table, c.ids)
    wanted = [j for j, c in enumerate(chunks) if c.logits]
    x = x[:b] if len(wanted) == b else x[torch.tensor(wanted, device=x.device)]
    return x.float() if on_device else x.float().cpu()


@torch.inference_mode()
def cpu_decode(
    executor: Executor, cache: PagedKVCache, chunks: Sequence[Chunk], replays: CpuBatchReplay,
    on_device: bool = False,
) -> torch.Tensor | None:  # fmt: skip
    """`forward_batch` of decode tokens alone (each chunk one token: on the host, or a tensor the
    sampler left, which the caller commits) on a CPU-only executor, as
    `decode_padded` runs it (`decode_rows`: one attention call a layer, no row gathered) but unpadded,
    its block tables as wide as a sequence's context: replayed from its native calls (`replays`, per
    batch size; `runtime.cpu_replay`). Logits as `forward_batch`'s (left "on the device", they are the
    replay's buffer: valid until the next step). None, nothing run, where the paged decode kernel does
    not take every layer or `replays` refuses the step; `forward_batch` then runs it eagerly."""
    model = executor.model
    if not cache.decodes_every_layer(model.config.head_dim):
        return None
    for c in chunks:
        cache.blocks.reserve(c.table, 1)
    positions, tables = padded_inputs(cache, chunks, len(chunks), 0, cache.seq_ctx // cache.block_rows)
    step = BatchStep(positions, True, cache.seq_ctx)
    ids = torch.cat([torch.as_tensor(c.ids, dtype=torch.long).reshape(1) for c in chunks])
    logits = replays.decode(ids, step, tables, partial(_cpu_rows, executor, cache))
    if logits is None:
        return None
    for c in chunks:
        if not isinstance(c.ids, torch.Tensor):
            cache.blocks.commit(c.table, c.ids)
    wanted = [j for j, c in enumerate(chunks) if c.logits]
    if len(wanted) < len(chunks):
        return logits[wanted]
    return logits if on_device else logits.clone()


def _cpu_rows(
    executor: Executor, cache: PagedKVCache, ids: torch.Tensor, step: BatchStep, tables: torch.Tensor
) -> torch.Tensor:
    """`cpu_decode`'s step eagerly (what its replay records): logits [B, vocab], the native kernels taking
    every row (`weight.decode_tokens`)."""
    with current_device(executor.embed_device), decode_tokens():
        x = executor.model.embed(ids)
        for seg in executor.segments:
            x = decode_rows(executor, cache, seg, x, step.positions, tables, step)
    return x
