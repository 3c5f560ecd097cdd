"""One request's generation, as the events a response is built from: `Piece`s of text, then `Done`.

Runs on the thread that owns the engine (`llmx.server.worker`); everything here is text over the
engine's token ids: stop strings, UTF-8 split across tokens, logprobs, finish reasons.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llmx.api import LoadedModel
from llmx.server.protocol import Candidate, Request, StopScanner, TokenLogprob, usage
from llmx.text.grammar import Constraint
from llmx.text.sampler import Sampler, SamplingParams
from llmx.text.tokenizer import StreamDecoder, Tokenizer

Sample = Callable[[torch.Tensor, Sequence[int]], int]  # (logits [vocab], history) -> next id


@dataclass(frozen=True)
class Piece:
    """Text generated since the last piece (possibly empty: held back for a stop string or a split
    character), with the ids of the tokens that made it and their logprobs when they were asked for."""

    text: str
    logprobs: list[TokenLogprob] | None = None
    ids: tuple[int, ...] = ()  # the tokens that made it


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop": an end-of-turn token or a stop string; "length": max_tokens or -c
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache: set by whoever ran the model

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def request_usage(done: Sequence[Done]) -> dict[str, Any]:
    """A request's usage over its choices: the prompt once (as the first choice ran it), every
    choice's completion tokens."""
    first = done[0]
    return usage(first.prompt_tokens, sum(d.completion_tokens for d in done), first.cached_tokens)


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


class Generation:
    """One request's text side, fed each of its tokens: UTF-8 pieces, stop strings and finish reasons,
    and for a reply with a grammar or logprobs the host sampler (constrained and recorded as asked).
    Whoever runs the model (the engine alone, or a batch of slots) calls `step` with each step's
    logits (a reply with a `pick`) or `push` with each id sampled on the device, until `done`.

    `room` is how many tokens the context lets it generate: every one but the last must be stored.
    """

    def __init__(
        self, tokenizer: Tokenizer, request: Request, ids: list[int], room: int, constraint: Constraint | None
    ) -> None:
        self.params = SamplingParams(**request.sampling)
        self.recorder: _Recorder | None = None
        # a grammar's mask and logprobs need every step's logits on the host; other replies are sampled
        # on the device (`text.device_sampler`) by whoever runs the model, their ids handed to `push`
        self.pick: Sample | None = None
        if constraint is not None or request.top_logprobs is not None:
            sample: Sample = Sampler(self.params)
            if constraint is not None:
                sample = _constrained(sample, constraint)
            if request.top_logprobs is not None:
                sample = self.recorder = _Recorder(sample, tokenizer, request.top_logprobs)
            self.pick = sample
        self.decoder, self.scanner = StreamDecoder(tokenizer), StopScanner(request.stop)
        self.stop_ids, self.history, self.n_prompt = tokenizer.stop_ids, list(ids), len(ids)
        self.limit = min(request.max_tokens, room)
        self.done = False

    @property
    def generated(self) -> int:
        return len(self.history) - self.n_prompt

    def step(self, logits: torch.Tensor) -> list[Piece | Done]:
        """Pick the next token from `logits` [vocab] on the host (a reply with a `pick`): `push`'s events."""
        assert self.pick is not None, "a reply sampled on the device is given its ids (`push`)"
        return self.push(self.pick(logits, self.history))

    def push(self, token: int) -> list[Piece | Done]:
        """The events the next token makes (the last a `Done` once the reply is over; then `done`, and
        the token is not to be run)."""
        if token in self.stop_ids:
            return self._end("stop")
        self.history.append(token)
        noted = None if self.recorder is None else self.recorder.take()
        events: list[Piece | Done] = [Piece(self.scanner.push(self.decoder.push(token)), noted, (token,))]
        if self.scanner.stopped:
            self.done = True
            return [*events, Done("stop", self.n_prompt, self.generated)]
        if self.generated == self.limit:
            return events + self._end("length")
        return events

    def _end(self, reason: str) -> list[Piece | Done]:
        self.done = True
        tail = self.scanner.push(self.decoder.flush()) + self.scanner.flush()
        # an end-of-turn token's logprob is not shown
        pieces = [Piece(tail, None if self.recorder is None else [])] if tail else []
        return [*pieces, Done(reason, self.n_prompt, self.generated)]


def generate(
    model: LoadedModel,
    request: Request,
    ids: list[int],
    constraint: Constraint | None = None,
    cancelled: Callable[[], bool] = lambda: False,
) -> Iterator[Piece | Done]:
    """A `Piece` per generated token, then one `Done`, run by the engine alone; only tokens
    `constraint` allows. The engine's context restarts here; closing the iterator stops generation
    after the current step. The prompt runs a `-ub` chunk at a time, and stops (yielding nothing)
    once `cancelled()`: a long prompt's client that left does not hold the engine to its end."""
    engine = model.engine
    engine.reset()
    reply = Generation(model.tokenizer, request, ids, engine.n_ctx - len(ids) + 1, constraint)
    starts = range(0, len(ids), engine.ubatch)
    for start in starts:
        if cancelled():
            return
        on_device = reply.pick is None and start == starts[-1]  # the chunk whose logits are sampled there
        logits = engine.prefill(ids[start : start + engine.ubatch], on_device=on_device)
    if reply.pick is None:
        tokens = engine.continue_from(logits, ids, reply.limit, reply.params)
        try:  # closing `tokens` takes back the step issued after the last token read
            for token in tokens:
                yield from reply.push(token)
                if reply.done:
                    return
        finally:
            tokens.close()
        return
    while True:
        yield from reply.step(logits)
        if reply.done:
            return
        logits = engine.decode(reply.history[-1])
