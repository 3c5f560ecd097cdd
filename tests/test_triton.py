"""Triton kernels vs gguf-py's dequantize (+ float64 matmul), on random valid blocks.

Without CUDA the kernels run on CPU tensors under TRITON_INTERPRET=1 (set here before triton is
first imported) with small odd shapes; with CUDA the same tests compile for the GPU, and the
`gpu`-marked ones add larger shapes and bf16.

Tolerances, as ||out - ref|| / ||ref|| against float64 on the same dequantized weights:
- dequantize / embedding to float32: 0 (bit-exact);
- GEMV, float32 x: 1e-5 (float32 sums over K);
- fp16 output or fp16 GEMM operands: 2e-3; tf32 GEMM (float32 x on a GPU): 3e-3;
- bf16 (GPU only: the interpreter cannot load bf16): 1.5e-2 (8-bit mantissa on weights and output).
The integer-dot GEMV ("dot8") quantizes x to int8 per 32 values first: it is held to the same
tolerances against x quantized by `quantized_x_ref` (numpy, written from llama.cpp's q8_1
definition), and to DOT8_FLOAT_TOL against the float x.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from functools import cache

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("LLMX_TRITON_AUTOTUNE", "0")  # one GEMM config: compiling all is minutes
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from llmx.bench.blocks import SCALE_FIELDS, chunk_rng, random_data  # noqa: E402
from llmx.errors import LlmxError  # noqa: E402
from llmx.quant import (  # noqa: E402
    BLOCK_TYPES,
    QType,
    choice,  # noqa: E402
    qtype,
)
from llmx.quant.triton import activation, launch, tuning  # noqa: E402
from llmx.quant.triton import layout as lay  # noqa: E402
from llmx.quant.triton import matmul as tops  # noqa: E402
from llmx.quant.triton.bits import u32, word_bytes  # noqa: E402

TYPES = list(BLOCK_TYPES)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
GEMM_TOL = {torch.float32: 3e-3, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DOT8_FLOAT_TOL = 2e-2  # int8 x (random normal x: about 0.8% measured)
DOT8_TYPES = list(choice.DOT8_TYPES)
TUNED = tuning.for_device(torch.device(DEVICE))  # the launch shapes this device (or the interpreter) runs


class Weight:
    """The fields of llmx.quant.weight.QWeight that the kernels read."""

    def __init__(self, raw: torch.Tensor, qt: QType, shape: tuple[int, int]) -> None:
        self.raw, self.qtype, self.shape, self.name, self.packed = raw, qt, shape, "test", None


@pytest.fixture(params=["raw", "prepared"])
def layout(request: pytest.FixtureRequest) -> str:
    """Rows as in the GGUF, or repacked by layout.prepare (for the types it repacks)."""
    return request.param


def laid_out(w: Weight, name: str, layout: str) -> Weight:
    if layout == "raw":
        return w
    if name not in lay.PREPARED_TYPES:
        pytest.skip(f"prepare leaves {name} as it is")
    packed = lay.prepare(w)
    assert packed.raw.shape == w.raw.shape and packed.packed is lay.SPLIT
    return packed


def random_weight(name: str, n: int, k: int, seed: int) -> tuple[Weight, np.ndarray]:
    """A random valid [n, k] weight and its float64 reference dequantization.

    Blocks are random bytes (llmx.bench.blocks) whose fp16 scale fields then get independent
    random values in +-[2^-6, 2^-2], so a kernel that reads the wrong block's scale is caught.
    """
    qt = qtype(name)
    rng = chunk_rng(seed, qt.ggml_id)
    blocks = random_data(qt, n * k, 0.02, rng).reshape(-1, qt.block_bytes)
    for off in SCALE_FIELDS[name]:
        mags = np.exp2(rng.uniform(-6, -2, len(blocks))) * rng.choice([-1.0, 1.0], len(blocks))
        blocks[:, off : off + 2] = mags.astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(n, -1)
    ref = gguf_dequantize(raw, GGMLQuantizationType(qt.ggml_id)).astype(np.float64)
    return Weight(torch.from_numpy(raw.copy()).to(DEVICE), qt, (n, k)), ref


def width(name: str, blocks: int) -> int:
    return blocks * qtype(name).block_elems


def rel_err(out: torch.Tensor, ref: np.ndarray) -> float:
    got = out.double().cpu().numpy()
    assert np.isfinite(got).all()
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def quantized_x_ref(x: np.ndarray) -> np.ndarray:
    """x [M, K] float32 as the integer-dot GEMV sees it: per 32 values, d = max|x| / 127 and codes
    round(x * 127 / max|x|) (halves away from zero), back in float64 as d * code."""
    g = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(g).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0))
    v = g * inv
    codes = np.trunc(v + np.where(v >= 0, np.float32(0.5), np.float32(-0.5)))
    return (codes.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


def check_linear(
    w: Weight,
    ref_w: np.ndarray,
    m: int,
    dtype: torch.dtype,
    seed: int,
    kernel: str | None = None,
    gemv: tuning.LaunchShape | None = None,
) -> None:
    n, k = w.shape
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out = tops.linear(x.to(DEVICE), w, kernel=kernel, gemv=gemv)
    assert out.shape == (m, n) and out.dtype == dtype
    chosen = tops.kernel_for(w, m, kernel)
    tol = TOL[dtype] if chosen in ("gemv", *tops.INT8_KERNELS) else GEMM_TOL[dtype]
    if chosen == "mmh":  # f16 operands whatever x's dtype
        tol = max(tol, TOL[torch.float16])
    exact = x.double().numpy()
    if chosen in tops.INT8_KERNELS:
        assert rel_err(out, exact @ ref_w.T) < DOT8_FLOAT_TOL
        exact = quantized_x_ref(x.float().numpy())
    assert rel_err(out, exact @ ref_w.T) < tol


# --- small shapes: the CPU interpreter, or the GPU when there is one -------------------------------


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_exact(name: str, layout: str) -> None:
    w, ref = random_weight(name, 5, width(name, 3), seed=1)
    w = laid_out(w, name, layout)
    assert np.array_equal(tops.dequantize(w).cpu().numpy(), ref.astype(np.float32))


@pytest.mark.parametrize("name", TYPES)
def test_embedding_reads_the_chosen_rows(name: str, layout: str) -> None:
    w, ref = random_weight(name, 7, width(name, 2), seed=2)
    w = laid_out(w, name, layout)
    ids = torch.tensor([[6, 0, 3], [3, 3, 1]])
    out = tops.embedding(ids.to(DEVICE), w)
    assert out.shape == (2, 3, w.shape[1])
    assert np.array_equal(out.cpu().numpy(), ref[ids.numpy()].astype(np.float32))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv(name: str, m: int, layout: str) -> None:
    # N = 9 is not a multiple of the rows per program; 3 blocks are not a multiple of BK.
    w, ref = random_weight(name, 9, width(name, 3), seed=10 + m)
    check_linear(laid_out(w, name, layout), ref, m, torch.float32, seed=m, kernel="gemv")


@pytest.mark.parametrize("name", TYPES)
def test_gemv_fp16(name: str) -> None:
    check_linear(*random_weight(name, 6, width(name, 2), seed=20), 2, torch.float16, seed=20)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemm(name: str, dtype: torch.dtype, layout: str) -> None:
    # M = 17 and N = 33 leave partial tiles in both directions.
    w, ref = random_weight(name, 33, width(name, 3), seed=30)
    check_linear(laid_out(w, name, layout), ref, 17, dtype, seed=30, kernel="gemm")


@pytest.mark.parametrize("name", DOT8_TYPES)
@pytest.mark.parametrize(
    "shape",
    [
        (4, 256, 4),
        (4, 1024, 4),
        (2, 1024, 1),
        (2, 1024, 2),
        (4, 1024, 1),
        (2, 2048, 1),
        (4, 2048, 1),
        (2, 2048, 2),
        (4, 2048, 2),
        (2, 2048, 1, True),
        (4, 2048, 2, True),
        (2, 2048, 1, False, 128),
        (2, 2048, 1, False, 128, 4),
        (4, 4096, 4, True),
        (4, 4096, 4, True, 64),
    ],
    ids=str,
)
def test_dot8(name: str, shape: tuple[int, ...]) -> None:
    # 6 super-blocks (48 blocks for Q8_0) leave a partial step at BK = 1024 and 2048; N = 9 a partial
    # program. The launch shapes the H200 sweeps favoured (bench/RESULTS.md), main's defaults
    # (`tuning.Tuning.dot8`, short and long rows) among them.
    w, ref = random_weight(name, 9, 1536, seed=60)
    w = laid_out(w, name, "prepared")
    assert tops.kernel_for(w, 1, "dot8") == "dot8" and tops.kernel_for(w, 2, "dot8") == "gemv"
    check_linear(w, ref, 1, torch.float32, seed=shape[1], kernel="dot8", gemv=tuning.LaunchShape(*shape))


@pytest.mark.parametrize("m", [2, 3, 8, 17])
@pytest.mark.parametrize("name", DOT8_TYPES)
def test_dot8_rows(name: str, m: int) -> None:
    # each weight step dotted with several rows of x: 2, 3 and 8 rows in one program, 17 in three
    # chunks of 6 (the last repeats row 16, unstored); 6 super-blocks and N = 9 as in test_dot8
    w, ref = random_weight(name, 9, 1536, seed=100 + m)
    w = laid_out(w, name, "prepared")
    assert tops.kernel_for(w, m, "dot8_rows") == "dot8_rows"
    check_linear(w, ref, m, torch.float32, seed=m, kernel="dot8_rows")


@pytest.mark.parametrize(("name", "shape"), [("Q4_K", (4, 1024, 2, True)), ("Q6_K", (2, 512, 1))], ids=str)
def test_dot8_rows_several_steps(name: str, shape: tuple[int, ...]) -> None:
    # rows of several steps, the last partial (Q4_K's with its headers loaded late, once for all rows)
    w, ref = random_weight(name, 9, 1536, seed=110)
    w = laid_out(w, name, "prepared")
    check_linear(w, ref, 5, torch.float32, seed=111, kernel="dot8_rows", gemv=tuning.LaunchShape(*shape))


@pytest.mark.parametrize(
    ("kernel", "m", "widths"),
    [("dot8_rows", 3, (5, 3, 9)), ("mmq", 20, (5, 3, 130)), ("mmh", 20, (5, 3, 130))],
)
def test_kernels_share_launches(kernel: str, m: int, widths: tuple[int, int, int]) -> None:
    """q/k/v-like weights of one type in one launch, each output equal to its own (mmq's third past
    one tile of weight rows); a residual [M, N] added at the store."""
    ws = [laid_out(random_weight("Q4_K", n, 512, seed=120 + n)[0], "Q4_K", "prepared") for n in widths]
    g = torch.Generator().manual_seed(125)
    x, r = torch.randn(m, 512, generator=g).to(DEVICE), torch.randn(m, widths[-1], generator=g).to(DEVICE)
    outs = tops.run_many(x, x, ws, [kernel] * len(ws))
    assert [tuple(y.shape) for y in outs] == [(m, n) for n in widths]
    for y, w in zip(outs, ws, strict=True):
        assert torch.equal(y, tops.linear(x, w, kernel=kernel))
    plain = tops.linear(x, ws[-1], kernel=kernel)
    assert torch.equal(tops.linear(x, ws[-1], kernel=kernel, residual=r), plain + r)


@pytest.mark.parametrize("name", DOT8_TYPES)
def test_dot8_rows_compiles_for_hopper(name: str) -> None:
    # the interpreter runs what the GPU's compiler may refuse: bench/ptx_gemv.py compiles the kernel
    # for sm_90 at its tuned shape and ROWS8_BM rows (no GPU needed; its own process, as below)
    cfg = TUNED.dot8_rows(name)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    shape = ["--types", name, "--bn", str(cfg.bn), "--bk", str(cfg.bk), "--warps", str(cfg.num_warps)]
    shape += ["--late", str(int(cfg.late_headers)), "--maxnreg", str(cfg.max_registers or 0)]
    tool = [sys.executable, "bench/ptx_gemv.py", *shape, "--rows", str(tops.ROWS8_BM)]
    out = subprocess.run(tool, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith(f"| {name} |"))
    assert int(row.strip("| ").split(" | ")[2].split("(")[1].rstrip(")")) > 0, row  # 16-byte loads


def mmq_tile(monkeypatch: pytest.MonkeyPatch, tile: str) -> None:
    """Runs "mmq" at `tile` (BM/BN/BK/warps/stages) for every type instead of the tuned one."""
    tile_of = {name: tuning.GemmConfig.parse(tile) for name in DOT8_TYPES}
    monkeypatch.setattr(tops, "for_device", lambda device: dataclasses.replace(TUNED, mmq_shapes=tile_of))


@pytest.mark.parametrize("m", [16, 17, 40, 70])
@pytest.mark.parametrize("name", DOT8_TYPES)
@pytest.mark.parametrize("kernel", ["mmq", "mmh"])
def test_tensor_core_gemms(kernel: str, name: str, m: int) -> None:
    # the tuned tiles: M rounded up to 16, 32 (or mmh's 64) rows of x a program (17 and 40 leave rows
    # that repeat row M - 1, unstored), 70 in a further program of the tile; N = 140 a whole tile of
    # 128 weight rows and a partial one; Q8_0's 58 blocks leave a partial step of 8 (its blocks past
    # the row count 0), the K-quants' rows 4 super-blocks
    k = 58 * 32 if name == "Q8_0" else 1024
    w, ref = random_weight(name, 140, k, seed=130 + m)
    w = laid_out(w, name, "prepared")
    assert tops.kernel_for(w, m, kernel) == kernel
    check_linear(w, ref, m, torch.float32, seed=m, kernel=kernel)


@pytest.mark.parametrize("name", DOT8_TYPES)
def test_mmq_small_tiles(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 16 x 16 tiles: 40 rows of x in three programs (the last of 8 rows), 9 weight rows a partial
    # tile; 1024 weights a step: 6 super-blocks (48 Q8_0 blocks) a whole step and a partial one
    mmq_tile(monkeypatch, "16/16/1024/4/2")
    w, ref = random_weight(name, 9, 1536, seed=140)
    check_linear(laid_out(w, name, "prepared"), ref, 40, torch.float32, seed=141, kernel="mmq")


@pytest.mark.parametrize("name", DOT8_TYPES)
def test_mmq_split_over_k(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # two output tiles leave SMs idle (the interpreter stands in 8), so K is cut into ranges: the
    # sums equal the unsplit launch's to float32's rounding, a second launch gives the same bits
    # (ranges added in K's order whichever program ends last) and every counter is back at 0
    k = 56 * 32 if name == "Q8_0" else 1024
    w = laid_out(random_weight(name, 140, k, seed=160)[0], name, "prepared")
    x = torch.randn(24, k, generator=torch.Generator().manual_seed(161)).to(DEVICE)
    steps = -(-k // max(TUNED.mmq(name).bk, w.qtype.block_elems))
    assert tops.mmq_splits(2, steps, launch.sm_count(x.device, tops.INTERPRETED_SMS))[0] > 1
    split = tops.linear(x, w, kernel="mmq")
    assert torch.equal(split, tops.linear(x, w, kernel="mmq"))
    assert not launch.zeroed_counters(x.device).any()
    monkeypatch.setattr(tops, "MMQ_PROGRAMS_PER_SM", 0)
    assert rel_err(split, tops.linear(x, w, kernel="mmq").double().cpu().numpy()) < 1e-5


def test_mmq_splits() -> None:
    # a Llama-3-8B o projection at 64 rows: 32 tiles, 16 steps, 132 SMs -> 8 ranges of 2 steps;
    # gate and up (224 tiles) fill the GPU unsplit; 7 steps for 48 tiles: 3 ranges, none empty
    assert tops.mmq_splits(32, 16, 132) == (8, 2)
    assert tops.mmq_splits(224, 16, 132) == (1, 16)
    assert tops.mmq_splits(48, 7, 132) == (3, 3)
    assert tops.mmq_splits(2, 1, 132) == (1, 1)


@pytest.mark.parametrize("name", DOT8_TYPES)
@pytest.mark.parametrize("kernel", ["mmq", "mmh"])
def test_tensor_core_gemms_compile_for_hopper_without_spills(kernel: str, name: str) -> None:
    # bench/ptx_gemv.py compiles the kernel for sm_90 at the type's tuned tile and each BM a launch
    # takes (its own process, as below): tensor-core instructions, no registers spilled
    tile = TUNED.mmh_shapes[name][-1] if kernel == "mmh" else TUNED.mmq(name)  # the largest BM
    bms = [bm for bm in (16, 32, 64) if bm <= tile.bm]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tool = [sys.executable, "bench/ptx_gemv.py", "--types", name, f"--{kernel}", ",".join(map(str, bms))]
    out = subprocess.run(tool, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = [
        line.strip("| ").split(" | ") for line in out.stdout.splitlines() if line.startswith(f"| {name} |")
    ]
    assert [int(row[1].split("/")[0]) for row in rows] == bms, out.stdout
    for row in rows:
        spills, tensor_ops = int(row[3]), int(row[4])
        assert spills == 0 and tensor_ops > 0, row


def mmh_tile(monkeypatch: pytest.MonkeyPatch, tile: str) -> None:
    """Runs "mmh" at `tile` (BM/BN/BK/warps/stages) for every type instead of the tuned one."""
    tile_of = {name: (tuning.GemmConfig.parse(tile),) for name in DOT8_TYPES}
    monkeypatch.setattr(tops, "for_device", lambda device: dataclasses.replace(TUNED, mmh_shapes=tile_of))


@pytest.mark.parametrize("name", DOT8_TYPES)
def test_mmh_small_tiles_split_over_k(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 16 x 16 tiles: 40 rows of x in three programs (the last of 8 rows), 9 weight rows a partial
    # tile, so few tiles that K is cut into ranges: the sums equal the unsplit launch's to float32's
    # rounding, a second launch gives the same bits and every counter is back at 0
    mmh_tile(monkeypatch, "16/16/256/4/2")
    k = 48 * 32 if name == "Q8_0" else 1536
    w, ref = random_weight(name, 9, k, seed=180)
    w = laid_out(w, name, "prepared")
    check_linear(w, ref, 40, torch.float32, seed=181, kernel="mmh")
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(182)).to(DEVICE)
    assert tops.mmq_splits(3, k // 256, launch.sm_count(x.device, tops.INTERPRETED_SMS))[0] > 1  # 3 tiles
    split = tops.linear(x, w, kernel="mmh")
    assert torch.equal(split, tops.linear(x, w, kernel="mmh"))
    assert not launch.zeroed_counters(x.device).any()
    monkeypatch.setattr(tops, "MMQ_PROGRAMS_PER_SM", 0)
    assert rel_err(split, tops.linear(x, w, kernel="mmh").double().cpu().numpy()) < 1e-5


def test_dot8_q6_k_extreme_blocks() -> None:
    # Every code 0 (a weight of -32 d * scale), every scale -128 and x all one sign: a group's
    # integer sum times its scale is 128 * 16 * 32 * 127 = 2**23 - 2**15, past the 2**22 that the
    # float conversion by exponent tricks (`bits.int_f32`) holds exactly.
    n, k = 4, 1024
    blocks = np.zeros((n * k // 256, 210), np.uint8)
    blocks[:, 192:208] = 0x80  # int8 -128
    blocks[:, 208:210] = np.array([2**-8], np.float16).view(np.uint8)
    raw = blocks.reshape(n, -1)
    ref = gguf_dequantize(raw, GGMLQuantizationType.Q6_K).astype(np.float64)
    w = laid_out(Weight(torch.from_numpy(raw.copy()).to(DEVICE), qtype("Q6_K"), (n, k)), "Q6_K", "prepared")
    x = -torch.rand(1, k, generator=torch.Generator().manual_seed(5)) - 1.0
    out = tops.linear(x.to(DEVICE), w, kernel="dot8")
    assert tops.kernel_for(w, 1, "dot8") == "dot8"
    assert rel_err(out, quantized_x_ref(x.numpy()) @ ref.T) < TOL[torch.float32]


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("k", [4096, TUNED.long_row + 2048])
def test_dot8_row_length_picks_the_launch_shape(name: str, k: int) -> None:
    # Q4_K and Q8_0 rows of exactly 4096 weights (Llama-3-8B's attention projections, gate and up) run
    # as one step a program, rows of DOT8_LONG_ROW weights and more (a down projection) on their own
    # shape of several steps, other rows on the default; the results are held to the same tolerances.
    shapes = {TUNED.dot8(name, n) for n in (2048, 4096, TUNED.long_row)}
    assert len(shapes) == 3 and TUNED.dot8(name, 4096).bk == 4096
    w, ref = random_weight(name, 9, k, seed=61)
    check_linear(laid_out(w, name, "prepared"), ref, 1, torch.float32, seed=62, kernel="dot8")


@pytest.mark.parametrize(
    ("kernel", "name", "k"), [("dot8", "Q6_K", 512), ("gemv", "Q6_K", 512), ("dot8", "Q4_K", 1536)]
)
def test_a_residual_is_added_to_the_product(kernel: str, name: str, k: int) -> None:
    # the integer-dot GEMV adds it as it stores (one float32 add, as torch's), the others after; Q4_K
    # at its one-step shape, whose programs end in a reduce-scatter on a GPU (N = 9: a partial program)
    w, _ = random_weight(name, 9, k, seed=80)
    w = laid_out(w, name, "prepared")
    gemv = TUNED.dot8(name, 4096) if name == "Q4_K" else None
    g = torch.Generator().manual_seed(81)
    x, r = torch.randn(1, k, generator=g).to(DEVICE), torch.randn(1, 9, generator=g).to(DEVICE)
    plain = tops.linear(x, w, kernel=kernel, gemv=gemv)
    assert torch.equal(tops.linear(x, w, kernel=kernel, gemv=gemv, residual=r), plain + r)


def test_dot8_shares_quantized_x_and_needs_aligned_rows() -> None:
    w4, ref4 = random_weight("Q4_K", 5, 512, seed=70)
    w6, ref6 = random_weight("Q6_K", 7, 512, seed=71)
    w8, ref8 = random_weight("Q8_0", 3, 96, seed=72)  # 3 blocks: 102-byte rows, not word-aligned
    assert [tops.kernel_for(w, 1, "dot8") for w in (w4, w6, w8)] == ["gemv"] * 3  # GGUF rows: not its layout
    w4, w6, w8 = (laid_out(w, name, "prepared") for w, name in ((w4, "Q4_K"), (w6, "Q6_K"), (w8, "Q8_0")))
    assert [tops.kernel_for(w, 1, "dot8") for w in (w4, w6, w8)] == ["dot8", "dot8", "gemv"]
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(73))
    outs = tops.linear_many(x.to(DEVICE), [w4, w6, w6])  # one quantized x for all three
    xq = quantized_x_ref(x.numpy())
    assert rel_err(outs[0], xq @ ref4.T) < TOL[torch.float32]
    assert rel_err(outs[1], xq @ ref6.T) < TOL[torch.float32]
    assert torch.equal(outs[1], outs[2])
    check_linear(w8, ref8, 1, torch.float32, seed=74)


def test_dot8_serves_up_to_three_weights_a_launch() -> None:
    """Four Q4_K weights of different heights and a Q6_K between them: launches of three and one
    Q4_K weights and one Q6_K, each output equal to that weight's own GEMV."""
    ws = [laid_out(random_weight("Q4_K", n, 512, seed=90 + n)[0], "Q4_K", "prepared") for n in (5, 3, 9, 2)]
    ws.insert(2, laid_out(random_weight("Q6_K", 7, 512, seed=99)[0], "Q6_K", "prepared"))
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(98)).to(DEVICE)
    outs = tops.linear_many(x, ws)
    assert [tuple(y.shape) for y in outs] == [(1, 5), (1, 3), (1, 7), (1, 9), (1, 2)]
    for y, w in zip(outs, ws, strict=True):
        assert torch.equal(y, tops.linear(x, w))


