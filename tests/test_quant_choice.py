"""Kernel choice, launch-shape data and the GEMM autotuner's memory (`llmx.quant.choice`,
`llmx.quant.triton.{tuning,autotune}`). No GPU needed."""

from __future__ import annotations

import json

import pytest
import torch

from llmx.errors import LlmxError
from llmx.quant import BLOCK_TYPES, QTYPES, choice, qtype
from llmx.quant.triton import autotune, tuning
from llmx.quant.triton.tuning import GemmConfig, LaunchShape
from llmx.quant.weight import QWeight

ALL_M = range(0, choice.BUCKET_TOPS[-1] + 8)  # every bucket, the last one's first rows too


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("layout", [choice.GGUF, choice.SPLIT, choice.WORDS, choice.NATIVE, choice.PACKED])
@pytest.mark.parametrize("name", [*BLOCK_TYPES, "F32", "F16"])
def test_a_bucket_holds_one_kernel(device: str, layout: str, name: str) -> None:
    """What a weight keeps (one kernel per M bucket) is what the table says for every M."""
    for preference in ("auto", "dequant", "emulated"):
        kept = choice.kernels(qtype(name), device, layout, preference)
        for m in ALL_M:
            assert kept[choice.bucket(m)] == choice.choose(qtype(name), device, layout, m, preference), m


def test_the_cpu_table() -> None:
    q4k = qtype("Q4_K")
    assert [choice.choose(q4k, "cpu", choice.NATIVE, m) for m in (1, 15, 16)] == ["native"] * 2 + [
        "native_chunks"
    ]
    assert choice.choose(q4k, "cpu", choice.PACKED, 1) == "packed"
    assert choice.choose(q4k, "cpu", choice.GGUF, 1) == "chunks"
    assert choice.choose(q4k, "cpu", choice.NATIVE, 1, "dequant") == "chunks"
    assert choice.choose(q4k, "cpu", choice.GGUF, 1, "packed") == "packed"  # an error at the call
    assert choice.choose(q4k, "cuda", choice.WORDS, 1, "packed") == "dot8"  # a CPU path: the GPU table
    assert choice.choose(q4k, "cuda-emulated", choice.WORDS, 1) == "emulated"
    assert choice.choose(qtype("F16"), "cuda", choice.GGUF, 1, "gemm") == "float"
    with pytest.raises(LlmxError, match="unknown kernel 'fast'"):
        choice.choose(q4k, "cuda", choice.WORDS, 1, "fast")


def test_a_forced_gpu_kernel_takes_every_batch_size_it_reads(monkeypatch) -> None:
    """LLMX_GPU_KERNEL (benchmarks) forces one GPU kernel at every M; the integer-dot GEMV, which reads
    one row of x, leaves the rest to the float GEMV; a value outside the choices is one error line."""
    from llmx import settings

    q4k = qtype("Q4_K")
    assert choice.kernels(q4k, "cuda", choice.WORDS, "gemm") == ("gemm",) * (choice.LAST_BUCKET + 1)
    assert choice.kernels(q4k, "cuda", choice.WORDS, "dot8")[:2] == ("dot8", "gemv")
    assert set(settings.GPU_KERNELS) - {"auto"} == set(choice.GPU_KERNELS)
    monkeypatch.setenv("LLMX_GPU_KERNEL", "gemm")
    assert settings.gpu_kernel() == "gemm"
    monkeypatch.setenv("LLMX_GPU_KERNEL", "fast")
    with pytest.raises(LlmxError, match="LLMX_GPU_KERNEL"):
        settings.gpu_kernel()


