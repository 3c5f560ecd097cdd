"""Float rows to GGUF blocks in torch, for the KV cache types that are blocks (`KV_BLOCK_TYPES`).

The spec of the cache's quantize-on-store: the native CPU kernel (`cpu_blocks.c`) and the Triton
decode kernel (`llmx.kernels.decode_attention`) write the same bytes, and the tests hold both to it.
Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 follow `gguf.quants` (ggml-quants.c's reference rounding: the
bytes are equal); gguf-py has no IQ4_NL quantizer, so IQ4_NL follows llama.cpp's cache copy
(ggml-cuda's `quantize_f32_iq4_nl_block`): the scale of the largest magnitude, each weight to its
nearest level, then the scale refit by least squares weighted by the squared weights.
Dequantization is `torch_ops.dequantize`.
"""

from __future__ import annotations

import torch

from llmx.quant import QType
from llmx.quant.reference import IQ4_LEVELS


def quantize(x: torch.Tensor, qt: QType) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) -> uint8 [..., K / 32 * block_bytes], GGUF blocks of `qt`."""
    blocks = x.float().reshape(-1, 32)
    out = _QUANTIZERS[qt.name](blocks)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * qt.block_bytes)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as C's roundf (gguf's np_roundf; floor(|v| + 0.5) rounds
    0.49999997 up)."""
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _half(v: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> its fp16 bytes [n, 2]."""
    return v.to(torch.float16).view(torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes [n, 32] -> 16 bytes: byte j holds code j (low nibble) and code j + 16 (high)."""
    return (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """5-bit codes [n, 32] -> their fifth bits as a little-endian uint32 [n, 4 bytes] (Q5's qh)."""
    bits = ((q >> 4) & 1).reshape(-1, 4, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=q.device)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def _largest(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's value of the largest magnitude (the first of equals): [n, 1]."""
    return blocks.gather(1, blocks.abs().argmax(1, keepdim=True))


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks.abs().amax(1, keepdim=True) / 127
    qs = _roundf(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_half(d), qs], 1)


def _symmetric(blocks: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0/Q5_0's scale (the largest magnitude / -levels/2) and codes in [0, levels)."""
    d = _largest(blocks) / -(levels // 2)
    q = torch.trunc(blocks * _inverse(d) + (levels // 2 + 0.5)).clamp(0, levels - 1).to(torch.uint8)
    return d, q


def _affine(blocks: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1/Q5_1's scale ((max - min) / (levels - 1)), minimum and codes in [0, levels)."""
    lo, hi = blocks.amin(1, keepdim=True), blocks.amax(1, keepdim=True)
    d = (hi - lo) / (levels - 1)
    q = torch.trunc((blocks - lo) * _inverse(d) + 0.5).clamp(0, levels - 1).to(torch.uint8)
    return d, lo, q


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric(blocks, 16)
    return torch.cat([_half(d), _pack_nibbles(q)], 1)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, lo, q = _affine(blocks, 16)
    return torch.cat([_half(d), _half(lo), _pack_nibbles(q)], 1)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric(blocks, 32)
    return torch.cat([_half(d), _high_bits(q), _pack_nibbles(q)], 1)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, lo, q = _affine(blocks, 32)
    return torch.cat([_half(d), _half(lo), _high_bits(q), _pack_nibbles(q)], 1)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    levels = torch.from_numpy(IQ4_LEVELS).float().to(blocks.device)
    d = _largest(blocks) / levels[0]
    x = blocks * _inverse(d)
    # the nearest level; of two equally near, the upper one (ggml's best_index_int8)
    upper = torch.searchsorted(levels, x.contiguous(), right=True).clamp(1, 15)
    idx = torch.where(x - levels[upper - 1] < levels[upper] - x, upper - 1, upper)
    idx = torch.where(x <= levels[0], 0, torch.where(x >= levels[15], 15, idx))
    v, w = levels[idx], blocks * blocks
    sumqx, sumq2 = (w * v * blocks).sum(1, keepdim=True), (w * v * v).sum(1, keepdim=True)
    d = torch.where(sumq2 > 0, sumqx / sumq2, d)
    return torch.cat([_half(d), _pack_nibbles(idx.to(torch.uint8))], 1)


_QUANTIZERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "IQ4_NL": _iq4_nl}
KV_BLOCK_TYPES = tuple(_QUANTIZERS)  # all of 32-weight blocks
