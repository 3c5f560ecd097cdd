"""Sampling: the next token id from a step's logits, with llama.cpp's samplers and their order.

`Sampler(params)(logits, history)` runs llama.cpp's default chain (common/sampling.cpp):

1. penalties over the last `repeat_last_n` ids of `history` (the prompt counts, as in llama.cpp):
   a repeated token's logit is divided by `repeat_penalty` when positive and multiplied when
   negative, then lowered by `frequency_penalty` per occurrence and `presence_penalty` once;
2. `temperature <= 0`: greedy, the argmax of the penalized logits;
3. top-k, then top-p (the smallest set of most likely tokens whose probability reaches `top_p`,
   renormalized over the top-k), then min-p (tokens at least `min_p` times as likely as the best);
   all three on the untempered distribution, because llama.cpp applies temperature after them;
4. temperature, softmax, and one draw with a `torch.Generator` seeded with `seed`.

Each filter keeps a prefix of the candidates sorted by logit, so after top-k the rest works on k
values, not the whole vocabulary.

Generation samples on the model's device with the same chain (`text.device_sampler`); this host
sampler serves what needs each step's logits on the host: grammar masks and logprobs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmx.errors import LlmxError
from llmx.quant import cpu_native


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's sampling options and defaults; `top_k <= 0`, `top_p >= 1`, `min_p <= 0` switch a
    filter off, `repeat_last_n` = -1 looks at the whole history, 0 disables the penalties."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise LlmxError(f"--top-p {self.top_p} is outside (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise LlmxError(f"--min-p {self.min_p} is outside [0, 1]")
        if self.repeat_penalty <= 0.0:
            raise LlmxError(f"--repeat-penalty {self.repeat_penalty} must be positive (1.0 = off)")
        if self.repeat_last_n < -1:
            raise LlmxError(
                f"--repeat-last-n {self.repeat_last_n}: use -1 (whole context), 0 (off) or a count"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def apply_penalties(logits: torch.Tensor, recent: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """`logits` [vocab] with the repetition, frequency and presence penalties for `recent` applied."""
    off = params.repeat_penalty == 1.0 and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0
    if off or not recent:
        return logits
    counts = Counter(recent)
    ids = torch.tensor(list(counts), dtype=torch.long)
    n = torch.tensor(list(counts.values()), dtype=logits.dtype)
    seen = logits[ids]
    # Dividing a negative logit would make the token more likely, hence the two cases.
    seen = torch.where(seen > 0, seen / params.repeat_penalty, seen * params.repeat_penalty)
    seen = seen - n * params.frequency_penalty - params.presence_penalty
    out = logits.clone()
    out[ids] = seen
    return out


def top_p_count(sorted_logits: torch.Tensor, p: float, log_total: torch.Tensor | None = None) -> int:
    """How many of the descending `sorted_logits` top-p keeps: up to and including the token whose
    cumulative probability first reaches `p`. Probabilities are normalized by `log_total` (the
    logsumexp of the distribution top-p sees) when the candidates are only its head; all of them
    are kept if that head's mass stays under `p`."""
    if p >= 1.0:
        return len(sorted_logits)
    if log_total is None:
        log_total = torch.logsumexp(sorted_logits, dim=-1)
    cumulative = torch.exp(sorted_logits - log_total).cumsum(dim=-1)
    reached = int(torch.searchsorted(cumulative, torch.tensor([p], dtype=cumulative.dtype)).item())
    return min(reached + 1, len(sorted_logits))  # rounding may leave the total a hair under p


def min_p_count(sorted_logits: torch.Tensor, p: float) -> int:
    """How many of the descending `sorted_logits` are at least `p` times as likely as the first."""
    if p <= 0.0:
        return len(sorted_logits)
    threshold = sorted_logits[0] + math.log(p)
    return max(1, int((sorted_logits >= threshold).sum().item()))


class Sampler:
    """Picks token ids with `params`; one generator per sampler, so a seeded run is reproducible."""

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.params = params or SamplingParams()
        self._generator = torch.Generator()
        if self.params.seed is None:
            self._generator.seed()  # a fresh random seed, like llama.cpp's default
        else:
            self._generator.manual_seed(self.params.seed)

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """The next id after `history` given `logits` (float, [vocab], on the CPU)."""
        p = self.params
        logits = apply_penalties(logits.float(), _recent(history, p.repeat_last_n), p)
        if p.greedy:  # the first of equal maxima, as torch.argmax
            return int(top_k(logits, 1)[1][0])
        if 0 < p.top_k < len(logits):
            values, ids = top_k(logits, p.top_k)
            log_total = torch.logsumexp(values, dim=-1)  # top-p renormalizes over the top k
        else:
            log_total = torch.logsumexp(logits, dim=-1)
            values, ids = _head(logits, p, log_total)
        keep = min(top_p_count(values, p.top_p, log_total), min_p_count(values, p.min_p))
        probs = torch.softmax(values[:keep] / p.temperature, dim=-1)
        return int(ids[_draw(probs, self._generator)].item())


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(logits, k)` for CPU float32 logits [vocab], 1 <= k <= vocab: the native one-pass
    kernel where it is built (of equal logits the lower id first)."""
    if logits.dtype == torch.float32 and logits.is_contiguous() and cpu_native.available():
        return cpu_native.top_k(logits, k)
    return torch.topk(logits, k)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn with probabilities `probs`, by inverting the cumulative sum at a uniform
    draw (exact, and several times faster than torch.multinomial over a 262k vocabulary)."""
    cdf = probs.cumsum(dim=-1)
    u = torch.rand((), generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True).item()), len(cdf) - 1)


def _head(
    logits: torch.Tensor, p: SamplingParams, log_total: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Without top-k: (values, ids) of every token min-p and top-p could keep, sorted by logit,
    without sorting the whole vocabulary (a 262k sort costs more than the decode step it follows)."""
    if p.min_p > 0.0:
        ids = torch.nonzero(logits >= logits.max() + math.log(p.min_p)).squeeze(1)
        values, order = torch.sort(logits[ids], descending=True)
        return values, ids[order]
    if p.top_p < 1.0:
        m = 256
        while m < len(logits):
            values, ids = top_k(logits, m)
            if torch.exp(values - log_total).sum() >= p.top_p:
                return values, ids
            m *= 8
        return torch.sort(logits, descending=True)
    return logits, torch.arange(len(logits))  # nothing filtered: order does not matter


def _recent(history: Sequence[int], n: int) -> Sequence[int]:
    """The last `n` ids of `history` (-1: all of them, 0: none)."""
    if n == 0:
        return ()
    if n == -1 or n >= len(history):
        return history
    return history[len(history) - n :]