def test_the_integer_dot_kernels_take_the_rows_they_read() -> None:
    """Q4_K, Q6_K and Q8_0 rows in WORDS layout: "dot8" at M <= DOT8_MAX_M, "mmh" in its type's MMH_M
    range, "dot8_rows" from ROWS8_MIN_M to ROWS8_MAX_M, "mmq" in its type's MMQ_M range, the float
    kernels' table around them and for other types and layouts; each limit closes a bucket, so a
    weight's kept kernels follow the table whatever the limits are."""
    lo, hi = choice.ROWS8_MIN_M, choice.ROWS8_MAX_M
    assert {choice.DOT8_MAX_M, lo - 1, hi} - {0} <= set(choice.BUCKET_TOPS)
    for name in choice.DOT8_TYPES:
        qt = qtype(name)
        mmq_low, mmq_high = choice.MMQ_M.get(name, (0, -1))
        mmh_low, mmh_high = choice.MMH_M.get(name, (0, -1))
        for m in ALL_M:
            words = choice.choose(qt, "cuda", choice.WORDS, m)
            split = choice.choose(qt, "cuda", choice.SPLIT, m)
            if m <= choice.DOT8_MAX_M:  # M = 0 too: the first bucket
                assert words == "dot8", m
            elif mmh_low <= m <= mmh_high:
                assert words == "mmh", m
            elif lo <= m <= hi:
                assert words == "dot8_rows", m
            elif mmq_low <= m <= mmq_high:
                assert words == "mmq", m
            else:
                assert words == split, m
            assert split not in ("dot8", "dot8_rows")
    assert choice.choose(qtype("Q5_K"), "cuda", choice.WORDS, lo) != "dot8_rows"
    q4k = qtype("Q4_K")
    assert choice.choose(q4k, "cuda", choice.WORDS, hi + 100, "dot8_rows") == "dot8_rows"  # forced: any M
    assert choice.choose(q4k, "cuda", choice.SPLIT, 2, "dot8_rows") == "gemv"  # rows it cannot read
    assert choice.choose(q4k, "cuda", choice.WORDS, 2, "dot8") == "gemv"  # the one-row kernel: M = 1
    assert choice.choose(q4k, "cuda", choice.WORDS, hi, "emulated") == "emulated"


@pytest.mark.parametrize(
    ("kernel", "name", "below", "above"),
    [("mmq", "Q8_0", "dot8_rows", "dequant"), ("mmh", "Q4_K", "dot8_rows", "dequant")],
)
def test_the_tensor_core_gemms_take_their_measured_rows(
    kernel: str, name: str, below: str, above: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each tensor-core GEMM takes the rows of x its table (MMQ_M, MMH_M) gives a type (below them
    `below`, above `above`), other types never by themselves; LLMX_GPU_KERNEL forces it at every M on
    the rows it reads, and weights it cannot read keep the table's kernel (the float GEMV, which a
    forced "dot8" falls back to, takes at most GEMV_MAX_M rows)."""
    from llmx import settings

    table = choice.MMQ_M if kernel == "mmq" else choice.MMH_M
    qt = qtype(name)
    low, high = table[name]
    taken = [choice.choose(qt, "cuda", choice.WORDS, m) for m in (low - 1, low, high, high + 1)]
    assert taken == [below, kernel, kernel, above]
    for other in choice.DOT8_TYPES:
        for layout in (choice.GGUF, choice.SPLIT, choice.WORDS):
            chosen = kernel in choice.kernels(qtype(other), "cuda", layout)
            assert chosen == (other in table and layout == choice.WORDS), (other, layout)
        forced = choice.kernels(qtype(other), "cuda", choice.WORDS, kernel)
        assert forced == (kernel,) * (choice.LAST_BUCKET + 1)
    for other, layout in (("Q4_K", choice.SPLIT), ("Q4_K", choice.GGUF), ("Q5_K", choice.WORDS)):
        qt = qtype(other)
        assert choice.kernels(qt, "cuda", layout, kernel) == choice.kernels(qt, "cuda", layout), (
            other,
            layout,
        )
    monkeypatch.setenv("LLMX_GPU_KERNEL", kernel)
    assert settings.gpu_kernel() == kernel


def test_a_weight_keeps_its_choice_and_follows_its_bytes(monkeypatch) -> None:
    """The kernels are chosen when the weight is made and again when its bytes or form change."""
    from llmx.quant import cpu_native

    monkeypatch.setattr(cpu_native, "available", lambda: False)  # chosen without the native kernels
    qt = qtype("Q8_0")
    w = QWeight(torch.zeros(4, qt.row_bytes(64), dtype=torch.uint8), qt, (4, 64), "w")
    assert w.kernels == choice.kernels(qt, "cpu", choice.GGUF) and w.native is None
    monkeypatch.undo()
    if cpu_native.available():
        w.raw = w.raw.clone()
        assert w.kernels == choice.kernels(qt, "cpu", choice.NATIVE) and w.native.raws[0] is w.raw


def test_every_gpu_kind_has_valid_shapes() -> None:
    """Each entry of launch_shapes.json names every kernel's shapes; integer-dot steps are whole blocks."""
    table = tuning.table()
    assert {tuning.TUNED, tuning.FALLBACK} <= set(table)
    for t in table.values():
        for name in choice.DOT8_TYPES:
            for k in (2048, 4096, t.long_row, 14336):
                assert t.dot8(name, k).bk % qtype(name).block_elems == 0
        for name in BLOCK_TYPES:
            assert t.gemv(name, 1).bk % 32 == 0 and t.gemv(name, 4).num_warps > 0
        assert t.gemm and t.dequantize.bn > 0
        for name in choice.DOT8_TYPES:
            assert t.dot8_rows(name).bk % qtype(name).block_elems == 0
            for tile in (t.mmq(name), *t.mmh_shapes[name]):  # whole blocks a step; BM a power of two
                assert tile.bk % qtype(name).block_elems == 0 and tile.bm in (16, 32, 64) and tile.bn >= 16
        assert t.dot8_rows("Q5_K") == t.dot8_rows_shapes["any"]
        for summed in (False, True):  # the grouped expert GEMV's, for the rows of a decode step's experts
            for name in choice.DOT8_TYPES:
                assert t.moe_dot8(name, summed).bk % qtype(name).block_elems == 0
            shapes = t.moe_dot8_sum_shapes if summed else t.moe_dot8_shapes
            assert t.moe_dot8("Q5_K", summed) == shapes["any"]
        for shape in [*t.dot8_by_type.values(), *t.dot8_one_step.values(), *t.dot8_long_rows.values()]:
            assert LaunchShape.parse(str(shape)) == shape
        assert all(GemmConfig.parse(str(c)) == c for c in t.gemm)


