"""Loads and bit tricks shared by every unpack helper.

Pointers are byte pointers into raw GGUF rows (`*uint8`); offsets are tensors of byte offsets.
"""

import triton
import triton.language as tl


@triton.jit
def u8(w_ptr, off):
    """The bytes at `w_ptr + off` as int32 in [0, 255]."""
    return tl.load(w_ptr + off).to(tl.int32)


@triton.jit
def u32(w_ptr, off):
    """The 4 bytes at byte offset `off` as one little-endian int32, for any 2-aligned `off` (every
    block field in GGUF rows is): the aligned word at or below it, and where `off` is 2 past a
    word boundary the next word too, joined. Unpacking a word's 4 codes at once takes a quarter of
    the shifts and masks of loading them as bytes."""
    mis = off & 2
    word = (w_ptr + (off - mis)).to(tl.pointer_type(tl.uint32))
    lo = tl.load(word)
    hi = tl.load(word + 1, mask=mis != 0, other=0)
    return tl.where(mis != 0, (lo >> 16) | (hi << 16), lo).to(tl.int32, bitcast=True)


@triton.jit
def word_bytes(v):
    """[R, S, W] int32 words -> [R, S, 4 W] int32 bytes (0..255), each word's bytes low one first."""
    b = (v[:, :, :, None] >> (8 * tl.arange(0, 4))[None, None, None, :]) & 255
    return tl.reshape(b, [v.shape[0], v.shape[1], 4 * v.shape[2]])


@triton.jit
def code_bytes(w_ptr, off, WORDS: tl.constexpr):
    """The 16 bytes from byte offsets `off` [R, S] (2-aligned) on: [R, S, 4] words (`u32`) when
    WORDS, else [R, S, 16] bytes as int32. An unpacker writes its shifts once for either, with
    `byte_mask` and `code_values`; words take a quarter of the shift and mask instructions, but
    their bytes end up spread over lanes, so a kernel that sums codes across a group (the GEMV)
    would pay shuffles for them."""
    if WORDS:  # one return for both: the branch is resolved at compile time, the shapes differ
        v = u32(w_ptr, off[:, :, None] + 4 * tl.arange(0, 4)[None, None, :])
    else:
        v = u8(w_ptr, off[:, :, None] + tl.arange(0, 16)[None, None, :])
    return v


@triton.jit
def byte_mask(v, MASK: tl.constexpr, WORDS: tl.constexpr):
    """v & MASK in every byte of `code_bytes`' result (words shifted right by at most 8 minus
    MASK's width keep each byte's bits its own)."""
    if WORDS:
        return v & (MASK * 0x01010101)
    else:
        return v & MASK


@triton.jit
def code_values(v, WORDS: tl.constexpr):
    """`code_bytes`-shaped codes as [R, S, 16], one code a weight."""
    if WORDS:
        v = word_bytes(v)
    return v


@triton.jit
def f16(w_ptr, off):
    """The fp16 stored at byte offset `off` (always 2-aligned in GGUF blocks), as float32."""
    return tl.load((w_ptr + off).to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def code_f32(v, BIAS: tl.constexpr):
    """float32(v - BIAS) for int32 codes 0 <= v < 2**23, exactly.

    Placing v in the mantissa of 2**23 and subtracting turns an integer into a float with one
    logic op and one add, instead of the int-to-float converter, which runs at an eighth of the
    FMA rate on Hopper and would bound 4-bit GEMV below the memory bandwidth.
    """
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + BIAS)


