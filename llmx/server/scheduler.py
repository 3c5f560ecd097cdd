"""Continuous batching (`-np N`): up to N requests generated at once, one batched step at a time.

Every step runs, in one forward over the paged KV cache (`runtime.batch`), the next token of each slot
whose prompt is done and, within `-ub` tokens in all, the next chunks of prompts still being
prefilled, oldest request first: a long prompt is cut into chunks that share steps with the others'
decode tokens, so it never stalls them for its whole length. Waiting requests take free slots at step
boundaries. A request that finishes, is cancelled (its client left, or timed out) or fails gives its
blocks back before the next step. Sampling is per request, on the host (`server.generation`).

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

from llmx.api import LoadedModel
from llmx.engine import Timings
from llmx.errors import LlmxError, first_line
from llmx.runtime.batch import Chunk, forward_batch
from llmx.runtime.blocks import BlockTable
from llmx.runtime.paged import PagedKVCache
from llmx.server.errors import ApiError
from llmx.server.generation import Done, Generation, Piece
from llmx.server.metrics import Metrics
from llmx.server.worker import Ticket, Worker

log = logging.getLogger("llmx.server")


@dataclass(eq=False)
class Slot:
    """A request in generation: its ticket, its text side, its blocks, how much of its prompt has run
    (or was `cached`), and its engine counters (a step's seconds count for every request in it: the
    time each waited)."""

    ticket: Ticket
    reply: Generation
    table: BlockTable = field(default_factory=BlockTable)
    fed: int = 0
    cached: int = 0
    timings: Timings = field(default_factory=Timings)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.ticket.ids)


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
                slot = Slot(ticket, reply)
                slot.fed = slot.cached = self.cache.blocks.reuse(slot.table, ticket.ids)
                self.metrics.cached_tokens.inc(slot.cached)
                self.running.append(slot)
            self.metrics.running.set(len(self.running))
            self._drop_cancelled()
            if self.running:
                self._step()
        for slot in list(self.running):
            self._end(slot, ApiError(503, "the server is shutting down", "shutting_down"))
        self._refuse_waiting()

    def _drop_cancelled(self) -> None:
        for slot in [s for s in self.running if s.ticket.cancelled]:
            self.metrics.cancelled.inc()
            self._end(slot)

    def _chunks(self) -> list[tuple[Slot, Chunk]]:
        """This step's work: every decoding slot's token, then prompt chunks within the -ub budget."""
        work = [(s, Chunk(s.table, s.reply.history[-1:])) for s in self.running if not s.prefilling]
        budget = self.ubatch - len(work)
        for slot in (s for s in self.running if s.prefilling):
            if budget <= 0:
                break
            ids = slot.ticket.ids[slot.fed : slot.fed + budget]
            budget -= len(ids)
            work.append((slot, Chunk(slot.table, ids, logits=slot.fed + len(ids) == len(slot.ticket.ids))))
        return work

    def _step(self) -> None:
        work = self._chunks()
        t0 = time.perf_counter()
        try:
            logits = forward_batch(self.model.engine.executor, self.cache, [c for _, c in work])
        except LlmxError as e:
            for slot, _ in work:
                self._end(slot, ApiError(400, first_line(e)))
            return
        except Exception as e:  # a bug: the clients hear of it, the server goes on
            log.exception("a batched step failed")
            for slot, _ in work:
                self._end(slot, ApiError(500, f"internal error: {first_line(e)}"))
            return
        seconds = time.perf_counter() - t0
        rows = iter(logits)
        for slot, chunk in work:
            t = slot.timings
            if slot.prefilling:
                slot.fed += len(chunk.ids)
                t.prompt_tokens, t.prompt_seconds = (
                    t.prompt_tokens + len(chunk.ids),
                    t.prompt_seconds + seconds,
                )
            else:
                t.gen_tokens, t.gen_seconds = t.gen_tokens + 1, t.gen_seconds + seconds
            if chunk.logits:
                self._deliver(slot, slot.reply.step(next(rows)))

    def _deliver(self, slot: Slot, events: list[Piece | Done]) -> None:
        for event in events:
            if isinstance(event, Done):
                slot.ticket.put(replace(event, cached_tokens=slot.cached))
                self._end(slot)
            else:
                slot.ticket.put(event)

    def _end(self, slot: Slot, error: ApiError | None = None) -> None:
        """Take `slot` out of the batch, its blocks back to the pool, `error` sent if there is one."""
        if error is not None:
            slot.ticket.put(error)
        self.cache.blocks.free(slot.table)
        self.running.remove(slot)
        self.metrics.add(slot.timings, slot.reply.generated)  # first: a client that sees the request
        self.metrics.running.set(len(self.running))  # no longer processing finds its tokens counted
