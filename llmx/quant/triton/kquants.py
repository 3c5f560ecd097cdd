"""Unpack helpers for the K-quants: 256-weight super-blocks with 6-bit or 8-bit sub-block scales.

Same contract as `legacy` (see its docstring). Groups follow the scale granularity: G = 16 for
Q2_K, Q3_K and Q6_K, G = 32 for Q4_K and Q5_K; `j` below is the group's index in its super-block.

Layouts (ggml-common.h block_q*_K), w = weight j*G + l of the super-block:
    Q2_K (84 B):  scales[16] (lo: scale, hi: min), qs[64], d, dmin      w = d*sc*q - dmin*m, q 2 bits
    Q3_K (110 B): hmask[32], qs[64], scales[12] (16 x 6 bits), d        w = d*(sc-32)*(q - 4*(1-h))
    Q4_K (144 B): d, dmin, scales[12] (8 x 6-bit scale + min), qs[128]  w = d*sc*q - dmin*m
                  (`prepare`d: scales[12] regrouped by sub-block pair, see `paired_scale_min`)
    Q5_K (176 B): d, dmin, scales[12], qh[32], qs[128]                   w = d*sc*(q | h<<4) - dmin*m
    Q6_K (210 B): ql[128], qh[64], scales[16] int8, d                    w = d*sc*((ql | qh<<4) - 32)
2-bit codes: weight i of a 128-weight half sits in byte i%32 of that half's 32 bytes, at bits
2*(i//32). Q3_K's hmask / Q5_K's qh: weight i of the super-block is bit i//32 of byte i%32.
"""

import triton
import triton.language as tl

from llmx.quant.triton.bits import block_parts, byte_mask, code_bytes, code_f32, code_values, f16, nibbles, u8


@triton.jit
def _two_bit_codes(w_ptr, body, j, QS: tl.constexpr, WORDS: tl.constexpr):
    """The 16 2-bit codes of groups `j` (0..15, 16 weights) of the super-block bodies at `body`, qs
    at QS, one a byte (`bits.code_bytes`)."""
    codes = code_bytes(w_ptr, body + QS + 32 * (j >> 3) + 16 * (j & 1), WORDS)
    return byte_mask(codes >> (2 * ((j & 7) >> 1))[:, :, None], 3, WORDS)


