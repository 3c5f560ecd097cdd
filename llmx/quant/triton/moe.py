"""Routed experts on a GPU: grouped matmuls over stacked expert weights kept in raw GGUF blocks.

An expert weight is a `layout.Blocks` of shape (E, N, K) whose raw rows are uint8 [E * N, row bytes]
(GGUF's `ffn_*_exps`, expert e's matrix in rows e * N .. e * N + N), as loaded, or `prepare`d. The
routing is expert_ids [T, k] (int32; any integer dtype is converted) on the weights' device: slot j
of token t takes expert expert_ids[t, j], which must lie in 0..E-1. Nothing here reads a tensor's
values on the host, and every shape follows from T and k alone, so each call is free of host
syncs and a CUDA graph can capture it. Results are in x's dtype (float32, float16, bfloat16),
accumulated in float32.

    moe_ffn(x, gate, up, down, expert_ids, topk_weights, fused=True, kernel=None, residual=None) -> Tensor
        x [T, D] -> [T, D]: sum over j of topk_weights[t, j] * down_e(silu(gate_e x[t]) * up_e x[t])
        with e = expert_ids[t, j], plus residual [T, D] where given; topk_weights [T, k] float.
        fused=False runs gate and up as two launches (-no-fmoe). `kernel` (each call's) forces one of
        `choice.MOE_KERNELS` (benchmarks).
    moe_linear(x, w, expert_ids, topk_weights=None, route=None, kernel=None, residual=None) -> Tensor
        x [T, K] (every slot of token t multiplies x[t]) or [T, k, K] (slot j multiplies x[t, j])
        -> y [T, k, N], y[t, j] = W[expert_ids[t, j]] @ x; with topk_weights [T, k] the weighted
        sum over the slots instead, [T, N], plus residual [T, N] where given (the few-token
        kernels add it as they store: a decode layer's last launch is its down projection).
    moe_swiglu(x, gate, up, expert_ids, route=None, kernel=None) -> Tensor
        x [T, K] -> [T, k, N]: silu(gate_e x[t]) * up_e x[t] in one launch (ik_llama.cpp's -fmoe);
        gate and up of one shape, their types may differ.
    route(expert_ids, n_expert, tile=None) -> Route
        the (token, slot) pairs sorted by expert and padded to the grouped GEMM's tile (None: the
        device's, `tuning`'s moe_gemm), on the device: made once a layer and passed to its
        projections (made by each call otherwise), which run that tile.

Which kernel runs is `choice.moe`'s call on T and the weights' types and layout:
- few tokens ("dot8", "gemv"): one program a (token, slot) pair and BN output rows, reading only the
  chosen experts' rows; the down projection sums the k slots, weighted, inside its program: one
  launch and no [T, k, N] buffer, where a sum after it would cost a launch and that buffer's write
  and read. "dot8" (Q4_K, Q6_K, Q8_0 rows in `layout.prepare`'s layout, 4-byte aligned:
  `moe_kernels.moe_gemv8_kernel`) multiplies x quantized to int8 per 32 values by the weights'
  codes in integer dot products, with the dense integer-dot GEMV's loop (`dot8.row_dots`): x is
  quantized once a token for gate and up (by the kernel that wrote it, where that one did:
  `activation.PENDING`), and the down projection's input, silu(gate) * up per pair, by one
  `quantize_x` launch (a program of BN rows holds no whole group of 32 of it to quantize as it
  writes). "gemv" (`moe_kernels.moe_gemv_kernel`) multiplies float x by the unpacked codes, for
  every other type and layout;
- prompts ("gemm"): `route` sorts the pairs by expert (vLLM's moe_align_block_size, in torch ops),
  and one grouped GEMM launch multiplies every expert's blocks of pairs, dequantizing weight tiles
  for tl.dot (`moe_kernels.moe_gemm_kernel`: on a GPU x and the weight tiles in bf16, f16 for f16 x,
  as dense prompts meet dequantized weights in half precision; float32 under the interpreter,
  whose numpy multiplies no bf16); its rows go back to their pairs, and the down
  projection's are weighted there and summed over the slots by one torch sum (deterministic,
  where atomic adds into [T, N] are not; next to the GEMM its traffic is small).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmx.errors import LlmxError
from llmx.quant import QType
from llmx.quant import choice as C
from llmx.quant.triton import autotune
from llmx.quant.triton.activation import PENDING, QuantizedX, quantize_x
from llmx.quant.triton.launch import cdiv, interpreting, lut, moe_kernels, programmatic_launch
from llmx.quant.triton.layout import Blocks, label, rows, word_rows
from llmx.quant.triton.matmul import DOT8_QUADS, unit_rows
from llmx.quant.triton.tuning import GemmConfig, LaunchShape, for_device

GROUP_M = 8  # blocks of pairs walked down before moving along N: an expert's tiles stay in L2


@dataclass(frozen=True)
class Route:
    """A routing's (token, slot) pairs p = t * k + j grouped by expert for the grouped GEMM.

    pairs:        int32 [blocks * block_m]: each expert's pairs in order, its group padded with
                  n_pairs to a whole number of blocks; the groups in expert order
    block_expert: int32 [blocks]: the expert of each block of block_m, E past the last group
    n_pairs:      T * k
    tile:         the GEMM's tile, which the GEMMs given this route run; block_m is its BM
    """

    pairs: torch.Tensor
    block_expert: torch.Tensor
    n_pairs: int
    tile: GemmConfig

    @property
    def block_m(self) -> int:
        return self.tile.bm


def moe_ffn(
    x: torch.Tensor,
    gate: Blocks,
    up: Blocks,
    down: Blocks,
    expert_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fused: bool = True,
    kernel: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' SwiGLU FFN, weighted and summed, plus `residual` where given: x [T, D] ->
    [T, D] (see the module docstring)."""
    r = route(expert_ids, gate.shape[0]) if C.moe(x.shape[0], preference=kernel or "auto") == "gemm" else None
    if fused:
        h = moe_swiglu(x, gate, up, expert_ids, r, kernel)
    else:
        g = moe_linear(x, gate, expert_ids, route=r, kernel=kernel)
        u = moe_linear(x, up, expert_ids, route=r, kernel=kernel)
        h = torch.nn.functional.silu(g) * u
    return moe_linear(h, down, expert_ids, topk_weights, r, kernel, residual)


