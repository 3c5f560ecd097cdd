"""Reading KV-cache rows in Triton kernels, shared by the decode (`decode_attention`) and prompt
(`prefill_attention`) attention kernels: float rows in their dtype, or GGUF blocks (q8_0, q4_0,
q4_1, q5_0, q5_1, iq4_nl) in the grouped layout a GPU's cache holds (`llmx.quant.kv_layout`: each
head's scales, then its codes), dequantized as a tile is loaded, so a kernel needs no float copy of
the cache; `dequantized` makes one where a prompt's many query tiles would convert each key tile again
(`prefill_attention`).

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
from llmx.quant.triton.bits import nibbles_times_f16, q8_times_f16

TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# Compiled kernels read module globals only as tl.constexpr (Triton's interpreter reads any).
BLOCKS = {"Q8_0": (1, 34), "Q4_0": (2, 18), "IQ4_NL": (3, 18), "Q5_0": (4, 22), "Q5_1": (5, 24),
          "Q4_1": (6, 20)}  # fmt: skip
Q8_0, Q4_0, IQ4_NL, Q5_0, Q5_1, Q4_1 = (tl.constexpr(code) for code, _ in BLOCKS.values())


def codes(
    types: tuple[QType, QType] | None, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(code, block bytes) of K's and V's cache types (`types`: None for float caches); (0, 0) for a
    float type. Block caches [rows, Hk, head bytes] hold the grouped layout (`llmx.quant.kv_layout`)
    with a row's heads packed (`head_at`)."""
    if types is None:
        return (0, 0), (0, 0)
    for t, rows in zip(types, (k_cache, v_cache), strict=True):
        if t.name in BLOCKS:
            assert rows.stride(2) == 1 and rows.stride(1) == rows.shape[2], "a row's heads are not packed"
    k, v = (BLOCKS.get(t.name, (0, 0)) for t in types)
    return k, v


@cache
def levels(device: torch.device) -> torch.Tensor:
    """IQ4_NL's 16 levels as float32 on `device`, for the kernels to look codes up in."""
    return torch.from_numpy(IQ4_LEVELS).float().to(device)


