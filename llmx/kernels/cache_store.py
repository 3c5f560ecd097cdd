"""Rows written into a block KV cache on a GPU, quantized where they are written: the grouped layout
(`llmx.quant.kv_layout`; its reader is `cache_rows.load_rows`), a head's row at a time.

The helpers (`quantize_head`, `blocks_value`, `store_head`) are shared with the decode kernel, which
stores its token's key and value this way; `store` writes a prompt's rows in one launch, where
`llmx.quant.quantize`'s torch ops and the layout's byte permutation took ~30 small kernels for each
of K and V a layer. The bytes are `quantize`'s (gguf's reference rounding), grouped.

    store(buffer, slots, x, qt) -> None
        x [T, Hk, D] (any float dtype, D a multiple of 32) quantized to `qt` into rows `slots` [T]
        (int64) of buffer uint8 [R, Hk, D / 32 * block bytes], all on one device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmx.kernels import cache_rows
from llmx.kernels.cache_rows import IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, head_at
from llmx.quant import QType


def store(buffer: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, qt: QType) -> None:
    """x [T, Hk, D] quantized to `qt` into rows `slots` of `buffer` (see the module docstring)."""
    t, n_kv, d = x.shape
    (code, block_bytes), _ = cache_rows.codes((qt, qt), buffer, buffer)
    if t == 0:
        return
    x = x if x.stride(-1) == 1 else x.contiguous()
    store_kernel[(t, n_kv)](
        x, slots, buffer, cache_rows.levels(x.device), x.stride(0), x.stride(1), buffer.stride(0),
        buffer.stride(1), D=d, QT=code, QB=block_bytes, BLOCK_D=triton.next_power_of_2(d), num_warps=1,
    )  # fmt: skip


@triton.jit
def store_kernel(
    x_ptr, slots_ptr, cache_ptr, levels_ptr, sx_t, sx_h, sc_n, sc_h,
    D: tl.constexpr, QT: tl.constexpr, QB: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (row t, KV head h): x[t, h] quantized into cache row slots[t]'s head h."""
    t, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + t.to(tl.int64) * sx_t + h * sx_h + d, mask=d < D, other=0.0).to(tl.float32)
    codes, scale, low = quantize_head(x, levels_ptr, QT, BLOCK_D)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    head_ptr = cache_ptr + slot * sc_n + head_at(h, sc_h, D, QT, QB)
    store_head(head_ptr, codes, scale, low, slot >= 0, D, QT, QB, BLOCK_D)


