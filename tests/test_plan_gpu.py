"""The memory model against a real GPU: probed inventory, and planned bytes vs measured allocations.

Runs only where CUDA is available (`gpu` marker). The model is a 2-layer synthetic Llama-3-8B in
Q4_K_M (real matrix sizes, random valid blocks), loaded by the runtime exactly where the plan says.
"""

from __future__ import annotations

import pytest

from llmx.plan import ModelSpec, Options, place

pytestmark = pytest.mark.gpu


def test_probe_reports_every_visible_gpu():
    import torch

    from llmx.runtime.devices import probe

    inv = probe()
    assert len(inv.gpus) == torch.cuda.device_count() > 0
    for g in inv.gpus:
        assert 0 < g.free <= g.total and g.label and g.bus_id.count(":") == 2
    assert inv.cpu.total >= inv.cpu.free > 0


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0", "q4_0"])
def test_planned_weights_and_kv_match_measured_allocations(tmp_path, cache_type):
    import torch

    from llmx.bench.synth import synthesize
    from llmx.gguf import open_gguf
    from llmx.runtime.cache import KVCache, LayerShape
    from llmx.runtime.devices import probe
    from llmx.runtime.weights import load_weights

    path = tmp_path / "llama3-8b-2l.gguf"
    synthesize("llama3-8b", "Q4_K_M", path, n_layer=2, progress=False)
    mf = open_gguf(path)
    model = ModelSpec.from_gguf(mf)
    opts = Options(n_gpu_layers="all", ctx_size=8192, cache_type_k=cache_type, cache_type_v=cache_type)
    p = place(model, probe(), opts)
    planned = p.device_use("cuda:0")

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(0)
    weights = load_weights(mf, p)
    layers = [
        LayerShape(
            model.config.n_head_kv,
            model.config.head_dim,
            model.config.head_dim_v,
            p.kv_device(i),
            p.kv_rows[i],
        )
        for i in range(2)
    ]
    cache = KVCache(p.ctx, layers, cache_type, cache_type)
    torch.cuda.synchronize()
    measured = torch.cuda.memory_allocated(0) - before
    print(f"planned weights+KV {planned.weights + planned.kv} bytes, measured {measured} bytes")
    assert measured == pytest.approx(planned.weights + planned.kv, rel=0.05)
    assert cache.nbytes == planned.kv and weights
