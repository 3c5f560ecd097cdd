"""Unpack helpers for the non-linear 4-bit types IQ4_NL and IQ4_XS (G = 32).

Same contract as `legacy` (see its docstring), plus `lut_ptr`: the 16 int8 code points
(ggml-common.h `kvalues_iq4nl`) as float32 on the kernel's device; a code's value is a lookup in it.
    IQ4_NL (18 B):  d, qs[16]                                  w = d * kvalues[nibble]
    IQ4_XS (136 B): d, scales_h (u16), scales_l[4], qs[128]    w = d * (ls - 32) * kvalues[nibble]
IQ4_NL nibbles are ordered as in Q4_0; IQ4_XS sub-block j has 16 bytes qs[16j..16j+15], low nibbles
first, and a 6-bit scale ls: low 4 bits from scales_l[j//2] (nibble j%2), high 2 from scales_h bits 2j.
"""

import triton
import triton.language as tl

from llmx.quant.triton.bits import block_parts, f16, nibbles, u8


@triton.jit
def _lookup(w_ptr, start, QS: tl.constexpr, lut_ptr):
    """[R, S, 32] values of the 16 nibble-packed bytes at start + QS, Q4_0 order."""
    l = tl.arange(0, 32)[None, None, :]
    return tl.load(lut_ptr + nibbles(w_ptr, start[:, :, None] + QS + l % 16, 4 * (l // 16)))


@triton.jit
def iq4_nl(w_ptr, row_off, sb, K, PACKED: tl.constexpr, lut_ptr):
    body, fields = block_parts(row_off, sb, K, 32, 18, 1, True, PACKED)
    d = f16(w_ptr, fields)
    return _lookup(w_ptr, body, 0, lut_ptr), d, tl.zeros_like(d)


@triton.jit
def iq4_xs(w_ptr, row_off, sb, lut_ptr):
    sup = row_off + (sb // 8) * 136
    j = sb % 8
    ls_lo = (u8(w_ptr, sup + 4 + j // 2) >> (4 * (j % 2))) & 15
    ls_hi = (u8(w_ptr, sup + 2 + j // 4) >> (2 * (j % 4))) & 3
    a = f16(w_ptr, sup) * ((ls_lo | (ls_hi << 4)) - 32).to(tl.float32)
    return _lookup(w_ptr, sup + 16 * j, 8, lut_ptr), a, tl.zeros_like(a)