@triton.jit
def scale_min_k4(w_ptr, blk, j):
    """Q4_K/Q5_K 6-bit scale and min of sub-block j (0..7) from the 12 bytes at blk + 4, as float32."""
    lo = j % 4
    sc, mn = k4_scale_min(u8(w_ptr, blk + 4 + lo), u8(w_ptr, blk + 8 + lo), u8(w_ptr, blk + 12 + lo), j < 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def k4_scale_min(s, m, sm, first):
    """int32 scale and min of a Q4_K/Q5_K sub-block j from its three scale bytes (int32 0..255):
    s = byte j%4, m = byte 4 + j%4, sm = byte 8 + j%4 of the 12; `first` is j < 4.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    sc = tl.where(first, s & 63, (sm & 15) | ((s >> 6) << 4))
    mn = tl.where(first, m & 63, (sm >> 4) | ((m >> 6) << 4))
    return sc, mn


@triton.jit
def paired_scale_min(lows, highs, odd):
    """int32 scale and min of sub-block 2p + odd of a Q4_K block in `layout.prepare`'s layout
    (`prepare_q4_k_scales`), from its pair p's fields: `lows` (bits 0-15 of bytes 4 + 2p and 5 + 2p
    as one int32; higher bits ignored) and `highs` (byte 12 + p, at bit 4 and up, lower bits ignored)."""
    sc = ((lows >> (4 * odd)) & 15) | ((highs >> (2 * odd)) & 0x30)
    mn = ((lows >> (8 + 4 * odd)) & 15) | ((highs >> (4 + 2 * odd)) & 0x30)
    return sc, mn


@triton.jit
def q2_k(w_ptr, row_off, sb, K, PACKED: tl.constexpr, WORDS: tl.constexpr):
    body, fields = block_parts(row_off, sb >> 4, K, 256, 84, 2, False, PACKED)
    j = sb & 15  # sb >= 0: masks and shifts, not signed division
    s = u8(w_ptr, body + j)
    a = f16(w_ptr, fields) * (s & 15).to(tl.float32)
    b = -(f16(w_ptr, fields + 2) * (s >> 4).to(tl.float32))
    return code_f32(code_values(_two_bit_codes(w_ptr, body, j, 16, WORDS), WORDS), 0), a, b


@triton.jit
def q3_k(w_ptr, row_off, sb, K, PACKED: tl.constexpr, WORDS: tl.constexpr):
    body, fields = block_parts(row_off, sb >> 4, K, 256, 110, 1, False, PACKED)
    j = sb & 15
    # The third bit of code l of group j is bit j // 2 of hmask byte 16 (j % 2) + l; a set bit means
    # the code is used as is, a clear one subtracts 4.
    hmask = code_bytes(w_ptr, body + 16 * (j & 1), WORDS) >> (j >> 1)[:, :, None]
    codes = _two_bit_codes(w_ptr, body, j, 32, WORDS) | (byte_mask(hmask, 1, WORDS) << 2)
    q = code_f32(code_values(codes, WORDS), 4)
    sc_lo = (u8(w_ptr, body + 96 + (j & 7)) >> (4 * (j >> 3))) & 15
    sc_hi = (u8(w_ptr, body + 104 + (j & 3)) >> (2 * (j >> 2))) & 3
    a = f16(w_ptr, fields) * ((sc_lo | (sc_hi << 4)) - 32).to(tl.float32)
    return q, a, tl.zeros_like(a)


@triton.jit
def _k4_low_nibbles(w_ptr, row_off, sb, BYTES: tl.constexpr, QS: tl.constexpr, PAIRED: tl.constexpr):
    """What Q4_K and Q5_K share: the super-block offsets `blk`, group index j, code lanes l, the
    low 4 bits of each code (nibbles at QS), and the group's a = d*sc and b = -dmin*m (scales in
    GGUF order, or by pair when PAIRED)."""
    blk = row_off + (sb // 8) * BYTES
    j = sb % 8
    if PAIRED:
        p = j // 2
        lows = u8(w_ptr, blk + 4 + 2 * p) | (u8(w_ptr, blk + 5 + 2 * p) << 8)
        sc, mn = paired_scale_min(lows, u8(w_ptr, blk + 12 + p) << 4, j % 2)
        sc, mn = sc.to(tl.float32), mn.to(tl.float32)
    else:
        sc, mn = scale_min_k4(w_ptr, blk, j)
    l = tl.arange(0, 32)[None, None, :]
    off = blk + QS + 32 * (j // 2)
    q = nibbles(w_ptr, off[:, :, None] + l, (4 * (j % 2))[:, :, None])
    return blk, j, l, q, f16(w_ptr, blk) * sc, -(f16(w_ptr, blk + 2) * mn)


@triton.jit
def q4_k(w_ptr, row_off, sb, PACKED: tl.constexpr):
    _, _, _, q, a, b = _k4_low_nibbles(w_ptr, row_off, sb, 144, 16, PACKED)
    return code_f32(q, 0), a, b


@triton.jit
def q5_k(w_ptr, row_off, sb):
    blk, j, l, q, a, b = _k4_low_nibbles(w_ptr, row_off, sb, 176, 48, False)
    h = (u8(w_ptr, blk[:, :, None] + 16 + l) >> j[:, :, None]) & 1  # fifth bits: qh[32] at byte 16
    return code_f32(q | (h << 4), 0), a, b


@triton.jit
def q6_k(w_ptr, row_off, sb, K, PACKED: tl.constexpr, WORDS: tl.constexpr):
    body, fields = block_parts(row_off, sb >> 4, K, 256, 210, 1, False, PACKED)
    j = sb & 15
    half, r = j >> 3, j & 7
    # group j's low 4 bits: ql bytes 64 half + 16 (r % 4) + l, nibble r // 4; its high 2: qh bytes
    # 128 + 32 half + 16 (r % 2) + l, bits 2 (r // 2)
    lo = code_bytes(w_ptr, body + 64 * half + 16 * (r & 3), WORDS) >> (4 * (r >> 2))[:, :, None]
    hi = code_bytes(w_ptr, body + 128 + 32 * half + 16 * (r & 1), WORDS) >> (2 * (r >> 1))[:, :, None]
    codes = byte_mask(lo, 15, WORDS) | (byte_mask(hi, 3, WORDS) << 4)
    sc = (u8(w_ptr, body + 192 + j) ^ 0x80) - 128  # int8 scale
    a = f16(w_ptr, fields) * sc.to(tl.float32)
    return code_f32(code_values(codes, WORDS), 32), a, tl.zeros_like(a)
