"""How the Triton kernels find a weight's blocks: the rows they read, and the one-time repack at load.

A weight reaches these kernels as `Blocks`: its GGUF rows (uint8 [N, row bytes]) on the GPU, its
type and shape. `prepare` may rearrange the rows once at load, in the same bytes a row: for the types
in SPLIT_TYPES, whose fp16 block fields leave their codes 2-byte aligned, each row's fields move
after its block bodies, so codes load as 16-byte vectors; Q4_K's 6-bit sub-block scales and mins are
regrouped by sub-block pair (`prepare_q4_k_scales`), so that the integer-dot GEMV takes a pair's four
apart with a few shifts. Every kernel reads both layouts exactly (`PACKED`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from llmx.errors import LlmxError
from llmx.quant import BLOCK_TYPES, QType, qtype
from llmx.quant.choice import DOT8_TYPES

# Types whose rows `prepare` splits into bodies, then fp16 fields. The unpack helpers read the same
# facts (their `block_parts` calls); the tests check they agree with `split_fields`.
SPLIT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q6_K")
PREPARED_TYPES = (*SPLIT_TYPES, "Q4_K")  # the types `prepare` repacks
TRITON_TYPES = BLOCK_TYPES  # every block type the GPU kernels unpack
ROW_ALIGN = 16  # bytes: `row_pitch`'s unit


class Blocks(Protocol):
    """What the kernels read of a weight (`llmx.quant.weight.QWeight` is one)."""

    raw: torch.Tensor  # uint8 [N, row bytes] GGUF rows, or a float tensor [N, K] for F32/F16/BF16
    qtype: QType
    shape: tuple[int, ...]  # (N, K)
    name: str
    packed: object | None  # SPLIT where `prepare` rearranged the rows


@dataclass(frozen=True)
class SplitFields:
    """`Blocks.packed` marker: rows are in `prepare`'s layout (bodies first, then fp16 fields;
    Q4_K: scales by sub-block pair)."""

    def describe(self) -> str:
        return "block scales rearranged for the Triton kernels (16-byte aligned codes)"


SPLIT = SplitFields()


def split_fields(name: str) -> tuple[int, int, bool]:
    """(bytes a block, fp16 fields a block, whether they open the block) of a SPLIT_TYPES type,
    from the type table (`llmx.quant`)."""
    qt = qtype(name)
    return qt.block_bytes, len(qt.half_fields), qt.half_fields[0] == 0


def prepare(w: Blocks) -> Blocks:
    """`w` with its rows repacked for these kernels where that helps, else `w` itself.

    For the SPLIT_TYPES each row of blocks [fields | body] (or [body | fields]) becomes
    [body 0 | body 1 | ... | fields of block 0 | fields of block 1 | ...]; Q4_K blocks keep their
    place and get their scale bytes regrouped (`prepare_q4_k_scales`). Either way the same row
    width, so sizes and offsets elsewhere do not change. Costs one copy of the tensor.
    """
    if w.qtype.name not in PREPARED_TYPES or w.packed is SPLIT:
        return w
    raw, name, _ = rows(w)
    if name == "Q4_K":
        packed = prepare_q4_k_scales(raw.reshape(raw.shape[0], -1, 144)).reshape(raw.shape)
    else:
        nbytes, nf, fields_first = split_fields(name)
        blocks = raw.reshape(raw.shape[0], -1, nbytes)
        cut = 2 * nf if fields_first else nbytes - 2 * nf
        head, tail = blocks[:, :, :cut], blocks[:, :, cut:]
        body, fields = (tail, head) if fields_first else (head, tail)
        packed = torch.cat([body.reshape(raw.shape[0], -1), fields.reshape(raw.shape[0], -1)], dim=1)
    out = copy.copy(w)
    out.raw, out.packed = packed, SPLIT
    return out


def prepare_q4_k_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks [..., 144] (uint8) with bytes 4-15, the 6-bit scales sc and mins m of sub-blocks
    0-7, regrouped by pair p = j // 2 (sub-blocks 2p and 2p + 1, which one quad of the integer-dot
    GEMV meets):
        byte 4 + 2p: low 4 bits of sc[2p] (bits 0-3) and sc[2p + 1] (bits 4-7)
        byte 5 + 2p: the same for m[2p] and m[2p + 1]
        byte 12 + p: their top 2 bits, sc[2p], sc[2p + 1], m[2p], m[2p + 1] at bits 0-1, 2-3, 4-5, 6-7
    (`kquants.paired_scale_min` reads them). The GGUF order (`kquants.k4_scale_min`) puts scales
    0-3 and 4-7 in different bytes and bits, which cost the GEMV ~30 instructions a quad."""
    s = blocks[..., 4:16]  # uint8 throughout: no value below exceeds a byte, and the load's transient
    lo, hi, mid = s[..., 0:4], s[..., 4:8], s[..., 8:12]  # memory stays a fraction of the tensor's
    sc = torch.cat([lo & 63, (mid & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([hi & 63, (mid >> 4) | ((hi >> 6) << 4)], dim=-1)
    sc0, sc1, mn0, mn1 = sc[..., 0::2], sc[..., 1::2], mn[..., 0::2], mn[..., 1::2]  # [..., pair]
    lows = torch.stack([(sc0 & 15) | ((sc1 & 15) << 4), (mn0 & 15) | ((mn1 & 15) << 4)], dim=-1)
    out = blocks.clone()
    out[..., 4:12] = lows.flatten(-2)
    out[..., 12:16] = (sc0 >> 4) | ((sc1 >> 4) << 2) | ((mn0 >> 4) << 4) | ((mn1 >> 4) << 6)
    return out


def row_pitch(name: str, row_bytes: int) -> int:
    """The distance in bytes between the rows of a stacked expert weight of type `name` on a GPU:
    rows of the integer-dot GEMV's types start 16 bytes apart (whole 16-byte units: its vector
    loads), so a row of an odd number of Q6_K super-blocks (Qwen3-30B-A3B's 768-weight down
    projection: 630 bytes) is followed by 10 bytes of padding; other types' rows are packed."""
    if name not in DOT8_TYPES:
        return row_bytes
    return -(-row_bytes // ROW_ALIGN) * ROW_ALIGN


def with_pitch(raw: torch.Tensor, pitch: int) -> torch.Tensor:
    """Rows raw [N, row bytes] (uint8) copied `pitch` bytes apart: a [N, row bytes] view of a new
    [N, pitch] tensor (raw itself where its rows are already so placed)."""
    n, row_bytes = raw.shape
    if raw.stride(0) == pitch:
        return raw
    out = torch.zeros((n, pitch), dtype=torch.uint8, device=raw.device)[:, :row_bytes]
    out.copy_(raw)
    return out


def word_rows(w: Blocks) -> bool:
    """Whether `w`'s rows are in `prepare`'s layout and start 4-byte aligned, as the integer-dot
    GEMV reads them (32-bit words; an even number of blocks a row for Q8_0)."""
    return w.packed is SPLIT and w.raw.stride(0) % 4 == 0 and w.raw.data_ptr() % 4 == 0


def rows(w: Blocks) -> tuple[torch.Tensor, str, bool]:
    """The raw [N, row_bytes] uint8 rows of `w`, checked; its type name; whether `prepare`d. A stacked
    expert tensor of shape (E, N, K) has E * N rows, expert e's from e * N on."""
    name = w.qtype.name
    if name not in TRITON_TYPES:
        raise LlmxError(f"{label(w)} has no Triton kernel; types with one: {', '.join(TRITON_TYPES)}")
    raw = w.raw
    *lead, k = w.shape
    n = math.prod(lead)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[0] != n or raw.stride(1) != 1:
        raise LlmxError(f"{label(w)}: raw blocks must be uint8 [{n}, row bytes] with contiguous rows")
    if raw.shape[1] != w.qtype.row_bytes(k):
        raise LlmxError(f"{label(w)}: {raw.shape[1]} bytes a row, {k} weights need {w.qtype.row_bytes(k)}")
    return raw, name, w.packed is SPLIT


def label(w: Blocks) -> str:
    return f"{w.name or 'weight'} ({w.qtype.name})"