def test_a_launch_shape_spells_its_options() -> None:
    shape = LaunchShape.parse("4/1024/4/late/r64/h2")
    assert (shape.late_headers, shape.max_registers, shape.halves) == (True, 64, 2)
    assert LaunchShape.parse(str(shape)) == shape and str(LaunchShape(2, 1024, 1)) == "2/1024/1"
    with pytest.raises(ValueError, match="/h takes 2"):  # more parts would add in an order that varies
        LaunchShape.parse("4/1024/4/h4")


def test_the_tuned_shapes_and_the_fallback(monkeypatch) -> None:
    """Hopper (sm_90) takes its swept shapes; an unknown GPU the default entry; the interpreter the
    tuned GPU's, so the tests cover them."""
    hopper = tuning.table()["sm_90"]
    assert str(hopper.dot8("Q4_K", 4096)) == "4/4096/4/late/r64"
    assert str(hopper.dot8("Q4_K", 14336)) == "4/2048/2"
    assert str(hopper.dot8("Q6_K", 4096)) == "2/2048/1/r128/s4"
    assert str(hopper.dot8("Q8_0", 4096)) == "2/4096/2" and str(hopper.dot8("Q8_0", 2048)) == "2/2048/2"
    assert str(hopper.gemv("Q4_K", 1)) == "8/1024/4" and str(hopper.gemv("Q5_0", 2)) == "4/256/2"
    assert tuning.kind_of(torch.device("cpu")) == tuning.TUNED
    monkeypatch.setattr(tuning, "capability", lambda device: (12, 0))
    tuning.for_device.cache_clear()
    try:
        assert tuning.for_device(torch.device("cuda", 7)).kind == tuning.FALLBACK
    finally:
        tuning.for_device.cache_clear()