@triton.jit
def words_kernel(src, words_out, bytes_out, N: tl.constexpr):
    off = 2 * tl.arange(0, N)
    w = u32(src, off[None, :, None])  # [1, N, 1], as the unpackers shape them
    tl.store(words_out + tl.arange(0, N), tl.reshape(w, [N]))
    tl.store(bytes_out + tl.arange(0, 4 * N), tl.reshape(word_bytes(w), [4 * N]))


def test_words_load_at_any_two_aligned_offset() -> None:
    """bits.u32 reads the 4 bytes at every even offset (two words joined where it is not 4-aligned)
    and word_bytes splits words into their bytes, low one first, as the K-quant unpackers use them."""
    data = np.random.default_rng(7).integers(0, 256, 80, dtype=np.uint8)
    src = torch.from_numpy(data).to(DEVICE)
    words = torch.empty(32, dtype=torch.int32, device=DEVICE)
    bytes_ = torch.empty(128, dtype=torch.int32, device=DEVICE)
    words_kernel[(1,)](src, words, bytes_, N=32)
    starts = 2 * np.arange(32)
    expected = np.stack([data[s : s + 4] for s in starts])
    assert np.array_equal(words.cpu().numpy().view(np.uint8).reshape(32, 4), expected)
    assert np.array_equal(bytes_.cpu().numpy(), expected.reshape(-1))


