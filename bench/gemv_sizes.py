"""Decode GEMV speed by matrix size: what a launch's start and end cost at a few tens of MB.

`bench/kernels.py` times the issue's two FFN shapes alone, 33-62 MB a launch, where the GEMVs reach
78-98% of a 4 GB copy and a read of the same bytes that overlaps its neighbours as they do (PDL)
107-111% (bench/RESULTS.md, session 23). This times the integer-dot GEMV (its default launch
shape) and that read on matrices of K = 4096 whose row counts give a chosen number of waves of
programs, from about one to seven (the slots: SMs times the programs an SM holds at the kernel's
registers, measured here), then a decode step's largest launches: gate and up in one launch
(`matmul.linear_many`, 2 x 14336 x 4096) and the output matrix (128256 x 4096). GB/s of weight
bytes, as fractions of the copy and of the read; CUDA graph replay as in `bench/kernels.py`.

    PYTHONPATH=. python bench/gemv_sizes.py [--types Q4_K,Q6_K,Q8_0] [--waves 1,1.5,2,3,4,7]
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

import torch

from bench import kernels as kb
from bench.ptx_gemv import compiled, registers
from llmx.quant.triton import activation, layout
from llmx.quant.triton import matmul as tops
from llmx.quant.triton.tuning import for_device

K = 4096
GATE_UP = (14336, K)
OUTPUT = (128256, K)
MAX_PROGRAMS_AN_SM = 32  # Hopper's limit of resident blocks


def slots(name: str) -> int:
    """Programs the GPU holds at once at `name`'s default short-row launch shape: SMs times what one
    SM holds at the kernel's registers (compiled for Hopper by `bench/ptx_gemv.py`) and warps."""
    cfg = for_device(torch.device("cuda")).dot8(name, K)
    regs = registers(compiled(name, cfg)["cubin"])
    props = torch.cuda.get_device_properties(0)
    by_regs = props.regs_per_multiprocessor // (regs * 32 * cfg.num_warps)
    by_warps = props.max_threads_per_multi_processor // (32 * cfg.num_warps)
    return props.multi_processor_count * min(by_regs, by_warps, MAX_PROGRAMS_AN_SM)


def timed(name: str, shapes: list[tuple[int, int]], ceil: dict[str, float]) -> dict:
    """GB/s of one launch over weights `shapes` (one: `linear`; several: `linear_many`) and of a read
    of the same bytes."""
    ws = [layout.prepare(kb.make_weight(name, n, k)) for n, k in shapes]
    x = torch.randn(1, shapes[0][1], dtype=torch.bfloat16, device="cuda")
    qx = activation.quantize_x(x)
    if len(ws) == 1:
        calls = [partial(tops.linear, x, c, kernel="dot8", qx=qx) for c in kb.copies(ws[0])]
    else:
        sets = list(zip(*(kb.copies(w) for w in ws), strict=True))
        calls = [partial(tops.linear_many, x, list(s), qx=qx) for s in sets]
    nbytes = sum(w.raw.numel() for w in ws)
    gbs = nbytes / kb.graph_ms(calls) / 1e6
    # a read of one matrix of the same bytes: the weights' rows stacked
    whole = kb.make_weight(name, sum(n for n, _ in shapes), shapes[0][1]) if len(ws) > 1 else ws[0]
    read = kb.read_row(whole, ceil)["gbs"]
    shape = " + ".join(f"{n}x{k}" for n, k in shapes)
    return {"type": name, "shape": shape, "mb": nbytes / 1e6, "dot8_gbs": gbs, "read_gbs": read}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--waves", default="1,1.5,2,3,4,7", help="waves of programs of the sizes to time")
    args = ap.parse_args()
    ceil = kb.ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {ceil['copy_gbs']:.0f} GB/s (read + write)\n")
    print("| type | N x K | MB | waves | dot8 GB/s | % of copy | read GB/s | % of copy | dot8 / read |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for name in args.types.split(","):
        cfg, held = for_device(torch.device("cuda")).dot8(name, K), slots(name)
        sizes = [([(round(held * float(v)) * cfg.bn, K)], f"{v}") for v in args.waves.split(",")]
        sizes += [([GATE_UP, GATE_UP], "gate + up"), ([OUTPUT], "output")]
        for shapes, label in sizes:
            row = timed(name, shapes, ceil) | {"waves": label, "slots": held}
            rows.append(row)
            copy = ceil["copy_gbs"]
            print(
                f"| {name} | {row['shape']} | {row['mb']:.0f} | {label} | {row['dot8_gbs']:.0f} | "
                f"{row['dot8_gbs'] / copy:.0%} | {row['read_gbs']:.0f} | {row['read_gbs'] / copy:.0%} | "
                f"{row['dot8_gbs'] / row['read_gbs']:.0%} |",
                flush=True,
            )
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemv-sizes.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "ceilings": ceil, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
