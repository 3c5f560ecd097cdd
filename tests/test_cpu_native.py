"""The native CPU kernels on GGUF blocks (`llmx.quant.cpu_native`) against gguf-py's dequantization:
rows dequantized to the same float32 values, and GEMVs of 1 to 64 rows of x within float32 summation
error of a float64 product with x rounded to 16-bit codes per group of 32, as the kernels read it
(an independent numpy rounding here); the integer dot products (AVX2, with or without VNNI) and the
portable ones (built without AVX2) alike, and a row of a batch equal to the same row alone. Skipped
without a C compiler."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from llmx.cpu_info import cpu_features
from llmx.errors import LlmxError
from llmx.quant import choice, cpu_native, qtype, reference
from llmx.quant import weight as qw
from llmx.quant.weight import QWeight, linear, linear_many, prepare_cpu, prepare_shared
from tests.test_quant import assert_bits_equal, gguf_py, random_blocks

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler for the native kernels")
TYPES = list(cpu_native.TYPES)


def random_weight(name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    qt = qtype(name)
    raw = random_blocks(qt, n, k // qt.block_elems, seed)
    return torch.from_numpy(raw), gguf_py(raw, qt)


@pytest.mark.parametrize("name", TYPES)
def test_rows_dequantize_to_gguf_py_values(name):
    qt = qtype(name)
    raw, ref = random_weight(name, 37, 3 * 256)
    out = torch.empty((20, ref.shape[1]), dtype=torch.float32)
    cpu_native.dequantize_rows(raw, qt, 11, 31, ref.shape[1], out)
    # equal to the bit: an fp16 scale (11 significant bits) times a 6- or 8-bit sub-scale times a code
    # of at most 6 bits is exact in float32, so fused multiply-adds round only where gguf-py does
    assert_bits_equal(out.numpy(), ref[11:31])
    ids = torch.tensor([36, 0, 11, 11])
    assert_bits_equal(cpu_native.embedding_rows(raw, qt, ids, ref.shape[1]).numpy(), ref[ids.numpy()])
    scale = 640**0.5  # Gemma 3 270M's sqrt(n_embd): the rows times it as torch's float32 multiply rounds
    scaled = cpu_native.embedding_rows(raw, qt, ids, ref.shape[1], scale)
    assert_bits_equal(scaled.numpy(), (torch.from_numpy(ref[ids.numpy()]) * scale).numpy())
    with pytest.raises(LlmxError, match="token id 37 is outside the embedding table's 37 rows"):
        cpu_native.embedding_rows(raw, qt, torch.tensor([3, 37]), ref.shape[1])


X_CODES = 32512  # cpu_blocks.c's X_CODES


def quantized(x: np.ndarray) -> np.ndarray:
    """x [M, K] float32 as the kernels read it: per group of 32, c = round(x * (X_CODES / max|x|)) half
    away from zero (the scale and the product rounded to float32 first, as in C), times the step
    max|x| / X_CODES."""
    groups = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(groups).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(X_CODES) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    v = (groups * inv).astype(np.float64)
    codes = np.sign(v) * np.floor(np.abs(v) + 0.5)
    return (codes * (amax / np.float32(X_CODES))).reshape(x.shape)


def test_quantized_x_keeps_each_value_within_half_a_step():
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    step = np.abs(x.reshape(3, -1, 32)).max(axis=2, keepdims=True) / X_CODES
    err = np.abs(quantized(x) - x).reshape(3, -1, 32)
    assert np.all(err <= step / 2 * (1 + 1e-3))


# rows of x: one (the one-row kernel), a few, a tile of the several-row kernels (8), two tiles and
# one row more, and MAX_ROWS
GEMV_ROWS = (1, 2, 3, 8, 17, cpu_native.MAX_ROWS)


def odd_shape(name: str) -> tuple[int, int]:
    """(N, K) of a test matrix: an odd N, and for 32-weight blocks 43 a row, five groups of eight
    (Q4_0/Q4_1/Q8_0 go eight at a time) and three more."""
    return 45, 5 * 256 if qtype(name).block_elems == 256 else 43 * 32


@pytest.mark.parametrize("name", TYPES)
def test_gemv_matches_a_float64_product(name, native_kernels):
    qt = qtype(name)
    n, k = odd_shape(name)
    for m in GEMV_ROWS:
        raw, ref = random_weight(name, n, k, seed=m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        x[0, :32] = 0.0  # a group of zeros (dx = 0)
        y = cpu_native.gemv(x, [(raw, qt)])
        xq = quantized(x.numpy())
        want = xq @ ref.astype(np.float64).T
        scale = np.abs(xq) @ np.abs(ref.astype(np.float64)).T  # the sum's magnitude
        assert y.shape == (m, n)
        assert np.all(np.abs(y.numpy() - want) <= 1e-5 * scale + 1e-30), m


def sums_rows_in_another_order(native_kernels: str, name: str) -> bool:
    """Whether the one-row kernel of type `name` in this build sums its lanes in another order than the
    kernels of several rows (the K-quants of this machine's own build with AVX-512 VNNI): then a row's
    bits depend on its batch."""
    k_quant = qtype(name).block_elems == 256
    return k_quant and native_kernels == "native" and "avx512_vnni" in cpu_features().split()


def test_a_row_of_a_batch_equals_the_row_alone(native_kernels):
    """Several rows of x take their own kernels (unpacked codes shared, 16-bit products; with AVX-512,
    16 W rows at once for the 32-weight types), yet each row's product equals the one-row kernel's to
    the bit: a sequence's logits do not depend on the batch it decodes in. (Not for the K-quants with
    AVX-512 VNNI, whose one-row kernels sum their lanes in another order: its builds without VNNI
    are checked.) 45 W rows: two tiles of 16 and a short one; x rows in tiles of 8 and of 4."""
    for name in TYPES:
        if sums_rows_in_another_order(native_kernels, name):
            continue
        qt = qtype(name)
        n, k = odd_shape(name)
        raw, _ = random_weight(name, n, k, seed=5)
        x = torch.randn(17, k, generator=torch.Generator().manual_seed(5))
        x[3, 32:64] = 0.0
        alone = torch.cat([cpu_native.gemv(row[None], [(raw, qt)]) for row in x])
        for m in (2, 3, 5, 8, 17):
            assert torch.equal(cpu_native.gemv(x[:m], [(raw, qt)]), alone[:m]), (name, m)


@pytest.mark.parametrize("name", TYPES)
def test_linear_takes_the_native_kernels_for_decode_and_prompts(name):
    """QWeights of these types stay as GGUF blocks on the CPU (nothing repacked), and `linear` and
    `linear_many` give the reference product for decode (few rows) and prompt (many rows) batches."""
    qt = qtype(name)
    n, k = 64, 512
    raw, ref = random_weight(name, n, k, seed=3)
    w = prepare_cpu(QWeight(raw, qt, (n, k), "w"))
    assert w.packed is None and "GGUF blocks" in w.describe()
    for m in (1, 5, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        # decode batches (GEMV) read x quantized; prompts dequantize W and multiply x as it is
        xs = quantized(x.numpy()) if m <= choice.NATIVE_MAX_ROWS else x.double().numpy()
        want = torch.from_numpy(xs @ ref.astype(np.float64).T)
        torch.testing.assert_close(linear(x, w).double(), want, rtol=1e-4, atol=1e-4 * want.abs().max())
        a, b = linear_many(x, [w, w])
        torch.testing.assert_close(a, linear(x, w))
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize("m", [1, 4])
def test_one_call_serves_matrices_of_different_types_sharing_x(m, native_kernels):
    """q/k/v or gate/up in one call, of mixed types and heights: each block of the output equals
    that matrix's own GEMV, and `linear_many` returns them split."""
    k = 512
    parts = [
        random_weight(name, n, k, seed)
        for name, n, seed in (("Q4_K", 40, 1), ("Q8_0", 8, 2), ("Q6_K", 24, 3))
    ]
    names = ["Q4_K", "Q8_0", "Q6_K"]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7))
    joined = cpu_native.gemv(x, [(raw, qtype(name)) for (raw, _), name in zip(parts, names, strict=True)])
    alone = [cpu_native.gemv(x, [(raw, qtype(name))]) for (raw, _), name in zip(parts, names, strict=True)]
    assert torch.equal(joined, torch.cat(alone, dim=1))
    ws = [
        prepare_cpu(QWeight(raw, qtype(name), (raw.shape[0], k), name))
        for (raw, _), name in zip(parts, names, strict=True)
    ]
    for got, want in zip(linear_many(x, ws), alone, strict=True):  # one call a weight
        assert torch.equal(got, want)
    group = prepare_shared(ws)
    assert group is not None and group.native is not None
    for got, want in zip(linear_many(x, ws), alone, strict=True):  # one call for all
        assert torch.equal(got, want)


