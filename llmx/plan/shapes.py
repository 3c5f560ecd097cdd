"""Real models' shapes, without their weights: GGUF tensor lists and metadata, sized by quant recipe.

`get_shape("llama3-70b").tensors("Q4_K_M")` gives the tensors a llama.cpp Q4_K_M file of that model
holds (names, types, shapes, bytes), and `.metadata()` the `{arch}.*`/`tokenizer.*` keys such a file
carries, so `llmx plan --shape llama3-70b:Q4_K_M` can answer "does it fit?" before a download, and
`llmx synth` can write a synthetic GGUF of the same shape. Hyperparameters are those of the Hugging
Face configs, tensor names and layouts those of llama.cpp's convert_hf_to_gguf.py. Pure, stdlib only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from llmx.errors import LlmxError
from llmx.plan.recipes import RECIPES, assign_types
from llmx.plan.tensors import TensorSpec

# --- the table ---


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1's "llama3" RoPE scaling (its config's rope_scaling). GGUFs carry it as no metadata
    key but as the tensor rope_freqs.weight, a factor per rotated pair that divides its frequency."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    def freq_factors(self, base: float, dims: int) -> list[float]:
        """The tensor's values, as llama.cpp's converter computes them (LlamaModel.generate_extra_tensors):
        pairs turning fast over the original context keep their frequency, slow ones are divided by
        `factor`, and a smooth ramp joins them."""
        low_wavelen = self.original_context / self.low_freq_factor
        high_wavelen = self.original_context / self.high_freq_factor
        out = []
        for i in range(0, dims, 2):
            wavelen = 2 * math.pi * base ** (i / dims)
            if wavelen < high_wavelen:
                out.append(1.0)
            elif wavelen > low_wavelen:
                out.append(self.factor)
            else:
                smooth = (self.original_context / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor
                )
                out.append(1 / ((1 - smooth) / self.factor + smooth))
        return out


@dataclass(frozen=True)
class ModelShape:
    """One model's hyperparameters, in the vocabulary of its GGUF metadata.

    Shapes follow llmx's GGUF reader: row-major, outermost first, so a projection from n_embd to
    n_out is (n_out, n_embd) and an expert stack is (n_expert, n_out, n_in).
    """

    name: str
    arch: str  # general.architecture
    size_label: str
    n_layer: int
    n_embd: int
    n_ff: int  # dense FFN width (the leading dense layers' width in DeepSeek)
    n_head: int
    n_head_kv: int
    n_vocab: int
    ctx_train: int
    rope_base: float
    rms_eps: float
    tokenizer: tuple[str, str, int, int]  # tokenizer.ggml.model, .pre, bos id, eos id
    head_dim: int = 128
    tied_embeddings: bool = False  # no output.weight: the output reuses token_embd
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3: per-head RMS norm of q and k
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0  # one expert's FFN width
    n_expert_shared: int = 0
    n_ff_shexp: int = 0  # the shared expert's FFN width where the file states it (Qwen2-MoE)
    n_leading_dense: int = 0  # DeepSeek: the first layers have a dense FFN instead of experts
    q_lora_rank: int = 0  # DeepSeek MLA: q = q_b(norm(q_a(x)))
    kv_lora_rank: int = 0  # DeepSeek MLA: the compressed KV that the cache stores
    rope_dim: int = 0  # DeepSeek MLA: the rotary part of each head (qk_rope_head_dim)
    llama3_rope: Llama3Rope | None = None  # Llama 3.1's scaling, written as rope_freqs.weight
    extra: tuple[tuple[str, Any], ...] = field(default=())  # further `{arch}.` keys, as in real files

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_expert > 0 and layer >= self.n_leading_dense

    def rope_freqs(self) -> list[float]:
        """rope_freqs.weight's values (the shape must have `llama3_rope`)."""
        assert self.llama3_rope is not None, f"{self.name} has no rope_freqs tensor"
        return self.llama3_rope.freq_factors(self.rope_base, self.rope_dim or self.head_dim)

    def tensors(self, recipe: str) -> list[TensorSpec]:
        """The file's tensors with their types under `recipe` (e.g. "Q4_K_M", "Q8_0", "IQ4_KS")."""
        return assign_types(self, _raw_tensors(self), recipe)

    def metadata(self, recipe: str | None = None) -> dict[str, Any]:
        """The GGUF key/value metadata of such a file, less the tokenizer's token/merge arrays
        (`tokenizer.ggml.tokens` has `{arch}.vocab_size` entries; a writer makes them up)."""
        a = self.arch
        md: dict[str, Any] = {
            "general.architecture": a,
            "general.name": self.name,
            "general.size_label": self.size_label,
            f"{a}.vocab_size": self.n_vocab,
            f"{a}.context_length": self.ctx_train,
            f"{a}.embedding_length": self.n_embd,
            f"{a}.feed_forward_length": self.n_ff,
            f"{a}.block_count": self.n_layer,
            f"{a}.attention.head_count": self.n_head,
            f"{a}.attention.head_count_kv": self.n_head_kv,
            f"{a}.attention.layer_norm_rms_epsilon": self.rms_eps,
            f"{a}.rope.freq_base": self.rope_base,
            f"{a}.rope.dimension_count": self.rope_dim or self.head_dim,
        }
        # Qwen3's config states head_dim, so its converter always writes these two keys.
        if (self.qk_norm or self.head_dim * self.n_head != self.n_embd) and not self.is_mla:
            md[f"{a}.attention.key_length"] = self.head_dim
            md[f"{a}.attention.value_length"] = self.head_dim
        if self.is_mla:
            # llama.cpp's MLA layout: the cache holds one latent "head" of kv_lora_rank + rope_dim.
            md[f"{a}.attention.head_count_kv"] = 1
            md[f"{a}.attention.key_length"] = self.kv_lora_rank + self.rope_dim
            md[f"{a}.attention.value_length"] = self.kv_lora_rank
            md[f"{a}.attention.key_length_mla"] = self.head_dim + self.rope_dim
            md[f"{a}.attention.value_length_mla"] = self.head_dim
            md[f"{a}.attention.q_lora_rank"] = self.q_lora_rank
            md[f"{a}.attention.kv_lora_rank"] = self.kv_lora_rank
        if self.n_expert:
            md[f"{a}.expert_count"] = self.n_expert
            md[f"{a}.expert_used_count"] = self.n_expert_used
            if self.n_ff_exp != self.n_ff:  # Mixtral's files state only feed_forward_length
                md[f"{a}.expert_feed_forward_length"] = self.n_ff_exp
        if self.n_expert_shared:
            md[f"{a}.expert_shared_count"] = self.n_expert_shared
        if self.n_ff_shexp:
            md[f"{a}.expert_shared_feed_forward_length"] = self.n_ff_shexp
        if self.n_leading_dense:
            md[f"{a}.leading_dense_block_count"] = self.n_leading_dense
        md.update({f"{a}.{k}": v for k, v in self.extra})
        model, pre, bos, eos = self.tokenizer
        md.update(
            {
                "tokenizer.ggml.model": model,
                "tokenizer.ggml.pre": pre,
                "tokenizer.ggml.bos_token_id": bos,
                "tokenizer.ggml.eos_token_id": eos,
            }
        )
        if recipe is not None:
            md["general.file_type"] = RECIPES[recipe.upper()].file_type
        md["general.quantization_version"] = 2
        return md


