"""Replies sampled on the device, as the engine alone (`-np 1`) and the batching scheduler serve them:
a seeded reply is the same every time, alone or beside others; a stop id, a stop string and max_tokens
end a reply at the right token although each token is read one step after it was sampled."""

from __future__ import annotations

import asyncio
import threading

import pytest

import llmx
from llmx.server.generation import Done, Piece
from llmx.server.metrics import Metrics
from llmx.server.protocol import Request
from llmx.server.scheduler import Batcher
from llmx.server.worker import Ticket, Worker

PROMPT = "Once upon a time, a small dog"


@pytest.fixture(scope="module")
def model(smollm2_path):
    return llmx.load(smollm2_path, ctx_size=256)


def serve(model, n_seq: int, requests: list[Request]) -> list[tuple[str, Done]]:
    """Each request's text and `Done`, served together by a fresh worker (`n_seq` > 1: batched)."""
    worker = Worker(model, 8, Metrics()) if n_seq == 1 else Batcher(model, 8, Metrics(), n_seq, 16)
    loop = asyncio.new_event_loop()
    tickets = [Ticket(r, model.encode(r.prompt), loop) for r in requests]
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        worker.submit(*tickets)
        out = []
        for ticket in tickets:
            text = ""
            while not isinstance(
                event := loop.run_until_complete(asyncio.wait_for(ticket.events.get(), 120)), Done
            ):
                assert isinstance(event, Piece), event
                text += event.text
            out.append((text, event))
        return out
    finally:
        worker.stop()
        thread.join()
        loop.close()


def greedy_reference(model, steps: int) -> list[int]:
    """The greedy ids after PROMPT the plain way: each step's logits read on the host. On a thread of
    its own, as the workers run: beside their OpenMP teams, another on the main thread oversubscribes
    a small machine's CPUs and its steps crawl (`server.worker`)."""
    engine, ids = model.engine, []

    def run() -> None:
        engine.reset()
        logits = engine.prefill(model.encode(PROMPT))
        for _ in range(steps):
            ids.append(int(logits.argmax()))
            logits = engine.decode(ids[-1])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return ids


def request(**kw) -> Request:
    sampling = {k: kw.pop(k) for k in ("temperature", "seed", "top_k", "top_p", "repeat_penalty") if k in kw}
    return Request("completion", prompt=kw.pop("prompt", PROMPT), sampling=sampling, **kw)


SEEDED = request(temperature=1.0, seed=5, max_tokens=10)
OTHERS = [request(temperature=0.7, seed=9, top_k=5, max_tokens=6, prompt="def f(x):"),
          request(temperature=0.0, repeat_penalty=1.3, max_tokens=12, prompt="Colours:")]  # fmt: skip


def test_a_seeded_reply_is_the_same_alone_and_batched_with_others(model):
    alone, other = serve(model, 1, [SEEDED, request(temperature=1.0, seed=6, max_tokens=10)])
    batched = serve(model, 3, [OTHERS[0], SEEDED, OTHERS[1]])
    assert alone[0] == batched[1][0] and alone[1].completion_tokens == 10
    assert other[0] != alone[0]


@pytest.mark.parametrize("n_seq", [1, 3])
def test_a_stop_id_a_stop_string_and_max_tokens_end_at_the_right_token(model, n_seq, monkeypatch):
    want = greedy_reference(model, 10)
    text = model.tokenizer.decode
    at = next(k for k in range(4, 10) if want[k] not in want[:k])  # a token not seen before it
    stop = text(want[at - 1 : at])  # the text of the token before it: a stop string
    monkeypatch.setattr(model.tokenizer, "stop_ids", model.tokenizer.stop_ids | {want[at]})
    by_id, by_length, by_string = serve(
        model, n_seq,
        [request(temperature=0, max_tokens=10), request(temperature=0, max_tokens=3),
         request(temperature=0, max_tokens=10, stop=(stop,))],
    )  # fmt: skip
    assert (
        by_id[0] == text(want[:at]) and by_id[1].finish_reason == "stop" and by_id[1].completion_tokens == at
    )
    assert by_length[0] == text(want[:3]) and by_length[1].finish_reason == "length"
    assert by_length[1].completion_tokens == 3
    assert by_string[0] == text(want[:at]).split(stop)[0] and by_string[1].finish_reason == "stop"