@pytest.mark.parametrize("chunk", [1 << 30, 5 * 512 * 2])
def test_dequant_matmul_in_half_precision_chunks(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # 5 rows a chunk: 33 rows take 7 chunks, the last one partial.
    monkeypatch.setattr(tops, "DEQUANT_CHUNK_BYTES", chunk)
    w, ref = random_weight("Q4_K", 33, 512, seed=80)
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(81))
    x[3] *= 1e6  # far outside fp16's range: the per-row scale keeps it in
    out = tops.linear(x.to(DEVICE), w, kernel="dequant")
    assert out.dtype == torch.float32 and out.shape == (17, 33)
    assert rel_err(out, x.double().numpy() @ ref.T) < GEMM_TOL[torch.float32]
    assert rel_err(out[3:4], x[3:4].double().numpy() @ ref.T) < GEMM_TOL[torch.float32]


def test_dequant_matmul_chunks_are_whole_multiples_of_the_row_alignment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 7 rows fit a chunk; with whole multiples of 4 rows, 33 rows take 4 x 8 chunks and a last row.
    monkeypatch.setattr(tops, "DEQUANT_CHUNK_BYTES", 7 * 512 * 2)
    monkeypatch.setattr(tops, "DEQUANT_ROW_ALIGN", 4)
    spans = []
    dequantize_rows = tops.dequantize_rows

    def recorded(w: object, r0: int, r1: int, *args: object) -> torch.Tensor:
        spans.append((r0, r1))
        return dequantize_rows(w, r0, r1, *args)

    monkeypatch.setattr(tops, "dequantize_rows", recorded)
    w, ref = random_weight("Q8_0", 33, 512, seed=82)
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(83))
    out = tops.linear(x.to(DEVICE), w, kernel="dequant")
    assert spans == [(r, min(33, r + 4)) for r in range(0, 33, 4)]
    assert rel_err(out, x.double().numpy() @ ref.T) < GEMM_TOL[torch.float32]


