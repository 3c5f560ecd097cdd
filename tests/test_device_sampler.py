"""The device sampler against independent references: argmax, each filter's definition in numpy, the
filtered softmax (by chi-square over many seeds), the host sampler's penalties; each row's stream its
own (alone or batched, reproducible by seed); on a GPU, no host sync."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from llmx.text.device_sampler import DeviceSampler, draw, filtered, penalize
from llmx.text.sampler import SamplingParams, apply_penalties

CPU = torch.device("cpu")
V = 64


def random_logits(b: int, seed: int, n: int = V) -> torch.Tensor:
    return torch.randn(b, n, generator=torch.Generator().manual_seed(seed)) * 3


def sampler(rows: list[SamplingParams], history=(), n_vocab: int = V, device=CPU) -> DeviceSampler:
    s = DeviceSampler(len(rows), n_vocab, device)
    for r, p in enumerate(rows):
        s.start(r, p, history)
    return s


# --- greedy and the filters ---------------------------------------------------------------------------


def test_temperature_zero_is_the_argmax_whatever_the_filters():
    logits = random_logits(5, 0)
    logits[4, [3, 9]] = 100.0  # a tie: the first of equal maxima, as the host's greedy
    rows = [
        SamplingParams(temperature=t, top_k=k, seed=1) for t, k in [(0, 40), (0, 1), (-1, 0), (0, 5), (0, 40)]
    ]
    assert sampler(rows)(logits, range(5)).tolist() == [*logits[:4].argmax(-1).tolist(), 3]


def survivors_by_definition(logits: np.ndarray, k: int, p: float, min_p: float) -> set[int]:
    """Which ids may be drawn, straight from the definitions (float64): the k likeliest (k <= 0: all);
    of those, the shortest head whose probability (renormalized over them) reaches p; of those, the
    ones at least min_p times as likely as the best."""
    order = np.argsort(-logits, kind="stable")
    if 0 < k < len(logits):
        order = order[:k]
    probs = np.exp(logits[order] - logits[order].max())
    probs /= probs.sum()
    n = len(order) if p >= 1 else int(np.argmax(np.cumsum(probs) >= p)) + 1
    n = min(n, int((probs >= min_p * probs[0]).sum()))
    return set(order[:n].tolist())


FILTERS = [(40, 0.95, 0.05), (5, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.2), (10, 0.8, 0.1), (3, 0.3, 0.5),
           (0, 0.9, 0.0), (1, 1.0, 0.0), (0, 1.0, 0.0), (20, 0.99, 0.01)]  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_each_filter_keeps_the_tokens_its_definition_keeps(seed):
    logits = random_logits(len(FILTERS), seed)
    top_k = torch.tensor([k if k > 0 else V for k, _, _ in FILTERS])
    top_p = torch.tensor([p for _, p, _ in FILTERS])
    log_min_p = torch.tensor([math.log(m) if m > 0 else -math.inf for _, _, m in FILTERS])
    values, ids = filtered(logits, V, top_k, top_p, log_min_p)
    for row, (k, p, m) in enumerate(FILTERS):
        got = set(ids[row][values[row] > -math.inf].tolist())
        assert got == survivors_by_definition(logits[row].double().numpy(), k, p, m), (k, p, m)


def test_a_batch_with_top_k_everywhere_sorts_only_its_largest_k():
    """The candidates are the batch's largest top-k, and each row still keeps only its own."""
    logits = random_logits(3, 9) / 10  # flat: 100 draws see each of the top 7
    rows = [
        SamplingParams(top_k=k, top_p=1.0, min_p=0.0, temperature=1.0, seed=s)
        for k, s in [(2, 1), (7, 2), (1, 3)]
    ]
    s = sampler(rows)
    seen = [set() for _ in rows]
    for _ in range(100):
        for row, token in enumerate(s(logits, range(3)).tolist()):
            seen[row].add(token)
    for row, p in enumerate(rows):
        assert seen[row] == set(logits[row].topk(p.top_k).indices.tolist())


# --- the draw ------------------------------------------------------------------------------------------


LOGITS = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))


def chi_square(counts: Counter, expected: torch.Tensor, n: int) -> float:
    return sum((counts[i] - n * q) ** 2 / (n * q) for i, q in enumerate(expected.tolist()) if q > 0)


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"),
                         [(1.0, 0, 1.0, 0.0), (0.5, 0, 1.0, 0.0), (2.0, 4, 1.0, 0.0), (1.0, 0, 0.7, 0.0),
                          (1.5, 0, 1.0, 0.3)])  # fmt: skip
