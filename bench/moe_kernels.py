"""The grouped expert kernels (`llmx.quant.triton.moe`) at Qwen3-30B-A3B's shapes, one MoE layer.

For each T (tokens), a top-8 routing of 128 experts (softmax of random logits) and the layer's
gate and up (default Q4_K) and down (default Q6_K) as prepared random blocks, rows placed as a GPU
load places them (`layout.row_pitch`): the median time of the fused gate+up, of the weighted down
projection and of the whole routed FFN (fused, and -no-fmoe). Decode sizes (the grouped GEMVs) are
timed replayed from a CUDA graph, as decode runs them, once per kernel of --kernels ("dot8": the
integer-dot GEMV, x and h quantized per 32; "gemv": the float one; "auto": `choice.moe`'s), with
GB/s of the chosen experts' blocks (each used expert's rows read once: the floor); prompt sizes
with triton.testing.do_bench (L2 cleared before each call), with TFLOP/s.

`--dot8-sweep` times the one-token grouped GEMVs (gate+up, and the weighted down projection) at each
launch shape of `--gate-shapes` and `--down-shapes` (BN/BK/warps[/late][/h2], as launch_shapes.json spells
them): each timed call runs ROTATION tokens' launches, each on another routing, so that the chosen
experts come from HBM as a decode step's do (one routing's 8 experts would sit in an H200's L2).

`--sweep` times the prompt path's grouped GEMM (fused gate+up, then the weighted down projection,
on one route made for the tile) for each tile BM/BN/BK/warps/stages of `--tiles` (else SWEEP_TILES)
at each T of `--sweep-t`, and ends with the tile of least total time over those T as the line to
put in `llmx/quant/triton/launch_shapes.json` (the device kind's "moe_gemm").

    python bench/moe_kernels.py [--t 1,2,4,8,64,512,2048] [--gate Q4_K] [--down Q6_K] [--dtype float32]
        [--kernels dot8,gemv]
    python bench/moe_kernels.py --sweep [--sweep-t 512,2048] [--tiles 32/64/64/4/3,64/128/64/4/3]
    python bench/moe_kernels.py --dot8-sweep [--gate-shapes 4/2048/2/late,8/2048/4] [--down-shapes 8/1024/4]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton.testing
from triton.runtime.errors import OutOfResources

from llmx.bench.blocks import chunk_rng, random_data
from llmx.quant import choice, qtype
from llmx.quant.triton import moe
from llmx.quant.triton.layout import prepare, row_pitch, with_pitch
from llmx.quant.triton.tuning import GemmConfig, LaunchShape, for_device

EXPERTS, N_EMBD, N_FF, TOP_K = 128, 2048, 768, 8
ROTATION = 16  # routings a timed call of --dot8-sweep cycles through (most of the 128 experts)
GATE_SHAPES = (
    "2/2048/1,2/2048/2/late,4/2048/2/late,4/2048/4,4/2048/4/late,8/2048/4,8/2048/4/late,8/2048/8,16/2048/8"
)
DOWN_SHAPES = (
    "2/1024/1,4/1024/2,4/1024/4,8/1024/2,8/1024/4,8/1024/8,16/1024/4,16/1024/8,32/1024/8,"
    "2/1024/1/h2,4/1024/2/h2,4/1024/4/h2,8/1024/4/h2,16/1024/4/h2"  # a token's slots in two programs
)
# the sweep's tiles: BM near a prompt's pairs an expert (T * 8 / 128: 32 at T = 512), BN and BK of
# the dense GEMM's candidates, and deeper pipelines, which bf16 tiles leave shared memory for
SWEEP_TILES = (
    "16/64/64/4/3,32/64/64/4/3,32/64/64/4/4,32/128/64/4/3,32/64/128/4/3,32/128/128/4/3,32/128/64/8/4,"
    "64/64/64/4/3,64/128/64/4/3,64/128/64/8/3,64/64/128/4/3,64/128/128/8/3,64/128/64/4/4,64/256/64/8/3,"
    "16/128/64/4/3,128/64/64/4/3,128/128/64/8/3"
)


class Experts:
    """A stacked expert weight as `llmx.quant.triton.layout.Blocks`."""

    def __init__(self, name: str, e: int, n: int, k: int, seed: int) -> None:
        qt = qtype(name)
        raw = torch.from_numpy(random_data(qt, e * n * k, 0.02, chunk_rng(seed, qt.ggml_id))).cuda()
        self.raw, self.qtype, self.shape, self.name, self.packed = (
            raw.view(e * n, -1),
            qt,
            (e * n, k),
            name,
            None,
        )
        prepared = prepare(self)
        self.raw = with_pitch(prepared.raw, row_pitch(name, prepared.raw.shape[1]))
        self.packed, self.shape = prepared.packed, (e, n, k)

    def expert_bytes(self) -> int:
        return self.raw.shape[1] * self.shape[1]


Layer = tuple[Experts, Experts, Experts]  # gate, up, down


def timed_ms(fn: Callable[[], object], graph: bool) -> float:
    return triton.testing.do_bench_cudagraph(fn) if graph else triton.testing.do_bench(fn)


def routing(
    t: int, dtype: torch.dtype, seed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """T = t tokens' top-8 routing of 128 experts (ids int32, weights) and x [t, N_EMBD] in `dtype`,
    drawn from `seed` (default t)."""
    g = torch.Generator().manual_seed(t if seed is None else seed)
    top, ids = torch.topk(torch.randn(t, EXPERTS, generator=g).cuda().softmax(-1), TOP_K)
    x = torch.randn(t, N_EMBD, generator=g).cuda().to(dtype)
    return ids.to(torch.int32), top / top.sum(-1, keepdim=True), x


def row(t: int, gate: Experts, up: Experts, down: Experts, dtype: torch.dtype, kernel: str) -> str:
    """The table's row for T = t tokens on `kernel` (forced, or "auto")."""
    ids, topw, x = routing(t, dtype)
    kw = {"kernel": None if kernel == "auto" else kernel}
    h = moe.moe_swiglu(x, gate, up, ids, **kw)
    graph = choice.moe(t) != "gemm"
    ms = [
        timed_ms(lambda: moe.moe_swiglu(x, gate, up, ids, **kw), graph),
        timed_ms(lambda: moe.moe_linear(h, down, ids, topw, **kw), graph),
        timed_ms(lambda: moe.moe_ffn(x, gate, up, down, ids, topw, **kw), graph),
        timed_ms(lambda: moe.moe_ffn(x, gate, up, down, ids, topw, fused=False, **kw), graph),
    ]
    chosen = f"{moe.kernel_of(t, [gate, up], kw['kernel'])}, {moe.kernel_of(t, [down], kw['kernel'])}"
    used = int(ids.unique().numel())
    gate_up, down_bytes = used * (gate.expert_bytes() + up.expert_bytes()), used * down.expert_bytes()
    flops = 2 * t * TOP_K * 3 * N_EMBD * N_FF
    cells = [f"{v:.4f}" for v in ms] + [
        f"{gate_up / ms[0] / 1e6:.0f}",
        f"{down_bytes / ms[1] / 1e6:.0f}",
        f"{(gate_up + down_bytes) / ms[2] / 1e6:.0f}",
        f"{flops / ms[2] / 1e9:.2f}",
    ]
    return f"| {t} | {chosen} | " + " | ".join(cells) + " |"


