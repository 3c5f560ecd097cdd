"""One decode token's attention kernel alone on a GPU, per cache type and context: microseconds a call
and the cache bytes it reads a second.

    python bench/decode_attention.py [--types f16,q8_0,q4_0] [--n-read 512,8192,32768]
                                     [--heads 32,8,128] [--stages 0] [--warps 4] [--block-n 64]
                                     [--programs N]
                                     [--rotation]

Random caches of `--n-read` rows (Llama-3-8B's heads by default; block caches' scales kept finite),
the token at the last row, `decode_attention.decode_attention` as a decode step calls it, twenty
calls captured in a CUDA graph and the best of five replays kept. `--stages`, `--warps` and
`--block-n` (comma-separated; stages 0: the kernel's own choice) launch `attention_kernel` with
other settings, to sweep them; `--programs` splits the keys for that many programs (KV heads x
splits) instead of the kernel's two waves of SMs.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from functools import partial

import torch

import llmx.kernels.decode_attention as kernel
from llmx.kernels.cache_rows import BLOCKS
from llmx.ops.hadamard import kv_rotation
from llmx.quant import qtype

CALLS = 20  # a graph's calls
REPLAYS = 5  # the best one kept


class Launched:
    """`attention_kernel` with launch options replaced (num_warps, num_stages)."""

    def __init__(self, jit, options: dict[str, int]) -> None:
        self.jit, self.options = jit, options

    def __getitem__(self, grid):
        launch = self.jit[grid]
        return lambda *args, **kw: launch(*args, **(kw | self.options))


def caches(name: str, n_read: int, n_kv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """K and V caches of `n_read` random rows of type `name`, and the bytes of one row of both."""
    code, block = BLOCKS.get(qtype(name).name, (0, 0))
    if not code:
        k = torch.randn(n_read, n_kv, d, dtype=torch.float16, device="cuda")
        return k, k.clone(), 2 * n_kv * d * 2
    head = d // 32 * block
    k = torch.randint(0, 256, (n_read, n_kv, head), dtype=torch.uint8, device="cuda")
    k[:, :, 1 : 2 * (d // 32) : 2] = 0x20  # the f16 scales' high bytes (the grouped layout's first)
    return k, k.clone(), 2 * n_kv * head


def graph_microseconds(call: Callable[[], object]) -> float:
    """A call's microseconds: CALLS of them in a CUDA graph, the best of REPLAYS replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call()
    graph.replay()
    best = float("inf")
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / CALLS)
    return best


def cases(
    name: str, n_read: int, heads: tuple[int, int, int], settings: list[tuple[str, str, str]], rotated: bool
) -> None:
    """Print one line for each (stages, warps, BLOCK_N) of `settings` with a cache of `name` and `n_read`
    rows; `rotated`: a block cache rotated as the runtime rotates it (`ops.hadamard.kv_rotation`)."""
    n_head, n_kv, d = heads
    k_cache, v_cache, row_bytes = caches(name, n_read, n_kv, d)
    types = (qtype(name), qtype(name)) if k_cache.dtype == torch.uint8 else None
    q = torch.randn(1, n_head, d, dtype=torch.float16, device="cuda")
    k = torch.randn(1, n_kv, d, dtype=torch.float16, device="cuda")
    cos, sin = torch.ones(1, d // 2, device="cuda"), torch.zeros(1, d // 2, device="cuda")
    positions = torch.tensor([n_read - 1], device="cuda")
    call = partial(
        kernel.decode_attention, q, k, k, cos, sin, k_cache, v_cache, positions, n_read, n_dims=d, neox=False,
        types=types, rotation=kv_rotation(types, (d, d), q.device) if rotated and types else (0, 0),
    )  # fmt: skip
    jit, block_n = kernel.attention_kernel, kernel.BLOCK_N
    for stages, warps, bn in settings:
        options = {"num_warps": int(warps)} | ({"num_stages": int(stages)} if int(stages) else {})
        kernel.attention_kernel, kernel.BLOCK_N = Launched(jit, options), int(bn)
        try:
            us = graph_microseconds(call)
            cells = [f"{us:.1f}", f"{n_read * row_bytes / us / 1e3:.0f}"]
        except Exception as e:  # out of shared memory or registers: say so and go on
            cells = [type(e).__name__, "-"]
        finally:
            kernel.attention_kernel, kernel.BLOCK_N = jit, block_n
        print(f"| {name} | {n_read} | {stages} | {warps} | {bn} | {' | '.join(cells)} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="f16,q8_0,q4_0", help="cache types (f16, q8_0, q4_0, ...)")
    ap.add_argument("--n-read", default="512,8192,32768", help="cache rows read (the context so far)")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    ap.add_argument("--stages", default="0", help="num_stages to launch with (0: the kernel's choice)")
    ap.add_argument("--warps", default="4", help="num_warps to launch with")
    ap.add_argument("--block-n", default=str(kernel.BLOCK_N), help="keys a loop step")
    ap.add_argument("--programs", type=int, help="programs to split the keys into (default: the kernel's)")
    ap.add_argument("--rotation", action="store_true", help="block caches rotated (`ops.hadamard`)")
    args = ap.parse_args()
    if args.programs:
        kernel.target_programs = lambda device: args.programs
    n_head, n_kv, d = (int(x) for x in args.heads.split(","))
    heads = (n_head, n_kv, d)
    settings = list(itertools.product(args.stages.split(","), args.warps.split(","), args.block_n.split(",")))
    print(f"{torch.cuda.get_device_name()}: {heads[0]} heads, {heads[1]} KV heads, D={heads[2]}")
    print("| cache | n_read | stages | warps | BLOCK_N | us | GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.types.split(","):
        for n_read in (int(x) for x in args.n_read.split(",")):
            cases(name, n_read, heads, settings, args.rotation)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
