"""Which kernel multiplies a weight: one table, consulted when a weight is made or prepared at load.

The answer depends on the weight's type, its device, how its rows are laid out there, and M (the
rows of x, in buckets: BUCKET_TOPS, which every M limit below closes); `kernels` gives one kernel
per bucket, which the weight keeps (`QWeight.kernels`), so a call only indexes it. Pure: no torch.

GPU kernels (`llmx.quant.triton.matmul`):
- "float": F32/F16/BF16 weights, torch's matmul;
- "dot8": M = 1, Q4_K, Q6_K and Q8_0 rows in the repacked layout read as words (WORDS): x quantized
  to int8 per 32 values, then int8 dot products on the weight codes (llama.cpp's mmvq); faster
  than "gemv" on every GPU measured (bench/RESULTS.md);
- "dot8_rows": ROWS8_MIN_M <= M <= ROWS8_MAX_M, the same types and layout: "dot8" for several rows
  of x, each weight block read once for up to `matmul.ROWS8_BM` of them (llama.cpp's mmvq; a
  batched decode step), any M where forced;
- "mmq": the rows of x MMQ_M gives a type (Q8_0: 16-32), any M where forced, the same types and
  layout: x quantized to int8, then tiles of rows of x by weight rows on the int8 tensor cores
  (llama.cpp's mmq), K split where the tiles alone leave SMs idle; weights it cannot read take the
  table's kernel (the float GEMV, which "dot8" falls back to, takes at most GEMV_MAX_M rows);
- "mmh": the rows of x MMH_M gives a type (Q4_K, Q6_K: 8-64; before "dot8_rows" and "mmq"), any M where
  forced, the same types and layout: tiles of weight rows dequantized to f16 in registers (scales
  folded in) by rows of x scaled into f16, on the half-precision tensor cores;
- "gemv": M <= FLOAT_GEMV_MAX_M (IQ4 types: GEMV_MAX_M), fp32 FMAs on the unpacked codes; its time
  grows with M;
- "gemm": M < DEQUANT_MIN_M, tiles dequantized in registers for tl.dot, time flat in M up to its
  tile; not for IQ4 types, whose per-code table lookups make it slower than "dequant";
- "dequant": larger M, chunks of rows dequantized to half precision for cuBLAS.
CPU kernels (`llmx.quant.weight`):
- "native": GGUF blocks the C kernels read (NATIVE layout), up to NATIVE_MAX_ROWS rows of x;
- "native_chunks": the same weights for more rows, dequantized by the C kernels a chunk at a time;
- "packed": `cpu_pack`'s repacked codes (PACKED layout);
- "chunks": the raw blocks dequantized a chunk at a time for torch.mm.
Stacked expert weights (`llmx.quant.triton.moe`, by `moe` on the tokens and the launch's types):
"dot8" for decode batches of Q4_K/Q6_K/Q8_0 rows in WORDS layout (x quantized to int8 per 32, as
the dense "dot8"), "gemv" (fp32 FMAs on unpacked codes) for decode batches of other types and
layouts, "gemm" over the pairs sorted by expert for more tokens.
Both: "emulated", the whole weight dequantized then one dense matmul: the numerics reference
(torchao's KernelPreference.EMULATED), forced everywhere by LLMX_KERNEL=emulated.

`preference` is LLMX_KERNEL's value (auto, packed, dequant, emulated: the CPU paths, emulated for
every device) or, on a GPU, one of GPU_KERNELS forced (tests, benchmarks).
"""

from __future__ import annotations

from llmx.errors import LlmxError
from llmx.quant import QType

GPU_KERNELS = ("dot8", "dot8_rows", "mmq", "mmh", "gemv", "gemm", "dequant")
CPU_PREFERENCES = ("auto", "packed", "dequant", "emulated")  # LLMX_KERNEL's values

# Layouts of a weight's rows on its device.
GGUF = "gguf"  # as the file stores them
SPLIT = "split"  # GPU: rearranged by `triton.layout.prepare`
WORDS = "words"  # GPU: SPLIT, every row 4-byte aligned, as the integer-dot GEMV reads them
NATIVE = "native"  # CPU: GGUF blocks the native C kernels read (`cpu_native`)
PACKED = "packed"  # CPU: repacked by `cpu_pack`

