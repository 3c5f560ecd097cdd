"""Sampler tests on hand-made logits: each filter's effect, llama.cpp's penalty rule, seeds, statistics."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from llmx.errors import LlmxError
from llmx.text.sampler import Sampler, SamplingParams, apply_penalties, min_p_count, top_p_count

# Probabilities 0.5, 0.3, 0.15, 0.05 as logits (the log of each).
PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor([math.log(q) for q in PROBS])
ALL_ON = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}  # every filter off: plain temperature sampling


def draws(params: SamplingParams, logits: torch.Tensor, n: int, history=()) -> Counter:
    sampler = Sampler(params)
    return Counter(sampler(logits, history) for _ in range(n))


# --- greedy and penalties ----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_temperature_zero_or_below_is_greedy(temperature):
    logits = torch.tensor([0.1, 2.0, 1.9, -3.0])
    assert {Sampler(SamplingParams(temperature=temperature))(logits) for _ in range(20)} == {1}


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.0])
    out = apply_penalties(logits, [0, 1, 1], SamplingParams(repeat_penalty=2.0))
    assert out.tolist() == [1.0, -4.0, 1.0, 0.0]  # both seen tokens less likely, however often seen
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.0]  # the caller's tensor is untouched


def test_frequency_counts_occurrences_presence_counts_once():
    logits = torch.zeros(3)
    out = apply_penalties(logits, [0, 0, 0, 1], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    assert out.tolist() == [-1.75, -0.75, 0.0]


def test_penalties_look_only_at_the_last_n_ids():
    # Token 1 leads by a little; penalized (1.05 / 1.5 = 0.7) it falls behind token 0.
    logits = torch.tensor([1.0, 1.05, -5.0])

    def pick(last_n: int, history: list[int]) -> int:
        return Sampler(SamplingParams(temperature=0, repeat_penalty=1.5, repeat_last_n=last_n))(
            logits, history
        )

    assert pick(2, [1, 2, 2]) == 1  # token 1 is outside the window of 2
    assert pick(2, [2, 2, 1]) == 0
    assert pick(0, [1]) == 1  # 0 turns the penalties off
    assert pick(-1, [1] + [2] * 99) == 0  # -1 looks at the whole history


# --- the filters ---------------------------------------------------------------------------------------


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert top_p_count(LOGITS, 0.45) == 1
    assert top_p_count(LOGITS, 0.75) == 2  # 0.5 + 0.3 reaches 0.75
    assert top_p_count(LOGITS, 0.85) == 3
    assert top_p_count(LOGITS, 1.0) == 4


def test_min_p_keeps_tokens_at_least_p_times_the_best():
    assert min_p_count(LOGITS, 0.2) == 3  # 0.15 >= 0.2 * 0.5, 0.05 is not
    assert min_p_count(LOGITS, 0.9) == 1
    assert min_p_count(LOGITS, 0.0) == 4


@pytest.mark.parametrize(
    ("params", "support"),
    [
        ({"top_k": 2, "top_p": 1.0, "min_p": 0.0}, {0, 1}),
        ({"top_k": 0, "top_p": 0.75, "min_p": 0.0}, {0, 1}),
        ({"top_k": 0, "top_p": 1.0, "min_p": 0.2}, {0, 1, 2}),
        ({"top_k": 3, "top_p": 0.82, "min_p": 0.0}, {0, 1}),  # over the top 3: 0.53 + 0.32 >= 0.82
        (ALL_ON, {0, 1, 2, 3}),
    ],
)
def test_filters_limit_what_can_be_drawn(params, support):
    # 1000 draws at temperature 1 see every allowed token (the rarest, p >= 0.05, is missed with
    # probability 0.95**1000, about 5e-23) and never a filtered one.
    assert set(draws(SamplingParams(temperature=1.0, seed=1, **params), LOGITS, 1000)) == support


@pytest.mark.parametrize(
    ("params", "support"),
    [
        ({"top_p": 0.75, "min_p": 0.0}, {0, 1}),
        ({"top_p": 0.85, "min_p": 0.0}, {0, 1, 2}),
        ({"min_p": 0.2}, {0, 1, 2}),
    ],
)
def test_without_top_k_a_large_vocabulary_keeps_the_same_tokens(params, support):
    # 5000 more tokens of negligible probability: the shortcut that avoids sorting the whole
    # vocabulary must keep exactly what sorting it would.
    logits = torch.cat([LOGITS, torch.full((5000,), -30.0)])
    assert set(draws(SamplingParams(temperature=1.0, top_k=0, seed=2, **params), logits, 1000)) == support


def test_filters_see_the_untempered_distribution():
    # llama.cpp applies temperature last: a high temperature flattens the draw but does not let
    # top-p admit more tokens than it would at temperature 1.
    hot = SamplingParams(temperature=5.0, top_k=0, top_p=0.75, min_p=0.0, seed=3)
    assert set(draws(hot, LOGITS, 2000)) == {0, 1}


# --- distribution and reproducibility ---------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_the_tempered_softmax(temperature):
    # Expected frequencies: softmax(logits / T). With n = 20000 a frequency's standard deviation is at
    # most sqrt(0.25 / n) = 0.0035, so 0.015 is over 4 sigma; the seed makes the check deterministic.
    n = 20000
    counts = draws(SamplingParams(temperature=temperature, seed=7, **ALL_ON), LOGITS, n)
    expected = torch.softmax(LOGITS / temperature, dim=-1).tolist()
    for token, q in enumerate(expected):
        assert abs(counts[token] / n - q) < 0.015, (token, counts[token] / n, q)


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    a = Sampler(SamplingParams(temperature=1.0, seed=42, **ALL_ON))
    b = Sampler(SamplingParams(temperature=1.0, seed=42, **ALL_ON))
    c = Sampler(SamplingParams(temperature=1.0, seed=43, **ALL_ON))
    run_a, run_b, run_c = ([s(logits) for _ in range(50)] for s in (a, b, c))
    assert run_a == run_b
    assert run_a != run_c  # 50 draws from ~1000 tokens: equal by chance with negligible probability


def test_default_params_are_llama_cpp_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n) == (
        0.8,
        40,
        0.95,
        0.05,
        1.0,
        64,
    )
    assert (p.presence_penalty, p.frequency_penalty, p.seed) == (0.0, 0.0, None)


@pytest.mark.parametrize(
    "bad",
    [{"top_p": 0.0}, {"top_p": 1.5}, {"min_p": -0.1}, {"repeat_penalty": 0.0}, {"repeat_last_n": -2}],
)
def test_bad_values_are_user_errors(bad):
    with pytest.raises(LlmxError):
        SamplingParams(**bad)
