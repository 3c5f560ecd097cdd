"""`linear` on the CPU, every path, against a float64 dequantize-then-matmul reference.

Tolerance: float32 summation error only, |y - y_ref| <= 1e-5 * (|x| @ |W|^T) elementwise (the sum of
magnitudes bounds the rounding of any summation order; a bf16 shortcut would miss it by ~100x).
"""

from __future__ import annotations

import mmap
import shutil
import warnings

import numpy as np
import pytest
import torch
from test_quant import QUANT_TYPES, random_blocks
from torch._dynamo.utils import counters

from llmx.errors import LlmxError
from llmx.quant import BY_NAME, cpu_pack, reference, weight
from llmx.quant.weight import (
    QWeight,
    dequantize,
    embedding,
    linear,
    linear_many,
    prepare_cpu,
    prepare_shared,
)

RTOL = 1e-5


def quant_weight(name: str, n: int, k: int, seed: int = 0) -> tuple[QWeight, np.ndarray]:
    """A random [n, k] QWeight of type `name` (packed for the CPU) and its float64 dequantization.
    Types the native kernels take (`cpu_native`, tested in test_cpu_native.py) are packed all the
    same: this module tests the packed path, which serves them where no C compiler is at hand."""
    qt = BY_NAME[name]
    data = random_blocks(qt, rows=n, blocks_per_row=k // qt.block_elems, seed=seed)
    w = prepare_cpu(QWeight(torch.from_numpy(data), qt, (n, k), f"test.{name}"))
    if w.packed is None and cpu_pack.packable(qt, w.shape):
        w.packed = cpu_pack.pack(w.raw, qt)
    return w, reference.dequantize(data, qt).astype(np.float64)


def assert_matmul_close(y: torch.Tensor, x: torch.Tensor, w64: np.ndarray) -> None:
    x64 = x.double().numpy().reshape(-1, w64.shape[1])
    ref = x64 @ w64.T
    bound = RTOL * (np.abs(x64) @ np.abs(w64).T) + 1e-30
    err = np.abs(y.double().numpy().reshape(ref.shape) - ref)
    assert (err <= bound).all(), f"worst error / bound = {(err / bound).max():.3g}"


@pytest.mark.parametrize("name", QUANT_TYPES)
@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("kernel", ["auto", "dequant", "emulated"])
def test_linear_matches_float64_reference(name, m, kernel):
    w, w64 = quant_weight(name, n=80, k=512)
    assert w.packed is not None
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    y = linear(x, w, kernel=kernel)
    assert y.shape == (m, 80) and y.dtype == torch.float32
    assert_matmul_close(y, x, w64)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q8_0", "Q6_K", "Q5_1"])
def test_compiled_gemv_equals_its_torch_spec(name):
    w, w64 = quant_weight(name, n=96, k=768, seed=2)
    pk = w.packed
    x = torch.randn(1, 768)
    spec = cpu_pack.gemv_torch(x.view(1, pk.scale.shape[1], -1), pk.codes, pk.scale, pk.offset)
    diff = (pk.gemv(x) - spec).abs().double().numpy()
    assert (diff <= 2 * RTOL * (np.abs(x.double().numpy()) @ np.abs(w64).T)).all()


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ toolchain: the GEMV kernels cannot be built")
def test_compiled_kernels_are_available():
    """With a C++ toolchain the kernels must build and load, AOTInductor's or torch.compile's (else
    decode is slow)."""
    assert set(cpu_pack.compiled_kernels()) == {"u4_offset", "i8", "i8_offset"}


@pytest.mark.parametrize("kernel", ["auto", "dequant"])
def test_many_dequant_chunks(monkeypatch, kernel):
    monkeypatch.setattr(weight, "DEQUANT_CHUNK_BYTES", 16 * 4 * 256)  # 16 rows per chunk
    w, w64 = quant_weight("Q5_K", n=72, k=256)
    x = torch.randn(20, 256)
    assert_matmul_close(linear(x, w, kernel=kernel), x, w64)


@pytest.mark.parametrize("m", [1, 5, 20])
def test_linear_many_joins_alike_weights(m):
    ws = [quant_weight("Q4_1", n, 128, seed=n) for n in (64, 32, 32)]
    x = torch.randn(m, 128)
    separate = [linear(x, w) for w, _ in ws]
    group = prepare_shared([w for w, _ in ws])
    assert group is not None and group.packed is not None and ws[0][0].shared is group is ws[2][0].shared
    joint = linear_many(x, [w for w, _ in ws])
    storage = {w.packed.codes.untyped_storage().data_ptr() for w, _ in ws}
    assert len(storage) == 1  # row views of one concatenation: no extra copy kept
    for y, y_alone, (w, w64) in zip(joint, separate, ws, strict=True):
        assert_matmul_close(y, x, w64)
        assert_matmul_close(linear(x, w), x, w64)  # each weight still works alone
        torch.testing.assert_close(y, y_alone, rtol=1e-5, atol=1e-5)


def test_linear_many_falls_back_for_unlike_weights():
    (a, a64), (b, b64) = quant_weight("Q4_1", 32, 64), quant_weight("Q8_0", 32, 64)
    x = torch.randn(2, 64)
    assert prepare_shared([a, b]) is None and a.shared is None
    ya, yb = linear_many(x, [a, b])
    assert_matmul_close(ya, x, a64)
    assert_matmul_close(yb, x, b64)


def test_without_compiled_kernels_every_batch_is_dequantized(monkeypatch):
    monkeypatch.setattr(cpu_pack, "_RUNNERS", [{}])  # as on a machine without a C++ toolchain
    w, w64 = quant_weight("Q4_K", n=32, k=256)
    assert w.packed.gemv is None
    x = torch.randn(1, 256)
    assert_matmul_close(linear(x, w), x, w64)


def test_packed_dequantize_matches_reference():
    for name in QUANT_TYPES:
        w, w64 = quant_weight(name, n=16, k=256, seed=6)
        out = cpu_pack.dequantize_into(w.packed, torch.empty(16, 256))
        np.testing.assert_allclose(out.numpy(), w64, rtol=1e-6, atol=1e-6 * np.abs(w64).max(), err_msg=name)


def test_tiny_shapes_fall_back_to_the_torch_spec():
    w, w64 = quant_weight("Q4_0", n=1, k=32)  # a single row and a single group
    x = torch.randn(2, 32)
    assert_matmul_close(linear(x, w), x, w64)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_weights(name):
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
    raw = torch.randn(40, 64).to(dtype)
    w = prepare_cpu(QWeight(raw, BY_NAME[name], (40, 64)))
    assert w.packed is None
    x = torch.randn(5, 64)
    for kernel in ("auto", "emulated"):
        assert_matmul_close(linear(x, w, kernel=kernel), x, raw.double().numpy())
    assert torch.equal(embedding(torch.tensor([3, 1]), w), raw[[3, 1]].float())


def test_leading_dims_and_shape_errors():
    w, w64 = quant_weight("IQ4_NL", n=32, k=64)  # a type only the packed path takes
    x = torch.randn(2, 3, 64)
    y = linear(x, w)
    assert y.shape == (2, 3, 32)
    assert_matmul_close(y, x, w64)
    with pytest.raises(LlmxError, match="cannot multiply"):
        linear(torch.randn(1, 65), w)
    with pytest.raises(LlmxError, match="no packed CPU form"):
        linear(x, QWeight(w.raw, w.qtype, w.shape, "unpacked"), kernel="packed")


def test_embedding_and_dequantize_read_the_raw_blocks_exactly():
    w, w64 = quant_weight("Q8_0", n=50, k=64)
    ids = torch.tensor([[4, 49], [0, 4]])
    np.testing.assert_array_equal(embedding(ids, w).numpy(), w64[ids.numpy()].astype(np.float32))
    np.testing.assert_array_equal(dequantize(w).numpy(), w64.astype(np.float32))


def test_describe_names_the_packed_form():
    assert (
        quant_weight("Q4_1", 16, 64)[0].describe() == "Q4_1 -> 4-bit codes, f32 scale + offset per 32 (exact)"
    )
    assert quant_weight("Q6_K", 16, 256)[0].describe() == "Q6_K -> int8 codes, f32 scale per 16 (exact)"
    unpacked = QWeight(torch.zeros(2, 18, dtype=torch.uint8), BY_NAME["IQ4_NL"], (2, 32))
    assert unpacked.describe().endswith("chunk)")


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_released_pages_read_back_unchanged(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 5 * mmap.PAGESIZE, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8)[100:])
    before = view.clone()
    cpu_pack.release_pages(view)
    assert torch.equal(view, before)


