"""GGUF tensor naming, pure (no torch): which layer a tensor belongs to and its short name."""

from __future__ import annotations

from llmx.errors import LlmxError


def group_key(gguf_name: str) -> tuple[int | None, str]:
    """`blk.3.attn_q.weight` -> (3, "attn_q"); `blk.3.attn_q.bias` -> (3, "attn_q_bias");
    `output_norm.weight` -> (None, "output_norm")."""
    parts = gguf_name.split(".")
    layer = None
    if parts[0] == "blk":
        if len(parts) < 3 or not (parts[1].isascii() and parts[1].isdigit()):
            raise LlmxError(f"tensor name {gguf_name!r} does not parse: blk.N.NAME expected")
        layer, parts = int(parts[1]), parts[2:]
    if parts[-1] == "weight":
        parts = parts[:-1]
    return layer, "_".join(parts)