GEMV_MAX_M = 8  # the float GEMV's limit (a static loop over input rows)
FLOAT_GEMV_MAX_M = 4  # its time grows with M: from here on "gemm" is faster, but for IQ4 types
DOT8_MAX_M = 1  # decode
DOT8_TYPES = ("Q4_K", "Q6_K", "Q8_0")  # the integer-dot kernels' types
# "dot8_rows"' range of M: it reads each weight once where "dequant" writes and reads it again in
# bf16, but its integer work grows with M. A batched decode step of synthetic Llama-3-8B Q4_K_M on an
# H100 (bench/batch_step.py, every weight forced by LLMX_GPU_KERNEL): 8 rows 9.6 ms ("gemm" 29.8,
# "dequant" 15.8), 16 rows 16.4 ("dequant" 16.2, flat to 18.2 at 64): from 16 "dequant" takes them
ROWS8_MIN_M = 2
ROWS8_MAX_M = 15
INT8_X_MAX_M = max(DOT8_MAX_M, ROWS8_MAX_M)  # rows of x that the integer-dot GEMVs take
DEQUANT_MIN_M = 16  # from here "dequant" beats "gemm" (bench/kernels.py)
# "mmq"'s range of M, by type: where it beats both "dot8_rows" and "dequant". H100, bench/kernels.py
# on Llama-3-8B's FFN matrices (14336x4096, 4096x14336), us: Q4_K at 16 / 32 / 64 rows 81-84 /
# 79-83 / 127-142 against "dequant"'s 110-113 and "dot8_rows"' 126-146 at 16; at 8 rows 64-70
# against "dot8_rows"' 58-66. Q6_K's two dots a group lose to "dequant" from 16 rows (119-128 /
# 149-168 / 231-332 against 119-124). A batched decode step of synthetic Llama-3-8B Q4_K_M
# (bench/batch_step.py): 16 sequences 10.4 ms against 16.2, 32 12.9 against 16.8. On an H200 (s38),
# whose faster HBM brings "dequant" level with mmq for Q4_K at 16-32 rows (74.7-86.1 us against
# 77.2-81.9), Q8_0 at 16 / 32 rows: 78.0 / 82.0 us against "dequant"'s 91.2 / 90.3 and "dot8_rows"'
# 100.8 / 192.7 (14336x4096); from 48 rows mmq loses for both types (106-160 against 87-117).
# Q4_K's rows go to "mmh" at 8-64 rows (below): that range of mmq's is superseded.
MMQ_M = {"Q8_0": (16, 32)}
# "mmh"'s range of M, by type. H100, bench/kernels.py on Llama-3-8B's FFN matrices (14336x4096,
# 4096x14336), us, Q4_K at 8 / 16 / 32 / 64 rows: 46.1-40.2 / 51.8-47.2 / 54.5-52.4 / 62.1-58.1
# against "dot8_rows"' 57.8-65.5 at 8, mmq's 83.9-81.4 / 83.3-81.2 / 135.3-159.8 and "dequant"'s
# 83.1-188.8 / 86.5-86.0 / 112.3-115.9 from 16; a batched decode step of synthetic Llama-3-8B Q4_K_M
# with every weight forced onto it (bench/batch_step.py): 8 / 16 / 32 / 64 sequences 7.2 / 7.2 / 8.7 /
# 10.8 ms against the table's 9.3 / 10.1 / 12.4 / 17.4 (raw bench/results/h100-20261207-s41-mmh.txt).
# Q6_K's rows too (its tiles checked on an H100 in s43): that step with Q4_K's rows on mmh and Q6_K's
# on the table's kernels 7.9 / 8.6 / 10.5 / 12.9 ms, every weight on mmh 7.2 / 6.9 / 8.9 / 12.1 (raw
# bench/results/h100-20261207-s43-batched.txt). Q8_0's stay where they were: mmh level with mmq at 16-32.
MMH_M = {"Q4_K": (8, 64), "Q6_K": (8, 64)}
MOE_GEMV_MAX_TOKENS = 8  # decode batches; to be measured against the GEMM on a GPU
MOE_KERNELS = ("dot8", "gemv", "gemm")  # the grouped expert kernels (`moe`'s answers)
# tokens whose router logits join the top-k's launch on a GPU (`kernels.router.route_tokens`), each
# token's programs reading the whole router (1 MB a Qwen3-MoE layer); more take a GEMM that reads it
# once, then the top-k's launch. One: a decode step, the steps its GPU checks cover (bench/RESULTS.md)
ROUTER_GEMV_MAX_TOKENS = 1
# rows of x the native GEMV takes (it can take cpu_native.MAX_ROWS): from 16, chunks dequantized for
# torch.mm are faster on the CI machine's Zen 3 (one thread, CPU time: even at 16 rows, 1.5x at 32;
# the GEMV 1.4x faster at 8), and 15 closes one of BUCKET_TOPS' buckets
NATIVE_MAX_ROWS = 15

# the largest M of each bucket but the last, which holds the rest: every limit above closes one
_LIMITS = (
    DOT8_MAX_M,
    FLOAT_GEMV_MAX_M,
    GEMV_MAX_M,
    DEQUANT_MIN_M - 1,
    NATIVE_MAX_ROWS,
    ROWS8_MIN_M - 1,
    ROWS8_MAX_M,
    *(limit for low, high in (*MMQ_M.values(), *MMH_M.values()) for limit in (low - 1, high)),
)
BUCKET_TOPS = tuple(sorted(set(_LIMITS) - {0}))
# the bucket of each M up to the last top (M = 0: the first); larger M are in LAST_BUCKET
BUCKET_OF = tuple(next(b for b, top in enumerate(BUCKET_TOPS) if m <= top) for m in range(max(_LIMITS) + 1))
LAST_BUCKET = len(BUCKET_TOPS)


