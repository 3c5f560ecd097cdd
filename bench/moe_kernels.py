"""The grouped expert kernels (`llmx.quant.triton.moe`) at Qwen3-30B-A3B's shapes, one MoE layer.

For each T (tokens), a top-8 routing of 128 experts (softmax of random logits) and the layer's
gate and up (default Q4_K) and down (default Q6_K) as prepared random blocks: the median time of
the fused gate+up, of the weighted down projection and of the whole routed FFN (fused, and
-no-fmoe). Decode sizes (the grouped GEMV) are timed replayed from a CUDA graph, as decode runs
them, with GB/s of the chosen experts' blocks (each used expert's rows read once: the floor); prompt
sizes with triton.testing.do_bench (L2 cleared before each call), with TFLOP/s.

    python bench/moe_kernels.py [--t 1,2,4,8,64,512,2048] [--gate Q4_K] [--down Q6_K] [--dtype float32]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton.testing

from llmx.bench.blocks import chunk_rng, random_data
from llmx.quant import choice, qtype
from llmx.quant.triton import moe
from llmx.quant.triton.layout import prepare

EXPERTS, N_EMBD, N_FF, TOP_K = 128, 2048, 768, 8


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
        self.raw, self.packed, self.shape = prepared.raw, prepared.packed, (e, n, k)

    def expert_bytes(self) -> int:
        return self.raw.shape[1] * self.shape[1]


def timed_ms(fn: Callable[[], object], graph: bool) -> float:
    return triton.testing.do_bench_cudagraph(fn) if graph else triton.testing.do_bench(fn)


def row(t: int, gate: Experts, up: Experts, down: Experts, dtype: torch.dtype) -> str:
    """The table's row for T = t tokens."""
    g = torch.Generator().manual_seed(t)
    top, ids = torch.topk(torch.randn(t, EXPERTS, generator=g).cuda().softmax(-1), TOP_K)
    ids, topw = ids.to(torch.int32), top / top.sum(-1, keepdim=True)
    x = torch.randn(t, N_EMBD, generator=g).cuda().to(dtype)
    h = moe.moe_swiglu(x, gate, up, ids)
    graph = choice.moe(t) == "gemv"
    ms = [
        timed_ms(lambda: moe.moe_swiglu(x, gate, up, ids), graph),
        timed_ms(lambda: moe.moe_linear(h, down, ids, topw), graph),
        timed_ms(lambda: moe.moe_ffn(x, gate, up, down, ids, topw), graph),
        timed_ms(lambda: moe.moe_ffn(x, gate, up, down, ids, topw, fused=False), graph),
    ]
    used = int(ids.unique().numel())
    nbytes = used * (gate.expert_bytes() + up.expert_bytes() + down.expert_bytes())
    flops = 2 * t * TOP_K * 3 * N_EMBD * N_FF
    cells = [f"{v:.4f}" for v in ms] + [f"{nbytes / ms[2] / 1e6:.0f}", f"{flops / ms[2] / 1e9:.2f}"]
    return f"| {t} | {choice.moe(t)} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", default="1,2,4,8,64,512,2048")
    ap.add_argument("--gate", default="Q4_K")
    ap.add_argument("--down", default="Q6_K")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    gate, up = Experts(args.gate, EXPERTS, N_FF, N_EMBD, 1), Experts(args.gate, EXPERTS, N_FF, N_EMBD, 2)
    down = Experts(args.down, EXPERTS, N_EMBD, N_FF, 3)
    print("| T | kernel | gate+up ms | down ms | ffn ms | -no-fmoe ms | GB/s | TFLOP/s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for t in (int(v) for v in args.t.split(",")):
        print(row(t, gate, up, down, dtype))


if __name__ == "__main__":
    main()
