"""The decode tokens of a batch in one native call over the paged cache (`runtime.paged.DecodeTokens`,
`cpu_blocks.c`'s llmx_paged_rope_store_attend), against the path each sequence took alone before it
(RoPE in torch, `store_rows`, its rows gathered, `cached_attention`) and against float64 attention over
the pools it leaves, for float and block cache types, ragged lengths (one sequence long enough to be
cut into several chunks), a sliding window, and sequences on blocks shared through the prefix cache.

Tolerances: float32 sums in another order (and a polynomial exp), 1e-5 of the output's norm against
the per-sequence path; against float64, the rounding of the pools' own values only (1e-5 as well).
The kernel's other builds (no VNNI, portable C) run the same `attend` through test_cpu_attention's
one-sequence calls.
"""

from __future__ import annotations

import pytest
import torch
from hadamard_reference import hadamard_blocks
from paged_sequences import ragged_tables
from tiny_models import random_prompt, write_tiny

import llmx
from llmx.kernels import cpu_attention
from llmx.ops import Rope
from llmx.ops.cached_attention import AttentionKernels, cached_attention
from llmx.ops.hadamard import rotate
from llmx.ops.masks import causal_mask
from llmx.quant import cpu_native, qtype
from llmx.quant.quantize import quantize
from llmx.quant.torch_ops import dequantize
from llmx.runtime import batch
from llmx.runtime.batch import Chunk, forward_batch
from llmx.runtime.blocks import BlockTable
from llmx.runtime.paged import PagedKVCache

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler for the native kernels")

N_HEAD, N_KV, D, ROWS = 6, 2, 64, 16


def pool(name: str, n_blocks: int, seed: int) -> torch.Tensor:
    """A pool [n_blocks * ROWS, Hk, row] of random rows in cache type `name`."""
    x = torch.randn(n_blocks * ROWS, N_KV, D, generator=torch.Generator().manual_seed(seed))
    qt = qtype(name)
    return x.to({"F16": torch.float16, "BF16": torch.bfloat16}.get(name, torch.float32)) if qt.is_float else (
        quantize(x, qt))  # fmt: skip


def setup(kt: str, vt: str) -> tuple[PagedKVCache, list[BlockTable]]:
    n_blocks = 24
    types = None if qtype(kt).is_float and qtype(vt).is_float else (qtype(kt), qtype(vt))
    paged = PagedKVCache(
        [pool(kt, n_blocks, 1)], [pool(vt, n_blocks, 2)], types, AttentionKernels(), n_seq=n_blocks // 12,
        seq_ctx=12 * ROWS, block_rows=ROWS,
    )  # fmt: skip
    return paged, ragged_tables(paged.blocks)


def step_inputs(n_seq: int, rope: Rope, positions: torch.Tensor):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(n_seq, N_HEAD, D, generator=g) * 3  # peaked scores: the softmax's exp matters
    k, v = torch.randn(n_seq, N_KV, D, generator=g), torch.randn(n_seq, N_KV, D, generator=g)
    cos, sin = rope.tables(positions, int(positions.max()) + 1)
    return q, k, v, cos, sin


def batched(paged: PagedKVCache, ts: list[BlockTable], rope: Rope, window: int | None, scale: float):
    positions = torch.tensor([t.length for t in ts])
    q, k, v, cos, sin = step_inputs(len(ts), rope, positions)
    tokens = paged.decode(0, paged.tables(ts), positions)
    out = tokens.rope_store_attend(q, k, v, rope, cos, sin, window, scale, None)
    assert out is not None, "the native kernel did not take the step"
    return out


def one_by_one(paged: PagedKVCache, ts: list[BlockTable], rope: Rope, window: int | None, scale: float):
    """What forward_batch did before, sequence by sequence, over the eager ops (the pool's rotation
    as `ops.rope_attention` makes it)."""
    positions = torch.tensor([t.length for t in ts])
    q, k, v, cos, sin = step_inputs(len(ts), rope, positions)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    rot_k, rot_v = paged.rotation[0]
    q, k, v = rotate(q, rot_k), rotate(k, rot_k), rotate(v, rot_v)
    outs = []
    for b, t in enumerate(ts):
        pos = positions[b : b + 1]
        rows = paged.rows(t, t.length + 1, torch.device("cpu"))
        view = paged.layer(0, pos, rows[t.length :], rows)
        mask = causal_mask(pos, t.length + 1, window) if window else None
        outs.append(cached_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], view, mask, window, scale))
    return rotate(torch.cat(outs), rot_v)