@triton.jit
def quantize_head(x, levels_ptr, QT: tl.constexpr, BLOCK_D: tl.constexpr):
    """A head's values x [BLOCK_D] float32 as blocks: codes [BLOCK_D / 32, 32] int32 (unsigned but
    Q8_0's; IQ4_NL's the level's index), d and m [BLOCK_D / 32] float32 (m 0 for the symmetric types),
    rounded as `llmx.quant.quantize` (gguf's reference) rounds."""
    xb = tl.reshape(x, (BLOCK_D // 32, 32))
    j = tl.arange(0, 32)[None, :]
    ax = tl.abs(xb)
    amax = tl.max(ax, 1)
    m = tl.zeros([BLOCK_D // 32], tl.float32)
    if QT == Q8_0:
        d = tl.math.div_rn(amax, 127.0)
        v = xb * _inverse(d)[:, None]
        a = tl.abs(v)
        whole = tl.floor(a)
        r = whole + tl.floor(2.0 * (a - whole))  # half away from zero, as roundf
        codes = tl.where(v < 0, -r, r).to(tl.int32)
    elif QT >= Q5_1:
        levels: tl.constexpr = 16 if QT == Q4_1 else 32
        m = tl.min(xb, 1)
        d = tl.math.div_rn(tl.max(xb, 1) - m, levels - 1.0)
        c = tl.floor((xb - m[:, None]) * _inverse(d)[:, None] + 0.5)
        codes = tl.minimum(tl.maximum(c, 0.0), levels - 1.0).to(tl.int32)
    else:  # the value of the largest magnitude (the first of equals) sets the scale
        first = tl.min(tl.where(ax == amax[:, None], j, 32), 1)
        vmax = tl.sum(tl.where(j == first[:, None], xb, 0.0), 1)
        if QT == IQ4_NL:
            d = tl.math.div_rn(vmax, -127.0)
            v = xb * _inverse(d)[:, None]
            codes = tl.zeros([BLOCK_D // 32, 32], tl.int32)
            for i in tl.static_range(15):  # the nearest level, the upper of two as near (ggml's)
                lo, hi = tl.load(levels_ptr + i), tl.load(levels_ptr + i + 1)
                codes += tl.where(v - lo < hi - v, 0, 1)
            level = tl.load(levels_ptr + codes)
            w = xb * xb
            sumqx, sumq2 = tl.sum(w * level * xb, 1), tl.sum(w * level * level, 1)
            d = tl.where(sumq2 > 0, tl.math.div_rn(sumqx, tl.where(sumq2 > 0, sumq2, 1.0)), d)
        else:
            levels: tl.constexpr = 16 if QT == Q4_0 else 32
            d = tl.math.div_rn(vmax, -(levels // 2) * 1.0)
            c = tl.floor(xb * _inverse(d)[:, None] + (levels // 2 + 0.5))
            codes = tl.minimum(tl.maximum(c, 0.0), levels - 1.0).to(tl.int32)
    return codes, d.to(tl.float16).to(tl.float32), m.to(tl.float16).to(tl.float32)


@triton.jit
def _inverse(d):
    return tl.where(d == 0, 0.0, tl.math.div_rn(1.0, tl.where(d == 0, 1.0, d)))


@triton.jit
def blocks_value(codes, d, m, levels_ptr, QT: tl.constexpr, BLOCK_D: tl.constexpr):
    """What `cache_rows.load_rows` reads back from `quantize_head`'s blocks: [BLOCK_D] float32."""
    if QT == IQ4_NL:
        v = d[:, None] * tl.load(levels_ptr + codes)
    elif QT == Q4_0:
        v = d[:, None] * (codes - 8).to(tl.float32)
    elif QT == Q5_0:
        v = d[:, None] * (codes - 16).to(tl.float32)
    elif QT == Q8_0:
        v = d[:, None] * codes.to(tl.float32)
    else:
        v = d[:, None] * codes.to(tl.float32) + m[:, None]
    return tl.reshape(v, (BLOCK_D,))


@triton.jit
def store_head(
    head_ptr, codes, d, m, store, D: tl.constexpr, QT: tl.constexpr, QB: tl.constexpr, BLOCK_D: tl.constexpr
):  # fmt: skip
    """`quantize_head`'s blocks of a head, at its start `head_ptr` in the cache row, where `store`, in the
    grouped layout: a field at byte o of a block starts at byte NB * o of the head. The blocks past
    D (BLOCK_D > D) are not the row's."""
    NB: tl.constexpr = D // 32
    nb = tl.arange(0, BLOCK_D // 32)
    mine = tl.where(store, nb < NB, False)
    tl.store((head_ptr + 2 * nb).to(tl.pointer_type(tl.float16)), d.to(tl.float16), mask=mine)
    j = tl.arange(0, 32)[None, :]
    if QT == Q8_0:
        at = (2 * NB) + 32 * nb[:, None] + j
        tl.store((head_ptr + at).to(tl.pointer_type(tl.int8)), codes.to(tl.int8), mask=mine[:, None])
    else:
        if QT >= Q5_1:
            m_ptrs = (head_ptr + 2 * NB + 2 * nb).to(tl.pointer_type(tl.float16))
            tl.store(m_ptrs, m.to(tl.float16), mask=mine)
        shifted = (codes & 15) << ((j // 16) * 4)  # values l and l + 16 share byte l
        packed = tl.sum(tl.reshape(shifted, (BLOCK_D // 32, 2, 16)), 1)
        l16 = tl.arange(0, 16)[None, :]
        at = (NB * (QB - 16)) + 16 * nb[:, None] + l16
        tl.store(head_ptr + at, packed.to(tl.uint8), mask=mine[:, None])
        if QT >= Q5_0 and QT <= Q5_1:
            bits = ((codes >> 4) & 1) << (j % 8)
            qh = tl.sum(tl.reshape(bits, (BLOCK_D // 32, 4, 8)), 2)
            l4 = tl.arange(0, 4)[None, :]
            tl.store(head_ptr + (NB * (QB - 20)) + 4 * nb[:, None] + l4, qh.to(tl.uint8), mask=mine[:, None])
