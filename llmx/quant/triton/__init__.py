"""Triton kernels that read raw GGUF blocks. Importing this package imports triton.

Only `llmx.quant.triton_ops` imports it, lazily, so CPU-only installs never load triton.

- `bits`: loads and bit tricks every format uses;
- `legacy`, `kquants`, `iq`: one unpack helper per GGML type, grouped by family;
- `kernels`: the GEMV (decode), GEMM (prefill) and dequantize kernels, written once for every type.
"""
