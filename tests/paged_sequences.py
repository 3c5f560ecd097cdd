"""Sequences on a paged cache's blocks, shared by the tests of the batched decode attention (the CPU's
native call, test_paged_attention; the GPU's Triton launch, test_paged_decode_attention)."""

from __future__ import annotations

from llmx.runtime.blocks import BlockPool, BlockTable

SYSTEM = 37  # the prompt's tokens the first three sequences share: two full blocks of 16 rows are shared


def ragged_tables(blocks: BlockPool) -> list[BlockTable]:
    """Five sequences at ragged lengths, before their decode token: three that began with the same
    system prompt (the second and third on the first's two full blocks of it, refcounted), one of a
    single position and one of 150 (several chunks or splits of keys)."""
    rows = blocks.block_rows
    system = list(range(SYSTEM))
    first = BlockTable()
    blocks.reserve(first, SYSTEM + 4)
    blocks.commit(first, [*system, 1, 2, 3, 4])
    out = [first]
    for tail in ([5, 6], [7, 8, 9, 10, 11, 12]):
        t = BlockTable()
        assert blocks.reuse(t, system + tail) == 2 * rows
        blocks.reserve(t, SYSTEM - 2 * rows + len(tail))
        blocks.commit(t, system[2 * rows :] + tail)
        out.append(t)
    for n in (0, 150):
        t = BlockTable()
        blocks.reserve(t, n)
        blocks.commit(t, list(range(1000, 1000 + n)))
        out.append(t)
    for t in out:
        blocks.reserve(t, 1)  # the decode token's place
    assert out[1].blocks[:2] == out[2].blocks[:2] == out[0].blocks[:2]
    return out
