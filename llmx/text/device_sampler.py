"""Sampling on the device: the next ids of a whole batch from its logits, without the host reading them.

`DeviceSampler` keeps, for each of its rows (a request), its `SamplingParams` as tensors, the counts
of the ids in its penalty window and its random stream, all on the logits' device. A call takes
logits [B, vocab] and the B rows they belong to, and returns the chosen ids [B] on the device; it
issues torch ops only (no `.item()`, no branch on a tensor's value), so the next step can be queued
before the ids reach the host. The host's choices depend only on the rows' parameters, which it set.

The chain and its meaning are the host sampler's (`text.sampler`, llama.cpp's order): penalties over
the last `repeat_last_n` ids (the prompt's included), greedy at `temperature <= 0`, then top-k, top-p
over the top k, min-p against the best, all on the untempered logits, then temperature and one draw.

The draw is Gumbel-max: argmax of logit / T + Gumbel noise, which picks token i with probability
softmax(logits / T)[i]. The noise of a token is a hash of (seed, draw number, token id) computed with
integer ops (`uniform`), so a row's stream depends on nothing but its own seed and how many ids it
has drawn: its tokens are the same alone or in any batch, on any device.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import torch

from llmx.text.sampler import SamplingParams

MASK32 = 0xFFFFFFFF


# --- the random stream -------------------------------------------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for int64 x in [0, 2**32): in two 16-bit halves of c, so no product overflows
    int64 (whose wrap-around torch does not promise)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit values with full avalanche: Wellons' "lowbias32" (hash-prospector)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, draws: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniform floats in (0, 1) [B, K] for token `ids` [B, K] of rows with `seeds` [B, 2] (the low
    and high 32 bits) at their draw numbers `draws` [B]; all int64. A counter-based generator: the
    value is a function of (seed, draw, id) alone."""
    key = _mix(seeds[:, 0] ^ _mix(seeds[:, 1]))
    step = _mix((draws & MASK32) ^ key)
    h = _mix(_mix(ids ^ step[:, None]) ^ key[:, None])
    # 23 bits, centred: (n + 0.5) / 2**23 is exact in float32 and never 0 or 1
    return ((h >> 9).float() + 0.5) * 2.0**-23


def seed_halves(seed: int | None) -> tuple[int, int]:
    """A request's seed as (low, high) 32-bit halves; no seed: a fresh random one, as llama.cpp does."""
    s = secrets.randbits(64) if seed is None else seed % 2**64
    return s & MASK32, s >> 32


# --- the sampler --------------------------------------------------------------------------------------


