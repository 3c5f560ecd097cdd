"""The native CPU GEMV with several rows of x: each row in turn, all rows at once a W row, and 16 W rows.

`cpu_blocks.c` multiplies a W row with M > 1 rows of x in one kernel (`rows_fn`: the block's codes
unpacked once, 16-bit multiply-adds) from ROWS_FROM rows, and 16 W rows at once (`wide_fn`: a W row a
32-bit lane) from WIDE_FROM rows (WIDE_K_FROM, WIDE_Q6_K_FROM for the K-quants); built with all of these
past MAX_ROWS it runs the one-row dot product once a row, as it did before, and with the WIDE ones
alone past it the kernels of one W row. The three builds take turns, round by round, on the
same matrix of each type: --mib of rows of K = 1024 (64 MiB streams from RAM, as a decode step's
weights do; 2 MiB stays in cache, where the arithmetic alone counts). Prints us a call (best of each
round's --calls, the range over rounds) and the ratio of the medians. On a machine shared with other
work, `--threads 1` times the calling thread's CPU time (the kernels then run on it alone), which
others' work hardly moves, where wall time swings severalfold.

    PYTHONPATH=. python bench/cpu_rows.py [--m 1,2,4,8,16,32,64] [--mib 64] [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from llmx.bench.blocks import random_data
from llmx.quant import cpu_native, qtype

K = 1024


def timed(gemv: cpu_native.Gemv, x: torch.Tensor, calls: int) -> float:
    """The fastest of `calls` calls, in us: wall time, or this thread's CPU time on one thread."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    best = float("inf")
    for _ in range(calls):
        t0 = clock()
        gemv(x)
        best = min(best, clock() - t0)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default=",".join(cpu_native.TYPES))
    ap.add_argument("--m", default="1,2,4,8,16,32,64")
    ap.add_argument("--mib", type=float, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {}
        never = cpu_native.MAX_ROWS + 1
        no_wide = [f"-D{name}={never}" for name in ("WIDE_FROM", "WIDE_K_FROM", "WIDE_Q6_K_FROM")]
        for name, flags in (
            ("each row", [f"-DROWS_FROM={never}", *no_wide]),
            ("rows", no_wide),
            ("wide", []),
        ):
            path = Path(tmp) / f"{name.replace(' ', '_')}.so"
            cpu_native.compile_to(path, *flags)
            builds[name] = lib = cpu_native.bind(path)
            lib.llmx_set_prefetch(cpu_native.prefetch_distance(lib, args.threads))
    clock = "CPU time" if args.threads == 1 else "wall time"
    print(f"{args.threads} threads ({clock}), {args.mib:g} MiB a matrix, K = {K}; us a call, their range\n")
    print("| type | M | each row | rows | 16 W rows | rows / each row | 16 W rows / rows |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.types.split(","):
        qt = qtype(name)
        n = int(args.mib * 2**20) // qt.row_bytes(K)
        data = random_data(qt, n * K, K**-0.5, np.random.default_rng(0))
        raw = torch.from_numpy(data).view(n, qt.row_bytes(K))
        calls = {}
        for build, lib in builds.items():
            cpu_native._library = lambda lib=lib: lib  # Gemv binds the library it finds at its making
            calls[build] = cpu_native.Gemv([(raw, qt)])
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, K)
            times: dict[str, list[float]] = {b: [] for b in builds}
            for _ in range(args.rounds):
                for build, gemv in calls.items():
                    times[build].append(timed(gemv, x, args.calls))
            cells = " | ".join(f"{min(t):.0f}-{max(t):.0f}" for t in times.values())
            median = {b: statistics.median(t) for b, t in times.items()}
            ratios = f"{median['each row'] / median['rows']:.2f}x | {median['rows'] / median['wide']:.2f}x"
            print(f"| {name} | {m} | {cells} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