_LLAMA3_TOK = ("gpt2", "llama-bpe", 128000, 128009)
_QWEN_TOK = ("gpt2", "qwen2", 151643, 151645)
_DEEPSEEK_V3 = dict(
    arch="deepseek2", size_label="671B", n_layer=61, n_embd=7168, n_ff=18432, n_head=128, n_head_kv=128,
    n_vocab=129280, ctx_train=163840, rope_base=10000.0, rms_eps=1e-6,
    tokenizer=("gpt2", "deepseek-v3", 0, 1),
    n_expert=256, n_expert_used=8, n_ff_exp=2048, n_expert_shared=1, n_leading_dense=3,
    q_lora_rank=1536, kv_lora_rank=512, rope_dim=64, head_dim=128,
    extra=(("expert_weights_scale", 2.5), ("expert_weights_norm", True), ("expert_gating_func", 2),
           ("expert_group_count", 8), ("expert_group_used_count", 4), ("rope.scaling.type", "yarn"),
           ("rope.scaling.factor", 40.0), ("rope.scaling.original_context_length", 4096),
           ("rope.scaling.yarn_log_multiplier", 0.1)),
)  # fmt: skip

SHAPES: dict[str, ModelShape] = {s.name: s for s in [
    ModelShape("smollm2-135m", "llama", "135M", n_layer=30, n_embd=576, n_ff=1536, n_head=9, n_head_kv=3,
               n_vocab=49152, ctx_train=8192, rope_base=100000.0, rms_eps=1e-5, head_dim=64,
               tokenizer=("gpt2", "smollm", 1, 2), tied_embeddings=True),
    ModelShape("llama3-8b", "llama", "8B", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8,
               n_vocab=128256, ctx_train=8192, rope_base=500000.0, rms_eps=1e-5, tokenizer=_LLAMA3_TOK),
    # Llama 3.1: Llama 3's shapes with a 128K context, reached by its "llama3" RoPE scaling.
    ModelShape("llama3.1-8b", "llama", "8B", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8,
               n_vocab=128256, ctx_train=131072, rope_base=500000.0, rms_eps=1e-5, tokenizer=_LLAMA3_TOK,
               llama3_rope=Llama3Rope()),
    ModelShape("llama3-70b", "llama", "70B", n_layer=80, n_embd=8192, n_ff=28672, n_head=64, n_head_kv=8,
               n_vocab=128256, ctx_train=8192, rope_base=500000.0, rms_eps=1e-5, tokenizer=_LLAMA3_TOK),
    # The seed's "qwen-70b" (80 layers, ~40 GB at Q4): Qwen2.5-72B. Its FFN width 29568 is not a
    # multiple of 256, so llama.cpp stores ffn_down in a 32-block fallback type (Q4_K -> Q5_0).
    ModelShape("qwen2.5-72b", "qwen2", "72B", n_layer=80, n_embd=8192, n_ff=29568, n_head=64, n_head_kv=8,
               n_vocab=152064, ctx_train=32768, rope_base=1000000.0, rms_eps=1e-6, tokenizer=_QWEN_TOK,
               qkv_bias=True),
    ModelShape("qwen3-8b", "qwen3", "8B", n_layer=36, n_embd=4096, n_ff=12288, n_head=32, n_head_kv=8,
               n_vocab=151936, ctx_train=40960, rope_base=1000000.0, rms_eps=1e-6, tokenizer=_QWEN_TOK,
               qk_norm=True),
    ModelShape("qwen3-30b-a3b", "qwen3moe", "30B-A3B", n_layer=48, n_embd=2048, n_ff=6144, n_head=32,
               n_head_kv=4, n_vocab=151936, ctx_train=40960, rope_base=1000000.0, rms_eps=1e-6,
               tokenizer=_QWEN_TOK, qk_norm=True, n_expert=128, n_expert_used=8, n_ff_exp=768),
    ModelShape("qwen3-235b-a22b", "qwen3moe", "235B-A22B", n_layer=94, n_embd=4096, n_ff=12288, n_head=64,
               n_head_kv=4, n_vocab=151936, ctx_train=40960, rope_base=1000000.0, rms_eps=1e-6,
               tokenizer=_QWEN_TOK, qk_norm=True, n_expert=128, n_expert_used=8, n_ff_exp=1536),
    # Mixtral's GGUFs say "llama"; the experts are stacked (ffn_*_exps) as current llama.cpp writes them.
    ModelShape("mixtral-8x7b", "llama", "8x7B", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8,
               n_vocab=32000, ctx_train=32768, rope_base=1000000.0, rms_eps=1e-5,
               tokenizer=("llama", "default", 1, 2), n_expert=8, n_expert_used=2, n_ff_exp=14336),
    ModelShape("deepseek-v3", **_DEEPSEEK_V3),
    ModelShape("deepseek-r1", **_DEEPSEEK_V3),
]}  # fmt: skip
ALIASES = {"seed-70b": "qwen2.5-72b", "qwen-70b": "qwen2.5-72b", "qwen2-72b": "qwen2.5-72b"}


