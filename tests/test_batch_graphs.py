"""CUDA graphs of batched decode steps (`runtime.batch.decode_padded`, `runtime.graphs.replay_batch`):
the buckets, the pool's scratch block, and, run eagerly on the CPU (the paged decode kernel under
TRITON_INTERPRET), a step padded to its buckets giving each real sequence the logits and the cache
rows of the unpadded step, while sequences join and leave and the batch crosses buckets. On a GPU:
the same steps with graphs on and off, and every decode-only step a replay."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from references import GPU_BATCH_TOLERANCE, decisive  # noqa: E402
from tiny_models import random_prompt, write_tiny  # noqa: E402

import llmx  # noqa: E402
from llmx.ops.cached_attention import AttentionKernels  # noqa: E402
from llmx.runtime import batch  # noqa: E402
from llmx.runtime.batch import Chunk, decode_padded, forward_batch  # noqa: E402
from llmx.runtime.blocks import BlockPool, BlockTable  # noqa: E402
from llmx.runtime.graphs import (  # noqa: E402
    BATCH_BUCKETS,
    GRAPH_BUCKET,
    batch_bucket,
    collection_paused,
    width_bucket,
)
from llmx.runtime.paged import PagedKVCache  # noqa: E402

ON = AttentionKernels(decode="on")

# --- buckets and the scratch block -----------------------------------------------------------------


def test_batch_buckets_round_up_and_stop_at_the_last():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 9, 17, 33, 48, 49, 64)] == [
        1,
        2,
        4,
        8,
        16,
        32,
        48,
        48,
        64,
        64,
    ]
    assert batch_bucket(BATCH_BUCKETS[-1] + 1) is None
    assert list(BATCH_BUCKETS) == sorted(BATCH_BUCKETS)


def test_width_buckets_round_the_context_up_to_a_graph_bucket_at_most_a_slot():
    per_bucket = GRAPH_BUCKET // 16
    assert width_bucket(1, 16, 4096) == width_bucket(GRAPH_BUCKET, 16, 4096) == per_bucket
    assert width_bucket(GRAPH_BUCKET + 1, 16, 4096) == 2 * per_bucket
    assert width_bucket(GRAPH_BUCKET + 1, 16, GRAPH_BUCKET + 32) == per_bucket + 2  # a slot's blocks
    assert width_bucket(5, 48, 96) == 2  # blocks that do not divide the bucket: rounded up


class _Cycle:
    """An object only the garbage collector frees (it refers to itself)."""

    def __init__(self) -> None:
        self.me = self


def test_a_capture_holds_the_collector_off():
    """During a capture the collector is off (a collection could free pinned memory through calls a
    capture forbids): garbage made then outlives allocations past the collector's threshold and is
    collected after; the collector is then as the caller had it."""
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
        garbage = weakref.ref(_Cycle())
        _ = [[] for _ in range(10 * gc.get_threshold()[0])]  # would start a young collection
        assert garbage() is not None
    assert gc.isenabled()
    gc.collect()
    assert garbage() is None
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_scratch_block_is_free_until_a_sequence_needs_it():
    pool = BlockPool(4, 16, 64, caching=False)
    s = pool.scratch()
    assert s is not None and pool.scratch() == s and pool.free_blocks == 4  # held, still counted free
    a = BlockTable()
    pool.reserve(a, 48)  # three blocks: the scratch block stays out of them
    assert s not in a.blocks and pool.scratch() == s
    pool.reserve(a, 64)  # the last block: the scratch one, given back
    assert s in a.blocks and pool.free_blocks == 0 and pool.scratch() is None
    pool.free(a)
    assert pool.scratch() is not None and pool.free_blocks == 4


# --- padded steps against unpadded ones, eagerly on the CPU ----------------------------------------


def _pools(paged: PagedKVCache) -> list[torch.Tensor]:
    return [t.clone() for t in paged.k + paged.v]


def _restore(paged: PagedKVCache, saved: list[torch.Tensor]) -> None:
    for t, s in zip(paged.k + paged.v, saved, strict=True):
        t.copy_(s)


def _rows(paged: PagedKVCache, blocks: set[int]) -> torch.Tensor:
    """A pool's rows of `blocks` (the mask over its rows)."""
    rows = torch.zeros(paged.blocks.n_blocks * paged.block_rows, dtype=torch.bool)
    for b in blocks:
        rows[b * paged.block_rows : (b + 1) * paged.block_rows] = True
    return rows


