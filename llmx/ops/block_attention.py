"""Attention over cache rows stored as GGUF blocks (`-ctk q8_0` ...), dequantized a chunk of rows
at a time: the scores and the dequantized keys and values never cover more than CHUNK_ROWS keys, so
a long context costs no cache-sized float copy. Online softmax (running max and sum per query, as
flash attention keeps them) joins the chunks. The eager path for quantized caches: prompts on the
CPU, and the steps no fused kernel takes (on a GPU, prompt batches take the Triton flash kernel,
`kernels.prefill_attention`, which reads the blocks in place, unless `-fa off` or
`AttentionKernels.prefill` "off").
"""

from __future__ import annotations

import math

import torch

from llmx.quant import QType, kv_layout
from llmx.quant.torch_ops import dequantize

CHUNK_ROWS = 1024  # keys dequantized at once: scores T x H x 1024 floats, a few MB per 512-token batch


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    types: tuple[QType, QType],
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`ops.attention` of q [T, H, D] over N cache rows k, v [N, Hk, row] of `types` (K's, V's):
    uint8 GGUF blocks of a head's D values in their device's layout (`kv_layout`), or float rows).
    `mask` [T, N] (True = visible) or None.
    Returns [T, H * Dv] in q's dtype; scores, softmax and sums in float32."""
    t, n_head, head_dim = q.shape
    n, n_kv = k.shape[0], k.shape[1]
    group = n_head // n_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    qh = q.float().reshape(t, n_kv, group, head_dim).permute(1, 2, 0, 3).reshape(n_kv, group * t, head_dim)
    top = torch.full((n_kv, group * t, 1), float("-inf"), device=q.device)
    total = torch.zeros(n_kv, group * t, 1, device=q.device)
    acc = None
    for lo in range(0, n, CHUNK_ROWS):
        hi = min(lo + CHUNK_ROWS, n)
        keys, values = _rows(k[lo:hi], types[0]), _rows(v[lo:hi], types[1])  # [Hk, c, D]
        s = qh @ keys.transpose(1, 2)  # [Hk, G * T, c]
        s = softcap * torch.tanh(s * (scale / softcap)) if softcap is not None else s * scale
        if mask is not None:
            visible = mask[:, lo:hi].to(q.device).expand(group, t, hi - lo).reshape(1, group * t, hi - lo)
            s = s.masked_fill(~visible, float("-inf"))
        new_top = torch.maximum(top, s.amax(-1, keepdim=True))
        shift = torch.where(new_top == float("-inf"), 0.0, new_top)  # a query with no visible key yet
        p = torch.exp(s - shift)
        alpha = torch.exp(top - shift)
        total = total * alpha + p.sum(-1, keepdim=True)
        acc = p @ values if acc is None else acc * alpha + p @ values
        top = new_top
    assert acc is not None, "attention over no keys"
    out = (acc / total).reshape(n_kv, group, t, -1).permute(2, 0, 1, 3)
    return out.reshape(t, -1).to(q.dtype)


def _rows(raw: torch.Tensor, qt: QType) -> torch.Tensor:
    """Cache rows [c, Hk, row] of type `qt` (blocks in their device's layout, `kv_layout`) -> float32
    [Hk, c, D]."""
    c, n_kv = raw.shape[0], raw.shape[1]
    raw = kv_layout.gguf_rows(raw, qt)
    return dequantize(raw.reshape(c * n_kv, -1), qt).reshape(c, n_kv, -1).transpose(0, 1)
