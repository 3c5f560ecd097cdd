"""Walsh-Hadamard rotation of attention heads whose keys or values a quantized cache holds.

A few channels of a key head carry most of its magnitude, and a 4-bit block's one scale then leaves
the others a level or two. Rotating queries and keys alike by an orthonormal Walsh-Hadamard matrix H
(after RoPE) spreads every channel over the block and leaves each score q.k as it was, since
(Hq).(Hk) = q.k; rotating values by H rotates the attention's output by H too, and H H = I takes it
back. llama.cpp does the same for quantized caches (its `attn_rot_k`, `attn_rot_v`): keys in blocks
of the largest power of two from 64 dividing the head, values in blocks of 64. On SmolLM2 with a q4_0
key cache the mean KLD against f16 falls from 0.27 to about 0.1 (bench/RESULTS.md, Quality).

Rotation is the cache's, chosen once (`kv_rotation`): every path that stores into it or attends over
it rotates alike. The fused one-token steps rotate inside (the native CPU kernels in C, Triton's
decode kernel with `tl.split`/`tl.join` butterflies); the eager path (`rotate`: one native call a
tensor on the CPU, one Triton launch on a GPU, torch's butterflies elsewhere) before the cache's
store and the prompt kernels, and rotates their output back.
"""

from __future__ import annotations

import math

import torch

from llmx.quant import QType, cpu_native, kv_layout

SMALLEST = 64  # llama.cpp's: heads not a multiple of it are not rotated
# Types the Triton kernels' caches (a GPU's) hold unrotated: unrotated, a q8_0 cache already attends
# within a mean KLD of 0.0012 of f16 on SmolLM2 (llama.cpp's rotated one: 0.0070), and rotating
# costs its decode kernel 18-60% (H100, 32K-512 keys: the butterflies' shuffles through shared
# memory); a 4-bit cache's KLD falls 3x rotated, for 4-34% of its kernel.
TRITON_UNROTATED = frozenset({"Q8_0"})


def key_block(qt: QType, head_dim: int) -> int:
    """The block in which keys (and queries) of `qt` are rotated: 0 for a float cache or a head that
    is not a multiple of 64, else the largest power of two from 64 that divides it."""
    if qt.is_float or head_dim % SMALLEST:
        return 0
    block = SMALLEST
    while head_dim % (2 * block) == 0:
        block *= 2
    return block


def value_block(qt: QType, head_dim: int) -> int:
    """The block in which values (and the attention's output) of `qt` are rotated: 64, or 0 as for keys."""
    return 0 if qt.is_float or head_dim % SMALLEST else SMALLEST


def kv_rotation(types: tuple[QType, QType], dims: tuple[int, int], device: torch.device) -> tuple[int, int]:
    """(key block, value block) for a cache of K and V types `types` with heads of `dims` values on
    `device`; 0 where that side is not rotated (`TRITON_UNROTATED` in the Triton kernels' layout)."""
    kt, vt = types
    triton_layout = kv_layout.grouped(device)
    k = 0 if triton_layout and kt.name in TRITON_UNROTATED else key_block(kt, dims[0])
    v = 0 if triton_layout and vt.name in TRITON_UNROTATED else value_block(vt, dims[1])
    return k, v


def rotate_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k (after RoPE) rotated in a cache's key blocks, v in its value blocks (`rotation`, from
    `kv_rotation`): what the eager path stores and attends with; its output goes back by
    `rotate(out, rotation[1])`."""
    rot_k, rot_v = rotation
    return rotate(q, rot_k), rotate(k, rot_k), rotate(v, rot_v)


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., D] with each run of `block` values of its last dimension rotated by the orthonormal
    Walsh-Hadamard matrix (block 0: x itself). The matrix is symmetric and its own inverse: rotating
    twice gives x back. Butterflies (a + b, a - b) of strides 1, 2, 4, .. in float32, then the scale:
    the native kernels' steps (`hadamard_in_place` in cpu_blocks.c), so both store the same bytes; on
    the CPU that very code, in one call (torch's ~20 ops a tensor cost a q8_0 cache's pp512 a quarter),
    on a GPU one Triton launch (`kernels.hadamard.rotate_rows`)."""
    if block == 0:
        return x
    if x.is_cuda:
        from llmx.kernels.hadamard import rotate_rows  # Triton: imported where a GPU is

        return rotate_rows(x, block)
    if cpu_native.available():
        y = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # one copy, strided or not
        cpu_native.hadamard_rows(y, block)
        return y.to(x.dtype)
    y = x.reshape(-1, block).to(torch.float32)
    s = 1
    while s < block:
        pairs = y.reshape(-1, block // (2 * s), 2, s)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack([a + b, a - b], 2).reshape(-1, block)
        s *= 2
    return (y * (1.0 / math.sqrt(block))).to(x.dtype).reshape(x.shape)