def test_draws_over_many_seeds_follow_the_filtered_tempered_softmax(temperature, top_k, top_p, min_p):
    """20000 rows, each its own seed, draw once: the frequencies are the softmax of the surviving logits
    over the temperature (chi-square under its mean + 6 standard deviations), and no filtered id comes."""
    n = 20000
    logits = LOGITS.expand(n, -1)
    k = torch.full((n,), top_k if top_k > 0 else len(LOGITS))
    values, ids = filtered(
        logits,
        len(LOGITS),
        k,
        torch.full((n,), top_p),
        torch.full((n,), math.log(min_p) if min_p else -math.inf),
    )
    seeds = torch.stack([torch.arange(n), torch.full((n,), 12345)], dim=1)
    counts = Counter(
        draw(values, ids, torch.full((n,), temperature), seeds, torch.zeros(n, dtype=torch.long)).tolist()
    )
    alive = sorted(survivors_by_definition(LOGITS.double().numpy(), top_k, top_p, min_p))
    expected = torch.zeros(len(LOGITS))
    expected[alive] = torch.softmax(LOGITS[alive] / temperature, dim=-1)
    assert set(counts) == set(alive)
    df = len(alive) - 1
    assert chi_square(counts, expected, n) < df + 6 * math.sqrt(2 * df), (counts, expected)


def test_one_rows_successive_draws_follow_the_softmax():
    """The stream of one row over 1000 draws (its draw counter moving on) has the right frequencies."""
    n, p = 1000, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=99)
    s = sampler([p], n_vocab=len(LOGITS))
    counts = Counter(int(s(LOGITS[None], [0])) for _ in range(n))
    expected = torch.softmax(LOGITS, dim=-1)
    tv = sum(abs(counts[i] / n - q) for i, q in enumerate(expected.tolist())) / 2
    assert tv < 0.05, counts


# --- rows: independence and seeds ---------------------------------------------------------------------


ROW = SamplingParams(
    temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repeat_penalty=1.2, repeat_last_n=4, seed=7
)
OTHERS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.3, top_k=0, seed=1),
    SamplingParams(temperature=0.7, top_p=0.5, frequency_penalty=0.3, seed=2),
    SamplingParams(temperature=1.0, top_k=3, repeat_last_n=-1, presence_penalty=1.0, seed=3),
]


def test_a_rows_tokens_are_the_same_alone_and_in_a_batch_of_five():
    s_alone = sampler([ROW], history=[5, 6, 7])
    s_batch = sampler([*OTHERS[:2], ROW, *OTHERS[2:]], history=[5, 6, 7])
    alone, batched = [], []
    for i in range(12):
        logits = random_logits(5, 100 + i)
        alone.append(int(s_alone(logits[2:3], [0])[0]))
        batched.append(int(s_batch(logits, range(5))[2]))
    assert alone == batched
    assert len(set(alone)) > 3  # it did sample, not repeat one token


def test_the_same_seed_gives_the_same_tokens_another_seed_others():
    def tokens(seed: int) -> list[int]:
        s = sampler([SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)], n_vocab=1000)
        logits = random_logits(1, 0, 1000)
        return [int(s(logits, [0])[0]) for _ in range(30)]

    assert tokens(42) == tokens(42)
    assert tokens(42) != tokens(43)
    assert tokens(-1) == tokens(2**64 - 1)  # the seed is taken modulo 2**64, as protocol allows both


# --- penalties ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("last_n", [-1, 0, 1, 3, 64])
def test_penalties_change_the_logits_as_the_hosts_over_a_sliding_window(last_n):
    """After the prompt and after each pushed id, the penalized logits equal the host sampler's over
    the last `last_n` ids of the whole history."""
    p = SamplingParams(temperature=0.0, repeat_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25,
                       repeat_last_n=last_n)  # fmt: skip
    history = [3, 1, 3, 3, 9, 1, 60]
    s = sampler([p], history=history)
    rng = np.random.default_rng(last_n + 2)
    for _ in range(8):
        logits = random_logits(1, int(rng.integers(1000)))
        recent = history if last_n == -1 else history[len(history) - last_n :] if last_n else []
        want = apply_penalties(logits[0], recent, p)
        got = penalize(logits, s.counts[:1], s.floats[:1, 3:])[0]
        assert torch.equal(got, want)
        forced = int(rng.choice([1, 3, 9, 20]))  # push an id of our choosing: a one-hot greedy pick
        one_hot = torch.full((1, V), -50.0)
        one_hot[0, forced] = 50.0
        assert int(s(one_hot, [0])[0]) == forced
        history.append(forced)


# --- on a GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_sampling_never_waits_for_the_host_and_matches_the_cpu():
    """With host syncs made errors, a batch is sampled and its rows started; the tokens are the CPU's
    (the stream is integer arithmetic; the filters see the same float32 logits)."""
    rows = [ROW, *OTHERS]
    cuda = sampler(rows, [5, 6, 7], 2000, torch.device("cuda"))
    cpu = sampler(rows, [5, 6, 7], 2000)
    logits = [random_logits(len(rows), 300 + i, 2000) for i in range(6)]
    cuda(logits[0].cuda(), range(5))  # first call outside: lazy CUDA initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [cuda(x.cuda(non_blocking=True), range(5)) for x in logits[1:]]
        cuda.start(1, SamplingParams(temperature=0.5, seed=8), [1, 2, 3])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = [cpu(x, range(5)) for x in logits]
    assert [g.tolist() for g in got] == [w.tolist() for w in want[1:]]
