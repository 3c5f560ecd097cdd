"""Random but valid tensor data of any GGML type, with a chosen standard deviation of the weights.

A synthetic model must run: activations have to stay finite through dozens of layers. Random bytes
are valid quantized codes for every supported type, but their fp16 scale fields (`d`, `dmin`, `m`)
would then be arbitrary halves, NaN and inf included. So each block is random bytes whose scale
fields are overwritten with +-s: one magnitude per tensor, chosen so the dequantized weights have
the requested standard deviation, and a random sign per field so every type is zero-mean (Q4_0's
codes alone average -0.5 d). Everything is vectorised over a chunk of blocks; a chunk is generated
by its own seeded `Generator`, so threads can fill chunks in parallel and the file stays reproducible.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from llmx.errors import LlmxError
from llmx.quant import QTYPES, QType, qtype

# Byte offsets of the fp16 scale fields inside one block, from the type table. Everything else in
# a block (codes, 6-bit sub-block scales, high bits) is valid as any byte value.
SCALE_FIELDS: dict[str, tuple[int, ...]] = {q.name: q.half_fields for q in QTYPES.values() if q.half_fields}
FLOAT_TYPES = ("F32", "F16", "BF16")


def can_generate(qt: QType) -> bool:
    """Whether random valid data of this type can be written (floats and the types in SCALE_FIELDS)."""
    return qt.name in FLOAT_TYPES or qt.name in SCALE_FIELDS


def chunk_rng(seed: int, *path: int) -> np.random.Generator:
    """An independent generator per (seed, tensor, chunk). SFC64: ~10x faster than PCG64 for raw bytes."""
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, *path])))


def random_data(qt: QType, n_elements: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """`n_elements` weights of type `qt` as raw uint8 bytes, zero-mean with standard deviation `std`."""
    if qt.name in FLOAT_TYPES:
        return _random_floats(qt.name, n_elements, std, rng)
    if qt.name not in SCALE_FIELDS:
        raise LlmxError(
            f"llmx cannot write random {qt.name} blocks; types it can write: "
            f"{', '.join(FLOAT_TYPES + tuple(SCALE_FIELDS))}"
        )
    if n_elements % qt.block_elems:
        raise LlmxError(f"{n_elements} weights are not whole {qt.name} blocks of {qt.block_elems}")
    return _random_blocks(qt, n_elements // qt.block_elems, std / unit_std(qt.name), rng).reshape(-1)


def constant_data(qt: QType, n_elements: int, value: float) -> np.ndarray:
    """`n_elements` copies of `value` in a float type, as raw bytes (norm weights 1.0, biases 0.0)."""
    if qt.name not in FLOAT_TYPES:
        raise LlmxError(f"a constant tensor must be F32, F16 or BF16, not {qt.name}")
    return _to_float_type(qt.name, np.full(n_elements, value, dtype=np.float32))


def _random_floats(name: str, n: int, std: float, rng: np.random.Generator) -> np.ndarray:
    values = rng.standard_normal(n, dtype=np.float32)
    values *= std
    return _to_float_type(name, values)


def _to_float_type(name: str, values: np.ndarray) -> np.ndarray:
    if name == "F32":
        return values.view(np.uint8)
    if name == "F16":
        return values.astype(np.float16).view(np.uint8)
    # BF16 is the top half of an f32 (truncation: exact for 0 and 1, harmless for random values).
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def _random_blocks(qt: QType, n_blocks: int, scale: float, rng: np.random.Generator) -> np.ndarray:
    """[n_blocks, block_bytes] uint8: random codes, every scale field set to +-scale."""
    # Whole 64-bit words are the fastest thing a Generator makes; the tail block padding is cut off.
    n_bytes = n_blocks * qt.block_bytes
    words = rng.integers(0, 2**64 - 1, -(-n_bytes // 8), dtype=np.uint64, endpoint=True)
    blocks = words.view(np.uint8)[:n_bytes].reshape(n_blocks, qt.block_bytes)
    magnitude = np.float16(scale)
    if not np.isfinite(magnitude) or magnitude == 0:
        raise LlmxError(f"a {qt.name} scale of {scale:g} does not fit in fp16; choose another std")
    for offset in SCALE_FIELDS[qt.name]:
        signs = rng.integers(0, 2, n_blocks, dtype=np.uint8).astype(np.float16) * 2 - 1
        blocks[:, offset : offset + 2].view(np.float16)[:, 0] = signs * magnitude
    return blocks


@cache
def unit_std(name: str) -> float:
    """Standard deviation of a type's dequantized weights when every scale field is +-1.

    Measured once per type on random blocks with gguf-py's reference dequantizer rather than derived
    by hand for each of the twelve layouts: one formula that cannot drift from the format.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qt = qtype(name)
    blocks = _random_blocks(qt, 4096, 1.0, chunk_rng(0, qt.ggml_id))
    values = dequantize(blocks, GGMLQuantizationType(qt.ggml_id))
    return float(np.std(values))
