"""Tiny random models of each architecture, written as GGUF, so every architecture is tested without a
real checkpoint and small enough for Hugging Face transformers to load live beside llmx.

The tensor lists and metadata come from the same shape table and writer as `llmx synth`
(`llmx.plan.shapes.ModelShape`, `llmx.bench.synth`, `llmx.bench.writer`), under a pure type (F32,
Q8_0) or llama.cpp's Q4_K_M mix. Only the values differ from `llmx synth`'s: every vector is random
too (norm weights near 1, biases near 0), because a norm of exactly 1 or a bias of exactly 0 would
hide a missing norm or bias.

The dimensions are the smallest that keep the real models' constraints:
- rows are whole 256-weight blocks (K-quants), so every matrix takes the asked type;
- Qwen3 and Gemma 3 keep their real head widths (128 and 256), because transformers' GGUF loader
  does not read them from the file (Qwen3's config defaults to 128, and Gemma 3 scales queries by
  `query_pre_attn_scalar` = 256 whatever the file says);
- Gemma 3 has six layers, so its default pattern (five sliding-window layers, then a global one)
  happens once, with a window of 8 tokens that every test prompt exceeds.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from llmx.bench.blocks import chunk_rng, random_data
from llmx.bench.synth import rope_freqs_data, synth_metadata, synth_tensors
from llmx.bench.writer import write_gguf
from llmx.plan.shapes import Llama3Rope, ModelShape
from llmx.plan.tensors import TensorSpec
from llmx.quant import qtype

N_VOCAB = 1024
SLIDING_WINDOW = 8
TOKENIZER = ("gpt2", "qwen2", N_VOCAB - 2, N_VOCAB - 1)  # transformers builds a GPT-2 BPE from it
NORM_STD, BIAS_STD = 0.2, 0.2  # spread of norm weights around 1 and of biases around 0

_COMMON = dict(size_label="tiny", n_vocab=N_VOCAB, ctx_train=4096, rms_eps=1e-6, tokenizer=TOKENIZER)
TINY_SHAPES: dict[str, ModelShape] = {
    "llama": ModelShape("tiny-llama", "llama", n_layer=3, n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                        head_dim=64, rope_base=1e4, **_COMMON),
    "qwen2": ModelShape("tiny-qwen2", "qwen2", n_layer=3, n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                        head_dim=64, rope_base=1e6, qkv_bias=True, **_COMMON),
    "qwen3": ModelShape("tiny-qwen3", "qwen3", n_layer=3, n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                        head_dim=128, rope_base=1e6, qk_norm=True, **_COMMON),
    "gemma3": ModelShape("tiny-gemma3", "gemma3", n_layer=6, n_embd=256, n_ff=512, n_head=2, n_head_kv=1,
                         head_dim=256, rope_base=1e6, qk_norm=True, tied_embeddings=True,
                         extra=(("attention.sliding_window", SLIDING_WINDOW),), **_COMMON),
}  # fmt: skip
TYPES = ("F32", "Q8_0", "Q4_K_M")
# Mixture-of-experts models, against transformers models built from a config (`test_moe.py`): Mixtral's
# GGUFs say "llama" and state only feed_forward_length (the experts' width).
TINY_MOE_SHAPES: dict[str, ModelShape] = {
    "qwen3moe": ModelShape("tiny-qwen3moe", "qwen3moe", n_layer=2, n_embd=256, n_ff=512, n_head=4,
                           n_head_kv=2, head_dim=64, rope_base=1e6, qk_norm=True, n_expert=8,
                           n_expert_used=2, n_ff_exp=256, **_COMMON),
    "qwen2moe": ModelShape("tiny-qwen2moe", "qwen2moe", n_layer=2, n_embd=256, n_ff=512, n_head=4,
                           n_head_kv=2, head_dim=64, rope_base=1e6, qkv_bias=True, n_expert=8,
                           n_expert_used=4, n_ff_exp=256, n_ff_shexp=512, **_COMMON),
    "mixtral": ModelShape("tiny-mixtral", "llama", n_layer=2, n_embd=256, n_ff=256, n_head=4, n_head_kv=2,
                          head_dim=64, rope_base=1e6, n_expert=4, n_expert_used=2, n_ff_exp=256, **_COMMON),
}  # fmt: skip
# Long-context RoPE scaling, stretched from an original context of ROPE_CTX_ORIG tokens that test
# prompts outrun: Llama 3.1's "llama3" factors (the rope_freqs tensor) and Qwen2.5's YaRN (metadata).
ROPE_CTX_ORIG = 64
TINY_ROPE_SHAPES: dict[str, ModelShape] = {
    "llama3-rope": replace(TINY_SHAPES["llama"], name="tiny-llama3-rope",
                           llama3_rope=Llama3Rope(8.0, 1.0, 4.0, ROPE_CTX_ORIG)),
    "qwen2-yarn": replace(TINY_SHAPES["qwen2"], name="tiny-qwen2-yarn",
                          extra=(("rope.scaling.type", "yarn"), ("rope.scaling.factor", 4.0),
                                 ("rope.scaling.original_context_length", ROPE_CTX_ORIG))),
}  # fmt: skip


def tiny_tensors(shape: ModelShape, type_name: str) -> list[TensorSpec]:
    """The file's tensors; Gemma 3 adds a norm after attention and after the FFN of every layer."""
    tensors = synth_tensors(shape, type_name)
    if shape.arch != "gemma3":
        return tensors
    out = []
    for t in tensors:
        out.append(t)
        for before, extra in (("attn_output", "post_attention_norm"), ("ffn_down", "post_ffw_norm")):
            if t.layer is not None and t.name == f"blk.{t.layer}.{before}.weight":
                name = f"blk.{t.layer}.{extra}.weight"
                out.append(TensorSpec(name, "F32", (shape.n_embd,), qtype("F32").nbytes((shape.n_embd,))))
    return out


