"""Flags and output the commands share: `-m/--model` for every command, sampling flags, timings.

Imports nothing heavy at module level, so `llmx plan` (which must not import torch) can use it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from llmx.errors import LlmxError

if TYPE_CHECKING:
    from llmx.engine import Timings

DEFAULT_MODEL = "the embedded SmolLM2-135M-Instruct"


def add_model_argument(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """-m/--model FILE: the GGUF to use (default: the embedded SmolLM2); with `several`, repeatable
    and collected into a list."""
    if several:
        extra = {"action": "append", "help": f"GGUF file; repeat for several (default: {DEFAULT_MODEL})"}
    else:
        extra = {"help": f"GGUF file (default: {DEFAULT_MODEL})"}
    parser.add_argument("-m", "--model", type=Path, default=None, metavar="FILE", **extra)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling (llama.cpp names)")
    g.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    g.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--repeat-last-n", type=int, default=64)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("-s", "--seed", type=int, default=None, help="RNG seed for a reproducible run")


def sampling_from_args(args: argparse.Namespace) -> dict:
    """The sampling keywords of `LoadedModel.stream`, checked here (a bad value is one LlmxError
    line), so that commands can call this before the model loads."""
    from llmx.text.sampler import SamplingParams

    sampling = dict(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        repeat_last_n=args.repeat_last_n,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )
    SamplingParams(**sampling)
    return sampling


def read_prompt(args: argparse.Namespace) -> str:
    """-p TEXT or -f FILE (one of them)."""
    if getattr(args, "file", None) is not None:
        try:
            return Path(args.file).read_text(encoding="utf-8")
        except OSError as e:
            raise LlmxError(f"cannot read prompt file {args.file}: {e.strerror}") from None
    if args.prompt is None:
        raise LlmxError("no prompt: pass -p TEXT or -f FILE")
    return args.prompt


def print_timings(load_seconds: float, t: Timings, file=None) -> None:
    """The end-of-run summary in llama.cpp's shape (on stderr unless `file` is given), then llmx's
    own lines: the host time of decode steps, the CPU segments' time and bandwidth (beside the RAM
    bandwidth `llmx bench --ceilings` measured, when cached), and the bytes op offload streamed."""
    file = file or sys.stderr

    def line(label: str, seconds: float, n: int) -> str:
        per = seconds * 1000 / n if n else 0.0
        tps = n / seconds if seconds else 0.0
        return (
            f"llmx: {label:>16} = {seconds * 1000:10.2f} ms / {n:5d} tokens "
            f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)"
        )

    print(f"\nllmx: {'load time':>16} = {load_seconds * 1000:10.2f} ms", file=file)
    print(line("prompt eval time", t.prompt_seconds, t.prompt_tokens), file=file)
    print(line("eval time", t.gen_seconds, t.gen_tokens), file=file)
    if t.gen_tokens:
        share = t.gen_host_seconds / t.gen_seconds if t.gen_seconds else 0.0
        print(
            f"llmx: {'host time':>16} = {t.gen_host_seconds * 1000:10.2f} ms / {t.gen_tokens:5d} tokens "
            f"({t.host_ms_per_token:8.2f} ms per token, {share:6.1%} of eval time)",
            file=file,
        )
    if t.gen_cpu_seconds:
        ram = _ram_gbs()
        vs = f", {t.cpu_gbs / ram:.0%} of {ram:.1f} GB/s RAM" if ram else ""
        print(
            f"llmx: {'cpu segments':>16} = {t.gen_cpu_seconds * 1000:10.2f} ms / {t.gen_tokens:5d} tokens "
            f"({t.cpu_ms_per_token:8.2f} ms per token, {t.cpu_gbs:8.2f} GB/s{vs})",
            file=file,
        )
    if t.prompt_bytes_streamed:
        print(
            f"llmx: {'prompt streamed':>16} = {t.prompt_bytes_streamed / 2**20:10.2f} MiB of CPU weights "
            "to the GPU (op offload)",
            file=file,
        )


def _ram_gbs() -> float | None:
    """This CPU's measured RAM bandwidth at the current thread count, if `llmx bench` cached it."""
    from llmx.bench.ceilings import device_key, load_cache

    ceiling = load_cache().get(device_key("cpu"))
    return ceiling.mem_gbs if ceiling else None


def print_load_report(model, file=None) -> None:
    """Where the weights went and how fast they got there: bytes and seconds per device, GB/s of GPU
    uploads beside the pinned host-to-device ceiling when `llmx bench --ceilings` has measured it,
    how CPU weights were prepared, and llama.cpp's `offloaded N/M layers to GPU` line."""
    from llmx.bench.ceilings import device_key, load_cache

    file = file or sys.stderr
    report, cached = model.report, load_cache()
    for device, nbytes in report.bytes_per_device.items():
        seconds = report.upload_seconds.get(device, 0.0)
        if device == "cpu":
            how = "read into memory" if model.options.no_mmap else "mapped, zero-copy"
            print(f"llmx: load {device:8s} {nbytes / 2**30:7.3f} GiB {how}", file=file)
            continue
        rate = nbytes / seconds / 1e9 if seconds else 0.0
        ceiling = cached.get(device_key(device))
        vs = (
            f" ({rate / ceiling.h2d_pinned_gbs:.0%} of pinned H2D)"
            if ceiling and ceiling.h2d_pinned_gbs
            else ""
        )
        print(
            f"llmx: load {device:8s} {nbytes / 2**30:7.3f} GiB in {seconds:.2f} s = {rate:.1f} GB/s{vs}",
            file=file,
        )
    for fmt, count in sorted(report.cpu_formats.items()):
        print(f"llmx: cpu weights {count:4d} x {fmt}", file=file)
    print(f"llmx: {model.plan.offloaded_line}", file=file)
    if model.warm_up:
        w = model.warm_up
        what = (
            f"{w.compiled} kernels compiled, kept in {w.cache_folder} for later runs"
            if w.compiled
            else "kernels from the cache of an earlier run"
        )
        print(f"llmx: warm-up {w.seconds:.2f} s ({what}; the decode graph captured)", file=file)
