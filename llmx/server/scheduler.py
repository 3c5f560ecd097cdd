"""Continuous batching (`-np N`): up to N requests generated at once, one batched step at a time.

Every step runs, in one forward over the paged KV cache (`runtime.batch`), the next token of each slot
whose prompt is done and, within `-ub` tokens in all, the next chunks of prompts still being
prefilled, oldest request first: a long prompt is cut into chunks that share steps with the others'
decode tokens, so it never stalls them for its whole length. Waiting requests take free slots at step
boundaries. A request that finishes, is cancelled (its client left, or timed out) or fails gives its
blocks back before the next step.

Sampling is per request, on the device for the whole batch (`text.device_sampler`, a row per slot):
each slot's id feeds the next step there, and the host reads a step's ids after issuing the next one
(`_settle`). So a slot's decode token is committed to its table one step late, and a reply found over
then (a stop id or string) has had one step more run for it, whose token is dropped with its blocks;
a slot whose last sampled id is its `max_tokens`-th runs no step more. A reply with a grammar or
logprobs is sampled on the host from its logits (`server.generation`), in the same steps.

With the prefix cache (on unless `--no-cache-prompt`), a request starts on the blocks of the longest
prompt prefix already computed (a shared system prompt, an earlier turn of a chat: `runtime.blocks`)
and prefills only the rest; `llmx_prompt_tokens_cached` and the reply's
`usage.prompt_tokens_details.cached_tokens` count what it reused.

The slots share `-c` as llama-server's do: each holds -c / N positions (`PagedKVCache.over`), and the
pool lies over the engine's own cache buffers, so the engine alone must not run while a batch serves.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from llmx.api import LoadedModel
from llmx.engine import Timings
from llmx.errors import LlmxError, first_line
from llmx.runtime.batch import Chunk, forward_batch
from llmx.runtime.blocks import BlockTable
from llmx.runtime.host_copy import HostCopy
from llmx.runtime.paged import PagedKVCache
from llmx.server.errors import ApiError
from llmx.server.generation import Done, Generation, Piece
from llmx.server.metrics import Metrics
from llmx.server.worker import Outbox, Ticket, Worker
from llmx.text.device_sampler import DeviceSampler

log = logging.getLogger("llmx.server")


@dataclass(eq=False)
class Slot:
    """A request in generation: its ticket, its text side, its row of the device sampler, its blocks,
    how much of its prompt has run (or was `cached`), the ids sampled for it on the device (read or on
    their way), and its engine counters (a step's seconds count for every request in it: the time each
    waited)."""

    ticket: Ticket
    reply: Generation
    row: int
    table: BlockTable = field(default_factory=BlockTable)
    fed: int = 0
    cached: int = 0
    sampled: int = 0
    timings: Timings = field(default_factory=Timings)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.ticket.ids)

    @property
    def decoding(self) -> bool:
        """Whether its next step is a decode token: its prompt has run and, sampled on the device, its
        last id is not its reply's last possible one."""
        return not self.prefilling and (self.reply.pick is not None or self.sampled < self.reply.limit)


InFlight = tuple[list[Slot], HostCopy]  # a step's slots sampled on the device, and their ids' copy


