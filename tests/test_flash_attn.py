"""`-fa/--flash-attn` as llama.cpp's: on/auto take the fused attention kernels, off the math path that
materializes the scores; the choice is made once at load and held by the KV cache."""

from __future__ import annotations

import pytest
import torch

import llmx
from llmx.kernels import cpu_attention
from llmx.ops import cached_attention
from llmx.ops.cached_attention import AttentionKernels
from llmx.quant import cpu_native


def test_fa_off_turns_every_fused_kernel_off() -> None:
    assert AttentionKernels.choose("on", "auto") == AttentionKernels(flash=True, decode="auto")
    assert AttentionKernels.choose("auto", "off") == AttentionKernels(flash=True, decode="off")
    assert AttentionKernels.choose("off", "on") == AttentionKernels(flash=False, decode="off")


def test_math_attention_matches_sdpa() -> None:
    """The materialized scores give SDPA's answer, masked and not, with grouped heads."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(5, 6, 16, generator=g),
        torch.randn(9, 2, 16, generator=g),
        torch.randn(9, 2, 16, generator=g),
    )
    mask = torch.rand(5, 9, generator=g) > 0.3
    mask[:, 0] = True
    for m in (None, mask):
        flash = cached_attention.attention(q, k, v, m, 0.25)
        math = cached_attention.attention(
            q, k, v, m, 0.25, kernels=AttentionKernels(flash=False, decode="off")
        )
        torch.testing.assert_close(math, flash, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not cpu_native.available(), reason="no C compiler for the native kernels")
def test_fa_on_and_off_give_the_same_tokens_by_different_kernels(smollm2_path, monkeypatch) -> None:
    """SmolLM2 decodes the same greedy tokens with -fa on and off; on, every decode step's layers take
    the fused kernel and no scores are materialized; off, the reverse."""
    calls = {"fused": 0, "math": 0}
    fused, math = cpu_attention.rope_decode_attention, cached_attention.math_attention

    def count(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    monkeypatch.setattr(cpu_attention, "rope_decode_attention", count("fused", fused))
    monkeypatch.setattr(cached_attention, "math_attention", count("math", math))
    prompt = "The capital of France is"
    runs = {}
    for fa in ("on", "off"):
        calls.update(fused=0, math=0)
        model = llmx.load(smollm2_path, ctx_size=128, flash_attn=fa)
        model.engine.executor.use_graphs = False  # replayed steps make their native calls without these
        runs[fa] = (list(model.stream_ids(prompt, max_tokens=8, temperature=0)), dict(calls))
    (on_tokens, on_calls), (off_tokens, off_calls) = runs["on"], runs["off"]
    assert on_tokens == off_tokens
    n_layer = model.config.n_layer
    assert on_calls["math"] == 0 and on_calls["fused"] >= n_layer * (len(on_tokens) - 1)
    # the same decode steps, and the prompt too, attend over materialized scores
    assert off_calls == {"fused": 0, "math": on_calls["fused"] + n_layer}
