"""Llama (also SmolLM2, Mistral, Llama 2/3): pre-norm blocks of grouped-query attention and SwiGLU.

h = x + W_o · attn(rope(W_q · norm(x)), rope(W_k · norm(x)), W_v · norm(x))
y = h + W_down · (silu(W_gate · norm(h)) * W_up · norm(h))
"""

from __future__ import annotations

import torch

from llmx.models.common import Model, Step, TensorGroup
from llmx.ops import LayerKV, add_rms_norm, linear, rms_norm, swiglu


class Llama(Model):
    neox_rope = False  # llama GGUFs permute Q/K for GGML's adjacent-pair rotation

    def block(self, i: int, w: TensorGroup, x: torch.Tensor, step: Step, cache_kv: LayerKV) -> torch.Tensor:
        eps = self.config.norm_eps
        attn = self.self_attention(w, rms_norm(x, w.attn_norm, eps), step, cache_kv)
        h, normed = add_rms_norm(x, linear(attn, w.attn_output), w.ffn_norm, eps)
        return swiglu(normed, w.ffn_gate, w.ffn_up, w.ffn_down, residual=h)


MODEL = Llama
