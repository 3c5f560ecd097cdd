"""What one exchange of a decode step's partial hidden state between two GPUs costs inside a CUDA graph.

A tensor-parallel decode step (`-sm row`) meets twice a layer: each GPU holds a partial sum of the
attention's and the FFN's output, and both need the whole. This times a graph of `--steps` such
meetings (64 = 2 a layer x 32 layers) against the same graph on one GPU without them:

- `local`: one GPU, a small kernel (y = y * 0.5 + a) per meeting: the floor every variant pays.
- `copy`: both GPUs compute; each copies its partial to the other (torch's peer copy, graph edges
  between the two streams), then adds.
- `flag`: both GPUs compute, then add their partials with `llmx.kernels.exchange` (each stores its
  partial into the peer's inbox, raises the peer's flag, waits for its own). No graph edges between
  the GPUs at all.

    python bench/exchange.py [--width 4096] [--steps 64] [--reps 200]
"""

from __future__ import annotations

import argparse
import time

import torch

from llmx.kernels.exchange import Exchange
from llmx.runtime.graphs import forked


def _timed(graph: torch.cuda.CUDAGraph, reps: int, devices: list[torch.device]) -> float:
    """Microseconds a replay, wall clock over `reps` replays after a warm-up."""
    for _ in range(10):
        graph.replay()
    for d in devices:
        torch.cuda.synchronize(d)
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    for d in devices:
        torch.cuda.synchronize(d)
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    n, steps = args.width, args.steps
    devs = [torch.device("cuda", i) for i in range(2)]
    for i, j in ((0, 1), (1, 0)):
        print(f"peer access {i}->{j}: {torch.cuda.can_device_access_peer(i, j)}")
    y = [torch.randn(n, device=d) for d in devs]
    a = [torch.randn(n, device=d) for d in devs]
    y[1].copy_(y[0].to(devs[1]))  # also turns peer access on both ways
    y[0].copy_(y[1].to(devs[0]))
    streams = [torch.cuda.Stream(d) for d in devs]

    def capture(body, devices) -> torch.cuda.CUDAGraph:
        """`body` captured as the executor captures a step across GPUs: every GPU's current stream
        a capturing one (a peer copy syncs with both GPUs' streams)."""
        g = torch.cuda.CUDAGraph()
        main = streams[0]
        main.wait_stream(torch.cuda.current_stream(devs[0]))
        sides = {d: streams[i] for i, d in enumerate(devices) if i}
        with torch.cuda.graph(g, stream=main), forked(main, sides, {}):
            body()
        return g

    def local() -> None:
        for _ in range(steps):
            y[0].mul_(0.5).add_(a[0])

    recv = [torch.empty(n, device=d) for d in devs]

    def copy() -> None:
        for _ in range(steps):
            for i in range(2):
                with torch.cuda.device(devs[i]), torch.cuda.stream(streams[i]):
                    y[i].mul_(0.5).add_(a[i])
            for i in range(2):
                with torch.cuda.device(devs[i]), torch.cuda.stream(streams[i]):
                    streams[i].wait_stream(streams[1 - i])
                    recv[i].copy_(y[1 - i], non_blocking=True)
            for i in range(2):
                with torch.cuda.device(devs[i]), torch.cuda.stream(streams[i]):
                    y[i].add_(recv[i])

    exchange = Exchange(devs, n)

    def flag() -> None:
        for _ in range(steps):
            for i in range(2):
                with torch.cuda.device(devs[i]), torch.cuda.stream(streams[i]):
                    y[i].mul_(0.5).add_(a[i])
                    y[i].copy_(exchange.all_reduce(y[i], i))

    # eager checks: the flag exchange gives the copy exchange's numbers
    start = [t.clone() for t in y]
    copy()
    want = [t.clone() for t in y]
    for t, s in zip(y, start, strict=True):
        t.copy_(s)
    flag()
    for d in devs:
        torch.cuda.synchronize(d)
    ok = all(torch.allclose(y[i], want[i]) for i in range(2))
    print(f"flag exchange matches the copy exchange: {ok}")

    base = _timed(capture(local, devs[:1]), args.reps, devs[:1])
    print(f"local  : {base:8.1f} us a step ({steps} small kernels, one GPU)")
    for name, body in (("copy", copy), ("flag", flag)):
        us = _timed(capture(body, devs), args.reps, devs)
        print(f"{name:7s}: {us:8.1f} us a step, {(us - base) / steps:6.2f} us an exchange beyond local")


if __name__ == "__main__":
    main()
