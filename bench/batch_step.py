"""The time of one batched decode step (`forward_batch`) against the single-sequence engine's, in-process.

Each sequence prefills a random prompt of ~--depth tokens, then decode steps of all of them run together
(each feeding back a fixed token: the work of a step does not depend on which), --steps timed after
--warm. On one thread (`-t 1`, the default) the figure is the process's CPU time a step, which other
work on a shared machine hardly moves; the wall time is printed beside it, and the tokens a second of
the whole batch. Prints one line a round:

    PYTHONPATH=. python bench/batch_step.py [-m MODEL] [--seqs 1,4,8] [--depth 35] [--rounds 3]

On a GPU (`-ngl 99`) the steps are issued as the server issues them: logits left on the device, the
next step issued before the last one ends (the clock stops once the GPU is done), so the wall time a
step is the larger of its host time and its GPU time. Decode-only steps replay CUDA graphs per batch
bucket (`runtime.batch.decode_padded`; `--graphs off`: eagerly, to compare); one warm step per bucket
captures its graph before the clock starts (keep --depth + --warm + --steps inside one 256-position
width bucket, or a capture lands in the timed steps). A synthetic Llama-3-8B:

    llmx synth --shape llama3-8b -o /tmp/l3.gguf
    PYTHONPATH=. python bench/batch_step.py -m /tmp/l3.gguf -ngl 99 -c 32768 --seqs 1,8,32,64 --depth 400

To compare two trees, run it with PYTHONPATH set to each in turn (the script uses only `forward_batch`).
`--profile` then runs --steps eager steps (no graphs) of each --seqs under torch.profiler and prints
the GPU's time a step by kernel name (`profile_decode.print_kernels`): which kernel a batch size takes.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from profile_decode import print_kernels  # this folder's: the script's own

import llmx
from llmx.api import LoadedModel
from llmx.runtime.batch import Chunk, forward_batch
from llmx.runtime.blocks import BlockTable
from llmx.runtime.paged import PagedKVCache


def _done(model: LoadedModel) -> None:
    """Wait for the GPU's work so far (none on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_step(model: LoadedModel, depth: int, warm: int, steps: int) -> tuple[float, float]:
    """(CPU ms, wall ms) a decode step of the engine alone at `depth` positions."""
    engine = model.engine
    engine.reset()
    engine.prefill(list(range(100, 100 + depth)))
    for _ in range(warm):
        engine.decode(42)
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        engine.decode(42)
    return (time.process_time() - c0) / steps * 1e3, (time.perf_counter() - t0) / steps * 1e3


def batch_step(
    model: LoadedModel,
    paged: PagedKVCache,
    seqs: int,
    depth: int,
    warm: int,
    steps: int,
    around: Callable[[], AbstractContextManager] = nullcontext,
) -> tuple[float, float]:
    """(CPU ms, wall ms) a decode step of `seqs` sequences at ~`depth` positions (ragged by a few);
    the timed steps run inside `around()` (a profiler)."""
    executor = model.engine.executor
    tables = [BlockTable() for _ in range(seqs)]
    prompts = [list(range(100 + s, 100 + s + depth - s % 5)) for s in range(seqs)]
    forward_batch(executor, paged, [Chunk(t, p) for t, p in zip(tables, prompts, strict=True)])
    on_device = any(d.type == "cuda" for d in executor.layer_devices)
    for _ in range(warm):
        forward_batch(executor, paged, [Chunk(t, [42]) for t in tables], on_device=on_device)
    _done(model)
    c0, t0 = time.process_time(), time.perf_counter()
    with around():
        for _ in range(steps):
            forward_batch(executor, paged, [Chunk(t, [42]) for t in tables], on_device=on_device)
        _done(model)
    cpu, wall = (time.process_time() - c0) / steps * 1e3, (time.perf_counter() - t0) / steps * 1e3
    for t in tables:
        paged.blocks.free(t)
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument(
        "-ngl", "--n-gpu-layers", default="0", help="as llmx's -ngl (99 or all: every layer on the GPU)"
    )
    ap.add_argument("-c", "--ctx-size", type=int, default=4096, help="shared by the largest --seqs")
    ap.add_argument(
        "--graphs", choices=("on", "off"), default="on", help="CUDA graphs (the engine's and the batch's)"
    )
    ap.add_argument("--seqs", default="1,4,8")
    ap.add_argument("--depth", type=int, default=35)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="then each batch's kernels, eager (a GPU)")
    args = ap.parse_args()
    ngl = args.n_gpu_layers if args.n_gpu_layers == "all" else int(args.n_gpu_layers)
    model = llmx.load(args.model, threads=args.threads, n_gpu_layers=ngl, ctx_size=args.ctx_size)
    model.engine.executor.use_graphs = args.graphs == "on"
    counts = [int(s) for s in args.seqs.split(",")]
    paged = PagedKVCache.over(model.engine.executor.cache, max(counts), caching=False)
    for r in range(args.rounds):
        cpu, wall = engine_step(model, args.depth, args.warm, args.steps)
        line = [f"round {r}: engine {cpu:.1f} ms CPU ({wall:.1f} wall, {1e3 / wall:.0f} tok/s)"]
        for n in counts:
            cpu_n, wall_n = batch_step(model, paged, n, args.depth, args.warm, args.steps)
            rate = f"{wall_n:.1f} wall, {n * 1e3 / wall_n:.0f} tok/s"
            line.append(f"{n} seqs {cpu_n:.1f} ({rate}) = {n * cpu / cpu_n:.2f}x")
        print("; ".join(line), flush=True)
    graphs = model.engine.executor.graphs
    print(
        f"batched decode graphs: {graphs.batch_captures} captured, {graphs.batch_replays} replays", flush=True
    )
    if args.profile and torch.cuda.is_available():
        model.engine.executor.use_graphs = False
        for n in counts:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            batch_step(model, paged, n, args.depth, args.warm, args.steps, lambda p=prof: p)
            print_kernels(prof, args.steps, f"{n} sequences, eager", "step", 12)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
