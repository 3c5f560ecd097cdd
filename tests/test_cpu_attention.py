"""The compiled one-token CPU attention (`llmx.kernels.cpu_attention`) against PyTorch's SDPA in
float64, directly and as `ops.attention` takes it over a long cache. Tolerance: float32 sums in
another order, 1e-5 of the output's norm."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from llmx import ops
from llmx.kernels import cpu_attention

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ toolchain to compile with")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, H, D] over k, v [N, Hk, D], every key visible, in float64 -> [1, H * D]."""
    qh, kh, vh = (t.double().transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(1, -1)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def step(n_head: int, n_kv: int, dim: int, n_keys: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n_head, dim, generator=g)
    k, v = (torch.randn(n_keys, n_kv, dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


@needs_compiler
@pytest.mark.parametrize(
    ("n_head", "n_kv", "dim", "n_keys", "dtype"),
    [(9, 3, 64, 600, torch.float16), (4, 4, 128, 513, torch.bfloat16), (8, 2, 64, 700, torch.float32)],
    ids=["smollm2-f16", "no-groups-bf16", "llama-f32"],
)
def test_matches_sdpa(n_head: int, n_kv: int, dim: int, n_keys: int, dtype: torch.dtype) -> None:
    q, k, v = step(n_head, n_kv, dim, n_keys, dtype, seed=n_keys)
    out = cpu_attention.decode_attention(q, k, v, 0.125)
    assert out is not None and out.shape == (1, n_head * dim) and out.dtype == torch.float32
    assert relative_error(out, reference(q, k, v, 0.125)) < 1e-5


@needs_compiler
def test_ops_take_it_only_for_one_token_over_a_long_cache(monkeypatch) -> None:
    """From MIN_KEYS keys on, one unmasked float32 token goes through the compiled kernel (and
    equals the flash path); a shorter cache, a mask or "off" keep the flash path."""
    calls = []
    kernel = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a: calls.append(1) or kernel(*a))
    q, k, v = step(9, 3, 64, cpu_attention.MIN_KEYS, torch.float16, seed=1)
    compiled = ops.attention(q, k, v, None)
    assert calls == [1]
    ops.attention(q, k[:-1], v[:-1], None)  # one key short
    ops.attention(q, k, v, torch.ones(1, k.shape[0], dtype=torch.bool))  # masked
    monkeypatch.setattr(ops, "FUSED_ATTENTION", "off")
    flash = ops.attention(q, k, v, None)
    assert calls == [1]
    assert relative_error(compiled, flash.double()) < 1e-5


def test_a_compiler_failure_keeps_the_flash_path(monkeypatch) -> None:
    """Where compiling fails (it surfaces at the first call), one warning, then PyTorch's kernel."""

    def no_compiler(fn, **_):
        def fails(*args):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

        return fails

    monkeypatch.setattr(cpu_attention, "_compiled", [])
    monkeypatch.setattr(torch, "compile", no_compiler)
    q, k, v = step(9, 3, 64, cpu_attention.MIN_KEYS, torch.float16, seed=2)
    with pytest.warns(UserWarning, match="InvalidCxxCompiler"):
        out = ops.attention(q, k, v, None)
    assert relative_error(out, reference(q, k, v, 0.125)) < 1e-5
    assert cpu_attention.decode_attention(q, k, v, 0.125) is None  # and no second try