def test_prompt_weights_share_one_half_precision_x(monkeypatch: pytest.MonkeyPatch) -> None:
    """linear_many scales a prompt's float32 x into fp16 once for all its weights, and each result
    equals that weight's own linear bit for bit."""
    ws = [random_weight(name, n, 256, seed=n)[0] for name, n in (("Q4_K", 12), ("Q6_K", 5), ("Q8_0", 9))]
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    alone = [tops.linear(x, w) for w in ws]
    calls = []
    half_rows = tops.half_rows
    monkeypatch.setattr(tops, "half_rows", lambda x2: calls.append(1) or half_rows(x2))
    together = tops.linear_many(x, ws)
    assert len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))


def test_quantize_x_matches_the_reference() -> None:
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(75))
    x[1, 32:64] = 0  # an all-zero group: scale 0, codes 0
    qx = activation.quantize_x(x.to(DEVICE))
    q, dx = qx.q.cpu().double(), qx.dx.cpu().double()
    assert np.array_equal((q.view(3, 3, 32) * dx[:, :, None]).view(3, 96).numpy(), quantized_x_ref(x.numpy()))
    sums = q.view(3, 6, 16).sum(-1) * dx.repeat_interleave(2, dim=1)
    assert torch.allclose(qx.sums.cpu().double(), sums, rtol=1e-6, atol=0)


