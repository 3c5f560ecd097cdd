"""llmx: GGUF language models on one CPU and several unequal GPUs, in Python (PyTorch + Triton)."""

__version__ = "0.1.0"
