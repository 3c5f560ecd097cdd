"""`llmx bench-serve`'s pure parts: its statistics and workload by hand, its check failing when a text
differs."""

from __future__ import annotations

import math
import random

import pytest

from llmx.bench.serve_check import first_difference, mismatches
from llmx.bench.serve_stats import Streamed, distribution, summary
from llmx.bench.serve_workload import WORDS, arrival_times, workload

# --- statistics, by hand ---


def test_distribution_is_in_milliseconds_with_linear_percentiles():
    d = distribution([0.1, 0.2, 0.3, 0.4])
    # p99: rank 0.99 * 3 = 2.97, between 300 and 400 ms
    assert d == pytest.approx({"mean": 250.0, "median": 250.0, "p99": 397.0})
    assert distribution([]) == {"mean": None, "median": None, "p99": None}


def test_summary_of_two_streams():
    a = Streamed(sent=0.0, chunks=(0.5, 0.6, 0.8), done=0.9, prompt_tokens=16, output_tokens=3, text="abc")
    b = Streamed(sent=0.2, chunks=(1.0, 1.4), done=1.8, prompt_tokens=16, output_tokens=2, text="de")
    empty = Streamed(sent=0.3, chunks=(), done=0.4, prompt_tokens=16, output_tokens=1, text="")
    s = summary([a, b, empty], duration_s=2.0)
    assert s["requests"] == 3 and s["prompt_tokens"] == 48 and s["output_tokens"] == 6
    assert (s["requests_per_s"], s["output_tokens_per_s"], s["total_tokens_per_s"]) == (1.5, 3.0, 27.0)
    assert s["ttft_ms"] == pytest.approx({"mean": 750.0, "median": 750.0, "p99": 995.0})
    # gaps 100, 200, 400 ms
    assert s["itl_ms"] == pytest.approx({"mean": 700 / 3, "median": 200.0, "p99": 396.0})
    assert s["e2e_ms"]["median"] == pytest.approx(900.0)


# --- the workload ---


def test_arrivals_are_a_seeded_poisson_process_or_all_at_once():
    assert arrival_times(3, math.inf, random.Random(0)) == (0.0, 0.0, 0.0)
    times = arrival_times(4000, 8.0, random.Random(1))
    gaps = [b - a for a, b in zip((0.0, *times), times, strict=False)]
    assert min(gaps) > 0 and sum(gaps) / len(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert arrival_times(4000, 8.0, random.Random(1)) == times


def test_workload_is_reproducible_and_cycles_its_prompts():
    w = workload(WORDS, 5, 7, 3, 2.0, seed=4)
    assert w == workload(WORDS, 5, 7, 3, 2.0, seed=4)
    assert w.prompts != workload(WORDS, 5, 7, 3, 2.0, seed=5).prompts
    assert w.prompts == workload(WORDS, 5, 7, 3, math.inf, seed=4).prompts  # the rate leaves the prompts
    assert w.prompt_of == (0, 1, 2, 0, 1, 2, 0) and len(w.arrivals) == 7
    assert all(p.startswith(" ") and len(p.split()) == 5 and set(p.split()) <= set(WORDS) for p in w.prompts)


# --- the check fails when a text differs ---


def test_first_difference():
    assert first_difference("abc", "abc") is None
    assert first_difference("abc", "abd") == 2
    assert first_difference("ab", "abc") == 2 and first_difference("", "x") == 0


def test_a_response_other_than_the_one_alone_is_a_mismatch():
    alone = ["The cat sat", "Once upon"]
    assert mismatches(["The cat sat", "Once upon", "The cat sat"], [0, 1, 0], alone) == []
    (wrong,) = mismatches(["The cat sat", "Once upon", "The cap sat"], [0, 1, 0], alone)
    assert (wrong.request, wrong.position) == (2, 6)
    assert "request 2" in wrong.line() and "'p sat' against 't sat'" in wrong.line()