@pytest.mark.usefixtures("grouped_caches")  # a q8_0 cache for the Triton kernels on the CPU
def test_a_padded_decode_step_gives_each_sequence_the_unpadded_logits_and_rows(tmp_path):
    """Sequences join (a prompt, eagerly) and leave between decode steps of 3, 5 and 3 sequences
    (buckets 4, 8, 4): each step runs unpadded, then again from the same cache padded, and gives
    every sequence the same logits and cache rows; the padding rows write only the scratch block."""
    model = llmx.load(write_tiny("llama", "Q8_0", tmp_path), ctx_size=512, n_gpu_layers=0,
                      cache_type_k="q8_0", cache_type_v="f16")  # fmt: skip
    executor = model.engine.executor
    paged = PagedKVCache.over(executor.cache, n_seq=8, caching=False)
    paged.kernels = ON
    tables: dict[int, BlockTable] = {}

    def join(seeds: list[int]) -> None:
        for s in seeds:
            tables[s] = BlockTable()
        if seeds:
            forward_batch(executor, paged, [Chunk(tables[s], random_prompt(3 + 5 * s, s)) for s in seeds])

    join([0, 1, 2])
    for step, (joining, leaving) in enumerate([((), ()), ((3, 4), ()), ((), (0, 3))]):
        join(list(joining))
        for s in leaving:
            paged.blocks.free(tables.pop(s))
        seqs = sorted(tables)
        ids = [(7 * s + step) % model.config.n_vocab for s in seqs]
        saved, lengths = _pools(paged), [tables[s].length for s in seqs]
        want = forward_batch(executor, paged, [Chunk(tables[s], [i]) for s, i in zip(seqs, ids, strict=True)])
        want_pools = _pools(paged)
        _restore(paged, saved)
        for s, n in zip(seqs, lengths, strict=True):
            tables[s].length = n
        got = decode_padded(executor, paged, [Chunk(tables[s], [i]) for s, i in zip(seqs, ids, strict=True)])
        assert got is not None and got.shape == want.shape
        assert batch_bucket(len(seqs)) > len(seqs)  # padding rows ran
        torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)
        assert [tables[s].length for s in seqs] == [n + 1 for n in lengths]
        scratch = paged.blocks.scratch()
        assert scratch is not None and all(scratch not in tables[s].blocks for s in seqs)
        outside = ~_rows(paged, {scratch})
        written = _rows(paged, set())
        for s, n in zip(seqs, lengths, strict=True):  # this step's row of each sequence
            written[tables[s].blocks[n // paged.block_rows] * paged.block_rows + n % paged.block_rows] = True
        for t, w, before in zip(paged.k + paged.v, want_pools, saved, strict=True):
            assert torch.equal(t[outside & ~written], before[outside & ~written])  # nothing else moved
            a, b = t[written].float(), w[written].float()
            torch.testing.assert_close(a, b, atol=2e-2 * b.abs().max().item(), rtol=0)


def test_decode_padded_declines_what_it_cannot_pad(tmp_path):
    """More sequences than the last bucket, or the paged kernel off: None, nothing run."""
    model = llmx.load(write_tiny("llama", "Q8_0", tmp_path), ctx_size=256, n_gpu_layers=0)
    paged = PagedKVCache.over(model.engine.executor.cache, n_seq=2, caching=False)
    paged.kernels = AttentionKernels(decode="off")
    t = BlockTable()
    assert decode_padded(model.engine.executor, paged, [Chunk(t, [1])]) is None
    assert t.blocks == [] and t.length == 0
    paged.kernels = ON
    many = [Chunk(BlockTable(), [1]) for _ in range(BATCH_BUCKETS[-1] + 1)]
    assert decode_padded(model.engine.executor, paged, many) is None


def test_forward_batch_pads_decode_only_steps_where_every_segment_replays(tmp_path, monkeypatch):
    """Steps of decode tokens alone go to `decode_padded` where every segment replays graphs (here
    pretended, each replay declining as a failed capture does: the segment runs padded, eagerly);
    steps with a prompt chunk, and every step with graphs off (`use_graphs`, the engine's switch)
    or on the CPU, do not."""
    model = llmx.load(write_tiny("llama", "Q8_0", tmp_path), ctx_size=256, n_gpu_layers=0)
    executor = model.engine.executor
    paged = PagedKVCache.over(executor.cache, n_seq=4, caching=False)
    paged.kernels = ON
    assert not executor.batch_graphs(0)  # a CPU segment
    padded: list[int] = []
    real = batch.decode_padded
    monkeypatch.setattr(
        batch, "decode_padded", lambda e, c, chunks, *a: padded.append(len(chunks)) or real(e, c, chunks, *a)
    )
    a, b = BlockTable(), BlockTable()
    forward_batch(executor, paged, [Chunk(a, [5]), Chunk(b, [6])])
    assert padded == []
    monkeypatch.setattr(executor, "batch_graphs", lambda k: executor.use_graphs)
    monkeypatch.setattr(executor.graphs, "replay_batch", lambda *args: None)
    mixed = forward_batch(executor, paged, [Chunk(a, [7]), Chunk(b, [8, 9, 10])])
    assert padded == [] and mixed.shape[0] == 2
    c = BlockTable()
    forward_batch(executor, paged, [Chunk(c, [3])])
    out = forward_batch(executor, paged, [Chunk(a, [1]), Chunk(b, [2]), Chunk(c, [4])])
    assert padded == [1, 3] and out.shape[0] == 3 and [t.length for t in (a, b, c)] == [3, 5, 2]
    executor.use_graphs = False
    forward_batch(executor, paged, [Chunk(a, [1]), Chunk(b, [2]), Chunk(c, [4])])
    assert padded == [1, 3]


# --- GPU: graphs on against graphs off -------------------------------------------------------------

# (sequences joining with prompts of these seeds, sequences leaving) before each decode step: the
# batch goes 3, 5, 9, 9, 2, 2, 4 sequences (buckets 4, 8, 16, 16, 2, 2, 4); the last two joiners'
# prompts (264 and 293 tokens) take the tables to the second width bucket
SCRIPT = [((0, 1, 2), ()), ((3, 4), ()), ((5, 6, 7, 8), ()), ((), ()), ((), (0, 1, 3, 4, 5, 6, 8)), ((), ()),
          ((9, 10), ())]  # fmt: skip


def _served(model, graphs: bool) -> list[torch.Tensor]:
    """Each decode step's logits [sequences, vocab] over SCRIPT (every sequence fed a fixed id)."""
    executor = model.engine.executor
    executor.use_graphs = graphs
    paged = PagedKVCache.over(executor.cache, n_seq=16, caching=False)  # 512 positions a sequence
    tables: dict[int, BlockTable] = {}
    out = []
    for step, (joining, leaving) in enumerate(SCRIPT):
        for s in joining:
            tables[s] = BlockTable()
        if joining:
            forward_batch(executor, paged, [Chunk(tables[s], random_prompt(3 + 29 * s, s)) for s in joining])
        for s in leaving:
            paged.blocks.free(tables.pop(s))
        seqs = sorted(tables)
        chunks = [Chunk(tables[s], [(11 * s + step) % model.config.n_vocab]) for s in seqs]
        out.append(forward_batch(executor, paged, chunks))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("arch", "placement"), [("llama", {}), ("gemma3", {}), ("qwen3moe", {"override_tensor": ["exps=CPU"]})]
)
def test_batched_decode_graphs_match_eager_steps(arch, placement, tmp_path):
    """Graphs on and off give every step's logits within GPU_BATCH_TOLERANCE of the largest (the padded
    batch's matmuls may take other kernels than the unpadded one's, which round x otherwise: see
    references), the same greedy token where the top two lie further apart than the logits may move; every
    decode step with graphs on is a replay, each (bucket, width) captured once; experts in RAM are
    served by each replay's trips to the host."""
    model = llmx.load(write_tiny(arch, "Q8_0", tmp_path), ctx_size=8192, n_gpu_layers="all", **placement)
    executor = model.engine.executor
    assert all(executor.batch_graphs(k) for k in range(len(executor.segments)))
    eager = _served(model, graphs=False)
    assert executor.graphs.batch_replays == 0
    graphed = _served(model, graphs=True)
    graphs = executor.graphs
    assert graphs.batch_replays == len(SCRIPT) * len(executor.segments)
    assert graphs.batch_captures == len(graphs.batch) < graphs.batch_replays
    assert all(bool(g.trips) == bool(placement) for g in graphs.batch.values())
    for want, got in zip(eager, graphed, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=GPU_BATCH_TOLERANCE * want.abs().max().item(), rtol=0)
        sure = decisive(want, 2 * GPU_BATCH_TOLERANCE)
        assert torch.equal(got.argmax(-1)[sure], want.argmax(-1)[sure])
