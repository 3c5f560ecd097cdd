"""The grouped expert kernels (`llmx.quant.triton.moe`) against dense float64 matmuls per chosen expert.

Expert weights are random valid blocks (`test_triton.random_weight`), dequantized by gguf-py for the
reference. Without CUDA the kernels run in Triton's interpreter on small shapes: ragged routings
(unused experts, one expert taken by more pairs than a GEMM tile holds), T = 1, few tokens (the
grouped GEMVs) and more than a tile (the grouped GEMM). The `gpu`-marked tests add Qwen3-30B-A3B's
shapes (2048 x 768 experts, 128 of them, top-8), with the reference dequantized on the GPU, and
CUDA-graph capture. Tolerances are test_triton's: float32 sums for the GEMVs; for the GEMM, its
tiles' type (`gemm_tol`). The integer-dot GEMV ("dot8") multiplies x quantized to int8 per 32
values: as the dense one, it is held to the float32 tolerance against the reference on x so quantized
(`quantized_x_ref`), and to DOT8_FLOAT_TOL (x's rounding, at most 1/254 of a group's largest |x|
a value) against the plain float x.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cache

import numpy as np
import pytest
import torch

from llmx.bench.blocks import chunk_rng, random_data
from llmx.errors import LlmxError
from llmx.quant import choice, qtype
from llmx.quant.triton import activation, autotune, moe, tuning
from llmx.quant.triton import layout as lay
from llmx.quant.triton import matmul as tops
from llmx.quant.triton.tuning import GemmConfig
from tests.test_triton import (
    DEVICE,
    DOT8_FLOAT_TOL,
    GEMM_TOL,
    TOL,
    Weight,
    laid_out,
    quantized_x_ref,
    random_weight,
    rel_err,
    width,
)

GEMV_T = choice.MOE_GEMV_MAX_TOKENS  # the most tokens the grouped GEMV takes
BM = autotune.INTERPRETED.bm if DEVICE == "cpu" else None  # the interpreter's GEMM tile


def gemm_tol(dtype: torch.dtype) -> float:
    """The grouped GEMM's tolerance for x of `dtype`: its tiles are bf16 on a GPU (fp16 for fp16 x),
    float32 in the interpreter (the output still rounded to x's dtype)."""
    return GEMM_TOL[dtype if DEVICE == "cpu" or dtype == torch.float16 else torch.bfloat16]


def experts(name: str, e: int, n: int, k: int, seed: int, layout: str = "raw") -> tuple[Weight, np.ndarray]:
    """A stacked expert weight (E, N, K) of random valid blocks, and its float64 [E, N, K] reference.
    layout: "raw" (the GGUF's), "prepared" (`layout.prepare`'s), "aligned" (prepared, rows at
    `layout.row_pitch`, as a GPU load places them)."""
    w, ref = random_weight(name, e * n, k, seed)
    w = laid_out(w, name, "prepared" if layout == "aligned" else layout)
    if layout == "aligned":
        w.raw = lay.with_pitch(w.raw, lay.row_pitch(name, w.raw.shape[1]))
    w.shape = (e, n, k)
    return w, ref.reshape(e, n, k)


def ids_tensor(ids: list[list[int]]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int32, device=DEVICE)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def per_slot(x: np.ndarray, ref: np.ndarray, ids: torch.Tensor) -> np.ndarray:
    """[T, k, N]: ref[ids[t, j]] @ x[t] (x [T, K]) or @ x[t, j] (x [T, k, K])."""
    e = ids.cpu().numpy()
    xs = x if x.ndim == 3 else np.repeat(x[:, None, :], e.shape[1], axis=1)
    return np.einsum("tjnk,tjk->tjn", ref[e], xs)


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def gate_input(t: int, ref_gate: np.ndarray, seed: int) -> torch.Tensor:
    """x [t, K] scaled so that the gate's products are of order 1, where silu is not yet linear or
    zero (random blocks' weights are large: products of plain normal x reach hundreds)."""
    x = randn(t, ref_gate.shape[2], seed=seed)
    return x * (2.0 / float(np.std(x.double().numpy() @ ref_gate[0].T)))


def ragged(t: int, k: int, e: int, seed: int) -> list[list[int]]:
    """A routing of t tokens over e experts, k distinct a token: expert 1 in every token (more pairs
    than a GEMM tile when t > BM), expert 0 never, the rest at random."""
    rng = np.random.default_rng(seed)
    return [[1, *(rng.choice(np.arange(2, e), k - 1, replace=False).tolist())] for _ in range(t)]


# --- the layout of a routing: torch ops only ---------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "n_expert", "block_m"),
    [(ragged(20, 3, 7, 1), 7, 16), ([[2]], 4, 16), ([[0, 1], [2, 3]], 4, 1), ([[3, 3, 3]] * 11, 5, 4)],
    ids=["ragged", "one pair", "unpadded", "one expert"],
)
def test_route_groups_every_pair_once_by_expert(ids: list[list[int]], n_expert: int, block_m: int) -> None:
    r = moe.route(torch.tensor(ids, dtype=torch.int32), n_expert, GemmConfig(block_m, 32, 64, 4, 1))
    flat = np.array(ids).reshape(-1)
    n = flat.size
    pairs, block_expert = r.pairs.numpy(), r.block_expert.numpy()
    assert r.n_pairs == n and r.block_m == block_m
    assert pairs.size == block_expert.size * block_m  # sized for any routing of n pairs
    assert sorted(pairs[pairs < n].tolist()) == list(range(n)) and (pairs[pairs >= n] == n).all()
    owner = np.repeat(block_expert, block_m)
    used = pairs < n
    assert (owner[used] == flat[pairs[used]]).all()  # each block holds one expert's pairs
    assert (np.diff(block_expert) >= 0).all() and block_expert[-1] <= n_expert
    counts = np.bincount(flat, minlength=n_expert)
    assert (block_expert < n_expert).sum() == (-(-counts // block_m)).sum()  # no block more than needed
    for e in range(n_expert):  # each expert's pairs in their order
        assert pairs[used & (owner == e)].tolist() == np.flatnonzero(flat == e).tolist()


# --- few tokens: the grouped GEMV ---------------------------------------------------------------------

KEY_TYPES = ["Q4_K", "Q6_K", "Q8_0"]  # the experts of Q4_K_M files
OTHER_TYPES = ["Q4_0", "Q5_1", "Q2_K", "Q5_K", "IQ4_XS"]


@pytest.mark.parametrize("name", KEY_TYPES)
@pytest.mark.parametrize("layout", ["raw", "prepared"])
def test_gemv_reads_each_pairs_expert(name: str, layout: str) -> None:
    # 5 experts (0 and 3 unused), N = 9 (a partial program), 2 blocks a row; the float GEMV forced
    # (prepared rows of these types take the integer-dot one by default)
    w, ref = experts(name, 5, 9, width(name, 2), seed=1, layout=layout)
    ids = ids_tensor([[4, 1], [1, 4], [2, 1]])
    x = randn(3, w.shape[2], seed=2)
    y = moe.moe_linear(x.to(DEVICE), w, ids, kernel="gemv")
    assert y.shape == (3, 2, 9) and y.dtype == torch.float32
    assert rel_err(y, per_slot(x.double().numpy(), ref, ids)) < TOL[torch.float32]


@pytest.mark.parametrize("name", OTHER_TYPES)
def test_gemv_other_types(name: str) -> None:
    w, ref = experts(name, 3, 5, width(name, 1), seed=3)
    ids = ids_tensor([[2, 0]])
    x = randn(1, w.shape[2], seed=4)
    assert rel_err(moe.moe_linear(x.to(DEVICE), w, ids), per_slot(x.double().numpy(), ref, ids)) < 1e-5


def test_gemv_one_token_one_slot_in_fp16() -> None:
    w, ref = experts("Q4_K", 4, 6, 256, seed=5)
    ids = ids_tensor([[3]])
    x = randn(1, 256, seed=6).half()
    y = moe.moe_linear(x.to(DEVICE), w, ids)
    assert y.dtype == torch.float16 and y.shape == (1, 1, 6)
    assert rel_err(y, per_slot(x.double().numpy(), ref, ids)) < TOL[torch.float16]


def test_gemv_fused_gate_and_up_of_two_types() -> None:
    # Q4_K_M files can give gate and up different types: each keeps its own decoding in the launch
    gate, ref_g = experts("Q4_K", 5, 7, 512, seed=7, layout="prepared")
    up, ref_u = experts("Q6_K", 5, 7, 512, seed=8)
    ids = ids_tensor([[0, 3, 4], [4, 2, 0]])
    x = gate_input(2, ref_g, seed=9)
    h = moe.moe_swiglu(x.to(DEVICE), gate, up, ids)
    xd = x.double().numpy()
    assert h.shape == (2, 3, 7)
    assert rel_err(h, silu(per_slot(xd, ref_g, ids)) * per_slot(xd, ref_u, ids)) < TOL[torch.float32]


def test_gemv_down_sums_the_slots_weighted() -> None:
    w, ref = experts("Q6_K", 6, 9, 256, seed=10)
    ids = ids_tensor([[5, 2], [2, 2], [0, 5], [1, 3]])  # a token may take one expert twice
    h, topw = randn(4, 2, 256, seed=11), torch.rand(4, 2, generator=torch.Generator().manual_seed(12))
    per = per_slot(h.double().numpy(), ref, ids)
    y = moe.moe_linear(h.to(DEVICE), w, ids, topw.to(DEVICE))
    assert y.shape == (4, 9)
    assert rel_err(y, np.einsum("tjn,tj->tn", per, topw.double().numpy())) < TOL[torch.float32]
    assert rel_err(moe.moe_linear(h.to(DEVICE), w, ids), per) < TOL[torch.float32]  # per slot: [T, k, N]
    res = randn(4, 9, seed=13)  # the layer's residual, added in the same launch
    y_res = moe.moe_linear(h.to(DEVICE), w, ids, topw.to(DEVICE), residual=res.to(DEVICE))
    assert torch.equal(y_res.cpu(), (y.cpu() + res))  # y's float32 sum plus the row: one rounding either way


# --- few tokens on integer dot products: the grouped integer-dot GEMV ---------------------------------


def check_dot8(y: torch.Tensor, x: torch.Tensor, ref_of: Callable[[np.ndarray], np.ndarray]) -> None:
    """y against ref_of(x) with x as the kernel quantizes it (float32 sums), and with x as it is."""
    shape = x.shape
    xq = quantized_x_ref(x.float().reshape(-1, shape[-1]).cpu().numpy()).reshape(shape)
    assert rel_err(y, ref_of(xq)) < TOL[torch.float32]
    assert rel_err(y, ref_of(x.double().cpu().numpy())) < DOT8_FLOAT_TOL


@pytest.mark.parametrize("name", KEY_TYPES)
def test_gemv8_reads_each_pairs_expert(name: str) -> None:
    # 6 experts (0 unused), T = 3 tokens x k = 3 slots, one expert twice in a token, N = 5 (a partial
    # program of every launch shape), 2 blocks a row
    w, ref = experts(name, 6, 5, width(name, 2) if name != "Q8_0" else 128, seed=40, layout="prepared")
    ids = ids_tensor([[4, 1, 4], [1, 5, 2], [3, 2, 1]])
    x = randn(3, w.shape[2], seed=41)
    y = moe.moe_linear(x.to(DEVICE), w, ids)
    assert y.shape == (3, 3, 5) and y.dtype == torch.float32
    assert moe.kernel_of(3, [w]) == "dot8"
    check_dot8(y, x, lambda xs: per_slot(xs, ref, ids))


@pytest.mark.parametrize("name", KEY_TYPES)
def test_gemv8_down_sums_the_slots_weighted(name: str) -> None:
    # the down projection's [T, k, K] input, one row a pair, summed over the slots in the program;
    # 3 blocks a row (Q4_K, Q6_K: a step of 4 with one past the row; Q8_0: 96 weights, 102-byte rows,
    # not word-aligned: 128)
    k = width(name, 3) if name != "Q8_0" else 128
    w, ref = experts(name, 5, 6, k, seed=42, layout="aligned")  # Q6_K: 630-byte rows, 640 apart
    ids = ids_tensor([[4, 2], [2, 2], [0, 4]])
    h, topw = randn(3, 2, k, seed=43), torch.rand(3, 2, generator=torch.Generator().manual_seed(44))
    y = moe.moe_linear(h.to(DEVICE), w, ids, topw.to(DEVICE))
    assert y.shape == (3, 6) and moe.kernel_of(3, [w]) == "dot8"
    check_dot8(y, h, lambda hs: np.einsum("tjn,tj->tn", per_slot(hs, ref, ids), topw.double().numpy()))
    res = randn(3, 6, seed=45)  # the layer's residual, added in the same launch (to one of a /h2
    # shape's two partial sums: the order of the additions differs from y + res)
    y_res = moe.moe_linear(h.to(DEVICE), w, ids, topw.to(DEVICE), residual=res.to(DEVICE))
    assert rel_err(y_res, (y.cpu() + res).double().numpy()) < 1e-6


@pytest.mark.parametrize("name", KEY_TYPES)
def test_gemv8_down_in_two_halves(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # a launch shape's /h2: each token's 4 slots summed by two programs of 2 slots, which add their
    # sums (the first with the residual) into the output that x's quantization zeroed
    k = width(name, 3) if name != "Q8_0" else 128
    w, ref = experts(name, 5, 6, k, seed=60, layout="aligned")
    ids = ids_tensor([[4, 2, 1, 0], [2, 2, 3, 3], [0, 4, 1, 1]])
    h, topw = randn(3, 4, k, seed=61), torch.rand(3, 4, generator=torch.Generator().manual_seed(62))
    res = randn(3, 6, seed=63).to(DEVICE)
    whole = moe.moe_linear(h.to(DEVICE), w, ids, topw.to(DEVICE), residual=res)
    summed = tuning.Tuning.moe_dot8
    halved = lambda self, name, s: replace(summed(self, name, s), halves=2 if s else 1)  # noqa: E731
    monkeypatch.setattr(tuning.Tuning, "moe_dot8", halved)
    assert moe._halves(w, k, True, 4, whole) == 2 and moe._halves(w, k, True, 3, whole) == 1
    split = moe.moe_linear(h.to(DEVICE), w, ids, topw.to(DEVICE), residual=res)
    assert rel_err(split, whole.double().cpu().numpy()) < 1e-6  # the same sums, added in two parts
    check_dot8(
        split - res, h, lambda hs: np.einsum("tjn,tj->tn", per_slot(hs, ref, ids), topw.double().numpy())
    )
    assert torch.equal(split, moe.moe_linear(h.to(DEVICE), w, ids, topw.to(DEVICE), residual=res))


def test_quantize_x_zeroes_the_output_the_next_launch_adds_into() -> None:
    x = randn(3, 256, seed=64).to(DEVICE)
    out = torch.full((1001,), float("nan"), device=DEVICE)  # more values than its programs' even shares
    zeroed, alone = activation.quantize_x(x, out), activation.quantize_x(x)
    assert torch.equal(out, torch.zeros_like(out))
    assert all(torch.equal(getattr(zeroed, f), getattr(alone, f)) for f in ("q", "dx", "sums"))


@pytest.mark.parametrize(("gate_type", "up_type"), [("Q4_K", "Q4_K"), ("Q6_K", "Q8_0")])
def test_gemv8_fused_gate_and_up(gate_type: str, up_type: str) -> None:
    gate, ref_g = experts(gate_type, 5, 6, 512, seed=45, layout="prepared")
    up, ref_u = experts(up_type, 5, 6, 512, seed=46, layout="prepared")
    ids = ids_tensor([[0, 3], [4, 4]])
    x = gate_input(2, ref_g, seed=47)
    h = moe.moe_swiglu(x.to(DEVICE), gate, up, ids)
    assert h.shape == (2, 2, 6) and moe.kernel_of(2, [gate, up]) == "dot8"
    check_dot8(h, x, lambda xs: silu(per_slot(xs, ref_g, ids)) * per_slot(xs, ref_u, ids))


def test_gemv8_rows_of_several_steps() -> None:
    # rows longer than a step (Q8_0: 2048 weights a step, 2080 a row: a second step of one block) take
    # each pair through dot8.row_dots, gated and summed; 2210-byte rows, 2224 apart
    k = 2080
    gate, ref_g = experts("Q8_0", 3, 3, k, seed=53, layout="aligned")
    up, ref_u = experts("Q8_0", 3, 3, k, seed=54, layout="aligned")
    ids = ids_tensor([[2, 0], [1, 2]])
    x, topw = gate_input(2, ref_g, seed=55), torch.rand(2, 2, generator=torch.Generator().manual_seed(56))
    h = moe.moe_swiglu(x.to(DEVICE), gate, up, ids)
    assert moe.kernel_of(2, [gate, up]) == "dot8" and moe._gemv8_shape(gate, k, False)[1] < k
    check_dot8(h, x, lambda xs: silu(per_slot(xs, ref_g, ids)) * per_slot(xs, ref_u, ids))
    xs = randn(2, 2, k, seed=57)
    y = moe.moe_linear(xs.to(DEVICE), up, ids, topw.to(DEVICE))
    check_dot8(y, xs, lambda v: np.einsum("tjn,tj->tn", per_slot(v, ref_u, ids), topw.double().numpy()))


@pytest.fixture
def wide_programs(monkeypatch) -> None:
    """The grouped GEMVs with 32 weight rows a program where a GPU's tuning has 2-8: the interpreter
    takes about as long for a program of 32 rows as of 2, and the rows a program takes are not what
    a test of how weights are laid out checks."""
    if torch.cuda.is_available():
        return
    for method in ("moe_dot8", "gemv"):
        tuned = getattr(tuning.Tuning, method)
        wide = lambda self, *a, tuned=tuned: replace(tuned(self, *a), bn=32)  # noqa: E731
        monkeypatch.setattr(tuning.Tuning, method, wide)


@pytest.mark.usefixtures("wide_programs")
def test_moe_ffn_on_integer_dots() -> None:
    # Q4_K gate and up, a Q8_0 down of short rows (few programs for the interpreter; each type's
    # down projection is tested above); h = silu(gate) * up quantized again for the down
    # projection: against the float reference, twice x's rounding at most
    d, f, e, k, t = 256, 64, 4, 2, 2
    gate, ref_g = experts("Q4_K", e, f, d, seed=48, layout="prepared")
    up, ref_u = experts("Q4_K", e, f, d, seed=49, layout="prepared")
    down, ref_d = experts("Q8_0", e, d, f, seed=50, layout="aligned")
    ids = ids_tensor([[1, 3], [3, 3]])
    x, topw = gate_input(t, ref_g, seed=51), torch.rand(t, k, generator=torch.Generator().manual_seed(52))
    y = moe.moe_ffn(x.to(DEVICE), gate, up, down, ids, topw.to(DEVICE))
    xd = x.double().numpy()
    h = silu(per_slot(xd, ref_g, ids)) * per_slot(xd, ref_u, ids)
    y_ref = np.einsum("tjn,tj->tn", per_slot(h, ref_d, ids), topw.double().numpy())
    assert y.shape == (t, d) and rel_err(y, y_ref) < 2 * DOT8_FLOAT_TOL


@pytest.mark.usefixtures("wide_programs")
@pytest.mark.parametrize(("name", "width"), [("Q8_0", 96), ("Q6_K", 256)])
@pytest.mark.parametrize("placed", ["staged", "packed", "arena"])
def test_a_decode_batch_reads_its_experts_as_they_were_placed(name: str, width: int, placed: str) -> None:
    """Each way a stack reaches the grouped kernels, at widths whose prepared rows are not whole words
    (Q8_0's 3 blocks: 102 bytes; Q6_K's super-block: 210): a GPU load's ("arena": prepared rows at
    `layout.row_pitch`, 112 and 224 bytes apart) takes the integer-dot GEMV; prepared rows packed one
    after another ("packed") and a prompt's experts copied from RAM (`expert_staging.compact_stack`:
    GGUF rows as the CPU holds them, a compact stack of the used experts, ids renumbered) the float
    GEMV. The whole FFN against float64 either way (twice x's rounding on integer dots)."""
    from llmx.runtime.expert_staging import compact_ids, compact_stack

    e, used = 5, [1, 4]
    layout = {"staged": "raw", "packed": "prepared", "arena": "aligned"}[placed]
    (gate, ref_g), (up, ref_u), (down, ref_d) = (
        experts(name, e, width, width, seed=60 + i, layout=layout) for i in range(3)
    )
    ids = ids_tensor([[4, 1]])
    x, topw = gate_input(1, ref_g, seed=63), torch.tensor([[0.7, 0.3]])
    xd = x.double().numpy()
    h = silu(per_slot(xd, ref_g, ids)) * per_slot(xd, ref_u, ids)
    y_ref = np.einsum("tjn,tj->tn", per_slot(h, ref_d, ids), topw.double().numpy())
    if placed == "staged":
        gate, up, down = (compact_stack(w, w.raw, used, torch.device(DEVICE)) for w in (gate, up, down))
        ids = compact_ids(ids, used, e)
    kernel = "dot8" if placed == "arena" else "gemv"
    assert moe.kernel_of(1, [gate, up]) == moe.kernel_of(1, [down]) == kernel
    y = moe.moe_ffn(x.to(DEVICE), gate, up, down, ids, topw.to(DEVICE))
    assert rel_err(y, y_ref) < (2 * DOT8_FLOAT_TOL if kernel == "dot8" else 1e-4)


def test_a_gpu_arena_spaces_out_the_rows_the_integer_dots_read() -> None:
    # Qwen3-30B-A3B's Q6_K down projection: 630-byte rows, 640 apart in a GPU's arena (`layout.row_pitch`);
    # Q4_K's 432-byte rows are whole 16-byte units already, and CPU tensors stay the file's bytes
    from llmx.gguf import TensorInfo
    from llmx.runtime.weights import Piece, _arena_view

    def piece(name: str, device: str) -> Piece:
        qt = qtype(name)
        info = TensorInfo("blk.0.ffn_down_exps.weight", qt, (4, 3, 768), 0, qt.nbytes((4, 3, 768)), None)
        return Piece(info.name, info, device)

    q6, q4 = piece("Q6_K", "cuda:0"), piece("Q4_K", "cuda:0")
    assert (q6.pitch, q6.arena_bytes, q6.nbytes) == (640, 12 * 640, 12 * 630)
    assert q4.pitch is None and q4.arena_bytes == q4.nbytes and piece("Q6_K", "cpu").pitch is None
    arena = torch.zeros(256 + q6.arena_bytes, dtype=torch.uint8)
    view = _arena_view(arena, 256, q6)
    assert view.shape == (12, 630) and view.stride() == (640, 1) and view.data_ptr() == arena.data_ptr() + 256
    assert _arena_view(arena, 0, q4).shape == (12, 432)


@pytest.mark.gpu
def test_gpu_upload_places_each_row_at_its_pitch(monkeypatch: pytest.MonkeyPatch) -> None:
    # staging buffers of a row and a half: chunks of one whole row for the spaced-out stack
    from llmx.gguf import TensorInfo
    from llmx.runtime import weights

    monkeypatch.setattr(weights, "STAGING_BYTES", 1000)
    rng = np.random.default_rng(5)
    infos = []
    for name, shape in (("Q6_K", (4, 3, 768)), ("Q4_K", (5, 512)), ("Q6_K", (2, 2, 256))):
        qt = qtype(name)
        data = rng.integers(0, 256, qt.nbytes(shape), dtype=np.uint8)
        infos.append(TensorInfo(f"t{len(infos)}", qt, shape, 0, data.nbytes, data))
    views = weights.upload_arena(
        [weights.Piece(i.name, i, DEVICE) for i in infos], torch.device(DEVICE), lambda n: None
    )
    for info in infos:
        raw = views[info.name]
        assert torch.equal(raw.cpu(), torch.from_numpy(info.data).view(raw.shape))
    assert views["t0"].stride(0) == 640 and views["t2"].stride(0) == 224 and views["t1"].is_contiguous()


# --- prompts: the grouped GEMM ------------------------------------------------------------------------


@pytest.mark.parametrize("name", KEY_TYPES)
def test_gemm_over_sorted_pairs(name: str) -> None:
    # T = 20 > GEMV_T and > the tile's 16 rows: expert 1 takes 20 pairs (two blocks), expert 0 none
    w, ref = experts(name, 6, 33, 256, seed=13, layout="prepared")
    ids = ids_tensor(ragged(20, 2, 6, seed=14))
    x = randn(20, 256, seed=15)
    y = moe.moe_linear(x.to(DEVICE), w, ids)
    assert choice.moe(20) == "gemm" and y.shape == (20, 2, 33)
    assert rel_err(y, per_slot(x.double().numpy(), ref, ids)) < gemm_tol(torch.float32)


def test_gemm_fused_gate_up_then_weighted_down_share_one_route() -> None:
    t, k, e, d, f = 17, 2, 7, 256, 64  # expert 1 takes 17 pairs: two blocks of 16
    gate, ref_g = experts("Q4_K", e, f, d, seed=16, layout="prepared")
    up, ref_u = experts("Q4_K", e, f, d, seed=17, layout="prepared")
    down, ref_d = experts("Q8_0", e, d, f, seed=18)
    ids = ids_tensor(ragged(t, k, e, seed=19))
    x, topw = gate_input(t, ref_g, seed=20), torch.rand(t, k, generator=torch.Generator().manual_seed(21))
    r = moe.route(ids, e)
    h = moe.moe_swiglu(x.to(DEVICE), gate, up, ids, r)
    xd = x.double().numpy()
    h_ref = silu(per_slot(xd, ref_g, ids)) * per_slot(xd, ref_u, ids)
    assert h.shape == (t, k, f) and rel_err(h, h_ref) < gemm_tol(torch.float32)
    y = moe.moe_linear(h, down, ids, topw.to(DEVICE), r)
    y_ref = np.einsum("tjn,tj->tn", per_slot(h.double().cpu().numpy(), ref_d, ids), topw.double().numpy())
    assert y.shape == (t, d) and rel_err(y, y_ref) < gemm_tol(torch.float32)


def test_gemm_fp16_and_a_mismatched_route() -> None:
    w, ref = experts("Q8_0", 4, 17, 128, seed=23)
    ids = ids_tensor(ragged(10, 2, 4, seed=24))
    x = randn(10, 128, seed=25).half()
    y = moe.moe_linear(x.to(DEVICE), w, ids)
    assert y.dtype == torch.float16
    assert rel_err(y, per_slot(x.double().numpy(), ref, ids)) < gemm_tol(torch.float16)
    with pytest.raises(LlmxError, match="does not fit"):
        moe.moe_linear(x.to(DEVICE), w, ids, route=moe.route(ids[:9], 4))


def test_gemm_runs_the_tile_its_route_was_made_for() -> None:
    """A route sorted for another tile (the benchmark's sweep) runs that tile: BM 32 (one block for
    all of expert 1's 12 pairs), BN 16 (N = 17: two column tiles), BK 32 (two steps of a row)."""
    w, ref = experts("Q8_0", 4, 17, 64, seed=34)
    ids = ids_tensor(ragged(12, 2, 4, seed=35))
    x = randn(12, 64, seed=36)
    tile = GemmConfig(32, 16, 32, 4, 1)
    r = moe.route(ids, 4, tile)
    assert r.block_m == 32 and r.tile == tile
    y = moe.moe_linear(x.to(DEVICE), w, ids, route=r, kernel="gemm")
    assert rel_err(y, per_slot(x.double().numpy(), ref, ids)) < gemm_tol(torch.float32)


# --- the whole routed FFN -----------------------------------------------------------------------------


@pytest.mark.usefixtures("wide_programs")
@pytest.mark.parametrize(("t", "fused"), [(1, True), (1, False), (GEMV_T + 4, True)])
def test_moe_ffn(t: int, fused: bool) -> None:
    # gate and up of two types; small legacy blocks keep the interpreter's programs few
    d, f, e, k = 32, 64, 5, 2
    gate, ref_g = experts("Q8_0", e, f, d, seed=26)
    up, ref_u = experts("Q4_0", e, f, d, seed=27)
    down, ref_d = experts("Q8_0", e, d, f, seed=28)
    ids = ids_tensor(ragged(t, k, e, seed=29))
    x, topw = gate_input(t, ref_g, seed=30), torch.rand(t, k, generator=torch.Generator().manual_seed(31))
    y = moe.moe_ffn(x.to(DEVICE), gate, up, down, ids, topw.to(DEVICE), fused=fused)
    xd = x.double().numpy()
    h = silu(per_slot(xd, ref_g, ids)) * per_slot(xd, ref_u, ids)
    y_ref = np.einsum("tjn,tj->tn", per_slot(h, ref_d, ids), topw.double().numpy())
    assert y.shape == (t, d)
    assert rel_err(y, y_ref) < (TOL[torch.float32] if choice.moe(t) == "gemv" else gemm_tol(torch.float32))
    res = randn(t, d, seed=32)  # the layer's residual: added by the down projection's launch, or after
    y_res = moe.moe_ffn(x.to(DEVICE), gate, up, down, ids, topw.to(DEVICE), fused, residual=res.to(DEVICE))
    assert torch.equal(y_res.cpu(), y.cpu() + res)


def test_clear_errors_for_what_the_kernels_cannot_take() -> None:
    ids = ids_tensor([[0, 1]])
    floats = Weight(torch.zeros(6, 32, device=DEVICE), qtype("F16"), (2, 3, 32))
    with pytest.raises(LlmxError, match=r"\(F16\) has no Triton kernel"):
        moe.moe_linear(torch.zeros(1, 32, device=DEVICE), floats, ids)
    w, _ = experts("Q8_0", 2, 3, 32, seed=32)
    flat = Weight(w.raw, w.qtype, (6, 32))
    with pytest.raises(LlmxError, match="expert weights are"):
        moe.moe_linear(torch.zeros(1, 32, device=DEVICE), flat, ids)
    with pytest.raises(LlmxError, match="cannot multiply"):
        moe.moe_linear(torch.zeros(2, 32, device=DEVICE), w, ids)
    with pytest.raises(LlmxError, match="differ in shape"):
        moe.moe_swiglu(torch.zeros(1, 32, device=DEVICE), w, experts("Q8_0", 2, 4, 32, seed=33)[0], ids)
    topw = torch.ones(1, 2, device=DEVICE)
    with pytest.raises(LlmxError, match=r"a residual \(1, 4\) is added to the weighted sum"):
        moe.moe_linear(torch.zeros(1, 32, device=DEVICE), w, ids, topw, residual=torch.zeros(1, 4).to(DEVICE))


# --- GPU: Qwen3-30B-A3B's experts, and CUDA graphs --------------------------------------------------

QWEN3_30B = (128, 2048, 768, 8)  # experts, n_embd, n_ff_exp, top-k


def gpu_experts(name: str, e: int, n: int, k: int, seed: int) -> tuple[Weight, torch.Tensor]:
    """A prepared stacked expert weight on the GPU (random valid blocks, `llmx.bench.blocks`), its rows
    at `layout.row_pitch` as a load places them, and its float32 [E, N, K] dequantization there
    (`matmul.dequantize`, bit-exact with gguf-py)."""
    qt = qtype(name)
    raw = torch.from_numpy(random_data(qt, e * n * k, 0.02, chunk_rng(seed, qt.ggml_id))).to(DEVICE)
    w = lay.prepare(Weight(raw.view(e * n, -1), qt, (e * n, k)))
    w.raw = lay.with_pitch(w.raw, lay.row_pitch(name, w.raw.shape[1]))
    dense = tops.dequantize(w).view(e, n, k)
    w.shape = (e, n, k)
    return w, dense


def dense_per_slot(x: torch.Tensor, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[T, k, N] float32: x[t] (or x[t, j]) @ dense[ids[t, j]].T, one expert at a time."""
    t, k = ids.shape
    xs = (x[:, None, :].expand(t, k, -1) if x.dim() == 2 else x).float().reshape(t * k, -1)
    flat = ids.reshape(-1)
    out = torch.empty(t * k, dense.shape[1], device=x.device)
    for e in flat.unique().tolist():
        sel = (flat == e).nonzero().squeeze(1)
        out[sel] = xs[sel] @ dense[e].t()
    return out.view(t, k, -1)


@cache
def qwen3_30b_layer() -> tuple[tuple[Weight, torch.Tensor], ...]:
    """One MoE layer of Qwen3-30B-A3B Q4_K_M: Q4_K gate and up, Q6_K down."""
    e, d, f, _ = QWEN3_30B
    return gpu_experts("Q4_K", e, f, d, 1), gpu_experts("Q4_K", e, f, d, 2), gpu_experts("Q6_K", e, d, f, 3)


def qwen3_30b_routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-8 of 128 softmax router probabilities, renormalised: ids int32 [t, 8], weights [t, 8]."""
    e, _, _, k = QWEN3_30B
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    top, ids = torch.topk(logits.softmax(-1), k)
    return ids.to(torch.int32), top / top.sum(-1, keepdim=True)


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "dtype"), [(1, torch.float32), (4, torch.float32), (8, torch.bfloat16),
                                          (64, torch.float32), (512, torch.bfloat16)])  # fmt: skip
def test_gpu_qwen3_30b_experts(t: int, dtype: torch.dtype) -> None:
    (gate, dg), (up, du), (down, dd) = qwen3_30b_layer()
    ids, topw = qwen3_30b_routing(t, seed=t)
    x = torch.randn(t, QWEN3_30B[1], generator=torch.Generator().manual_seed(t + 1)).to(DEVICE, dtype)
    tol = max(TOL[dtype] if choice.moe(t) == "gemv" else gemm_tol(dtype), 1e-4)  # a chain of three products
    if moe.kernel_of(t, [gate, up]) == "dot8":  # x, then h, quantized per 32 (exact x: check_gpu_dot8)
        assert moe.kernel_of(t, [down]) == "dot8"
        tol = 2 * DOT8_FLOAT_TOL
    h = moe.moe_swiglu(x, gate, up, ids)
    h_ref = torch.nn.functional.silu(dense_per_slot(x, dg, ids)) * dense_per_slot(x, du, ids)
    assert h.dtype == dtype and rel_err(h, h_ref.double().cpu().numpy()) < tol
    y = moe.moe_linear(h, down, ids, topw)
    y_ref = (dense_per_slot(h, dd, ids) * topw[:, :, None]).sum(1)
    assert y.shape == (t, QWEN3_30B[1]) and rel_err(y, y_ref.double().cpu().numpy()) < tol
    ffn = moe.moe_ffn(x, gate, up, down, ids, topw)
    assert rel_err(ffn, y_ref.double().cpu().numpy()) < tol
    unfused = moe.moe_ffn(x, gate, up, down, ids, topw, fused=False)
    assert rel_err(unfused, y_ref.double().cpu().numpy()) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64])
