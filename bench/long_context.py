"""A long prompt on the CPU: prefill time per -ub chunk as the cache fills, and the process's peak memory.

    python bench/long_context.py [--shape smollm2-135m] [--layers 2] [--type Q8_0] [-c 32768] [-ub 512]
                                 [-t THREADS] [-fa auto|off] [-amb MiB]

Writes a synthetic model of `--shape` cut to `--layers` layers (`llmx synth`'s writer) in a temporary
folder, loads it with -c and -ub, prefills a random prompt of the whole context, and prints a table
of every eighth ubatch: depth, ms for the ubatch, prompt tokens/s. The peak resident memory (VmHWM)
against the plan's KV and compute bytes shows that no [tokens x context] score matrix was held (with
-fa auto; -fa off stores them, a chunk of heads at a time under -amb). Too slow for the test suite at
32K; tests/test_long_context.py runs 8K.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import llmx
from llmx.bench.synth import synthesize


def vm_hwm() -> int:
    """The process's peak resident bytes so far."""
    line = next(s for s in Path("/proc/self/status").read_text().splitlines() if s.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--type", default="Q8_0")
    ap.add_argument("-c", "--ctx-size", type=int, default=32768)
    ap.add_argument("-ub", "--ubatch-size", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-fa", "--flash-attn", default="auto")
    ap.add_argument("-amb", "--attention-max-batch", type=int, default=0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.gguf"
        synthesize(a.shape, a.type, path, n_layer=a.layers, progress=False)
        model = llmx.load(path, ctx_size=a.ctx_size, ubatch_size=a.ubatch_size, threads=a.threads,
                          flash_attn=a.flash_attn, attn_max_batch=a.attention_max_batch)  # fmt: skip
        cpu = model.plan.device_use("cpu")
        ids = np.random.default_rng(0).integers(0, model.config.n_vocab, a.ctx_size).tolist()
        base = vm_hwm()
        print(f"{a.shape} x{a.layers} {a.type}, -c {a.ctx_size} -ub {a.ubatch_size} -t {a.threads} "
              f"-fa {a.flash_attn} -amb {a.attention_max_batch}")  # fmt: skip
        print("| depth | ms/ubatch | t/s |\n| ---: | ---: | ---: |")
        t_start = time.perf_counter()
        for i, lo in enumerate(range(0, a.ctx_size, a.ubatch_size)):
            t0 = time.perf_counter()
            model.engine.prefill(ids[lo : lo + a.ubatch_size])  # one ubatch, continuing the sequence
            ms = 1000 * (time.perf_counter() - t0)
            if i % 8 == 0 or lo + a.ubatch_size >= a.ctx_size:
                print(f"| {lo} | {ms:.0f} | {a.ubatch_size / ms * 1000:.0f} |")
        total = time.perf_counter() - t_start
        print(f"prefill of {a.ctx_size} tokens: {total:.1f} s, {a.ctx_size / total:.0f} t/s")
        print(f"peak memory added during the prefill {(vm_hwm() - base) / 2**20:.0f} MiB; planned: "
              f"KV {cpu.kv / 2**20:.0f} MiB, compute {cpu.compute / 2**20:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
