"""One request's generation, as the events a response is built from: `Piece`s of text, then `Done`.

Runs on the thread that owns the engine (`llmx.server.worker`); everything here is text over the
engine's token ids: stop strings, UTF-8 split across tokens, logprobs, finish reasons.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from llmx.api import LoadedModel
from llmx.server.protocol import Candidate, Request, StopScanner, TokenLogprob
from llmx.text.grammar import Constraint
from llmx.text.sampler import Sampler, SamplingParams
from llmx.text.tokenizer import StreamDecoder, Tokenizer

Sample = Callable[[torch.Tensor, Sequence[int]], int]  # (logits [vocab], history) -> next id


@dataclass(frozen=True)
class Piece:
    """Text generated since the last piece (possibly empty: held back for a stop string or a split
    character), with the logprobs of the tokens that made it when they were asked for."""

    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop": an end-of-turn token or a stop string; "length": max_tokens or -c
    prompt_tokens: int
    completion_tokens: int


def _constrained(sample: Sample, constraint: Constraint) -> Sample:
    def pick(logits: torch.Tensor, history: Sequence[int]) -> int:
        token = sample(constraint.mask(logits), history)
        constraint.accept(token)
        return token

    return pick


class _Recorder:
    """A sampler that also notes, for each token it picks, its log-probability under the model (the
    raw logits' softmax, before penalties and temperature, as OpenAI reports it) and the `top`
    likeliest tokens'."""

    def __init__(self, sample: Sample, tokenizer: Tokenizer, top: int):
        self.sample, self.tokenizer, self.top = sample, tokenizer, top
        self.noted: list[TokenLogprob] = []

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        token = self.sample(logits, history)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values, ids = torch.topk(logprobs, self.top) if self.top else (torch.empty(0), torch.empty(0))
        top = tuple(self._candidate(int(i), float(v)) for v, i in zip(values, ids, strict=True))
        self.noted.append(TokenLogprob(self._candidate(token, float(logprobs[token])), top))
        return token

    def _candidate(self, token: int, logprob: float) -> Candidate:
        data = self.tokenizer.token_bytes(token)
        return Candidate(data.decode("utf-8", errors="replace"), data, logprob)

    def take(self) -> list[TokenLogprob]:
        noted, self.noted = self.noted, []
        return noted


def generate(
    model: LoadedModel, request: Request, ids: list[int], constraint: Constraint | None = None
) -> Iterator[Piece | Done]:
    """A `Piece` per generated token, then one `Done`; only tokens `constraint` allows. The engine's
    context restarts here; closing the iterator stops generation after the current step."""
    engine, tokenizer = model.engine, model.tokenizer
    engine.reset()
    sample: Sample = Sampler(SamplingParams(**request.sampling))
    if constraint is not None:
        sample = _constrained(sample, constraint)
    recorder = None if request.top_logprobs is None else _Recorder(sample, tokenizer, request.top_logprobs)
    decoder, scanner = StreamDecoder(tokenizer), StopScanner(request.stop)

    def noted() -> list[TokenLogprob] | None:
        return None if recorder is None else recorder.take()

    n = 0
    pick = sample if recorder is None else recorder
    for token in engine.generate(ids, request.max_tokens, pick, tokenizer.stop_ids):
        n += 1
        yield Piece(scanner.push(decoder.push(token)), noted())
        if scanner.stopped:
            yield Done("stop", len(ids), n)
            return
        if n == request.max_tokens:  # asked for more, the engine would run a step whose logits go unused
            break
    tail = scanner.push(decoder.flush()) + scanner.flush()
    if tail:
        yield Piece(tail, None if recorder is None else [])  # an end-of-turn token's logprob is not shown
    full = n == request.max_tokens or engine.n_past >= engine.n_ctx
    yield Done("length" if full else "stop", len(ids), n)