def dequantized(rows: torch.Tensor, qt: QType, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Block-cache rows [N, Hk, head bytes] of type `qt` as float rows [N, Hk, d] of `dtype`: the
    values `load_rows` gives a kernel whose operands are of that type, so a kernel reading the copy
    computes what it would on the blocks."""
    n, n_kv = rows.shape[0], rows.shape[1]
    out = torch.empty(n, n_kv, d, dtype=dtype, device=rows.device)
    (code, block), _ = codes((qt, qt), rows, rows)
    block_n = 64 if rows.is_cuda else 16
    rows_kernel[(triton.cdiv(n, block_n), n_kv)](
        rows, out, levels(rows.device), rows.stride(0), n,
        D=d, QT=code, QB=block, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        DOT=TL_DTYPE[dtype],
    )  # fmt: skip
    return out


# --- kernels ------------------------------------------------------------------------------------


@triton.jit
def rows_kernel(
    rows_ptr, out_ptr, levels_ptr, stride_n, n_rows,
    D: tl.constexpr, QT: tl.constexpr, QB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    """`dequantized`: BLOCK_N rows of KV head program_id(1)."""
    tile, kvh = tl.program_id(0), tl.program_id(1)
    r = (tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]
    rmask = r < n_rows
    row_ptrs = rows_ptr + head_at(kvh, 0, D, QT, QB) + r * stride_n
    values = load_rows(row_ptrs, rmask, levels_ptr, D, QT, QB, BLOCK_D, DOT)
    d = tl.arange(0, BLOCK_D)[None, :]
    tl.store(out_ptr + (r * tl.num_programs(1) + kvh) * D + d, values, mask=rmask & (d < D))


@triton.jit
def dot(a, b, DOT: tl.constexpr):
    """a @ b accumulated in float32; float32 operands in full precision, not tf32."""
    a, b = a.to(DOT), b.to(DOT)
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


# --- cache blocks: the grouped layout (`llmx.quant.kv_layout`), read a head's row at a time ---------
# A head of NB = D / 32 blocks of QB bytes holds, field by field: the NB f16 scales d (byte 0), Q4_1's
# and Q5_1's NB f16 minimums m (byte 2 NB), Q5's NB fifth-bit words qh (4 bytes each, little-endian:
# bit j for value j; byte NB * (QB - 20)), then the codes (byte NB * (QB - 32) for Q8_0: D int8 in
# value order; NB * (QB - 16) for the others: each block's 16 bytes of nibbles, byte l holding value
# l low and value l + 16 high). A head starts at a multiple of its bytes, a constexpr (`head_at`),
# so the compiler knows how far the codes are aligned (Q8_0 at D = 128: 8 bytes) and loads a tile's
# codes as vectors, as it loads a float row.


@triton.jit
def head_at(kvh, stride, D: tl.constexpr, QT: tl.constexpr, QB: tl.constexpr):
    """Head `kvh`'s offset in a cache row: `stride` (the row's head stride) for a float cache; a
    block cache's heads are packed, kvh * D / 32 * QB, a multiple the compiler sees."""
    return kvh * stride if QT == 0 else kvh * (D // 32 * QB)


@triton.jit
def load_rows(
    row_ptrs, rmask, levels_ptr, D: tl.constexpr, QT: tl.constexpr, QB: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    """Values 0..D-1 of the cache rows at `row_ptrs` [BLOCK_N, 1] (a head's start in each row) where
    `rmask` [BLOCK_N, 1], as a [BLOCK_N, BLOCK_D] tile: for a block type dequantized (d * code (+ m),
    IQ4_NL's code its level) into DOT, the type it meets q in (q8_0 into float16 four codes at a time:
    `q8_times_f16`); else in the cache's dtype."""
    # One return at the end: Triton 3.6 compiles the statements after a constexpr branch's return
    # too, and refuses returns of different types (the cache's dtype, DOT).
    if QT == 0:
        d = tl.arange(0, BLOCK_D)[None, :]
        values = tl.load(row_ptrs + d, mask=rmask & (d < D), other=0.0)
    else:
        NB: tl.constexpr = D // 32
        nb = tl.arange(0, BLOCK_D // 32)[None, :]  # [1, BLOCK_D / 32]: the head's blocks
        bmask = rmask & (nb < NB)
        scale = _f16_fields(row_ptrs, 0, rmask, NB, BLOCK_D)
        rows3, nb3, bmask3 = row_ptrs[:, :, None], nb[:, :, None], bmask[:, :, None]  # [.., 1] by block
        if QT == Q8_0:  # [BLOCK_N, BLOCK_D / 32, 32]: value j of each block
            j = tl.arange(0, 32)[None, None, :]
            at = (2 * NB) + 32 * nb3 + j
            codes = tl.load((rows3 + at).to(tl.pointer_type(tl.int8)), mask=bmask3, other=0)
            if tl.float16 == DOT:  # a GPU's tensor cores: four codes at a time into two f16x2 words
                values = q8_times_f16(codes, scale[:, :, None].to(tl.float16))
            else:
                values = scale[:, :, None] * codes.to(tl.float32)
        else:  # [BLOCK_N, BLOCK_D / 32, 2, 16]: value 16h + l of each block, byte l's nibble h
            h = tl.arange(0, 2)[None, None, :, None]
            l = tl.arange(0, 16)[None, None, None, :]
            at = (NB * (QB - 16)) + 16 * nb3[:, :, :, None] + l
            raw = tl.load(rows3[:, :, :, None] + at, mask=bmask3[:, :, :, None], other=0)
            nibbles = raw.to(tl.int32)
            codes = (nibbles >> (4 * h)) & 15
            if QT >= Q5_0 and QT <= Q5_1:  # bit 16h + l of the block's qh word is the value's fifth
                k = tl.arange(0, 4)[None, None, :]
                qh_bytes = tl.load(rows3 + (NB * (QB - 20)) + 4 * nb3 + k, mask=bmask3, other=0)
                qh = tl.sum(qh_bytes.to(tl.int32) << (8 * k), 2)[:, :, None, None]
                codes |= ((qh >> (16 * h + l)) & 1) << 4
            scale = scale[:, :, None, None]
            if QT == IQ4_NL:
                values = scale * tl.load(levels_ptr + codes)
            elif QT == Q4_0 and tl.float16 == DOT:  # four codes at a time into two f16x2 words
                shape: tl.constexpr = (raw.shape[0], raw.shape[1], 2, 16)
                shift = tl.broadcast_to((4 * h).to(tl.uint8), shape)
                d = scale.to(tl.float16)  # (code - 8) * d as code * d - 8 d: -8 d is exact, one rounding
                d, minus_8d = tl.broadcast_to(d, shape), tl.broadcast_to(-8.0 * d, shape)
                values = nibbles_times_f16(tl.broadcast_to(raw, shape), shift, d, minus_8d)
            elif QT == Q4_0:
                values = scale * (codes - 8).to(tl.float32)
            elif QT == Q5_0:
                values = scale * (codes - 16).to(tl.float32)
            else:
                m = _f16_fields(row_ptrs, 2 * NB, rmask, NB, BLOCK_D)
                values = scale * codes.to(tl.float32) + m[:, :, None, None]
        values = tl.reshape(values, (row_ptrs.shape[0], BLOCK_D)).to(DOT)
    return values


@triton.jit
def _f16_fields(row_ptrs, first: tl.constexpr, rmask, NB: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BLOCK_N, BLOCK_D / 32] float32: the NB f16 fields (a block's scale, or minimum) from byte
    `first` of the heads at `row_ptrs` [BLOCK_N, 1] where `rmask`, 0 past NB. With NB even a head
    is 4-byte aligned (`head_at`) and they are read as NB / 2 32-bit words, each placed by selects
    (no reshape, which kept the compiler from pipelining the step's loads): loads of 4 bytes or more
    are the ones it pipelines through cp.async, where 2-byte loads would wait in every loop step."""
    nb = tl.arange(0, BLOCK_D // 32)[None, :]
    if NB % 2 == 0:
        fields = tl.zeros((row_ptrs.shape[0], BLOCK_D // 32), tl.float16)
        for w in tl.static_range(NB // 2):
            word = tl.load((row_ptrs + first + 4 * w).to(tl.pointer_type(tl.int32)), mask=rmask, other=0)
            low = (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
            high = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True)
            fields = tl.where(nb == 2 * w, low, tl.where(nb == 2 * w + 1, high, fields))
    else:
        ptrs = (row_ptrs + first + 2 * nb).to(tl.pointer_type(tl.float16))
        fields = tl.load(ptrs, mask=rmask & (nb < NB), other=0.0)
    return fields.to(tl.float32)
