"""The tensors a model file holds, and the shape each one must have under its config.

Checked when a model opens, before any weight loads, so a file whose tensors disagree with its own
metadata (damaged, or converted wrongly) is one `LlmxError` line naming the file and the tensor, not
a failed matrix product later. Shapes are row-major (outermost first), as `llmx.gguf` reports them.
Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain

from llmx.errors import LlmxError, shown
from llmx.model_config import ModelConfig
from llmx.models.naming import group_key
from llmx.quant import QType

Shape = tuple[int, ...]

# Outside the layers: name -> shape. `output` is absent when it is tied to the token embeddings.
TOP: dict[str, Callable[[ModelConfig], Shape]] = {
    "token_embd": lambda c: (c.n_vocab, c.n_embd),
    "output": lambda c: (c.n_vocab, c.n_embd),
    "output_norm": lambda c: (c.n_embd,),
    "rope_freqs": lambda c: (c.rope_dims // 2,),
}
TOP_REQUIRED = ("token_embd", "output_norm")

# Inside each layer (`blk.N.` dropped, `_bias` for biases): short name -> shape.
LAYER: dict[str, Callable[[ModelConfig], Shape]] = {
    "attn_norm": lambda c: (c.n_embd,),
    "attn_q": lambda c: (c.n_head * c.head_dim, c.n_embd),
    "attn_k": lambda c: (c.n_head_kv * c.head_dim, c.n_embd),
    "attn_v": lambda c: (c.n_head_kv * c.head_dim_v, c.n_embd),
    "attn_output": lambda c: (c.n_embd, c.n_head * c.head_dim_v),
    "attn_q_bias": lambda c: (c.n_head * c.head_dim,),
    "attn_k_bias": lambda c: (c.n_head_kv * c.head_dim,),
    "attn_v_bias": lambda c: (c.n_head_kv * c.head_dim_v,),
    "attn_q_norm": lambda c: (c.head_dim,),
    "attn_k_norm": lambda c: (c.head_dim,),
    "post_attention_norm": lambda c: (c.n_embd,),
    "ffn_norm": lambda c: (c.n_embd,),
    "ffn_gate": lambda c: (c.n_ff, c.n_embd),
    "ffn_up": lambda c: (c.n_ff, c.n_embd),
    "ffn_down": lambda c: (c.n_embd, c.n_ff),
    # the router, and the routed experts stacked [expert, rows, columns]
    "ffn_gate_inp": lambda c: (c.n_expert, c.n_embd),
    "ffn_gate_exps": lambda c: (c.n_expert, c.expert_width, c.n_embd),
    "ffn_up_exps": lambda c: (c.n_expert, c.expert_width, c.n_embd),
    "ffn_down_exps": lambda c: (c.n_expert, c.n_embd, c.expert_width),
    # Qwen2-MoE's shared expert and its gate: one row (GGML's {n_embd}, as the converter writes it)
    "ffn_gate_inp_shexp": lambda c: (1, c.n_embd),
    "ffn_gate_shexp": lambda c: (c.n_ff_shexp, c.n_embd),
    "ffn_up_shexp": lambda c: (c.n_ff_shexp, c.n_embd),
    "ffn_down_shexp": lambda c: (c.n_embd, c.n_ff_shexp),
    "post_ffw_norm": lambda c: (c.n_embd,),
}

VECTOR_TYPES = ("F32", "F16", "BF16")  # norms and biases are read as floats


def check_tensors(
    source: str,
    config: ModelConfig,
    tensors: Iterable[tuple[str, QType, Shape]],
    layer_tensors: Iterable[str],
) -> None:
    """Raise LlmxError unless the file holds every tensor its architecture needs (`layer_tensors` in
    each layer), nothing it does not know, and each with the shape `config` implies and a type llmx
    computes with. (`ModelSpec.from_metadata` has already checked
    that the tensors fill exactly `n_layer` layers.)"""
    seen: set[tuple[int | None, str]] = set()
    for name, qt, shape in tensors:
        try:
            layer, short = group_key(name)
        except LlmxError as e:
            raise LlmxError(f"{source}: {e}") from None
        expected = (TOP if layer is None else LAYER).get(short)
        problem = None
        if expected is None:
            problem = f"is unexpected in a {config.arch} model"
        elif shape != (want := expected(config)):
            problem = f"has shape {list(shape)}; the metadata implies {list(want)}"
        elif len(shape) == 1 and qt.name not in VECTOR_TYPES:
            problem = f"is {qt.name}; a norm or bias must be F32, F16 or BF16"
        elif not qt.supported:
            problem = f"is {qt.name}, a type llmx cannot compute with yet"
        if problem:
            raise LlmxError(f"{source}: tensor {shown(name)} {problem}")
        seen.add((layer, short))
    # a generator: a damaged block_count can be huge, and the first gap is all the message needs
    top = ((None, n) for n in TOP_REQUIRED)
    required = chain(top, ((i, n) for i in range(config.n_layer) for n in layer_tensors))
    missing = next((key for key in required if key not in seen), None)
    if missing is not None:
        layer, short = missing
        name = f"{short}.weight" if layer is None else f"blk.{layer}.{short}.weight"
        raise LlmxError(f"{source}: tensor {name} is missing (the metadata states {config.n_layer} layers)")
