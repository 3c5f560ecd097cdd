"""Memory truth on a GPU (issues #4 and #7): the plan's bytes against torch's allocator.

- After loading, each GPU's allocated bytes are the plan's weights + KV, within 5%.
- While prompts and decode steps run, the peak allocated beyond that (the compute memory) stays
  within the plan's compute estimate, which is meant to err high. The prompt is placed at the end
  of the context, so its attention reads every position: the worst case the estimate counts.
- `llmx bench` reports both numbers per GPU, and the CPU segments' time and bytes streamed.
- A `--fit` plan for a GPU pretended small (a described device with the real one's name, and torch's
  allocator capped to that size) runs a full prompt and decode steps in every CUDA-graph bucket
  without running out of memory.

Skipped without CUDA (`gpu` marker). The model is a synthetic Llama-3-8B in Q4_K_M with 4 layers:
real matrix sizes, so dequantized weights, attention scores and streamed layers are full-size.
Run with -s to see the measured and planned bytes of every case.
"""

from __future__ import annotations

import dataclasses
import gc
import json

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

N_LAYER = 4
CTX = 2048
MiB = 2**20


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from llmx.bench.synth import synthesize

    path = tmp_path_factory.mktemp("memory") / "llama3-8b-4l-Q4_K_M.gguf"
    synthesize("llama3-8b", "Q4_K_M", path, n_layer=N_LAYER, progress=False)
    return path


@pytest.fixture
def stream_every_prompt(monkeypatch):
    """Op offload streams CPU layers from 2 prompt tokens on (the measured threshold varies by machine)."""
    from llmx.runtime import offload

    monkeypatch.setattr(offload, "offload_threshold", lambda layers, device: 2)


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def exercise(engine, ub: int) -> None:
    """Decode steps in every CUDA-graph bucket (each captures a graph), a few in a row, then a prompt
    of `ub` tokens that ends at the end of the context."""
    from llmx.runtime.graphs import GRAPH_BUCKET

    engine.reset()
    for pos in range(0, CTX, GRAPH_BUCKET):
        engine.n_past = pos
        engine.decode(1)
    for t in tokens(4):
        engine.decode(t)
    engine.n_past = CTX - ub
    engine.prefill(tokens(ub, 1))
    engine.synchronize()


def gpus_of(plan) -> list[str]:
    return [u.device for u in plan.usage if u.device.startswith("cuda") and u.used]


def release() -> None:
    from llmx.bench.gpumem import release_cuda_memory

    gc.collect()
    release_cuda_memory()


