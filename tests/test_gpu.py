"""The GPU paths give the CPU's tokens: all-GPU, hybrid (-ngl), single tensors overridden to the CPU,
eager vs CUDA-graph decode; and the loaded bytes match the plan. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import llmx
from llmx.runtime.executor import Segment, segments

PROMPT = "The three primary colours are"
N = 32


def greedy_ids(model) -> list[int]:
    return list(model.stream_ids(PROMPT, N, temperature=0))


@pytest.fixture(scope="module")
def cpu_tokens(smollm2_path):
    return greedy_ids(llmx.load(smollm2_path, ctx_size=512))


def test_segments_group_consecutive_devices():
    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    assert segments([cpu, cpu, gpu, gpu], gpu) == [Segment(cpu, range(0, 2), False), Segment(gpu, range(2, 4), True)]
    assert segments([gpu, cpu], cpu) == [Segment(gpu, range(0, 1), False), Segment(cpu, range(1, 2), True)]
    assert segments([cpu], gpu) == [Segment(cpu, range(0, 1), False), Segment(gpu, range(0), True)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "options",
    [
        {"n_gpu_layers": "all"},
        {"n_gpu_layers": 15},
        {"n_gpu_layers": "all", "override_tensor": ["ffn=CPU"]},
        {"n_gpu_layers": "all", "no_kv_offload": True},
    ],
    ids=["all-gpu", "ngl-15", "ffn-on-cpu", "no-kv-offload"],
)
def test_gpu_greedy_matches_cpu(smollm2_path, cpu_tokens, options):
    model = llmx.load(smollm2_path, ctx_size=512, **options)
    assert greedy_ids(model) == cpu_tokens


@pytest.mark.gpu
def test_graph_decode_matches_eager(smollm2_path):
    model = llmx.load(smollm2_path, ctx_size=512, n_gpu_layers="all")
    graphed = greedy_ids(model)
    model.engine.executor.use_graphs = False
    assert greedy_ids(model) == graphed


@pytest.mark.gpu
def test_allocated_bytes_match_the_plan(smollm2_path):
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(0)
    model = llmx.load(smollm2_path, ctx_size=2048, n_gpu_layers="all")
    measured = torch.cuda.memory_allocated(0) - before
    use = model.plan.device_use("cuda:0")
    planned = use.weights + use.kv
    assert abs(measured - planned) <= 0.05 * planned, (measured, planned)
