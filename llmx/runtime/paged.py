"""Paged KV cache: every layer's rows in fixed-size blocks, handed to sequences through block tables.

A layer's pool is [n_blocks * block_rows, Hk, row] in the cache's types (`runtime.cache`: floats or
GGUF blocks); block b is rows b * block_rows .. (b + 1) * block_rows - 1, and a sequence's position p
lives in row table[p // block_rows] * block_rows + p % block_rows. Which blocks a sequence holds,
and which it shares with others through the prefix cache, is `runtime.blocks`' bookkeeping.

As llama-server shares `-c` among `-np` slots, each sequence holds at most `seq_ctx` = -c / -np
positions (whole blocks), and the pool holds n_seq of those: never more rows than `-c`. The pool is
laid over the single-sequence cache's buffers (`PagedKVCache.over`), so serving with slots allocates
nothing beyond the plan; only a sliding-window layer, whose planned cache is a ring shorter than the
context, gets a pool of its own (every sequence keeps all its positions there, the window is a mask).
So a block shared through the prefix cache holds the same rows in every layer, sliding ones included:
no ring wraps over a shared position.

`SequenceKV` is one sequence's view of one layer for one step (an `ops.LayerKV`): it stores the
step's rows through the cache's writer (`cache.store_rows`) and returns the sequence's rows gathered
in position order, so the existing attention ops read them as they read a contiguous cache.
`DecodeTokens` is the decode tokens of several sequences in one layer for one step: one call stores
them all and attends each over its blocks where they lie (no gather): the native kernel on the CPU,
Triton's paged decode kernel (`kernels.decode_attention.paged_decode_attention`) on a GPU.
`PromptChunks` is the prompt chunks of several sequences in one layer for one step: one store of all
their rows, then one launch of Triton's flash kernel over the pool (`kernels.prefill_attention.
paged_prefill_attention`), each chunk reading its sequence's blocks where they lie.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmx.errors import LlmxError
from llmx.kernels import cpu_attention
from llmx.ops.cached_attention import AttentionKernels, flash_prefill
from llmx.ops.hadamard import kv_rotation
from llmx.ops.norms import HeadNorms
from llmx.ops.rope import Rope
from llmx.quant import QType, kv_layout
from llmx.quant.triton.launch import has_triton
from llmx.runtime.blocks import BlockPool, BlockTable
from llmx.runtime.cache import KVCache, head_dim, kv_buffer, store_rows

BLOCK_ROWS = 16  # positions a block holds: llama.cpp's KV cells are padded to 256, a multiple of it


class PagedKVCache:
    """Per-layer pools of `n_seq * seq_ctx` rows shared by up to `n_seq` sequences of `seq_ctx`
    positions each; `blocks` hands the blocks out, `layer` makes a step's views."""

    def __init__(
        self,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        types: tuple[QType, QType] | None,
        kernels: AttentionKernels,
        n_seq: int,
        seq_ctx: int,
        block_rows: int = BLOCK_ROWS,
        caching: bool = True,
    ) -> None:
        if seq_ctx < block_rows or seq_ctx % block_rows:
            raise LlmxError(f"a sequence's context ({seq_ctx}) must be whole blocks of {block_rows} rows")
        self.k, self.v, self.types, self.kernels = k, v, types, kernels
        self.n_seq, self.seq_ctx, self.block_rows = n_seq, seq_ctx, block_rows
        # each layer's Walsh-Hadamard rotation of keys and values as stored (`ops.hadamard`)
        self.rotation = [(0, 0)] * len(k)
        if types is not None:
            dims = [(head_dim(a, types[0]), head_dim(b, types[1])) for a, b in zip(k, v, strict=True)]
            self.rotation = [kv_rotation(types, d, a.device) for d, a in zip(dims, k, strict=True)]
        self.blocks = BlockPool(n_seq * seq_ctx // block_rows, block_rows, seq_ctx, caching)

    @classmethod
    def over(
        cls, cache: KVCache, n_seq: int, block_rows: int = BLOCK_ROWS, caching: bool = True
    ) -> PagedKVCache:
        """Pools laid over `cache`'s buffers for `n_seq` sequences sharing its context (-np slots
        sharing -c): a sequence holds -c / n_seq positions rounded down to whole blocks. `caching`:
        with the prefix cache."""
        seq_ctx = cache.n_ctx // n_seq // block_rows * block_rows
        if seq_ctx == 0:
            raise LlmxError(
                f"-c {cache.n_ctx} shared by {n_seq} slots leaves less than {block_rows} positions "
                "each; raise -c or lower -np"
            )
        rows = n_seq * seq_ctx

        def pool(buffer: torch.Tensor, qt: QType) -> torch.Tensor:
            if buffer.shape[0] >= rows:
                return buffer[:rows]
            return kv_buffer(rows, buffer.shape[1], head_dim(buffer, qt), qt, buffer.device)

        k = [pool(b, cache.types[0]) for b in cache.k]
        v = [pool(b, cache.types[1]) for b in cache.v]
        types = cache.types if cache.blocks else None
        return cls(k, v, types, cache.kernels, n_seq, seq_ctx, block_rows, caching)

    def rows(self, table: BlockTable, end: int, device: torch.device) -> torch.Tensor:
        """The pool rows [end] of `table`'s positions 0..end-1, on `device`."""
        blocks = torch.tensor(table.blocks, dtype=torch.long)
        rows = (blocks[:, None] * self.block_rows + torch.arange(self.block_rows)).flatten()
        return rows[:end].to(device)

    def layer(self, i: int, positions: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> SequenceKV:
        """Layer i's view for one sequence's step: it writes `positions` [T] into pool rows `slots` [T]
        and reads its `rows` [N] (slots and rows on the pool's device)."""
        n_read = rows.shape[0]
        k, v, rotation = self.k[i], self.v[i], self.rotation[i]
        return SequenceKV(k, v, positions, n_read, slots, rows, self.kernels, self.types, rotation)

    def tables(self, tables: Sequence[BlockTable]) -> torch.Tensor:
        """The tables' blocks as int32 [len(tables), most blocks], on the CPU (a short table padded with
        block 0, never read: a sequence reads only its own positions)."""
        width = max(len(t.blocks) for t in tables)
        return torch.tensor([t.blocks + [0] * (width - len(t.blocks)) for t in tables], dtype=torch.int32)

    def decodes_every_layer(self, width: int) -> bool:
        """Whether `DecodeTokens` takes the decode tokens of every layer (on a GPU, or anywhere with
        `kernels.decode` "on"): queries `width` wide, every pool's keys and values as wide, the
        kernels not "off". A padded batched decode step (`runtime.batch.decode_padded`) needs it."""
        kt, vt = self.types or (None, None)
        widths = {width}
        for k, v in zip(self.k, self.v, strict=True):
            typed = kt is not None and vt is not None
            widths |= {head_dim(k, kt), head_dim(v, vt)} if typed else {k.shape[-1], v.shape[-1]}
        return self.kernels.decode != "off" and len(widths) == 1

    def chunk_rows(
        self, tables: Sequence[BlockTable], lengths: Sequence[int], device: torch.device
    ) -> ChunkRows:
        """Where chunks of `lengths` rows, one a sequence of `tables` placed after the positions it
        holds (its blocks already reserved), lie in the pools: `ChunkRows` on `device`."""
        counts, br = torch.tensor(lengths), self.block_rows
        positions = torch.cat(
            [torch.arange(t.length, t.length + n) for t, n in zip(tables, lengths, strict=True)]
        )
        blocks = self.tables(tables)
        owner = torch.repeat_interleave(torch.arange(len(tables)), counts)
        slots = blocks[owner, positions // br].long() * br + positions % br
        starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        on = (slots, positions, starts, blocks)
        return ChunkRows(*(x.to(device, non_blocking=True) for x in on), longest=int(counts.max()))

    def prompts(self, i: int) -> PromptChunks:
        """Layer i's view for the prompt chunks of several sequences."""
        return PromptChunks(self.k[i], self.v[i], self.types, self.kernels, self.block_rows)

    def decodes_chunks(self, q: torch.Tensor) -> bool:
        """Whether `decode`'s call for queries q may take several tokens of a sequence (a prompt chunk's
        rows, its table repeated, at consecutive positions): the native CPU kernel stores every token
        before any attends (`llmx_paged_rope_store_attend`), so each attends its sequence's up to its
        own; Triton's kernel stores a program's token after its attention, where others may read it."""
        return self.kernels.decode == "auto" and not q.is_cuda

    def decode(self, i: int, tables: torch.Tensor, positions: torch.Tensor) -> DecodeTokens:
        """Layer i's view for one token of each of several sequences: sequence b's at positions[b]
        (int64 [B]) in its blocks tables[b] (`tables`), both on the pool's device."""
        k, v, rotation = self.k[i], self.v[i], self.rotation[i]
        return DecodeTokens(k, v, self.types, self.kernels, self.block_rows, tables, positions, rotation)


@dataclass(frozen=True)
class SequenceKV:
    """One sequence's cache in one layer for one step (an `ops.LayerKV`): its positions 0..n_read-1
    are pool rows `rows`, of which this step writes `slots`. The rows come back in position order, so
    attention needs no ring and no fused kernel (those read a contiguous cache)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    n_read: int
    slots: torch.Tensor
    rows: torch.Tensor
    kernels: AttentionKernels
    types: tuple[QType, QType] | None
    rotation: tuple[int, int]  # as `PagedKVCache.rotation`'s: the eager path rotates the rows it stores

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        types = self.types or (None, None)
        store_rows(self.k, self.slots, k, types[0])
        store_rows(self.v, self.slots, v, types[1])
        return kv_layout.moved(self.k[self.rows], types[0], k.device), kv_layout.moved(
            self.v[self.rows], types[1], v.device
        )

    def key_positions(self) -> None:
        return None

    def rope_store_attend(self, *args: object, **kwargs: object) -> None:
        """No fused kernel takes one sequence's rows of a paged cache: `ops.rope_attention`'s eager
        path runs (a step's decode tokens take `DecodeTokens`)."""
        return None


@dataclass(frozen=True)
class DecodeTokens:
    """One layer's pools k, v [rows, Hk, row] (`types` as `SequenceKV`'s) and one token of each of B
    sequences: sequence b's at positions[b] (int64 [B]), its blocks of `block_rows` rows in
    tables[b] (int32 [B, most blocks]), on the pools' device."""

    k: torch.Tensor
    v: torch.Tensor
    types: tuple[QType, QType] | None
    kernels: AttentionKernels
    block_rows: int
    tables: torch.Tensor
    positions: torch.Tensor
    rotation: tuple[int, int]  # the pools' Walsh-Hadamard blocks (`ops.hadamard`)

    def rope_store_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope, cos: torch.Tensor,
        sin: torch.Tensor, window: int | None, scale: float | None, softcap: float | None,
        norms: HeadNorms | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """`ops.rope_attention` of the B tokens in one call: q [B, H, D], k and v [B, Hk, D], cos and
        sin [B, n_dims / 2] their angles -> [B, H * D], q and k normalized by `norms` where given
        (in Triton's kernel, before the native one), each k rotated and stored with its v at its
        position, each token attending its positions up to its own (the last `window`, for a sliding
        window). As for one sequence's decode (`runtime.cache.LayerWriter`): Triton's kernel where
        everything lives on one GPU (or anywhere with `kernels.decode` "on": the interpreter on the
        CPU), else the native one for float32 on the CPU. None, nothing written, where neither takes
        the step: unequal head widths, a pool on the CPU for a GPU's step (--no-kv-offload), on the
        CPU a softcap, a type or shape the native kernel lacks or blocks grouped for the Triton
        kernels (`kv_layout.GROUPED_ON_CPU`), or `kernels.decode` "off"."""
        mode, types = self.kernels.decode, self.types
        widths = (self.k.shape[-1], self.v.shape[-1]) if types is None else (
            head_dim(self.k, types[0]), head_dim(self.v, types[1]))  # fmt: skip
        if mode == "off" or not q.shape[-1] == v.shape[-1] == widths[0] == widths[1]:
            return None
        if mode == "on" or (q.is_cuda and has_triton()):
            devices = {q.device, self.k.device, self.v.device, self.tables.device, self.positions.device}
            if len(devices) > 1:
                return None
            from llmx.kernels.decode_attention import paged_decode_attention

            return paged_decode_attention(
                q, k, v, cos, sin, self.k, self.v, self.tables, self.positions, block_rows=self.block_rows,
                n_dims=rope.n_dims, neox=rope.neox, scale=scale, softcap=softcap, window=window, types=types,
                norms=None if norms is None else norms.weights(), rotation=self.rotation,
            )  # fmt: skip
        cpu = not q.is_cuda and q.dtype == torch.float32 and self.k.device.type == "cpu"
        if not cpu or softcap is not None or kv_layout.grouped_blocks(types, self.k.device):
            return None
        if norms is not None:
            q, k = norms(q, k)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return cpu_attention.paged_rope_decode_attention(
            q, k, v, rope.neox, cos, sin, self.k, self.v, types, self.tables, self.block_rows, self.positions,
            window, scale, self.rotation,
        )  # fmt: skip


@dataclass(frozen=True)
class ChunkRows:
    """A step's prompt chunks of C sequences (T rows in all, chunk c rows starts[c]..starts[c+1]-1): the
    pool rows they are written to (`slots` int64 [T]) at `positions` (int64 [T]), the sequences' block
    tables (int32 [C, W]) and the most rows a chunk has (`longest`), on one device."""

    slots: torch.Tensor
    positions: torch.Tensor
    starts: torch.Tensor
    tables: torch.Tensor
    longest: int


@dataclass(frozen=True)
class PromptChunks:
    """One layer's pools k, v [rows, Hk, row] (`types` as `SequenceKV`'s) for a step's prompt chunks of
    several sequences, in blocks of `block_rows` rows."""

    k: torch.Tensor
    v: torch.Tensor
    types: tuple[QType, QType] | None
    kernels: AttentionKernels
    block_rows: int

    def takes(self, q: torch.Tensor) -> bool:
        """Whether Triton's flash kernel takes the step's queries q [T, H, D], as `flash_prefill`
        decides for one sequence: not on a CPU without `kernels.prefill` "on", nor with `-fa off`,
        a pool on another device than q or unequal head widths."""
        return flash_prefill(q, self.k, self.v, self)

    def store_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: ChunkRows, window: int | None,
        scale: float | None, softcap: float | None,
    ) -> torch.Tensor:  # fmt: skip
        """`ops.cached_attention` of every chunk at once, where `takes(q)`: q [T, H, D], k and v
        [T, Hk, D] (after RoPE) of the chunks `rows` -> [T, H * D]. k and v are stored at the chunks'
        rows first; each row attends its sequence's positions up to its own (the last `window`)."""
        types = self.types or (None, None)
        store_rows(self.k, rows.slots, k, types[0])
        store_rows(self.v, rows.slots, v, types[1])
        from llmx.kernels.prefill_attention import paged_prefill_attention

        return paged_prefill_attention(
            q, self.k, self.v, rows.positions, rows.starts, rows.tables, rows.longest,
            block_rows=self.block_rows, types=self.types, window=window, scale=scale, softcap=softcap,
        )  # fmt: skip
