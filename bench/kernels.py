"""Triton kernel speed per GGML type against the GPU's measured ceilings.

For each type and weight shape N x K (default: Llama-3-8B's FFN, 14336x4096 and 4096x14336) and
each batch M: the median time of `triton_ops.linear`, as GB/s of weight bytes over the measured
device-to-device copy bandwidth (GEMV, M <= 8: memory-bound), or as TFLOP/s over the measured bf16
matmul rate (GEMM: compute-bound). GEMM rows also show dequantize-then-torch.matmul and a dense bf16
torch.matmul of the same shape. The ceilings are measured in the same run: a copy of a 4 GB
buffer (bytes read + written) and an 8192^3 bf16 matmul. triton.testing.do_bench clears the L2
before every call, so each call reads its weight from HBM.

    python bench/kernels.py [--types Q4_K,Q8_0] [--m 1,2,4,8,512] [--sweep] [--json PATH]

`--sweep` also times a grid of GEMV launch shapes at M = 1 and 8 (how `default_gemv` was chosen).
Prints markdown tables; JSON goes to --json, else to $OUT/kernels.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from functools import partial
from types import SimpleNamespace

import torch
import triton.testing

from llmx.bench.blocks import chunk_rng, random_data
from llmx.quant import qtype
from llmx.quant import triton_ops as tops

SHAPES = [(14336, 4096), (4096, 14336)]


def bench_ms(fn) -> float:
    """Median milliseconds of fn() with a cleared L2 before each call."""
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def ceilings() -> dict[str, float]:
    """Device-to-device copy GB/s (read + write) and bf16 matmul TFLOP/s, measured now."""
    src = torch.empty(1 << 30, dtype=torch.float32, device="cuda").uniform_()
    copy_gbs = 2 * src.numel() * 4 / bench_ms(partial(torch.Tensor.copy_, torch.empty_like(src), src)) / 1e6
    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    mm_tflops = 2 * 8192**3 / bench_ms(partial(torch.matmul, a, b)) / 1e9
    return {"copy_gbs": copy_gbs, "bf16_tflops": mm_tflops}


def make_weight(name: str, n: int, k: int) -> SimpleNamespace:
    """A random valid [n, k] weight of type `name` on the GPU, shaped like llmx.quant.weight.QWeight."""
    qt = qtype(name)
    data = random_data(qt, n * k, 0.02, chunk_rng(0, qt.ggml_id, n))
    raw = torch.from_numpy(data).view(n, qt.row_bytes(k)).cuda()
    return SimpleNamespace(raw=raw, qtype=qt, shape=(n, k), name=f"{name} {n}x{k}")


def dequant_matmul(x: torch.Tensor, w: SimpleNamespace) -> torch.Tensor:
    """The unfused alternative to the GEMM kernel: whole weight to bf16, then cuBLAS."""
    return torch.nn.functional.linear(x, tops.dequantize(w, torch.bfloat16))


def run(types: list[str], ms: list[int], ceil: dict[str, float]) -> list[dict]:
    rows = []
    for name, (n, k) in itertools.product(types, SHAPES):
        w = make_weight(name, n, k)
        nbytes = w.raw.numel()
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            t = bench_ms(partial(tops.linear, x, w))
            row = {"type": name, "n": n, "k": k, "m": m, "ms": t, "weight_bytes": nbytes}
            if m <= tops.GEMV_MAX_M:
                row["gbs"] = nbytes / t / 1e6
                row["frac"] = row["gbs"] / ceil["copy_gbs"]
            else:
                flop = 2 * m * n * k
                row["tflops"] = flop / t / 1e9
                row["frac"] = row["tflops"] / ceil["bf16_tflops"]
                row["dequant_matmul_tflops"] = flop / bench_ms(partial(dequant_matmul, x, w)) / 1e9
                dense = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
                row["dense_bf16_tflops"] = (
                    flop / bench_ms(partial(torch.nn.functional.linear, x, dense)) / 1e9
                )
            rows.append(row)
        del w
    return rows


def sweep(types: list[str]) -> list[dict]:
    """GEMV time for a grid of launch shapes, M = 1 and 8."""
    rows = []
    shapes = itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048), (4, 8))
    grid = [tops.GemvConfig(bn, bk, nw) for bn, bk, nw in shapes]
    for name, (n, k), m in itertools.product(types, SHAPES, (1, 8)):
        w = make_weight(name, n, k)
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        for cfg in grid:
            if m == 8 and cfg.bn * cfg.bk > 2048:  # the [8, BN, BK] product would spill
                continue
            t = bench_ms(partial(tops.linear, x, w, gemv=cfg))
            row = {"type": name, "n": n, "k": k, "m": m, "ms": t, "gbs": w.raw.numel() / t / 1e6}
            rows.append(row | cfg.__dict__)
    return rows


def table(rows: list[dict], ceil: dict[str, float]) -> str:
    out = [
        f"Ceilings: copy {ceil['copy_gbs']:.0f} GB/s (read+write), "
        f"bf16 matmul {ceil['bf16_tflops']:.0f} TFLOP/s",
        "",
        "| type | N x K | M | time µs | GB/s (weights) | TFLOP/s | fraction of ceiling "
        "| dequant+matmul TFLOP/s | dense bf16 TFLOP/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        head = f"| {r['type']} | {r['n']}x{r['k']} | {r['m']} | {r['ms'] * 1e3:.1f} |"
        if "gbs" in r:
            out.append(f"{head} {r['gbs']:.0f} | | {r['frac']:.0%} of copy | | |")
        else:
            out.append(
                f"{head} | {r['tflops']:.0f} | {r['frac']:.0%} of bf16 | "
                f"{r['dequant_matmul_tflops']:.0f} | {r['dense_bf16_tflops']:.0f} |"
            )
    return "\n".join(out)


def sweep_table(rows: list[dict]) -> str:
    """The best and the median launch shape per (type, shape, M)."""
    out = [
        "| type | N x K | M | best BN/BK/warps | best GB/s | median GB/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key, group in itertools.groupby(rows, lambda r: (r["type"], r["n"], r["k"], r["m"])):
        group = list(group)
        best = max(group, key=lambda r: r["gbs"])
        med = statistics.median(r["gbs"] for r in group)
        cfg = f"{best['bn']}/{best['bk']}/{best['num_warps']}"
        out.append(f"| {key[0]} | {key[1]}x{key[2]} | {key[3]} | {cfg} | {best['gbs']:.0f} | {med:.0f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(tops.GROUP))
    ap.add_argument("--m", default="1,2,4,8,512")
    ap.add_argument("--sweep", default="", help="types whose GEMV launch shapes to sweep, e.g. Q4_K,Q8_0")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    ceil = ceilings()
    result: dict = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "ceilings": ceil}
    if args.sweep:
        result["sweep"] = sweep(args.sweep.split(","))
        print(sweep_table(result["sweep"]), flush=True)
    result["rows"] = run(args.types.split(","), [int(m) for m in args.m.split(",")], ceil)
    print(f"\n{gpu}, torch {torch.__version__}, triton {triton.__version__}\n")
    print(table(result["rows"], ceil))
    path = args.json or (os.path.join(os.environ["OUT"], "kernels.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
