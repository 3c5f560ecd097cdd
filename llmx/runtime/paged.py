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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmx.errors import LlmxError
from llmx.ops.cached_attention import AttentionKernels
from llmx.quant import QType
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
        return SequenceKV(self.k[i], self.v[i], positions, n_read, slots, rows, self.kernels, self.types)


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

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        types = self.types or (None, None)
        store_rows(self.k, self.slots, k, types[0])
        store_rows(self.v, self.slots, v, types[1])
        return self.k[self.rows].to(k.device), self.v[self.rows].to(v.device)

    def key_positions(self) -> None:
        return None

    def rope_store_attend(self, *args: object, **kwargs: object) -> None:
        """No fused kernel reads a paged cache yet: `ops.rope_attention`'s eager path runs."""
        return None