def gemm_ms(
    r: moe.Route, ids: torch.Tensor, topw: torch.Tensor, x: torch.Tensor, h: torch.Tensor, layer: Layer
) -> list[float]:
    """The grouped GEMM's median ms on route `r` of ids (and on its tile): the fused gate+up of x,
    the weighted down projection of h."""
    gate, up, down = layer
    return [
        triton.testing.do_bench(lambda: moe.moe_swiglu(x, gate, up, ids, r, "gemm")),
        triton.testing.do_bench(lambda: moe.moe_linear(h, down, ids, topw, r, "gemm")),
    ]


def sweep(ts: list[int], tiles: list[GemmConfig], layer: Layer, dtype: torch.dtype) -> None:
    """Print each tile's gate+up and down GEMM times at each T, then the fastest tile over all T."""
    gate, up, _ = layer
    print("| tile BM/BN/BK/warps/stages | T | gate+up ms | down ms | both ms | TFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    totals: dict[GemmConfig, float] = {}
    for t in ts:
        ids, topw, x = routing(t, dtype)
        h = moe.moe_swiglu(x, gate, up, ids, kernel="gemm")
        for tile in tiles:
            try:
                ms = gemm_ms(moe.route(ids, EXPERTS, tile), ids, topw, x, h, layer)
            except OutOfResources as e:  # more shared memory or registers than the GPU has
                print(f"| {tile} | {t} | {e.name}: {e.required} > {e.limit} | | | |", flush=True)
                totals[tile] = float("inf")
                continue
            both = sum(ms)
            totals[tile] = totals.get(tile, 0.0) + both
            tflops = 2 * t * TOP_K * 3 * N_EMBD * N_FF / both / 1e9
            print(f"| {tile} | {t} | {ms[0]:.4f} | {ms[1]:.4f} | {both:.4f} | {tflops:.1f} |", flush=True)
    best = min(totals, key=totals.__getitem__)
    tuning = for_device(torch.device("cuda"))
    print(f"\nnow: {tuning.moe_gemm}; fastest over T = {ts}: {best} ({totals[best]:.4f} ms)")
    print(f'launch_shapes.json, devices.{tuning.kind}: "moe_gemm": "{best}",')


def dot8_sweep(layer: Layer, gate_shapes: list[str], down_shapes: list[str], dtype: torch.dtype) -> None:
    """Print the one-token grouped GEMVs' time and GB/s at each launch shape (the module docstring)."""
    gate, up, down = layer
    tuning = for_device(torch.device("cuda"))
    routes = [routing(1, dtype, seed) for seed in range(ROTATION)]
    hs = [moe.moe_swiglu(x, gate, up, ids, kernel="dot8") for ids, _, x in routes]
    used = sum(int(ids.unique().numel()) for ids, _, _ in routes)
    pairs = [(ids, w, x, h) for (ids, w, x), h in zip(routes, hs, strict=True)]

    def gate_up() -> None:
        for ids, _, x, _ in pairs:
            moe.moe_swiglu(x, gate, up, ids, kernel="dot8")

    def down_sum() -> None:
        for ids, w, _, h in pairs:
            moe.moe_linear(h, down, ids, w, kernel="dot8")

    runs = (
        ("gate+up", tuning.moe_dot8_shapes, gate.qtype.name, gate_shapes, 2 * gate.expert_bytes(), gate_up),
        ("down", tuning.moe_dot8_sum_shapes, down.qtype.name, down_shapes, down.expert_bytes(), down_sum),
    )
    print("| launch | shape BN/BK/warps | us a launch | GB/s |")
    print("| --- | --- | ---: | ---: |")
    for what, table, name, shapes, expert_bytes, calls in runs:
        n_bytes = used * expert_bytes
        kept = table.get(name)
        for text in shapes:
            table[name] = LaunchShape.parse(text)
            try:
                ms = timed_ms(calls, graph=True)
            except OutOfResources as e:
                print(f"| {what} | {text} | {e.name}: {e.required} > {e.limit} | |", flush=True)
                continue
            print(f"| {what} | {text} | {ms * 1e3 / ROTATION:.2f} | {n_bytes / ms / 1e6:.0f} |", flush=True)
        if kept is None:
            del table[name]
        else:
            table[name] = kept
        print(f"| {what} | table's: {kept or table.get('any')} | | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", default="1,2,4,8,64,512,2048")
    ap.add_argument("--gate", default="Q4_K")
    ap.add_argument("--down", default="Q6_K")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--kernels", default="dot8,gemv", help="decode sizes' kernels: dot8, gemv, auto")
    ap.add_argument("--sweep", action="store_true", help="time the prompt GEMM's tiles instead")
    ap.add_argument("--sweep-t", default="512,2048", help="the sweep's prompt sizes")
    ap.add_argument("--dot8-sweep", action="store_true", help="time the one-token GEMVs' launch shapes")
    ap.add_argument("--gate-shapes", default=GATE_SHAPES, help="--dot8-sweep's gate+up shapes")
    ap.add_argument("--down-shapes", default=DOWN_SHAPES, help="--dot8-sweep's down projection shapes")
    ap.add_argument("--tiles", default=SWEEP_TILES, help="the sweep's tiles BM/BN/BK/warps/stages")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    gate, up = Experts(args.gate, EXPERTS, N_FF, N_EMBD, 1), Experts(args.gate, EXPERTS, N_FF, N_EMBD, 2)
    down = Experts(args.down, EXPERTS, N_EMBD, N_FF, 3)
    if args.dot8_sweep:
        dot8_sweep((gate, up, down), args.gate_shapes.split(","), args.down_shapes.split(","), dtype)
        return
    if args.sweep:
        ts = [int(v) for v in args.sweep_t.split(",")]
        sweep(ts, [GemmConfig.parse(v) for v in args.tiles.split(",")], (gate, up, down), dtype)
        return
    columns = "gate+up ms | down ms | ffn ms | -no-fmoe ms | gate+up GB/s | down GB/s | ffn GB/s | TFLOP/s"
    print(f"| T | kernel (gate+up, down) | {columns} |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for t in (int(v) for v in args.t.split(",")):
        for kernel in args.kernels.split(",") if choice.moe(t) != "gemm" else ["auto"]:
            print(row(t, gate, up, down, dtype, kernel), flush=True)


if __name__ == "__main__":
    main()
