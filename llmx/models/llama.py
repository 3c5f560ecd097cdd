"""Llama (also SmolLM2, Mistral, Llama 2/3, and Mixtral): pre-norm blocks of grouped-query attention
and SwiGLU, or in Mixtral a SwiGLU per routed expert.

h = x + W_o · attn(rope(W_q · norm(x)), rope(W_k · norm(x)), W_v · norm(x))
y = h + W_down · (silu(W_gate · norm(h)) * W_up · norm(h))
Mixtral: y = h + sum over the top k experts e: p_e · W_down,e · (silu(W_gate,e · norm(h)) * W_up,e · norm(h))
         p = softmax(W_router · norm(h)), renormalised over the top k (`Model.routed_experts`).
"""

from __future__ import annotations

import torch

from llmx.models.common import Model, Step, TensorGroup
from llmx.ops import LayerKV, add_rms_norm, linear, rms_norm, swiglu


class Llama(Model):
    neox_rope = False  # llama GGUFs permute Q/K for GGML's adjacent-pair rotation

    def block(self, i: int, w: TensorGroup, x: torch.Tensor, step: Step, cache_kv: LayerKV) -> torch.Tensor:
        h, normed = self.attend(w, x, step, cache_kv)
        if self.config.n_expert:  # Mixtral's GGUFs say "llama" and hold stacked experts
            return self.routed_experts(w, normed, h)
        return swiglu(normed, w.ffn_gate, w.ffn_up, w.ffn_down, residual=h)

    def attend(
        self, w: TensorGroup, x: torch.Tensor, step: Step, cache_kv: LayerKV
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention half of the block: h = x + attention, and norm(h), the FFN's input."""
        eps = self.config.norm_eps
        attn = self.self_attention(w, rms_norm(x, w.attn_norm, eps), step, cache_kv)
        return add_rms_norm(x, linear(attn, w.attn_output), w.ffn_norm, eps)


MODEL = Llama
