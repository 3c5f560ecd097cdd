"""The engine's owner: one thread that takes requests from a bounded queue and generates for them.

HTTP handlers never touch the model. They `submit` a `Ticket` and read its events (an asyncio queue,
filled from this thread with `call_soon_threadsafe`); a handler whose client has gone `cancel`s its
ticket, and generation stops after the step in progress. `Worker` generates for one request at a
time with the engine alone (its CUDA graphs and fused kernels: `-np 1`); `server.scheduler.Batcher`
keeps this shape (one owner thread, tickets in, events out) and runs `-np` requests in batched steps.

`Worker.run` should be called on the thread that loaded the model (`llmx serve` runs it on the main
thread). torch's CPU kernels and llmx's native ones run their parallel loops on the calling thread's
OpenMP team; libgomp gives every thread that opens a parallel region a team of its own, and once a
process's teams hold more threads than it has CPUs it stops spin-waiting between parallel regions
and puts its workers to sleep at each one (its "throttled" spin count). Measured on SmolLM2 (2-core
CPU, bench/serve_speed.py): decoded on another thread than the one that loaded it, ~615 voluntary
context switches a token against ~6, and 13-26 tokens/s against 43-53 on a quiet machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field

from llmx.api import LoadedModel
from llmx.errors import LlmxError, first_line
from llmx.server.errors import ApiError
from llmx.server.generation import Done, Piece, generate
from llmx.server.metrics import Metrics
from llmx.server.protocol import Request
from llmx.text.grammar import Constraint

POLL_SECONDS = 0.1  # how often an idle worker looks at its stop flag (a signal handler may set it)
RETRY_AFTER_SECONDS = 1

log = logging.getLogger("llmx.server")

Event = Piece | Done | ApiError


@dataclass(eq=False)
class Ticket:
    """A request waiting for or in generation; its events arrive on `events` in the submitter's loop."""

    request: Request
    ids: list[int]
    loop: asyncio.AbstractEventLoop
    constraint: Constraint | None = None  # response_format's grammar, compiled
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # set by the handler (client gone, time-out); read by the worker each step

    def cancel(self) -> None:
        self.cancelled = True

    def put(self, event: Event) -> None:
        """From the worker's thread: hand `event` to the handler's loop (gone at shutdown: dropped)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Outbox:
    """Events for tickets, handed over in one call a loop (`flush`): a batched step's tokens for N
    replies wake the handlers' event loop once rather than N times (each wake a write to the loop's
    self-pipe, made while the worker's thread holds the GIL the loop then takes). Events keep their
    order, a ticket's as the whole step's."""

    def __init__(self) -> None:
        self._events: list[tuple[Ticket, Event]] = []

    def put(self, ticket: Ticket, event: Event) -> None:
        self._events.append((ticket, event))

    def flush(self) -> None:
        """From the worker's thread: hand every event put since the last flush to its ticket's loop."""
        by_loop: defaultdict[asyncio.AbstractEventLoop, list[tuple[Ticket, Event]]] = defaultdict(list)
        for ticket, event in self._events:
            by_loop[ticket.loop].append((ticket, event))
        self._events = []
        for loop, events in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
                loop.call_soon_threadsafe(_hand_over, events)


def _hand_over(events: list[tuple[Ticket, Event]]) -> None:
    for ticket, event in events:
        ticket.events.put_nowait(event)


class Worker:
    """Generates for one ticket at a time; at most `max_queue` wait, later ones are refused (503).
    A ticket cancelled while it waits (its client left, or timed out) gives its place up at once."""

    def __init__(self, model: LoadedModel, max_queue: int, metrics: Metrics) -> None:
        self.model, self.metrics, self.max_queue = model, metrics, max_queue
        self._waiting: deque[Ticket] = deque()
        self._changed = threading.Condition()
        self._stopping = False
        self.busy: Ticket | None = None  # the ticket in generation (read by /slots)
        metrics.queued.set_function(self._live)

    def _live(self) -> int:
        with self._changed:
            return sum(not t.cancelled for t in self._waiting)

    def submit(self, *tickets: Ticket) -> None:
        """Queue `tickets` (one request's choices), all or none."""
        with self._changed:
            if self._stopping:
                raise ApiError(503, "the server is shutting down", "shutting_down")
            self._waiting = deque(t for t in self._waiting if not t.cancelled)
            if len(self._waiting) + len(tickets) > self.max_queue:
                self.metrics.rejected.inc()
                raise ApiError(
                    503,
                    f"the server is busy: {self.max_queue} requests are waiting already; retry later",
                    "queue_full",
                    retry_after=RETRY_AFTER_SECONDS,
                )
            self._waiting.extend(tickets)
            self._changed.notify()

    def stop(self) -> None:
        """Ask `run` to return: the request in generation and those waiting get a 503. Only sets a flag
        (no lock), so a signal handler may call it."""
        self._stopping = True

    @property
    def n_ctx(self) -> int:
        """The context a request may fill: its prompt and its reply."""
        return self.model.engine.n_ctx

    def slots(self) -> list[dict]:
        """llama-server's /slots: one, with the engine's context while it generates."""
        busy, engine = self.busy, self.model.engine
        state = {"n_past": engine.n_past, "n_prompt_tokens": len(busy.ids)} if busy else {}
        return [{"id": 0, "n_ctx": self.n_ctx, "is_processing": busy is not None} | state]

    def run(self) -> None:
        """Serve tickets until `stop`."""
        while not self._stopping:
            ticket = next(iter(self._take(1)), None)
            if ticket is not None:
                self._serve(ticket)
        self._refuse_waiting()

    def _take(self, room: int, wait: bool = True) -> list[Ticket]:
        """Up to `room` waiting tickets that are not cancelled, waiting a moment for one if `wait`."""
        with self._changed:
            if wait:  # a time-out, not a plain wait: `stop` sets its flag without notifying
                self._changed.wait_for(lambda: self._waiting, timeout=POLL_SECONDS)
            taken: list[Ticket] = []
            while self._waiting and len(taken) < room:
                ticket = self._waiting.popleft()
                if not ticket.cancelled:  # its client left while it waited
                    taken.append(ticket)
            return taken

    def _refuse_waiting(self) -> None:
        with self._changed:
            for ticket in self._waiting:
                ticket.put(ApiError(503, "the server is shutting down", "shutting_down"))
            self._waiting.clear()

    def _left(self, ticket: Ticket) -> bool:
        """Whether `ticket`'s generation is to stop here: its client left (counted), or the server is
        stopping (the client is told)."""
        if ticket.cancelled:
            self.metrics.cancelled.inc()
            return True
        if self._stopping:
            ticket.put(ApiError(503, "the server is shutting down", "shutting_down"))
            return True
        return False

    def _serve(self, ticket: Ticket) -> None:
        self.metrics.running.set(1)
        self.busy = ticket

        def gone() -> bool:  # read between a prompt's chunks too
            return ticket.cancelled or self._stopping

        steps = generate(self.model, ticket.request, ticket.ids, ticket.constraint, gone)
        tokens, done = 0, False
        try:
            for event in steps:
                done = isinstance(event, Done)
                tokens = event.completion_tokens if done else tokens + 1
                if self._left(ticket):
                    return
                ticket.put(event)
            if not done:  # the prompt was cut short: `generate` ended without a word
                self._left(ticket)
        except LlmxError as e:
            ticket.put(ApiError(400, first_line(e)))
        except Exception as e:  # a bug: the client hears of it, the server goes on
            log.exception("generation failed")
            ticket.put(ApiError(500, f"internal error: {first_line(e)}"))
        finally:
            steps.close()  # left mid-way: the engine's step is over and no other one starts
            self.metrics.running.set(0)
            self.busy = None
            self.metrics.add(self.model.engine.timings, tokens)  # this request's: `generate` reset them