@triton.jit
def int_f32(v):
    """float32(v) for int32 |v| < 2**22, exactly: `code_f32`'s trick for signed values, centred on
    1.5 * 2**23 so that negative v stay within the same exponent."""
    return (v + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def nibbles(w_ptr, off, shift):
    """4-bit codes: (byte at `off`) >> `shift` & 15, as int32."""
    return (u8(w_ptr, off) >> shift) & 15


@triton.jit
def block_parts(
    row_off, blk, K,
    ELEMS: tl.constexpr, BYTES: tl.constexpr, NF: tl.constexpr, FIELDS_FIRST: tl.constexpr,
    PACKED: tl.constexpr,
):  # fmt: skip
    """Byte offsets (body, fields) of blocks `blk` in rows starting at `row_off`.

    A block of ELEMS weights and BYTES bytes is NF fp16 fields (its scales; first or last in the
    block) and a body (codes and sub-block scales). Raw GGUF rows keep each block whole, so with
    18-, 34- or 210-byte blocks the codes are only 2-byte aligned; rows repacked by
    `layout.prepare` (PACKED) hold every body first, then every block's fields, so bodies
    start on 16-byte boundaries and load as 16-byte vectors.
    """
    BODY: tl.constexpr = BYTES - 2 * NF
    if PACKED:
        body = row_off + blk * BODY
        fields = row_off + (K // ELEMS) * BODY + blk * (2 * NF)
    elif FIELDS_FIRST:
        fields = row_off + blk * BYTES
        body = fields + 2 * NF
    else:
        body = row_off + blk * BYTES
        fields = body + BODY
    return body, fields


@triton.jit
def half_f32(word, high: tl.constexpr):
    """The fp16 in the low (or high) half of int32 `word`, as float32."""
    bits = (word >> 16) if high else word
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def lane(v, i):
    """[R, W] int32 words -> [R, W/4]: word i of each quad of consecutive words (a quad loaded as one
    16-byte vector sits in one thread: no data moves); i a constant or a [1, W/4, 1] tensor, one
    lane a quad."""
    quads = tl.reshape(v, [v.shape[0], v.shape[1] // 4, 4])
    return tl.sum(tl.where(tl.arange(0, 4)[None, None, :] == i, quads, 0), 2)


# Four int8 codes (one 32-bit word) times their f16 scales (two f16x2 words) -> two f16x2 words: each
# byte made unsigned (xor 0x80) and placed under f16's exponent of 1024 (0x64XX is 1024 + XX, exactly),
# 1152 (0x6480) subtracted (the code, exactly), then multiplied by the scale, rounded once: the bits
# that rounding the float32 product to f16 gives. ~1.5 instructions a value where the compiler's int8 ->
# f32 -> f16 path takes ~2.5 (bytes picked out one by one, two conversions).
Q8_F16_ASM: tl.constexpr = tl.constexpr("""{
.reg .b32 u, lo, hi, k;
xor.b32 u, $2, 0x80808080;
prmt.b32 lo, u, 0x64646464, 0x4140;
prmt.b32 hi, u, 0x64646464, 0x4342;
mov.b32 k, 0x64806480;
sub.f16x2 lo, lo, k;
sub.f16x2 hi, hi, k;
mul.rn.f16x2 $0, lo, $3;
mul.rn.f16x2 $1, hi, $4;
}""")


@triton.jit
def q8_times_f16(codes, scale):
    """codes (int8) times scale (float16, broadcast to the codes' shape) in float16, four a step."""
    scale = tl.broadcast_to(scale, codes.shape)
    return tl.inline_asm_elementwise(
        Q8_F16_ASM, "=r,=r,r,r,r", [codes, scale], dtype=tl.float16, is_pure=True, pack=4
    )


# Four bytes' nibbles (shift 0: low, 4: high) times their f16 scales plus their f16 offsets -> two f16x2
# words: each nibble spread into a 16-bit lane under f16's exponent of 1024 (0x640X is 1024 + X,
# exactly), 1024 subtracted (the code, exactly), then code * scale + offset rounded once.
NIBBLE_F16_ASM: tl.constexpr = tl.constexpr("""{
.reg .b32 s, w, lo, hi, k;
and.b32 s, $3, 0xff;
shr.b32 w, $2, s;
prmt.b32 lo, w, 0, 0x7170;
prmt.b32 hi, w, 0, 0x7372;
lop3.b32 lo, lo, 0x000f000f, 0x64006400, 0xea;
lop3.b32 hi, hi, 0x000f000f, 0x64006400, 0xea;
mov.b32 k, 0x64006400;
sub.f16x2 lo, lo, k;
sub.f16x2 hi, hi, k;
fma.rn.f16x2 $0, lo, $4, $6;
fma.rn.f16x2 $1, hi, $5, $7;
}""")


@triton.jit
def nibbles_times_f16(raw, shift, scale, offset):
    """The nibbles at `shift` (uint8, 0 or 4, equal in each run of four) of the bytes `raw` times
    `scale` plus `offset` (float16), in float16, four a step; the arguments of one shape."""
    args = [raw, shift, scale, offset]
    return tl.inline_asm_elementwise(
        NIBBLE_F16_ASM, "=r,=r,r,r,r,r,r,r", args, dtype=tl.float16, is_pure=True, pack=4
    )
