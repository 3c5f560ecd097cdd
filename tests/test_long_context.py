"""Long contexts on the CPU: a prompt processed in -ub chunks never stores a [tokens x context] score
matrix, an 8K-token prompt gives the logits of the other paths, and `-c 131072` plans and
allocates exactly the KV cache the plan counts. (`bench/long_context.py` runs 32K.)"""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompt, write_tiny

import llmx
from llmx.ops import cached_attention
from llmx.ops.cached_attention import AttentionKernels, attention
from llmx.ops.masks import causal_mask

OPTIONS = dict(cache_type_k="f32", cache_type_v="f32", threads=1)
N_HEAD, N_KV, DIM, UBATCH, N_KEYS = 4, 2, 64, 512, 8192
SCORE_BYTES = N_HEAD * UBATCH * N_KEYS * 4  # one float32 [H, T, N] score matrix: 64 MiB


def largest_allocation(fn) -> int:
    """The largest single CPU allocation an op made while `fn` ran (torch's profiler)."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_a_prompt_batch_over_a_long_cache_stores_no_score_matrix(cache_dtype):
    """The last -ub batch of an 8K prompt: -fa auto allocates under a quarter of one score matrix (the
    mask's float bias, T x N, is the largest); -fa off, as llama.cpp without -fa, the whole matrix."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(UBATCH, N_HEAD, DIM, generator=g)
    k, v = (torch.randn(N_KEYS, N_KV, DIM, generator=g).to(cache_dtype) for _ in range(2))
    mask = causal_mask(torch.arange(N_KEYS - UBATCH, N_KEYS), N_KEYS)
    flash = attention(q, k, v, mask)
    assert largest_allocation(lambda: attention(q, k, v, mask)) <= SCORE_BYTES // 4
    off = AttentionKernels.choose("off", "auto")
    assert largest_allocation(lambda: attention(q, k, v, mask, kernels=off)) >= SCORE_BYTES
    torch.testing.assert_close(flash, attention(q, k, v, mask, kernels=off), rtol=1e-5, atol=1e-5)


def test_an_8k_prompt_prefills_in_ubatches_on_the_cpu(tmp_path, monkeypatch):
    """8192 tokens in 16 ubatches of 512 through the CPU flash kernel, in seconds; the last token's
    logits equal a decode step's (the native kernel over the same cache)."""
    path = write_tiny("llama", "F32", tmp_path)
    model = llmx.load(path, ctx_size=8192, ubatch_size=512, **OPTIONS)
    ids = random_prompt(8192, seed=1)
    calls = []
    real = cached_attention.cpu_flash_attention
    monkeypatch.setattr(cached_attention, "cpu_flash_attention", lambda *a: calls.append(1) or real(*a))
    last = model.engine.prefill(ids)
    assert len(calls) == 16 * 3  # every ubatch after the first, and the first too, in each of 3 layers
    model.engine.reset()
    model.engine.prefill(ids[:-1])
    assert (model.engine.decode(ids[-1]) - last).abs().max().item() < 2e-3


def test_a_128k_context_plans_and_allocates_its_kv_cache(tmp_path):
    path = write_tiny("llama", "Q8_0", tmp_path)
    model = llmx.load(path, ctx_size=131072, ubatch_size=512, threads=1)
    cache = model.engine.executor.cache
    # 3 layers x 2 KV heads x 64 dims x (K + V) x f16 per position
    assert cache.nbytes == model.plan.device_use("cpu").kv == 131072 * 3 * 2 * 64 * 2 * 2
    ids = random_prompt(600, seed=2)
    model.engine.prefill(ids)
    assert torch.isfinite(model.engine.decode(ids[0])).all()
