"""KV cache: one key and one value buffer per layer, allocated on that layer's device.

Buffers are [rows, Hk, D] in the cache type (`-ctk`/`-ctv`, K and V each their own): float
numbers, or for the block types (q8_0, q4_0, ...) uint8 [rows, Hk, D / 32 * block bytes], each
head's D values as GGUF blocks, so the sizes are llama.cpp's and the plan's. On the CPU a head holds
GGUF's bytes in GGUF's order (the native kernel reads them); on a GPU the same bytes grouped by
field, the head's scales first and its codes last, for the Triton kernels
(`llmx.quant.kv_layout`). `store_rows` writes either, and rows read onto another device (or
dequantized by `ops.block_attention`) are converted there. Rows are the whole
context, or for a sliding-window layer a ring of the plan's `kv_rows` (position p in row p mod
rows). Attention reads the valid prefix, or the whole ring with each row's position.

The cache is the only writer of its buffers: a step's keys and values go in through its layer
object (`LayerWriter`), either stored by it or by the fused kernel it runs (`rope_store_attend`),
which rotates, stores and attends in one call. It holds the attention kernels chosen at load.
Block types are quantized as they are stored (by the fused kernels, or by `BlockWriter` for the
step's rows only: `store_rows`, on a GPU one launch, `kernels.cache_store`) and dequantized by the
kernels that read them; their heads are stored rotated by a Walsh-Hadamard matrix, queries and outputs
rotated to match (`ops.hadamard`, `KVCache.rotation`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmx.errors import LlmxError
from llmx.ops.cached_attention import DEFAULT_KERNELS, AttentionKernels, native_cpu_decode
from llmx.ops.hadamard import kv_rotation
from llmx.ops.norms import HeadNorms
from llmx.ops.rope import Rope
from llmx.quant import F16, QType, kv_layout, qtype
from llmx.quant.cpu_native import Attention as NativeAttention
from llmx.quant.quantize import KV_BLOCK_TYPES, quantize
from llmx.quant.torch_ops import FLOAT_DTYPES
from llmx.quant.triton.launch import has_triton

BIND = "bind"  # a `LayerWriter` made without its cache's native step binds its own
CACHE_TYPES = tuple(name.lower() for name in (*FLOAT_DTYPES, *KV_BLOCK_TYPES))  # what the runtime holds


def cache_type(name: str) -> QType:
    if name not in CACHE_TYPES:
        supported = ", ".join(CACHE_TYPES)
        raise LlmxError(f"KV cache type {name!r} is not supported by the runtime; use one of {supported}")
    return qtype(name)


def head_dim(buffer: torch.Tensor, qt: QType) -> int:
    """The values a head holds in a row of `buffer` [rows, Hk, row] of type `qt`."""
    return buffer.shape[-1] if qt.is_float else buffer.shape[-1] // qt.block_bytes * qt.block_elems


def kv_buffer(rows: int, n_head_kv: int, dim: int, qt: QType, device: str | torch.device) -> torch.Tensor:
    """A zeroed cache buffer [rows, Hk, row] of type `qt`: floats, or each head's values as GGUF blocks."""
    if qt.is_float:
        return torch.zeros(rows, n_head_kv, dim, dtype=FLOAT_DTYPES[qt.name], device=device)
    return torch.zeros(rows, n_head_kv, qt.row_bytes(dim), dtype=torch.uint8, device=device)


def store_rows(buffer: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, qt: QType | None = None) -> None:
    """Write x [T, Hk, D] into rows `slots` of `buffer`, quantized first where `qt` is a block type
    (in the layout of the buffer's device, `kv_layout`; None or a float type: converted to the
    buffer's dtype). The cache's one way in: on a GPU, a block type's rows in one Triton launch."""
    if qt is not None and not qt.is_float and buffer.is_cuda and x.device == buffer.device and has_triton():
        from llmx.kernels import cache_store

        cache_store.store(buffer, slots, x, qt)
        return
    stored = x if qt is None or qt.is_float else kv_layout.stored(quantize(x, qt), qt, buffer.device)
    buffer.index_copy_(0, slots, stored.to(buffer.device, buffer.dtype))


@dataclass(frozen=True)
class LayerShape:
    """What one layer stores per token: Hk heads of `k_dim` keys and `v_dim` values."""

    n_head_kv: int
    k_dim: int
    v_dim: int
    device: str
    rows: int = 0  # positions kept: 0 = the whole context; fewer = a ring (sliding-window layers)