def moe(tokens: int, names: tuple[str, ...] = (), layout: str = GGUF, preference: str = "auto") -> str:
    """The grouped expert kernel for `tokens` rows of x (`triton.moe`) whose launch multiplies
    weights of types `names` (gate and up together, or one) in `layout` (WORDS where every one's
    rows are): "dot8" and "gemv" read each (token, slot) pair's expert rows by themselves, which
    costs nothing extra while few pairs share an expert, "dot8" on integer dot products where it
    reads the weights; "gemm" sorts the pairs by expert on the device and reads each expert's blocks
    once for up to a tile of its pairs. `preference`: "auto", or one of MOE_KERNELS forced
    (benchmarks, tests); "dot8" becomes "gemv" for weights it cannot read. Without `names`, "gemv"
    stands for either GEMV (the question is then only whether to sort the pairs)."""
    if preference in MOE_KERNELS:
        choice = preference
    elif preference == "auto":
        choice = "gemm" if tokens > MOE_GEMV_MAX_TOKENS else "dot8"
    else:
        raise LlmxError(f"unknown expert kernel {preference!r}; choose one of {', '.join(MOE_KERNELS)}")
    if choice == "dot8" and not _int8_readable(names, layout):
        return "gemv"
    return choice


def bucket(m: int) -> int:
    """The bucket of M = m rows of x (an index into `kernels`' answer)."""
    return BUCKET_OF[m] if m < len(BUCKET_OF) else LAST_BUCKET


def kernels(qt: QType, device: str, layout: str, preference: str = "auto") -> tuple[str, ...]:
    """The kernel of each M bucket for a weight of type `qt` on a `device` ("cuda", "cpu"; a GPU
    without Triton: "cuda-emulated") in `layout`."""
    return tuple(choose(qt, device, layout, m, preference) for m in (*BUCKET_TOPS, BUCKET_TOPS[-1] + 1))


def choose(qt: QType, device: str, layout: str, m: int, preference: str = "auto") -> str:
    """The kernel for M = m rows of x (see the module docstring for the table)."""
    if preference == "emulated" or device == "cuda-emulated":
        return "emulated"
    if device == "cuda":
        return _gpu(qt, layout, m, preference)
    if preference not in CPU_PREFERENCES:
        raise LlmxError(f"unknown kernel {preference!r}; choose one of {', '.join(CPU_PREFERENCES)}")
    if preference == "dequant":
        return "chunks"
    if layout == NATIVE:
        return "native" if m <= NATIVE_MAX_ROWS else "native_chunks"
    if layout == PACKED or preference == "packed":  # "packed" without a packed form: an error at the call
        return "packed"
    return "chunks"


def _gpu(qt: QType, layout: str, m: int, preference: str) -> str:
    if qt.is_float:
        return "float"
    readable = _int8_readable((qt.name,), layout)
    if preference in CPU_PREFERENCES:  # LLMX_KERNEL's CPU paths leave GPUs to the table
        return _gpu_table(qt.name, readable, m)
    if preference not in GPU_KERNELS:
        raise LlmxError(f"unknown kernel {preference!r}; choose one of {', '.join(GPU_KERNELS)}")
    if preference in ("dot8", "dot8_rows") and not (
        readable and (m <= DOT8_MAX_M or preference == "dot8_rows")
    ):
        return "gemv"  # rows (of W or x) it cannot read
    if preference in ("mmq", "mmh") and not readable:
        return _gpu_table(qt.name, readable, m)
    return preference


def _int8_readable(names: tuple[str, ...], layout: str) -> bool:
    """Whether the integer-dot GEMVs read weights of types `names` (at least one) in `layout`."""
    return bool(names) and layout == WORDS and all(name in DOT8_TYPES for name in names)


def _gpu_table(name: str, readable: bool, m: int) -> str:
    if readable and m <= DOT8_MAX_M:
        return "dot8"
    low, high = MMH_M.get(name, (0, -1))
    if readable and low <= m <= high:
        return "mmh"
    if readable and ROWS8_MIN_M <= m <= ROWS8_MAX_M:
        return "dot8_rows"
    low, high = MMQ_M.get(name, (0, -1))
    if readable and low <= m <= high:
        return "mmq"
    iq4 = name.startswith("IQ4")
    if m <= (GEMV_MAX_M if iq4 else FLOAT_GEMV_MAX_M):
        return "gemv"
    return "dequant" if iq4 or m >= DEQUANT_MIN_M else "gemm"
