"""The feed-forward halves of a block: the gated FFNs (SwiGLU, GeGLU), and a MoE layer's gated shared
expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmx.ops.matmul import linear, linear_many
from llmx.ops.norms import fused_rows
from llmx.quant import weight as qw
from llmx.quant.weight import QWeight


def swiglu(
    x: torch.Tensor, gate: QWeight, up: QWeight, down: QWeight, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The gated FFN of Llama-family models: down(silu(gate(x)) * up(x)), plus `residual` where
    given (the block's residual stream, added by the down projection's GEMV)."""
    if (
        all(isinstance(w, QWeight) for w in (gate, up, down))
        and (y := qw.gated_ffn(x, gate, up, down, "silu", residual)) is not None
    ):
        return y  # a CPU decode step: one native call, the residual added in it
    g, u = linear_many(x, [gate, up])
    if fused_rows(g) and u.shape == g.shape and u.dtype == g.dtype and u.device == g.device:
        from llmx.kernels import norm

        return linear(norm.silu_mul(g, u), down, residual)
    # in place: g is this call's own, and a prompt's gate is -ub x n_ff floats (twice saved)
    return linear(F.silu(g, inplace=True).mul_(u), down, residual)


def shared_expert(
    x: torch.Tensor,
    gate_inp: QWeight,
    gate: QWeight,
    up: QWeight,
    down: QWeight,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Qwen2-MoE's shared expert, which every token takes at its own weight: sigmoid(gate_inp(x)) *
    swiglu(x) ([T, 1] times [T, E]), plus `residual` where given. For a CPU decode step one native call
    computes the gate and the add with the FFN (`quant.weight.gated_ffn`), so that the step has no torch
    op between its native calls and replays (`runtime.cpu_replay`)."""
    if (
        all(isinstance(w, QWeight) for w in (gate_inp, gate, up, down))
        and (y := qw.gated_ffn(x, gate, up, down, "silu", residual, gate_inp)) is not None
    ):
        return y
    y = torch.sigmoid(linear(x, gate_inp)) * swiglu(x, gate, up, down)
    return y if residual is None else residual + y


def geglu(x: torch.Tensor, gate: QWeight, up: QWeight, down: QWeight) -> torch.Tensor:
    """The gated FFN of Gemma: down(gelu_tanh(gate(x)) * up(x))."""
    if (
        all(isinstance(w, QWeight) for w in (gate, up, down))
        and (y := qw.gated_ffn(x, gate, up, down, "gelu_tanh")) is not None
    ):
        return y  # a CPU decode step: one native call
    g, u = linear_many(x, [gate, up])
    return linear(F.gelu(g, approximate="tanh") * u, down)
