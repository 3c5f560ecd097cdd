"""The fused row ops (`llmx.kernels.norm`) against the eager ops they replace, all reached through
`ops.rms_norm`, `ops.add_rms_norm` and `ops.swiglu` with `ops.norms.FUSED_NORM` "on" and "off".

Without CUDA the kernels run on CPU tensors under TRITON_INTERPRET=1 (set here before triton is
first imported). Widths: SmolLM2-135M's 576, Llama-3-8B's 4096, a width that is no power of two
(2560), and the widest the kernel holds (16384, GPU only). Tolerances, as
||fused - eager|| / ||eager||: float32 1e-6 (sums in another order), f16 1e-3 and bf16 1e-2 (one
rounding of the output may land a step apart); x + delta is exact in every dtype.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from tiny_models import greedy_steps, random_prompt, write_tiny  # noqa: E402

import llmx  # noqa: E402
from llmx import ops  # noqa: E402
from llmx.bench.blocks import chunk_rng, random_data  # noqa: E402
from llmx.kernels import norm  # noqa: E402
from llmx.quant import BY_NAME  # noqa: E402
from llmx.quant.weight import QWeight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: 1e-6, F16: 1e-3, BF16: 1e-2}
EPS = 1e-5


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def check_norms(shape: tuple[int, ...], dtype: torch.dtype, monkeypatch) -> None:
    x, delta = rows(shape, dtype, 0, 3.0), rows(shape, dtype, 1)
    weight = rows(shape[-1:], F32, 2) + 1.0  # GGUF norm weights are float32

    monkeypatch.setattr(ops.norms, "FUSED_NORM", "on")
    y = ops.rms_norm(x, weight, EPS)
    h, hy = ops.add_rms_norm(x, delta, weight, EPS)

    ref_h = x + delta
    ref_y, ref_hy = (F.rms_norm(t, (shape[-1],), weight.to(dtype), EPS) for t in (x, ref_h))
    for out, ref in ((y, ref_y), (h, ref_h), (hy, ref_hy)):
        assert out.shape == ref.shape and out.dtype == dtype
    assert torch.equal(h, ref_h)
    for out, ref in ((y, ref_y), (hy, ref_hy)):
        err = relative_error(out, ref)
        assert err < TOL[dtype], f"relative error {err:.2e}"


def check_silu_mul(t: int, width: int, dtype: torch.dtype, joined: bool) -> None:
    """silu(g) * u, also for g and u that are column views of one [T, 2F] projection."""
    from llmx.kernels.norm import silu_mul

    if joined:
        g, u = rows((t, 2 * width), dtype, 3, 2.0).split(width, dim=-1)
    else:
        g, u = rows((t, width), dtype, 3, 2.0), rows((t, width), dtype, 4)
    out, ref = silu_mul(g, u), F.silu(g) * u
    assert out.shape == ref.shape and out.dtype == dtype
    err = relative_error(out, ref)
    assert err < TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
@pytest.mark.parametrize("width", [576, 2560, 4096])
@pytest.mark.parametrize("t", [1, 2, 3])
def test_norms_match_eager(t: int, width: int, dtype: torch.dtype, monkeypatch) -> None:
    check_norms((t, width), dtype, monkeypatch)


def test_per_head_norm_of_three_axes(monkeypatch) -> None:
    """The q/k norms of Qwen3 and Gemma 3: x [T, heads, D], normalized per head."""
    check_norms((2, 4, 64), F32, monkeypatch)


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_query_and_key_norms_in_one_launch(dtype: torch.dtype, monkeypatch) -> None:
    """`ops.norms.rms_norm_pair` (what `ops.HeadNorms` calls): a layer's q [T, H, D] and k [T, Hk, D]
    (column views of one projection, as the model's are) normalized per head, each by its own weight,
    as two fused norms compute them."""
    t, h, hk, d = 2, 4, 2, 64
    qkv = rows((t, (h + 2 * hk) * d), dtype, 5, 2.0)
    q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + hk) * d].view(t, hk, d)
    wq, wk = rows((d,), F32, 6) + 1.0, rows((d,), F32, 7) + 1.0
    monkeypatch.setattr(ops.norms, "FUSED_NORM", "on")
    launches = []
    monkeypatch.setattr(norm, "rms_norm_kernel", _counted(norm.rms_norm_kernel, launches))
    monkeypatch.setattr(norm, "rms_norm_pair_kernel", _counted(norm.rms_norm_pair_kernel, launches))
    nq, nk = ops.norms.rms_norm_pair(q, wq, k, wk, EPS)
    assert launches == ["rms_norm_pair_kernel"]
    assert torch.equal(nq, ops.rms_norm(q, wq, EPS)) and torch.equal(nk, ops.rms_norm(k, wk, EPS))
    for out, x, w in ((nq, q, wq), (nk, k, wk)):
        assert out.shape == x.shape and out.dtype == dtype
        assert relative_error(out, F.rms_norm(x, (d,), w.to(dtype), EPS)) < TOL[dtype]


def _counted(kernel, launches: list[str]):
    """`kernel` whose launches are named in `launches`."""

    class Counted:
        def __getitem__(self, grid):
            launches.append(kernel.fn.__name__)
            return kernel[grid]

    return Counted()


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
@pytest.mark.parametrize(("t", "width"), [(1, 1536), (3, 2560), (2, 1000)])
@pytest.mark.parametrize("joined", [False, True], ids=["separate", "joined"])
def test_silu_mul_matches_eager(t: int, width: int, dtype: torch.dtype, joined: bool) -> None:
    check_silu_mul(t, width, dtype, joined)


def test_swiglu_takes_silu_mul(monkeypatch) -> None:
    """`ops.swiglu` with the fused gating equals the eager one (float32 weights, one token)."""
    g = torch.Generator().manual_seed(5)
    gate, up, down = (
        QWeight(torch.randn(shape, generator=g).to(DEVICE), BY_NAME["F32"], shape, name)
        for shape, name in (((96, 64), "gate"), ((96, 64), "up"), ((64, 96), "down"))
    )
    x = torch.randn(1, 64, generator=g).to(DEVICE)
    outs = []
    for mode in ("off", "on"):
        monkeypatch.setattr(ops.norms, "FUSED_NORM", mode)
        outs.append(ops.swiglu(x, gate, up, down))
    assert relative_error(outs[1], outs[0]) < 1e-6


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_outputs_hand_over_their_quantized_form(dtype: torch.dtype, monkeypatch) -> None:
    """With `quantize`, each kernel offers its output quantized exactly as `quantize_x` would, for
    that very tensor only (not a view, not an earlier output), and a GEMV that takes the output uses
    it; without, nothing is offered."""
    from llmx.quant.triton import activation, matmul
    from llmx.quant.triton.layout import prepare

    pending = activation.PENDING
    x, delta, weight = rows((1, 2560), dtype, 0, 3.0), rows((1, 2560), dtype, 1), rows((2560,), F32, 2)
    g, u = rows((1, 3 * 1024 + 64), dtype, 3, 2.0), rows((1, 3 * 1024 + 64), dtype, 4)
    makers = [
        lambda: norm.rms_norm(x, weight, EPS, quantize=True),
        lambda: norm.add_rms_norm(x, delta, weight, EPS, quantize=True)[1],
        lambda: norm.silu_mul(g, u, quantize=True),  # four column blocks, the last one partial
    ]
    outs = []
    for make in makers:
        outs.append(out := make())
        qx, ref = pending.quantized(out), activation.quantize_x(out)
        assert torch.equal(qx.q, ref.q) and torch.equal(qx.dx, ref.dx) and torch.equal(qx.sums, ref.sums)
    assert pending.quantized(outs[0]) is None  # a later output took the hand-over
    assert pending.quantized(outs[2].reshape(-1)) is None  # a view is a new tensor
    assert pending.quantized(norm.rms_norm(x, weight, EPS, quantize=False)) is None

    qt = BY_NAME["Q4_K"]
    raw = torch.from_numpy(random_data(qt, 8 * 2560, 0.02, chunk_rng(0, qt.ggml_id, 8))).view(8, -1)
    w = prepare(QWeight(raw.to(DEVICE), qt, (8, 2560), "w"))
    assert matmul.kernel_for(w, 1) == "dot8"
    want = matmul.linear(outs[0], w)  # not the latest output: the GEMV quantizes it
    fresh = makers[0]()
    monkeypatch.setattr(matmul, "quantize_x", None)  # from here on quantizing would fail
    assert torch.equal(matmul.linear(fresh, w), want)


@pytest.mark.skipif(DEVICE == "cuda", reason="checks that CPU tensors stay on the eager path")
def test_auto_takes_triton_only_on_cuda_and_prompts_stay_eager(monkeypatch) -> None:
    """ "auto" fuses only CUDA tensors with Triton (a CPU step takes the native kernel, where it is
    built: F.rms_norm's values to float32 rounding); a step of more than FUSED_NORM_MAX_TOKENS stays
    eager when "on"."""
    weight = rows((64,), F32, 2)
    for mode, t in (("auto", 1), ("on", ops.norms.FUSED_NORM_MAX_TOKENS + 1)):
        x, delta = rows((t, 64), F32, 0), rows((t, 64), F32, 1)
        monkeypatch.setattr(ops.norms, "FUSED_NORM", mode)
        close = torch.equal if mode == "on" else functools.partial(torch.allclose, rtol=1e-6, atol=1e-6)
        assert close(ops.rms_norm(x, weight, EPS), F.rms_norm(x, (64,), weight, EPS))
        h, hy = ops.add_rms_norm(x, delta, weight, EPS)
        assert torch.equal(h, x + delta) and close(hy, F.rms_norm(x + delta, (64,), weight, EPS))
        # Gemma's norm after a sublayer, then the residual add
        assert close(ops.rms_norm(x, weight, EPS, residual=delta), delta + F.rms_norm(x, (64,), weight, EPS))


# --- a tiny model, decoded greedily with and without the fused path ------------------------------


def counting(fn, calls: dict[str, int], name: str):
    def counted(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return counted


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])  # add_rms_norm + swiglu; post-norms; q/k norms
def test_tiny_model_greedy_decode_is_unchanged(arch: str, tmp_path, monkeypatch) -> None:
    model = llmx.load(write_tiny(arch, "F32", tmp_path), ctx_size=64, threads=1)
    prompt = random_prompt(12, seed=3)

    def decode(mode: str) -> tuple[list[int], torch.Tensor]:
        monkeypatch.setattr(ops.norms, "FUSED_NORM", mode)
        return greedy_steps(model, prompt)

    calls = dict.fromkeys(["rms_norm", "add_rms_norm", "silu_mul"], 0)
    for name in calls:  # count the kernel calls, to know that "on" took them
        monkeypatch.setattr(norm, name, counting(getattr(norm, name), calls, name))

    eager_tokens, eager_logits = decode("off")
    assert not any(calls.values())
    fused_tokens, fused_logits = decode("on")
    assert calls["rms_norm"] and calls["add_rms_norm"] and bool(calls["silu_mul"]) == (arch != "gemma3")
    assert fused_tokens == eager_tokens
    diff = (fused_logits - eager_logits).abs().max().item()
    assert diff < 1e-3, f"max |logit difference| {diff:.2e}"


# --- GPU: bf16, the widest rows, prompt-sized gating, CUDA-graph capture ----------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("width", [576, 2560, 4096, 5120, 8192, 16384])
@pytest.mark.parametrize("t", [1, 4, 16])
def test_gpu_norms(t: int, width: int, dtype: torch.dtype, monkeypatch) -> None:
    check_norms((t, width), dtype, monkeypatch)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize(("t", "width"), [(1, 14336), (16, 28672), (512, 14336)])
@pytest.mark.parametrize("joined", [False, True], ids=["separate", "joined"])
def test_gpu_silu_mul(t: int, width: int, dtype: torch.dtype, joined: bool) -> None:
    check_silu_mul(t, width, dtype, joined)


@pytest.mark.gpu
@gpu
def test_gpu_auto_dispatch_and_cuda_graph(monkeypatch) -> None:
    """ "auto" takes the kernels for a CUDA decode row, and a captured graph replays them on new values."""
    monkeypatch.setattr(ops.norms, "FUSED_NORM", "auto")
    x, delta, weight = rows((1, 4096), F32, 0), rows((1, 4096), F32, 1), rows((4096,), F32, 2)
    ops.add_rms_norm(x, delta, weight, EPS)  # compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, y = ops.add_rms_norm(x, delta, weight, EPS)
    x.copy_(rows((1, 4096), F32, 7, 2.0))
    graph.replay()
    torch.testing.assert_close(h, x + delta, rtol=0, atol=0)
    assert relative_error(y, F.rms_norm(x + delta, (4096,), weight, EPS)) < TOL[F32]
