"""KV cache: one key and one value buffer per layer, allocated on that layer's device.

Buffers are [n_ctx, Hk, D] in the cache type (`-ctk`/`-ctv`); attention reads the valid prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmx.errors import LlmxError

CACHE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def cache_dtype(name: str) -> torch.dtype:
    try:
        return CACHE_DTYPES[name]
    except KeyError:
        raise LlmxError(
            f"KV cache type {name!r} is not supported by the runtime yet; use one of "
            f"{', '.join(CACHE_DTYPES)}"
        ) from None


@dataclass(frozen=True)
class LayerShape:
    """What one layer stores per token: Hk heads of `k_dim` keys and `v_dim` values."""

    n_head_kv: int
    k_dim: int
    v_dim: int
    device: str


class KVCache:
    def __init__(
        self, n_ctx: int, layers: list[LayerShape], type_k: str = "f16", type_v: str = "f16"
    ) -> None:
        self.n_ctx = n_ctx
        dk, dv = cache_dtype(type_k), cache_dtype(type_v)
        self.k = [torch.zeros(n_ctx, s.n_head_kv, s.k_dim, dtype=dk, device=s.device) for s in layers]
        self.v = [torch.zeros(n_ctx, s.n_head_kv, s.v_dim, dtype=dv, device=s.device) for s in layers]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def writer(self, layer: int, positions: torch.Tensor, n_read: int) -> LayerWriter:
        """Layer `layer`'s cache for a step at `positions` that reads the first `n_read` rows."""
        kc = self.k[layer]
        if positions.device != kc.device:  # --no-kv-offload: a GPU layer's cache lives on the CPU
            positions = positions.to(kc.device)
        return LayerWriter(kc, self.v[layer], positions, n_read)


@dataclass(frozen=True)
class LayerWriter:
    """One layer's buffers [n_ctx, Hk, D] and this step's `positions` (a tensor on their device, so
    writes need no host sync and can sit in a CUDA graph); an `llmx.ops.LayerKV`."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    n_read: int

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v [T, Hk, D]; the first `n_read` rows, on k's device, for attention."""
        self.k.index_copy_(0, self.positions, k.to(self.k.device, self.k.dtype))
        self.v.index_copy_(0, self.positions, v.to(self.v.device, self.v.dtype))
        return self.k[: self.n_read].to(k.device), self.v[: self.n_read].to(v.device)
