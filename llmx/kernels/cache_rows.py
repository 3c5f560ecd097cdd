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


def codes(types: tuple[QType, QType] | None) -> tuple[tuple[int, int], tuple[int, int]]:
    """(code, block bytes) of K's and V's cache types (`types`: None for float caches); (0, 0) for a
    float type."""
    if types is None:
        return (0, 0), (0, 0)
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


@triton.jit
def f16_at(ptrs, mask):
    """The f16 fields at byte pointers `ptrs` (even offsets), as float32."""
    return tl.load(ptrs.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_rows(row_ptrs, d, mask, levels_ptr, QT: tl.constexpr, QB: tl.constexpr):
    """Values d of the cache rows at `row_ptrs` (a head's start in each row) as float32 (a block
    type's dequantized: d * code (+ m), IQ4_NL's code its level), or in the cache's dtype."""
    # One return at the end: Triton 3.6 compiles the statements after a constexpr branch's return
    # too, and refuses returns of different types (the cache's dtype, float32).
    if QT == 0:
        values = tl.load(row_ptrs + d, mask=mask, other=0.0)
    else:
        j = d % 32
        block = row_ptrs + (d // 32) * QB
        scale = f16_at(block, mask)
        if QT == Q8_0:
            codes = tl.load((block + 2 + j).to(tl.pointer_type(tl.int8)), mask=mask, other=0)
            values = scale * codes.to(tl.float32)
        else:
            nibbles = tl.load(block + (QB - 16) + j % 16, mask=mask, other=0).to(tl.int32)
            code = (nibbles >> ((j // 16) * 4)) & 15
            if QT >= Q5_0 and QT <= Q5_1:
                qh = tl.load(block + (QB - 20) + j // 8, mask=mask, other=0).to(tl.int32)
                code = code | (((qh >> (j % 8)) & 1) << 4)
            if QT == IQ4_NL:
                values = scale * tl.load(levels_ptr + code)
            elif QT == Q4_0:
                values = scale * (code - 8).to(tl.float32)
            elif QT == Q5_0:
                values = scale * (code - 16).to(tl.float32)
            else:
                values = scale * code.to(tl.float32) + f16_at(block + 2, mask)
    return values