def moe_linear(
    x: torch.Tensor,
    w: Blocks,
    expert_ids: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
    route: Route | None = None,
    kernel: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K] or [T, k, K] times the chosen experts of W [E, N, K] -> [T, k, N], or with
    topk_weights [T, k] their weighted sum [T, N], plus `residual` [T, N] where given (see the module
    docstring)."""
    if residual is not None and (topk_weights is None or tuple(residual.shape) != (x.shape[0], w.shape[1])):
        raise LlmxError(
            f"a residual {tuple(residual.shape)} is added to the weighted sum [T, N] of {label(w)}, "
            f"here {(x.shape[0], w.shape[1])}"
        )
    return _run(x, w, None, expert_ids, topk_weights, route, kernel, residual)


def moe_swiglu(
    x: torch.Tensor,
    gate: Blocks,
    up: Blocks,
    expert_ids: torch.Tensor,
    route: Route | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """silu(x [T, K] @ gate_e.T) * (x @ up_e.T) for each slot's expert e -> [T, k, N], one launch."""
    if tuple(gate.shape) != tuple(up.shape):
        raise LlmxError(
            f"{label(gate)} {tuple(gate.shape)} and {label(up)} {tuple(up.shape)} differ in shape"
        )
    if x.dim() != 2:
        raise LlmxError(f"the fused gate and up take x [T, K], got {tuple(x.shape)}")
    return _run(x, gate, up, expert_ids, None, route, kernel)


