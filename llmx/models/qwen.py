"""Qwen2 and Qwen3: Llama's block with NeoX-style RoPE; Qwen2 adds q/k/v biases, Qwen3 per-head q/k RMSNorm.

Both differences live in the shared pieces (`Model.qkv` adds biases when the file has them,
`Model.head_norms` normalizes when it has `attn_q_norm`/`attn_k_norm`), so the block is Llama's.
"""

from __future__ import annotations

from llmx.models.llama import Llama


class Qwen(Llama):
    neox_rope = True


MODEL = Qwen