@pytest.fixture
def fresh_library():
    """`_library` decides again in the test, and again after it (for the other tests)."""
    cpu_native._library.cache_clear()
    yield
    cpu_native._library.cache_clear()


def test_without_a_compiler_the_packed_path_serves_with_a_warning(fresh_library, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.warns(UserWarning, match="native CPU kernels could not be built"):
        assert not cpu_native.available()
    raw, ref = random_weight("Q4_K", 16, 256)
    w = prepare_cpu(QWeight(raw, qtype("Q4_K"), (16, 256), "w"))
    assert w.packed is not None  # repacked instead
    x = torch.randn(1, 256)
    want = torch.from_numpy(x.double().numpy() @ ref.astype(np.float64).T)
    torch.testing.assert_close(linear(x, w).double(), want, rtol=1e-4, atol=1e-4 * want.abs().max())


def test_a_library_that_does_not_load_is_a_warning(fresh_library, monkeypatch, tmp_path):
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not a shared library")
    monkeypatch.setattr(cpu_native, "_built", lambda: broken)
    with pytest.warns(UserWarning, match="native CPU kernels could not be built"):
        assert not cpu_native.available()


def _allowed_cpus(task_status: Path) -> str:
    line = next(ln for ln in task_status.read_text().splitlines() if ln.startswith("Cpus_allowed_list:"))
    return line.split(":", 1)[1].strip()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_openmp_workers_are_pinned_and_python_stays_free(monkeypatch):
    """After a GEMV on 2 threads, the OpenMP worker runs on the second allowed CPU alone, while this
    (Python's) thread keeps every CPU it had."""
    before = os.sched_getaffinity(0)
    monkeypatch.setattr(cpu_native, "_pinned_team", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        raw, _ = random_weight("Q8_0", 64, 256)
        cpu_native.gemv(torch.randn(1, 256), [(raw, qtype("Q8_0"))])
    finally:
        torch.set_num_threads(threads)
    assert os.sched_getaffinity(0) == before
    tasks = Path(f"/proc/{os.getpid()}/task").glob("*/status")
    assert str(sorted(before)[1]) in {_allowed_cpus(t) for t in tasks}


def test_the_prefetch_is_measured_once_a_thread_count_and_can_be_forced(monkeypatch, tmp_path):
    """The GEMVs' prefetch (distance, and the L2's multiple of it) is the one a RAM-streaming GEMV ran
    fastest under, measured once per machine and thread count (kept in the cache directory), or
    LLMX_CPU_PREFETCH's."""
    monkeypatch.setenv("LLMX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LLMX_CPU_PREFETCH", raising=False)
    lib = cpu_native._library()
    chosen = cpu_native.prefetch_choice(lib, 2)
    kept = tmp_path / cpu_native.PREFETCH_FILE
    assert chosen in cpu_native.PREFETCH_CHOICES and kept.exists()
    measured = []
    picked = cpu_native.Prefetch(1024, 4)
    monkeypatch.setattr(cpu_native, "_fastest_prefetch", lambda lib: measured.append(1) or picked)
    assert cpu_native.prefetch_choice(lib, 2) == chosen and not measured  # from the cache
    assert cpu_native.prefetch_choice(lib, 3) == picked and measured  # another thread count: measured
    kept.write_text("{ torn")  # a damaged cache is measured again
    assert cpu_native.prefetch_choice(lib, 2) == picked and len(measured) == 2
    kept.write_text(json.dumps(dict.fromkeys(json.loads(kept.read_text()), 2048)))  # not a choice: measured
    assert cpu_native.prefetch_choice(lib, 2) == picked and len(measured) == 3
    monkeypatch.setenv("LLMX_CPU_PREFETCH", "3072")
    assert cpu_native.prefetch_choice(lib, 2) == (3072, 0)
    monkeypatch.setenv("LLMX_CPU_PREFETCH", "3072/4")
    assert cpu_native.prefetch_choice(lib, 2) == (3072, 4)
    for bad in ("far", "2048/", "2048/x", "/4"):
        monkeypatch.setenv("LLMX_CPU_PREFETCH", bad)
        with pytest.raises(LlmxError, match="is not BYTES or BYTES/FAR"):
            cpu_native.prefetch_choice(lib, 2)


@pytest.mark.parametrize(
    "shape", [(1, 576), (3, 4096), (1, 9, 64), (64, 640)], ids=["smollm2", "3-rows", "q-heads", "prompt-rows"]
)
def test_rms_norm_matches_float64(shape, native_kernels):
    """`rms_norm` (a step's norms; a prompt's rows shared out among the threads) against float64: each
    last-dim row, with and without the residual added first (which it also returns, exactly)."""
    g = torch.Generator().manual_seed(len(shape))
    x, delta = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    weight = torch.randn(shape[-1], generator=g)
    for d in (None, delta):
        h64 = x.double() if d is None else x.double() + d.double()
        want = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
        h, out = cpu_native.rms_norm(x, weight, 1e-6, d)
        assert torch.equal(h, x if d is None else x + d)
        torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=1e-6)


def test_a_prepared_gemv_follows_a_replaced_raw():
    """The native calls prepared for a weight, alone and with the weights it shares x with, are
    rebuilt when its `raw` is replaced (op offload makes a pinned copy the weight's storage), so they
    never keep the old bytes alive or read them."""
    (raw, _), (raw2, _) = random_weight("Q8_0", 32, 256), random_weight("Q8_0", 16, 256, seed=5)
    w = prepare_cpu(QWeight(raw, qtype("Q8_0"), (32, 256), "w"))
    w2 = prepare_cpu(QWeight(raw2, qtype("Q8_0"), (16, 256), "w2"))
    group = prepare_shared([w, w2])
    x = torch.randn(1, 256)
    before, before_many = linear(x, w), linear_many(x, [w, w2])
    first, first_group = w.native, group.native
    w.raw = raw.clone()
    assert torch.equal(linear(x, w), before)
    assert all(torch.equal(a, b) for a, b in zip(linear_many(x, [w, w2]), before_many, strict=True))
    assert w.native is not first and w.native.raws[0] is w.raw
    assert group.native is not first_group and group.native.raws[0] is w.raw


def gelu_tanh(v: np.ndarray) -> np.ndarray:
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))


