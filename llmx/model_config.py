"""A model's hyperparameters as its GGUF metadata states them: one reader, one set of defaults.

The planner (`llmx.plan.model.ModelSpec.config`) and the models (`llmx.models.common.Model.config`) hold
the same `ModelConfig`, read here from the `{arch}.*` keys, so both size the same layers, heads and
caches. Keys llama.cpp requires are required here; optional keys take llama.cpp's defaults. A value
that is not a number, or a count that is not positive, is one `LlmxError` naming the file and the key.
Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmx.errors import LlmxError

# Architectures whose layers attend through sliding windows, and their default pattern (llama.cpp's
# for gemma3: every 6th layer is global). Other architectures ignore a sliding_window key.
SLIDING_PATTERNS = {"gemma3": 6}

# Whether the routed experts' top-k weights are renormalised to sum to 1, where the file does not say
# (`{arch}.expert_weights_norm`): llama.cpp's choice per architecture (src/models/*.cpp, the `norm_w`
# argument of build_moe_ffn). Mixtral's GGUFs say "llama".
EXPERT_WEIGHTS_NORM = {"llama": True, "qwen3moe": True, "qwen2moe": False}
# Architectures whose expert width defaults to feed_forward_length / expert_used_count (llama.cpp's
# rule for Qwen MoE files without expert_feed_forward_length); elsewhere it defaults to the FFN width.
EXPERT_WIDTH_PER_USED = ("qwen2moe", "qwen3moe")


def layer_window(layer: int, window: int, pattern: int) -> int | None:
    """The sliding window of layer `layer` (counted from 0), or None when it sees the whole context:
    with a window and a pattern, every pattern-th layer is global."""
    if not window or not pattern or (layer + 1) % pattern == 0:
        return None
    return window


@dataclass(frozen=True)
class ModelConfig:
    """Per layer and token, attention caches `n_head_kv` keys of `head_dim` and values of `head_dim_v`
    (MLA: one latent of kv_lora_rank + rope dims as the key, and the values read from that same latent,
    so `head_dim_v` is 0, as llama.cpp caches it)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    n_vocab: int
    n_ctx_train: int
    n_ff: int  # the widest dense FFN (0 if none)
    n_ff_exp: int  # one routed expert's FFN width (0 without experts)
    n_expert: int  # routed experts per layer (0: a dense model)
    n_expert_used: int
    norm_eps: float
    rope_base: float
    rope_dims: int
    rope_scaling: str  # "none", "linear", "yarn", ...
    rope_scaling_factor: float
    # YaRN (rope.scaling.*, llama.cpp's defaults): the context the model was trained at before it was
    # stretched, the rotation counts that bound the ramp between extrapolated and interpolated
    # dimensions, the ramp's weight and a factor on the attention magnitude.
    rope_ctx_orig: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_ext_factor: float = 1.0
    yarn_attn_factor: float = 1.0
    sliding_window: int = 0  # tokens a local-attention layer sees (Gemma 3); 0 = none
    sliding_window_pattern: int = 0  # every pattern-th layer is global (0: none is local)
    n_ff_shexp: int = 0  # the shared expert's FFN width (Qwen2-MoE; 0 without one)
    expert_weights_norm: bool = False  # renormalise the chosen experts' router weights to sum to 1

    @classmethod
    def from_metadata(cls, md: dict[str, Any], source: str) -> ModelConfig:
        """Read from GGUF metadata; `source` (the file's name) starts every error message."""
        arch = md.get("general.architecture")
        if not arch or not isinstance(arch, str):
            raise LlmxError(f"{source}: no general.architecture in the metadata; not a model GGUF")
        if not arch.isprintable():
            raise LlmxError(f"{source}: general.architecture is {arch!r}, not a name")
        keys = _Keys(md, arch, source)
        n_embd, n_head = keys.count("embedding_length"), keys.count("attention.head_count")
        head_dim = keys.count("attention.key_length", n_embd // n_head)
        head_dim_v = keys.count("attention.value_length", head_dim)
        if f"{arch}.attention.kv_lora_rank" in md and f"{arch}.attention.key_length_mla" in md:
            head_dim_v = 0  # MLA: V is a view of the K latent (llama.cpp), nothing more is cached
        n_vocab = keys.number(f"{arch}.vocab_size", 0, int) or len(md.get("tokenizer.ggml.tokens") or ())
        if n_vocab <= 0:
            raise LlmxError(
                f"{source}: the metadata states no vocabulary ({arch}.vocab_size, tokenizer.ggml.tokens)"
            )
        rope_dims = keys.size("rope.dimension_count", head_dim)
        if rope_dims > head_dim or rope_dims % 2:
            key = f"{arch}.rope.dimension_count"
            raise LlmxError(f"{source}: {key} is {rope_dims}; it must be even and at most {head_dim}")
        pattern = SLIDING_PATTERNS.get(arch, 0)
        n_ff = keys.size("feed_forward_length", 0)
        n_ctx_train = keys.count("context_length")
        # llama.cpp: a negative ext_factor (its "unset") means 1 for YaRN
        ext_factor = keys.number(f"{arch}.rope.scaling.yarn_ext_factor", -1.0, float)
        norm_default = EXPERT_WEIGHTS_NORM.get(arch, False)
        return cls(
            arch=arch,
            n_layer=keys.count("block_count"),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=keys.count("attention.head_count_kv", n_head),
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            n_vocab=n_vocab,
            n_ctx_train=n_ctx_train,
            n_ff=n_ff,
            n_ff_exp=keys.size("expert_feed_forward_length", 0),
            n_expert=keys.size("expert_count", 0),
            n_expert_used=keys.size("expert_used_count", 0),
            norm_eps=keys.number(f"{arch}.attention.layer_norm_rms_epsilon", None, float),
            rope_base=keys.number(f"{arch}.rope.freq_base", 10000.0, float),
            rope_dims=rope_dims,
            rope_scaling=str(md.get(f"{arch}.rope.scaling.type", "none")),
            rope_scaling_factor=keys.number(f"{arch}.rope.scaling.factor", 1.0, float) or 1.0,
            rope_ctx_orig=keys.count("rope.scaling.original_context_length", n_ctx_train),
            yarn_beta_fast=keys.number(f"{arch}.rope.scaling.yarn_beta_fast", 32.0, float),
            yarn_beta_slow=keys.number(f"{arch}.rope.scaling.yarn_beta_slow", 1.0, float),
            yarn_ext_factor=1.0 if ext_factor < 0 else ext_factor,
            yarn_attn_factor=keys.number(f"{arch}.rope.scaling.yarn_attn_factor", 1.0, float),
            sliding_window=keys.size("attention.sliding_window", 0) if pattern else 0,
            sliding_window_pattern=keys.size("attention.sliding_window_pattern", pattern) if pattern else 0,
            n_ff_shexp=keys.size("expert_shared_feed_forward_length", n_ff if arch == "qwen2moe" else 0),
            expert_weights_norm=keys.number(f"{arch}.expert_weights_norm", norm_default, bool),
        )

    @property
    def rope_scale(self) -> float:
        """The factor positions are stretched by, linear or YaRN (1: none); other scaling types are the
        runtime's to refuse."""
        return self.rope_scaling_factor if self.rope_scaling in ("linear", "yarn") else 1.0

    @property
    def expert_width(self) -> int:
        """One routed expert's FFN width: `n_ff_exp` where the file states it, else llama.cpp's default
        (Mixtral's files state only feed_forward_length, the experts' width)."""
        if self.n_ff_exp or not self.n_expert:
            return self.n_ff_exp
        return self.n_ff // self.n_expert_used if self.arch in EXPERT_WIDTH_PER_USED else self.n_ff

    def window(self, layer: int) -> int | None:
        return layer_window(layer, self.sliding_window, self.sliding_window_pattern)


class _Keys:
    """`{arch}.*` lookups that turn a missing required key or a value of the wrong kind into one line."""

    def __init__(self, md: dict[str, Any], arch: str, source: str) -> None:
        self.md, self.arch, self.source = md, arch, source

    def number(self, key: str, default: Any, kind: type) -> Any:
        value = self.md.get(key, default)
        if value is None:
            raise LlmxError(f"{self.source}: metadata key {key} is missing")
        try:
            if isinstance(value, list):  # per-layer arrays: the widest layer sizes buffers and caches
                value = max(value, default=None)
            return kind(value)
        except (TypeError, ValueError, OverflowError):
            raise LlmxError(f"{self.source}: metadata key {key} is {value!r}, not a number") from None

    def size(self, suffix: str, default: int | None = None) -> int:
        """A non-negative integer `{arch}.{suffix}`."""
        value = self.number(f"{self.arch}.{suffix}", default, int)
        if value < 0:
            raise LlmxError(f"{self.source}: metadata key {self.arch}.{suffix} is {value}, below 0")
        return value

    def count(self, suffix: str, default: int | None = None) -> int:
        """A positive integer `{arch}.{suffix}`: a count or width that a model cannot have zero of."""
        value = self.size(suffix, default)
        if value == 0:
            raise LlmxError(f"{self.source}: metadata key {self.arch}.{suffix} is 0")
        return value