CASES = [
    ({"n_gpu_layers": "all"}, 64),
    ({"n_gpu_layers": "all"}, 512),
    ({"n_gpu_layers": N_LAYER // 2}, 64),  # hybrid: layers 0-1 on the CPU, streamed for prompts
    ({"n_gpu_layers": N_LAYER // 2}, 512),
    ({"n_gpu_layers": "all", "override_tensor": ["ffn=CPU"]}, 512),
]


@pytest.mark.parametrize(("options", "ub"), CASES, ids=["gpu-ub64", "gpu-ub512", "hybrid-ub64",
                                                        "hybrid-ub512", "ffn-on-cpu-ub512"])  # fmt: skip
def test_weights_kv_and_compute_peak_stay_within_the_plan(model_path, stream_every_prompt, options, ub):
    import torch

    import llmx
    from llmx.bench.gpumem import GpuMemory, allocated, cuda_devices
    from llmx.quant.weight import QWeight

    release()
    before = allocated(cuda_devices())
    model = llmx.load(model_path, ctx_size=CTX, ubatch_size=ub, **options)
    memory = GpuMemory.of_load(model.plan, before, model.warm_up.retained)
    assert memory.devices == gpus_of(model.plan) and memory.devices
    memory.start()
    exercise(model.engine, ub)
    measured = memory.measure()
    streamed = model.engine.executor.bytes_streamed
    host_weights = [
        w
        for layer in model.engine.executor.model.layers
        for _, w in layer.items()
        if isinstance(w, QWeight) and w.raw.device.type == "cpu"
    ]
    # a streamed layer's pinned copy is its only host copy (the CPU decodes from it too)
    pinned_only = all(w.raw.is_pinned() for w in host_weights) if streamed else True
    del model
    release()
    for dev, m in measured.items():
        print(f"{options} -ub {ub} {dev}: weights+KV {m['weights_kv'] / MiB:.1f} MiB (plan "
              f"{m['weights_kv_planned'] / MiB:.1f}); compute peak {m['compute_peak'] / MiB:.1f} MiB (plan "
              f"{m['compute_planned'] / MiB:.1f}); reserved peak {m['reserved_peak'] / MiB:.1f} MiB; "
              f"streamed {streamed / MiB:.1f} MiB")  # fmt: skip
        assert m["weights_kv"] == pytest.approx(m["weights_kv_planned"], rel=0.05), (dev, m)
        assert m["compute_peak"] <= m["compute_planned"], (dev, m)
    if options["n_gpu_layers"] != "all":
        assert streamed > 0  # the prompt's CPU layers did run on the GPU
        assert pinned_only
    assert torch.cuda.is_available()


def test_bench_json_reports_gpu_memory_host_time_and_cpu_segments(
    model_path, stream_every_prompt, tmp_path, monkeypatch, capsys
):
    from llmx import cli
    from llmx.bench import ceilings

    monkeypatch.setattr(ceilings, "cache_path", lambda: tmp_path / "ceilings.json")
    quick = {
        "cpu": ceilings.measure_cpu(size_bytes=64 << 20, matmul_n=256, reps=1),
        "cuda": ceilings.measure_cuda("cuda:0", size_bytes=256 << 20, matmul_n=1024, reps=2),
    }
    monkeypatch.setattr(ceilings, "measure", lambda device: quick["cpu" if device == "cpu" else "cuda"])
    argv = ["bench", "-m", str(model_path), "-p", "512", "-n", "16", "-r", "2", "-ngl", f"99,{N_LAYER // 2}"]
    assert cli.main([*argv, "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["test"], r["n_gpu_layers"]) for r in rows] == [
        ("pp512", N_LAYER + 1),
        ("tg16", N_LAYER + 1),
        ("pp512", N_LAYER // 2),
        ("tg16", N_LAYER // 2),
    ]
    for r in rows:
        assert r["gpu_memory"], r["test"]
        for dev, m in r["gpu_memory"].items():
            print(f"-ngl {r['n_gpu_layers']} {r['test']} {dev}: {json.dumps(m)}")
            assert m["weights_kv"] == pytest.approx(m["weights_kv_planned"], rel=0.05)
            assert m["compute_peak"] <= m["compute_planned"]
    gpu_tg, hybrid_pp, hybrid_tg = rows[1], rows[2], rows[3]
    print(
        f"host ms/token: all-GPU {gpu_tg['host_ms_per_token']:.3f} of {1000 / gpu_tg['avg_ts']:.3f}; hybrid "
        f"{hybrid_tg['host_ms_per_token']:.3f} (CPU segments {hybrid_tg['cpu_ms_per_token']:.3f} ms, "
        f"{hybrid_tg['cpu_gbs']:.1f} GB/s) of {1000 / hybrid_tg['avg_ts']:.3f}"
    )
    assert 0 < gpu_tg["host_ms_per_token"] <= 1000 / min(gpu_tg["samples_ts"])  # a part of each step
    assert gpu_tg["cpu_ms_per_token"] is None  # no CPU segment when every layer and the head are on the GPU
    assert 0 < hybrid_tg["cpu_ms_per_token"] <= hybrid_tg["host_ms_per_token"]
    assert hybrid_tg["cpu_gbs"] > 0 and hybrid_tg["cpu_pct_ram"] > 0
    assert hybrid_pp["bytes_streamed"] > 0 and gpu_tg["bytes_streamed"] == 0
    capsys.readouterr()  # the lines printed above
    assert cli.main([*argv[:-2], "-ngl", str(N_LAYER // 2), "-r", "1"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    for column in ("host ms/t", "CPU ms/t", "CPU GB/s", "streamed", "compute MiB (planned)"):
        assert column in header


def test_fit_for_a_small_gpu_never_runs_out_of_memory(model_path, monkeypatch):
    """Pretend cuda:0 has room for about half the layers: --fit must split, and the run must stay
    within the memory the plan was given (torch's allocator is capped to it, so going past it is
    an out-of-memory error, as on a GPU that small)."""
    import torch

    import llmx
    import llmx.api
    from llmx.gguf import open_gguf
    from llmx.plan import ModelSpec, Options, place
    from llmx.plan.devices import Inventory
    from llmx.runtime.devices import probe

    margin_mib = 256  # small, so that the estimate, not the margin, keeps the run inside the budget
    spec = ModelSpec.from_gguf(open_gguf(model_path))
    real = probe()
    gpu = real.gpus[0]
    opts = Options(n_gpu_layers=N_LAYER // 2, ctx_size=CTX, fit_margin_mib=margin_mib)
    half = place(spec, Inventory(real.cpu, (gpu,)), opts).device_use(gpu.name)
    layer_bytes = sum(t.nbytes for t in spec.tensors if t.layer == 0)
    budget = half.used + margin_mib * MiB + layer_bytes // 2
    small = Inventory(real.cpu, (dataclasses.replace(gpu, total=budget, free=budget),))
    monkeypatch.setattr(llmx.api, "probe", lambda: small)

    release()
    reserved_before = torch.cuda.memory_reserved(0)
    torch.cuda.reset_peak_memory_stats(0)
    torch.cuda.set_per_process_memory_fraction((reserved_before + budget) / gpu.total, 0)
    try:
        model = llmx.load(model_path, ctx_size=CTX, fit=True, fit_margin_mib=margin_mib)
        plan = model.plan
        assert 0 < plan.n_offloaded < N_LAYER + 1, plan.notes  # fit had to split, and used the GPU
        exercise(model.engine, plan.options.n_ubatch)
        peak = torch.cuda.max_memory_reserved(0) - reserved_before
        use = plan.device_use(gpu.name)
        print(
            f"--fit chose {' '.join(plan.options.to_args())} for a {budget / MiB:.0f} MiB GPU: planned "
            f"{use.used / MiB:.0f} MiB (weights {use.weights / MiB:.0f}, KV {use.kv / MiB:.0f}, compute "
            f"{use.compute / MiB:.0f}), peak reserved {peak / MiB:.0f} MiB"
        )
        assert peak <= budget
        del model
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        release()
