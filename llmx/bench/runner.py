"""llama-bench's measurements on an llmx engine: timed prompt (pp) and generation (tg) tests.

A test runs `reps` times after warm-up runs that are not counted (`warmup_runs`: the first run pays
for kernel compilation, decode graph capture and cold caches; a prompt test has a second one, since
a prompt shape's first run is eager and its second captures the shape's CUDA graph, see
`llmx.runtime.executor`, so the timed runs replay it as every later prompt of that shape does).
Each repetition starts from a context of `n_depth` random tokens, then times either one prompt of
`n_prompt` random tokens or `n_gen` single-token decode steps fed random tokens, as llama-bench
does: the speed of a step does not depend on which token it is, and sampling is not part of the
measurement. The steps run as generation runs them (`generate_steps`, `Engine.continue_from`): each
one's token already on the device, its result (a token, not the logits) read by the host one step
late, while the next step runs; llama-bench waits for each step's logits instead, as llama.cpp's
generation, which samples on the host, does.

The depth is filled untimed once per test, and later repetitions rewind to it, where llama-bench
fills it again for each: at 32K tokens of depth the fills would be most of the run. A
rewound context's rows past the depth are written again before they are read; a sliding-window
layer's ring holds some of the last run's tokens in place of the depth's last ones, which changes
the values a step reads but not its work.

Beside the seconds, each repetition keeps the engine's counters for its timed part (`Timings`:
host time and CPU-segment time of decode steps, bytes op offload streamed for the prompt), and
`Counters` averages them over the repetitions for a result row.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from llmx.runtime.host_copy import HostCopy

if TYPE_CHECKING:
    from llmx.engine import Timings


class TimedEngine(Protocol):
    """What the benchmarks need from `llmx.engine.Engine`."""

    n_past: int
    timings: Timings

    def reset(self) -> None: ...
    def prefill(self, ids: list[int]) -> object: ...
    def decode(self, token: int | torch.Tensor, on_device: bool = False) -> torch.Tensor: ...
    def token_ids(self, ids: Sequence[int]) -> torch.Tensor: ...
    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class BenchTest:
    """One llama-bench test: a prompt of n_prompt tokens or n_gen generated ones, after n_depth."""

    n_prompt: int
    n_gen: int
    n_depth: int = 0

    @property
    def name(self) -> str:
        base = f"pp{self.n_prompt}" if self.n_prompt else f"tg{self.n_gen}"
        return f"{base} @ d{self.n_depth}" if self.n_depth else base

    @property
    def n_tokens(self) -> int:
        return self.n_prompt + self.n_gen

    @property
    def n_ctx(self) -> int:
        """The context the test needs."""
        return self.n_depth + self.n_tokens


def bench_tests(prompts: Sequence[int], gens: Sequence[int], depths: Sequence[int]) -> list[BenchTest]:
    """llama-bench's test list: for each depth, the pp tests then the tg tests (0 skips a kind)."""
    out = []
    for d in depths:
        out += [BenchTest(p, 0, d) for p in prompts if p > 0]
        out += [BenchTest(0, n, d) for n in gens if n > 0]
    return out


def random_tokens(rng: np.random.Generator, n: int, n_vocab: int) -> list[int]:
    return rng.integers(0, n_vocab, n).tolist()


@dataclass(frozen=True)
class Sample:
    """One timed repetition: its seconds and the engine's counters for the timed part only."""

    seconds: float
    timings: Timings


def time_once(
    engine: TimedEngine, test: BenchTest, rng: np.random.Generator, n_vocab: int, fill: bool = True
) -> Sample:
    """One repetition of `test`, from a context filled to its depth (untimed, uncounted) when `fill`,
    else from the filled context of the run before, rewound to the depth."""
    if fill:
        engine.reset()
        if test.n_depth:
            engine.prefill(random_tokens(rng, test.n_depth, n_vocab))
    else:
        engine.n_past = test.n_depth
    prompt = random_tokens(rng, test.n_prompt, n_vocab)
    tokens = random_tokens(rng, test.n_gen, n_vocab)
    engine.synchronize()
    before = copy.copy(engine.timings)
    t0 = time.perf_counter()
    if prompt:
        engine.prefill(prompt)
    generate_steps(engine, tokens)
    engine.synchronize()
    seconds = time.perf_counter() - t0
    return Sample(seconds, engine.timings.since(before))