class Batcher(Worker):
    """A `Worker` that generates for up to `n_seq` tickets at once in batched steps of at most
    `ubatch` tokens; `cache_prompt`: with the prefix cache."""

    def __init__(
        self, model: LoadedModel, max_queue: int, metrics: Metrics, n_seq: int, ubatch: int,
        cache_prompt: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(model, max_queue, metrics)
        self.cache = PagedKVCache.over(model.engine.executor.cache, n_seq, caching=cache_prompt)
        self.ubatch = ubatch
        self.running: list[Slot] = []  # in the order they came
        executor = model.engine.executor
        self.sampler = DeviceSampler(n_seq, executor.model.config.n_vocab, executor.head_device)
        self._rows = list(range(n_seq))  # the sampler's rows no slot holds
        self._in_flight: InFlight | None = None  # the ids of the last step, not read yet
        self._outbox = Outbox()  # a step's events, handed to the handlers when it ends

    @property
    def n_ctx(self) -> int:
        return self.cache.seq_ctx

    def slots(self) -> list[dict]:
        slots = [{"id": i, "n_ctx": self.n_ctx, "is_processing": False} for i in range(self.cache.n_seq)]
        for i, slot in enumerate(list(self.running)):  # a copy: the worker's thread changes the list
            state = {"n_past": slot.table.length, "n_prompt_tokens": len(slot.ticket.ids)}
            slots[i] |= {"is_processing": True} | state
        return slots

    def run(self) -> None:
        """Serve tickets until `stop`: then those in generation and those waiting get a 503."""
        while not self._stopping:
            room = self.cache.n_seq - len(self.running)
            for ticket in self._take(room, wait=not self.running):
                reply = Generation(
                    self.model.tokenizer, ticket.request, ticket.ids, self.n_ctx - len(ticket.ids) + 1,
                    ticket.constraint,
                )  # fmt: skip
                slot = Slot(ticket, reply, self._rows.pop())
                if reply.pick is None:
                    self.sampler.start(slot.row, reply.params, ticket.ids)
                slot.fed = slot.cached = self.cache.blocks.reuse(slot.table, ticket.ids)
                self.metrics.cached_tokens.inc(slot.cached)
                self.running.append(slot)
            self.metrics.running.set(len(self.running))
            self._drop_cancelled()
            if self.running:
                self._step()
        for slot in list(self.running):
            self._end(slot, ApiError(503, "the server is shutting down", "shutting_down"))
        self._outbox.flush()
        self._refuse_waiting()

    def _drop_cancelled(self) -> None:
        for slot in [s for s in self.running if s.ticket.cancelled]:
            self.metrics.cancelled.inc()
            self._end(slot)

    def _chunks(self) -> list[tuple[Slot, Chunk]]:
        """This step's work: every decoding slot's token, then prompt chunks within the -ub budget."""
        work = [(s, Chunk(s.table, self._last(s))) for s in self.running if s.decoding]
        budget = self.ubatch - len(work)
        for slot in (s for s in self.running if s.prefilling):
            if budget <= 0:
                break
            ids = slot.ticket.ids[slot.fed : slot.fed + budget]
            budget -= len(ids)
            work.append((slot, Chunk(slot.table, ids, logits=slot.fed + len(ids) == len(slot.ticket.ids))))
        return work

    def _last(self, slot: Slot) -> list[int] | torch.Tensor:
        """The id a decoding slot runs next: picked on the host, or left on the device by the sampler."""
        if slot.reply.pick is not None:
            return slot.reply.history[-1:]
        return self.sampler.last[slot.row : slot.row + 1]

    def _step(self) -> None:
        """Issue the next step, then read the one before (its slots' tokens delivered and committed)."""
        t0 = time.perf_counter()
        work, previous, self._in_flight = self._chunks(), self._in_flight, None
        prompts = [slot.prefilling for slot, _ in work]
        t1 = time.perf_counter()
        forward = self._run(work) if work else 0.0
        t2 = time.perf_counter()
        waited = self._settle(previous) if previous is not None else 0.0
        t3 = time.perf_counter()
        self._outbox.flush()
        t4 = time.perf_counter()
        seconds = t4 - t0  # an issue and a read: a step's time when steps follow on
        parts = {
            "plan": t1 - t0, "forward": forward, "sample": t2 - t1 - forward, "wait": waited,
            "text": t3 - t2 - waited, "hand_over": t4 - t3,
        }  # fmt: skip
        with_prompt = any(prompts)
        for part, spent in parts.items():
            self.metrics.batch_step_seconds.labels(part).inc(spent)
            if with_prompt:
                self.metrics.prompt_step_seconds.labels(part).inc(spent)
        self.metrics.batch_steps.inc()
        if with_prompt:
            self.metrics.prompt_steps.inc()
        for (slot, chunk), prompt in zip(work, prompts, strict=True):
            t = slot.timings
            if prompt:
                t.prompt_tokens, t.prompt_seconds = (
                    t.prompt_tokens + len(chunk.ids),
                    t.prompt_seconds + seconds,
                )
            else:
                t.gen_tokens, t.gen_seconds = t.gen_tokens + 1, t.gen_seconds + seconds

    def _run(self, work: list[tuple[Slot, Chunk]]) -> float:
        """Run `work`'s step: the slots sampled on the device get their next ids there (in flight to
        the host), the others theirs from their logits on the host. The seconds the forward took to
        issue (on a CPU: to run)."""
        t0 = time.perf_counter()
        try:
            logits = forward_batch(
                self.model.engine.executor, self.cache, [c for _, c in work], on_device=True
            )
        except LlmxError as e:
            for slot, _ in work:
                self._end(slot, ApiError(400, first_line(e)))
            return time.perf_counter() - t0
        except Exception as e:  # a bug: the clients hear of it, the server goes on
            log.exception("a batched step failed")
            for slot, _ in work:
                self._end(slot, ApiError(500, f"internal error: {first_line(e)}"))
            return time.perf_counter() - t0
        forward = time.perf_counter() - t0
        for slot, chunk in work:
            if slot.prefilling:
                slot.fed += len(chunk.ids)
        wanted = [slot for slot, chunk in work if chunk.logits]  # logits' rows, in order
        on_device = [k for k, s in enumerate(wanted) if s.reply.pick is None]
        if on_device:
            slots = [wanted[k] for k in on_device]
            every = len(slots) == len(wanted)
            rows = logits if every else logits[torch.tensor(on_device).to(logits.device, non_blocking=True)]
            ids = self.sampler(rows, [s.row for s in slots])
            for slot in slots:
                slot.sampled += 1
            self._in_flight = slots, HostCopy(ids)
        on_host = [k for k, s in enumerate(wanted) if s.reply.pick is not None]
        if on_host:
            for k, row in zip(on_host, logits[on_host].cpu(), strict=True):
                self._deliver(wanted[k], wanted[k].reply.step(row))
        return forward

    def _settle(self, in_flight: InFlight) -> float:
        """Hand the ids of an earlier step to their replies; a slot whose reply goes on ran its id in
        the step just issued, which its table now records (one that ended meanwhile is skipped). The
        seconds spent waiting for the ids."""
        slots, copy = in_flight
        t0 = time.perf_counter()
        tokens = copy.values()
        waited = time.perf_counter() - t0
        for slot, token in zip(slots, tokens, strict=True):
            if slot not in self.running:  # cancelled, or failed, while its id was on its way
                continue
            events = slot.reply.push(token)
            if not slot.reply.done:
                self.cache.blocks.commit(slot.table, [token])
            self._deliver(slot, events)
        return waited

    def _deliver(self, slot: Slot, events: list[Piece | Done]) -> None:
        for event in events:
            if isinstance(event, Done):
                self._outbox.put(slot.ticket, replace(event, cached_tokens=slot.cached))
                self._end(slot)
            else:
                self._outbox.put(slot.ticket, event)

    def _end(self, slot: Slot, error: ApiError | None = None) -> None:
        """Take `slot` out of the batch, its blocks back to the pool, `error` sent if there is one."""
        if error is not None:
            self._outbox.put(slot.ticket, error)
        self.cache.blocks.free(slot.table)
        self.running.remove(slot)
        self._rows.append(slot.row)
        self.metrics.add(slot.timings, slot.reply.generated)  # first: a client that sees the request
        self.metrics.running.set(len(self.running))  # no longer processing finds its tokens counted
