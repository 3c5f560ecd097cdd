"""The `n` choices of one request: their tickets' events as they come, each choice's text read for tool
calls, and the response built from them, whole or as server-sent events.

Each choice is a ticket of its own (its own seed, its own grammar state), so a batching worker runs
them as parallel sequences and the plain one runs them one after another; prompt tokens are counted
once, completion tokens over all choices.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from llmx.server.errors import ApiError
from llmx.server.generation import Done, Piece, request_usage
from llmx.server.protocol import Reply, TokenLogprob
from llmx.server.worker import Ticket
from llmx.text.tool_calls import CallDelta, ToolCallParser, ToolFormat, collect

Event = tuple[int, Piece | Done]  # a choice's index and its event


class Choices:
    """A request's tickets, one per choice; `next` gives their events in the order they arrive."""

    def __init__(self, tickets: list[Ticket]) -> None:
        self.tickets = tickets
        self._gets: dict[int, asyncio.Future] = {}  # a pending read of each choice still generating
        self._open = set(range(len(tickets)))

    async def next(self, deadline: float | None, gone: asyncio.Future | None) -> Event | None:
        """The next event of any choice; None when `gone` (the client left) came first. A time-out or
        an error from the worker raises ApiError."""
        for i in self._open - set(self._gets):
            self._gets[i] = asyncio.ensure_future(self.tickets[i].events.get())
        waits = set(self._gets.values()) | ({gone} if gone is not None else set())
        timeout = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        ready = [i for i, get in self._gets.items() if get in done]
        if not ready:
            if gone is not None and gone in done:
                return None
            raise ApiError(503, "the request took longer than the server's --timeout", "timeout")
        index = min(ready)  # of events that came together, the lowest choice's first
        event = self._gets.pop(index).result()
        if isinstance(event, ApiError):
            raise event
        if isinstance(event, Done):
            self._open.discard(index)
        return index, event

    @property
    def finished(self) -> bool:
        return not self._open

    def cancel(self) -> None:
        """Stop every choice's generation (done, or the response ended early)."""
        for get in self._gets.values():
            get.cancel()
        for ticket in self.tickets:
            ticket.cancel()


class ChoiceText:
    """One choice's text side of the response: its text read for tool calls when the request gave
    tools (`format`), the call ids, the offset of streamed text."""

    def __init__(self, reply: Reply, index: int, format: ToolFormat | None) -> None:
        self.reply, self.index = reply, index
        self.parser = None if format is None else ToolCallParser(format)
        self.ids: list[str] = []
        self.offset = 0

    def read(self, text: str, end: bool = False) -> list[str | CallDelta]:
        """Content and call deltas in `text`; `end`: the reply is over, release what was held."""
        if self.parser is None:
            return [text] if text else []
        return self.parser.push(text) + (self.parser.finish() if end else [])

    def call_delta(self, delta: CallDelta) -> dict[str, Any]:
        """OpenAI's delta of a call: the first carries its id and name."""
        if delta.name is None:
            return {"index": delta.index, "function": {"arguments": delta.arguments}}
        self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
        function = {"name": delta.name, "arguments": delta.arguments}
        return {"index": delta.index, "id": self.ids[-1], "type": "function", "function": function}

    def finish_reason(self, done: Done) -> str:
        return "tool_calls" if self.ids and done.finish_reason == "stop" else done.finish_reason

    def chunks(self, event: Piece | Done) -> list[dict]:
        """The stream's chunks for one event of this choice."""
        if isinstance(event, Done):
            pieces, logprobs, ids = self.read("", end=True), None, ()
        else:
            pieces, logprobs, ids = self.read(event.text), event.logprobs, event.ids
        out = []
        for piece in pieces:
            if isinstance(piece, str):
                chunk = self.reply.chunk(self.index, piece, logprobs=logprobs, offset=self.offset, ids=ids)
                out.append(chunk)
                self.offset += len(piece)
            else:
                delta = [self.call_delta(piece)]
                out.append(self.reply.chunk(self.index, None, logprobs=logprobs, tool_calls=delta, ids=ids))
            logprobs, ids = None, ()  # a piece's tokens are shown once, with its first chunk
        # text held back (a stop string's start, a call's head): the tokens still show
        if logprobs or (ids and self.reply.tokens):
            out.append(self.reply.chunk(self.index, None, logprobs=logprobs, offset=self.offset, ids=ids))
        if isinstance(event, Done):
            out.append(self.reply.chunk(self.index, None, finish_reason=self.finish_reason(event)))
        return out

    def whole(self, events: list[Piece | Done], top_logprobs: int | None) -> dict[str, Any]:
        """This choice of the whole response, from all its events."""
        pieces = [e for e in events if isinstance(e, Piece)]
        done = events[-1]
        assert isinstance(done, Done)
        logprobs: list[TokenLogprob] | None = None
        if top_logprobs is not None:
            logprobs = [t for p in pieces for t in p.logprobs or ()]
        content, calls = collect(self.read("".join(p.text for p in pieces), end=True))
        tool_calls = [self.call_delta(CallDelta(i, c.name, c.arguments)) for i, c in enumerate(calls)]
        ids = [i for p in pieces for i in p.ids]
        return self.reply.choice(self.index, content, self.finish_reason(done), logprobs, tool_calls, ids)


async def whole(
    choices: Choices, texts: list[ChoiceText], first: Event, deadline: float | None, gone: asyncio.Future,
    top_logprobs: int | None,
) -> dict | None:  # fmt: skip
    """The whole response; None if the client left first."""
    events: list[list[Piece | Done]] = [[] for _ in texts]
    done: list[Done] = []
    event: Event | None = first
    while event is not None:
        events[event[0]].append(event[1])
        if isinstance(event[1], Done):
            done.append(event[1])
        if choices.finished:
            body = [t.whole(e, top_logprobs) for t, e in zip(texts, events, strict=True)]
            return texts[0].reply.body(body, request_usage(done))
        event = await choices.next(deadline, gone)
    return None


async def stream(
    choices: Choices, texts: list[ChoiceText], first: Event, deadline: float | None, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events of a streamed response, ending with OpenAI's `[DONE]`. A client that leaves
    mid-stream makes the response close this generator: `finally` cancels the generations."""

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    reply = texts[0].reply
    done: list[Done] = []
    try:
        if reply.kind == "chat":
            for t in texts:
                yield sse(reply.chunk(t.index, None, first=True))
        event: Event | None = first
        while event is not None:
            index, e = event
            for chunk in texts[index].chunks(e):
                yield sse(chunk)
            if isinstance(e, Done):
                done.append(e)
            if choices.finished:
                break
            try:
                event = await choices.next(deadline, None)
            except ApiError as error:  # the status line is sent already: the error goes in the stream
                yield sse(error.body())
                return
        if include_usage:
            yield sse(reply.usage_chunk(request_usage(done)))
        yield "data: [DONE]\n\n"
    finally:
        choices.cancel()