def route(expert_ids: torch.Tensor, n_expert: int, tile: GemmConfig | None = None) -> Route:
    """expert_ids [T, k]'s pairs sorted by expert, each expert's padded to whole blocks of the
    tile's BM (None: the grouped GEMM's tile on their device), by torch ops on the device.

    The buffers are sized for the most blocks any routing of T * k pairs over n_expert experts
    takes (each used expert wastes at most block_m - 1 rows), so their shapes do not depend on the
    ids."""
    ids = expert_ids.reshape(-1)
    device, n = ids.device, ids.numel()
    tile = tile or _gemm_config(device)
    bm = tile.bm
    counts = torch.zeros(n_expert, dtype=torch.int64, device=device)
    counts.scatter_add_(0, ids.long(), torch.ones(n, dtype=torch.int64, device=device))
    ends = torch.cumsum((counts + bm - 1) // bm * bm, 0)  # each group's padded end
    padded_starts = ends - (counts + bm - 1) // bm * bm
    starts = torch.cumsum(counts, 0) - counts  # each group's start among the sorted pairs
    sorted_ids, order = torch.sort(ids, stable=True)
    sorted_ids = sorted_ids.long()
    dest = padded_starts[sorted_ids] + torch.arange(n, device=device) - starts[sorted_ids]
    blocks = (n + min(n_expert, n) * (bm - 1)) // bm
    pairs = torch.full((blocks * bm,), n, dtype=torch.int32, device=device)
    pairs[dest] = order.to(torch.int32)
    first_rows = torch.arange(blocks, device=device) * bm
    block_expert = torch.searchsorted(ends, first_rows, right=True).to(torch.int32)
    return Route(pairs, block_expert, n, tile)


def kernel_of(tokens: int, ws: list[Blocks], kernel: str | None = None) -> str:
    """The grouped kernel (`choice.moe`) of a launch over `tokens` rows of x that multiplies `ws` (one
    weight, or gate and up), or `kernel` forced (where it can read them)."""
    layout = C.WORDS if all(word_rows(w) for w in ws) else C.GGUF  # GGUF: any layout but WORDS
    return C.moe(tokens, tuple(w.qtype.name for w in ws), layout, kernel or "auto")


# --- launches ---------------------------------------------------------------------------------------


def _experts(w: Blocks) -> tuple[torch.Tensor, str, bool, tuple[int, int, int]]:
    """`layout.rows` of a stacked expert weight, and its (E, N, K)."""
    if len(w.shape) != 3:
        raise LlmxError(
            f"{label(w)}: expert weights are (experts, rows, columns), got shape {tuple(w.shape)}"
        )
    raw, name, packed = rows(w)
    e, n, k = w.shape
    return raw, name, packed, (e, n, k)


def _run(
    x: torch.Tensor,
    w: Blocks,
    w2: Blocks | None,
    expert_ids: torch.Tensor,
    topk_weights: torch.Tensor | None,
    r: Route | None,
    kernel: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x times W's chosen experts, gated by W2's (silu(x W) * x W2) where given, or weighted and
    summed over the slots with topk_weights (plus residual where given): the launches behind the
    public calls."""
    raw, name, packed, (n_expert, n, k) = _experts(w)
    raw2, name2, packed2, _ = (raw, name, packed, None) if w2 is None else _experts(w2)
    t, slots = expert_ids.shape
    if x.shape[-1] != k or x.shape[0] != t or (x.dim() == 3 and x.shape[1] != slots) or x.dim() not in (2, 3):
        raise LlmxError(
            f"{label(w)} {tuple(w.shape)} cannot multiply x {tuple(x.shape)} routed as {(t, slots)}"
        )
    if topk_weights is not None and tuple(topk_weights.shape) != (t, slots):
        raise LlmxError(f"topk_weights {tuple(topk_weights.shape)} do not match expert_ids {(t, slots)}")
    ids = expert_ids.to(torch.int32).contiguous()
    x2 = unit_rows(x)
    x_div = slots if x.dim() == 2 else 1
    weights = ids if topk_weights is None else topk_weights.contiguous()  # read only with SUM/SCALE
    choice = kernel_of(t, [w] if w2 is None else [w, w2], kernel)
    table = lut(raw.device)
    g, g2 = w.qtype.scale_group, (w2 or w).qtype.scale_group
    if choice in ("dot8", "gemv"):
        dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
        out = torch.empty((t if topk_weights is not None else t * slots, n), dtype=dtype, device=x.device)
        res = None if residual is None else residual.contiguous()  # read with out's strides
        if out.numel() and choice == "dot8":  # x quantized once for all pairs (gate and up share it)
            halves = _halves(w, k, topk_weights is not None, slots, out)
            zeroed = out if halves > 1 else None  # the halves' programs add into it
            qx = PENDING.quantized(x)
            if qx is None:
                qx = quantize_x(x2, zeroed)
            elif zeroed is not None:
                zeroed.zero_()
            _gemv8(
                qx, w, raw, w2, raw2, ids, None if topk_weights is None else weights, out, x_div, res, halves
            )
        elif out.numel():
            cfg = for_device(raw.device).gemv(name, 1)
            moe_kernels().moe_gemv_kernel[(cdiv(n, cfg.bn), out.shape[0])](
                x2, raw, raw2, table, ids, weights, out if res is None else res, out, n, k, n_expert, slots,
                x_div, x2.stride(0),
                raw.stride(0), raw2.stride(0), out.stride(0),
                QT=name, QT2=name2, PACKED=packed, PACKED2=packed2, G=g, G2=g2, BN=cfg.bn,
                BK=step_weights(cfg.bk, k), GATED=w2 is not None, SUM=topk_weights is not None,
                RES=res is not None, num_warps=cfg.num_warps,
            )  # fmt: skip
        return out if topk_weights is not None else out.reshape(t, slots, n)
    r = r or route(ids, n_expert)
    if r.n_pairs != t * slots:
        raise LlmxError(f"a route of {r.n_pairs} pairs does not fit {t * slots} pairs")
    c = r.tile
    dot = "fp32" if interpreting() else "fp16" if x.dtype == torch.float16 else "bf16"
    out = torch.empty((t * slots, n), dtype=x.dtype, device=x.device)
    blocks = r.block_expert.numel()
    if out.numel():
        moe_kernels().moe_gemm_kernel[(blocks * cdiv(n, c.bn),)](
            x2, raw, raw2, table, r.pairs, r.block_expert, weights, out, r.n_pairs, n, k, n_expert, blocks,
            x_div, x2.stride(0), raw.stride(0), raw2.stride(0), out.stride(0),
            QT=name, QT2=name2, PACKED=packed, PACKED2=packed2, G=g, G2=g2, BM=c.bm, BN=c.bn, BK=c.bk,
            GROUP_M=GROUP_M, GATED=w2 is not None, SCALE=topk_weights is not None, DOT=dot,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip
    if topk_weights is None:
        return out.reshape(t, slots, n)
    y = out.reshape(t, slots, n).sum(dim=1)
    return y if residual is None else y + residual


def _gemv8(
    qx: QuantizedX,
    w: Blocks,
    raw: torch.Tensor,
    w2: Blocks | None,
    raw2: torch.Tensor,
    ids: torch.Tensor,
    topk_weights: torch.Tensor | None,
    out: torch.Tensor,
    x_div: int,
    residual: torch.Tensor | None = None,
    halves: int = 1,
) -> None:
    """The integer-dot grouped GEMV's launch (`moe_kernels.moe_gemv8_kernel`): out = x (quantized,
    `qx`) times the experts `ids` [T, k] of W, gated by W2's where given, or summed over the slots
    weighted by `topk_weights` (plus `residual`, out's shape and strides, where given); x row p // x_div
    for pair p. `raw`, `raw2`: W's and W2's `layout.rows` (W's again without W2). `halves` (2: out
    zeroed, see `_halves`): programs a token's sum."""
    n_expert, n, k = w.shape
    cfg, bk = _gemv8_shape(w, k, topk_weights is not None)
    types, row_units = [], []
    for v, r in ((w, raw), (w2 or w, raw2)):
        row_words = 4 if r.stride(0) % 16 == 0 else 1  # whole 16-byte units a row: vector loads
        types.append((v.qtype, row_words))
        row_units.append(r.stride(0) // (4 * row_words))
    consts = gemv8_constants(types, k, bk)
    weights = ids if topk_weights is None else topk_weights  # read only with SUM
    res = out if residual is None else residual  # read only with RES
    pdl = programmatic_launch(out.device)
    moe_kernels().moe_gemv8_kernel[(cdiv(n, cfg.bn), out.shape[0] * halves)](
        qx.q, qx.dx, qx.sums, raw, raw2, ids, weights, res, out, n, k, n_expert, x_div, *row_units,
        out.stride(0), BN=cfg.bn, LATE=cfg.late_headers, SLOTS=ids.shape[1], ASM=not interpreting(),
        GATED=w2 is not None, SUM=topk_weights is not None, RES=residual is not None, HALVES=halves,
        PDL=pdl, num_warps=cfg.num_warps, maxnreg=cfg.max_registers, launch_pdl=pdl, **consts,
    )  # fmt: skip


def _halves(w: Blocks, k: int, summed: bool, slots: int, out: torch.Tensor) -> int:
    """Programs a token's weighted sum takes in the integer-dot GEMV: its launch shape's `halves`
    where the sum is split evenly and added into a float32 output (two halves, whose order of adding
    cannot change the result), else 1."""
    halves = _gemv8_shape(w, k, summed)[0].halves
    return halves if summed and slots % halves == 0 and out.dtype == torch.float32 else 1


def gemv8_constants(weights: list[tuple[QType, int]], k: int, bk: int) -> dict[str, object]:
    """`moe_gemv8_kernel`'s constants of its two weights (W's unsuffixed, W2's with "2"), each given
    as its type and ROW_WORDS, for rows of k weights at BK weights a step; and ONE_STEP."""
    consts: dict[str, object] = {"ONE_STEP": True}
    for suffix, (qt, row_words) in zip(("", "2"), weights, strict=True):
        unit = qt.block_elems
        bu = max(1, bk // unit)
        consts["ONE_STEP"] = consts["ONE_STEP"] and k <= bu * unit
        consts |= {
            f"QT{suffix}": qt.name, f"UNIT{suffix}": unit, f"QUADS{suffix}": DOT8_QUADS[qt.name],
            f"BU{suffix}": bu, f"EVEN{suffix}": k % (bu * unit) == 0, f"ROW_WORDS{suffix}": row_words,
        }  # fmt: skip
    return consts


def step_weights(bk: int, k: int) -> int:
    """The weights a GEMV step takes of rows of k: the launch shape's BK, or the row's rounded up to a
    power of two where it is shorter (a down projection's 768-weight rows in one step)."""
    return min(bk, 1 << (k - 1).bit_length())


def _gemv8_shape(w: Blocks, k: int, summed: bool) -> tuple[LaunchShape, int]:
    """The integer-dot grouped GEMV's launch shape for W's type, one pair a program or a token's
    `summed`, and the weights of a step (`step_weights`)."""
    cfg = for_device(w.raw.device).moe_dot8(w.qtype.name, summed)
    return cfg, step_weights(cfg.bk, k)


def _gemm_config(device: torch.device) -> GemmConfig:
    """The grouped GEMM's tile on `device`: the tuning table's, or the interpreter's small one."""
    return autotune.INTERPRETED if interpreting() else for_device(device).moe_gemm
