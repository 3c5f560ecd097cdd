"""numpy reference dequantization: the spec every other kernel is tested against.

One small function per GGML type turns raw blocks [n_blocks, block_bytes] (uint8) into weights
[n_blocks, block_elems] (float32). The arithmetic is done in the same order as gguf-py's
`gguf.quants.dequantize` (e.g. `(d * sc) * q - dmin * m`, never fused), so results are bit-exact
against it. Block layouts follow ggml-common.h (`block_q4_0` ... `block_iq4_xs`). Pure numpy: no torch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from llmx.errors import LlmxError
from llmx.quant import BY_NAME, QType

BlockFn = Callable[[np.ndarray], np.ndarray]
DEQUANT: dict[int, BlockFn] = {}  # GGML type id -> blocks [n, block_bytes] -> float32 [n, block_elems]

# The 16 non-linear levels shared by IQ4_NL and IQ4_XS (kvalues_iq4nl in ggml-common.h).
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def dequantize(data: np.ndarray, qt: QType) -> np.ndarray:
    """Raw bytes [..., row_bytes] (uint8) of type `qt` -> float32 [..., n_cols].

    n_cols = row_bytes / block_bytes * block_elems; float types take their bytes too.
    """
    fn = DEQUANT.get(qt.ggml_id)
    if fn is None:
        raise LlmxError(f"no dequantization for GGML type {qt.name}")
    data = np.ascontiguousarray(data).view(np.uint8)
    if data.shape[-1] % qt.block_bytes:
        raise LlmxError(
            f"{qt.name} rows of {data.shape[-1]} bytes are not whole {qt.block_bytes}-byte blocks"
        )
    lead = data.shape[:-1]
    out = fn(data.reshape(-1, qt.block_bytes))
    return out.reshape(*lead, data.shape[-1] // qt.block_bytes * qt.block_elems)


def _spec(name: str) -> Callable[[BlockFn], BlockFn]:
    def register(fn: BlockFn) -> BlockFn:
        DEQUANT[BY_NAME[name].ggml_id] = fn
        return fn

    return register


# --- field readers -----------------------------------------------------------------------------


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of each block, widened to float32: [n, 1]."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Bytes [n, b] -> 4-bit codes [n, 2b]: per `chunk` bytes, their low nibbles then their high nibbles."""
    n = qs.shape[0]
    split = qs.reshape(n, -1, 1, chunk) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (split & 0x0F).reshape(n, -1)


