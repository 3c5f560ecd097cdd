"""Reading KV-cache rows in Triton kernels, shared by the decode (`decode_attention`) and prompt
(`prefill_attention`) attention kernels: float rows in their dtype, or GGUF blocks (q8_0, q4_0,
q4_1, q5_0, q5_1, iq4_nl) dequantized to float32 as a tile is loaded, so no cache-sized float
copy is ever made.

A cache's type reaches a kernel as two constexprs (`codes`): its code (0: float, read in its
dtype), ordered so that ranges name the layouts' traits (Q5_0..Q5_1 have fifth bits, Q5_1..Q4_1 a
minimum), and its block's bytes.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from llmx.quant import QType
from llmx.quant.reference import IQ4_LEVELS

TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# Compiled kernels read module globals only as tl.constexpr (Triton's interpreter reads any).
BLOCKS = {"Q8_0": (1, 34), "Q4_0": (2, 18), "IQ4_NL": (3, 18), "Q5_0": (4, 22), "Q5_1": (5, 24),
          "Q4_1": (6, 20)}  # fmt: skip
Q8_0, Q4_0, IQ4_NL, Q5_0, Q5_1, Q4_1 = (tl.constexpr(code) for code, _ in BLOCKS.values())


def codes(
    types: tuple[QType, QType] | None, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(code, block bytes) of K's and V's cache types (`types`: None for float caches); (0, 0) for a
    float type. Block caches [rows, Hk, head bytes] whose head bytes are a multiple of 4 must start
    each head 4-aligned: `load_rows` reads them as 32-bit words."""
    if types is None:
        return (0, 0), (0, 0)
    for t, rows in zip(types, (k_cache, v_cache), strict=True):
        if t.name in BLOCKS and rows.shape[-1] % 4 == 0:
            assert rows.data_ptr() % 4 == 0 and rows.stride(0) % 4 == 0 and rows.stride(1) % 4 == 0
    k, v = (BLOCKS.get(t.name, (0, 0)) for t in types)
    return k, v


@cache
def levels(device: torch.device) -> torch.Tensor:
    """IQ4_NL's 16 levels as float32 on `device`, for the kernels to look codes up in."""
    return torch.from_numpy(IQ4_LEVELS).float().to(device)


# --- kernels ------------------------------------------------------------------------------------


@triton.jit
def dot(a, b, DOT: tl.constexpr):
    """a @ b accumulated in float32; float32 operands in full precision, not tf32."""
    a, b = a.to(DOT), b.to(DOT)
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


# --- cache blocks: GGUF's layouts (ggml-common.h), read a head's row at a time ----------------------
# Every block type here holds 32 values: an f16 scale d (Q4_1, Q5_1: then an f16 minimum m), Q5's 32
# fifth bits (qh, a little-endian uint32), then codes: Q8_0's 32 int8, the others' 16 bytes of
# nibbles (byte l: value l low, value l + 16 high), the block's last 16 bytes.
#
# A tile is read a block field at a time rather than a value at a time: each block's scale once, and
# its codes as 16-bit halves, two bytes a load (a block's fields sit only 2-aligned: Q8_0's 34-byte
# blocks put codes at odd multiples of 2). A half's two bytes hold adjacent values (Q8_0: values
# 2w, 2w + 1; nibbles: 2w, 2w + 1 low and 16 above them high), so the values come out as pairs that
# `tl.join` puts side by side and a reshape lays in order.


@triton.jit
def halves_at(row_ptrs, offsets, mask, WORDS: tl.constexpr):
    """The 16-bit fields at even byte `offsets` from `row_ptrs`, in bits 0-15 of int32 (the bits above
    them unspecified). With WORDS (rows 4-aligned) each is read from the 32-bit word holding it: the
    compiler pipelines 4-byte loads through shared memory (cp.async), not 2-byte ones, so only
    those are in flight while the previous tile is multiplied."""
    if WORDS:
        words = tl.load((row_ptrs + (offsets & -4)).to(tl.pointer_type(tl.int32)), mask=mask, other=0)
        halves = words >> ((offsets & 2) * 8)
    else:
        halves = tl.load((row_ptrs + offsets).to(tl.pointer_type(tl.int16)), mask=mask, other=0).to(tl.int32)
    return halves


