"""The Walsh-Hadamard rotation of quantized caches' heads (`llmx.ops.hadamard`): the matrix against one
built as Kronecker powers, torch's butterflies against the native ones (the same bits), llama.cpp's choice
of blocks, and what it is for: a 4-bit key cache of heads with outlier channels attends closer to float
attention rotated than not. That the batched native step stores the bytes the eager path stores is
test_paged_attention's; that a model's steps over a rotated cache agree, test_kv_blocks' and test_batch's."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
from hadamard_reference import walsh_hadamard

from llmx.ops.hadamard import key_block, kv_rotation, rotate, value_block
from llmx.quant import cpu_native, qtype

native = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler for the native kernels")


@pytest.mark.parametrize("block", [64, 128, 256])
def test_rotate_multiplies_each_block_by_the_matrix_and_undoes_itself(block):
    x = torch.randn(3, 4, 256, generator=torch.Generator().manual_seed(block))
    want = (x.double().reshape(-1, block) @ walsh_hadamard(block)).reshape(x.shape)
    torch.testing.assert_close(rotate(x, block).double(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(rotate(rotate(x, block), block), x, rtol=0, atol=1e-6)
    assert rotate(x, 0) is x
    assert rotate(x.to(torch.bfloat16), block).dtype == torch.bfloat16


@native
@pytest.mark.parametrize("block", [64, 128, 256])
def test_torchs_butterflies_give_the_native_rotations_bits(block, monkeypatch):
    """Where the native kernels are not (a GPU's tensors, no compiler) torch's butterflies rotate: the
    same float32 operations in the same order, so both paths store the same cache bytes."""
    x = torch.randn(5, 2, 256, generator=torch.Generator().manual_seed(block))
    native_bits = rotate(x, block)
    monkeypatch.setattr(cpu_native, "available", lambda: False)
    assert torch.equal(rotate(x, block), native_bits)


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter truncates bf16
def test_the_gpus_one_launch_gives_torchs_butterflies_bits(block, dtype, monkeypatch):
    """A GPU's eager rotation (one Triton launch, `kernels.hadamard.rotate_rows`; interpreted without
    one) stores what torch's butterflies do, for a strided tensor of runs no multiple of a program's."""
    pytest.importorskip("triton")
    from llmx.kernels.hadamard import rotate_rows

    x = torch.randn(3, 37, 128, generator=torch.Generator().manual_seed(block)).to(dtype).transpose(0, 1)
    monkeypatch.setattr(cpu_native, "available", lambda: False)
    want = rotate(x, block)  # on the CPU: torch's butterflies
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = rotate_rows(x.to(device), block)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got.cpu(), want)


def test_blocks_are_llama_cpps():
    """Keys: the largest power of two from 64 that divides the head; values: 64; float caches and heads
    not a multiple of 64: none."""
    q4 = qtype("q4_0")
    assert [key_block(q4, d) for d in (64, 128, 192, 256, 96, 80)] == [64, 128, 64, 256, 0, 0]
    assert [value_block(q4, d) for d in (64, 256, 96)] == [64, 64, 0]
    assert key_block(qtype("f16"), 128) == value_block(qtype("bf16"), 128) == 0


def test_a_cache_of_blocks_is_rotated_on_the_sides_it_quantizes():
    cpu = torch.device("cpu")
    assert kv_rotation((qtype("q4_0"), qtype("f16")), (128, 128), cpu) == (128, 0)
    assert kv_rotation((qtype("f16"), qtype("q5_1")), (64, 64), cpu) == (0, 64)
    assert kv_rotation((qtype("q8_0"), qtype("q8_0")), (64, 64), cpu) == (64, 64)


def test_the_gpus_q8_0_sides_stay_unrotated(monkeypatch):
    """In the Triton kernels' layout (a GPU's caches) q8_0 is not worth its cost (`TRITON_UNROTATED`);
    4-bit sides are rotated there as on the CPU."""
    from llmx.quant import kv_layout

    monkeypatch.setattr(kv_layout, "GROUPED_ON_CPU", True)  # the CPU's caches as a GPU's
    cpu = torch.device("cpu")
    assert kv_rotation((qtype("q8_0"), qtype("q4_0")), (128, 128), cpu) == (0, 64)
    assert kv_rotation((qtype("q8_0"), qtype("q8_0")), (128, 128), cpu) == (0, 0)
    assert kv_rotation((qtype("iq4_nl"), qtype("q5_1")), (128, 128), cpu) == (128, 64)


def native_steps(keys, values, q, kv_types, rotation) -> torch.Tensor:
    """q [1, H, D] attending after every key and value [N, Hk, D] went in, a token a step, through the
    native one-call step over a cache of `kv_types` in `rotation` (no RoPE: its angles of no dimensions)."""
    n, n_kv, d = keys.shape
    kc, vc = (
        torch.zeros(n, n_kv, d)
        if name == "F32"
        else torch.zeros(n, n_kv, qtype(name).row_bytes(d), dtype=torch.uint8)
        for name in kv_types
    )
    step, no_angles = cpu_native.Attention(kc, vc, kv_types, d, rotation), torch.empty(1, 0)
    for p in range(n):
        out = step(q, keys[p : p + 1], values[p : p + 1], no_angles, no_angles, False, p, None, d**-0.5)
    return out


@native
def test_a_rotated_4_bit_key_cache_attends_closer_to_float_attention():
    """Keys whose few outlier channels set each q4_0 block's scale: the native step over a cache rotated
    in blocks of 64 lands at least twice as close to float64 attention over the float keys (0.07 of
    the output's norm against 0.16)."""
    n_head, n_kv, d, n = 4, 2, 64, 48
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(n, n_kv, d, generator=g)
    keys[:, :, ::16] *= 20  # outlier channels, as real models' keys have
    values, q = torch.randn(n, n_kv, d, generator=g), torch.randn(1, n_head, d, generator=g)
    k64, v64 = (x.repeat_interleave(n_head // n_kv, 1).double() for x in (keys, values))
    weights = (torch.einsum("hd,nhd->hn", q[0].double(), k64) / d**0.5).softmax(-1)
    want = torch.einsum("hn,nhd->hd", weights, v64).reshape(1, -1)
    unrotated, rotated = (
        ((native_steps(keys, values, q, ("Q4_0", "F32"), r).double() - want).norm() / want.norm()).item()
        for r in ((0, 0), (64, 0))
    )
    assert rotated < unrotated / 2, (unrotated, rotated)


@native
def test_values_rotated_and_the_output_rotated_back_attend_as_before():
    """Float values stored rotated by 64 and the output rotated back: the same attention to float
    rounding (the step's output rotation is its values' inverse)."""
    g = torch.Generator().manual_seed(1)
    keys, values, q = (
        torch.randn(20, 2, 128, generator=g),
        torch.randn(20, 2, 128, generator=g),
        torch.randn(1, 4, 128, generator=g),
    )
    plain, rotated = (native_steps(keys, values, q, ("F32", "F32"), (0, r)) for r in (0, 64))
    torch.testing.assert_close(rotated, plain, rtol=0, atol=1e-5)
