"""Launch each M = 1 GEMV once after a warm-up, for Nsight Compute to profile (bench/gpu_session.sh ncu).

    ncu --set full -k regex:gemv python bench/ncu_gemv.py [--types Q4_K,Q6_K,Q8_0] [--kernels dot8,gemv]
        [--shapes 2/1024/2,2/2048/1]

Every (type, shape, kernel) is launched twice: the first call compiles, the second is the one to
read (ncu reports both; caches are flushed before each profiled launch by ncu's default).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bench.kernels import SHAPES, make_weight, parse_shapes
from llmx.quant.triton import layout
from llmx.quant.triton import matmul as tops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--kernels", default="dot8,gemv")
    ap.add_argument(
        "--shapes", default="", help="launch shapes BN/BK/warps[/late][/rN] (default: each kernel's own)"
    )
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes) or [None]
    for name in args.types.split(","):
        for n, k in SHAPES:
            w = layout.prepare(make_weight(name, n, k))
            x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
            for kernel, shape in itertools.product(args.kernels.split(","), shapes):
                for _ in range(2):
                    tops.linear(x, w, kernel=kernel, gemv=shape)
                torch.cuda.synchronize()
                print(f"{name} {n}x{k} {kernel} {shape or 'default shape'}", flush=True)


if __name__ == "__main__":
    main()