@triton.jit
def f16_of(halves):
    """f16 fields in bits 0-15 of `halves` (int32), as float32."""
    return halves.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_rows(
    row_ptrs, rmask, levels_ptr, D: tl.constexpr, QT: tl.constexpr, QB: tl.constexpr, BLOCK_D: tl.constexpr
):  # fmt: skip
    """Values 0..D-1 of the cache rows at `row_ptrs` [BLOCK_N, 1] (a head's start in each row) where
    `rmask` [BLOCK_N, 1], as a [BLOCK_N, BLOCK_D] tile: float32 for a block type (dequantized: d *
    code (+ m), IQ4_NL's code its level), else in the cache's dtype. A head of block rows whose
    bytes are a multiple of 4 starts 4-aligned (`codes` checks it of the caches)."""
    # One return at the end: Triton 3.6 compiles the statements after a constexpr branch's return
    # too, and refuses returns of different types (the cache's dtype, float32).
    if QT == 0:
        d = tl.arange(0, BLOCK_D)[None, :]
        values = tl.load(row_ptrs + d, mask=rmask & (d < D), other=0.0)
    else:
        WORDS: tl.constexpr = D // 32 * QB % 4 == 0
        nb = tl.arange(0, BLOCK_D // 32)[None, :]
        at = nb * QB  # [1, BLOCK_D / 32]: the blocks' offsets in the head
        bmask = rmask & (nb * 32 < D)
        scale = f16_of(halves_at(row_ptrs, at, bmask, WORDS))[:, :, None, None]
        rows3, at3, bmask3 = row_ptrs[:, :, None], at[:, :, None], bmask[:, :, None]  # [.., 1] by block
        if QT == Q8_0:  # [BLOCK_N, BLOCK_D / 32, 16, 2]: value 2w + k of each block
            w = tl.arange(0, 16)[None, None, :]
            halves = halves_at(rows3, at3 + 2 + 2 * w, bmask3, WORDS)
            pairs = tl.join(halves.to(tl.int8), (halves >> 8).to(tl.int8))
            values = scale * pairs.to(tl.float32)
        else:  # [BLOCK_N, BLOCK_D / 32, 2, 8, 2]: value 16h + 2w + k of each block
            w = tl.arange(0, 8)[None, None, :]
            # half w: bytes 2w and 2w + 1, so values 2w, 2w + 1 (low nibbles), 2w + 16, 2w + 17 (high)
            halves = halves_at(rows3, at3 + (QB - 16) + 2 * w, bmask3, WORDS)
            low_fifths, high_fifths = 0, 0
            if QT >= Q5_0 and QT <= Q5_1:
                qh_lo = halves_at(row_ptrs, at + (QB - 20), bmask, WORDS) & 0xFFFF
                qh = (qh_lo | (halves_at(row_ptrs, at + (QB - 18), bmask, WORDS) << 16))[:, :, None]
                low_fifths, high_fifths = qh >> (2 * w), qh >> (16 + 2 * w)
            pairs = tl.join(_pair(halves, low_fifths), _pair(halves >> 4, high_fifths))  # [..., 8, 2, 2]
            codes = tl.permute(pairs, (0, 1, 4, 2, 3))
            scale = scale[:, :, :, :, None]
            if QT == IQ4_NL:
                values = scale * tl.load(levels_ptr + codes)
            elif QT == Q4_0:
                values = scale * (codes - 8).to(tl.float32)
            elif QT == Q5_0:
                values = scale * (codes - 16).to(tl.float32)
            else:
                m = f16_of(halves_at(row_ptrs, at + 2, bmask, WORDS))
                values = scale * codes.to(tl.float32) + m[:, :, None, None, None]
        values = tl.reshape(values, (row_ptrs.shape[0], BLOCK_D))
    return values


@triton.jit
def _pair(nibbles, fifths):
    """Values 2w, 2w + 1 of a block ([..., 8, 2] int32): the nibbles at bits 0 and 8 of `nibbles`,
    with bits 0 and 1 of `fifths` (Q5's fifth bits, 0 for the other types) as their bit 4."""
    return tl.join((nibbles & 15) | ((fifths & 1) << 4), ((nibbles >> 8) & 15) | ((fifths & 2) << 3))
