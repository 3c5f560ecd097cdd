"""Attention over a layer's KV cache: RoPE, the cache write, and grouped-query attention.

Which kernels run is an `AttentionKernels` value, chosen once at load and held by the cache (whose
layer object runs the fused ones, being the only writer of its buffers): with `-fa on`/`auto`
one-token steps take the fused kernels (Triton on a GPU, native on the CPU), and prompt batches on a
GPU Triton's flash kernel (`kernels.prefill_attention`: every cache type, float or GGUF blocks read
in place, GQA without copying the cache per group, sliding windows, rings and soft-capping), on the
CPU PyTorch's flash kernel (a long context never stores a prompt batch's scores; `block_attention`
for block caches); with `-fa off` attention materializes the scores, as llama.cpp's does (a chunk of
heads at a time: `-amb`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmx.ops.block_attention import block_attention
from llmx.ops.hadamard import rotate, rotate_qkv
from llmx.ops.masks import ring_mask
from llmx.ops.norms import HeadNorms
from llmx.ops.rope import Rope
from llmx.plan.memory import PREFILL_KERNEL_MAX_HEAD_DIM, score_heads
from llmx.quant import QType
from llmx.quant.triton.launch import has_triton


@dataclass(frozen=True)
class AttentionKernels:
    """How attention runs, chosen once at load (`choose`) and held by the KV cache.

    `flash`: PyTorch's fused attention (flash, memory-efficient; scores never stored), llama.cpp's
    `-fa on`/`auto`; False: the math path, scores materialized in float32 (`-fa off`).
    `decode`, for one-token steps: "auto" the fused kernels (RoPE, cache write and attention: Triton
    on a GPU, native on the CPU); "on" the Triton kernel on the CPU too (tests, TRITON_INTERPRET=1);
    "off" PyTorch's ops.
    `prefill`, for prompt batches with `flash`: "auto" the Triton flash kernel on a GPU
    (`kernels.prefill_attention`); "on" on the CPU too (tests, TRITON_INTERPRET=1); "off" PyTorch's
    SDPA for float caches and `block_attention` for block caches (the path before the kernel).
    `max_score_bytes`: with `-fa off`, the math path's cap on the scores it stores at once (`-amb`,
    0 = none): it attends `plan.memory.score_heads` query heads at a time.
    """

    flash: bool = True
    decode: str = "auto"
    max_score_bytes: int = 0
    prefill: str = "auto"

    @classmethod
    def choose(cls, flash_attn: str, fused: str, max_batch_mib: int = 0) -> AttentionKernels:
        """From `-fa` (on/off/auto), LLMX_FUSED_ATTENTION and `-amb` (MiB): `-fa off` turns the fused
        decode kernels off too (they never store the scores either); `-amb` caps only `-fa off`'s
        scores, as in ik_llama.cpp (the fused kernels store none)."""
        if flash_attn == "off":
            return cls(flash=False, decode="off", max_score_bytes=max_batch_mib * 2**20)
        return cls(flash=True, decode=fused)


DEFAULT_KERNELS = AttentionKernels()  # -fa auto, LLMX_FUSED_ATTENTION auto


class LayerKV(Protocol):
    """One layer's KV cache as a step sees it (`llmx.runtime.cache.KVCache.writer` makes one).

    It is the only writer of its buffers. Called with this step's k, v [T, Hk, D], it stores them
    at `positions` and returns the first `n_read` rows of keys and values for `attention`;
    `rope_store_attend` does RoPE, the write and the attention in one fused kernel where one takes
    the step.
    """

    k: torch.Tensor  # [rows, Hk, D] keys: of every position, or a ring of the latest ones
    v: torch.Tensor  # [rows, Hk, D] values
    positions: torch.Tensor  # [T] this step's positions, on the buffers' device
    n_read: int  # attention reads rows 0..n_read-1 (a ring: all its rows)
    kernels: AttentionKernels
    types: tuple[QType, QType] | None  # K's and V's types where either is GGUF blocks, whose raw rows
    # `block_attention` reads; None: float buffers
    rotation: tuple[int, int]  # Walsh-Hadamard blocks of keys and values as stored (`ops.hadamard`)

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def key_positions(self) -> torch.Tensor | None: ...

    def rope_store_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope, cos: torch.Tensor,
        sin: torch.Tensor, mask: torch.Tensor | None, window: int | None, scale: float | None,
        softcap: float | None, norms: HeadNorms | None = None,
    ) -> torch.Tensor | None: ...  # fmt: skip


def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: Rope,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: LayerKV,
    mask: torch.Tensor | None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    norms: HeadNorms | None = None,
) -> torch.Tensor:
    """q [T, H, D] and k [T, Hk, D] normalized per head by `norms` where given, rotated by `rope`
    (cos/sin from `Rope.tables`), k and v stored in `cache`, then `attention` over its first n_read
    rows: [T, H * D].

    `mask` (from `causal_mask`, for the eager path) and `window` (for the fused kernel) describe the
    same visibility. A one-token step goes to the cache's fused kernel where one takes it (one
    launch on a GPU, the norms in it, instead of ~25; see `AttentionKernels`). A cache that stores
    its rows rotated (`cache.rotation`) gets them so, q alike, and the output is rotated back.
    """
    out = cache.rope_store_attend(q, k, v, rope, cos, sin, mask, window, scale, softcap, norms)
    if out is not None:
        return out
    if norms is not None:
        q, k = norms(q, k)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    q, k, v = rotate_qkv(q, k, v, cache.rotation)
    return rotate(cached_attention(q, k, v, cache, mask, window, scale, softcap), cache.rotation[1])


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKV,
    mask: torch.Tensor | None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`rope_attention` after RoPE, on the eager path: k and v stored in `cache`, then attention over
    its first n_read rows: q [T, H, D], k and v [T, Hk, D] -> [T, H * D]."""
    keys, values = cache(k, v)
    ring = cache.key_positions()
    if flash_prefill(q, keys, values, cache):
        from llmx.kernels.prefill_attention import prefill_attention

        return prefill_attention(
            q, keys, values, cache.positions, types=cache.types, key_positions=ring, window=window,
            scale=scale, softcap=softcap,
        )  # fmt: skip
    if ring is not None:  # a sliding-window layer's ring: rows are not in position order
        mask = ring_mask(cache.positions, ring, window).to(q.device)  # --no-kv-offload: from the CPU
    if cache.types is not None:
        return block_attention(q, keys, values, cache.types, mask, scale, softcap)
    # Without the Triton kernel (`prefill` "off"): a prompt batch ends at the last cached key, so its
    # mask is causal aligned to the bottom right, unless a sliding window cuts in; then a GPU can
    # attend without materializing the scores.
    whole = window is None or cache.n_read <= window
    if cache.kernels.flash and q.is_cuda and q.shape[0] > 1 and softcap is None and whole:
        return causal_prompt_attention(q, keys, values, scale)
    return attention(q, keys, values, mask, scale, softcap, cache.kernels)


