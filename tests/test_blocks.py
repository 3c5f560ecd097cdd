"""The paged cache's block bookkeeping (`runtime.blocks`), without tensors: the prefix cache's chained
keys, the longest cached prefix a prompt starts on, reference counts, least-recently-used eviction.

The random run checks the one property the prefix cache must keep, against a model of the pool's
memory written here: every row a sequence holds has the token it stored there (a shared block is never
written into, an evicted block is never handed out as cached), while prompts sharing prefixes do reuse
blocks and eviction does happen."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from llmx.errors import LlmxError
from llmx.runtime.blocks import ROOT, BlockPool, BlockTable, chain

ROWS = 4


def _pool(n_blocks: int = 8, seq_ctx: int = 32, caching: bool = True) -> BlockPool:
    return BlockPool(n_blocks, ROWS, seq_ctx, caching)


def _run(pool: BlockPool, ids: list[int]) -> BlockTable:
    """A sequence that stored `ids` in one step (after the blocks it reused)."""
    table = BlockTable()
    start = pool.reuse(table, ids)
    pool.reserve(table, len(ids) - start)
    pool.commit(table, ids[start:])
    return table


def test_the_module_imports_no_torch():
    code = "import sys, llmx.runtime.blocks; sys.exit('torch' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_blocks_key_is_its_tokens_after_its_predecessors():
    first = chain(ROOT, [1, 2, 3, 4])
    assert chain(first, [5, 6, 7, 8]) == chain(chain(ROOT, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert chain(ROOT, [5, 6, 7, 8]) != chain(first, [5, 6, 7, 8])  # the same tokens elsewhere
    assert chain(first, [5, 6, 7, 9]) != chain(first, [5, 6, 7, 8])
    assert chain(ROOT, [1, 2]) != chain(ROOT, [1, 2, 0, 0]) != chain(ROOT, [1 << 16, 2, 3, 4])


def test_a_prompt_starts_on_its_longest_cached_prefix_of_whole_blocks_leaving_a_token():
    pool = _pool()
    a = _run(pool, list(range(10)))  # blocks 0-3 and 4-7 full, 8-9 in a third
    first = chain(ROOT, [0, 1, 2, 3])
    assert a.length == 10 and a.keys == [first, chain(first, [4, 5, 6, 7])]
    assert a.tail == [8, 9]

    def reused(ids: list[int]) -> tuple[int, list[int]]:
        table = BlockTable()
        n = pool.reuse(table, ids)
        shared = table.blocks[:]
        pool.free(table)
        return n, shared

    assert reused([*range(8), 99, 98]) == (8, a.blocks[:2])
    assert reused(list(range(10))) == (8, a.blocks[:2])  # the partial third block is not cached
    assert reused(list(range(8))) == (4, a.blocks[:1])  # the last token is computed: one block less
    assert reused(list(range(9))) == (8, a.blocks[:2])
    assert reused([0, 1, 2, 3, 4, 5, 6, 0, 8]) == (4, a.blocks[:1])
    assert reused([9, 1, 2, 3, 4, 5, 6, 7, 8]) == (0, [])  # block 4-7 only counts after block 0-3
    assert reused([0, 1, 2]) == (0, [])
    off = _pool(caching=False)
    _run(off, list(range(10)))
    assert off.reuse(BlockTable(), list(range(10))) == 0 and off.cached_blocks == 0


def test_blocks_filled_a_token_at_a_time_are_cached_as_those_filled_at_once():
    pool = _pool()
    table = BlockTable()
    for token in range(9):
        pool.reserve(table, 1)
        pool.commit(table, [token])
    assert table.keys == _run(_pool(), list(range(9))).keys and pool.cached_blocks == 2


def test_a_shared_block_is_held_until_its_last_sequence_ends_then_kept_for_reuse():
    pool = _pool(n_blocks=8)
    a = _run(pool, list(range(9)))  # 3 blocks, 2 cached
    b = _run(pool, [*range(8), 50, 51, 52, 53, 54])  # shares 2, takes 2 of its own
    assert b.blocks[:2] == a.blocks[:2] and len(set(a.blocks + b.blocks)) == 5
    assert pool.free_blocks == 3
    pool.free(a)
    assert pool.free_blocks == 4  # a's own third block; the shared two are b's still
    c = BlockTable()
    pool.reserve(c, 4 * ROWS)
    assert not set(c.blocks) & set(b.blocks)
    pool.free(c)
    pool.free(b)
    assert pool.free_blocks == 8 and pool.cached_blocks == 3  # b's third block was full: cached too
    assert pool.reuse(BlockTable(), [*range(8), 50, 51, 52, 53, 54]) == 3 * ROWS


def test_the_pool_takes_empty_blocks_first_then_evicts_the_least_recently_released():
    pool = _pool(n_blocks=6, seq_ctx=24)
    x, y = [100 + i for i in range(9)], [200 + i for i in range(9)]
    tables = [_run(pool, x), _run(pool, y)]
    (x0, x1, _), (y0, y1, _) = (t.blocks[:] for t in tables)
    for t in tables:
        pool.free(t)  # each: 2 cached blocks idle, its partial third back to empty
    assert pool.cached_blocks == 4 and pool.free_blocks == 6
    pool.free(_run(pool, [*x[:8], 7]))  # x again: its blocks become the most recently released
    takes = [BlockTable() for _ in range(4)]
    pool.reserve(takes[0], 2 * ROWS)  # the two empty blocks: nothing evicted
    assert pool.cached_blocks == 4
    pool.reserve(takes[1], ROWS)  # the least recently released: y's, its last block first
    assert takes[1].blocks == [y1] and pool.cached_blocks == 3
    pool.reserve(takes[2], 2 * ROWS)
    assert takes[2].blocks == [y0, x1] and pool.cached_blocks == 1
    assert pool.reuse(BlockTable(), y) == 0
    assert pool.reuse(BlockTable(), x) == ROWS  # x's first block: now held, so not evictable
    assert pool.free_blocks == 0
    with pytest.raises(LlmxError, match="0 free blocks, 1 are needed"):
        pool.reserve(takes[3], 1)
    assert x0 not in {b for t in takes for b in t.blocks}


def test_a_block_two_sequences_computed_alike_is_cached_once_and_their_chains_go_on():
    pool = _pool()
    ids = list(range(13))
    a, b = BlockTable(), BlockTable()
    for t in (a, b):  # both missed the cache: neither had run yet
        assert pool.reuse(t, ids) == 0
        pool.reserve(t, len(ids))
    for t in (a, b):
        pool.commit(t, ids)
    assert a.keys == b.keys and len(a.keys) == 3 and pool.cached_blocks == 3
    pool.free(b)  # b's copies are no one's cache: empty again
    assert pool.cached_blocks == 3 and pool.free_blocks == 8 - 4
    c = BlockTable()
    assert pool.reuse(c, ids) == 12 and c.blocks == a.blocks[:3]


def test_a_refused_reservation_takes_nothing():
    pool = _pool(n_blocks=4, seq_ctx=16)
    table = _run(pool, list(range(5)))
    with pytest.raises(LlmxError, match="the context is full"):
        pool.reserve(table, 12)
    assert len(table.blocks) == 2 and pool.free_blocks == 2


@pytest.mark.parametrize("seed", range(3))
def test_every_row_a_sequence_holds_keeps_its_token_while_blocks_are_shared_and_evicted(seed):
    """Up to 4 sequences at a time over a pool of 4 sequences' blocks: prompts from a few shared
    prefixes, run in chunks, then decoded a token at a time, ended at random. `memory` is what each
    pool row holds: the token last stored there."""
    rng = random.Random(seed)
    n_seq, seq_ctx = 4, 24
    pool = BlockPool(n_seq * seq_ctx // ROWS, ROWS, seq_ctx)
    memory: dict[int, int] = {}
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    live: list[tuple[BlockTable, list[int]]] = []  # each table and the tokens it is to store
    reused = 0
    evicted = [0]

    def store(table: BlockTable, ids: list[int]) -> None:
        cached = pool.cached_blocks
        pool.reserve(table, len(ids))
        evicted[0] += cached - pool.cached_blocks
        for p, token in enumerate(ids, table.length):
            memory[table.blocks[p // ROWS] * ROWS + p % ROWS] = token
        pool.commit(table, ids)

    for _ in range(300):
        if len(live) < n_seq and rng.random() < 0.4:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 6))]
            tokens = prompt + [rng.randrange(1000) for _ in range(rng.randrange(seq_ctx - len(prompt)))]
            table = BlockTable()
            reused += pool.reuse(table, prompt)
            live.append((table, tokens))
            store(table, prompt[table.length :])
        for table, tokens in live:
            if table.length < len(tokens):
                store(table, tokens[table.length : table.length + 1])
        for table, tokens in live:
            held = [memory[table.blocks[p // ROWS] * ROWS + p % ROWS] for p in range(table.length)]
            assert held == tokens[: table.length]
        for entry in [e for e in live if rng.random() < 0.1]:
            pool.free(entry[0])
            live.remove(entry)
    assert reused > 0 and evicted[0] > 0
