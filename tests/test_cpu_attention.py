"""The native one-token CPU attention (`llmx.kernels.cpu_attention`) against PyTorch's SDPA in
float64, directly and as `ops.attention` takes it; both the AVX2 build and the portable one.
Tolerance: float32 sums in another order (and a polynomial exp), 1e-5 of the output's norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmx import ops
from llmx.kernels import cpu_attention
from llmx.ops.cached_attention import AttentionKernels
from llmx.quant import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler for the native kernels")


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """q [1, H, D] over k, v [N, Hk, D], every key visible (or those `mask` [1, N] shows), in float64
    -> [1, H * D]."""
    qh, kh, vh = (t.double().transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
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
    flash = ops.attention(q, k, v, None, kernels=AttentionKernels(decode="off"))
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


# --- the whole step: RoPE, cache write and attention in one call, run by the cache ----------------


def rope_step(g, rows, n_head, n_kv, dim, dtype, rope, pos):
    """A decode step's random inputs: the cache's past rows (of `dtype`), q, k, v of one token at
    `pos`, and its position and RoPE angles."""
    past_k, past_v = (torch.randn(rows, n_kv, dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(1, n_head, dim, generator=g) * 3
    k, v = torch.randn(1, n_kv, dim, generator=g), torch.randn(1, n_kv, dim, generator=g)
    positions = torch.tensor([pos])
    cos, sin = rope.tables(positions, pos + 1)
    return past_k, past_v, q, k, v, positions, cos, sin


def unfused_step(q, k, v, rope, cos, sin, cache, scale):
    """`ops.rope_attention`'s torch path for the same step: the reference for the fused one."""
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    keys, values = cache(k, v)
    return reference(q, keys, values, scale)


@pytest.mark.parametrize(
    ("n_head", "n_kv", "dim", "n_dims", "neox", "dtype"),
    [
        (9, 3, 64, 64, False, torch.float16),
        (8, 2, 128, 128, True, torch.bfloat16),
        (4, 4, 64, 32, False, torch.float32),
        (32, 8, 128, 64, True, torch.float16),
    ],
    ids=["smollm2-f16", "neox-bf16", "partial-rotary-f32", "neox-partial-f16"],
)
def test_one_call_step_matches_rope_then_write_then_attention(
    n_head, n_kv, dim, n_dims, neox, dtype, native_kernels
) -> None:
    from llmx.runtime.cache import LayerWriter

    g = torch.Generator().manual_seed(dim + n_dims)
    rows, pos = 48, 29
    rope = ops.Rope(n_dims, 10000.0, neox)
    past_k, past_v, q, k, v, positions, cos, sin = rope_step(g, rows, n_head, n_kv, dim, dtype, rope, pos)
    fused_cache = LayerWriter(past_k.clone(), past_v.clone(), positions, pos + 1)
    torch_cache = LayerWriter(past_k.clone(), past_v.clone(), positions, pos + 1)
    q_before, k_before = q.clone(), k.clone()
    out = fused_cache.rope_store_attend(q, k, v, rope, cos, sin, None, None, 0.1, None)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # rotated into copies, not in place
    want = unfused_step(q, k, v, rope, cos, sin, torch_cache, 0.1)
    assert out is not None and out.shape == (1, n_head * dim)
    assert relative_error(out, want) < 1e-5
    # the step's row holds its rotated key and its value (to an ulp of the cache's type: the rotation
    # rounds in another order), and no other row changed
    for fused, ref in ((fused_cache.k, torch_cache.k), (fused_cache.v, torch_cache.v)):
        torch.testing.assert_close(fused[pos].float(), ref[pos].float(), rtol=1e-2, atol=1e-6)
        assert torch.equal(torch.cat((fused[:pos], fused[pos + 1 :])), torch.cat((ref[:pos], ref[pos + 1 :])))