def flash_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cache: LayerKV) -> bool:
    """Whether a step takes the Triton flash kernel (`kernels.prefill_attention`): a prompt batch
    (T > 1) with `-fa on`/`auto` on a GPU (anywhere with `prefill` "on"), its keys and values heads
    of q's width (at most PREFILL_KERNEL_MAX_HEAD_DIM), and Triton at hand."""
    mode = cache.kernels.prefill
    if not cache.kernels.flash or mode == "off" or q.shape[0] < 2:
        return False
    if mode == "auto" and not (q.is_cuda and has_triton()):
        return False
    types = cache.types or (None, None)
    widths = [_head_width(x, qt) for x, qt in zip((keys, values), types, strict=True)]
    narrow = q.shape[-1] <= PREFILL_KERNEL_MAX_HEAD_DIM
    return narrow and widths == [q.shape[-1]] * 2 and keys.device == values.device == q.device


def _head_width(rows: torch.Tensor, qt: QType | None) -> int:
    """The values a head holds in cache rows [N, Hk, row] of type `qt` (None: float)."""
    if qt is None or qt.is_float:
        return rows.shape[-1]
    return rows.shape[-1] // qt.block_bytes * qt.block_elems


def causal_prompt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """`attention` for T queries at the last T of N positions, each seeing the keys up to its own.

    On a GPU this is PyTorch's flash or memory-efficient kernel (the mask is implicit, the scores are
    never stored: -ub x context x heads x ~13 bytes on the math path); on the CPU it falls back to
    the masked math path. q [T, H, D], k and v [N, Hk, D] -> [T, H * D].
    """
    from torch.nn.attention.bias import causal_lower_right

    t, n_head, head_dim = q.shape
    n_keys, n_head_kv = k.shape[0], k.shape[1]
    dtype = k.dtype if q.is_cuda else q.dtype
    qh = q.transpose(0, 1)[None].to(dtype)
    kh, vh = k.transpose(0, 1)[None].to(dtype), v.transpose(0, 1)[None].to(dtype)
    if t == n_keys:  # the first batch of a sequence: plain causal, GQA done by the kernel
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:  # the bottom-right variant reaches the fused kernels only with one K/V head per query head
        group = n_head // n_head_kv
        kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(t, n_keys), scale=scale)
    return out[0].transpose(0, 1).reshape(t, n_head * head_dim).to(q.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
    kernels: AttentionKernels = DEFAULT_KERNELS,
) -> torch.Tensor:
    """Grouped-query attention of T queries over the N cached keys, with `kernels`.

    q [T, H, D]; k, v [N, Hk, D]: the cache's first N rows, this step's keys included. `mask` [T, N]
    (True = visible) comes from `causal_mask`; None means every key is visible to every query.
    Returns [T, H * D].
    """
    t, n_head, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if softcap is not None or not kernels.flash:  # outside SDPA's vocabulary, or -fa off
        return math_attention(q, k, v, mask, scale, softcap, kernels.max_score_bytes)
    if kernels.decode != "off" and native_cpu_decode(q, k, mask):
        from llmx.kernels import cpu_attention

        out = cpu_attention.decode_attention(q, k, v, scale)
        if out is not None:
            return out
    # On a GPU attend in the cache's dtype (f16/bf16 tensor-core kernels, no cache-sized conversion);
    # on the CPU in float32, where half-precision math is slow.
    dtype = k.dtype if q.is_cuda else q.dtype
    qh, kh, vh = q.transpose(0, 1).to(dtype), k.transpose(0, 1).to(dtype), v.transpose(0, 1).to(dtype)
    if mask is not None and not q.is_cuda:
        out = cpu_flash_attention(qh, kh, vh, mask, scale)
    elif mask is None:
        # Unmasked (a decode step over exactly its past): 4-D [batch, heads, tokens, dim] tensors,
        # which reach PyTorch's fused kernels (the CPU's flash attention: 3-5x faster per step than
        # the math path that 3-D tensors take).
        out = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], scale=scale, enable_gqa=True)[0]
    else:  # a GPU's masked prompt without the Triton kernel (a sliding window SDPA's causal path lacks)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1).reshape(t, n_head * head_dim).to(q.dtype)


