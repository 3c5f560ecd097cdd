"""The GEMM's tile configuration for each problem, measured once per GPU and kept on disk.

A problem is (GPU, Triton version, type, layout, M bucket, N, K, x's dtype). The first time one is
met, every candidate of the GPU kind's tuning (`tuning.Tuning.gemm`) is timed, round by round (so
a clock change or a neighbour's burst touches them all alike), and the fastest is written to
`gemm-configs.json` in the cache directory; every later call, and every later process, reads the
same answer, so repeated runs of one prompt run the same kernels. Timing runs on the caller's
stream and needs no buffer of its own (`triton.testing.do_bench` allocates 256 MB to flush the L2,
a peak the planner would have to reserve on every GPU).

Under the interpreter, and with LLMX_TRITON_AUTOTUNE=0, one fixed configuration, nothing timed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from llmx import settings
from llmx.errors import LlmxError
from llmx.measured import remember, remembered
from llmx.quant.triton.launch import interpreting
from llmx.quant.triton.tuning import GemmConfig, for_device

CACHE_FILE = "gemm-configs.json"
UNTUNED = GemmConfig(64, 128, 64, 4, 4)  # LLMX_TRITON_AUTOTUNE=0: one compile per type (tests)
INTERPRETED = GemmConfig(16, 32, 64, 4, 1)  # the interpreter: small tiles keep it quick
WARMUP_RUNS = 2  # the first compiles
ROUNDS = 5  # each candidate timed once a round
RUNS_A_ROUND = 10  # launches between one pair of events

_chosen: dict[str, GemmConfig] = {}  # this process's answers, by `problem_key`


def problem_key(
    device: torch.device, qt: str, packed: bool, m_bucket: int, n: int, k: int, dtype: torch.dtype
) -> str:
    """The cache's key for one GEMM problem on `device`."""
    return f"{_machine(device)}|{qt}|{'split' if packed else 'gguf'}|M{m_bucket}|{n}x{k}|{dtype}"


@cache
def _machine(device: torch.device) -> str:
    """The GPU's name and the Triton version: what a measured pick holds for."""
    import triton

    return f"{torch.cuda.get_device_name(device)}|triton {triton.__version__}"


def gemm_config(
    device: torch.device,
    key: Callable[[], str],
    run: Callable[[GemmConfig], None],
) -> GemmConfig:
    """The configuration to run the problem `key()` with: fixed (interpreter, autotuning off), this
    process's or the disk's earlier answer, else the fastest of the candidates, each run by `run`."""
    if interpreting():
        return INTERPRETED
    if not _autotuning():
        return UNTUNED
    name = key()
    chosen = _chosen.get(name)
    if chosen is None:
        chosen = _chosen[name] = _remembered(name) or _measure(name, for_device(device).gemm, run)
    return chosen


@cache
def _autotuning() -> bool:
    return settings.triton_autotune()


def _remembered(name: str) -> GemmConfig | None:
    text = remembered(CACHE_FILE).get(name)
    return GemmConfig.parse(text) if isinstance(text, str) else None


def _measure(name: str, candidates: tuple[GemmConfig, ...], run: Callable[[GemmConfig], None]) -> GemmConfig:
    """The fastest candidate, each timed over ROUNDS x RUNS_A_ROUND launches (best round), then kept
    in the cache file beside the answers other processes left there."""
    best = fastest(candidates, run, _gpu_seconds, _unfit())
    remember(CACHE_FILE, name, str(best))
    return best


def fastest(
    candidates: tuple[GemmConfig, ...],
    run: Callable[[GemmConfig], None],
    seconds: Callable[[Callable[[], None]], float],
    unfit: tuple[type[Exception], ...] = (),
) -> GemmConfig:
    """The candidate whose best round of RUNS_A_ROUND runs took least (`seconds` times a round);
    rounds alternate over the candidates. Ties keep the earlier candidate. A candidate whose first
    run raises one of `unfit` (the GPU cannot hold its tiles: a float32 x doubles them) is left out."""
    fitting = []
    for cfg in candidates:
        try:
            for _ in range(WARMUP_RUNS):
                run(cfg)
        except unfit:
            continue
        fitting.append(cfg)
    if not fitting:
        raise LlmxError(f"no GEMM tile configuration fits this GPU; tried {', '.join(map(str, candidates))}")
    candidates = tuple(fitting)
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(ROUNDS):
        for cfg in candidates:
            best[cfg] = min(best[cfg], seconds(lambda c=cfg: [run(c) for _ in range(RUNS_A_ROUND)]))
    return min(candidates, key=lambda c: best[c])


def _unfit() -> tuple[type[Exception], ...]:
    """What Triton raises for a configuration this GPU cannot run (too much shared memory)."""
    from triton.runtime.errors import OutOfResources

    return (OutOfResources,)


def _gpu_seconds(fn: Callable[[], None]) -> float:
    """GPU time of `fn`'s launches, between two events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
