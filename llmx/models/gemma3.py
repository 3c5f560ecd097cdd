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
from dataclasses import dataclass, replace
from typing import Any, Self

import torch

from llmx.models.common import Config, Model, Step, TensorGroup
from llmx.ops import LayerKV, add_rms_norm, gelu_tanh, linear, linear_many, rms_norm
from llmx.plan.model import layer_window

LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62


@dataclass(frozen=True)
class Gemma3Config(Config):
    sliding_window: int = 0
    sliding_window_pattern: int = 6  # every 6th layer is global (llama.cpp's default for gemma3)

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], **extra: Any) -> Self:
        arch = meta["general.architecture"]
        return super().from_gguf(
            meta,
            sliding_window=int(meta.get(f"{arch}.attention.sliding_window", 0)),
            sliding_window_pattern=int(meta.get(f"{arch}.attention.sliding_window_pattern", 6)),
            **extra,
        )

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None for a global layer (the planner sizes its cache by
        the same rule)."""
        return layer_window(layer, self.sliding_window, self.sliding_window_pattern)

    @property
    def query_scale(self) -> float:
        """1/sqrt(query_pre_attn_scalar), which the GGUF does not store: Gemma 3 27B (62 layers) uses
        n_embd / n_head = 168 where its head_dim is 128; every other size uses head_dim. This is
        llama.cpp's rule (llama-model.cpp, LLM_ARCH_GEMMA3: f_attention_scale by model type)."""
        scalar = self.n_embd // self.n_head if self.n_layer == GEMMA3_27B_LAYERS else self.head_dim
        return 1.0 / math.sqrt(scalar)


class Gemma3(Model):
    config_class = Gemma3Config
    neox_rope = True
    config: Gemma3Config

    def __init__(self, config: Gemma3Config, top: TensorGroup, layers: list[TensorGroup]) -> None:
        super().__init__(config, top, layers)
        self.local_rope = replace(self.rope, base=LOCAL_ROPE_BASE, scale=1.0)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return super().embed(ids) * math.sqrt(self.config.n_embd)

    def block(self, i: int, w: TensorGroup, x: torch.Tensor, step: Step, cache_kv: LayerKV) -> torch.Tensor:
        eps, c = self.config.norm_eps, self.config
        window = c.window(i)
        rope = self.rope if window is None else self.local_rope
        h = rms_norm(x, w.attn_norm, eps)
        attn = self.self_attention(w, h, step, cache_kv, rope=rope, window=window, scale=c.query_scale)
        attn = rms_norm(linear(attn, w.attn_output), w.post_attention_norm, eps)
        x, h = add_rms_norm(x, attn, w.ffn_norm, eps)  # x + attn, and its norm
        gate, up = linear_many(h, [w.ffn_gate, w.ffn_up])
        ffn = linear(gelu_tanh(gate) * up, w.ffn_down)
        return x + rms_norm(ffn, w.post_ffw_norm, eps)


MODEL = Gemma3
