"""A mixture-of-experts router's choice for each token in one launch: softmax over the X router
logits, the k most probable experts, optionally renormalised (`llmx.ops.moe.route`'s semantics).
For a few tokens the logits' GEMV joins that launch (`route_tokens`).

In torch ops that chain is a softmax, a top-k (a gather and a bitonic sort), a sum and a division,
and dtype copies: about ten launches, ~18 us of each layer of a Qwen3-30B-A3B decode token on an
H100 (0.87 ms of its 4.6). Here one program holds a token's row of X <= MAX_EXPERTS logits in
registers and takes k rounds of max-with-index, masking each winner out.

Order: experts are ranked by their logits, which is the order of their probabilities except where
float32 rounding makes two probabilities equal (torch.topk's order among equal values is its own);
of equal logits the lower expert id comes first. The ids come out int32, as the grouped kernels read
them (`llmx.quant.triton.moe`).

`route_tokens` takes the logits' GEMV (x [T, E] times the float router [X, E]) into the launch: in a
decode step the GEMV was cuBLAS's two launches (a dot and a reduction) before this one, three
launches for ~1 MB of weights a layer. Its programs each compute BX experts' logits of one token
and count themselves in the token's counter (`launch.zeroed_counters`); the last to arrive chooses,
as `router_kernel` does, and sets the counter back to 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llmx.quant.triton.launch import COUNTERS, programmatic_launch, zeroed_counters

MAX_EXPERTS = 256  # widest router row held in registers (Qwen3-MoE: 128)
MAX_K = 16  # rounds of the unrolled selection
GEMV_EXPERTS = 4  # experts a program of `route_tokens` computes (Qwen3-MoE: 32 programs a token)
GEMV_STEP = 512  # columns of the router a program's loop step reads


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


def route_tokens(
    x: torch.Tensor, w: torch.Tensor, k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`route` of the logits x [T, E] @ w.T (w: the router [X, E], float32/16, bfloat16) in one
    launch, or None where that launch does not take them: more tokens than it has counters, a row
    or k past the kernel's limits, or no counters yet (a CUDA graph captured before any eager step).
    Each token's programs read the whole router: `ops.moe.router` sends it few tokens."""
    t, e = x.shape
    n_expert = w.shape[0]
    floats = w.dtype in (torch.float32, torch.float16, torch.bfloat16) and w.device == x.device
    fits = 0 < t <= COUNTERS and w.shape[1] == e and n_expert <= MAX_EXPERTS
    if not (floats and fits and 0 < k <= min(n_expert, MAX_K)):
        return None
    counts = zeroed_counters(x.device)
    if counts is None:
        return None
    xs = x if x.stride(-1) == 1 else x.contiguous()
    ws = w if w.stride(-1) == 1 else w.contiguous()
    logits = torch.empty((t, n_expert), dtype=torch.float32, device=x.device)
    weights = torch.empty((t, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, k), dtype=torch.int32, device=x.device)
    pdl = programmatic_launch(x.device)
    router_gemv_kernel[(triton.cdiv(n_expert, GEMV_EXPERTS), t)](
        xs, ws, logits, counts, weights, ids, n_expert, e, xs.stride(0), ws.stride(0),
        K=k, NORMALIZE=normalize, BX=GEMV_EXPERTS, BE=min(GEMV_STEP, triton.next_power_of_2(e)),
        BLOCK_X=triton.next_power_of_2(n_expert), BLOCK_K=triton.next_power_of_2(k), PDL=pdl, num_warps=4,
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
    _choose(z, weights_ptr + t * K, ids_ptr + t * K, K, NORMALIZE, BLOCK_X, BLOCK_K)


@triton.jit
def router_gemv_kernel(
    x_ptr, w_ptr, logits_ptr, count_ptr, weights_ptr, ids_ptr, X, E, sx, sw,
    K: tl.constexpr, NORMALIZE: tl.constexpr, BX: tl.constexpr, BE: tl.constexpr, BLOCK_X: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (i, t): token t's logits of experts i * BX .. i * BX + BX - 1 (x's row times theirs,
    float32, in E's order), stored; the token's last program to count itself then chooses its K
    experts from the whole row (`_choose`). PDL: as `router_kernel`'s."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(1).to(tl.int64)
    rx = tl.program_id(0) * BX + tl.arange(0, BX)
    re = tl.arange(0, BE)
    acc = tl.zeros([BX, BE], tl.float32)
    for e0 in range(0, E, BE):
        ok = e0 + re < E
        xv = tl.load(x_ptr + t * sx + e0 + re, mask=ok, other=0.0).to(tl.float32)
        w_at = w_ptr + rx[:, None].to(tl.int64) * sw + (e0 + re)[None, :]
        w = tl.load(w_at, mask=(rx < X)[:, None] & ok[None, :], other=0.0).to(tl.float32)
        acc += w * xv[None, :]
    tl.store(logits_ptr + t * X + rx, tl.sum(acc, axis=1), mask=rx < X)
    # every thread's logits are stored before the count (the barrier), and visible to the program
    # that counts last (acq_rel), which reads them past the L1 (.cg)
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + t, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        ra = tl.arange(0, BLOCK_X)
        z = tl.load(logits_ptr + t * X + ra, mask=ra < X, other=-float("inf"), cache_modifier=".cg")
        tl.store(count_ptr + t, 0)
        _choose(z, weights_ptr + t * K, ids_ptr + t * K, K, NORMALIZE, BLOCK_X, BLOCK_K)


@triton.jit
def _choose(
    z, weights_ptr, ids_ptr, K: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_X: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """A token's logits z [BLOCK_X] (-inf past X) -> its K best experts' ids and probabilities,
    stored at ids_ptr and weights_ptr: k rounds of max-with-index, each winner masked out."""
    rx = tl.arange(0, BLOCK_X)
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
    tl.store(weights_ptr + rk, w, mask=rk < K)
    tl.store(ids_ptr + rk, ids, mask=rk < K)