def float64_reference(
    paged: PagedKVCache, ts: list[BlockTable], rope: Rope, window: int | None, scale: float
):
    """Attention in float64 over the pools as the call left them, each sequence's rows gathered: q
    rotated as the pool's keys are, the output back as its values are."""
    positions = torch.tensor([t.length for t in ts])
    q, _, _, cos, sin = step_inputs(len(ts), rope, positions)
    rot_k, rot_v = paged.rotation[0]
    q = hadamard_blocks(rope.apply(q, cos, sin).double(), rot_k)
    types = paged.types or (qtype("F32"), qtype("F32"))
    k, v = (dequantize(p.reshape(p.shape[0] * N_KV, -1), qt).reshape(p.shape[0], N_KV, D).double()
            for p, qt in zip((paged.k[0], paged.v[0]), types, strict=True))  # fmt: skip
    outs = []
    for b, t in enumerate(ts):
        rows = paged.rows(t, t.length + 1, torch.device("cpu"))
        if window:
            rows = rows[max(0, t.length + 1 - window) :]
        kb, vb = (x[rows].repeat_interleave(N_HEAD // N_KV, dim=1) for x in (k, v))  # [N, H, D]
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[b], kb) * scale, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", weights, vb).reshape(1, -1))
    return hadamard_blocks(torch.cat(outs), rot_v)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check(kt: str, vt: str, window: int | None) -> None:
    rope, scale = Rope(D, 10000.0, False), 0.125
    paged, ts = setup(kt, vt)
    twin = PagedKVCache([paged.k[0].clone()], [paged.v[0].clone()], paged.types, paged.kernels, 2, 12 * ROWS)
    before = paged.k[0].clone(), paged.v[0].clone()
    out = batched(paged, ts, rope, window, scale)
    want = one_by_one(twin, ts, rope, window, scale)
    assert out.shape == (len(ts), N_HEAD * D) and relative_error(out, want) < 1e-5
    assert relative_error(out, float64_reference(paged, ts, rope, window, scale)) < 1e-5
    # each token's row holds its key and value as the per-sequence path stored them (a float key to
    # an ulp: the rotation rounds in another order), and no other row changed, shared blocks included
    slots = torch.cat([paged.rows(t, t.length + 1, torch.device("cpu"))[-1:] for t in ts])
    others = torch.ones(paged.k[0].shape[0], dtype=torch.bool)
    others[slots] = False
    for ours, theirs, old in zip((paged.k[0], paged.v[0]), (twin.k[0], twin.v[0]), before, strict=True):
        assert torch.equal(ours[others], old[others])
        if ours.is_floating_point():
            torch.testing.assert_close(ours[slots].float(), theirs[slots].float(), rtol=1e-2, atol=1e-6)
        else:
            assert torch.equal(ours[slots], theirs[slots])


@pytest.mark.parametrize(
    ("kt", "vt"),
    [("F32", "F32"), ("BF16", "BF16"), ("Q8_0", "Q8_0"), ("Q4_0", "Q4_0"), ("Q4_1", "Q5_0"), ("F16", "Q5_1")],
    ids=lambda p: p,
)
def test_a_batchs_decode_tokens_in_one_call_match_each_alone(kt, vt) -> None:
    check(kt, vt, None)


@pytest.mark.parametrize(("kt", "vt"), [("F16", "F16"), ("Q8_0", "Q4_0")], ids=lambda p: p)
def test_a_sliding_window_is_masked_by_position(kt, vt) -> None:
    check(kt, vt, window=20)  # the long sequence and the shared-prefix ones see only their last 20


def test_a_sequence_in_a_batch_attends_as_in_a_batch_of_one() -> None:
    """Chunking is per call (the long sequence's keys are cut by the whole call's work): a sequence's
    output does not depend on its batch but to float rounding."""
    rope = Rope(D, 10000.0, False)
    paged, ts = setup("F16", "F16")
    k0, v0 = paged.k[0].clone(), paged.v[0].clone()
    together = batched(paged, ts, rope, None, 0.125)
    paged.k[0].copy_(k0)
    paged.v[0].copy_(v0)
    positions = torch.tensor([t.length for t in ts])
    q, k, v, cos, sin = step_inputs(len(ts), rope, positions)
    alone = torch.cat([
        paged.decode(0, paged.tables([t]), positions[b : b + 1]).rope_store_attend(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], rope, cos[b : b + 1], sin[b : b + 1], None, 0.125, None)
        for b, t in enumerate(ts)
    ])  # fmt: skip
    assert relative_error(together, alone) < 1e-6


def test_forward_batch_sends_its_tokens_to_one_call_a_layer(tmp_path, monkeypatch) -> None:
    """A step of decode tokens makes one native call a layer for all of them, and so does a step with
    short prompt chunks, every row a token; past TOKEN_CHUNK_ROWS a chunk takes the eager path and the
    decode tokens beside it go to that call all the same. That the logits are each sequence's own is
    test_batch's."""
    calls: list[int] = []
    kernel = cpu_attention.paged_rope_decode_attention
    monkeypatch.setattr(
        cpu_attention, "paged_rope_decode_attention", lambda q, *a: calls.append(len(q)) or kernel(q, *a)
    )
    model = llmx.load(write_tiny("llama", "Q8_0", tmp_path), ctx_size=256, n_gpu_layers=0)
    executor = model.engine.executor
    paged = PagedKVCache.over(executor.cache, n_seq=4)
    a, b, c, d = BlockTable(), BlockTable(), BlockTable(), BlockTable()
    forward_batch(executor, paged, [Chunk(a, random_prompt(5, 0)), Chunk(b, random_prompt(9, 1))])
    assert calls == [5 + 9] * model.config.n_layer
    calls.clear()
    forward_batch(executor, paged, [Chunk(a, [1]), Chunk(b, [2])])
    assert calls == [2] * model.config.n_layer
    calls.clear()
    forward_batch(executor, paged, [Chunk(a, [3]), Chunk(c, random_prompt(6, 2)), Chunk(b, [4])])
    assert calls == [1 + 6 + 1] * model.config.n_layer and (a.length, b.length, c.length) == (7, 11, 6)
    calls.clear()
    monkeypatch.setattr(batch, "TOKEN_CHUNK_ROWS", 5)
    forward_batch(executor, paged, [Chunk(a, [5]), Chunk(d, random_prompt(6, 3)), Chunk(b, [6])])
    assert calls == [2] * model.config.n_layer and (a.length, b.length, d.length) == (8, 12, 6)