def ffn_weights() -> tuple[list[tuple[torch.Tensor, np.ndarray]], list[QWeight]]:
    """A gated FFN's gate, up (Q4_K, 512 x 256) and down (Q6_K, 96 x 512) matrices as their GGUF rows
    and float values, and as QWeights prepared as the loader prepares them (gate and up as one call)."""
    k, f, e = 256, 512, 96
    matrices = [
        random_weight(name, n, width, seed)
        for name, n, width, seed in (("Q4_K", f, k, 11), ("Q4_K", f, k, 12), ("Q6_K", e, f, 13))
    ]
    ws = [
        prepare_cpu(QWeight(raw, qtype(name), (raw.shape[0], width), name))
        for (raw, _), name, width in zip(matrices, ("Q4_K", "Q4_K", "Q6_K"), (k, k, f), strict=True)
    ]
    assert prepare_shared(ws[:2]) is not None
    return matrices, ws


def float64_ffn(x: torch.Tensor, matrices, activation: str) -> tuple[np.ndarray, np.ndarray]:
    """down(act(gate(x)) * up(x)) in float64, x and the activation read as the kernels quantize them,
    and the sum of its products' magnitudes (the scale of float32's error)."""
    (_, gate), (_, up), (_, down) = matrices
    xq = quantized(x.numpy()).astype(np.float64)
    g, u = xq @ gate.astype(np.float64).T, xq @ up.astype(np.float64).T
    act = quantized(((silu(g) if activation == "silu" else gelu_tanh(g)) * u).astype(np.float32))
    return act.astype(np.float64) @ down.astype(np.float64).T, np.abs(act) @ np.abs(down.astype(np.float64)).T


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_ffn_is_one_call_matching_a_float64_ffn(m, activation, native_kernels):
    """A decode step's gated FFN in one native call (`ops.swiglu` and `ops.geglu` take it for CPU GGUF
    blocks): down(act(gate(x)) * up(x)) within float32 error of the float64 FFN, x and the activation
    read as the kernels quantize them."""
    from llmx.ops import geglu, swiglu

    matrices, ws = ffn_weights()
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    y = (swiglu if activation == "silu" else geglu)(x, *ws)
    want, scale = float64_ffn(x, matrices, activation)
    assert y.shape == (m, 96)
    assert np.all(np.abs(y.numpy() - want) <= 1e-4 * scale)
    (gate_raw, _), (up_raw, _), (down_raw, _) = matrices
    gate_up = cpu_native.Gemv([(gate_raw, qtype("Q4_K")), (up_raw, qtype("Q4_K"))])
    assert torch.equal(y, gate_up.gated_ffn(x, cpu_native.Gemv([(down_raw, qtype("Q6_K"))]), activation))