# --- torch.compile's kernels (LLMX_CPU_GEMV=jit, and auto's fallback when AOTInductor's fail) ----------


def _no_aot(*_):
    raise AssertionError("LLMX_CPU_GEMV=jit must not touch the AOTInductor packages")


@pytest.fixture(scope="module")
def jit_kernels():
    """The JIT kernels as LLMX_CPU_GEMV=jit loads them: checked once per machine in a subprocess,
    compiled once per process (~5 s here; the first time on a machine, ~30 s)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMX_CPU_GEMV", "jit")
        mp.setattr(cpu_pack, "_RUNNERS", [])
        mp.setattr(cpu_pack, "_aot_kernels", _no_aot)
        graphs = counters["stats"]["unique_graphs"]
        runners = cpu_pack.compiled_kernels()  # compiled unless an earlier test did; checked here
    assert set(runners) == {"u4_offset", "i8", "i8_offset"}
    return runners, counters["stats"]["unique_graphs"] - graphs


SHAPES = {"Q4_0": [(5, 96), (33, 320)], "Q5_1": [(5, 96), (2, 64)], "Q8_0": [(33, 320)],
          "Q2_K": [(7, 768)], "Q5_K": [(3, 256)], "Q6_K": [(7, 768), (2, 512)]}  # fmt: skip


@pytest.mark.parametrize("inference", [False, True], ids=["plain", "inference_mode"])
@pytest.mark.parametrize(("name", "n", "k"), [(name, n, k) for name, s in SHAPES.items() for n, k in s])
def test_jit_gemv_matches_the_reference(monkeypatch, jit_kernels, name, n, k, inference):
    monkeypatch.setattr(cpu_pack, "_RUNNERS", [jit_kernels[0]])
    w, w64 = quant_weight(name, n=n, k=k, seed=n)
    pk = w.packed
    assert pk.gemv is not None
    for m in (1, 3):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        with torch.inference_mode(inference):
            y = linear(x, w)
            spec = cpu_pack.gemv_torch(x[:1].view(1, pk.scale.shape[1], -1), pk.codes, pk.scale, pk.offset)
            diff = (pk.gemv(x[:1]) - spec).abs().double().numpy()
        assert y.is_inference() == inference  # outside inference mode, a tensor that can be updated in place
        assert_matmul_close(y, x, w64)
        assert (diff <= 2 * RTOL * (np.abs(x[:1].double().numpy()) @ np.abs(w64).T)).all()


def test_jit_kernels_serve_every_shape_without_recompiling(monkeypatch, jit_kernels):
    """One kernel per variant (dynamic sizes; long sums of K > 8192 included), whichever mode made the
    weights and x."""
    runners, compiled = jit_kernels
    assert compiled in (0, 3)  # the check at load ran small, decode-sized and long-K matrices
    monkeypatch.setattr(cpu_pack, "_RUNNERS", [runners])
    graphs = counters["stats"]["unique_graphs"]
    ws = [quant_weight("Q4_1", n, 128, seed=n) for n in (64, 32, 32)] + [
        quant_weight(name, 40 + i, 512, seed=i) for i, name in enumerate(["Q8_0", "Q5_K", "Q6_K", "Q4_K"])
    ]
    ws += [quant_weight("Q4_K", 24, 65 * 256), quant_weight("Q8_0", 24, 264 * 32)]  # sums over K > 8192
    for inference in (False, True):
        with torch.inference_mode(inference):
            ws.append(quant_weight("Q5_K", 24, 256))  # weights loaded in either mode
            x = torch.randn(1, 128)
            linear_many(x, [w for w, _ in ws[:3]])  # row views of one joined matrix (storage offsets)
            for w, w64 in ws:
                x = torch.randn(2, w.shape[1])
                assert_matmul_close(linear(x, w), x, w64)
    assert counters["stats"]["unique_graphs"] == graphs


def test_auto_falls_back_to_jit_when_the_aot_packages_crash(monkeypatch, capsys, jit_kernels):
    checked = cpu_pack._verified
    monkeypatch.delenv("LLMX_CPU_GEMV", raising=False)
    monkeypatch.setattr(cpu_pack, "_RUNNERS", [])
    monkeypatch.setattr(cpu_pack, "_build_all", lambda *_: None)  # as if the packages were there
    monkeypatch.setattr(cpu_pack, "_runner", _no_aot)
    monkeypatch.setattr(
        cpu_pack,
        "_verified",
        lambda folder, kind: "crashes (SIGSEGV)" if kind == "aot" else checked(folder, kind),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a working fallback is no reason for a warning
        runners = cpu_pack.compiled_kernels()
    assert runners["u4_offset"].__qualname__.startswith("_jit_runners")
    assert "with torch.compile (aot: crashes (SIGSEGV))" in capsys.readouterr().err
    w, w64 = quant_weight("Q4_K", n=32, k=256)
    x = torch.randn(1, 256)
    assert w.packed.gemv is not None
    assert_matmul_close(linear(x, w), x, w64)


@pytest.mark.parametrize("path", ["auto", "jit"])
def test_without_any_compiled_kernel_decode_is_dequantized(monkeypatch, path):
    monkeypatch.setenv("LLMX_CPU_GEMV", path)
    monkeypatch.setattr(cpu_pack, "_RUNNERS", [])
    monkeypatch.setattr(cpu_pack, "_build_all", lambda *_: None)
    monkeypatch.setattr(cpu_pack, "_verified", lambda folder, kind: None if kind == "jit" else "crashes")

    def compiler_fails():
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(cpu_pack, "_jit_runners", compiler_fails)
    expected = "aot: crashes; jit: InvalidCxxCompiler" if path == "auto" else r"\(jit: InvalidCxxCompiler"
    with pytest.warns(UserWarning, match=expected):
        assert cpu_pack.compiled_kernels() == {}
    w, w64 = quant_weight("Q5_1", n=32, k=256)
    assert w.packed.gemv is None
    x = torch.randn(1, 256)
    assert_matmul_close(linear(x, w), x, w64)


def test_cpu_gemv_eager_and_bad_values(monkeypatch):
    monkeypatch.setattr(cpu_pack, "_RUNNERS", [])
    monkeypatch.setattr(cpu_pack, "_aot_kernels", _no_aot)
    monkeypatch.setattr(cpu_pack, "_jit_kernels", _no_aot)
    monkeypatch.setenv("LLMX_CPU_GEMV", "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for: no warning
        assert cpu_pack.compiled_kernels() == {}
    monkeypatch.setattr(cpu_pack, "_RUNNERS", [])
    monkeypatch.setenv("LLMX_CPU_GEMV", "fast")
    with pytest.raises(LlmxError, match="LLMX_CPU_GEMV='fast' is not one of auto, aot, jit, eager"):
        cpu_pack.compiled_kernels()


@pytest.mark.parametrize("m", [1, 5])
def test_row_split_matrices_gather_the_full_product(m):
    """`-sm row` assembly, with CPU parts standing in for GPUs: each matrix's row slices, computed
    per device (for q/k/v-like groups in one call a device) and gathered in order, give the whole
    matrix's product."""
    from llmx.ops import RowSplit
    from llmx.ops import linear as op_linear
    from llmx.ops import linear_many as op_linear_many

    def split(w: QWeight, at: int) -> RowSplit:
        n, k = w.shape
        parts = [
            prepare_cpu(QWeight(w.raw[r0:r1], w.qtype, (r1 - r0, k), f"{w.name}@{r0}"))
            for r0, r1 in ((0, at), (at, n))
        ]
        return RowSplit(parts, torch.device("cpu"))

    made = [
        quant_weight(name, n, 256, seed)[0]
        for name, n, seed in (("Q4_K", 48, 1), ("Q5_1", 16, 2), ("Q8_0", 16, 3))
    ]
    splits = [split(w, at) for w, at in zip(made, (32, 8, 4), strict=True)]
    # each whole matrix as `prepare_cpu` leaves it, its rows computed the way its slices' are
    wholes = [prepare_cpu(QWeight(w.raw, w.qtype, w.shape, w.name)) for w in made]
    x = torch.randn(m, 256)
    for whole, s in zip(wholes, splits, strict=True):
        torch.testing.assert_close(op_linear(x, s), linear(x, whole))
    for got, whole in zip(op_linear_many(x, splits), wholes, strict=True):
        torch.testing.assert_close(got, linear(x, whole))
