"""Two or more versions of the native CPU kernels' source (`llmx/quant/cpu_blocks.c`) side by side.

Each source is compiled as `cpu_native` compiles its own, and the same random matrix of each type is
multiplied by the same x (M rows) through each build's `Gemv`, the builds taking turns for seven rounds;
the table gives each build's best and median microseconds a call (the best of several calls a round:
this thread's CPU time on one thread, wall time on more) and whether all builds' outputs are equal to the
bit, as changes to a kernel's instruction choice should leave them.

    python bench/cpu_build_ab.py OLD.c,llmx/quant/cpu_blocks.c [--types Q4_1,Q4_K] [--mib 1]
                                 [--threads 1] [--m 1] [--k 1024]

`--mib` sizes each matrix: 1-2 MiB stay in a core's L2 (the kernel's own speed); 64 MiB pass it (from RAM
where the last-level cache is smaller: the 2-core Xeon's VM reports 480 MiB of L3).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
from cpu_rows import timed  # this folder's: the script's own

from llmx.bench.blocks import random_data
from llmx.quant import cpu_native, qtype

K = 1024  # a row's weights unless --k
ROUNDS = 7


def build(source: Path, out: Path, threads: int) -> cpu_native.Gemv:
    """The library compiled from `source` (as cpu_native builds its own), bound, with its prefetch set."""
    cpu_native.SOURCE = source
    cpu_native.compile_to(out)
    lib = cpu_native.bind(out)
    lib.llmx_set_prefetch(cpu_native.prefetch_distance(lib, threads))
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", help="comma-separated C sources")
    ap.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q6_K")
    ap.add_argument("--mib", type=float, default=1.0, help="each matrix's size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--m", type=int, default=1, help="rows of x")
    ap.add_argument("--k", type=int, default=K, help="a row's weights (Gemma 3 270M's: 640)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sources = [Path(s) for s in args.sources.split(",")]
    original = cpu_native.SOURCE
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(s, Path(tmp) / f"build{i}.so", args.threads) for i, s in enumerate(sources)]
    cpu_native.SOURCE = original
    calls = 20 if args.mib < 8 else 5
    k = args.k
    shape = f"{args.mib:g} MiB a matrix, K = {k}, M = {args.m}"
    print(f"{args.threads} threads, {shape}; us a call, best-median\n")
    print("| type | " + " | ".join(s.name for s in sources) + " | same bits |")
    print("| --- | " + " | ".join("---:" for _ in sources) + " | --- |")
    for name in args.types.split(","):
        qt = qtype(name)
        n = int(args.mib * 2**20) // qt.row_bytes(k)
        data = random_data(qt, n * k, k**-0.5, np.random.default_rng(0))
        raw = torch.from_numpy(data).view(n, qt.row_bytes(k))
        gemvs = []
        for lib in libs:
            cpu_native._library = lambda lib=lib: lib  # a Gemv binds the library it finds at its making
            gemvs.append(cpu_native.Gemv([(raw, qt)]))
        x = torch.randn(args.m, k)
        outputs = [gemv(x).clone() for gemv in gemvs]
        same = all(torch.equal(outputs[0], out) for out in outputs[1:])
        times: list[list[float]] = [[] for _ in gemvs]
        for _ in range(ROUNDS):
            for gemv, kept in zip(gemvs, times, strict=True):
                kept.append(timed(gemv, x, calls))
        cells = " | ".join(f"{min(t):.0f}-{statistics.median(t):.0f}" for t in times)
        print(f"| {name} | {cells} | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
