"""The Walsh-Hadamard rotation (`llmx.ops.hadamard`) in Triton: `hadamard` rotates a tile a kernel
holds (the decode attention's q, k, v and output), `rotate_rows` a tensor in one launch (the eager
path's rotation on a GPU, where torch's butterflies take ~20 small kernels a tensor). Both take the
same float32 steps in the same order as `ops.hadamard.rotate`, so every path stores the same bytes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 32  # runs a program rotates


def rotate_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., D] with each run of `block` values of its last dimension (a power of two dividing D)
    rotated, in x's dtype (a new tensor)."""
    runs = x.reshape(-1, block)  # a view where x is contiguous, else one copy
    out = torch.empty(runs.shape, dtype=x.dtype, device=x.device)
    rows_kernel[(triton.cdiv(runs.shape[0], BLOCK_R),)](
        runs, out, runs.shape[0], runs.stride(0), BLOCK=block, BLOCK_R=BLOCK_R
    )
    return out.reshape(x.shape)


@triton.jit
def hadamard(x, BLOCK: tl.constexpr):
    """x [R, C] float32 (C a multiple of BLOCK, a power of two; BLOCK 0: x as it is) with each run of
    BLOCK values of a row rotated by the orthonormal Walsh-Hadamard matrix: butterflies (a + b, a - b)
    of strides 1, 2, .. BLOCK / 2, then the scale."""
    if BLOCK > 0:
        R: tl.constexpr = x.shape[0]
        C: tl.constexpr = x.shape[1]
        for i in tl.static_range(10):  # strides up to 512, the widest head a kernel takes
            if (1 << i) < BLOCK:  # stride 1 << i: each group of 2 << i values its halves' a and b
                pairs = tl.permute(tl.reshape(x, (R, C // (2 << i), 2, 1 << i)), (0, 1, 3, 2))
                a, b = tl.split(pairs)
                x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, C))
        x = x * (1.0 / BLOCK**0.5)
    return x


@triton.jit
def rows_kernel(x_ptr, out_ptr, n_rows, stride, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr):
    """`rotate_rows`: runs program_id * BLOCK_R.. of x [n_rows, BLOCK] (rows `stride` apart)."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK)[None, :]
    x = tl.load(x_ptr + r * stride + d, mask=r < n_rows, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * BLOCK + d, hadamard(x, BLOCK).to(out_ptr.dtype.element_ty), mask=r < n_rows)
