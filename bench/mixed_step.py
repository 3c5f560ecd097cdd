"""A batched step that carries prompt chunks beside decode tokens (`forward_batch`), as a server's step
does while requests arrive: its wall time over repetitions (each with fresh prompts), whether Triton
compiled anything inside it, and one more repetition under torch.profiler with its kernels and host ops.

Sequences that decode prefill a prompt first; each repetition then runs --prompts new prompts of
about --plen tokens (ragged by a few) and one decode token of each of --decode sequences in one step.

    PYTHONPATH=.:bench python bench/mixed_step.py -m MODEL [-ngl 99] [--prompts 4] [--plen 112] [--decode 60]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from profile_decode import HOST_AND_GPU, print_host_ops, print_kernels  # this folder's: the script's own

import llmx
from llmx.runtime.batch import Chunk, forward_batch
from llmx.runtime.blocks import BlockTable
from llmx.runtime.paged import PagedKVCache


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def triton_kernels() -> int:
    """Kernels in Triton's cache: more after a step than before it means the step compiled some."""
    root = os.path.expanduser("~/.triton/cache")
    return sum(1 for _, _, files in os.walk(root) for f in files if f.endswith(".cubin"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=99)
    ap.add_argument("-c", "--ctx-size", type=int, default=40960)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--plen", type=int, default=112)
    ap.add_argument("--decode", type=int, default=60)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    model = llmx.load(args.model, n_gpu_layers=args.n_gpu_layers, ctx_size=args.ctx_size)
    executor = model.engine.executor
    paged = PagedKVCache.over(executor.cache, args.prompts + args.decode, caching=False)
    decoding = [BlockTable() for _ in range(args.decode)]
    forward_batch(executor, paged, [Chunk(t, list(range(100 + i, 400 + i))) for i, t in enumerate(decoding)])
    synchronize()
    on_device = torch.cuda.is_available()
    for rep in range(args.reps + 1):
        fresh = [BlockTable() for _ in range(args.prompts)]
        first = 200 + rep
        chunks = [
            Chunk(t, list(range(first + i, first + i + args.plen - i % 3))) for i, t in enumerate(fresh)
        ]
        chunks += [Chunk(t, [42]) for t in decoding]
        before = triton_kernels()
        profiled = rep == args.reps
        prof = torch.profiler.profile(activities=HOST_AND_GPU) if profiled else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.__enter__()
        forward_batch(executor, paged, chunks, on_device=on_device)
        synchronize()
        if prof is not None:
            prof.__exit__(None, None, None)
        ms = (time.perf_counter() - t0) * 1e3
        rows = sum(len(c.ids) for c in chunks)
        note = " (profiled)" if profiled else ""
        print(f"rep {rep}: {ms:.1f} ms ({rows} rows), Triton's kernels {before} -> {triton_kernels()}{note}")
        if prof is not None:
            print_kernels(prof, 1, "mixed step", "step", 25)
            print_host_ops(prof, "mixed step", 25)
        for t in fresh:
            paged.blocks.free(t)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
