"""Kernels for the non-matmul ops of `llmx.ops`: Triton ones for GPUs, and a native one for the CPU.

Only `llmx.ops` and the KV cache (`llmx.runtime.cache`, which runs the kernels that write it)
import them, lazily: the Triton modules (importing one imports triton) only for
CUDA tensors (or when a test forces a kernel under TRITON_INTERPRET=1), so CPU-only installs never
load triton.

- `decode_attention`: one decode token's RoPE, KV-cache write and attention in one launch.
- `norm`: RMSNorm, residual add + RMSNorm, and silu(g) * u of a few rows, one launch each.
- `router`: a MoE router's softmax, top-k and renormalisation for every token, one launch.
- `cpu_attention`: one CPU token over its cache, in one call of the native CPU kernels (no triton).
"""
