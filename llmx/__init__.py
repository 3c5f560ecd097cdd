"""llmx: GGUF language models on one CPU and several unequal GPUs, in Python (PyTorch + Triton).

    import llmx
    model = llmx.load("model.gguf", n_gpu_layers=20)   # llama.cpp's options, Python-named
    print(model.generate("Hello", max_tokens=32))

`load` is imported on first use, so `import llmx.plan` (the planner) never pulls in torch.

Layout, from the pure core outwards: a module imports only from its own layer or earlier ones
(`tests/test_architecture.py` holds this list and keeps it, and the rules marked "tested"):

    settings, errors      the environment (read in settings only: tested), the one error type
    quant's type table,   the GGML types (`llmx.quant` itself, pure), the file, its hyperparameters
      gguf, model_config,   (one reader for planner and models), the machine's CPU, answers measured
      cpu_info, measured    once and kept for later processes
    quant                 kernel choice (pure); reference, CPU and Triton kernels
    plan                  devices, options, placement, memory (no torch: tested in test_plan)
    kernels, ops          fused kernels; the compute API models see (matmul, norms, rope, attention)
    models                architectures as equations over ops (no device, no runtime: tested)
    runtime               weights on devices, the KV cache (the only writer of its buffers), the
                          executor, CUDA graphs, op offload, tensor parallelism
    engine, text, api     generation over ids; tokenizer, templates, sampling; `load`
    server, bench,        the shells: HTTP, benchmarks, the CLI (bench never imports commands);
      commands, cli         no module or package imports itself through others (tested)
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "load"]


def __getattr__(name: str) -> Any:
    if name == "load":
        from llmx.api import load

        return load
    raise AttributeError(f"module 'llmx' has no attribute {name!r}")
