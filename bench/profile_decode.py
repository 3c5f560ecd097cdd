"""Where a GPU decode step spends its time: kernel time by kernel name, and the step time per token.

    python bench/profile_decode.py MODEL.gguf [-ngl 99] [--steps 8] [--depth 64] [--prefill 512]
                                   [-c 1024] [-ctk f16] [-ctv f16] [-fa auto]

Prefills `--depth` tokens, then profiles `--steps` eager decode steps (no CUDA graph, so every kernel
is visible) with torch.profiler and prints CUDA time per kernel name, summed and per token. Then it
times graph-replayed decode steps the way `llmx bench` does, so the two can be set side by side:
(graph step time) - (kernel time) is launch gaps and host work the graph did not hide.
`--prefill N` also profiles one N-token prefill (after one that compiles and tunes), then times
eight more without the profiler, with the garbage collector's time inside each. `--host` profiles
the host's side of decode steps as `llmx bench` runs them (graphs where they run) by operator: what
the GPU waits for between steps, and for hybrid runs where the CPU layers' time goes. `--python`
profiles the same steps by Python function (cProfile, own time first): a native CPU kernel's time
counts as its ctypes caller's own, so kernels and the Python around them separate.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time
from collections import defaultdict

import torch

import llmx


def print_kernels(prof: torch.profiler.profile, runs: int, what: str, unit: str, top: int) -> None:
    """CUDA time per kernel name, per run, largest first."""
    per_name: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_name[ev.name] += ev.device_time_total
            counts[ev.name] += 1
    total = sum(per_name.values())
    print(f"{what}: {total / runs / 1000:.3f} ms of kernel time per {unit}, "
          f"{sum(counts.values()) / runs:.0f} kernels per {unit}")  # fmt: skip
    for name, us in sorted(per_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{us / runs:9.1f} us/{unit} {counts[name] / runs:6.1f} x  {name[:110]}")


HOST_AND_GPU = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def print_host_ops(prof: torch.profiler.profile, what: str, top: int) -> None:
    """Host time by operator, largest self time first."""
    print(f"host time of {what} by operator:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


def timed_prefills(engine, batch: list[int], runs: int = 8) -> None:
    """Wall time of `runs` prefills without the profiler, each with the time Python's cyclic
    garbage collector spent inside it: whether its full passes explain slow samples."""
    passes: list[tuple[int, float]] = []  # (generation, seconds) of each collection
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            passes.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(on_gc)
    try:
        for _ in range(runs):
            passes.clear()
            engine.reset()
            engine.synchronize()
            t0 = time.perf_counter()
            engine.prefill(batch)
            engine.synchronize()
            ms = (time.perf_counter() - t0) * 1000
            full = [s for gen, s in passes if gen == 2]
            print(
                f"prefill: {ms:.1f} ms ({len(batch) / ms * 1000:.0f} t/s); garbage collections "
                f"{len(passes)}, of which full {len(full)} taking {sum(full) * 1000:.1f} ms"
            )
    finally:
        gc.callbacks.remove(on_gc)


def decode_steps(engine, n: int) -> None:
    """n one-token decode steps, waited for."""
    for _ in range(n):
        engine.decode(1)
    engine.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-ngl", default="99")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--prefill", type=int, default=0, help="also profile one prefill of this many tokens")
    ap.add_argument("--host", action="store_true", help="also profile decode steps' host time by operator")
    ap.add_argument("--python", action="store_true", help="also profile decode steps by Python function")
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("-c", "--ctx-size", type=int, default=1024, help="context (at least --depth + --steps)")
    ap.add_argument("-ctk", "--cache-type-k", default="f16")
    ap.add_argument("-ctv", "--cache-type-v", default="f16")
    ap.add_argument("-fa", "--flash-attn", default="auto")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    model = llmx.load(
        args.model, n_gpu_layers=args.ngl, ctx_size=args.ctx_size, cache_type_k=args.cache_type_k,
        cache_type_v=args.cache_type_v, flash_attn=args.flash_attn,
    )  # fmt: skip
    engine, executor = model.engine, model.engine.executor
    prompt = list(range(1, args.depth + 1))

    executor.use_graphs = False
    engine.reset()
    engine.prefill(prompt)
    decode_steps(engine, 1)  # warm-up: compile and autotune outside the profile
    if torch.cuda.is_available():  # without a GPU (an all-CPU run here) only the host's side is seen
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            decode_steps(engine, args.steps)
        print_kernels(prof, args.steps, "eager decode", "token", args.top)

    if args.prefill:
        batch = list(range(1, args.prefill + 1))
        for _ in range(2):  # the first prefill of this length compiles and tunes; the second is kept
            engine.reset()
            engine.synchronize()
            t0 = time.perf_counter()
            with torch.profiler.profile(activities=HOST_AND_GPU) as prof:
                engine.prefill(batch)
                engine.synchronize()
            ms = (time.perf_counter() - t0) * 1000
        rate = args.prefill / ms * 1000
        print(f"prefill of {args.prefill} tokens: {ms:.1f} ms under the profiler ({rate:.0f} t/s)")
        print_kernels(prof, 1, f"prefill {args.prefill}", "prefill", args.top)
        print_host_ops(prof, "the prefill (what the GPU waits on when it is not busy)", args.top)
        timed_prefills(engine, batch)

    for graphs in (False, True):
        executor.use_graphs = graphs
        engine.reset()
        engine.prefill(prompt)
        decode_steps(engine, 1)
        t0 = time.perf_counter()
        decode_steps(engine, 64)
        ms = (time.perf_counter() - t0) / 64 * 1000
        print(f"decode step with graphs={graphs}: {ms:.3f} ms/token ({1000 / ms:.1f} t/s)")
    if args.host:  # the steps `llmx bench` times: GPU segments replayed from graphs, CPU ones eager
        with torch.profiler.profile(activities=HOST_AND_GPU) as prof:
            decode_steps(engine, args.steps)
        print_host_ops(prof, f"{args.steps} decode steps (graphs where they run)", args.top)
    if args.python:
        with cProfile.Profile() as py:
            decode_steps(engine, args.steps)
        print(f"host time of {args.steps} decode steps by Python function (own time first):")
        pstats.Stats(py).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
