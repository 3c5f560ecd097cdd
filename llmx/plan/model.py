"""What the planner knows about a model: its tensors (name, type, shape, bytes) and the few
hyperparameters that size the KV cache and the compute buffers.

Built the same way from a GGUF file's header (`ModelSpec.from_gguf`) or from a named shape
(`ModelSpec.from_shape`), because both come down to GGUF metadata keys plus a tensor list.
Pure: no torch, and no import of the GGUF reader (a `ModelFile` is passed in, duck-typed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmx.errors import LlmxError

if TYPE_CHECKING:
    from llmx.gguf import ModelFile
    from llmx.plan.shapes import ModelShape

_LAYER = re.compile(r"^blk\.(\d+)\.")

# Report columns, in order. "experts" are routed expert stacks; "shared" experts run for every
# token, so --fit treats them like attention (GPU first).
ROLES = ("attn", "ffn", "experts", "shared", "other")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as stored in the file: `qtype` is a GGML type name, `nbytes` its exact size."""

    name: str
    qtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def layer(self) -> int | None:
        """The repeating layer (`blk.N.`) this tensor belongs to; None for embeddings/output."""
        m = _LAYER.match(self.name)
        return int(m.group(1)) if m else None

    @property
    def short(self) -> str:
        """A layer tensor's name within its layer, `blk.3.attn_q.weight` -> `attn_q`; "" outside layers."""
        return self.name.split(".")[2] if self.layer is not None else ""

    @property
    def role(self) -> str:
        """attn / ffn (dense) / experts / shared / other (norms, router, embeddings, output)."""
        short = self.short
        if short.endswith("_exps"):
            return "experts"
        if short.endswith("_shexp"):
            return "shared"
        if short.startswith("attn_") and short != "attn_norm":
            return "attn"
        if short in ("ffn_gate", "ffn_up", "ffn_down"):
            return "ffn"
        return "other"

    @property
    def is_matrix(self) -> bool:
        """A 2-D weight: what `-sm row` splits by rows across GPUs."""
        return len(self.shape) == 2 and self.name.endswith(".weight")


# Architectures whose runtime attends through sliding windows, and their default layer pattern
# (llama.cpp's for gemma3: every 6th layer global). Others ignore a sliding_window key.
SLIDING_PATTERNS = {"gemma3": 6}


def layer_window(layer: int, window: int, pattern: int) -> int | None:
    """The sliding window of layer `layer` (counted from 0), or None when it sees the whole context:
    with a window and a pattern, every pattern-th layer is global."""
    if not window or not pattern or (layer + 1) % pattern == 0:
        return None
    return window


@dataclass(frozen=True)
class ModelSpec:
    """The planner's view of a model. KV sizes follow llama.cpp: per layer and token, K holds
    `n_head_kv * head_dim_k` values and V `n_head_kv * head_dim_v` (MLA: one latent of
    kv_lora_rank + rope dims in K, and V read from that same latent, so `head_dim_v` is 0)."""

    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_ff: int  # the widest dense FFN (0 if none)
    n_ff_exp: int
    n_expert_used: int
    ctx_train: int
    tensors: tuple[TensorSpec, ...]
    sliding_window: int = 0  # tokens a local-attention layer sees (Gemma 3); 0 = none
    sliding_window_pattern: int = 0  # every pattern-th layer is global (0: none is local)

    @classmethod
    def from_metadata(cls, name: str, md: dict[str, Any], tensors: list[TensorSpec]) -> ModelSpec:
        arch = md.get("general.architecture")
        if not arch:
            raise LlmxError(f"{name}: no general.architecture in the metadata; not a model GGUF")

        def key(suffix: str, default: Any = None) -> Any:
            value = md.get(f"{arch}.{suffix}", default)
            if value is None:
                raise LlmxError(f"{name}: metadata key {arch}.{suffix} is missing")
            return value[0] if isinstance(value, list) else value  # per-layer arrays: planner uses the first

        n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
        n_head_kv = int(key("attention.head_count_kv", n_head))
        head_k = int(key("attention.key_length", n_embd // n_head))
        head_v = int(key("attention.value_length", head_k))
        if f"{arch}.attention.kv_lora_rank" in md and f"{arch}.attention.key_length_mla" in md:
            head_v = 0  # MLA: V is a view of the K latent (llama.cpp), nothing more is cached
        vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", ()))
        embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
        return cls(
            name=name,
            arch=arch,
            n_layer=int(key("block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim_k=head_k,
            head_dim_v=head_v,
            n_vocab=int(vocab or (embd.shape[0] if embd else 0)),
            n_ff=int(key("feed_forward_length", 0)),
            n_ff_exp=int(key("expert_feed_forward_length", 0)),
            n_expert_used=int(key("expert_used_count", 0)),
            ctx_train=int(key("context_length", 4096)),
            tensors=tuple(tensors),
            sliding_window=int(key("attention.sliding_window", 0)),
            sliding_window_pattern=SLIDING_PATTERNS.get(arch, 0)
            and int(key("attention.sliding_window_pattern", SLIDING_PATTERNS.get(arch, 0))),
        )

    @classmethod
    def from_gguf(cls, mf: ModelFile) -> ModelSpec:
        """From an opened GGUF: exact byte sizes straight from its tensor infos."""
        tensors = [TensorSpec(t.name, t.qtype.name, tuple(t.shape), t.nbytes) for t in mf.tensors.values()]
        return cls.from_metadata(mf.path.name, mf.metadata, tensors)

    @classmethod
    def from_shape(cls, shape: ModelShape, recipe: str) -> ModelSpec:
        """From a named shape and a quant recipe, as if the file were there."""
        return cls.from_metadata(f"{shape.name}:{recipe}", shape.metadata(recipe), shape.tensors(recipe))

    def window(self, layer: int) -> int | None:
        return layer_window(layer, self.sliding_window, self.sliding_window_pattern)

    @property
    def n_params(self) -> int:
        total = 0
        for t in self.tensors:
            n = 1
            for d in t.shape:
                n *= d
            total += n
        return total

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
