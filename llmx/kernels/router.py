"""A mixture-of-experts router's choice for each token in one launch: softmax over the X router
logits, the k most probable experts, optionally renormalised (`llmx.ops.moe.route`'s semantics).

In torch ops that chain is a softmax, a top-k (a gather and a bitonic sort), a sum and a division,
and dtype copies: about ten launches, ~18 us of each layer of a Qwen3-30B-A3B decode token on an
H100 (0.87 ms of its 4.6). Here one program holds a token's row of X <= MAX_EXPERTS logits in
registers and takes k rounds of max-with-index, masking each winner out.

Order: experts are ranked by their logits, which is the order of their probabilities except where
float32 rounding makes two probabilities equal (torch.topk's order among equal values is its own);
of equal logits the lower expert id comes first. The ids come out int32, as the grouped kernels read
them (`llmx.quant.triton.moe`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llmx.quant.triton.launch import programmatic_launch

MAX_EXPERTS = 256  # widest router row held in registers (Qwen3-MoE: 128)
MAX_K = 16  # rounds of the unrolled selection


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, X] (X <= MAX_EXPERTS, any float dtype) -> (weights [T, k] float32, expert
    ids [T, k] int32), best first; `normalize` rescales each token's k weights to sum to 1."""
    t, x = logits.shape
    if x > MAX_EXPERTS or not 0 < k <= min(x, MAX_K):
        raise ValueError(
            f"the router kernel takes k <= {MAX_K} of X <= {MAX_EXPERTS} experts, got {k} of {x}"
        )
    rows = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = torch.empty((t, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, k), dtype=torch.int32, device=logits.device)
    if t:
        pdl = programmatic_launch(logits.device)
        router_kernel[(t,)](
            rows, weights, ids, x, rows.stride(0), K=k, NORMALIZE=normalize,
            BLOCK_X=triton.next_power_of_2(x), BLOCK_K=triton.next_power_of_2(k), PDL=pdl, num_warps=1,
            launch_pdl=pdl,
        )  # fmt: skip
    return weights, ids


@triton.jit
def router_kernel(
    logits_ptr, weights_ptr, ids_ptr, X, stride, K: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_X: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program: token program_id(0)'s K best experts and their probabilities. PDL (launched as a
    programmatic dependent): the next kernel may launch at once, and this one waits for the kernel
    before it only here, its launch hidden in that kernel's tail."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    rx = tl.arange(0, BLOCK_X)
    z = tl.load(logits_ptr + t * stride + rx, mask=rx < X, other=-float("inf")).to(tl.float32)
    m = tl.max(z, axis=0)
    total = tl.sum(tl.exp(z - m), axis=0)  # the lanes past X add exp(-inf) = 0
    rk = tl.arange(0, BLOCK_K)
    top = tl.full([BLOCK_K], -float("inf"), tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(K):
        best, i = tl.max(z, axis=0, return_indices=True, return_indices_tie_break_left=True)
        top = tl.where(rk == j, best, top)
        ids = tl.where(rk == j, i, ids)
        z = tl.where(rx == i, -float("inf"), z)
    w = tl.exp(top - m) / total  # the softmax's probabilities of the chosen; 0 past K
    if NORMALIZE:
        w = w / tl.sum(w, axis=0)
    tl.store(weights_ptr + t * K + rk, w, mask=rk < K)
    tl.store(ids_ptr + t * K + rk, ids, mask=rk < K)