def test_gpu_moe_ffn_needs_no_host_sync_and_replays_in_a_cuda_graph(t: int) -> None:
    """The routing stays on the device: the eager call runs with host syncs made errors, and a
    captured graph replayed on new ids and x gives the eager result bit for bit."""
    (gate, _), (up, _), (down, _) = qwen3_30b_layer()
    ids, topw = qwen3_30b_routing(t, seed=100 + t)
    x = torch.randn(t, QWEN3_30B[1], generator=torch.Generator().manual_seed(7)).to(DEVICE)
    moe.moe_ffn(x, gate, up, down, ids, topw)  # compiles outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe.moe_ffn(x, gate, up, down, ids, topw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe_ffn(x, gate, up, down, ids, topw)
    new_ids, new_topw = qwen3_30b_routing(t, seed=200 + t)
    ids.copy_(new_ids)
    topw.copy_(new_topw)
    x.copy_(torch.randn(t, QWEN3_30B[1], generator=torch.Generator().manual_seed(8)).to(DEVICE))
    graph.replay()
    assert torch.equal(out, moe.moe_ffn(x, gate, up, down, ids, topw))


@cache
def qwen3_30b_down(name: str) -> tuple[Weight, torch.Tensor]:
    """A down projection of Qwen3-30B-A3B's experts in type `name`."""
    e, d, f, _ = QWEN3_30B
    return gpu_experts(name, e, d, f, 4)


