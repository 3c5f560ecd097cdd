"""One forward over several sequences: decode tokens and prompt chunks share a step, over a paged cache.

The rows of every sequence in the step form one activation [T, E], so the embedding, the norms, every
matmul (`ops.linear` on the QWeights, which reads each weight once for all T rows) and the FFN run
once for the whole batch: that is where batching pays. Only attention is per sequence: each reads its
own blocks of the paged cache (`runtime.paged`) with the existing attention ops. RoPE rotates each row
by its own position.

This is the eager path on every device (no CUDA graphs, no fused decode kernel, no op offload or
expert staging yet); the single-sequence path (`Engine`, `Executor.forward`) is not changed by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from llmx.errors import LlmxError
from llmx.models.common import Step
from llmx.ops import current_device
from llmx.ops.cached_attention import cached_attention
from llmx.ops.rope import Rope
from llmx.runtime.blocks import BlockTable
from llmx.runtime.executor import Executor
from llmx.runtime.paged import PagedKVCache, SequenceKV


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
    in `rope_store_attend`, attending each sequence's rows `bounds` over its own cache `views` (so it
    needs none of the `ops.LayerKV` members that the eager path after that call uses)."""

    views: list[SequenceKV]
    steps: list[Step]  # per sequence: its positions, and its masks (made once, shared by the layers)
    bounds: list[tuple[int, int]]  # per sequence: its rows of the activation

    def rope_store_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope, cos: torch.Tensor,
        sin: torch.Tensor, mask: torch.Tensor | None, window: int | None, scale: float | None,
        softcap: float | None,
    ) -> torch.Tensor:  # fmt: skip
        """q [T, H, D], k and v [T, Hk, D] of the whole batch -> [T, H * D]: RoPE over every row at
        once, then each sequence's rows stored and attended; `mask` (the batch's: None) is replaced by
        each sequence's."""
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        outs = [
            cached_attention(q[a:b], k[a:b], v[a:b], kv, step.mask(window), window, scale, softcap)
            for (a, b), kv, step in zip(self.bounds, self.views, self.steps, strict=True)
        ]
        return torch.cat(outs)


@dataclass
class _Layout:
    """Where each chunk's rows sit, in the activation and in the pool; tensors made once per device."""

    cache: PagedKVCache
    chunks: Sequence[Chunk]
    bounds: list[tuple[int, int]] = field(init=False)
    _steps: dict[torch.device, list[Step]] = field(default_factory=dict, init=False)
    # per pool device, per chunk: the pool rows it writes and those it reads
    _rows: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict, init=False
    )

    def __post_init__(self) -> None:
        ends = torch.tensor([len(c.ids) for c in self.chunks]).cumsum(0).tolist()
        self.bounds = [(end - len(c.ids), end) for c, end in zip(self.chunks, ends, strict=True)]

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
        pool = self.cache.k[i].device
        if pool not in self._rows:
            self._rows[pool] = [self._pool_rows(c, pool) for c in self.chunks]
        steps = self.steps(device)
        views = [
            self.cache.layer(i, step.positions, slots, rows)
            for step, (slots, rows) in zip(steps, self._rows[pool], strict=True)
        ]
        return BatchKV(views, steps, self.bounds)

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
    for c in chunks:
        cache.blocks.reserve(c.table, len(c.ids))
    layout = _Layout(cache, chunks)
    model = executor.model
    ids = torch.cat([_ids(c.ids, executor.embed_device) for c in chunks])
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


def _ids(ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A chunk's ids on `device` (ids sampled on a GPU reach a CPU embedding table once they exist)."""
    if isinstance(ids, torch.Tensor):
        return ids.to(device)
    return torch.tensor(ids, dtype=torch.long, device=device)
