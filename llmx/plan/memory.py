"""Bytes that are not weights: the KV cache per layer and the compute (scratch) buffers per device.

The KV cache is exact arithmetic: K and V rows per token in the cache type (`-ctk`, `-ctv`), for a
context padded to 256 tokens as llama.cpp pads it; a sliding-window layer keeps a ring of
window + -ub positions (`kv_rows`). Compute buffers are an estimate meant to err
high: the peak bytes llmx's runtime allocates beyond weights and KV while it processes one physical
batch (`-ub` tokens) at the end of the context, term by term from what its ops allocate. `llmx
bench` measures the peak on each GPU beside it, and tests/test_memory_gpu.py checks it.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmx.plan.model import ModelSpec
from llmx.plan.options import Options
from llmx.quant import qtype

CTX_PAD = 256
F32 = 4
F16 = 2
MiB = 2**20
# What the runtime allocates (llmx.quant.choice, llmx.quant.triton.matmul, llmx.quant.weight):
GPU_DEQUANT_MIN_M = 16  # from this many rows a GPU matmul dequantizes the weight for cuBLAS ...
GPU_DEQUANT_CHUNK_BYTES = 128 * MiB  # ... this much of it at a time
CPU_DEQUANT_CHUNK_BYTES = 4 * MiB  # the CPU's float32 chunk of weight rows for a prompt matmul
# cuBLAS takes a workspace per stream it runs on: 32 MiB each on Hopper. Two: the compute stream
# and the one stream a GPU's CUDA graphs are captured on (`runtime.graphs.GraphCache._side_stream`).
CUBLAS_WORKSPACES = 2 * 32 * MiB
EXCHANGE_FLAGS = 64  # programs of an exchange kernel, each with its own flags (llmx.kernels.exchange)
STREAMED_LAYERS = 3


def context_length(model: ModelSpec, opts: Options) -> int:
    """-c, or the model's training context for -c 0, padded to whole 256-token cells."""
    ctx = opts.ctx_size or model.config.n_ctx_train
    return -(-ctx // CTX_PAD) * CTX_PAD


def kv_rows(model: ModelSpec, opts: Options, layer: int) -> int:
    """Positions layer `layer`'s cache holds: the whole context, or for a sliding-window layer a ring
    of window + -ub positions (a batch's first query still finds its window after the batch's own
    keys have been written)."""
    ctx, window = context_length(model, opts), model.config.window(layer)
    return ctx if window is None else min(ctx, window + opts.n_ubatch)


def kv_read_bytes(layers: Iterable[tuple[float, int]], n_kv: float) -> float:
    """K+V bytes a token reads over `n_kv` cached positions from caches given as (bytes a position,
    positions held) each: a sliding-window layer's ring holds fewer positions than the context, and
    a token reads at most those."""
    return sum(per_position * min(n_kv, rows) for per_position, rows in layers)


# The widest head the GPU's Triton prompt-attention kernel takes (`kernels.prefill_attention`: its
# tiles' shared memory); `ops.cached_attention` sends wider heads to PyTorch's kernels.
PREFILL_KERNEL_MAX_HEAD_DIM = 256


def score_heads(n_head: int, n_queries: int, n_keys: int, max_bytes: int) -> int:
    """Query heads whose float32 scores [heads, n_queries, n_keys] attention computes at once: all of
    them, or under `-amb` (`max_bytes`; 0 = no cap) as many as keep the scores within it, at least one
    (ik_llama.cpp's --attention-max-batch splits the `-fa off` path's heads the same way)."""
    if not max_bytes:
        return n_head
    return max(1, min(n_head, max_bytes // (n_queries * n_keys * F32)))


def kv_layer_bytes(model: ModelSpec, opts: Options, layer: int) -> int:
    """Layer `layer`'s K and V cache."""
    c = model.config
    k = qtype(opts.cache_type_k).row_bytes(c.n_head_kv * c.head_dim) if c.head_dim else 0
    v = qtype(opts.cache_type_v).row_bytes(c.n_head_kv * c.head_dim_v) if c.head_dim_v else 0
    return kv_rows(model, opts, layer) * (k + v)


def compute_bytes(
    model: ModelSpec, opts: Options, *, attention: bool, ffn: bool, output: bool, inp: bool, gpu: bool
) -> int:
    """Scratch for one device: `attention`/`ffn` if it runs those ops, `output` if it computes the
    logits, `inp` if it looks up the token embeddings; `gpu` for a GPU (whose kernels differ).

    Terms follow what llmx's runtime allocates for one physical batch (`-ub` tokens) at the end of
    the context. The attention and FFN phases of a block never overlap, so the larger of the two
    counts, on top of the residual stream that lives through both.
    """
    ub, ctx = opts.n_ubatch, context_length(model, opts)
    total = 0
    if attention or ffn:
        total += 4 * ub * model.config.n_embd * F32  # residual stream, normed input, op output, sum
        flash = opts.flash_attn != "off"  # -fa off: every device attends over stored scores
        max_scores = opts.attn_max_batch * MiB if opts.flash_attn == "off" else 0  # -amb: -fa off's cap
        blocks = not all(qtype(t).is_float for t in (opts.cache_type_k, opts.cache_type_v))
        attn = _attention_bytes(model, ub, ctx, flash, gpu, max_scores, blocks) if attention else 0
        total += max(attn, 2 * ub * _ffn_width(model) * F32 if ffn else 0)  # gate and up (silu in place)
        total += _matmul_bytes(model, ub, gpu)
        if gpu:
            total += CUBLAS_WORKSPACES
    if output:
        total += ub * model.config.n_vocab * F32  # worst case: logits for every token of the batch
    if inp:
        total += ub * model.config.n_embd * F32
    return total


def exchange_bytes(model: ModelSpec, opts: Options, n_gpus: int) -> int:
    """What each GPU of a `-sm row` split holds to add partial sums across the GPUs: a receive slot
    of one batch's hidden states from every GPU, twice (`llmx.kernels.exchange`), and its flags."""
    return 2 * n_gpus * opts.n_ubatch * model.config.n_embd * F32 + EXCHANGE_FLAGS * (2 * n_gpus + 1) * 4


def stream_bytes(model: ModelSpec, cpu_layers: list[int]) -> int:
    """Op offload's share of the streaming GPU: prompt batches of the CPU layers run there with the
    layers' weights copied over, one ahead of the compute, so about STREAMED_LAYERS at a time (the
    allocator reuses a layer's blocks only once the compute stream is past it)."""
    per_layer = dict.fromkeys(cpu_layers, 0)
    for t in model.tensors:
        if t.layer in per_layer:
            per_layer[t.layer] += t.nbytes
    return STREAMED_LAYERS * max(per_layer.values(), default=0)


def _ffn_width(model: ModelSpec) -> int:
    """The widest FFN activation a token makes: the dense FFN's, or its k routed experts' side by side."""
    c = model.config
    return max(c.n_ff, c.expert_width * max(c.n_expert_used, 1))


def _attention_bytes(
    model: ModelSpec, ub: int, ctx: int, flash: bool, gpu: bool, max_scores: int, blocks: bool
) -> int:
    """The attention phase of one block for `ub` queries over a full cache of `ctx` positions on a GPU
    or the CPU (`gpu`); `flash`: PyTorch's flash or memory-efficient kernels, which never store the
    scores; otherwise the scores of `score_heads` heads at a time (`max_scores`: -amb in bytes);
    `blocks`: K or V cached as GGUF blocks."""
    c = model.config
    h, hk = c.n_head, c.n_head_kv
    d = max(c.head_dim, c.head_dim_v)
    total = ub * (h + 2 * hk) * d * F32  # q, k, v
    total += 3 * ub * h * d * F32  # RoPE's rotated halves and products
    total += 2 * (1 << max(8, (ctx - 1).bit_length())) * (d // 2) * F32  # RoPE tables, kept
    total += 3 * ub * h * d * F32  # the output, in the cache's dtype, then float, then reshaped
    if flash and not gpu:
        # The CPU's flash kernel (`ops.cached_attention.cpu_flash_attention`): K and V in f32, the
        # mask in bool and as the float bias the kernel adds (made twice over); no scores.
        return total + ctx * 2 * hk * d * F32 + ub * ctx * (1 + 2 * F32)
    if flash and c.head_dim == c.head_dim_v <= PREFILL_KERNEL_MAX_HEAD_DIM:
        # The GPU's Triton flash kernel (`kernels.prefill_attention`): the cache read in place, every
        # window and ring included, no scores; block rows converted first into f16 copies for a
        # prompt of many query tiles (`DEQUANTIZE_FIRST_TILES`; counted whatever the batch).
        return total + (ctx * hk * (c.head_dim + c.head_dim_v) * F16 if blocks and gpu else 0)
    if flash and not (c.sliding_window and c.sliding_window < ctx):
        # PyTorch's fused causal kernels (heads wider than the Triton kernel's): no scores; after the
        # first batch of a sequence K and V are repeated to every query head (the bottom-right causal
        # variant needs it).
        return total + 2 * ctx * h * d * F16 + ub * h * d * F16
    # The masked math path (the CPU, a GPU's sliding-window layers, -fa off), a chunk of heads at a
    # time: q, K and V in f32, K and V repeated to the chunk's query heads and K scaled, then per
    # score the product, its softmax, the NaN-safe select over it and a bool (13 bytes), plus the
    # mask in bool and float.
    chunk = score_heads(h, ub, ctx, max_scores)
    total += ctx * (2 * hk + 3 * chunk) * d * F32
    return total + 13 * chunk * ub * ctx + ub * ctx * (1 + F32)


def _matmul_bytes(model: ModelSpec, ub: int, gpu: bool) -> int:
    """A matmul's own scratch beyond its output, at `ub` rows. GPU: from 16 rows the weight is
    dequantized DEQUANT_CHUNK_BYTES of half-precision rows at a time, with x in fp16 and the
    output transposed, converted and scaled. CPU: one chunk of float32 rows and a transposed output."""
    widest = max((t.shape[0] for t in model.tensors if t.is_matrix and t.layer is not None), default=0)
    deepest = max((t.shape[1] for t in model.tensors if t.is_matrix and t.layer is not None), default=0)
    if not gpu:
        return CPU_DEQUANT_CHUNK_BYTES + 2 * ub * widest * F32
    if ub < GPU_DEQUANT_MIN_M:
        return 0
    return GPU_DEQUANT_CHUNK_BYTES + ub * deepest * F16 + ub * widest * (F16 + 2 * F32)