def _fill(shape: ModelShape, seed: int):
    """The writer's fill function: matrices of std 1/sqrt(fan-in), norms 1 + N(0, 0.2²), biases N(0, 0.2²).

    Matrices scaled by their fan-in keep every activation near unit scale, and with a vocabulary of
    1024 random output rows the logits spread over a few units: argmax is never tied.
    """

    def fill(t: TensorSpec, first: int, count: int, path: tuple[int, int]) -> np.ndarray:
        if (freqs := rope_freqs_data(shape, t, first, count)) is not None:
            return freqs
        rng = chunk_rng(seed, *path)
        if len(t.shape) > 1:
            return random_data(qtype(t.qtype), count, 1.0 / math.sqrt(t.shape[-1]), rng)
        values = rng.standard_normal(count, dtype=np.float32)
        values = 1.0 + NORM_STD * values if "norm" in t.name else BIAS_STD * values
        return values.astype(np.float32).view(np.uint8)

    return fill


def write_tiny(
    arch: str,
    type_name: str,
    directory: Path,
    seed: int = 0,
    chat_template: str | None = None,
    retyped: dict[str, str] | None = None,
) -> Path:
    """Write the tiny `arch` model (a key of TINY_SHAPES, TINY_MOE_SHAPES or TINY_ROPE_SHAPES) in
    `type_name` (F32, Q8_0, Q4_K_M, ...) under `directory`, with `chat_template` if given, each layer's
    tensor named in `retyped` (e.g. "ffn_gate_inp_shexp") in the type it gives; its path."""
    shape = TINY_SHAPES.get(arch) or TINY_MOE_SHAPES.get(arch) or TINY_ROPE_SHAPES[arch]
    metadata = synth_metadata(shape, type_name, seed)
    metadata["tokenizer.ggml.pre"] = shape.tokenizer[1]  # the synthetic vocabulary says "default"
    if chat_template is not None:
        metadata["tokenizer.chat_template"] = chat_template
    path = Path(directory) / f"tiny-{arch}-{type_name}.gguf"
    tensors = [
        replace(t, qtype=kept, nbytes=qtype(kept).nbytes(t.shape))
        if t.layer is not None and (kept := (retyped or {}).get(t.name.split(".")[2])) is not None
        else t
        for t in tiny_tensors(shape, type_name)
    ]
    write_gguf(path, shape.arch, metadata, tensors, _fill(shape, seed), threads=1, progress=False)
    return path


def random_prompt(length: int, seed: int) -> list[int]:
    """`length` random ordinary token ids (the two specials sit at the top of the vocabulary)."""
    return np.random.default_rng(seed).integers(0, N_VOCAB - 2, length).tolist()


def greedy_steps(model, prompt: list[int], steps: int = 8) -> tuple[list[int], torch.Tensor]:
    """Prefill `prompt`, then `steps` greedy decode steps: the tokens and each step's logits
    [steps, vocab], for comparing two runs of the same model (e.g. a fused path on and off)."""
    model.engine.reset()
    logits, tokens, out = model.engine.prefill(prompt), [], []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = model.engine.decode(tokens[-1])
        out.append(logits)
    return tokens, torch.stack(out)