def get_shape(name: str) -> ModelShape:
    """A shape by name (case-insensitive); an unknown name lists the known ones."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in SHAPES:
        raise LlmxError(f"unknown model shape {name!r}; known shapes: {', '.join(SHAPES)}")
    return SHAPES[key]


def parse_shape_spec(spec: str) -> tuple[ModelShape, str]:
    """`"llama3-70b:Q4_K_M"` -> (shape, "Q4_K_M"); the recipe defaults to Q4_K_M."""
    name, _, recipe = spec.partition(":")
    recipe = (recipe or "Q4_K_M").upper()
    if recipe not in RECIPES:
        raise LlmxError(f"unknown quant recipe {recipe!r} in {spec!r}; known recipes: {', '.join(RECIPES)}")
    return get_shape(name), recipe


# --- tensor lists, per architecture family ---


def _raw_tensors(s: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor, in the order llama.cpp's converter writes them."""
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s.n_vocab, s.n_embd))]
    if s.llama3_rope is not None:  # the converter's extra tensors come first
        out.insert(0, ("rope_freqs.weight", ((s.rope_dim or s.head_dim) // 2,)))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        out.append((p + "attn_norm.weight", (s.n_embd,)))
        out += [(p + n, shape) for n, shape in (_mla(s) if s.is_mla else _gqa(s))]
        out.append((p + "ffn_norm.weight", (s.n_embd,)))
        out += [(p + n, shape) for n, shape in (_moe(s) if s.is_moe_layer(i) else _dense(s))]
    out.append(("output_norm.weight", (s.n_embd,)))
    if not s.tied_embeddings:
        out.append(("output.weight", (s.n_vocab, s.n_embd)))
    return out


def _gqa(s: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    out = [
        ("attn_q.weight", (q, s.n_embd)),
        ("attn_k.weight", (kv, s.n_embd)),
        ("attn_v.weight", (kv, s.n_embd)),
    ]
    if s.qkv_bias:
        out += [("attn_q.bias", (q,)), ("attn_k.bias", (kv,)), ("attn_v.bias", (kv,))]
    if s.qk_norm:
        out += [("attn_q_norm.weight", (s.head_dim,)), ("attn_k_norm.weight", (s.head_dim,))]
    return [*out, ("attn_output.weight", (s.n_embd, q))]


def _mla(s: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    # DeepSeek's multi-head latent attention as current llama.cpp converts it: kv_b split into
    # per-head k_b (latent -> nope keys, stored transposed) and v_b (latent -> values).
    nope, h = s.head_dim, s.n_head
    return [
        ("attn_q_a.weight", (s.q_lora_rank, s.n_embd)),
        ("attn_q_a_norm.weight", (s.q_lora_rank,)),
        ("attn_q_b.weight", (h * (nope + s.rope_dim), s.q_lora_rank)),
        ("attn_kv_a_mqa.weight", (s.kv_lora_rank + s.rope_dim, s.n_embd)),
        ("attn_kv_a_norm.weight", (s.kv_lora_rank,)),
        ("attn_k_b.weight", (h, s.kv_lora_rank, nope)),
        ("attn_v_b.weight", (h, s.head_dim, s.kv_lora_rank)),
        ("attn_output.weight", (s.n_embd, h * s.head_dim)),
    ]


def _dense(s: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    return [
        ("ffn_gate.weight", (s.n_ff, s.n_embd)),
        ("ffn_up.weight", (s.n_ff, s.n_embd)),
        ("ffn_down.weight", (s.n_embd, s.n_ff)),
    ]


def _moe(s: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    e, f = s.n_expert, s.n_ff_exp
    out = [
        ("ffn_gate_inp.weight", (e, s.n_embd)),
        ("ffn_gate_exps.weight", (e, f, s.n_embd)),
        ("ffn_up_exps.weight", (e, f, s.n_embd)),
        ("ffn_down_exps.weight", (e, s.n_embd, f)),
    ]
    if s.arch == "deepseek2":
        out.insert(1, ("exp_probs_b.bias", (e,)))  # the router's score-correction bias (V3 only)
    if s.arch == "qwen2moe":  # its shared expert's per-token gate: one row
        out.append(("ffn_gate_inp_shexp.weight", (1, s.n_embd)))
    if s.n_expert_shared or s.n_ff_shexp:
        fs = s.n_ff_shexp or f * s.n_expert_shared
        out += [
            ("ffn_gate_shexp.weight", (fs, s.n_embd)),
            ("ffn_up_shexp.weight", (fs, s.n_embd)),
            ("ffn_down_shexp.weight", (s.n_embd, fs)),
        ]
    return out