class KVCache:
    def __init__(
        self,
        n_ctx: int,
        layers: list[LayerShape],
        type_k: str = "f16",
        type_v: str = "f16",
        kernels: AttentionKernels = DEFAULT_KERNELS,
    ) -> None:
        self.n_ctx, self.kernels = n_ctx, kernels
        self.types = cache_type(type_k), cache_type(type_v)
        # chosen once: float caches keep the plain writer, with no per-step test of the type
        self.blocks = not all(t.is_float for t in self.types)

        def rows(s: LayerShape) -> int:
            return min(s.rows or n_ctx, n_ctx)

        self.k = [kv_buffer(rows(s), s.n_head_kv, s.k_dim, self.types[0], s.device) for s in layers]
        self.v = [kv_buffer(rows(s), s.n_head_kv, s.v_dim, self.types[1], s.device) for s in layers]
        # each layer's Walsh-Hadamard rotation of keys and values (`ops.hadamard`: quantized caches)
        self.rotation = [kv_rotation(self.types, (s.k_dim, s.v_dim), torch.device(s.device)) for s in layers]
        # each CPU layer's native decode step, bound to its buffers once (None: not taken)
        block_types = self.types if self.blocks else None
        self.native = [
            native_attention(k, v, block_types, kernels, r)
            for k, v, r in zip(self.k, self.v, self.rotation, strict=True)
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def writer(self, layer: int, positions: torch.Tensor, n_read: int) -> LayerWriter:
        """Layer `layer`'s cache for a step at `positions` that reads the first `n_read` rows."""
        kc = self.k[layer]
        if positions.device != kc.device:  # --no-kv-offload: a GPU layer's cache lives on the CPU
            positions = positions.to(kc.device)
        vc, native, rotation = self.v[layer], self.native[layer], self.rotation[layer]
        if self.blocks:
            return BlockWriter(kc, vc, positions, n_read, self.kernels, self.types, native, rotation)
        return LayerWriter(kc, vc, positions, n_read, self.kernels, native=native)


def native_attention(
    k: torch.Tensor, v: torch.Tensor, types: tuple[QType, QType] | None, kernels: AttentionKernels,
    rotation: tuple[int, int],
) -> NativeAttention | None:  # fmt: skip
    """The native CPU decode step of a layer's buffers k, v [rows, Hk, row] (`types` where either is
    GGUF blocks; `rotation` their Walsh-Hadamard blocks), or None where it is off (`kernels.decode`) or
    does not take them (blocks grouped for the Triton kernels, `kv_layout.GROUPED_ON_CPU`)."""
    if kernels.decode == "off" or k.is_cuda or kv_layout.grouped_blocks(types, k.device):
        return None
    from llmx.kernels import cpu_attention

    dims = (head_dim(k, types[0]), head_dim(v, types[1])) if types else (k.shape[-1], v.shape[-1])
    return cpu_attention.prepare(k, v, types, dims, rotation)


@dataclass(frozen=True)
class LayerWriter:
    """One layer's buffers [rows, Hk, D] and this step's `positions` (a tensor on their device, so
    writes need no host sync and can sit in a CUDA graph); an `llmx.ops.LayerKV`."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    n_read: int
    kernels: AttentionKernels = DEFAULT_KERNELS
    # K's and V's cache types where either is GGUF blocks (a `BlockWriter`); None: float buffers,
    # whose dtypes say their types
    types: tuple[QType, QType] | None = None
    # the native CPU decode step bound to k and v (`native_attention`, None: not taken), which the
    # cache binds once a layer; a writer made on its own (tests) binds its own (BIND)
    native: NativeAttention | str | None = BIND
    # the Walsh-Hadamard blocks in which keys (with queries) and values (with the output) are stored
    # (`ops.hadamard.kv_rotation`; 0: not rotated), which every path into and out of k and v keeps
    rotation: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if self.native == BIND:
            native = native_attention(self.k, self.v, self.types, self.kernels, self.rotation)
            object.__setattr__(self, "native", native)

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v [T, Hk, D]; the first `n_read` rows (of a ring: all of them, see
        `key_positions`), on k's device, for attention: raw blocks for a block type, in the layout
        of k's device (for --no-kv-offload a GPU layer reads blocks over the bus, not floats)."""
        rows = self.k.shape[0]
        slots = self.positions if self.n_read <= rows else self.positions % rows
        types = self.types or (None, None)
        store_rows(self.k, slots, k, types[0])
        store_rows(self.v, slots, v, types[1])
        keys, values = self.k[: self.n_read], self.v[: self.n_read]
        return kv_layout.moved(keys, types[0], k.device), kv_layout.moved(values, types[1], v.device)

    def key_positions(self) -> torch.Tensor | None:
        """For a ring that may have wrapped (n_read beyond its rows), the position each row holds
        after this step's write: row r holds the latest position up to the step's last one that is r
        modulo the ring's length, negative for a row not written yet. None while the rows read are
        positions 0..n_read-1. Computed on the device from `positions`, so a CUDA graph replays it."""
        rows = self.k.shape[0]
        if self.n_read <= rows:
            return None
        r = torch.arange(rows, device=self.positions.device)
        return r + torch.div(self.positions[-1] - r, rows, rounding_mode="floor") * rows

    def rope_store_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope, cos: torch.Tensor,
        sin: torch.Tensor, mask: torch.Tensor | None, window: int | None, scale: float | None,
        softcap: float | None, norms: HeadNorms | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """`ops.rope_attention` of one token in one fused kernel: q [1, H, D] and this step's k, v
        [1, Hk, D] -> [1, H * D], q and k normalized by `norms` where given, k rotated and stored
        (quantized, for a block type) with v at `positions`. Triton's kernel
        (`kernels.decode_attention`, the norms in it) where everything lives on one GPU, the native
        one (`kernels.cpu_attention`, the norms before it) for a float32 CPU step over its past (a
        ring's, or a sliding window's, included); None, nothing written, where neither takes the
        step or `kernels.decode` is "off"."""
        if self._triton_takes(q, v):
            from llmx.kernels.decode_attention import decode_attention

            return decode_attention(
                q, k, v, cos, sin, self.k, self.v, self.positions, self.n_read, types=self.types,
                n_dims=rope.n_dims, neox=rope.neox, scale=scale, softcap=softcap, window=window,
                norms=None if norms is None else norms.weights(), rotation=self.rotation,
            )  # fmt: skip
        native = self.native
        if isinstance(native, NativeAttention) and self._native_takes(q, v, softcap, native):
            from llmx.kernels import cpu_attention

            if norms is not None:
                q, k = norms(q, k)
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            position = self.n_read - 1
            return cpu_attention.rope_decode_attention(
                q, k, v, rope.neox, cos, sin, native, position, window, scale
            )
        return None

    def _triton_takes(self, q: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the Triton kernel runs this step: one token, everything on one device (not a GPU
        layer whose cache stays on the CPU), equal key and value widths, and Triton at hand."""
        mode = self.kernels.decode
        if mode == "off" or q.shape[0] != 1:
            return False
        if mode == "auto" and not (q.is_cuda and has_triton()):
            return False
        one_device = q.device == self.k.device == self.v.device == self.positions.device
        dk, dv = self.head_dims()
        return one_device and q.shape[-1] == v.shape[-1] == dk == dv

    def head_dims(self) -> tuple[int, int]:
        """The values a key head and a value head hold."""
        if self.types is None:
            return self.k.shape[-1], self.v.shape[-1]
        return head_dim(self.k, self.types[0]), head_dim(self.v, self.types[1])

    def _native_takes(
        self, q: torch.Tensor, v: torch.Tensor, softcap: float | None, native: NativeAttention
    ) -> bool:  # fmt: skip
        """Whether the native CPU kernel bound to this layer's buffers may run this step: as
        `ops.attention`'s native decode, q and v of the cache's head width, but the token seeing its
        past by the kernel's own window (its position n_read - 1: the step's mask says no more)."""
        if softcap is not None or self.positions.device.type != "cpu":
            return False
        widths = q.shape[-1] == v.shape[-1] == native.d
        return widths and native_cpu_decode(q, self.k, None) and int(self.positions[0]) == self.n_read - 1


@dataclass(frozen=True)
class BlockWriter(LayerWriter):
    """A layer's cache where K or V (or both) are GGUF blocks (`types`): the step's rows are
    quantized as they are stored, and the rows read come back raw, for `ops.block_attention`."""

    types: tuple[QType, QType] = (F16, F16)
