"""Torch dequantization of raw GGUF rows, on any device: the CPU fallback and the GPU "emulated" path.

Every quantized type llmx computes is affine per group of 16 or 32 weights:

    w = scale * code (+ offset)

with an integer `code` that fits int8 (the IQ4 types' code is their non-linear level). `codes(raw, qt)`
unpacks raw blocks into that form and `dequantize` evaluates it in the same float32 operation order
as `reference.py`, so the results are bit-exact. The CPU repacker (`cpu_pack.py`) builds its int4
planes from the same `Codes`, so one unpacker per type serves both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmx.errors import LlmxError
from llmx.quant import BY_NAME, QType
from llmx.quant.reference import IQ4_LEVELS

FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass
class Codes:
    """Weights as `scale * code (+ offset)`, one scale/offset per `group` consecutive weights of a row.

    code:   int8 [rows, K]
    scale:  float32 [rows, K / group]
    offset: float32 [rows, K / group], or None for symmetric types
    """

    code: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, K]: scale * code, then + offset (never fused, to match the reference)."""
        rows, k = self.code.shape
        w = self.scale.unsqueeze(-1) * self.code.view(rows, -1, self.group).float()
        if self.offset is not None:
            w = w + self.offset.unsqueeze(-1)
        return w.view(rows, k)


# What one type's unpacker returns for blocks [n, block_bytes]:
# code int8 [n, block_elems], scale float32 [n, groups per block], offset (same) or None
Unpacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
Unpack = Callable[[torch.Tensor], Unpacked]


@dataclass(frozen=True)
class CodeSpec:
    """How one type unpacks, its scale group (weights per scale), its code range [lo, hi] and whether
    it has an offset (a per-group minimum)."""

    unpack: Unpack
    group: int
    lo: int
    hi: int
    has_offset: bool


CODES: dict[int, CodeSpec] = {}  # GGML type id -> its unpacker


def codes(raw: torch.Tensor, qt: QType) -> Codes:
    """Raw rows [rows, row_bytes] uint8 -> Codes with code [rows, K]."""
    spec = CODES.get(qt.ggml_id)
    if spec is None:
        raise LlmxError(f"no torch unpacker for GGML type {qt.name}")
    rows, row_bytes = raw.shape
    code, scale, offset = spec.unpack(raw.reshape(-1, qt.block_bytes))
    k = row_bytes // qt.block_bytes * qt.block_elems
    offset = None if offset is None else offset.reshape(rows, -1)
    return Codes(code.reshape(rows, k), scale.reshape(rows, -1), offset, spec.group)


def dequantize(raw: torch.Tensor, qt: QType) -> torch.Tensor:
    """Raw rows [rows, row_bytes] uint8 (or a float tensor for F32/F16/BF16) -> float32 [rows, K]."""
    if raw.is_floating_point():
        return raw.float()
    if qt.name in FLOAT_DTYPES:
        return raw.contiguous().view(FLOAT_DTYPES[qt.name]).float()
    return codes(raw.contiguous(), qt).dequantize()