def _crumbs(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Bytes [n, b] -> 2-bit codes [n, 4b]: per `chunk` bytes, bits 0-1 of each, then 2-3, 4-5, 6-7."""
    n = qs.shape[0]
    split = qs.reshape(n, -1, 1, chunk) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (split & 0x03).reshape(n, -1)


def _le_bits(qh: np.ndarray) -> np.ndarray:
    """Bytes [n, b] -> bits [n, 8b]: bit i of the little-endian integer they form (Q5_0/Q5_1's qh)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _bit_planes(qh: np.ndarray) -> np.ndarray:
    """Bytes [n, b] -> bits [n, 8b]: bit 0 of every byte, then bit 1 of every byte, ... (K-quant qh)."""
    n = qh.shape[0]
    return ((qh.reshape(n, 1, -1) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(n, -1)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes -> eight 6-bit scales and eight 6-bit mins, each [n, 8] uint8.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for
    the mins; bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return scales, mins


def _groups(x: np.ndarray, n_groups: int) -> np.ndarray:
    """[n, E] codes -> float32 [n, n_groups, E / n_groups], ready to meet a scale [n, n_groups, 1]."""
    return x.reshape(x.shape[0], n_groups, -1).astype(np.float32)


# --- float types --------------------------------------------------------------------------------


@_spec("F32")
def _f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.copy().view(np.float32)


@_spec("F16")
def _f16_type(blocks: np.ndarray) -> np.ndarray:
    return blocks.copy().view(np.float16).astype(np.float32)


@_spec("BF16")
def _bf16(blocks: np.ndarray) -> np.ndarray:
    # bf16 is the top half of a float32
    return (blocks.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# --- legacy 32-weight blocks: d (and m) fp16, then codes ------------------------------------------


@_spec("Q4_0")
def _q4_0(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 2:18], 16).astype(np.int8) - np.int8(8)
    return _f16(blocks, 0) * q.astype(np.float32)


@_spec("Q4_1")
def _q4_1(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 4:20], 16).astype(np.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


@_spec("Q5_0")
def _q5_0(blocks: np.ndarray) -> np.ndarray:
    q = (_nibbles(blocks[:, 6:22], 16) | (_le_bits(blocks[:, 2:6]) << 4)).astype(np.int8) - np.int8(16)
    return _f16(blocks, 0) * q.astype(np.float32)


@_spec("Q5_1")
def _q5_1(blocks: np.ndarray) -> np.ndarray:
    q = (_nibbles(blocks[:, 8:24], 16) | (_le_bits(blocks[:, 4:8]) << 4)).astype(np.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


@_spec("Q8_0")
def _q8_0(blocks: np.ndarray) -> np.ndarray:
    return blocks[:, 2:34].view(np.int8).astype(np.float32) * _f16(blocks, 0)


@_spec("IQ4_NL")
def _iq4_nl(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, 0) * IQ4_LEVELS[_nibbles(blocks[:, 2:18], 16)].astype(np.float32)


# --- K-quants: 256-weight super-blocks with 6-bit (Q4_K, Q5_K) or 4/8-bit sub-block scales -------


@_spec("Q2_K")
def _q2_k(blocks: np.ndarray) -> np.ndarray:
    # scales[16] (low nibble: scale, high nibble: min, per 16 weights), qs[64], d, dmin
    sc = blocks[:, 0:16]
    dl = (_f16(blocks, 80) * (sc & 0x0F).astype(np.float32))[..., None]
    ml = (_f16(blocks, 82) * (sc >> 4).astype(np.float32))[..., None]
    return (dl * _groups(_crumbs(blocks[:, 16:80], 32), 16) - ml).reshape(len(blocks), -1)


@_spec("Q3_K")
def _q3_k(blocks: np.ndarray) -> np.ndarray:
    # hmask[32], qs[64], scales[12] (sixteen 6-bit scales biased by 32), d
    packed = blocks[:, 96:108]
    low = _nibbles(packed[:, 0:8], 8)
    high = _crumbs(packed[:, 8:12], 4)
    sc = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    dl = (_f16(blocks, 108) * sc)[..., None]
    # a clear high bit means "subtract 4": the 3-bit code is q2 - 4 * (1 - h)
    minus4 = ((_bit_planes(blocks[:, 0:32]) ^ 1) << 2).astype(np.int8)
    q = _crumbs(blocks[:, 32:96], 32).astype(np.int8) - minus4
    return (dl * _groups(q, 16)).reshape(len(blocks), -1)


@_spec("Q4_K")
def _q4_k(blocks: np.ndarray) -> np.ndarray:
    # d, dmin, scales[12], qs[128]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = (_f16(blocks, 0) * sc.astype(np.float32))[..., None]
    ml = (_f16(blocks, 2) * mn.astype(np.float32))[..., None]
    return (dl * _groups(_nibbles(blocks[:, 16:144], 32), 8) - ml).reshape(len(blocks), -1)


@_spec("Q5_K")
def _q5_k(blocks: np.ndarray) -> np.ndarray:
    # d, dmin, scales[12], qh[32], qs[128]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = (_f16(blocks, 0) * sc.astype(np.float32))[..., None]
    ml = (_f16(blocks, 2) * mn.astype(np.float32))[..., None]
    q = _nibbles(blocks[:, 48:176], 32) | (_bit_planes(blocks[:, 16:48]) << 4)
    return (dl * _groups(q, 8) - ml).reshape(len(blocks), -1)


@_spec("Q6_K")
def _q6_k(blocks: np.ndarray) -> np.ndarray:
    # ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d
    codes = _nibbles(blocks[:, 0:128], 64) | (_crumbs(blocks[:, 128:192], 32) << 4)
    q = codes.astype(np.int8) - np.int8(32)
    dl = (_f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32))[..., None]
    return (dl * _groups(q, 16)).reshape(len(blocks), -1)


@_spec("IQ4_XS")
def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    # d, scales_h (u16: 2 high bits per sub-block), scales_l[4] (4 low bits), qs[128]
    sc = (_nibbles(blocks[:, 4:8], 1) | (_crumbs(blocks[:, 2:4], 1) << 4)).astype(np.int8) - np.int8(32)
    dl = (_f16(blocks, 0) * sc.astype(np.float32))[..., None]
    levels = IQ4_LEVELS[_nibbles(blocks[:, 8:136], 16)]
    return (dl * _groups(levels, 8)).reshape(len(blocks), -1)
