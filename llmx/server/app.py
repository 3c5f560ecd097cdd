"""The FastAPI application: HTTP in, `llmx.server.protocol` for the shapes, the loaded model for text.

Errors a client can cause (bad JSON, a wrong field, a prompt longer than the context) are HTTP 400
with one line in OpenAI's error object; the model's state is reset before every request, so a
failed one leaves nothing behind.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from llmx.api import LoadedModel
from llmx.errors import LlmxError
from llmx.server.protocol import Kind, Reply, StopScanner, error_body, parse_request
from llmx.server.protocol import Request as Job
from llmx.text.sampler import SamplingParams
from llmx.text.tokenizer import StreamDecoder


def make_app(model: LoadedModel, model_id: str) -> FastAPI:
    """The application serving `model` under the name `model_id`."""
    app = FastAPI(title="llmx", version="0")
    turn = threading.Lock()  # one sequence at a time: the engine holds one KV cache

    @app.exception_handler(LlmxError)
    async def bad_request(_: Request, e: LlmxError) -> JSONResponse:
        return JSONResponse(error_body(str(e)), status_code=400)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "llmx"}]}

    async def serve(kind: Kind, request: Request) -> Any:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise LlmxError("the request body is not valid JSON") from None
        job = parse_request(kind, body)
        SamplingParams(**job.sampling)  # out-of-range values fail here, before a stream has begun
        reply = Reply(model_id, kind)
        ids = model.chat_prompt(list(job.messages)) if kind == "chat" else model.encode(job.prompt)
        if len(ids) >= model.engine.n_ctx:
            raise LlmxError(
                f"the prompt has {len(ids)} tokens but the context holds {model.engine.n_ctx}; "
                "shorten it, or restart the server with a larger -c"
            )
        if job.stream:
            return StreamingResponse(_events(model, turn, job, ids, reply), media_type="text/event-stream")
        return await run_in_threadpool(_whole, model, turn, job, ids, reply)  # the event loop stays free

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await serve("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await serve("completion", request)

    return app


def _whole(model: LoadedModel, turn: threading.Lock, job: Job, ids: list[int], reply: Reply) -> dict:
    """A reply generated to its end, as one response body."""
    with turn:
        pieces, last = [], ("", "stop", 0)
        for last in _generate(model, job, ids):
            pieces.append(last[0])
    return reply.body("".join(pieces), last[1], len(ids), last[2])


def _generate(model: LoadedModel, job: Job, ids: list[int]) -> Iterator[tuple[str, str, int]]:
    """(text piece, finish reason so far, tokens generated) as the model generates: "length" when
    max_tokens (or the context) ran out, "stop" at an end-of-turn token or a stop string."""
    decoder, scanner = StreamDecoder(model.tokenizer), StopScanner(job.stop)
    n = 0
    for token in model.stream_ids(ids, job.max_tokens, **job.sampling):
        n += 1
        piece = scanner.push(decoder.push(token))
        if scanner.stopped:
            yield piece, "stop", n
            return
        yield piece, "length" if n == job.max_tokens else "stop", n
    reason = "length" if n == job.max_tokens or model.engine.n_past >= model.engine.n_ctx else "stop"
    yield scanner.push(decoder.flush()) + scanner.flush(), reason, n


def _events(
    model: LoadedModel, turn: threading.Lock, job: Job, ids: list[int], reply: Reply
) -> Iterator[str]:
    """Server-sent events of a streamed reply, ending with OpenAI's `[DONE]`."""

    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    with turn:
        if reply.kind == "chat":
            yield event(reply.chunk(None, first=True))
        last = ("", "stop", 0)
        try:
            for last in _generate(model, job, ids):
                if last[0]:
                    yield event(reply.chunk(last[0]))
        except LlmxError as e:  # the status line is sent already: the error goes in the stream
            yield event(error_body(str(e)))
            return
        yield event(reply.chunk(None, finish_reason=last[1]))
        yield "data: [DONE]\n\n"