def generate_steps(engine: TimedEngine, tokens: Sequence[int]) -> None:
    """One decode step for each of `tokens`, as `Engine.continue_from` runs generation's: the ids on
    the device that embeds them, each step's result (its greedy token, as a sampler on the device
    would leave it) read by the host after the next step is issued."""
    ids = engine.token_ids(tokens)
    late: HostCopy | None = None
    for i in range(len(tokens)):
        logits = engine.decode(ids[i : i + 1], on_device=True)
        now = HostCopy(logits.argmax(-1, keepdim=True))
        if late is not None:
            late.values()
        late = now


def warmup_runs(test: BenchTest) -> int:
    """Untimed runs before a test's repetitions (see the module docstring)."""
    return 2 if test.n_prompt else 1


def time_test(
    engine: TimedEngine,
    test: BenchTest,
    reps: int,
    n_vocab: int,
    seed: int = 0,
    tick: Callable[[], None] | None = None,
) -> list[Sample]:
    """Each of `reps` repetitions, after `warmup_runs(test)` uncounted ones."""
    rng = np.random.default_rng(seed)
    samples = []
    warmups = warmup_runs(test)
    for i in range(reps + warmups):
        sample = time_once(engine, test, rng, n_vocab, fill=i == 0)
        if i >= warmups:
            samples.append(sample)
        if tick:
            tick()
    return samples


@dataclass(frozen=True)
class Counters:
    """A test's engine counters, averaged over its repetitions (None where the test has none)."""

    host_ms_per_token: float | None  # decode steps: host time, CPU segments included
    cpu_ms_per_token: float | None  # decode steps: time in CPU segments (hybrid and CPU runs)
    cpu_bytes_per_token: float | None  # decode steps: weight and KV bytes the CPU segments read
    bytes_streamed: float  # prompt: CPU weight bytes op offload copied to a GPU, per repetition

    @property
    def cpu_gbs(self) -> float | None:
        if not self.cpu_ms_per_token or self.cpu_bytes_per_token is None:
            return None
        return self.cpu_bytes_per_token / self.cpu_ms_per_token / 1e6

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> Counters:
        ts = [s.timings for s in samples]
        tokens = sum(t.gen_tokens for t in ts)
        cpu_seconds = sum(t.gen_cpu_seconds for t in ts)

        def per_token(total: float, scale: float = 1.0) -> float | None:
            return scale * total / tokens if tokens else None

        return cls(
            host_ms_per_token=per_token(sum(t.gen_host_seconds for t in ts), 1000),
            cpu_ms_per_token=per_token(cpu_seconds, 1000) if cpu_seconds else None,
            cpu_bytes_per_token=per_token(sum(t.gen_cpu_bytes for t in ts)) if cpu_seconds else None,
            bytes_streamed=statistics.fmean(t.prompt_bytes_streamed for t in ts) if ts else 0.0,
        )


@dataclass(frozen=True)
class Speed:
    """A test's repetitions as llama-bench reports them: tokens/s per sample, mean and sample stddev."""

    n_tokens: int
    samples_s: tuple[float, ...]

    @property
    def samples_ts(self) -> list[float]:
        return [self.n_tokens / s for s in self.samples_s]

    @property
    def avg_ts(self) -> float:
        return statistics.fmean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        ts = self.samples_ts
        return statistics.stdev(ts) if len(ts) > 1 else 0.0

    @property
    def samples_ns(self) -> list[int]:
        return [round(s * 1e9) for s in self.samples_s]

    @property
    def avg_ns(self) -> float:
        return statistics.fmean(self.samples_ns)

    @property
    def stddev_ns(self) -> float:
        return statistics.stdev(self.samples_ns) if len(self.samples_s) > 1 else 0.0
