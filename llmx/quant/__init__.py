"""The GGML type table: one place that knows each type's block facts.

Per type: its id, weights and bytes a block, the weights that share one sub-block scale, and where
its fp16 fields (the block scales d, dmin, m) sit in a block. Pure (no torch): the GGUF reader, the
planner and the synthetic-model writer size tensors from here, and the kernels (`reference.py`'s
numpy spec, `torch_ops.py`, `cpu_native.py`, `triton/`) derive their per-type constants from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmx.errors import LlmxError


@dataclass(frozen=True)
class QType:
    """One GGML tensor type. `block_elems` weights are stored in `block_bytes` bytes."""

    name: str
    ggml_id: int
    block_elems: int
    block_bytes: int
    family: str  # "float", "legacy" (32-weight blocks), "k" (256-weight super-blocks), "iq"
    scale_group: int = 0  # weights that share one sub-block scale (0: float types, size-only types)
    half_fields: tuple[int, ...] = ()  # byte offsets of the block's fp16 fields (ggml-common.h's block_*)
    supported: bool = True  # False: known for sizing (planner, shapes) but not computed yet
    row_meta_bytes: int = 0  # ik_llama's *_KS types start every row with an f32 scale

    @property
    def is_float(self) -> bool:
        """F32/F16/BF16: stored as plain numbers, no blocks."""
        return self.family == "float" and self.supported

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_elems

    def row_bytes(self, n_cols: int) -> int:
        """Bytes of one row of `n_cols` weights; rows are whole blocks in GGUF."""
        if n_cols % self.block_elems:
            raise LlmxError(f"a {self.name} row needs a multiple of {self.block_elems} columns, got {n_cols}")
        return self.row_meta_bytes + n_cols // self.block_elems * self.block_bytes

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a tensor whose innermost (contiguous) dimension is shape[-1]."""
        rows = 1
        for d in shape[:-1]:
            rows *= d
        return rows * self.row_bytes(shape[-1])


_TABLE = [
    # name, ggml id, weights a block, bytes a block, family, weights a sub-block scale, fp16 fields
    ("F32", 0, 1, 4, "float"),
    ("F16", 1, 1, 2, "float"),
    ("BF16", 30, 1, 2, "float"),
    ("Q4_0", 2, 32, 18, "legacy", 32, (0,)),  # d, qs[16]
    ("Q4_1", 3, 32, 20, "legacy", 32, (0, 2)),  # d, m, qs[16]
    ("Q5_0", 6, 32, 22, "legacy", 32, (0,)),  # d, qh[4], qs[16]
    ("Q5_1", 7, 32, 24, "legacy", 32, (0, 2)),  # d, m, qh[4], qs[16]
    ("Q8_0", 8, 32, 34, "legacy", 32, (0,)),  # d, qs[32]
    ("Q2_K", 10, 256, 84, "k", 16, (80, 82)),  # scales[16], qs[64], d, dmin
    ("Q3_K", 11, 256, 110, "k", 16, (108,)),  # hmask[32], qs[64], scales[12], d
    ("Q4_K", 12, 256, 144, "k", 32, (0, 2)),  # d, dmin, scales[12], qs[128]
    ("Q5_K", 13, 256, 176, "k", 32, (0, 2)),  # d, dmin, scales[12], qh[32], qs[128]
    ("Q6_K", 14, 256, 210, "k", 16, (208,)),  # ql[128], qh[64], scales[16], d
    ("IQ4_NL", 20, 32, 18, "iq", 32, (0,)),  # d, qs[16]
    ("IQ4_XS", 23, 256, 136, "iq", 32, (0,)),  # d, scales_h, scales_l[4], qs[128]
]

# Types that real GGUF files carry but llmx cannot multiply yet: known so that files and shapes
# can be sized and planned, and so the error for them names the type instead of a number.
_SIZE_ONLY = [
    ("Q8_1", 9, 32, 40, "legacy"),
    ("Q8_K", 15, 256, 292, "k"),
    ("IQ2_XXS", 16, 256, 66, "iq"),
    ("IQ2_XS", 17, 256, 74, "iq"),
    ("IQ3_XXS", 18, 256, 98, "iq"),
    ("IQ1_S", 19, 256, 50, "iq"),
    ("IQ3_S", 21, 256, 110, "iq"),
    ("IQ2_S", 22, 256, 82, "iq"),
    ("I8", 24, 1, 1, "float"),
    ("I16", 25, 1, 2, "float"),
    ("I32", 26, 1, 4, "float"),
    ("I64", 27, 1, 8, "float"),
    ("F64", 28, 1, 8, "float"),
    ("IQ1_M", 29, 256, 56, "iq"),
    ("TQ1_0", 34, 256, 54, "k"),
    ("TQ2_0", 35, 256, 66, "k"),
    ("MXFP4", 39, 32, 17, "legacy"),
    # ik_llama.cpp types (ggml/include/ggml.h there): ubergarm's DeepSeek/Qwen MoE quants use them.
    ("IQ5_K", 140, 256, 176, "iq"),
    ("IQ4_KS", 144, 256, 136, "iq", 4),  # + f32 row scale: 4 bytes a row
    ("IQ4_KS_R4", 344, 256, 136, "iq", 4),
]

QTYPES: dict[int, QType] = {row[1]: QType(*row) for row in _TABLE} | {
    row[1]: QType(*row[:5], supported=False, row_meta_bytes=row[5] if len(row) > 5 else 0)
    for row in _SIZE_ONLY
}
BY_NAME: dict[str, QType] = {q.name: q for q in QTYPES.values()}

F32, F16, BF16 = BY_NAME["F32"], BY_NAME["F16"], BY_NAME["BF16"]
BLOCK_TYPES = tuple(q.name for q in QTYPES.values() if q.supported and not q.is_float)  # computed on blocks


def qtype(key: int | str) -> QType:
    """Look a type up by GGML id or by name (case-insensitive); unknown ones are a clear error."""
    found = QTYPES.get(key) if isinstance(key, int) else BY_NAME.get(str(key).upper())
    if found is None:
        known = ", ".join(q.name for q in QTYPES.values() if q.supported)
        raise LlmxError(f"unknown GGML tensor type {key!r}; llmx supports {known}")
    return found
