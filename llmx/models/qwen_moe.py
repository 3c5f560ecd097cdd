"""Qwen2-MoE and Qwen3-MoE: Qwen's attention (`models.qwen`), and a feed-forward of routed experts.

h = x + attention(norm(x))                        (Qwen2: q/k/v biases; Qwen3: per-head q/k RMSNorm)
p = softmax(W_router · norm(h)), the top k experts e kept: Qwen3-MoE renormalises their p_e to sum
    to 1, Qwen2-MoE does not (`ModelConfig.expert_weights_norm`, llama.cpp's choice per architecture)
y = h + sum_e p_e · W_down,e · (silu(W_gate,e · norm(h)) * W_up,e · norm(h))
Qwen2-MoE adds a shared expert that every token takes, gated per token by a sigmoid:
    + sigmoid(w_shared_gate · norm(h)) · W_down,s · (silu(W_gate,s · norm(h)) * W_up,s · norm(h))
"""

from __future__ import annotations

import torch

from llmx.model_config import ModelConfig
from llmx.models.common import Step, TensorGroup
from llmx.models.qwen import Qwen
from llmx.ops import LayerKV, shared_expert

SHARED_EXPERT = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


class QwenMoe(Qwen):
    @classmethod
    def layer_tensors(cls, config: ModelConfig) -> tuple[str, ...]:
        shared = SHARED_EXPERT if config.n_ff_shexp else ()
        return (*super().layer_tensors(config), *shared)

    def block(self, i: int, w: TensorGroup, x: torch.Tensor, step: Step, cache_kv: LayerKV) -> torch.Tensor:
        h, normed = self.attend(w, x, step, cache_kv)
        y = self.routed_experts(w, normed, h)
        if self.config.n_ff_shexp:
            shared = (w.ffn_gate_inp_shexp, w.ffn_gate_shexp, w.ffn_up_shexp, w.ffn_down_shexp)
            y = shared_expert(normed, *shared, residual=y)
        return y


MODEL = QwenMoe
