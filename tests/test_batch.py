"""Batched steps over the paged KV cache: the paged cache's blocks (taken, given back, reused, never
more rows than -c), and logits of a step over several sequences equal to each sequence run alone
through the single-sequence engine, for sequences decoding beside one whose prompt is prefilled in
chunks. The matmuls of a batch run over several rows at once, so logits agree to float rounding,
not bit for bit; the greedy token always agrees (the tiny models' logits are never near a tie)."""

from __future__ import annotations

import pytest
import torch
from references import DECISIVE_MARGIN, GPU_BATCH_TOLERANCE, decisive, greedy_alone
from tiny_models import SLIDING_WINDOW, random_prompt, write_tiny

import llmx
from llmx.errors import LlmxError
from llmx.quant import choice
from llmx.runtime import batch
from llmx.runtime.batch import Chunk, forward_batch
from llmx.runtime.blocks import BlockTable
from llmx.runtime.cache import KVCache, LayerShape
from llmx.runtime.paged import PagedKVCache

STEPS = 4  # decode steps of every sequence
CHUNK = 8  # the late sequence's prompt goes in chunks of this many tokens (-ub)

# --- the paged cache -------------------------------------------------------------------------------


def _cache(n_ctx: int = 128, rows: int = 0) -> KVCache:
    return KVCache(n_ctx, [LayerShape(2, 64, 64, "cpu"), LayerShape(2, 64, 64, "cpu", rows)])


def test_pools_lie_over_the_planned_buffers_and_a_ring_gets_its_own():
    cache = _cache(n_ctx=100, rows=24)
    paged = PagedKVCache.over(cache, n_seq=3, block_rows=16)
    assert paged.seq_ctx == 32 and paged.blocks.n_blocks == 6  # 100 / 3 = 33 positions: two whole blocks
    assert paged.k[0].data_ptr() == cache.k[0].data_ptr() and paged.k[0].shape[0] == 96 <= cache.n_ctx
    assert paged.v[1].shape[0] == 96 and paged.v[1].data_ptr() != cache.v[1].data_ptr()  # the ring's
    with pytest.raises(LlmxError, match="raise -c or lower -np"):
        PagedKVCache.over(cache, n_seq=8, block_rows=16)


def test_blocks_are_taken_as_a_sequence_grows_given_back_and_reused():
    paged = PagedKVCache.over(_cache(), n_seq=2, block_rows=16)  # 8 blocks, 64 positions a sequence
    a, b = BlockTable(), BlockTable()
    paged.blocks.reserve(a, 1)
    assert len(a.blocks) == 1 and paged.blocks.free_blocks == 7
    a.length = 16
    paged.blocks.reserve(a, 1)  # position 16 starts a second block
    assert len(a.blocks) == 2
    paged.blocks.reserve(b, 64)
    assert len(b.blocks) == 4 and paged.blocks.free_blocks == 2
    with pytest.raises(LlmxError, match="the context is full"):
        paged.blocks.reserve(b, 65)
    assert len(b.blocks) == 4  # a refused reservation takes nothing
    held = set(a.blocks)
    paged.blocks.free(a)
    assert a.blocks == [] and a.length == 0 and paged.blocks.free_blocks == 4
    c = BlockTable()
    paged.blocks.reserve(c, 32)
    assert set(c.blocks) == held and not set(c.blocks) & set(b.blocks)
    assert paged.rows(c, 20, torch.device("cpu")).tolist() == [c.blocks[0] * 16 + r for r in range(16)] + [
        c.blocks[1] * 16 + r for r in range(4)
    ]


# --- batched logits against the single-sequence path ---------------------------------------------


def _check_batched(model, lengths: list[int], n_seq: int, tolerance: float = 5e-3) -> None:
    """All but the last sequence prefill together, then decode STEPS tokens (each the token the engine
    alone chose: a difference never compounds) while the last joins, its prompt in CHUNK-token chunks."""
    prompts = [random_prompt(n, seed) for seed, n in enumerate(lengths)]
    alone = [
        greedy_alone(model, p, STEPS) for p in prompts
    ]  # first: the pools below lie over the engine's cache
    paged = PagedKVCache.over(model.engine.executor.cache, n_seq)
    tables = [BlockTable() for _ in prompts]
    early, late = range(len(prompts) - 1), len(prompts) - 1
    got: dict[tuple[int, int], torch.Tensor] = {}
    out = forward_batch(model.engine.executor, paged, [Chunk(tables[j], prompts[j]) for j in early])
    got |= {(j, 0): out[j] for j in early}
    done = 0
    for s in range(STEPS):
        chunks = [Chunk(tables[j], [alone[j][0][s]]) for j in early]
        if done < lengths[late]:
            piece = prompts[late][done : done + CHUNK]
            done += len(piece)
            chunks.append(Chunk(tables[late], piece, logits=done == lengths[late]))
        out = forward_batch(model.engine.executor, paged, chunks)
        got |= {(j, s + 1): out[j] for j in early}
        if len(out) > len(early):
            got[late, 0] = out[-1]
    assert done == lengths[late] and (late, 0) in got
    for (j, s), logits in got.items():
        want = alone[j][1][s]
        if decisive(want, DECISIVE_MARGIN):
            assert int(logits.argmax()) == int(want.argmax()), (j, s)
        torch.testing.assert_close(logits, want, atol=tolerance * want.abs().max().item(), rtol=0)
    assert [t.length for t in tables[:late]] == [n + STEPS for n in lengths[:late]]


