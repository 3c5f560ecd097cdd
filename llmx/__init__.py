"""llmx: GGUF language models on one CPU and several unequal GPUs, in Python (PyTorch + Triton).

    import llmx
    model = llmx.load("model.gguf", n_gpu_layers=20)   # llama.cpp's options, Python-named
    print(model.generate("Hello", max_tokens=32))

`load` is imported on first use, so `import llmx.plan` (the planner) never pulls in torch.
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
