"""Where a KV cache of GGUF blocks keeps its bytes: GGUF order on the CPU, grouped on a GPU.

A block cache is uint8 [rows, Hk, head bytes], a head's D values in D / 32 blocks of 32 (`nb`
blocks). Both layouts hold the same bytes a head, so sizes and shapes do not depend on the layout:

- GGUF order (`llmx.quant.quantize`'s bytes, llama.cpp's): block after block, each its fields in
  ggml-common.h's order: an f16 scale d; Q4_1 and Q5_1 an f16 minimum m; Q5_0 and Q5_1 the 32 fifth
  bits qh (4 bytes, little-endian); then the codes: Q8_0's 32 int8, the others' 16 bytes of nibbles
  (byte l: value l low, value l + 16 high). The native CPU attention (`cpu_blocks.c`) reads it.
- grouped (the GPU's): field by field, each field of every block in block order: the nb scales d,
  then (Q4_1, Q5_1) the nb minimums m, then (Q5_0, Q5_1) the nb qh words, then every block's codes
  (Q8_0: the head's D int8 in value order; nibbles: each block's 16 bytes as GGUF packs them). A
  field at byte o of a block starts at byte nb * o of the head, so Q8_0's codes of D = 128 start 8
  bytes in: the Triton kernels (`kernels.cache_rows.load_rows`) read them as one contiguous tile.

Which layout a buffer holds follows its device (`grouped`): the Triton kernels read and write only
the grouped layout, the CPU's native kernel only GGUF's. Without a GPU the Triton kernels run on CPU
tensors under TRITON_INTERPRET=1; tests set `GROUPED_ON_CPU` so that CPU caches take the grouped
layout there (the native CPU kernel then declines them). Host code converts with `to_grouped` /
`to_gguf` (a byte permutation a head, built once per type and D).
"""

from __future__ import annotations

from functools import cache

import torch

from llmx.quant import QType

# a block's fields' bytes in GGUF order: d, (m), (qh), codes
FIELDS = {
    "Q8_0": (2, 32),
    "Q4_0": (2, 16),
    "IQ4_NL": (2, 16),
    "Q4_1": (2, 2, 16),
    "Q5_0": (2, 4, 16),
    "Q5_1": (2, 2, 4, 16),
}
GROUPED_ON_CPU = False  # tests: CPU caches grouped, for the Triton kernels under the interpreter


def grouped(device: torch.device | str) -> bool:
    """Whether block caches on `device` hold the grouped layout (a GPU's; the CPU's in tests)."""
    kind = torch.device(device).type
    return kind == "cuda" or (GROUPED_ON_CPU and kind == "cpu")


def grouped_blocks(types: tuple[QType, QType] | None, device: torch.device | str) -> bool:
    """Whether caches of `types` (K's, V's; None: float caches) on `device` hold blocks in the grouped
    layout, which the native CPU kernels do not read."""
    return types is not None and grouped(device)


@cache
def _order(name: str, head_bytes: int, device: torch.device) -> torch.Tensor:
    """For a head of `head_bytes` bytes of type `name`: grouped byte i is GGUF byte order[i]. Built
    on `device` (no host copy: a CUDA graph may capture the first use)."""
    fields = FIELDS[name]
    nb = head_bytes // sum(fields)
    assert nb * sum(fields) == head_bytes, f"{head_bytes} bytes are not whole {name} blocks"
    gguf = torch.arange(head_bytes, device=device).view(nb, sum(fields))
    return torch.cat([f.reshape(-1) for f in gguf.split(fields, dim=1)])


@cache
def _inverse(name: str, head_bytes: int, device: torch.device) -> torch.Tensor:
    order = _order(name, head_bytes, device)
    return torch.empty_like(order).scatter_(0, order, torch.arange(head_bytes, device=device))


def to_grouped(raw: torch.Tensor, qt: QType) -> torch.Tensor:
    """GGUF-ordered heads raw [..., head bytes] of type `qt` in the grouped layout (a new tensor)."""
    return raw.index_select(-1, _order(qt.name, raw.shape[-1], raw.device))


def to_gguf(raw: torch.Tensor, qt: QType) -> torch.Tensor:
    """Grouped heads raw [..., head bytes] of type `qt` in GGUF order (a new tensor)."""
    return raw.index_select(-1, _inverse(qt.name, raw.shape[-1], raw.device))


def stored(raw: torch.Tensor, qt: QType | None, device: torch.device | str) -> torch.Tensor:
    """GGUF-ordered rows `raw` as a block cache on `device` holds them (float types: as they are)."""
    if qt is None or qt.is_float or not grouped(device):
        return raw
    return to_grouped(raw, qt)


def gguf_rows(raw: torch.Tensor, qt: QType | None) -> torch.Tensor:
    """Cache rows `raw` in GGUF order, from the layout their device holds (float types: as they are)."""
    if qt is None or qt.is_float or not grouped(raw.device):
        return raw
    return to_gguf(raw, qt)


def moved(raw: torch.Tensor, qt: QType | None, device: torch.device | str) -> torch.Tensor:
    """Cache rows `raw` on `device`, in the layout block caches hold there (--no-kv-offload: a CPU
    cache's GGUF rows read by a GPU's kernels)."""
    if qt is None or qt.is_float or grouped(raw.device) == grouped(device):
        return raw.to(device)
    return stored(gguf_rows(raw, qt).to(device), qt, device)
