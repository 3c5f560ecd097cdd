"""Whether the CUDA graphs a process has captured change how fast its GEMV graphs replay.

On an H200 (torch 2.11, bench/RESULTS.md, session 24) a stream of integer-dot GEMVs replayed from a
process's first graphs ran 1-2% faster than the same graphs once the process had captured a fourth
graph, of any content, kept or freed, and stayed so: this is why a process's first `graph_ms`
timing reads high. What switches it is not the graphs (session 25): before each capture torch runs
two small kernels eagerly on its capture stream, and two such bursts of eager work on a stream
other than the replays' switched it with no capture at all, where captures made through the CUDA
runtime or driver directly did not. A process that issued all its work on one stream stayed at the
faster rate through captures and bursts; the engine's decode graph replayed no faster in that state.
This times one type's 14336 x 4096 GEMV stream (`kernels.stream_graphs`, graphs 1 and 2), then
again after each further capture of a one-kernel graph.

    python bench/graph_state.py [--type Q4_K] [--graphs 5]

One type a process: a second type's graphs would not be among the process's first.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from bench.kernels import copies, make_weight, stream_graphs
from llmx.quant.triton import activation, layout
from llmx.quant.triton import matmul as tops

N, K = 14336, 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="Q4_K", help="a type of the integer-dot GEMV")
    ap.add_argument("--graphs", type=int, default=5, help="the process's graph count to time up to")
    args = ap.parse_args()
    w = layout.prepare(make_weight(args.type, N, K))
    x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
    qx = activation.quantize_x(x)
    gemvs = stream_graphs([partial(tops.linear, x, c, kernel="dot8", qx=qx) for c in copies(w)])
    flag = torch.zeros(1, device="cuda")
    kept = []  # the graphs as they were timed (session 24), though freed ones counted the same
    for count in range(2, args.graphs + 1):
        if count > 2:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                flag.add_(1)
            kept.append(graph)
        gbs = w.raw.numel() / gemvs.call_ms() / 1e6
        print(f"{args.type} {N}x{K}, {count} graphs captured: {gbs:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