@pytest.mark.parametrize("m", [1, 3])
def test_a_shared_expert_is_one_call_with_its_sigmoid_gate_and_the_residual(m, native_kernels, monkeypatch):
    """Qwen2-MoE's shared expert for a decode step (`ops.shared_expert`): residual + sigmoid(w . x) *
    swiglu(x) in one native call, within float32 error of float64 (the gate's float32 dot product
    exactly so), and torch's ops on the same FFN where the native path is off."""
    from llmx.ops import shared_expert

    matrices, ws = ffn_weights()
    generator = torch.Generator().manual_seed(m)
    x, residual = torch.randn(m, 256, generator=generator), torch.randn(m, 96, generator=generator)
    gate_inp = torch.randn(1, 256, generator=generator) / 16
    shared_gate = QWeight(gate_inp, qtype("F32"), (1, 256), "ffn_gate_inp_shexp")
    y = shared_expert(x, shared_gate, *ws, residual=residual)
    ffn, scale = float64_ffn(x, matrices, "silu")
    s = 1 / (1 + np.exp(-(x.double().numpy() @ gate_inp.double().numpy().T)))  # [m, 1]
    want = residual.double().numpy() + s * ffn
    assert y.shape == (m, 96)
    assert np.all(np.abs(y.numpy() - want) <= 1e-4 * s * scale + 1e-6 * np.abs(want))
    monkeypatch.setattr(qw, "KERNEL", "dequant")  # torch's ops: the same products, its own rounding
    eager = shared_expert(x, shared_gate, *ws, residual=residual)
    assert torch.allclose(y, eager, rtol=1e-4, atol=1e-4)