@pytest.mark.parametrize(("pos", "window"), [(29, 8), (5, 8), (11, 12), (29, None)], ids=str)
def test_one_call_step_slides_a_window_over_a_ring(pos, window, native_kernels) -> None:
    """A sliding-window layer's ring of 12 rows (position p in row p mod 12, as the prompt batches
    store it): the step attends its window's last keys wherever the ring has wrapped them to, as the
    torch path does by each row's position (`ring_mask`). Without a window, a position past the rows
    (whose keys the ring lost) is refused, nothing written."""
    from llmx.ops.masks import ring_mask
    from llmx.runtime.cache import LayerWriter

    g = torch.Generator().manual_seed(pos)
    rows, n_head, n_kv, dim, dtype = 12, 4, 2, 64, torch.float16
    rope = ops.Rope(dim, 10000.0, True)
    past_k, past_v, q, k, v, positions, cos, sin = rope_step(g, rows, n_head, n_kv, dim, dtype, rope, pos)
    fused_cache = LayerWriter(past_k.clone(), past_v.clone(), positions, pos + 1)
    out = fused_cache.rope_store_attend(q, k, v, rope, cos, sin, None, window, 0.1, None)
    if window is None and pos >= rows:
        assert out is None and torch.equal(fused_cache.k, past_k)
        return
    torch_cache = LayerWriter(past_k.clone(), past_v.clone(), positions, pos + 1)
    qr, kr = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    keys, values = torch_cache(kr, v)
    ring = torch_cache.key_positions()
    if ring is None:  # not wrapped: row r holds position r, the rows past pos not yet written
        ring = torch.arange(len(keys))
    want = reference(qr, keys, values, 0.1, ring_mask(positions, ring, window))
    assert out is not None and relative_error(out, want) < 1e-5
    row = pos % rows  # the step's key, rotated and stored in its position's row
    torch.testing.assert_close(fused_cache.k[row].float(), torch_cache.k[row].float(), rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cache_rows_round_as_torch_does(dtype, native_kernels) -> None:
    """Without rotation (n_dims 0 is not RoPE's, so: cos 1, sin 0), the stored row equals torch's own
    conversion bit for bit: ties to even, subnormals, overflow to infinity, signed zero."""
    from llmx.runtime.cache import LayerWriter

    specials = [65504.0, 65519.0, 65520.0, 1e6, -1e6, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-26, 5.96e-8]
    specials += [1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, -0.0, 1.0 + 2.0**-8, 3.0e38, 1.0000001, 2.0**-133]
    values = torch.tensor(specials + [0.0] * (64 - len(specials)), dtype=torch.float32)
    values = torch.cat((values, torch.randn(64, generator=torch.Generator().manual_seed(0)) * 1e-4))
    k = values.reshape(1, 2, 64)
    rope = ops.Rope(64, 10000.0, False)
    positions = torch.tensor([0])
    cos, sin = torch.ones(1, 32), torch.zeros(1, 32)
    cache = LayerWriter(torch.zeros(4, 2, 64, dtype=dtype), torch.zeros(4, 2, 64, dtype=dtype), positions, 1)
    q = torch.randn(1, 2, 64)
    assert cache.rope_store_attend(q, k, k, rope, cos, sin, None, None, 0.1, None) is not None
    want = k[0].to(dtype)
    assert torch.equal(cache.k[0].view(torch.int16), want.view(torch.int16))
    assert torch.equal(cache.v[0].view(torch.int16), want.view(torch.int16))


def test_decode_steps_take_the_one_call_step(monkeypatch, smollm2_path) -> None:
    """A CPU model's decode steps go through it (one call a layer), and a step it does not take (a
    wrapped ring, a mask) keeps the torch path."""
    import llmx

    calls = []
    step_fn = cpu_attention.rope_decode_attention
    monkeypatch.setattr(cpu_attention, "rope_decode_attention", lambda *a: calls.append(1) or step_fn(*a))
    model = llmx.load(smollm2_path, ctx_size=64)
    model.engine.prefill([1, 2, 3])
    assert calls == []  # a prompt of three tokens: masked
    model.engine.decode(4)
    assert len(calls) == model.config.n_layer