@pytest.mark.parametrize(
    ("arch", "type_name", "cache_type"),
    [
        ("llama", "F32", "f16"),
        ("qwen2", "Q8_0", "f32"),
        ("qwen3", "Q4_K_M", "q8_0"),
        ("gemma3", "Q4_K_M", "f16"),  # sliding-window layers: prompts longer than the window
        ("qwen3moe", "Q8_0", "f16"),
    ],
)
def test_a_batched_step_gives_each_sequence_its_own_logits(arch, type_name, cache_type, tmp_path):
    path = write_tiny(arch, type_name, tmp_path)
    model = llmx.load(path, ctx_size=256, n_gpu_layers=0, cache_type_k=cache_type, cache_type_v=cache_type)
    lengths = [5, 2 * SLIDING_WINDOW + 3, 1, 2 * CHUNK + 3]  # the last joins late, in three chunks
    _check_batched(model, lengths, n_seq=4)


@pytest.mark.parametrize(("arch", "cache_type"), [("llama", "f32"), ("gemma3", "f16"), ("llama", "q8_0")])
def test_long_prompt_chunks_attend_over_their_gathered_rows(arch, cache_type, tmp_path, monkeypatch):
    """Prompt chunks longer than TOKEN_CHUNK_ROWS take the eager path (each sequence's rows over its
    own gathered rows, the decode tokens in one call) and give the same logits; with a q8_0 cache the
    eager rows are rotated as the native call's are (`ops.hadamard`)."""
    monkeypatch.setattr(batch, "TOKEN_CHUNK_ROWS", 2)
    path = write_tiny(arch, "Q8_0", tmp_path)
    model = llmx.load(path, ctx_size=256, n_gpu_layers=0, cache_type_k=cache_type, cache_type_v=cache_type)
    _check_batched(model, [5, 2 * SLIDING_WINDOW + 3, 1, 2 * CHUNK + 3], n_seq=4)


# --- the prefix cache: sequences on blocks others computed, against the engine alone --------------


def _serve(model, paged: PagedKVCache, prompts: list[list[int]], starts: list[int], chunk: int) -> list[int]:
    """Prompt i joins at step starts[i] on the blocks of it the cache holds (as the scheduler admits
    a request), prefills the rest in `chunk`-token chunks and decodes a token (the engine alone's)
    beside the others, then ends, its blocks released. Every logits is checked against the engine
    alone's; the positions each took from the cache come back."""
    alone = [greedy_alone(model, p, 1) for p in prompts]  # first: the pools lie over the engine's cache
    tables = [BlockTable() for _ in prompts]
    reused, fed, decoded = [0] * len(prompts), [0] * len(prompts), [0] * len(prompts)
    live: list[int] = []
    step = 0
    while step <= max(starts) or live:
        for i in (i for i, start in enumerate(starts) if start == step):
            reused[i] = fed[i] = paged.blocks.reuse(tables[i], prompts[i])
            live.append(i)
        work = []
        for i in live:
            if fed[i] < len(prompts[i]):
                piece = prompts[i][fed[i] : fed[i] + chunk]
                fed[i] += len(piece)
                work.append((i, Chunk(tables[i], piece, logits=fed[i] == len(prompts[i]))))
            else:
                work.append((i, Chunk(tables[i], [alone[i][0][decoded[i]]])))
                decoded[i] += 1
        out = iter(forward_batch(model.engine.executor, paged, [c for _, c in work]) if work else ())
        for i, c in work:
            if c.logits:
                got, want = next(out), alone[i][1][decoded[i]]
                assert int(got.argmax()) == int(want.argmax()), (i, decoded[i])
                torch.testing.assert_close(got, want, atol=5e-3 * want.abs().max().item(), rtol=0)
        for i in [i for i in live if decoded[i] == 1]:
            paged.blocks.free(tables[i])
            live.remove(i)
        step += 1
    return reused