def pick_kernel(name: str, m: int) -> str:
    return choice.choose(qtype(name), "cuda", choice.WORDS, m)


def test_kernel_choice() -> None:
    lo, hi = choice.ROWS8_MIN_M, choice.ROWS8_MAX_M
    assert [pick_kernel("Q8_0", m) for m in (1, lo, hi)] == ["dot8", "dot8_rows", "dot8_rows"]
    split = [choice.choose(qtype("Q4_K"), "cuda", choice.SPLIT, m) for m in (1, 2, 4, 5, 15, 16)]
    assert split == ["gemv"] * 3 + ["gemm"] * 2 + ["dequant"]  # rows the integer dots cannot read
    assert [pick_kernel("Q4_1", m) for m in (1, 4, 5)] == ["gemv"] * 2 + ["gemm"]
    assert [pick_kernel("IQ4_XS", m) for m in (8, 9)] == ["gemv", "dequant"]


@pytest.mark.parametrize("kernel", ["gemm", "dequant"])
def test_forced_kernels(kernel: str) -> None:
    w, ref = random_weight("Q6_K", 10, 512, seed=35)
    check_linear(w, ref, 2, torch.float16, seed=35, kernel=kernel)
    with pytest.raises(LlmxError, match="at most 8 rows"):
        tops.linear(torch.zeros(9, 512, device=DEVICE), w, kernel="gemv")