def test_the_gemm_autotuner_times_every_candidate_and_remembers_its_pick(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LLMX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "interpreting", lambda: False)
    monkeypatch.setattr(autotune, "_autotuning", lambda: True)
    monkeypatch.setattr(autotune, "_chosen", {})
    candidates = (GemmConfig(64, 64, 32, 4, 3), GemmConfig(128, 64, 32, 8, 3), GemmConfig(16, 64, 64, 4, 2))
    cost = {candidates[0]: 3.0, candidates[1]: 1.0, candidates[2]: 2.0}
    runs: list[GemmConfig] = []
    monkeypatch.setattr(autotune, "for_device", lambda device: type("T", (), {"gemm": candidates}))
    monkeypatch.setattr(autotune, "_gpu_seconds", lambda fn: (fn(), cost[runs[-1]])[1])
    pick = autotune.gemm_config(torch.device("cpu"), lambda: "problem", runs.append)
    assert pick == candidates[1]
    per_candidate = autotune.WARMUP_RUNS + autotune.ROUNDS * autotune.RUNS_A_ROUND
    assert all(runs.count(c) == per_candidate for c in candidates)
    assert json.loads((tmp_path / autotune.CACHE_FILE).read_text()) == {"problem": str(candidates[1])}

    monkeypatch.setattr(autotune, "_chosen", {})  # another process: the file answers, nothing is timed
    runs.clear()
    assert autotune.gemm_config(torch.device("cpu"), lambda: "problem", runs.append) == candidates[1]
    assert runs == []


def test_the_gemm_autotuner_leaves_out_what_the_gpu_cannot_hold() -> None:
    from triton.runtime.errors import OutOfResources

    candidates = (GemmConfig(128, 256, 64, 8, 3), GemmConfig(64, 128, 64, 4, 4))

    def run(cfg: GemmConfig) -> None:
        if cfg is candidates[0]:
            raise OutOfResources(294912, 232448, "shared memory")

    # the larger tiles, first and as fast as the others, are left out rather than failing the call
    assert autotune.fastest(candidates, run, lambda fn: 1.0, autotune._unfit()) == candidates[1]
    with pytest.raises(LlmxError, match="no GEMM tile configuration fits"):
        autotune.fastest(candidates[:1], run, lambda fn: 1.0, autotune._unfit())


def test_the_type_table_holds_the_kernels_block_facts() -> None:
    from llmx.quant.triton import layout

    for q in QTYPES.values():
        if q.supported and not q.is_float:
            assert q.scale_group and q.block_elems % q.scale_group == 0 and q.half_fields
            assert all(0 <= off <= q.block_bytes - 2 for off in q.half_fields)
    for name in layout.SPLIT_TYPES:  # the fields `prepare` moves are one run at a block's start or end
        nbytes, nf, first = layout.split_fields(name)
        offsets = qtype(name).half_fields
        start = 0 if first else nbytes - 2 * nf
        assert offsets == tuple(range(start, start + 2 * nf, 2))


def test_choice_of_the_expert_kernel() -> None:
    """Stacked experts (`triton.moe`): the integer-dot GEMV for decode batches whose launch's weights
    it reads, the float GEMV for the rest, the GEMM over sorted pairs for more tokens."""
    moe_of, top = choice.moe, choice.MOE_GEMV_MAX_TOKENS
    assert [moe_of(t, ("Q4_K",), choice.WORDS) for t in (1, top, top + 1)] == ["dot8", "dot8", "gemm"]
    assert moe_of(1, ("Q4_K", "Q6_K"), choice.WORDS) == "dot8"  # gate and up of two types in one launch
    assert moe_of(1, ("Q4_K", "Q5_K"), choice.WORDS) == "gemv"  # one the integer dots cannot read
    assert moe_of(1, ("Q8_0",), choice.SPLIT) == "gemv"  # rows not word-aligned
    assert moe_of(1) == "gemv" and moe_of(top + 1) == "gemm"  # sort the pairs or not
    assert moe_of(1, ("Q4_K",), choice.WORDS, "gemv") == "gemv"  # forced
    assert moe_of(top + 1, ("Q4_K",), choice.WORDS, "dot8") == "dot8"
    assert moe_of(1, ("Q4_0",), choice.WORDS, "dot8") == "gemv"
    with pytest.raises(LlmxError, match="unknown expert kernel"):
        moe_of(1, ("Q4_K",), choice.WORDS, "dequant")
