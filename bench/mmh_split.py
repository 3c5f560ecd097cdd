"""mmh's time by its split over K: the tuned rule (`matmul.mmq_splits`) against K cut into 1, 2, 4 and 8
ranges, on Llama-3-8B's FFN matrices (14336 x 4096 and 4096 x 14336) at 8 to 64 rows of x, microseconds
a call: what one call adds to a CUDA graph of them over weight copies larger than the L2 (`kernels.graph_ms`,
x scaled into f16 beforehand as a step does; eager calls were host-bound, ~140 us each on an H100). A
launch of the FFN up matrix at 16 rows has under two programs an SM (bench/RESULTS.md): whether more
programs, each with fewer steps, hide the step's latency.

    python bench/mmh_split.py [--types Q4_K,Q6_K] [--m 8,16,32,64]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
from kernels import copies, graph_ms, make_weight

from llmx.quant.triton import activation
from llmx.quant.triton import matmul as tops
from llmx.quant.triton.layout import prepare

FACTORS = (1, 2, 4, 8)  # K's ranges forced, beside the rule's


def forced(ranges: int) -> Callable[[int, int, int], tuple[int, int]]:
    """An `mmq_splits` that cuts K's steps into `ranges` (each at least two steps)."""

    def splits(programs: int, steps: int, sms: int) -> tuple[int, int]:
        per = -(-steps // max(1, min(ranges, steps // 2)))
        return -(-steps // per), per

    return splits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--m", default="8,16,32,64")
    args = ap.parse_args()
    rule = tops.mmq_splits
    print("| weight | rows | rule | " + " | ".join(f"{f} ranges" for f in FACTORS) + " |")
    print("| --- | ---: | ---: |" + " ---: |" * len(FACTORS))
    for name in args.types.split(","):
        for n, k in ((14336, 4096), (4096, 14336)):
            ws = copies(prepare(make_weight(name, n, k)))
            for m in map(int, args.m.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 0.1
                half = activation.half_rows(x)
                cells = []
                for splits in (rule, *map(forced, FACTORS)):
                    tops.mmq_splits = splits  # read as each call is captured
                    calls = [partial(tops.linear, x, w, kernel="mmh", half=half) for w in ws]
                    cells.append(f"{graph_ms(calls) * 1e3:.1f}")
                tops.mmq_splits = rule
                print(f"| {name} {n}x{k} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
