"""Attention over a layer's KV cache: RoPE, the cache write, and grouped-query attention.

One-token steps on a GPU take the fused Triton decode attention ("auto"), and on the CPU a native
kernel (`llmx.kernels.cpu_attention`); prompt batches on a GPU take PyTorch's flash kernels.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

from llmx import settings
from llmx.kernels import has_triton
from llmx.ops.masks import ring_mask
from llmx.ops.rope import Rope

# "auto" as above; "off" keeps the eager ops everywhere (to compare), "on" takes the Triton kernel on
# the CPU too (tests, under TRITON_INTERPRET=1). Read once; tests set the module attribute.
FUSED_ATTENTION = settings.fused_attention()


class LayerKV(Protocol):
    """One layer's KV cache as a step sees it (`llmx.runtime.cache.KVCache.writer` makes one).

    Called with this step's k, v [T, Hk, D], it stores them at `positions` and returns the first
    `n_read` rows of keys and values for `attention`; the fused decode path writes the buffers itself.
    """

    k: torch.Tensor  # [rows, Hk, D] keys: of every position, or a ring of the latest ones
    v: torch.Tensor  # [rows, Hk, D] values
    positions: torch.Tensor  # [T] this step's positions, on the buffers' device
    n_read: int  # attention reads rows 0..n_read-1 (a ring: all its rows)

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def key_positions(self) -> torch.Tensor | None: ...


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
) -> torch.Tensor:
    """q [T, H, D] and k [T, Hk, D] rotated by `rope` (cos/sin from `Rope.tables`), k and v stored
    in `cache`, then `attention` over its first n_read rows: [T, H * D].

    `mask` (from `causal_mask`, for the eager path) and `window` (for the fused kernel) describe the
    same visibility. One token on a GPU takes `llmx.kernels.decode_attention`: two kernel launches
    instead of ~25 (see FUSED_ATTENTION).
    """
    if _fused_decode(q, v, cache):
        from llmx.kernels.decode_attention import decode_attention

        return decode_attention(
            q, k, v, cos, sin, cache.k, cache.v, cache.positions, cache.n_read,
            n_dims=rope.n_dims, neox=rope.neox, scale=scale, softcap=softcap, window=window,
        )  # fmt: skip
    if _native_cpu_step(q, cache, mask, softcap):
        from llmx.kernels import cpu_attention

        scale_ = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        out = cpu_attention.rope_decode_attention(q, k, v, rope, (cos, sin), cache, scale_)
        if out is not None:
            return out
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    keys, values = cache(k, v)
    ring = cache.key_positions()
    if ring is not None:  # a sliding-window layer's ring: rows are not in position order
        mask = ring_mask(cache.positions, ring, window).to(q.device)  # --no-kv-offload: from the CPU
    # A prompt batch ends at the last cached key, so its mask is causal aligned to the bottom right,
    # unless a sliding window cuts in; then a GPU can attend without materializing the scores.
    if q.is_cuda and q.shape[0] > 1 and softcap is None and (window is None or cache.n_read <= window):
        return causal_prompt_attention(q, keys, values, scale)
    return attention(q, keys, values, mask, scale, softcap)


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


def _fused_decode(q: torch.Tensor, v: torch.Tensor, cache: LayerKV) -> bool:
    """Whether the fused kernel can run this step: one token, everything on one device (not a GPU
    layer whose cache stays on the CPU), equal key and value widths, and Triton at hand."""
    if FUSED_ATTENTION == "off" or q.shape[0] != 1:
        return False
    if FUSED_ATTENTION == "auto" and not (q.is_cuda and has_triton()):
        return False
    one_device = q.device == cache.k.device == cache.v.device == cache.positions.device
    return one_device and q.shape[-1] == v.shape[-1] == cache.k.shape[-1] == cache.v.shape[-1]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Grouped-query attention of T queries over the N cached keys.

    q [T, H, D]; k, v [N, Hk, D]: the cache's first N rows, this step's keys included. `mask` [T, N]
    (True = visible) comes from `causal_mask`; None means every key is visible to every query.
    Returns [T, H * D].
    """
    t, n_head, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if _native_cpu_decode(q, k, mask, softcap):
        from llmx.kernels import cpu_attention

        out = cpu_attention.decode_attention(q, k, v, scale)
        if out is not None:
            return out
    # On a GPU attend in the cache's dtype (f16/bf16 tensor-core kernels, no cache-sized conversion);
    # on the CPU in float32, where half-precision math is slow.
    dtype = k.dtype if q.is_cuda else q.dtype
    qh, kh, vh = q.transpose(0, 1).to(dtype), k.transpose(0, 1).to(dtype), v.transpose(0, 1).to(dtype)
    if softcap is None:
        # Unmasked (a decode step over exactly its past): 4-D [batch, heads, tokens, dim] tensors,
        # which reach PyTorch's fused kernels (the CPU's flash attention: 3-5x faster per step than
        # the math path that 3-D tensors take). Masked prompts keep the math path, whose summation
        # order matches the float32 references' (tests/test_logits.py).
        if mask is None:
            qh, kh, vh = qh[None], kh[None], vh[None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        out = out[0] if mask is None else out
    else:  # logit soft-capping is outside SDPA's vocabulary: spell attention out
        group = n_head // kh.shape[0]
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
        scores = softcap * torch.tanh((qh @ kh.transpose(1, 2)) * scale / softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1) @ vh
    return out.transpose(0, 1).reshape(t, n_head * head_dim).to(q.dtype)


def _native_cpu_step(
    q: torch.Tensor, cache: LayerKV, mask: torch.Tensor | None, softcap: float | None
) -> bool:
    """Whether a CPU step's RoPE, cache write and attention can go to `cpu_attention` in one call: as
    `_native_cpu_decode`, with its cache on the CPU too."""
    return _native_cpu_decode(q, cache.k, mask, softcap) and cache.positions.device.type == "cpu"


def _native_cpu_decode(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, softcap: float | None
) -> bool:
    """Whether a CPU step takes `llmx.kernels.cpu_attention`: one float32 token seeing every key of
    its cache (not with FUSED_ATTENTION "off")."""
    if FUSED_ATTENTION == "off" or mask is not None or softcap is not None:
        return False
    return q.shape[0] == 1 and q.dtype == torch.float32 and not q.is_cuda and not k.is_cuda
