"""Dequantization: the numpy reference equals gguf-py bit for bit, and the torch path equals the reference.

Inputs: hand-built known-answer blocks, random blocks (random bytes with sane fp16 scale fields), and
every tensor of the embedded SmolLM2 (and of Gemma 3 270M when installed; big tensors are subsampled
by rows, but every tensor is covered).
"""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from llmx.gguf import open_gguf
from llmx.quant import BY_NAME, QType, reference, torch_ops

QUANT_TYPES = [
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
]
# Byte offsets of each block's fp16 fields (d, and dmin/m where there is one), from ggml-common.h.
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
    "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}  # fmt: skip


def random_blocks(qt: QType, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random rows [rows, blocks_per_row * block_bytes] whose fp16 fields are finite, signed, varied."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, blocks_per_row, qt.block_bytes), dtype=np.uint8)
    for at in F16_FIELDS.get(qt.name, ()):
        d = rng.standard_normal((rows, blocks_per_row)) * 10.0 ** rng.integers(-4, 1, (rows, blocks_per_row))
        data[:, :, at : at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return data.reshape(rows, -1)


def float_rows(name: str, rows: int, cols: int) -> np.ndarray:
    """Raw bytes of a random F32/F16/BF16 matrix [rows, cols * itemsize]."""
    x = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    if name == "F16":
        return x.astype(np.float16).view(np.uint8)
    if name == "BF16":
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return x.view(np.uint8)


def gguf_py(data: np.ndarray, qt: QType) -> np.ndarray:
    out = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qt.ggml_id))
    return out.reshape(data.shape[0], -1)


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{np.sum(a != b)} values differ"


# --- the reference against gguf-py -----------------------------------------------------------------


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_reference_equals_gguf_py_on_random_blocks(name):
    qt = BY_NAME[name]
    data = random_blocks(qt, rows=48, blocks_per_row=3)
    assert_bits_equal(reference.dequantize(data, qt), gguf_py(data, qt))


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_reference_float_types(name):
    qt = BY_NAME[name]
    data = float_rows(name, 8, 64)
    expected = {"F32": lambda d: d.view(np.float32), "F16": lambda d: d.view(np.float16).astype(np.float32),
                "BF16": lambda d: gguf_py(d, qt)}[name](data)  # fmt: skip
    assert_bits_equal(reference.dequantize(data, qt), expected.reshape(8, 64))


def _block(*parts: bytes | np.ndarray) -> np.ndarray:
    return np.frombuffer(b"".join(bytes(p) for p in parts), dtype=np.uint8)[None, :]


def _f16(v: float) -> bytes:
    return np.float16(v).tobytes()


def test_known_answer_q4_0_and_q4_1():
    # byte j: low nibble = weight j, high nibble = weight j + 16
    qs = bytes((j % 16) | ((15 - j % 16) << 4) for j in range(16))
    codes = np.array([j % 16 for j in range(16)] + [15 - j % 16 for j in range(16)], np.float32)
    got = reference.dequantize(_block(_f16(0.5), qs), BY_NAME["Q4_0"])
    np.testing.assert_array_equal(got[0], 0.5 * (codes - 8))
    got = reference.dequantize(_block(_f16(0.25), _f16(-1.0), qs), BY_NAME["Q4_1"])
    np.testing.assert_array_equal(got[0], 0.25 * codes - 1.0)


def test_known_answer_q5_0_and_q8_0():
    qh = np.uint32(0x8000_0001).tobytes()  # high bit set for weights 0 and 31
    qs = bytes([0x21] * 16)  # low nibbles 1 (weights 0-15), high nibbles 2 (weights 16-31)
    expected = np.array([1] * 16 + [2] * 16) + np.array([16] + [0] * 30 + [16]) - 16
    got = reference.dequantize(_block(_f16(2.0), qh, qs), BY_NAME["Q5_0"])
    np.testing.assert_array_equal(got[0], 2.0 * expected)
    q8 = np.arange(-16, 16, dtype=np.int8)
    got = reference.dequantize(_block(_f16(-0.125), q8), BY_NAME["Q8_0"])
    np.testing.assert_array_equal(got[0], -0.125 * q8.astype(np.float32))


