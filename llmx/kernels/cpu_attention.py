"""One CPU token attending over its whole cache, in one native call (`llmx/quant/cpu_blocks.c`).

PyTorch's flash attention on the CPU wants float32 keys and values, so a decode step converted the
cache (f16 by default) to float32 in every layer at every token, and paid ~25 µs of dispatch even
over a handful of keys. The native kernel reads each key and value once, in the cache's own type,
and converts each row once for all the query heads of its group: on 2 cores at SmolLM2's shapes
(9 heads, 3 KV heads, 64 dims, f16 cache) 11-37 µs a layer from 1 to 511 cached keys, against
26-242 µs for the flash path (bench/RESULTS.md). It replaces a torch.compile'd kernel that took
seconds to compile in the middle of a generation and ~100 µs of dispatch a call.

`rope_decode_attention` does a whole decode step's attention in that one call: RoPE on q and k,
the cache write and the attention (some twenty torch ops and their dispatch, ~50 µs a layer, before).
`paged_rope_decode_attention` does the same for the decode tokens of a batch over the paged cache,
all sequences in one call a layer (before: a gather of each sequence's rows, its stores and its
attention call, ~180 µs a sequence and layer of SmolLM2 in Python and torch).

Where the native kernels cannot be built, or for shapes they do not take, the caller keeps the
flash path.
"""

from __future__ import annotations

import torch

from llmx.quant import QType, cpu_native


def _kv_types(k: torch.Tensor, v: torch.Tensor, types: tuple[QType, QType] | None) -> tuple[str, str] | None:
    """The native cache types of k and v: of `types` (GGUF blocks among them), or of float buffers'
    dtypes (types None); None for a type the kernel lacks."""
    names = (cpu_native.FLOAT_KV.get(k.dtype), cpu_native.FLOAT_KV.get(v.dtype)) if types is None else (
        types[0].name, types[1].name)  # fmt: skip
    return (names[0], names[1]) if all(n in cpu_native.KV_TYPES for n in names) else None


def _takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, types: tuple[str, str] | None) -> bool:
    """Whether the native kernel takes q [1, H, D] over cache rows k, v [N, Hk, row] of `types`."""
    return q.shape[1] % k.shape[1] == 0 and _cache_takes(k, v, types, q.shape[2])


def _cache_takes(k: torch.Tensor, v: torch.Tensor, types: tuple[str, str] | None, head_dim: int) -> bool:
    """Whether the native kernel reads cache rows k, v [N, Hk, row] of `types` (None: a type it lacks)
    with heads of `head_dim` values."""
    blocks = any(t not in cpu_native.FLOAT_KV.values() for t in types or ())
    return (
        types is not None
        and head_dim % (32 if blocks else 8) == 0
        and head_dim <= cpu_native.MAX_HEAD_DIM
        and k.is_contiguous()
        and v.is_contiguous()
        and cpu_native.available()
    )


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q [1, H, D] float32 over float cache rows k, v [N, Hk, D] (every key visible) -> [1, H * D]
    float32, or None where the native kernel does not take this step."""
    types = _kv_types(k, v, None)
    if not (_takes(q, k, v, types) and k.shape[-1] == v.shape[-1] == q.shape[-1]):
        return None
    assert types is not None
    return cpu_native.decode_attention(q, k, v, types, scale)


def prepare(
    kc: torch.Tensor, vc: torch.Tensor, types: tuple[QType, QType] | None, dims: tuple[int, int],
    rotation: tuple[int, int],
) -> cpu_native.Attention | None:  # fmt: skip
    """The native decode step of a layer's cache kc, vc [rows, Hk, row] (`types`: the cache's where either
    is GGUF blocks, else None; `dims`: the values a key head and a value head hold; `rotation`: its
    Walsh-Hadamard blocks, `ops.hadamard`), made once with the cache: None where the kernel does not take
    it (not on the CPU, a type or head width it lacks, unequal key and value widths)."""
    names = _kv_types(kc, vc, types)
    if kc.is_cuda or vc.is_cuda or dims[0] != dims[1] or not _cache_takes(kc, vc, names, dims[0]):
        return None
    assert names is not None
    return cpu_native.Attention(kc, vc, names, dims[0], rotation)


def rope_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, neox: bool, cos: torch.Tensor, sin: torch.Tensor,
    native: cpu_native.Attention, position: int, window: int | None, scale: float,
) -> torch.Tensor | None:  # fmt: skip
    """`ops.rope_attention` for one float32 token on the CPU over the cache `native` was prepared for
    (`prepare`; a sliding-window layer's ring too), seeing every key up to its `position` (the last
    `window` of them, for a sliding window): q [1, H, D], k and v [1, Hk, D] this step's, cos and sin
    [1, n_dims / 2] its RoPE angles (NeoX halves or adjacent pairs) -> [1, H * D], k rotated and stored
    with v in the row of `position`; None (nothing written) where the kernel does not take it. Only the
    cache (`runtime.cache.LayerWriter`) calls it; its caller has checked that the head widths of q, k,
    v and the cache agree."""
    if q.shape[1] % native.n_kv != 0 or not native.takes(position, window):
        return None
    return native(q, k, v, cos, sin, neox, position, window, scale)


def paged_rope_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, neox: bool, cos: torch.Tensor, sin: torch.Tensor,
    k_pool: torch.Tensor, v_pool: torch.Tensor, types: tuple[QType, QType] | None, tables: torch.Tensor,
    block_rows: int, positions: torch.Tensor, window: int | None, scale: float, rotation: tuple[int, int],
) -> torch.Tensor | None:  # fmt: skip
    """`rope_decode_attention` for one float32 token of each of B sequences over a paged cache on the
    CPU (`runtime.paged.DecodeTokens`, which checked the head widths): q [B, H, D], k and v [B, Hk, D],
    cos and sin [B, n_dims / 2], sequence b's blocks tables[b] (int32) and position positions[b]
    (int64) -> [B, H * D], in the pools' Walsh-Hadamard `rotation`; None (nothing written) where the
    native kernel does not take it."""
    names = _kv_types(k_pool, v_pool, types)
    if not _takes(q, k_pool, v_pool, names):
        return None
    assert names is not None
    return cpu_native.paged_rope_store_attend(
        q, k, v, cos, sin, neox, k_pool, v_pool, names, tables, block_rows, positions, window, scale, rotation
    )
