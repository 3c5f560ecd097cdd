"""Gemma 3: sliding-window local layers beside global ones, GELU-gated FFN, norms before and after.

    x_0 = sqrt(E) · embed(ids)
    q, k, v = rope_l(qnorm(W_q · norm(x))), rope_l(knorm(W_k · norm(x))), W_v · norm(x)
    h   = x + post_attn_norm(W_o · attn(q, k, v))
    y   = h + post_ffw_norm(W_down · (gelu(W_gate · norm(h)) * W_up · norm(h)))

Every `sliding_window_pattern`-th layer is global (full context, the file's RoPE base); the others
see the last `sliding_window` tokens and rotate with base 10000. The GGUF converter already stores
Gemma's norm weights as (1 + w), so the norms are plain RMSNorms here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Self

import torch

from llmx.models.common import Config, Model, Step
from llmx.ops import Rope, gelu_tanh, linear, rms_norm

LOCAL_ROPE_BASE = 10000.0


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

    def is_global(self, layer: int) -> bool:
        return self.sliding_window == 0 or (layer + 1) % self.sliding_window_pattern == 0


class Gemma3(Model):
    config_class = Gemma3Config
    neox_rope = True
    config: Gemma3Config

    def __init__(self, config, top, layers) -> None:
        super().__init__(config, top, layers)
        self.local_rope = replace(self.rope, base=LOCAL_ROPE_BASE, scale=1.0)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return super().embed(ids) * math.sqrt(self.config.n_embd)

    def rope_for(self, layer: int) -> Rope:
        return self.rope if self.config.is_global(layer) else self.local_rope

    def block(self, i: int, x: torch.Tensor, step: Step, cache_kv) -> torch.Tensor:
        w, eps, c = self.layers[i], self.config.norm_eps, self.config
        window = None if c.is_global(i) else c.sliding_window
        attn = self.self_attention(
            w, rms_norm(x, w.attn_norm, eps), step, cache_kv, window=window, rope=self.rope_for(i)
        )
        x = x + rms_norm(linear(attn, w.attn_output), w.post_attention_norm, eps)
        h = rms_norm(x, w.ffn_norm, eps)
        ffn = linear(gelu_tanh(linear(h, w.ffn_gate)) * linear(h, w.ffn_up), w.ffn_down)
        return x + rms_norm(ffn, w.post_ffw_norm, eps)


MODEL = Gemma3
