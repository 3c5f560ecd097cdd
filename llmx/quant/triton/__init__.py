"""Triton kernels that read raw GGUF blocks, and their launches (the GPU path of `llmx.quant`).

The kernel modules import triton; the launch modules import it only on a first launch, so
`llmx.quant.weight` imports them on CPU-only installs too:

- `bits`: loads and bit tricks every format uses;
- `legacy`, `kquants`, `iq`: one unpack helper per GGML type, grouped by family;
- `kernels`: the GEMV (decode), GEMM (prefill) and dequantize kernels, written once for every type;
- `dot8`: the integer-dot decode GEMV, and x's quantization for it;
- `dot8_rows`: the integer-dot GEMV for several rows of x (a batched decode step);
- `mmq`: the integer tensor-core GEMM for tens of rows of x (a larger batched decode step);
- `moe_kernels`, `moe`: the grouped GEMV and GEMM over stacked expert weights, and their launches
  (routings sorted by expert on the device);
- `matmul`: the launches: linear, linear_many, embedding, dequantize;
- `layout`: the rows the kernels read, and their one-time repack at load;
- `activation`: x quantized to int8 or scaled to fp16, and the hand-over of a decode step's quantized x;
- `tuning` (+ `launch_shapes.json`): launch shapes per kind of GPU;
- `autotune`: the GEMM's tiles per problem, measured once and kept on disk;
- `launch`: per-device facts a launch needs (interpreter, programmatic launch).
"""
