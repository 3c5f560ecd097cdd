"""Prompt rows written into a GPU block cache by one Triton launch (`llmx.kernels.cache_store`): the
bytes of `llmx.quant.quantize` (tested against gguf elsewhere) in the grouped layout, in exactly the
rows named, for every cache block type and heads of one, three and four blocks. Under
TRITON_INTERPRET=1 on CPU tensors; on a GPU through the cache's own way in (`store_rows`)."""

from __future__ import annotations

import pytest
import torch

from llmx.kernels import cache_store
from llmx.quant import kv_layout, qtype
from llmx.quant.quantize import KV_BLOCK_TYPES, quantize
from llmx.runtime.cache import store_rows

ROWS, TOKENS, HEADS = 9, 5, 3


def prompt_rows(d: int) -> torch.Tensor:
    """x [TOKENS, HEADS, d]: blocks of scales far apart, a zero block, and a block of equal values."""
    g = torch.Generator().manual_seed(d)
    scales = torch.rand(TOKENS, HEADS, d // 32, 1, generator=g).mul(6).sub(3).exp()
    x = torch.randn(TOKENS, HEADS, d // 32, 32, generator=g) * scales
    x[0, 0, 0] = 0.0
    x[1, 2, -1] = -1.5
    return x.reshape(TOKENS, HEADS, d)


def expected(buffer: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, name: str) -> torch.Tensor:
    want = buffer.clone()
    want[slots] = kv_layout.to_grouped(quantize(x, qtype(name)), qtype(name))
    return want


def stale_buffer(name: str, d: int, device: str) -> torch.Tensor:
    shape, g = (ROWS, HEADS, qtype(name).row_bytes(d)), torch.Generator().manual_seed(1)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(device)


SLOTS = [7, 0, 3, 8, 4]  # out of order, rows 1, 2, 5, 6 left alone


@pytest.mark.parametrize("d", [32, 96, 128])
@pytest.mark.parametrize("name", KV_BLOCK_TYPES)
def test_the_kernel_writes_the_bytes_of_quantize_grouped_in_the_rows_named(name, d):
    x, slots = prompt_rows(d), torch.tensor(SLOTS)
    buffer = stale_buffer(name, d, "cpu")
    want = expected(buffer, slots, x, name)
    cache_store.store(buffer, slots, x, qtype(name))
    assert torch.equal(buffer, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", KV_BLOCK_TYPES)
def test_a_gpu_cache_stores_rows_through_the_kernel(name, dtype):
    d = 128
    x, slots = prompt_rows(d).to(dtype), torch.tensor(SLOTS)
    buffer = stale_buffer(name, d, "cuda")
    want = expected(buffer.cpu(), slots, x, name)
    store_rows(buffer, slots.cuda(), x.cuda(), qtype(name))
    assert torch.equal(buffer.cpu(), want)