def cpu_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [H, T, D] over k, v [Hk, N, D] on the CPU, `mask` [T, N]: PyTorch's CPU flash kernel, which
    walks the keys in tiles, so a prompt batch over a long cache never holds its [H, T, N] scores (the
    math path's 13 bytes a score: 4 GiB for 512 tokens of a 32-head model over 32K keys). Each KV
    head is broadcast to its group of query heads (stride 0, no copy), which the kernel reads as 4-D
    [Hk, group, T, D]. Returns [H, T, Dv]."""
    n_head, t, head_dim = q.shape
    n_kv, n = k.shape[0], k.shape[1]
    group = n_head // n_kv
    qg = q.reshape(n_kv, group, t, head_dim)
    kg, vg = k[:, None].expand(n_kv, group, n, head_dim), v[:, None].expand(n_kv, group, n, v.shape[-1])
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # never the math path, whose scores this avoids
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
    return out.reshape(n_head, t, -1)


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    max_score_bytes: int = 0,
) -> torch.Tensor:
    """`attention` spelled out, the scores [heads, T, N] materialized in float32 (llama.cpp's attention
    without `-fa`): softmax(softcap(q k^T * scale), masked) v, for `score_heads` query heads at a
    time (all of them unless `max_score_bytes`, -amb, caps the scores). Shapes as `attention`'s."""
    t, n_head, head_dim = q.shape
    group = n_head // k.shape[1]
    step = score_heads(n_head, t, k.shape[0], max_score_bytes)
    qh, kh, vh = (x.transpose(0, 1) for x in (q, k, v))
    chunks = []
    for h0 in range(0, n_head, step):
        kv_heads = torch.arange(h0, min(h0 + step, n_head), device=k.device) // group  # GQA: each head's K/V
        scores = (qh[h0 : h0 + step].float() @ kh[kv_heads].float().transpose(1, 2)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        chunks.append(scores.softmax(-1) @ vh[kv_heads].float())
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    return out.transpose(0, 1).reshape(t, n_head * head_dim).to(q.dtype)


def native_cpu_decode(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a CPU step may take `llmx.kernels.cpu_attention`: one float32 token seeing every key
    of its cache (unless the kernels' `decode` is "off")."""
    if mask is not None:
        return False
    return q.shape[0] == 1 and q.dtype == torch.float32 and not q.is_cuda and not k.is_cuda
