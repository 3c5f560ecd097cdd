"""The figures of a `llmx bench-serve` run, from each streamed request's timings: throughput, time to
first token (TTFT), inter-token latency (ITL) and end-to-end latency, as vLLM's serving benchmark
reports them. Pure: times in, numbers out.

ITL is the gap between consecutive streamed chunks that carry text: a server sends one chunk a token,
except that a token ending inside a UTF-8 character or a possible stop string comes with the next. TPOT
(time per output token) counts tokens instead, a request's time after its first token over the tokens
after it, so replies whose chunks hold several tokens (random weights' broken characters) read right.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PERCENTILES = (50, 99)


@dataclass(frozen=True)
class Streamed:
    """One streamed request: its timings, token counts, text and tokens. Times are seconds, `sent` from
    the run's start and the others from `sent`."""

    sent: float
    chunks: tuple[float, ...]  # when each chunk with text arrived
    done: float  # when the stream ended
    prompt_tokens: int
    output_tokens: int
    text: str
    ids: tuple[int, ...] = ()  # its tokens, where the server returns them (`return_tokens`)
    tops: tuple[tuple[float, ...], ...] = ()  # each token's likeliest logprobs, best first, where asked


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean, median and p99 of `values_s` (seconds), in milliseconds; None where there are no values.
    Percentiles interpolate linearly between the nearest two ranks (numpy's default)."""
    if not values_s:
        return {"mean": None, "median": None, "p99": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1000
    median, p99 = np.percentile(ms, PERCENTILES)
    return {"mean": float(ms.mean()), "median": float(median), "p99": float(p99)}


def summary(timings: Sequence[Streamed], duration_s: float) -> dict[str, Any]:
    """The run's figures; `duration_s`: from the run's start to the end of its last stream."""
    output = sum(t.output_tokens for t in timings)
    prompt = sum(t.prompt_tokens for t in timings)
    return {
        "requests": len(timings),
        "duration_s": duration_s,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "requests_per_s": len(timings) / duration_s,
        "output_tokens_per_s": output / duration_s,
        "total_tokens_per_s": (prompt + output) / duration_s,
        "ttft_ms": distribution([t.chunks[0] for t in timings if t.chunks]),
        "tpot_ms": distribution(
            [
                (t.done - t.chunks[0]) / (t.output_tokens - 1)
                for t in timings
                if t.chunks and t.output_tokens > 1
            ]
        ),
        "itl_ms": distribution(
            [b - a for t in timings for a, b in zip(t.chunks, t.chunks[1:], strict=False)]
        ),
        "e2e_ms": distribution([t.done for t in timings]),
    }
