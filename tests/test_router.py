"""The router kernels (`llmx.kernels.router`) against torch's route (`llmx.ops.moe.route` on the CPU),
for every MoE model's (experts, k, renormalised) and the kernels' limits; `route_tokens` (the logits'
GEMV in the same launch) on routers built so that x's rows give prescribed logits.

Without CUDA the kernel runs on CPU tensors under TRITON_INTERPRET=1. The logits are distinct and
at least 1e-3 apart, so the k best are the same in any order of summation; weights to float32
rounding (the softmax's sum taken in another order).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from llmx.kernels import router  # noqa: E402
from llmx.ops.moe import route  # noqa: E402
from llmx.quant.triton import launch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (experts X, k, renormalised): Qwen3-MoE, Mixtral, Qwen1.5/2-MoE-A2.7B (60: no power of two),
# OLMoE, and the kernel's widest row and most rounds
WIDEST = (router.MAX_EXPERTS, router.MAX_K, True)
MODELS = [(128, 8, True), (8, 2, True), (60, 4, False), (64, 8, False), WIDEST]


def distinct_logits(tokens: int, n_expert: int, seed: int) -> torch.Tensor:
    """[tokens, n_expert] logits, each row a shuffle of values >= 1e-3 apart spread over ~[-4, 4]
    (near-ties: neighbours in rank differ by as little as 1e-3)."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.rand(tokens, n_expert, generator=g) * (8.0 / n_expert) + 1e-3
    ranked = steps.cumsum(dim=1) - 4.0
    order = torch.argsort(torch.rand(tokens, n_expert, generator=g), dim=1)
    return torch.gather(ranked, 1, order)


@pytest.mark.parametrize(("n_expert", "k", "normalize"), MODELS)
@pytest.mark.parametrize("tokens", [1, 37])
def test_the_kernel_chooses_and_weighs_as_torch_does(n_expert, k, normalize, tokens):
    logits = distinct_logits(tokens, n_expert, seed=n_expert + tokens)
    want_w, want_ids = route(logits, k, normalize)  # CPU: torch's ops
    weights, ids = router.route(logits.to(DEVICE), k, normalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (tokens, k)
    assert torch.equal(ids.cpu().long(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w, rtol=2e-6, atol=1e-8)


def test_equal_logits_go_to_the_lower_expert_id_first():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 0.5, 2.0]])
    weights, ids = router.route(logits.to(DEVICE), 4, normalize=True)
    assert ids.cpu().tolist() == [[1, 3, 5, 2]]
    p = torch.softmax(logits[0, [1, 3, 5, 2]], dim=0)
    torch.testing.assert_close(weights.cpu()[0], p, rtol=2e-6, atol=0)


def test_half_precision_logits_and_strided_rows():
    logits = distinct_logits(5, 128, seed=1)
    wide = torch.zeros(5, 200)
    wide[:, 10:138] = logits
    for rows in (logits.to(torch.bfloat16), wide[:, 10:138]):
        weights, ids = router.route(rows.to(DEVICE), 8, normalize=True)
        want_w, want_ids = route(rows.float(), 8, True)
        assert torch.equal(ids.cpu().long(), want_ids)
        torch.testing.assert_close(weights.cpu(), want_w, rtol=2e-6, atol=1e-8)


def test_rows_beyond_the_kernel_are_refused():
    with pytest.raises(ValueError, match="router kernel"):
        router.route(torch.zeros(1, router.MAX_EXPERTS + 1, device=DEVICE), 2, True)
    with pytest.raises(ValueError, match="router kernel"):
        router.route(torch.zeros(1, 8, device=DEVICE), 9, True)


@pytest.mark.gpu
@pytest.mark.parametrize(("n_expert", "k", "normalize"), MODELS)
def test_route_on_a_gpu_takes_the_kernel(n_expert, k, normalize):
    logits = distinct_logits(512, n_expert, seed=7)
    weights, ids = route(logits.cuda(), k, normalize)
    want_w, want_ids = route(logits, k, normalize)
    assert ids.dtype == torch.int32  # the kernel's, not torch.topk's int64
    assert torch.equal(ids.cpu().long(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w, rtol=2e-6, atol=1e-8)


def router_for(logits: torch.Tensor, n_embd: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [T, n_embd], router [X, n_embd]) whose product is `logits` [T, X] to float rounding: x's
    rows orthonormal (q_t), the router's rows sum_t logits[t, r] * q_t."""
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(n_embd, logits.shape[0], generator=g, dtype=torch.float64))[0].T
    return q.float(), (logits.double().T @ q).float()


@pytest.mark.parametrize(("n_expert", "k", "normalize"), MODELS)
@pytest.mark.parametrize(("tokens", "n_embd"), [(1, 96), (3, 1100)])
def test_route_tokens_computes_the_logits_and_chooses_in_one_launch(n_expert, k, normalize, tokens, n_embd):
    # 96 columns: one masked loop step; 1100: three, the last partial
    logits = distinct_logits(tokens, n_expert, seed=n_expert + tokens)
    x, w = router_for(logits, n_embd, seed=tokens)
    want_w, want_ids = route(logits, k, normalize)
    x = x.to(DEVICE)
    weights, ids = router.route_tokens(x, w.to(DEVICE), k, normalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (tokens, k)
    assert torch.equal(ids.cpu().long(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w, rtol=1e-4, atol=1e-7)
    assert not launch.zeroed_counters(x.device).any()  # the last program of each token set its word back


def test_route_tokens_reads_half_precision_routers_and_repeats_its_bits():
    logits = distinct_logits(2, 64, seed=3)
    x, w = router_for(logits, 256, seed=4)
    for half in (torch.bfloat16, torch.float16):
        wh = w.to(half)
        want_w, want_ids = route(x.double() @ wh.double().T, 6, True)
        first = router.route_tokens(x.to(DEVICE), wh.to(DEVICE), 6, True)
        assert torch.equal(first[1].cpu().long(), want_ids)
        torch.testing.assert_close(first[0].cpu(), want_w.float(), rtol=1e-4, atol=1e-7)
        again = router.route_tokens(x.to(DEVICE), wh.to(DEVICE), 6, True)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_route_tokens_leaves_what_it_does_not_take():
    x, w = torch.zeros(1, 64, device=DEVICE), torch.zeros(8, 64, device=DEVICE)
    many = torch.zeros(launch.COUNTERS + 1, 64, device=DEVICE)
    assert router.route_tokens(many, w, 2, True) is None  # more tokens than counters
    assert router.route_tokens(x, torch.zeros(8, 32, device=DEVICE), 2, True) is None  # widths differ
    assert router.route_tokens(x, w.to(torch.uint8), 2, True) is None  # GGUF blocks
    assert router.route_tokens(x, w, 9, True) is None  # k past the experts
    wide = torch.zeros(router.MAX_EXPERTS + 1, 64, device=DEVICE)
    assert router.route_tokens(x, wide, 2, True) is None


@pytest.mark.gpu
def test_route_tokens_replays_in_a_cuda_graph():
    logits = distinct_logits(4, 128, seed=9)
    x, w = (t.cuda() for t in router_for(logits, 2048, seed=9))
    eager = router.route_tokens(x, w, 8, True)  # makes the counters before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = router.route_tokens(x, w, 8, True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, captured, strict=True))
    assert torch.equal(eager[1].cpu().long(), route(logits, 8, True)[1])
