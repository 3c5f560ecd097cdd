"""Unpack helpers for the legacy 32-weight blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

The contract every unpack helper (here, in `kquants` and in `iq`) keeps:
    row_off [R, 1] int64  byte offset of each weight row in the raw tensor
    sb      [1, S] int32  which G-weight groups of the row to unpack (group g = weights g*G .. g*G+G-1)
    K, PACKED             weights per row, and whether rows are in `layout.prepare`'s layout
                          (only types whose fp16 fields misalign their codes take these two)
returns (q [R, S, G], a [R, S], b [R, S]), all float32, with weight = a * q + b exactly as
gguf-py's dequantize computes it (a * q is exact in float32 for every type, so a fused
multiply-add rounds the same way as the reference's multiply then add). G is 32 here.

Block layouts (ggml-common.h), little-endian, fp16 scales:
    Q4_0 (18 B): d, qs[16]          w = d * (nibble - 8)
    Q4_1 (20 B): d, m, qs[16]       w = d * nibble + m
    Q5_0 (22 B): d, qh[4], qs[16]   w = d * (nibble | high bit << 4) - 16 d
    Q5_1 (24 B): d, m, qh[4], qs[16] w = d * (nibble | high bit << 4) + m
    Q8_0 (34 B): d, qs[32] int8     w = d * q
Weight l < 16 of a block is the low nibble of qs[l], weight l >= 16 the high nibble of qs[l - 16];
its fifth bit is bit l of the 32-bit qh.
"""

import triton
import triton.language as tl

from llmx.quant.triton.bits import block_parts, code_f32, f16, nibbles, u8


@triton.jit
def _nibble_codes(w_ptr, body, QS: tl.constexpr):
    """[R, S, 32] 4-bit codes of the blocks whose bodies start at `body` [R, S], quants at QS."""
    l = tl.arange(0, 32)[None, None, :]
    return nibbles(w_ptr, body[:, :, None] + QS + l % 16, 4 * (l // 16))


@triton.jit
def _high_bits(w_ptr, body, QH: tl.constexpr):
    """[R, S, 32] fifth bits (0 or 16) from the 32-bit qh at offset QH of each block body."""
    qh = u8(w_ptr, body + QH) | (u8(w_ptr, body + QH + 1) << 8)
    qh = qh | (u8(w_ptr, body + QH + 2) << 16) | (u8(w_ptr, body + QH + 3) << 24)
    l = tl.arange(0, 32)[None, None, :]
    return ((qh[:, :, None] >> l) & 1) << 4


@triton.jit
def q4_0(w_ptr, row_off, sb, K, PACKED: tl.constexpr):
    body, fields = block_parts(row_off, sb, K, 32, 18, 1, True, PACKED)
    d = f16(w_ptr, fields)
    return code_f32(_nibble_codes(w_ptr, body, 0), 8), d, tl.zeros_like(d)


@triton.jit
def q4_1(w_ptr, row_off, sb, K, PACKED: tl.constexpr):
    body, fields = block_parts(row_off, sb, K, 32, 20, 2, True, PACKED)
    return code_f32(_nibble_codes(w_ptr, body, 0), 0), f16(w_ptr, fields), f16(w_ptr, fields + 2)


@triton.jit
def q5_0(w_ptr, row_off, sb, K, PACKED: tl.constexpr):
    body, fields = block_parts(row_off, sb, K, 32, 22, 1, True, PACKED)
    d = f16(w_ptr, fields)
    q = _nibble_codes(w_ptr, body, 4) | _high_bits(w_ptr, body, 0)
    return code_f32(q, 16), d, tl.zeros_like(d)


@triton.jit
def q5_1(w_ptr, row_off, sb, K, PACKED: tl.constexpr):
    body, fields = block_parts(row_off, sb, K, 32, 24, 2, True, PACKED)
    q = _nibble_codes(w_ptr, body, 4) | _high_bits(w_ptr, body, 0)
    return code_f32(q, 0), f16(w_ptr, fields), f16(w_ptr, fields + 2)


@triton.jit
def q8_0(w_ptr, row_off, sb, K, PACKED: tl.constexpr):
    body, fields = block_parts(row_off, sb, K, 32, 34, 1, True, PACKED)
    d = f16(w_ptr, fields)
    l = tl.arange(0, 32)[None, None, :]
    # int8 v is (byte ^ 0x80) - 128: the bias keeps the code non-negative for code_f32.
    q = code_f32(u8(w_ptr, body[:, :, None] + l) ^ 0x80, 128)
    return q, d, tl.zeros_like(d)
