"""The arithmetic of `llmx perplexity`, in numpy: chunks of a text, perplexity and its uncertainty, and
the KL divergence of one run's next-token distributions from a base run's. No torch, no model.

The semantics are llama.cpp's `llama-perplexity` (tools/perplexity/perplexity.cpp): the text's tokens are
cut into chunks of `n_ctx`, each run from an empty context with its first token replaced by BOS when the
model adds one, and the second half of each chunk is scored: the logits at position j (n_ctx/2 <= j <=
n_ctx - 2) predict the token at j + 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llmx.errors import LlmxError

# The percentiles of the per-token KL divergence that `--kl-divergence` prints, as fractions.
KLD_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.5, 0.1, 0.05, 0.01)


def first_scored(n_ctx: int) -> int:
    """The first position whose logits are scored (llama.cpp's `first = n_ctx/2`)."""
    return n_ctx // 2


def chunks(tokens: Sequence[int], n_ctx: int, n_chunks: int | None = None) -> list[list[int]]:
    """The text's tokens cut into whole chunks of `n_ctx` (the tail that fills no chunk is dropped), at most
    `n_chunks` of them (all when None or not positive, as llama.cpp's default --chunks -1)."""
    if n_ctx < 4:
        raise LlmxError(f"-c {n_ctx} is too small to score anything: perplexity needs a context of 4 or more")
    n = len(tokens) // n_ctx
    if n == 0:
        raise LlmxError(
            f"the text has {len(tokens)} tokens, fewer than one chunk of -c {n_ctx}; "
            "use a longer text or a smaller -c"
        )
    if n_chunks is not None and n_chunks > 0:
        n = min(n, n_chunks)
    return [list(tokens[i * n_ctx : (i + 1) * n_ctx]) for i in range(n)]


def model_input(chunk: Sequence[int], bos_id: int | None) -> list[int]:
    """What the model runs: the chunk with its first token replaced by BOS when the model adds one."""
    return list(chunk) if bos_id is None else [bos_id, *chunk[1:]]


def targets(chunk: Sequence[int]) -> np.ndarray:
    """The ids the scored positions predict: the chunk's tokens from n_ctx/2 + 1 on (never the first,
    which BOS may have replaced)."""
    return np.asarray(chunk[first_scored(len(chunk)) + 1 :], dtype=np.int64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Normalized log-probabilities over the last axis, in float32 (for float16 inputs too)."""
    x = x.astype(np.float32)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32))


def token_nll(logprobs: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """-log p(ids[i]) from row i of `logprobs` [n, vocab], in float64."""
    return -logprobs[np.arange(len(ids)), ids].astype(np.float64)


def mean_and_error(x: np.ndarray) -> tuple[float, float]:
    """The mean of `x` and its standard error, sqrt((E[x^2] - E[x]^2) / (n - 1)) as llama.cpp computes it
    (0 when it cannot be estimated)."""
    n = len(x)
    mean = float(np.mean(x)) if n else 0.0
    var = float(np.mean(np.square(x))) - mean * mean if n else 0.0
    return mean, (float(np.sqrt(var / (n - 1))) if n > 1 and var > 0 else 0.0)


def perplexity(nll: np.ndarray) -> tuple[float, float]:
    """PPL = exp(mean NLL) and its uncertainty PPL * (standard error of the NLL), llama.cpp's
    `Final estimate: PPL = X +/- err`."""
    mean, err = mean_and_error(nll)
    ppl = float(np.exp(mean))
    return ppl, ppl * err


def covariance(a: np.ndarray, b: np.ndarray) -> float:
    """The covariance of the means of `a` and `b` (llama.cpp's `covariance`: (E[ab] - E[a]E[b]) / (n - 1))."""
    n = len(a)
    if n < 2:
        return 0.0
    return (float(np.mean(a * b)) - float(np.mean(a)) * float(np.mean(b))) / (n - 1)


# --- KL divergence ------------------------------------------------------------------------------------


def at_base_precision(logprobs: np.ndarray) -> np.ndarray:
    """Log-probabilities as a base file stores them (float16), renormalized in float32: both sides of a
    comparison go through this, so a run compared with its own base gives exactly 0, and every KL
    divergence is one between two true distributions (never negative)."""
    return log_softmax(logprobs.astype(np.float16))


def kld_rows(base: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(base || other) per row of two normalized log-probability arrays [n, vocab]:
    sum_i p_base_i (log p_base_i - log p_other_i), in float64."""
    p = np.exp(base.astype(np.float64))
    return np.sum(p * (base.astype(np.float64) - other.astype(np.float64)), axis=-1)


@dataclass(frozen=True)
class Comparison:
    """Per scored token: this run's NLL, the base run's, KL(base || this) and whether both runs put the
    same token on top."""

    nll: np.ndarray
    nll_base: np.ndarray
    kld: np.ndarray
    same_top: np.ndarray

    @staticmethod
    def of(
        base: np.ndarray, other: np.ndarray, ids: np.ndarray, nll: np.ndarray, nll_base: np.ndarray
    ) -> Comparison:
        """Compare one chunk: `base` and `other` are log-probabilities [n, vocab] (any precision), `ids` the
        scored tokens; the NLLs are each run's own (full precision)."""
        b, o = at_base_precision(base), at_base_precision(other)
        same = np.argmax(b, axis=-1) == np.argmax(o, axis=-1)
        return Comparison(nll, nll_base, kld_rows(b, o), same)

    @staticmethod
    def join(parts: Sequence[Comparison]) -> Comparison:
        return Comparison(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in ("nll", "nll_base", "kld", "same_top"))
        )

    @property
    def count(self) -> int:
        return len(self.kld)

    def ppl(self) -> tuple[float, float]:
        return perplexity(self.nll)

    def ppl_base(self) -> tuple[float, float]:
        return perplexity(self.nll_base)

    def log_ppl_ratio(self) -> tuple[float, float]:
        """ln(PPL(Q)/PPL(base)) and its uncertainty, the two NLLs' correlation taken into account."""
        (a, ea), (b, eb) = mean_and_error(self.nll), mean_and_error(self.nll_base)
        var = ea * ea + eb * eb - 2 * covariance(self.nll, self.nll_base)
        return a - b, float(np.sqrt(max(var, 0.0)))

    def ppl_correlation(self) -> float:
        """The correlation of ln(PPL(Q)) with ln(PPL(base))."""
        ea, eb = mean_and_error(self.nll)[1], mean_and_error(self.nll_base)[1]
        return covariance(self.nll, self.nll_base) / (ea * eb) if ea and eb else 1.0

    def ppl_difference(self) -> tuple[float, float]:
        """PPL(Q) - PPL(base) and its uncertainty."""
        (p, ep), (pb, epb) = self.ppl(), self.ppl_base()
        cov = p * pb * covariance(self.nll, self.nll_base)
        return p - pb, float(np.sqrt(max(ep * ep + epb * epb - 2 * cov, 0.0)))

    def mean_kld(self) -> tuple[float, float]:
        return mean_and_error(self.kld)

    def kld_percentiles(self) -> dict[float, float]:
        """The KLD at each of `KLD_PERCENTILES` (linear interpolation between ranks, as llama.cpp)."""
        return {f: float(np.quantile(self.kld, f)) for f in KLD_PERCENTILES}

    def same_top_rate(self) -> tuple[float, float]:
        """The fraction of tokens whose top token is the same in both runs, and its binomial uncertainty."""
        n, p = self.count, float(np.mean(self.same_top))
        return p, (float(np.sqrt(p * (1 - p) / (n - 1))) if n > 1 else 0.0)