def test_leading_dims_and_float_weights() -> None:
    w, ref = random_weight("Q4_K", 6, 256, seed=40)
    x = torch.randn(2, 3, 256)
    expected = x.reshape(6, 256).double().numpy() @ ref.T
    out = tops.linear(x.to(DEVICE), w)
    assert out.shape == (2, 3, 6)
    assert rel_err(out.reshape(6, 6), expected) < TOL[torch.float32]
    dense = Weight(torch.from_numpy(ref.astype(np.float32)).to(DEVICE), qtype("F32"), (6, 256))
    assert rel_err(tops.linear(x.to(DEVICE), dense).reshape(6, 6), expected) < 1e-5


def test_unsupported_type_is_a_clear_error() -> None:
    qt = qtype("IQ2_XXS")
    w = Weight(torch.zeros(2, qt.block_bytes, dtype=torch.uint8), qt, (2, 256))
    with pytest.raises(LlmxError, match=r"\(IQ2_XXS\) has no Triton kernel"):
        tops.linear(torch.zeros(1, 256), w)


# --- GPU: model-sized shapes and bf16 ---------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cache
def large_weight(name: str) -> tuple[Weight, np.ndarray]:
    """One 1000 x 4096 weight per type, shared by the GPU tests (making it dominates their time)."""
    return random_weight(name, 1000, 4096, seed=50)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", TYPES)