@pytest.mark.parametrize(
    ("arch", "type_name", "cache_type"),
    [
        ("qwen3", "Q8_0", "f16"),
        # sliding-window layers (the shared prefix is longer than the window), blocks of q8_0 blocks
        ("gemma3", "Q8_0", "q8_0"),
    ],
)
def test_a_sequence_on_cached_blocks_gets_its_own_logits_before_and_after_eviction(
    arch, type_name, cache_type, tmp_path
):
    """Two sequences of 3 blocks over a pool of 6. A system prompt of two blocks and a bit: B starts
    on A's two blocks while A decodes. C and D then hold 5 blocks at once, and only 4 are empty, so
    the least recently released cached block (the system prompt's second) is evicted: B's prompt
    served again reuses only the first."""
    path = write_tiny(arch, type_name, tmp_path)
    model = llmx.load(path, ctx_size=256, n_gpu_layers=0, cache_type_k=cache_type, cache_type_v=cache_type)
    planned = PagedKVCache.over(model.engine.executor.cache, n_seq=2)
    rows = planned.block_rows
    paged = PagedKVCache(planned.k, planned.v, planned.types, planned.kernels, n_seq=2, seq_ctx=3 * rows)
    system = random_prompt(2 * rows + 5, 10)
    a, b = system + random_prompt(6, 11), system + random_prompt(3, 12)
    c, d = random_prompt(2 * rows + 8, 13), random_prompt(rows + 8, 14)  # 3 and 2 blocks, C in 2 chunks
    chunk = 2 * rows
    b_joins = -(-len(a) // chunk)  # A's decode step
    c_d_join = b_joins + 2  # B: one chunk, its decode step, then it is gone
    b_again = c_d_join + 3  # C: two chunks and its decode step
    reused = _serve(model, paged, [a, b, c, d, b], [0, b_joins, c_d_join, c_d_join, b_again], chunk)
    assert reused == [0, 2 * rows, 0, 0, rows]


def test_eight_sequences_of_smollm2_batched(smollm2_path):
    model = llmx.load(smollm2_path, ctx_size=512, n_gpu_layers=0)
    _check_batched(model, [7, 30, 2, 11, 19, 4, 25, 13], n_seq=8)


def test_a_decode_batch_wider_than_native_max_rows_runs_native_and_is_replayed(smollm2_path):
    """Decode-only steps of more sequences than a prompt's ubatch takes on the native GEMV
    (`choice.NATIVE_MAX_ROWS`) still run the native kernels (`weight.decode_tokens`): each sequence's
    logits are its token's alone, and the steps are recorded and replayed (a torch matmul between the
    native calls, as dequantized chunks were, has its batch size refused)."""
    n = choice.NATIVE_MAX_ROWS + 5
    model = llmx.load(smollm2_path, ctx_size=64 * n, n_gpu_layers=0)
    executor = model.engine.executor
    prompts = [random_prompt(6 + s % 4, s) for s in range(n)]
    alone = [greedy_alone(model, p, STEPS) for p in prompts]  # first: the pools lie over the engine's cache
    paged = PagedKVCache.over(executor.cache, n)
    tables = [BlockTable() for _ in prompts]
    forward_batch(executor, paged, [Chunk(t, p) for t, p in zip(tables, prompts, strict=True)])
    for s in range(STEPS):
        out = forward_batch(executor, paged, [Chunk(tables[j], [alone[j][0][s]]) for j in range(n)])
        for j in range(n):
            want = alone[j][1][s + 1]
            torch.testing.assert_close(out[j], want, atol=5e-3 * want.abs().max().item(), rtol=0)
    replays = executor.cpu_batch(paged)
    assert replays is not None and n not in replays.refused


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("arch", "type_name", "placement"),
    [
        ("llama", "Q4_K_M", {"n_gpu_layers": "all"}),
        ("gemma3", "Q4_K_M", {"n_gpu_layers": 3}),  # hybrid: the first three layers on the CPU
        ("qwen3", "Q8_0", {"n_gpu_layers": "all", "no_kv_offload": True, "cache_type_k": "q8_0"}),
        ("qwen3moe", "Q8_0", {"n_gpu_layers": "all", "override_tensor": ["exps=CPU"]}),
    ],
)
def test_a_batched_step_on_a_gpu_gives_each_sequence_its_own_logits(arch, type_name, placement, tmp_path):
    model = llmx.load(write_tiny(arch, type_name, tmp_path), ctx_size=256, **placement)
    assert any(d.type == "cuda" for d in model.engine.executor.layer_devices)
    lengths = [5, 2 * SLIDING_WINDOW + 3, 1, 2 * CHUNK + 3]
    _check_batched(model, lengths, n_seq=4, tolerance=GPU_BATCH_TOLERANCE)
