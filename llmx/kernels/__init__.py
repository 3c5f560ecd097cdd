"""Triton kernels for the non-matmul ops of `llmx.ops`. Importing a module here imports triton.

Only `llmx.ops` imports them, lazily and only for CUDA tensors (or when a test forces a kernel under
TRITON_INTERPRET=1), so CPU-only installs never load triton.

- `decode_attention`: one decode token's RoPE, KV-cache write and attention in two launches.
- `norm`: RMSNorm, residual add + RMSNorm, and silu(g) * u of a few rows, one launch each.
"""