def test_known_answer_q4_k():
    # sub-block j < 4: scale = byte j & 63, min = byte j+4 & 63; j >= 4 takes 4 low bits from byte j+4
    # (scale: low nibble, min: high nibble) and 2 high bits from the top of bytes j-4 / j.
    sc = bytes([1, 2, 3, 4 | 0x40, 5, 6, 7, 8 | 0x80, 0x21, 0x43, 0x65, 0x87])
    scales = [1, 2, 3, 4, 1, 3, 5, 7 | 0x10]
    mins = [5, 6, 7, 8, 2, 4, 6, 8 | 0x20]
    qs = bytes([0x31] * 128)  # per 32-byte chunk: low nibbles (1) then high nibbles (3)
    got = reference.dequantize(_block(_f16(1.0), _f16(0.5), sc, qs), BY_NAME["Q4_K"])[0].reshape(8, 32)
    for j in range(8):
        np.testing.assert_array_equal(got[j], scales[j] * (1 if j % 2 == 0 else 3) - 0.5 * mins[j])


def test_known_answer_q6_k_and_iq4_nl():
    ql = bytes([0x5A] * 128)  # low 4 bits: 0xA for the first 64 of each 128, 0x5 for the next 64
    qh = bytes([0b11100100] * 64)  # 2-bit high parts 0, 1, 2, 3 for the four 32-weight quarters
    scales = np.arange(1, 17, dtype=np.int8)
    got = reference.dequantize(_block(ql, qh, scales, _f16(0.5)), BY_NAME["Q6_K"])[0].reshape(2, 4, 32)
    for half in range(2):
        for quarter in range(4):
            low = 0xA if quarter < 2 else 0x5
            q = low | (quarter << 4)
            sub = half * 8 + quarter * 2  # 16-weight sub-blocks
            np.testing.assert_array_equal(got[half, quarter, :16], 0.5 * scales[sub] * (q - 32))
            np.testing.assert_array_equal(got[half, quarter, 16:], 0.5 * scales[sub + 1] * (q - 32))
    got = reference.dequantize(_block(_f16(1.0), bytes([0xF0] * 16)), BY_NAME["IQ4_NL"])
    np.testing.assert_array_equal(got[0], [-127.0] * 16 + [113.0] * 16)


def _sample_rows(n_rows: int, limit: int = 48) -> np.ndarray:
    """All rows of small tensors; the first, last and a spread of rows of big ones."""
    if n_rows <= limit:
        return np.arange(n_rows)
    return np.unique(np.r_[0, n_rows - 1, np.random.default_rng(n_rows).choice(n_rows, limit - 2, False)])


def _model_tensors(path):
    mf = open_gguf(path)
    for info in mf.tensors.values():
        rows = info.data.reshape(-1, info.qtype.row_bytes(info.shape[-1]))
        yield info, rows[_sample_rows(rows.shape[0])]


def _check_model(path) -> set[str]:
    seen = set()
    for info, rows in _model_tensors(path):
        ours = reference.dequantize(rows, info.qtype)
        assert_bits_equal(ours, gguf_py(rows, info.qtype).reshape(ours.shape))
        assert_bits_equal(torch_ops.dequantize(torch.from_numpy(rows), info.qtype).numpy(), ours)
        seen.add(info.qtype.name)
    return seen


def test_every_smollm2_tensor(smollm2_path):
    assert _check_model(smollm2_path) == {"F32", "Q4_1", "Q8_0"}


def test_every_gemma3_tensor(gemma3_path):
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= _check_model(gemma3_path)


# --- the torch path against the reference ------------------------------------------------------------


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_torch_dequantize_equals_reference(name):
    qt = BY_NAME[name]
    data = random_blocks(qt, rows=40, blocks_per_row=2, seed=3)
    assert_bits_equal(
        torch_ops.dequantize(torch.from_numpy(data), qt).numpy(), reference.dequantize(data, qt)
    )


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_torch_dequantize_float_types(name):
    qt = BY_NAME[name]
    data = float_rows(name, 4, 32)
    assert_bits_equal(
        torch_ops.dequantize(torch.from_numpy(data), qt).numpy(), reference.dequantize(data, qt)
    )


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_codes_stay_in_their_declared_range(name):
    qt = BY_NAME[name]
    spec = torch_ops.CODES[qt.ggml_id]
    c = torch_ops.codes(torch.from_numpy(random_blocks(qt, rows=64, blocks_per_row=2, seed=4)), qt)
    assert spec.lo <= int(c.code.min()) and int(c.code.max()) <= spec.hi
    assert (c.offset is not None) == spec.has_offset and c.group == spec.group


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K", "IQ4_XS"])
def test_embedding_rows_are_exact(name):
    qt = BY_NAME[name]
    data = random_blocks(qt, rows=30, blocks_per_row=2, seed=5)
    ids = torch.tensor([7, 0, 29, 7])
    got = torch_ops.embedding_rows(torch.from_numpy(data), qt, 2 * qt.block_elems, ids)
    assert_bits_equal(got.numpy(), reference.dequantize(data[ids.numpy()], qt))


def test_reference_imports_no_torch():
    code = "import sys, llmx.quant.reference; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
