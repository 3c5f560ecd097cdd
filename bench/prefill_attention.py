"""A prompt batch's attention over the KV cache: the Triton flash kernel (`kernels.prefill_attention`)
against the path it replaces, for one layer of Llama-3-8B (32 heads, 8 KV heads, D = 128), T = 512.

The path before the kernel: for f16/bf16 caches `ops.causal_prompt_attention` (PyTorch's SDPA;
past the first chunk it repeats the cache over each GQA group, a cache-sized copy a layer), for block
caches `ops.block_attention` (dequantize and matmul, a chunk of keys at a time). Times are medians
of CUDA-event timings; TFLOP/s counts the visible keys' 4 * D flops a query head.

    python bench/prefill_attention.py [--n-read 512,8192,32768] [--types f16,q8_0] [--t 512]
                                      [--first auto|on|off]  # block rows converted first, or not
    python bench/prefill_attention.py --sweep 128x64x8x3,64x64x4x3  # the kernel's tiles: BLOCK_M x
        BLOCK_N x num_warps x num_stages, in place of `_tiles`' choice (then no old path)
"""

from __future__ import annotations

import argparse
import statistics

import torch

from llmx.kernels import prefill_attention as kernel
from llmx.kernels.prefill_attention import prefill_attention
from llmx.ops.block_attention import block_attention
from llmx.ops.cached_attention import causal_prompt_attention
from llmx.ops.masks import causal_mask
from llmx.quant import kv_layout, qtype
from llmx.quant.quantize import quantize

FIRST = {"auto": None, "on": True, "off": False}  # --first: prefill_attention's dequantize_first
FLOATS = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def milliseconds(fn, runs: int = 20) -> float:
    """Median milliseconds of fn() on the GPU, after two warm-up calls (compiles, autotuning)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def inputs(name: str, t: int, n_read: int, n_head: int, n_kv: int, d: int):
    """Random q [t, H, D] and a cache of `n_read` rows of K and V in type `name`, the last t of them
    the queries' positions: (q, K, V, positions, the caches' types or None for float ones)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, n_head, d, device="cuda", generator=g)
    k, v = (torch.randn(n_read, n_kv, d, device="cuda", generator=g) for _ in range(2))
    positions = torch.arange(n_read - t, n_read, device="cuda")
    if name in FLOATS:
        return q, k.to(FLOATS[name]), v.to(FLOATS[name]), positions, None
    qt = qtype(name.upper())
    k, v = (kv_layout.stored(quantize(x, qt), qt, x.device) for x in (k, v))  # as a GPU cache holds them
    return q, k, v, positions, (qt, qt)


def case(
    name: str, t: int, n_read: int, n_head: int, n_kv: int, d: int, first: bool | None
) -> tuple[float, float, float]:
    """(old ms, kernel ms, max |kernel - old|) for cache type `name` (`first`: `dequantize_first`)."""
    q, kc, vc, positions, types = inputs(name, t, n_read, n_head, n_kv, d)
    if types is None:

        def old():
            return causal_prompt_attention(q, kc, vc)
    else:
        mask = causal_mask(positions, n_read)  # made once a step for every layer: not timed

        def old():
            return block_attention(q, kc, vc, types, mask)

    def new():
        return prefill_attention(q, kc, vc, positions, types=types, dequantize_first=first)

    diff = (new().float() - old().float()).abs().max().item()
    return milliseconds(old), milliseconds(new), diff


def sweep(tiles: str, name: str, t: int, n_read: int, n_head: int, n_kv: int, d: int) -> None:
    """The kernel's milliseconds with each of `tiles` (BMxBNxWARPSxSTAGES, comma-separated)."""
    q, kc, vc, positions, types = inputs(name, t, n_read, n_head, n_kv, d)
    chosen = kernel._tiles
    cells = []
    for spec in tiles.split(","):
        bm, bn, warps, stages = (int(x) for x in spec.split("x"))
        kernel._tiles = lambda *a, c=(bm, bn, warps, stages): c
        try:
            ms = milliseconds(lambda: prefill_attention(q, kc, vc, positions, types=types))
            cells.append(f"{ms:.3f}")
        except Exception as e:  # out of shared memory, registers: say so and go on
            cells.append(type(e).__name__)
        finally:
            kernel._tiles = chosen
    print(f"| {name} | {n_read} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-read", default="512,8192,32768", help="cache rows read (the context so far)")
    ap.add_argument("--types", default="f16,q8_0", help="cache types (f16, bf16, f32, q8_0, q4_0, ...)")
    ap.add_argument("--t", type=int, default=512, help="the prompt chunk's tokens (-ub)")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    ap.add_argument("--sweep", help="the kernel alone with these tiles (BMxBNxWARPSxSTAGES,...)")
    ap.add_argument("--first", choices=FIRST, default="auto", help="block rows converted first")
    args = ap.parse_args()
    n_head, n_kv, d = (int(x) for x in args.heads.split(","))
    print(f"{torch.cuda.get_device_name()}: T={args.t}, {n_head} heads, {n_kv} KV heads, D={d}")
    if args.sweep:
        print("| cache | n_read | " + " | ".join(args.sweep.split(",")) + " |")
        print("|---|---:|" + "---:|" * len(args.sweep.split(",")))
        for name in args.types.split(","):
            for n_read in (int(x) for x in args.n_read.split(",")):
                sweep(args.sweep, name, min(args.t, n_read), n_read, n_head, n_kv, d)
        return
    print("| cache | n_read | old ms | kernel ms | speedup | kernel TFLOP/s | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.types.split(","):
        for n_read in (int(x) for x in args.n_read.split(",")):
            t = min(args.t, n_read)
            old, new, diff = case(name, t, n_read, n_head, n_kv, d, FIRST[args.first])
            visible = t * (n_read - t) + t * (t + 1) / 2  # keys each query sees, summed
            tflops = 4 * d * n_head * visible / (new * 1e-3) / 1e12
            speedup = f"{old / new:.2f}x"
            cells = [name, n_read, f"{old:.3f}", f"{new:.3f}", speedup, f"{tflops:.1f}", f"{diff:.1e}"]
            print("| " + " | ".join(map(str, cells)) + " |")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
