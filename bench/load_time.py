"""Model load time against its floor: reading the file from disk, then the bytes over pinned H2D.

    python bench/load_time.py MODEL.gguf [MODEL.gguf ...] [-ngl 99]

For each file: the cold disk read rate (page cache dropped, then the file read in 16 MiB pieces),
the pinned host-to-device rate (`llmx.bench.ceilings`), the floor = file / disk + GPU bytes / H2D,
and `llmx.load` timed cold (page cache dropped again) and warm (file cached), less its warm-up (the
kernels of every kind of step run once, shown apart: it is compute, not loading). Dropping the page
cache needs root; without it the "cold" rows are marked as cached. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

import torch

import llmx
from llmx.bench.ceilings import measure_cuda


def drop_page_cache() -> bool:
    """Whether the kernel's page cache could be dropped (root only)."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_gbs(path: Path) -> float:
    """GB/s of one sequential read of the file."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass
    return path.stat().st_size / (time.perf_counter() - t0) / 1e9


def load_seconds(path: Path, ngl: str) -> tuple[float, float, int]:
    """Seconds of `llmx.load` to weights resident and the arena filled (its warm-up left out), the
    warm-up's seconds, and the bytes put on GPUs."""
    t0 = time.perf_counter()
    model = llmx.load(str(path), n_gpu_layers=ngl, ctx_size=512)
    torch.cuda.synchronize()
    warm_up = model.warm_up.seconds if model.warm_up else 0.0
    seconds = time.perf_counter() - t0 - warm_up
    gpu_bytes = sum(n for dev, n in model.report.bytes_per_device.items() if dev != "cpu")
    del model
    torch.cuda.empty_cache()
    return seconds, warm_up, gpu_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("-ngl", default="99")
    args = ap.parse_args()
    h2d = measure_cuda("cuda:0").h2d_pinned_gbs
    print(f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs; pinned H2D {h2d:.1f} GB/s\n")
    print("| file | GiB | disk read GB/s | floor s | load s, cold | x floor | load s, cached | warm-up s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in args.models:
        cold = drop_page_cache()
        disk = read_gbs(path)
        load_seconds(path, args.ngl)  # compile and warm the allocator once, outside the timing
        drop_page_cache()
        t_cold, _, gpu_bytes = load_seconds(path, args.ngl)
        t_warm, warm_up, _ = load_seconds(path, args.ngl)
        floor = path.stat().st_size / disk / 1e9 + gpu_bytes / h2d / 1e9
        note = "" if cold else " (page cache not dropped)"
        print(
            f"| {path.name} | {path.stat().st_size / 2**30:.2f} | {disk:.2f}{note} | {floor:.2f} | "
            f"{t_cold:.2f} | {t_cold / floor:.2f} | {t_warm:.2f} | {warm_up:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
