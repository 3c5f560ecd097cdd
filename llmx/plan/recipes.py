"""llama.cpp's quantization mixes: which type each tensor of a "Q4_K_M" (etc.) file gets.

A recipe such as Q4_K_M is not one type: llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp)
gives the output matrix Q6_K, half of the layers' attn_v and ffn_down Q6_K, and falls back to a
32-weight-block type where a row is not a whole number of 256-weight blocks. This module restates
those rules for the recipes llmx names, so that a shape's size matches a real file within a few
percent. It assumes an importance matrix was used (as for all published IQ quants). ik_llama.cpp's
IQ4_KS mix follows that fork's rules for the same tensor categories.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from llmx.plan.tensors import TensorSpec
from llmx.quant import qtype


class ShapeFacts(Protocol):
    """What llama.cpp's type rules look at (a `llmx.plan.shapes.ModelShape` has it); read-only."""

    @property
    def arch(self) -> str: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def n_head_kv(self) -> int: ...
    @property
    def n_expert(self) -> int: ...
    @property
    def tied_embeddings(self) -> bool: ...


@dataclass(frozen=True)
class Recipe:
    name: str
    file_type: int  # general.file_type (llama_ftype; ik_llama.cpp numbering for its own types)
    base: str  # the type of every quantizable tensor that no rule singles out


RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("F16", 1, "F16"),
    Recipe("BF16", 32, "BF16"),
    Recipe("Q8_0", 7, "Q8_0"),
    Recipe("Q4_0", 2, "Q4_0"),
    Recipe("Q4_1", 3, "Q4_1"),
    Recipe("Q3_K_S", 11, "Q3_K"),
    Recipe("Q3_K_M", 12, "Q3_K"),
    Recipe("Q4_K_S", 14, "Q4_K"),
    Recipe("Q4_K_M", 15, "Q4_K"),
    Recipe("Q5_K_M", 17, "Q5_K"),
    Recipe("Q6_K", 18, "Q6_K"),
    Recipe("IQ4_XS", 30, "IQ4_XS"),
    Recipe("IQ4_KS", 145, "IQ4_KS"),
]}  # fmt: skip

# When a row is not a whole number of the chosen type's blocks (llama-quant.cpp tensor_type_fallback).
_FALLBACK = {
    "Q3_K": "Q4_0",
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
    "IQ4_XS": "IQ4_NL",
    "IQ4_KS": "IQ4_NL",
}


def assign_types(shape: ShapeFacts, raw: list[tuple[str, tuple[int, ...]]], recipe: str) -> list[TensorSpec]:
    """Give each (name, shape) its type under `recipe` and its exact byte size."""
    r = RECIPES[recipe.upper()]
    out = []
    for name, dims in raw:
        t = _type_for(shape, r, name, dims)
        out.append(TensorSpec(name, t, dims, qtype(t).nbytes(dims)))
    return out


def _quantizable(name: str, dims: tuple[int, ...]) -> bool:
    # llama.cpp quantizes 2-D and 3-D weights, never norms or the expert router.
    return len(dims) >= 2 and name.endswith(".weight") and "_norm." not in name and "ffn_gate_inp" not in name


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _type_for(s: ShapeFacts, r: Recipe, name: str, dims: tuple[int, ...]) -> str:
    if not _quantizable(name, dims):
        return "F32" if len(dims) == 1 or "ffn_gate_inp" in name else "F16"
    if r.base in ("F16", "BF16"):
        return r.base
    t = _mixed(s, r, name, dims)
    if dims[-1] % qtype(t).block_elems:
        t = _FALLBACK.get(t, "F16")
        if dims[-1] % qtype(t).block_elems:
            t = "F16"
    return t


def _mixed(s: ShapeFacts, r: Recipe, name: str, dims: tuple[int, ...]) -> str:
    """The per-category rules of llama_tensor_get_type_impl for the recipes in RECIPES."""
    f, t = r.name, r.base
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    n = s.n_layer
    gqa = s.n_head // max(s.n_head_kv, 1)
    eight_experts = s.n_expert == 8  # llama.cpp special-cases Mixtral-style 8-expert models
    is_70b = n == 80 and s.arch in ("llama", "qwen2")  # llama.cpp's LLM_TYPE_70B
    short = name.split(".")[-2]

    if name == "output.weight" or (s.tied_embeddings and name == "token_embd.weight"):
        if dims[-1] % qtype(t).block_elems:
            return "Q8_0"
        if f == "IQ4_KS" and s.tied_embeddings:
            return "IQ5_K"
        return t if t == "Q8_0" else "Q6_K"
    if name == "token_embd.weight":
        return t
    if short in ("attn_v", "attn_qkv", "attn_kv_b"):
        if f == "IQ4_KS":
            return "Q8_0" if s.n_expert >= 4 else "IQ5_K" if gqa >= 2 else t
        if f == "Q3_K_M":
            t = "Q5_K" if layer < 2 else "Q4_K"
        elif f == "IQ4_XS" and gqa >= 4:
            t = "Q5_K"
        elif f in ("Q4_K_M", "Q5_K_M") and _more_bits(layer, n):
            t = "Q6_K"
        elif f == "Q4_K_S" and layer < 4:
            t = "Q5_K"
        if is_70b and t in ("Q3_K", "Q4_K"):
            t = "Q5_K"  # 8 heads share attn_v in 70B models: more bits cost almost nothing
        return "Q8_0" if eight_experts else t
    if short == "attn_k":
        return "Q8_0" if eight_experts and f != "IQ4_KS" else t
    if short.startswith("ffn_down"):
        if f == "Q3_K_M":
            return "Q5_K" if layer < n // 16 else "Q4_K"
        if f in ("Q4_K_M", "Q5_K_M") and _more_bits(layer, n):
            return "Q6_K"
        if f == "Q4_K_S" and layer < n // 8:
            return "Q5_K"
        return t
    if short == "attn_output":
        k_mixes = ("Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M", "IQ4_XS")
        if eight_experts and f in k_mixes:
            return "Q5_K"
        if not eight_experts and f == "Q3_K_M":
            return "Q4_K"
    return t
