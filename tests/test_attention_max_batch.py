"""`-amb N` (ik_llama.cpp's --attention-max-batch, MiB): with `-fa off`, attention materializes the
scores of as many query heads at a time as fit in N MiB. The logits do not change, and the plan's
compute estimate shrinks by the heads' scores left out."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompt, write_tiny

import llmx
from llmx.ops import cached_attention
from llmx.ops.cached_attention import AttentionKernels, math_attention
from llmx.plan.memory import MiB, compute_bytes, score_heads
from llmx.plan.model import ModelSpec
from llmx.plan.options import Options
from llmx.plan.shapes import get_shape

OPTIONS = dict(cache_type_k="f32", cache_type_v="f32", threads=1, flash_attn="off")


def test_score_heads_keeps_a_chunks_scores_under_the_cap():
    per_head = 512 * 4096 * 4  # float32 scores of 512 queries over 4096 keys: 8 MiB
    assert score_heads(32, 512, 4096, 0) == 32  # no cap
    assert score_heads(32, 512, 4096, 64 * MiB) == 8 and 8 * per_head <= 64 * MiB < 9 * per_head
    assert score_heads(32, 512, 4096, 1 * MiB) == 1  # one head is the least a chunk holds
    assert score_heads(32, 1, 4096, 1024 * MiB) == 32  # never more heads than there are


def test_amb_caps_only_fa_offs_scores():
    assert AttentionKernels.choose("off", "auto", 256).max_score_bytes == 256 * MiB
    assert AttentionKernels.choose("on", "auto", 256) == AttentionKernels.choose("on", "auto")


def test_head_chunks_give_the_same_attention():
    """6 query heads over 2 KV heads, in chunks of 1, 2, 4 (crossing a KV group) and all 6."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 16, generator=g) for n, h in ((5, 6), (9, 2), (9, 2)))
    mask = torch.rand(5, 9, generator=g) > 0.3
    mask[:, 0] = True
    whole = math_attention(q, k, v, mask, 0.25, softcap=30.0)
    per_head = 5 * 9 * 4
    for heads in (1, 2, 4):
        chunked = math_attention(q, k, v, mask, 0.25, softcap=30.0, max_score_bytes=heads * per_head)
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


def test_a_model_gives_the_same_logits_with_and_without_amb(tmp_path, monkeypatch):
    """A 512-token ubatch over 512 keys: 1 MiB of scores per head, so -amb 1 attends the tiny
    Llama's 4 heads one at a time."""
    path = write_tiny("llama", "F32", tmp_path)
    ids = random_prompt(512, seed=0)
    chunks = []
    real = cached_attention.score_heads
    monkeypatch.setattr(cached_attention, "score_heads", lambda *a: chunks.append(real(*a)) or chunks[-1])
    logits = {}
    for amb in (0, 1):
        model = llmx.load(path, ctx_size=512, ubatch_size=512, attn_max_batch=amb, **OPTIONS)
        chunks.clear()
        logits[amb] = model.engine.prefill(ids, all_logits=True)
        assert set(chunks) == {4 if amb == 0 else 1}
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("amb", [64, 256, 1024])
def test_the_plans_compute_estimate_counts_a_chunk_of_heads(amb):
    """Llama-3-8B, -ub 512 -c 32768 -fa off: 64 MiB of scores per head, so -amb 256 stores 4 of 32 heads'
    scores at once; the estimate drops by the other heads' scores and repeated K/V rows."""
    spec = ModelSpec.from_shape(get_shape("llama3-8b"), "Q4_K_M")
    opts = Options(ctx_size=32768, flash_attn="off")

    def attn(o: Options) -> int:
        return compute_bytes(spec, o, attention=True, ffn=False, output=False, inp=False, gpu=False)

    chunk = amb // 64
    saved = (32 - chunk) * (13 * 512 * 32768 + 3 * 32768 * 128 * 4)
    assert attn(opts) - attn(opts.replace(attn_max_batch=amb)) == saved
    # -amb caps -fa off's scores only
    on = opts.replace(flash_attn="on")
    assert attn(on) == attn(on.replace(attn_max_batch=amb))