def test_gpu_dequantize_large(name: str, layout: str) -> None:
    w, ref = large_weight(name)
    w = laid_out(w, name, layout)
    assert np.array_equal(tops.dequantize(w).cpu().numpy(), ref.astype(np.float32))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize(
    ("m", "dtype"),
    [(1, torch.bfloat16), (1, torch.float32), (2, torch.float16), (5, torch.bfloat16), (8, torch.float32)]
    + [(40, torch.bfloat16), (100, torch.bfloat16), (100, torch.float16)],
)
def test_gpu_linear_large(name: str, m: int, dtype: torch.dtype, layout: str) -> None:
    w, ref = large_weight(name)
    check_linear(laid_out(w, name, layout), ref, m, dtype, seed=m)


@pytest.mark.parametrize(
    ("name", "k"), [("Q4_K", 4096), ("Q4_K", 14336), ("Q6_K", 4096), ("Q8_0", 4096), ("Q8_0", 14336)]
)
def test_dot8_loop_moves_no_data_between_threads(name: str, k: int) -> None:
    # With [rows, blocks, quads, 4] tensors Triton 3.6 laid the rows out across threads and its loop
    # moved x and the partial sums between them with ~30 shuffles a step (bench/RESULTS.md, session
    # 9); along one axis of words, every row and the x it meets stay in one thread. bench/ptx_gemv.py
    # compiles the default shape for Hopper (no GPU needed; not under the interpreter, hence its own
    # process).
    cfg = TUNED.dot8(name, k)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    shape = ["--types", name, "--bn", str(cfg.bn), "--bk", str(cfg.bk), "--warps", str(cfg.num_warps)]
    shape += ["--late", str(int(cfg.late_headers)), "--maxnreg", str(cfg.max_registers or 0)]
    tool = [sys.executable, "bench/ptx_gemv.py", *shape]
    out = subprocess.run(tool, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith(f"| {name} |"))
    cells = row.strip("| ").split(" | ")
    loads, shuffles, barriers, end = *cells[2:5], cells[-1]
    vectors = int(loads.split("(")[1].rstrip(")"))  # 16-byte loads: the codes at least
    assert vectors > 0 and int(shuffles) == 0 and int(barriers) == 0, row
    # Q4_K's one-step rows end in the reduce-scatter (dot8.SCATTER4_ASM: 6 shuffles, 1 barrier, no
    # layout conversion before it), the others in tl.sum's
    assert (end == "6/1") == (name == "Q4_K" and k == 4096), row
