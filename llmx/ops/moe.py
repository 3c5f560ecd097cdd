"""Mixture-of-experts feed-forward: the router's choice of experts for each token, and the chosen
experts' SwiGLU FFNs weighted and summed.

Shapes: T tokens, E = n_embd, X routed experts, k experts a token; an expert stack is a QWeight of
shape (X, out, in) whose `experts` are its matrices (`llmx.quant.weight`).

    p      = softmax(router logits)                  [T, X]
    ids, w = top-k of p (renormalised to sum 1 where the model says so)
    y_t    = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = ids[t, j]

The experts run where their stacks live (the activation moves there and back, as for `linear`),
unless the runtime takes that crossing over for a while (`crossing`): it may capture a GPU step in
pieces around expert stacks in RAM, or copy the experts a prompt uses to the GPU.
`moe_ffn` is the one entry point for the experts' compute. Stacks of GGUF blocks on a GPU take the
grouped Triton kernels (`llmx.quant.triton.moe`): the routing stays on the device, so no step waits for
the host and a CUDA graph can hold the layer; on a GPU the router's softmax and top-k are one Triton
launch (`route`, `llmx.kernels.router`), which for a decode step computes the logits too. CPU stacks of
the native kernels' types take one native call for the layer (`quant.weight.moe_swiglu`), decode steps
and prompts alike: every chosen expert's blocks read once, the rows of all of them shared out among the
threads. A CPU decode step's router (float32, as GGUFs keep it) is one native call too (`router`), so
that the step has no torch op between its native calls and replays (`runtime.cpu_replay`). Elsewhere
(float stacks, other types) tokens are grouped by expert with a sort, and each expert that has tokens
multiplies all of its rows at once (`grouped_ffn`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch

from llmx.ops.ffn import swiglu
from llmx.ops.matmul import linear
from llmx.ops.split import PartialSum, RowSplit
from llmx.quant import weight as qw
from llmx.quant.choice import ROUTER_GEMV_MAX_TOKENS
from llmx.quant.triton import moe as grouped
from llmx.quant.triton.launch import has_triton
from llmx.quant.triton.layout import TRITON_TYPES
from llmx.quant.weight import QWeight

# Computes the experts for an x on another device than their stacks, in place of moving x there and
# back: (x, gate, up, down, weights, ids, fused) -> [T, E] float32 on x's device.
Crossing = Callable[[torch.Tensor, QWeight, QWeight, QWeight, torch.Tensor, torch.Tensor, bool], torch.Tensor]
_crossing: ContextVar[Crossing | None] = ContextVar("llmx_moe_crossing", default=None)


@contextlib.contextmanager
def crossing(cross: Crossing) -> Iterator[None]:
    """Within this context (on this thread), `moe_ffn` hands x on another device than its stacks to
    `cross`. A context variable, because the models between the runtime and this call never see
    devices (`llmx.models`)."""
    token = _crossing.set(cross)
    try:
        yield
    finally:
        _crossing.reset(token)


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, X] -> (weights [T, k] float32, expert ids [T, k]), best first.

    Softmax over all X experts, then the k most probable; `normalize` rescales those k to sum to 1
    (Qwen3-MoE, Mixtral: whose top-k-then-softmax is the same), else they keep their share of all X
    (Qwen2-MoE). On a GPU one Triton launch (`llmx.kernels.router`, ids int32, as the grouped
    kernels read them) replaces torch's chain of about ten; elsewhere torch's ops (ids int64)."""
    if logits.is_cuda and has_triton():
        from llmx.kernels import router

        if logits.shape[-1] <= router.MAX_EXPERTS and k <= router.MAX_K:
            return router.route(logits, k, normalize)
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def router(
    x: torch.Tensor, w: QWeight | RowSplit | PartialSum, k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` of the router w's logits for x [T, E] (w [X, E]): for a CPU decode step one native call
    (`quant.weight.moe_route`), so that the step has no torch op between its native calls
    (`runtime.cpu_replay`); for a decode step on a GPU one Triton launch, the logits' GEMV with the
    choice (`kernels.router.route_tokens`, up to `choice.ROUTER_GEMV_MAX_TOKENS` tokens); elsewhere
    the logits' matmul, then `route` (on a GPU its one Triton launch)."""
    if isinstance(w, QWeight):  # -sm row: split
        native = qw.moe_route(x, w, k, normalize)
        if native is None and x.is_cuda and x.shape[0] <= ROUTER_GEMV_MAX_TOKENS and has_triton():
            from llmx.kernels import router as kernel

            native = kernel.route_tokens(x, w.raw, k, normalize)
        if native is not None:
            return native
    return route(linear(x, w), k, normalize)  # any placement's


def moe_ffn(
    x: torch.Tensor,
    gate_exps: QWeight,
    up_exps: QWeight,
    down_exps: QWeight,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fused: bool = True,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, E] -> sum over j of weights[t, j] * expert ids[t, j]'s SwiGLU FFN of x_t: [T, E] float32,
    on x's device, computed on the stacks' (gate/up [X, F, E], down [X, E, F]); plus `residual` [T, E]
    where given (in the native call, where it is one). `fused`: the grouped kernels compute gate and
    up in one launch (ik_llama.cpp's -fmoe; -no-fmoe: two)."""
    device = gate_exps.raw.device
    if x.device != device:
        if (cross := _crossing.get()) is not None:
            y = cross(x, gate_exps, up_exps, down_exps, weights, ids, fused)
        else:
            moved = (x.to(device), gate_exps, up_exps, down_exps, weights.to(device), ids.to(device))
            y = moe_ffn(*moved, fused).to(x.device)
    elif on_grouped_kernels(gate_exps, up_exps, down_exps):  # the add in the down projection's launch
        return grouped.moe_ffn(x, gate_exps, up_exps, down_exps, ids, weights, fused, residual=residual)
    else:
        native = qw.moe_swiglu(x, gate_exps, up_exps, down_exps, weights, ids, residual)
        if native is not None:  # CPU GGUF blocks: one native call for the layer's experts (and the add)
            return native
        y = grouped_ffn(x, gate_exps, up_exps, down_exps, weights, ids)
    return y if residual is None else y + residual


def grouped_ffn(
    x: torch.Tensor,
    gate_exps: QWeight,
    up_exps: QWeight,
    down_exps: QWeight,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """`moe_ffn` with the (token, slot) pairs grouped by expert with a sort, and each expert that has
    pairs multiplying all of them at once (`expert_swiglu`), on the stacks' device."""
    device = gate_exps.raw.device
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the (token, slot) pairs, grouped by expert
    tokens = order // k
    counts = torch.bincount(flat, minlength=len(gate_exps.experts)).tolist()
    out = expert_swiglu(x[tokens], gate_exps, up_exps, down_exps, counts)
    out.mul_(weights.reshape(-1)[order].unsqueeze(1).to(out.dtype))
    return torch.zeros(x.shape, dtype=out.dtype, device=device).index_add_(0, tokens, out)


def on_grouped_kernels(*stacks: QWeight) -> bool:
    """Whether expert stacks take the grouped Triton kernels: GGUF blocks of a type they read, on a GPU."""
    return all(w.raw.is_cuda for w in stacks) and grouped_readable(*stacks)


def grouped_readable(*stacks: QWeight) -> bool:
    """Whether expert stacks, wherever they are, hold GGUF blocks of a type the grouped kernels read."""
    return has_triton() and all(w.raw.dtype == torch.uint8 and w.qtype.name in TRITON_TYPES for w in stacks)


def expert_swiglu(
    rows: torch.Tensor, gate_exps: QWeight, up_exps: QWeight, down_exps: QWeight, counts: list[int]
) -> torch.Tensor:
    """rows [R, E] grouped by expert (the first counts[0] rows go to expert 0, the next counts[1] to
    expert 1, ...) -> each row's expert FFN [R, E]. A loop over the experts that have rows: each one's
    gate/up/down multiply all its rows in one call (one native call for a few rows on the CPU)."""
    out = torch.empty(rows.shape[0], down_exps.shape[1], dtype=torch.float32, device=rows.device)
    r0 = 0
    for e, n in enumerate(counts):
        if n:
            part = rows[r0 : r0 + n]
            out[r0 : r0 + n] = swiglu(part, gate_exps.experts[e], up_exps.experts[e], down_exps.experts[e])
            r0 += n
    return out
