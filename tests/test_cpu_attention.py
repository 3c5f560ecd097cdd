"""The native one-token CPU attention (`llmx.kernels.cpu_attention`) against PyTorch's SDPA in
float64, directly and as `ops.attention` takes it; both the AVX2 build and the portable one.
Tolerance: float32 sums in another order (and a polynomial exp), 1e-5 of the output's norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmx import ops
from llmx.kernels import cpu_attention
from llmx.quant import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler for the native kernels")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, H, D] over k, v [N, Hk, D], every key visible, in float64 -> [1, H * D]."""
    qh, kh, vh = (t.double().transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(1, -1)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def step(n_head: int, n_kv: int, dim: int, n_keys: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n_head, dim, generator=g) * 3  # peaked scores: the softmax's exp matters
    k, v = (torch.randn(n_keys, n_kv, dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize(
    ("n_head", "n_kv", "dim", "n_keys", "dtype"),
    [
        (9, 3, 64, 600, torch.float16),
        (4, 4, 128, 513, torch.bfloat16),
        (8, 2, 64, 700, torch.float32),
        (9, 3, 64, 1, torch.float16),
        (32, 8, 128, 37, torch.float16),
    ],
    ids=["smollm2-f16", "no-groups-bf16", "llama-f32", "one-key", "llama3-odd-length"],
)
def test_matches_sdpa(n_head, n_kv, dim, n_keys, dtype, native_kernels) -> None:
    q, k, v = step(n_head, n_kv, dim, n_keys, dtype, seed=n_keys)
    out = cpu_attention.decode_attention(q, k, v, 0.125)
    assert out is not None and out.shape == (1, n_head * dim) and out.dtype == torch.float32
    assert relative_error(out, reference(q, k, v, 0.125)) < 1e-5


def test_ops_take_it_for_one_unmasked_token(monkeypatch) -> None:
    """One unmasked float32 token goes through the native kernel at any cache length (and equals the
    flash path); a mask or "off" keep the flash path."""
    calls = []
    kernel = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a: calls.append(1) or kernel(*a))
    q, k, v = step(9, 3, 64, 20, torch.float16, seed=1)
    native = ops.attention(q, k, v, None)
    assert calls == [1]
    ops.attention(q, k, v, torch.ones(1, k.shape[0], dtype=torch.bool))  # masked
    monkeypatch.setattr(ops, "FUSED_ATTENTION", "off")
    flash = ops.attention(q, k, v, None)
    assert calls == [1]
    assert relative_error(native, flash.double()) < 1e-5


def test_shapes_it_does_not_take_keep_the_flash_path() -> None:
    """A head size that is not a multiple of 8, or a cache that is not contiguous: None, and
    `ops.attention` still answers."""
    q, k, v = step(4, 2, 12, 30, torch.float16, seed=3)
    assert cpu_attention.decode_attention(q, k, v, 0.125) is None
    assert relative_error(ops.attention(q, k, v, None, 0.125), reference(q, k, v, 0.125)) < 1e-3
    q, k, v = step(4, 2, 64, 30, torch.float16, seed=4)
    assert cpu_attention.decode_attention(q, k[::2], v[::2], 0.125) is None
