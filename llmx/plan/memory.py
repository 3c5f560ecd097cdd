"""Bytes that are not weights: the KV cache per layer and the compute (scratch) buffers per device.

The KV cache is exact arithmetic: K and V rows per token in the cache type (`-ctk`, `-ctv`), for a
context padded to 256 tokens as llama.cpp pads it (sliding-window layers are counted at the full
context, which errs high for Gemma-style models). Compute buffers are an estimate that errs high:
it adds up the activations of one physical batch (`-ub` tokens) that a device's layers produce,
where a graph allocator would reuse some of that memory.
"""

from __future__ import annotations

from llmx.plan.model import ModelSpec
from llmx.plan.options import Options
from llmx.quant import qtype

CTX_PAD = 256
F32 = 4


def context_length(model: ModelSpec, opts: Options) -> int:
    """-c, or the model's training context for -c 0, padded to whole 256-token cells."""
    ctx = opts.ctx_size or model.ctx_train
    return -(-ctx // CTX_PAD) * CTX_PAD


def kv_layer_bytes(model: ModelSpec, opts: Options) -> int:
    """One layer's K and V cache for the whole context."""
    ctx = context_length(model, opts)
    k = qtype(opts.cache_type_k).row_bytes(model.n_head_kv * model.head_dim_k) if model.head_dim_k else 0
    v = qtype(opts.cache_type_v).row_bytes(model.n_head_kv * model.head_dim_v) if model.head_dim_v else 0
    return ctx * (k + v)


def compute_bytes(
    model: ModelSpec, opts: Options, *, attention: bool, ffn: bool, output: bool, inp: bool
) -> int:
    """Scratch for one device: `attention`/`ffn` if it runs those ops, `output` if it computes the
    logits, `inp` if it looks up the token embeddings."""
    ub = opts.n_ubatch
    total = 0
    if attention or ffn:
        total += 4 * ub * model.n_embd * F32  # residual stream, normed input, op output, sum
    if attention:
        heads_k = model.head_dim_k or model.head_dim_v
        total += ub * (model.n_head + 2 * model.n_head_kv) * heads_k * F32  # q, k, v
        if opts.flash_attn == "off":
            # Without flash attention the scores (and their softmax) are materialized in f32.
            scores = 2 * ub * model.n_head * context_length(model, opts) * F32
            if opts.attn_max_batch:
                scores = min(scores, opts.attn_max_batch * 2**20)
            total += scores
        else:
            total += ub * model.n_head * max(model.head_dim_v, 128) * F32
    if ffn:
        width = max(model.n_ff, model.n_ff_exp * max(model.n_expert_used, 1))
        total += 2 * ub * width * F32  # gate and up activations
    if output:
        total += ub * model.n_vocab * F32  # worst case: logits for every token of the batch
    if inp:
        total += ub * model.n_embd * F32
    return total