def embedding_rows(raw: torch.Tensor, qt: QType, n_cols: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a table stored as raw rows [rows, row_bytes] -> float32 [len(ids), n_cols].

    Only the requested rows are read (the rest of an mmap-backed table stays untouched).
    """
    picked = raw.index_select(0, ids.reshape(-1).to(device=raw.device, dtype=torch.long))
    out = dequantize(picked, qt)
    if out.shape[-1] != n_cols:
        raise LlmxError(f"{qt.name} table rows hold {out.shape[-1]} values, expected {n_cols}")
    return out


def _spec(name: str, group: int, lo: int, hi: int, has_offset: bool = False) -> Callable[[Unpack], Unpack]:
    def register(fn: Unpack) -> Unpack:
        CODES[BY_NAME[name].ggml_id] = CodeSpec(fn, group, lo, hi, has_offset)
        return fn

    return register


# --- field readers (the torch twins of reference.py's) -------------------------------------------


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block, widened to float32: [n, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """Bytes [n, b] -> 4-bit codes [n, 2b]: per `chunk` bytes, their low nibbles then their high nibbles."""
    q = qs.reshape(qs.shape[0], -1, chunk)
    return torch.stack((q & 0x0F, q >> 4), dim=2).reshape(qs.shape[0], -1)


def _crumbs(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """Bytes [n, b] -> 2-bit codes [n, 4b]: per `chunk` bytes, bits 0-1 of each, then 2-3, 4-5, 6-7."""
    q = qs.reshape(qs.shape[0], -1, chunk)
    return torch.stack([(q >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).reshape(qs.shape[0], -1)


def _le_bits(qh: torch.Tensor) -> torch.Tensor:
    """Bytes [n, b] -> bits [n, 8b]: bit i of the little-endian integer they form (Q5_0/Q5_1's qh)."""
    return torch.stack([(qh >> i) & 1 for i in range(8)], dim=-1).reshape(qh.shape[0], -1)


def _bit_planes(qh: torch.Tensor) -> torch.Tensor:
    """Bytes [n, b] -> bits [n, 8b]: bit 0 of every byte, then bit 1 of every byte, ... (K-quant qh)."""
    return torch.stack([(qh >> i) & 1 for i in range(8)], dim=1).reshape(qh.shape[0], -1)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> eight 6-bit scales and eight 6-bit mins as float32 [n, 8]."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=-1)
    mins = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=-1)
    return scales.float(), mins.float()


def _signed(codes: torch.Tensor, bias: int) -> torch.Tensor:
    """Unsigned codes (uint8) minus `bias`, as int8."""
    return codes.to(torch.int8) - bias


def _levels(idx: torch.Tensor) -> torch.Tensor:
    """4-bit indices -> the IQ4 non-linear levels (int8)."""
    return torch.from_numpy(IQ4_LEVELS).to(idx.device)[idx.long()]


# --- legacy 32-weight blocks ---------------------------------------------------------------------


@_spec("Q4_0", 32, -8, 7)
def _q4_0(b: torch.Tensor) -> Unpacked:
    return _signed(_nibbles(b[:, 2:18], 16), 8), _f16(b, 0), None


@_spec("Q4_1", 32, 0, 15, has_offset=True)
def _q4_1(b: torch.Tensor) -> Unpacked:
    return _nibbles(b[:, 4:20], 16).to(torch.int8), _f16(b, 0), _f16(b, 2)


@_spec("Q5_0", 32, -16, 15)
def _q5_0(b: torch.Tensor) -> Unpacked:
    q = _nibbles(b[:, 6:22], 16) | (_le_bits(b[:, 2:6]) << 4)
    return _signed(q, 16), _f16(b, 0), None


@_spec("Q5_1", 32, 0, 31, has_offset=True)
def _q5_1(b: torch.Tensor) -> Unpacked:
    q = _nibbles(b[:, 8:24], 16) | (_le_bits(b[:, 4:8]) << 4)
    return q.to(torch.int8), _f16(b, 0), _f16(b, 2)


@_spec("Q8_0", 32, -128, 127)
def _q8_0(b: torch.Tensor) -> Unpacked:
    return b[:, 2:34].contiguous().view(torch.int8), _f16(b, 0), None


@_spec("IQ4_NL", 32, -127, 113)
def _iq4_nl(b: torch.Tensor) -> Unpacked:
    return _levels(_nibbles(b[:, 2:18], 16)), _f16(b, 0), None


# --- K-quants ------------------------------------------------------------------------------------


@_spec("Q2_K", 16, 0, 3, has_offset=True)
def _q2_k(b: torch.Tensor) -> Unpacked:
    sc = b[:, 0:16]
    scale = _f16(b, 80) * (sc & 0x0F).float()
    offset = -(_f16(b, 82) * (sc >> 4).float())
    return _crumbs(b[:, 16:80], 32).to(torch.int8), scale, offset


@_spec("Q3_K", 16, -4, 3)
def _q3_k(b: torch.Tensor) -> Unpacked:
    packed = b[:, 96:108]
    sc = _signed(_nibbles(packed[:, 0:8], 8) | (_crumbs(packed[:, 8:12], 4) << 4), 32)
    minus4 = ((_bit_planes(b[:, 0:32]) ^ 1) << 2).to(torch.int8)
    return _crumbs(b[:, 32:96], 32).to(torch.int8) - minus4, _f16(b, 108) * sc.float(), None


@_spec("Q4_K", 32, 0, 15, has_offset=True)
def _q4_k(b: torch.Tensor) -> Unpacked:
    sc, mn = _k_scale_min(b[:, 4:16])
    code = _nibbles(b[:, 16:144], 32).to(torch.int8)
    return code, _f16(b, 0) * sc, -(_f16(b, 2) * mn)


@_spec("Q5_K", 32, 0, 31, has_offset=True)
def _q5_k(b: torch.Tensor) -> Unpacked:
    sc, mn = _k_scale_min(b[:, 4:16])
    code = (_nibbles(b[:, 48:176], 32) | (_bit_planes(b[:, 16:48]) << 4)).to(torch.int8)
    return code, _f16(b, 0) * sc, -(_f16(b, 2) * mn)


@_spec("Q6_K", 16, -32, 31)
def _q6_k(b: torch.Tensor) -> Unpacked:
    code = _signed(_nibbles(b[:, 0:128], 64) | (_crumbs(b[:, 128:192], 32) << 4), 32)
    scale = _f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()
    return code, scale, None


@_spec("IQ4_XS", 32, -127, 113)
def _iq4_xs(b: torch.Tensor) -> Unpacked:
    sc = _signed(_nibbles(b[:, 4:8], 1) | (_crumbs(b[:, 2:4], 1) << 4), 32)
    return _levels(_nibbles(b[:, 8:136], 16)), _f16(b, 0) * sc.float(), None
