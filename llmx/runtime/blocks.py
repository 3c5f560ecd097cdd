"""The paged KV cache's bookkeeping: which blocks each sequence holds, which are free, which are shared.

Pure: block ids and token ids only, no tensors (`runtime.paged` lays the pools over them). A block
holds `block_rows` consecutive positions of one sequence; a `BlockTable` lists a sequence's blocks in
position order.

Prefix cache (as vLLM's): a full block is known by a key chained from its tokens and its predecessor's
key, so equal keys mean equal tokens at equal positions, hence equal keys and values in the cache
(the model, its placement and the cache types are fixed for the pool's life; up to the rounding of
the batch that computed them, as any batched step's). A block becomes known
once a step has stored all its rows (`commit`); a new sequence starts on the longest chain of known
blocks its prompt begins with (`reuse`), shared by reference count, and computes only the rest. No
one writes into a shared block: a sequence writes only past its shared ones, and it always computes
at least its prompt's last token (that step's logits pick the first reply token), so the block
holding that token is its own. A known block no sequence holds stays cached until the pool needs a
block and no empty one is left: then the least recently released goes (`_take`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmx.errors import LlmxError

ROOT = b""  # the key before a sequence's first block


def chain(parent: bytes, ids: Sequence[int]) -> bytes:
    """The key of a full block holding `ids` after the blocks keyed `parent` (ROOT: the first): a
    digest, as a key of the tokens themselves would grow with the prefix. 128 bits: a collision,
    which would hand a sequence another's keys and values, is out of reach."""
    return hashlib.blake2b(parent + array("i", ids).tobytes(), digest_size=16).digest()


@dataclass(eq=False)
class BlockTable:
    """One sequence's blocks, in position order, and the positions stored so far (`length`); with the
    prefix cache, the keys of its first full blocks and the ids of the positions past them (`tail`)."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0
    keys: list[bytes] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)


class BlockPool:
    """`n_blocks` blocks of `block_rows` positions for sequences of at most `seq_ctx` positions each.
    With `caching`, full blocks are kept for reuse after their sequences end (the prefix cache)."""

    def __init__(self, n_blocks: int, block_rows: int, seq_ctx: int, caching: bool = True) -> None:
        self.n_blocks, self.block_rows, self.seq_ctx, self.caching = n_blocks, block_rows, seq_ctx, caching
        self._refs = [0] * n_blocks  # the sequences holding each block
        # released blocks worth nothing: the last one released is the next taken (likelier still in a
        # CPU's caches)
        self._empty = list(reversed(range(n_blocks)))
        self._idle: OrderedDict[int, None] = OrderedDict()  # released known blocks, least recent first
        self._block: dict[bytes, int] = {}  # the known blocks by key
        self._key: dict[int, bytes] = {}
        self._scratch: int | None = None  # `scratch`'s block, while the pool holds one

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence may take: empty ones, known ones no sequence holds, and the scratch block."""
        return len(self._empty) + len(self._idle) + (self._scratch is not None)

    def scratch(self) -> int | None:
        """A block that no sequence reads, for rows whose writes must land nowhere that matters (the
        padding rows of a batched decode step's CUDA graph); None when no block is free. The pool
        holds it until a reservation needs it (then it is an empty block again: a sequence writes
        each of its rows before reading it), so it never costs a sequence its context."""
        if self._scratch is None and self.free_blocks:
            self._scratch = self._take()
        return self._scratch

    @property
    def cached_blocks(self) -> int:
        return len(self._block)

    def reuse(self, table: BlockTable, ids: Sequence[int]) -> int:
        """Start the empty `table` of a sequence whose prompt is `ids` on the longest chain of known
        blocks that prompt begins with, all but its last token: the positions it now holds."""
        if not self.caching:
            return 0
        parent, rows = ROOT, self.block_rows
        for start in range(0, (len(ids) - 1) // rows * rows, rows):
            key = chain(parent, ids[start : start + rows])
            block = self._block.get(key)
            if block is None:
                break
            self._idle.pop(block, None)
            self._refs[block] += 1
            table.blocks.append(block)
            table.keys.append(key)
            parent = key
        table.length = len(table.blocks) * rows
        return table.length

    def reserve(self, table: BlockTable, n: int) -> None:
        """Give `table` the blocks for `n` more positions; an error, nothing taken, past `seq_ctx` or
        when the pool has too few free blocks."""
        end = table.length + n
        if end > self.seq_ctx:
            raise LlmxError(
                f"the context is full: {table.length} + {n} tokens exceed a slot's {self.seq_ctx} "
                "(-c shared by -np slots); raise -c or shorten the prompt"
            )
        need = -(-end // self.block_rows) - len(table.blocks)
        if need > self.free_blocks:
            raise LlmxError(f"the KV cache has {self.free_blocks} free blocks, {need} are needed")
        if need > len(self._empty) + len(self._idle) and self._scratch is not None:
            self._refs[self._scratch] = 0
            self._empty.append(self._scratch)
            self._scratch = None
        for _ in range(need):
            table.blocks.append(self._take())

    def commit(self, table: BlockTable, ids: Sequence[int]) -> None:
        """`ids` are stored at `table`'s next positions: it holds them now, and the blocks they fill
        become known."""
        table.length += len(ids)
        if not self.caching:
            return
        table.tail.extend(ids)
        rows = self.block_rows
        while len(table.tail) >= rows:
            key = chain(table.keys[-1] if table.keys else ROOT, table.tail[:rows])
            del table.tail[:rows]
            block = table.blocks[len(table.keys)]
            table.keys.append(key)
            # a sequence that missed the cache while another computed the same tokens: its copy stays
            # its own (its later blocks chain on from the key all the same)
            if key not in self._block:
                self._block[key], self._key[block] = block, key

    def free(self, table: BlockTable) -> None:
        """Release `table`'s blocks; it is empty after. Its last blocks are released first, so they
        are evicted first: a chain's later blocks are of no use without its earlier ones."""
        for block in reversed(table.blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key:
                    self._idle[block] = None
                else:
                    self._empty.append(block)
        table.blocks.clear()
        table.keys.clear()
        table.tail.clear()
        table.length = 0

    def _take(self) -> int:
        """A block for one sequence alone: an empty one, else the least recently released known one,
        which is forgotten."""
        if self._empty:
            block = self._empty.pop()
        else:
            block, _ = self._idle.popitem(last=False)
            del self._block[self._key.pop(block)]
        self._refs[block] = 1
        return block
