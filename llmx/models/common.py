"""What every architecture shares: the weight tree and the Model base (the config is `llmx.model_config`'s).

A model is three functions over token ids and a KV cache: `embed`, `block(i, w, ...)` and `head`.
The runtime walks the blocks, moving the hidden state to each block's device and handing each its
weights; models never name devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from llmx.errors import LlmxError
from llmx.model_config import ModelConfig
from llmx.ops import (
    HeadNorms,
    LayerKV,
    Rope,
    Yarn,
    causal_mask,
    embedding,
    linear,
    linear_many,
    moe_ffn,
    rms_norm,
    rope_attention,
    router,
)

# What every layer's block reads (biases and q/k norms are optional): attention, then a dense FFN or,
# in a model with experts, the router and the routed experts' stacks.
ATTENTION = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output")
DENSE_FFN = ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
ROUTED_FFN = ("ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SCALING_TYPES = ("none", "linear", "yarn")  # rope.scaling.type values `Rope` applies


def rope_of(c: ModelConfig, neox: bool, freq_factors: torch.Tensor | None) -> Rope:
    """The config's RoPE, its scaling included (`freq_factors`: the file's rope_freqs tensor)."""
    yarn = None
    if c.rope_scaling == "yarn":
        yarn = Yarn(
            c.rope_ctx_orig, c.yarn_beta_fast, c.yarn_beta_slow, c.yarn_ext_factor, c.yarn_attn_factor
        )
    return Rope(c.rope_dims, c.rope_base, neox, c.rope_scale, freq_factors, yarn)


class TensorGroup:
    """Tensors by GGUF name with the `blk.N.` prefix and `.weight` suffix dropped (`attn_q`, `attn_q_bias`).

    Matrices are `QWeight`s; vectors (norms, biases) are float32 tensors.
    """

    def __init__(self, prefix: str, tensors: dict[str, Any]) -> None:
        self._prefix, self._tensors = prefix, tensors

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_tensors"][name]
        except KeyError:
            raise LlmxError(f"the model file has no tensor {self._prefix}{name}.weight") from None

    def optional(self, name: str) -> Any | None:
        return self._tensors.get(name)

    def items(self):
        return self._tensors.items()


@dataclass(frozen=True)
class Step:
    """Where a micro-batch sits in the sequence, on the device of the blocks being run.

    `positions` [T] are the tokens' positions; attention reads the cache's first `n_read` rows.
    `masked` is False only when every cached key is visible to every query (one token decoded over
    exactly its past), so attention can skip the mask; inside a CUDA graph the cache is read in
    fixed-size buckets and the mask is always on. RoPE tables and masks are made once per step and
    shared by every layer.
    """

    positions: torch.Tensor
    masked: bool
    n_read: int
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def rope(self, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("rope", id(rope))
        if key not in self._memo:
            self._memo[key] = rope.tables(self.positions, self.n_read)
        return self._memo[key]

    def mask(self, window: int | None) -> torch.Tensor | None:
        """The attention mask over the `n_read` cached keys, or None when all are visible."""
        if not self.masked and (window is None or self.n_read <= window):
            return None
        key = ("mask", window)
        if key not in self._memo:
            self._memo[key] = causal_mask(self.positions, self.n_read, window)
        return self._memo[key]


class Model:
    """Base of every architecture: the weight tree, the config and the three stages of a forward pass.

    `block(i, w, x, step, cache_kv)` runs layer i with its weights `w`: `layers[i]`, or a copy of
    them the runtime streamed to a GPU (the model is never changed for that). `cache_kv` (an
    `ops.LayerKV`) is the layer's cache: `cache_kv(k, v) -> (K, V)` stores this step's keys and
    values and returns the rows attention reads.
    """

    neox_rope: ClassVar[bool] = False

    def __init__(
        self, config: ModelConfig, top: TensorGroup, layers: list[TensorGroup], fused_moe: bool = True
    ) -> None:
        self.config, self.top, self.layers = config, top, layers
        self.fused_moe = fused_moe  # routed experts' gate and up in one launch (-no-fmoe: two)
        self.rope = rope_of(config, self.neox_rope, top.optional("rope_freqs"))

    @classmethod
    def check_config(cls, config: ModelConfig, source: str) -> None:
        """Refuse, before anything loads, what the config asks and this runtime cannot do."""
        if config.n_expert and not 0 < config.n_expert_used <= config.n_expert:
            raise LlmxError(
                f"{source}: {config.arch}.expert_used_count is {config.n_expert_used}; "
                f"it must be 1 to {config.n_expert} (expert_count)"
            )
        # Llama 3.1's "llama3" scaling is no type: its converter writes the rope_freqs tensor instead.
        if config.rope_scaling not in SCALING_TYPES:
            raise LlmxError(
                f"{source}: RoPE scaling type {config.rope_scaling!r} is not supported yet "
                f"(llmx supports {', '.join(SCALING_TYPES[1:])} and rope_freqs factors)"
            )

    @classmethod
    def layer_tensors(cls, config: ModelConfig) -> tuple[str, ...]:
        """The tensors every layer must hold (`models.layout` checks them at open)."""
        return ATTENTION + (ROUTED_FFN if config.n_expert else DENSE_FFN)

    @classmethod
    def kv_shape(cls, config: ModelConfig, layer: int) -> tuple[int, int, int]:
        """What layer `layer` caches per token: (KV heads, key dim, value dim)."""
        return config.n_head_kv, config.head_dim, config.head_dim

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> hidden states [T, E]."""
        return embedding(ids, self.top.token_embd)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """hidden states [T, E] -> logits [T, vocab]; a missing `output` means tied to the embedding."""
        x = rms_norm(x, self.top.output_norm, self.config.norm_eps)
        output = self.top.optional("output")
        return linear(x, self.top.token_embd if output is None else output)

    def block(self, i: int, w: TensorGroup, x: torch.Tensor, step: Step, cache_kv: LayerKV) -> torch.Tensor:
        raise NotImplementedError

    # --- shared pieces -------------------------------------------------------------------------

    def qkv(self, w: TensorGroup, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections with optional biases, as [T, heads, D]; the heads are counted from the weights
        (a GPU of a `-sm row` split holds some of them)."""
        c, t = self.config, h.shape[0]
        names = ("attn_q", "attn_k", "attn_v")
        ws, biases = [getattr(w, n) for n in names], [w.optional(f"{n}_bias") for n in names]
        q, k, v = linear_many(h, ws, biases)
        n_kv = k.shape[-1] // c.head_dim
        return q.view(t, -1, c.head_dim), k.view(t, n_kv, c.head_dim), v.view(t, n_kv, -1)

    def self_attention(
        self,
        w: TensorGroup,
        h: torch.Tensor,
        step: Step,
        cache_kv: LayerKV,
        rope: Rope | None = None,
        window: int | None = None,
        **kw: Any,
    ) -> torch.Tensor:
        """RoPE'd grouped-query attention over the cache, before the output projection: [T, H*D]."""
        rope = rope or self.rope
        q, k, v = self.qkv(w, h)
        cos, sin = step.rope(rope)
        norms = self.head_norms(w)
        return rope_attention(q, k, v, rope, cos, sin, cache_kv, step.mask(window), window, norms=norms, **kw)

    def head_norms(self, w: TensorGroup) -> HeadNorms | None:
        """Per-head RMSNorm of queries and keys, before RoPE, where the model has it (Qwen3, Gemma 3)."""
        qn, kn = w.optional("attn_q_norm"), w.optional("attn_k_norm")
        return None if qn is None and kn is None else HeadNorms(qn, kn, self.config.norm_eps)

    def routed_experts(self, w: TensorGroup, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual plus the routed experts' FFN of the normed h [T, E]: each token's top-k experts by
        the router `ffn_gate_inp`, their SwiGLU outputs weighted by the router and summed."""
        c = self.config
        weights, ids = router(h, w.ffn_gate_inp, c.n_expert_used, c.expert_weights_norm)
        stacks = (w.ffn_gate_exps, w.ffn_up_exps, w.ffn_down_exps)
        return moe_ffn(h, *stacks, weights, ids, self.fused_moe, residual)
