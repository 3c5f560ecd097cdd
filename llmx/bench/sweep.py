"""llama-sweep-bench's measurement: speed window by window as the context fills.

For each `ubatch`-sized window (N_KV = 0, ub, 2 ub, ... while a window still fits in the context):
generate `n_gen` tokens at N_KV and time them, drop them from the cache again, then process one
ubatch of random prompt tokens and time it. Each row shows how speed depends on the context
length instead of averaging over it (ik_llama.cpp examples/sweep-bench). Memory columns (host RSS,
bytes allocated per GPU) show the cache growing with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import psutil
import torch

from llmx.bench.runner import TimedEngine, generate_steps, random_tokens
from llmx.errors import LlmxError


def memory_now() -> dict[str, Any]:
    """Host resident set size and, per visible GPU, the bytes torch has allocated."""
    gpus = {f"cuda:{i}": torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())}
    return {"rss_bytes": psutil.Process().memory_info().rss, "gpu_allocated": gpus}


def sweep(
    engine: TimedEngine,
    n_ctx: int,
    n_ubatch: int,
    n_gen: int,
    n_vocab: int,
    seed: int = 0,
) -> Iterator[dict[str, Any]]:
    """Rows in ik_llama.cpp's field names (pp, tg, n_kv, t_pp, speed_pp, t_tg, speed_tg) plus memory."""
    if n_ubatch > n_ctx or n_gen > n_ubatch:
        raise LlmxError(f"sweep-bench needs -n ({n_gen}) <= -ub ({n_ubatch}) <= -c ({n_ctx})")
    rng = np.random.default_rng(seed)
    # Warm-up, not reported: the first decode and the first full ubatch compile and capture.
    engine.reset()
    engine.decode(0)
    engine.reset()  # a full-context ubatch must still fit
    engine.prefill(random_tokens(rng, n_ubatch, n_vocab))
    engine.reset()
    for n_kv in range(0, n_ctx - n_ubatch + 1, n_ubatch):
        t_tg = _timed(engine, lambda: generate_steps(engine, random_tokens(rng, n_gen, n_vocab)))
        engine.n_past = n_kv  # forget the generated tokens: the next window starts where this one did
        t_pp = _timed(engine, lambda: engine.prefill(random_tokens(rng, n_ubatch, n_vocab)))
        yield {
            "pp": n_ubatch, "tg": n_gen, "n_kv": n_kv,
            "t_pp": t_pp, "speed_pp": n_ubatch / t_pp,
            "t_tg": t_tg, "speed_tg": n_gen / t_tg if n_gen else 0.0,
            **memory_now(),
        }  # fmt: skip


def _timed(engine: TimedEngine, work: Callable[[], object]) -> float:
    engine.synchronize()
    t0 = time.perf_counter()
    work()
    engine.synchronize()
    return time.perf_counter() - t0