def quantized(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the integer-dot GEMV sees it (`quantized_x_ref`), float32 on x's device."""
    q = quantized_x_ref(x.float().reshape(-1, x.shape[-1]).cpu().numpy())
    return torch.from_numpy(q).float().reshape(x.shape).to(x.device)


@pytest.mark.gpu
@pytest.mark.parametrize("down_type", ["Q6_K", "Q4_K", "Q8_0"])
@pytest.mark.parametrize("t", [1, 3, 8])
def test_gpu_gemv8_at_qwen3_30b_shapes(down_type: str, t: int) -> None:
    """The integer-dot grouped GEMV on Qwen3-30B-A3B's experts (Q4_K gate and up; Q6_K down, 630-byte
    rows 640 apart, or Q4_K, Q8_0) against the dense reference on x and h as it quantizes them, and
    the whole FFN against the float GEMV's."""
    (gate, dg), (up, du), _ = qwen3_30b_layer()
    d = QWEN3_30B[1]
    down, dd = qwen3_30b_down(down_type)
    ids, topw = qwen3_30b_routing(t, seed=300 + t)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(t + 2)).to(DEVICE)
    assert moe.kernel_of(t, [gate, up]) == "dot8" and moe.kernel_of(t, [down]) == "dot8"
    h = moe.moe_swiglu(x, gate, up, ids)
    xq = quantized(x)
    h_ref = torch.nn.functional.silu(dense_per_slot(xq, dg, ids)) * dense_per_slot(xq, du, ids)
    assert rel_err(h, h_ref.double().cpu().numpy()) < 1e-4
    y = moe.moe_linear(h, down, ids, topw)
    y_ref = (dense_per_slot(quantized(h), dd, ids) * topw[:, :, None]).sum(1)
    assert rel_err(y, y_ref.double().cpu().numpy()) < 1e-4
    on_floats = moe.moe_ffn(x, gate, up, down, ids, topw, kernel="gemv")
    assert (
        rel_err(moe.moe_ffn(x, gate, up, down, ids, topw), on_floats.double().cpu().numpy())
        < 2 * DOT8_FLOAT_TOL
    )