class DeviceSampler:
    """Sampling state of `n_rows` requests over a vocabulary of `n_vocab` on `device`; `start` gives a
    row to a request, a call samples the next ids of some rows."""

    @torch.inference_mode()
    def __init__(self, n_rows: int, n_vocab: int, device: torch.device) -> None:
        self.n_vocab, self.device = n_vocab, device
        self.params: list[SamplingParams] = [SamplingParams(temperature=0.0)] * n_rows
        # per row: temperature, top_p, log(min_p) (-inf: off), repeat, presence, frequency penalty
        self.floats = torch.zeros(n_rows, 6, device=device)
        # per row: top_k (the candidates kept, 0 < k <= vocab), window (repeat_last_n: -1 all, 0 off),
        # ids pushed into the window, ids drawn, seed low, seed high
        self.ints = torch.zeros(n_rows, 6, dtype=torch.long, device=device)
        self.counts = torch.zeros(n_rows, n_vocab, device=device)  # each id's count in the window
        self.ring = torch.zeros(n_rows, 1, dtype=torch.long, device=device)  # the window's ids
        self.last = torch.zeros(n_rows, dtype=torch.long, device=device)  # each row's last id: the next input
        self._rows: tuple[tuple[int, ...], torch.Tensor] | None = None

    @torch.inference_mode()
    def start(self, row: int, params: SamplingParams, history: Sequence[int]) -> None:
        """Give `row` to a request sampled with `params` whose context so far is `history` (its prompt:
        the penalties see it, as llama.cpp's do)."""
        self.params[row] = params
        window = params.repeat_last_n
        if window > self.ring.shape[1]:  # a longer window than any before: a wider ring
            ring = torch.zeros(self.ring.shape[0], window, dtype=torch.long, device=self.device)
            ring[:, : self.ring.shape[1]] = self.ring
            self.ring = ring
        penalized = window != 0
        top_k = params.top_k if 0 < params.top_k < self.n_vocab else self.n_vocab
        log_min_p = math.log(params.min_p) if params.min_p > 0 else -math.inf
        floats = [params.temperature, params.top_p, log_min_p] + (
            [params.repeat_penalty, params.presence_penalty, params.frequency_penalty]
            if penalized
            else [1.0, 0.0, 0.0]
        )
        tail = list(history) if window == -1 else list(history)[len(history) - window :] if penalized else []
        ints = [top_k, window, len(tail), 0, *seed_halves(params.seed)]
        self.floats[row] = _on(floats, torch.float32, self.device)
        self.ints[row] = _on(ints, torch.long, self.device)
        self.counts[row] = 0
        if tail:
            ids = _on(tail, torch.long, self.device)
            self.counts[row].index_add_(0, ids, torch.ones(len(tail), device=self.device))
            if window > 0:  # the tail fills the ring from its start: the ids pushed so far are len(tail)
                self.ring[row, : len(tail)] = ids

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """The next ids [B] (int64, on the device) of `rows` [B] given their `logits` [B, vocab]; each
        row's penalty window and random stream move on by one."""
        index = self._index(rows)
        params = [self.params[r] for r in rows]
        logits = logits.float()
        if any(p.repeat_last_n != 0 and _penalizes(p) for p in params):
            logits = penalize(logits, self.counts[index], self.floats[index, 3:])
        chosen = argmax(logits)
        if not all(p.greedy for p in params):
            f, i = self.floats[index], self.ints[index]
            kept = max(p.top_k if 0 < p.top_k < self.n_vocab else self.n_vocab for p in params)
            values, ids = filtered(logits, kept, i[:, 0], f[:, 1], f[:, 2])
            drawn = draw(values, ids, f[:, 0], i[:, 4:6], i[:, 3])
            chosen = torch.where(f[:, 0] > 0, drawn, chosen)
        self._push(index, chosen)
        return chosen

    def _index(self, rows: Sequence[int]) -> torch.Tensor:
        """`rows` as a tensor on the device, made again only when the batch's rows change."""
        key = tuple(rows)
        if self._rows is None or self._rows[0] != key:
            self._rows = key, _on(list(key), torch.long, self.device)
        return self._rows[1]

    def _push(self, index: torch.Tensor, chosen: torch.Tensor) -> None:
        """Count `chosen` [B] in the rows' penalty windows (the id leaving a full window uncounted), move
        their random streams on, and keep them as the rows' `last` ids."""
        window, pushed = self.ints[index, 1], self.ints[index, 2]
        ring_len = window.clamp(min=1)  # rows without a ring write its first slot, never read
        slot = (pushed % ring_len)[:, None]
        leaving = self.ring[index].gather(1, slot).squeeze(1)
        full = ((pushed >= window) & (window > 0)).float()
        self.counts.index_put_((index, leaving), -full, accumulate=True)
        self.counts.index_put_((index, chosen), (window != 0).float(), accumulate=True)
        self.ring[index] = self.ring[index].scatter(1, slot, chosen[:, None])
        self.ints[index, 2:4] += 1
        self.last[index] = chosen


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest logit [B] (int64): the first of equal maxima, as the host's
    greedy; a NaN counts as the largest, in torch's and numpy's. On the CPU numpy's vectorized loop
    reads [8, 49152] in 64 us where torch's took 300-1200 (2-core EPYC): a batched step's sampling."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _penalizes(p: SamplingParams) -> bool:
    return p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _on(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on `device`, copied without waiting for the device's queued work."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


# --- the chain, as pure functions of tensors -------------------------------------------------------------


def penalize(logits: torch.Tensor, counts: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] with llama.cpp's penalties for ids seen `counts` [B, V] times; `penalties` [B, 3]
    are (repeat, presence, frequency). A seen logit is divided by the repeat penalty when positive and
    multiplied when negative (dividing would make it likelier), then lowered by the frequency penalty
    per occurrence and the presence penalty once."""
    repeat, presence, frequency = (penalties[:, j : j + 1] for j in range(3))
    seen = torch.where(logits > 0, logits / repeat, logits * repeat)
    seen = seen - counts * frequency - presence
    return torch.where(counts > 0, seen, logits)


def filtered(
    logits: torch.Tensor, kept: int, top_k: torch.Tensor, top_p: torch.Tensor, log_min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates each row may draw: (values, ids) [B, kept], sorted by logit, those filtered out
    at -inf. `kept` (a host int) is the largest top-k of the batch (the vocabulary for a row without
    one). Per row, `top_k` [B] candidates, then top-p: the smallest head whose probability, renormalized
    over those k, reaches `top_p` [B] (all of them at 1); then min-p: those at least exp(`log_min_p`)
    [B] times as likely as the best. At least the best survives."""
    if kept < logits.shape[-1]:
        values, ids = torch.topk(logits, kept, dim=-1)
    else:
        values, ids = torch.sort(logits, dim=-1, descending=True)
    rank = torch.arange(kept, device=logits.device)
    head = values.masked_fill(rank >= top_k[:, None], -math.inf)
    cumulative = torch.softmax(head, dim=-1).cumsum(dim=-1)
    # the token whose cumulative probability first reaches p is kept: one more than those under p
    by_p = torch.where(top_p >= 1.0, kept, (cumulative < top_p[:, None]).sum(dim=-1) + 1)
    by_min_p = (head >= head[:, :1] + log_min_p[:, None]).sum(dim=-1).clamp(min=1)
    keep = torch.minimum(torch.minimum(top_k, by_p), by_min_p)
    return values.masked_fill(rank >= keep[:, None], -math.inf), ids


def draw(
    values: torch.Tensor,
    ids: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    draws: torch.Tensor,
) -> torch.Tensor:
    """One id [B] per row from candidates (`values`, `ids`) [B, K] (-inf: filtered out) with
    probabilities softmax(values / `temperature`), by Gumbel-max with the rows' counter-based noise.
    A row at temperature <= 0 gets an arbitrary candidate (the caller takes its argmax instead)."""
    t = torch.where(temperature > 0, temperature, 1.0)[:, None]
    gumbel = -torch.log(-torch.log(uniform(seeds, draws, ids)))
    return ids.gather(1, (values / t + gumbel).argmax(dim=-1, keepdim=True)).squeeze(1)
