"""Gemma 3: sliding-window local layers beside global ones, GELU-gated FFN, norms before and after.

    x_0 = sqrt(E) · embed(ids)
    q, k, v = rope_l(qnorm(W_q · norm(x))), rope_l(knorm(W_k · norm(x))), W_v · norm(x)
    h   = x + post_attn_norm(W_o · attn(q, k, v))
    y   = h + post_ffw_norm(W_down · (gelu(W_gate · norm(h)) * W_up · norm(h)))

Every `sliding_window_pattern`-th layer is global (full context, the file's RoPE base and scaling);
the others see the last `sliding_window` tokens and rotate with base 10000, unscaled. Queries are
scaled by 1/sqrt(query_pre_attn_scalar) instead of 1/sqrt(head_dim) (see `query_scale`). The GGUF
converter already stores Gemma's norm weights as (1 + w), so the norms are plain RMSNorms here.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from llmx.model_config import ModelConfig
from llmx.models.common import Model, Step, TensorGroup
from llmx.ops import LayerKV, add_rms_norm, embedding, geglu, linear, rms_norm

LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62


def query_scale(config: ModelConfig) -> float:
    """1/sqrt(query_pre_attn_scalar), which the GGUF does not store: Gemma 3 27B (62 layers) uses
    n_embd / n_head = 168 where its head_dim is 128; every other size uses head_dim. This is
    llama.cpp's rule (llama-model.cpp, LLM_ARCH_GEMMA3: f_attention_scale by model type)."""
    if config.n_layer == GEMMA3_27B_LAYERS:
        return 1.0 / math.sqrt(config.n_embd // config.n_head)
    return 1.0 / math.sqrt(config.head_dim)


class Gemma3(Model):
    neox_rope = True

    @classmethod
    def layer_tensors(cls, config: ModelConfig) -> tuple[str, ...]:
        return (*super().layer_tensors(config), "post_attention_norm", "post_ffw_norm")

    def __init__(
        self, config: ModelConfig, top: TensorGroup, layers: list[TensorGroup], fused_moe: bool = True
    ) -> None:
        super().__init__(config, top, layers, fused_moe)
        self.local_rope = replace(self.rope, base=LOCAL_ROPE_BASE, scale=1.0)
        self.query_scale = query_scale(config)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.top.token_embd, scale=math.sqrt(self.config.n_embd))

    def block(self, i: int, w: TensorGroup, x: torch.Tensor, step: Step, cache_kv: LayerKV) -> torch.Tensor:
        eps, c = self.config.norm_eps, self.config
        window = c.window(i)
        rope = self.rope if window is None else self.local_rope
        h = rms_norm(x, w.attn_norm, eps)
        attn = self.self_attention(w, h, step, cache_kv, rope=rope, window=window, scale=self.query_scale)
        attn = rms_norm(linear(attn, w.attn_output), w.post_attention_norm, eps)
        x, h = add_rms_norm(x, attn, w.ffn_norm, eps)  # x + attn, and its norm
        ffn = geglu(h, w.ffn_gate, w.ffn_up, w.ffn_down)
        return rms_norm(ffn, w.post_ffw_norm, eps, residual=x)  # x + post_ffw_norm(ffn)


MODEL = Gemma3