def silu(v: np.ndarray) -> np.ndarray:
    return v * 0.5 * (1 + np.tanh(v / 2))  # without exp overflowing for large -v


# gate/up and down types of each case: every native type alone, and Q4_K_M's mix
MOE_TYPES = [(name, name) for name in TYPES] + [("Q4_K", "Q6_K")]


@pytest.mark.parametrize(("gate_type", "down_type"), MOE_TYPES, ids=[f"{g}-{d}" for g, d in MOE_TYPES])
def test_moe_swiglu_is_the_weighted_sum_of_the_chosen_experts(
    gate_type, down_type, native_kernels, monkeypatch
):
    """A MoE layer's routed experts in one native call, for 1 to 8 tokens that share some
    experts and leave others unused, against float64 products of the reference's dequantized stacks
    (x and each activation read as the kernels quantize them); and the same bits on 1 thread as on 2
    (each sum's order is fixed, whichever thread computes it) and in calls of fewer tokens (a token's
    result depends on its x alone; to rounding where `sums_rows_in_another_order`)."""
    n_expert, k_used, e, f = 6, 3, 512, 256
    stacks = [
        (
            torch.from_numpy(
                random_blocks(qtype(name), n_expert * rows, width // qtype(name).block_elems, seed)
            ),
            name,
        )
        for name, rows, width, seed in ((gate_type, f, e, 1), (gate_type, f, e, 2), (down_type, e, f, 3))
    ]
    dense = [
        reference.dequantize(raw.numpy(), qtype(name)).astype(np.float64).reshape(n_expert, -1, width)
        for (raw, name), width in zip(stacks, (e, e, f), strict=True)
    ]
    g = torch.Generator().manual_seed(0)
    for m in range(1, 9):
        x = torch.randn(m, e, generator=g)
        # experts 0-3 only, so experts 4 and 5 stay unused and the rest serve several tokens
        ids = torch.stack([torch.randperm(4, generator=g)[:k_used] for _ in range(m)])
        weights = torch.rand(m, k_used, generator=g)
        y = cpu_native.moe_swiglu(
            x, [(raw, qtype(name)) for raw, name in stacks], (n_expert, f, e), ids, weights
        )
        xq = quantized(x.numpy()).astype(np.float64)
        want, scale = np.zeros((m, e)), np.zeros((m, e))
        for t in range(m):
            for j, ex in enumerate(ids[t].tolist()):
                act = silu(dense[0][ex] @ xq[t]) * (dense[1][ex] @ xq[t])
                aq = quantized(act[None].astype(np.float32))[0].astype(np.float64)
                w = float(weights[t, j])
                want[t] += w * (dense[2][ex] @ aq)
                scale[t] += w * (np.abs(dense[2][ex]) @ np.abs(aq))  # the sum's magnitude
        assert y.shape == (m, e)
        assert np.all(np.abs(y.numpy() - want) <= 1e-4 * scale), m
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            again = cpu_native.moe_swiglu(
                x, [(raw, qtype(name)) for raw, name in stacks], (n_expert, f, e), ids, weights
            )
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(again, y), m
    monkeypatch.setattr(cpu_native, "MOE_TOKENS", 3)
    chunked = cpu_native.moe_swiglu(
        x, [(raw, qtype(name)) for raw, name in stacks], (n_expert, f, e), ids, weights
    )
    # fewer tokens an expert: more one-row products
    if any(sums_rows_in_another_order(native_kernels, name) for name in (gate_type, down_type)):
        torch.testing.assert_close(chunked, y, rtol=1e-5, atol=1e-5 * float(y.abs().max()))
    else:
        assert torch.equal(chunked, y)


@pytest.mark.parametrize("k", [1, 40, 256, 1000])
def test_top_k_equals_torch_topk(k):
    x = torch.randn(128256, generator=torch.Generator().manual_seed(k)) * 4
    x[torch.randperm(128256, generator=torch.Generator().manual_seed(1))[:1000]] = float("-inf")
    values, ids = cpu_native.top_k(x, k)
    expected = torch.topk(x, k)
    assert torch.equal(values, expected.values) and torch.equal(ids, expected.indices)


def test_top_k_takes_the_lower_id_of_equal_values_and_any_value():
    x = torch.zeros(1000)
    x[[700, 5, 300]] = 1.0
    values, ids = cpu_native.top_k(x, 5)
    assert values.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0] and ids.tolist() == [5, 300, 700, 0, 1]
    only_one = torch.full((300,), float("-inf"))
    only_one[10] = 2.0
    assert cpu_native.top_k(only_one, 3)[1].tolist() == [10, 0, 1]
