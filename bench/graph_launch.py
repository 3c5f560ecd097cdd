"""What a kernel boundary costs inside a CUDA graph, and what launching the graph costs the host.

A decode step replays one graph of ~340 kernels a token (bench/profile_decode.py); the time a step
takes beyond its kernels' sum is these boundaries plus the host's work between steps. This replays
graphs of N in-place multiplies on tensors of a few sizes (empty to 4 MB), whole or cut into parts,
and prints the host's time to launch them and the time until the GPU is done, per kernel.

    python bench/graph_launch.py [--kernels 343] [--parts 1,4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def capture(x: torch.Tensor, n: int) -> torch.cuda.CUDAGraph:
    """A graph of n in-place multiplies of x."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            x.mul_(1.0001)
    return graph


def replay_times(graphs: list[torch.cuda.CUDAGraph], runs: int = 30) -> tuple[float, float]:
    """Median seconds the host takes to launch `graphs` in turn, and until the GPU has run them, from idle."""
    host, done = [], []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for g in graphs:
            g.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append(t1 - t0)
        done.append(time.perf_counter() - t0)
    return statistics.median(host), statistics.median(done)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--kernels", type=int, default=343, help="kernels a graph (a Llama-3-8B decode step: 343)"
    )
    ap.add_argument("--parts", default="1,4", help="graphs the kernels are cut into")
    args = ap.parse_args()
    side = torch.cuda.Stream()  # capture needs a warmed-up non-default stream
    for numel in (1, 1 << 16, 1 << 20):
        x = torch.zeros(numel, device="cuda")
        with torch.cuda.stream(side):
            x.mul_(1.0001)
        torch.cuda.synchronize()
        for parts in (int(p) for p in args.parts.split(",")):
            graphs = [capture(x, args.kernels // parts) for _ in range(parts)]
            replay_times(graphs, runs=3)
            host, done = replay_times(graphs)
            n = args.kernels // parts * parts
            print(
                f"{numel * 4} bytes a kernel, {parts} graph(s) of {n // parts} kernels: launch "
                f"{host * 1e6:.0f} µs of host time, done after {done * 1e6:.0f} µs "
                f"= {done * 1e6 / n:.2f} µs a kernel"
            )


if __name__ == "__main__":
    main()
