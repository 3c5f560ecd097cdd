"""The grouped layout of GPU block caches (`llmx.quant.kv_layout`): a round trip to GGUF order and
back, and grouped heads decoded field by field, as the Triton kernels read them (scales first,
codes last), against gguf's dequantization of `llmx.quant.quantize`'s bytes, for every block type
and a head of one, three and four blocks."""

from __future__ import annotations

import pytest
import torch

from llmx.quant import kv_layout, qtype
from llmx.quant.quantize import KV_BLOCK_TYPES, quantize
from llmx.quant.reference import IQ4_LEVELS
from llmx.quant.torch_ops import dequantize


def heads(name: str, d: int) -> torch.Tensor:
    """Random values [5, 3, d] with blocks of different scales, quantized: GGUF-ordered heads."""
    g = torch.Generator().manual_seed(d)
    scales = torch.rand(5, 3, d // 32, 1, generator=g).mul(4).exp()
    x = torch.randn(5, 3, d // 32, 32, generator=g) * scales
    return quantize(x.view(5, 3, d), qtype(name))


def decode_grouped(raw: torch.Tensor, name: str, d: int) -> torch.Tensor:
    """Grouped heads [..., head bytes] as float32 [..., d], read field by field."""
    nb, lead = d // 32, raw.shape[:-1]
    at = 0

    def field(size: int) -> torch.Tensor:
        nonlocal at
        out = raw[..., at : at + nb * size].reshape(*lead, nb, size)
        at += nb * size
        return out

    def f16(b: torch.Tensor) -> torch.Tensor:
        return b.contiguous().view(torch.float16).float()  # [..., nb, 1]

    scale = f16(field(2))
    m = f16(field(2)) if name in ("Q4_1", "Q5_1") else 0.0
    fifths = None
    if name in ("Q5_0", "Q5_1"):
        qh = field(4).long()
        word = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
        fifths = (word[..., None] >> torch.arange(32)) & 1
    if name == "Q8_0":
        codes = field(32).view(torch.int8).float()
        assert at == raw.shape[-1]
        return (scale * codes).reshape(*lead, d)
    nibbles = field(16).long()
    codes = torch.cat([nibbles & 15, nibbles >> 4], -1)  # value l low, value l + 16 high
    assert at == raw.shape[-1]
    if fifths is not None:
        codes = codes | fifths << 4
    if name == "IQ4_NL":
        values = torch.from_numpy(IQ4_LEVELS).float()[codes]
    else:
        values = (codes - {"Q4_0": 8, "Q5_0": 16}.get(name, 0)).float()
    return (scale * values + m).reshape(*lead, d)


@pytest.mark.parametrize("name", KV_BLOCK_TYPES)
@pytest.mark.parametrize("d", [32, 96, 128])
def test_grouped_heads_hold_gguf_values(name: str, d: int) -> None:
    qt = qtype(name)
    raw = heads(name, d)
    grouped = kv_layout.to_grouped(raw, qt)
    assert grouped.shape == raw.shape and grouped.dtype == torch.uint8
    assert torch.equal(kv_layout.to_gguf(grouped, qt), raw)
    want = dequantize(raw.reshape(-1, raw.shape[-1]), qt).reshape(5, 3, d)
    torch.testing.assert_close(decode_grouped(grouped, name, d), want, rtol=0, atol=0)
    # the scales open the head: block b's f16 d at bytes 2b, 2b + 1
    nb = d // 32
    assert torch.equal(grouped[..., : 2 * nb].reshape(5, 3, nb, 2), raw.reshape(5, 3, nb, -1)[..., :2])


def test_the_layout_follows_the_device(monkeypatch) -> None:
    qt = qtype("Q8_0")
    raw = heads("Q8_0", 64)
    cpu = torch.device("cpu")
    assert not kv_layout.grouped(cpu) and kv_layout.grouped(torch.device("cuda"))
    assert kv_layout.stored(raw, qt, cpu) is raw and kv_layout.gguf_rows(raw, qt) is raw
    monkeypatch.setattr(kv_layout, "GROUPED_ON_CPU", True)
    assert torch.equal(kv_layout.stored(raw, qt, cpu), kv_layout.to_grouped(raw, qt))
    assert torch.equal(kv_layout.gguf_rows(kv_layout.stored(raw, qt, cpu), qt), raw)
    f16 = torch.randn(2, 2, 64).half()
    assert kv_layout.stored(f16, qtype("F16"), cpu) is f16
