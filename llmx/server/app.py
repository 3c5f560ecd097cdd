"""The FastAPI application: HTTP in, `llmx.server.protocol` for the shapes, the `Worker` for tokens.

Handlers are coroutines that never block the event loop: bodies are decoded and prompts tokenized on
a small pool of text threads, generation happens on the worker's thread, and a handler only waits
for events. So /health answers at once however many requests wait. A client that leaves (or runs past
--timeout) cancels its ticket, and the worker stops within a step. Every error, unknown paths included,
is OpenAI's error object with its status.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import llmx
from llmx.errors import LlmxError, first_line
from llmx.plan.report import layer_ranges
from llmx.server.choices import Choices, ChoiceText, stream, whole
from llmx.server.errors import ApiError, error_body
from llmx.server.metrics import CONTENT_TYPE, Metrics
from llmx.server.page import add_page, is_page
from llmx.server.protocol import Kind, Reply, decode_body, parse_request
from llmx.server.protocol import Request as Job
from llmx.server.worker import Ticket, Worker
from llmx.text.chat import tool_format as template_tool_format
from llmx.text.grammar import Constraint, Grammars
from llmx.text.sampler import SamplingParams
from llmx.text.tool_calls import forced_call_grammar

TEXT_THREADS = 2  # decode and tokenize bodies: a 4 MiB prompt takes seconds, /health must not wait
OPEN_PATHS = frozenset({"/health"})  # answered without the API key (load balancers probe it)
CLIENT_GONE = 499  # nginx's status for a request its client closed; only the metrics see it

T = TypeVar("T")


@dataclass(frozen=True)
class ServerConfig:
    model_id: str  # the name /v1/models lists and replies carry (--alias)
    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 4 << 20
    timeout: float | None = None  # seconds a request may take, waiting included; None: no limit
    hosts: frozenset[str] | None = None  # the Host header's names allowed (a loopback server's); None: any
    cors_origin: str | None = None  # the one web origin whose pages may call the API (--cors)


def make_app(worker: Worker, config: ServerConfig) -> FastAPI:
    """The application in front of `worker` (whose `run` some thread must be running)."""
    model, metrics = worker.model, worker.metrics
    app = FastAPI(title="llmx", version=llmx.__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Gate, config=config, metrics=metrics)
    if config.cors_origin is not None:  # outside the gate: a browser's preflight carries no API key
        app.add_middleware(
            CORSMiddleware, allow_origins=[config.cors_origin], allow_methods=["*"], allow_headers=["*"]
        )
    text_threads = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="llmx-text")
    tool_format = template_tool_format(model.tokenizer)
    grammars = Grammars(model.tokenizer)
    n_ctx = worker.n_ctx
    # the plan it loaded with (fixed for the server's life), with the report's layer ranges
    placement = model.plan.to_dict() | {"layer_ranges": layer_ranges(model.plan)}

    async def off_loop(fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(text_threads, fn, *args)

    async def body_of(request: Request) -> Any:
        return await off_loop(decode_body, await _read(request, config.max_body_bytes))

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers())

    @app.exception_handler(LlmxError)
    async def bad_request(_: Request, e: LlmxError) -> JSONResponse:
        return JSONResponse(error_body(first_line(e)), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = f"no such path: {request.url.path}" if e.status_code == 404 else str(e.detail)
        return JSONResponse(error_body(message, e.status_code), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(f"invalid request: {e.errors()[0]['msg']}", 422), status_code=422)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {first_line(e)}", 500), status_code=500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    def model_card() -> dict:
        meta = {
            "n_ctx": n_ctx,
            "n_ctx_train": model.config.n_ctx_train,
            "n_vocab": model.config.n_vocab,
            "size": model.file.nbytes,
        }
        return {"id": config.model_id, "object": "model", "owned_by": "llmx", "meta": meta}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name}")
    async def one_model(name: str) -> dict:
        if name != config.model_id:
            raise ApiError(
                404, f"no model {name!r}: this server serves {config.model_id!r}", "model_not_found"
            )
        return model_card()

    @app.get("/props")
    async def props() -> dict:
        return {
            "model_alias": config.model_id,
            "model_path": str(model.file.path),
            "n_ctx": n_ctx,
            "total_slots": len(worker.slots()),
            "chat_template": model.tokenizer.chat_template or "",
            "build_info": f"llmx {llmx.__version__}",
            "default_generation_settings": vars(SamplingParams()),
        }

    @app.get("/slots")
    async def slots() -> list[dict]:
        """llama-server's slot list."""
        return worker.slots()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/stats")
    async def stats() -> dict:
        """/metrics' throughput counters as JSON (the chat page's live panel)."""
        return metrics.snapshot()

    @app.get("/placement")
    async def where() -> dict:
        """Where the loaded model's tensors, layers and KV cache are: `llmx plan --json`'s data."""
        return placement

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await body_of(request)
        content = body.get("content") if isinstance(body, dict) else None
        if not isinstance(content, str):
            raise LlmxError("'content' must be a string")
        add_special = body.get("add_special", False)
        if not isinstance(add_special, bool):
            raise LlmxError("'add_special' must be true or false")
        return {"tokens": await off_loop(model.tokenizer.encode, content, add_special)}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await body_of(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        vocab = model.tokenizer.vocab_size
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < vocab for i in ids):
            raise LlmxError(f"'tokens' must be a list of token ids in [0, {vocab})")
        return {"content": await off_loop(model.tokenizer.decode, ids)}

    def prompt_ids(job: Job) -> list[int]:
        if job.kind == "chat":
            ids = model.chat_prompt(list(job.messages), list(job.tools) or None)
        else:
            ids = model.encode(job.prompt)
        if len(ids) >= n_ctx:
            raise LlmxError(
                f"the prompt has {len(ids)} tokens but the context holds {n_ctx}; "
                "shorten it, or restart the server with a larger -c"
            )
        return ids

    def constraint(job: Job) -> Constraint | None:
        """The grammar the reply must follow: response_format's schema, or the calls tool_choice
        requires, in the format the template teaches."""
        if job.tool_choice == "required" and tool_format is not None:
            source = forced_call_grammar(tool_format, list(job.tools), job.tool_name, job.parallel_tool_calls)
            return grammars.compile_lark(source, "'tools': the calls' grammar")
        return None if job.schema is None else grammars.compile(job.schema)

    async def complete(kind: Kind, request: Request) -> Response:
        job = parse_request(kind, await body_of(request), tool_format)
        SamplingParams(**job.sampling)  # out-of-range values fail here, before the request waits
        loop = asyncio.get_running_loop()
        grammar = await off_loop(constraint, job)
        ids = await off_loop(prompt_ids, job)
        # every choice has its own grammar state
        forks: list[Constraint | None] = (
            [None] * job.n if grammar is None else [grammar] + [grammar.fork() for _ in range(job.n - 1)]
        )
        tickets = [Ticket(job.for_choice(i), ids, loop, forks[i]) for i in range(job.n)]
        choices = Choices(tickets)
        deadline = None if config.timeout is None else loop.time() + config.timeout
        worker.submit(*tickets)
        # Until the response starts, nothing else notices a client that leaves: watch for it here.
        gone = asyncio.ensure_future(_disconnected(request))
        streaming = False
        try:
            first = await choices.next(deadline, gone)
            if first is None:
                return Response(status_code=CLIENT_GONE)
            reply = Reply(config.model_id, kind, job.return_tokens)
            texts = [ChoiceText(reply, i, tool_format if job.tools else None) for i in range(job.n)]
            if job.stream:
                streaming = True  # from here the stream's `finally` cancels the tickets
                events = stream(choices, texts, first, deadline, job.include_usage)
                return StreamingResponse(events, media_type="text/event-stream")
            body = await whole(choices, texts, first, deadline, gone, job.top_logprobs)
            return Response(status_code=CLIENT_GONE) if body is None else JSONResponse(body)
        finally:
            gone.cancel()
            if not streaming:
                choices.cancel()  # done, or ended early (an error, a time-out): the worker stops

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete("completion", request)

    add_page(app)
    return app


async def _read(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past `limit` bytes before more of it is read."""
    too_big = ApiError(413, f"the request body is larger than {limit} bytes (--max-body)", "body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Gate:
    """ASGI middleware: what a request must show before anything reads it, and the count of answers
    by status. Plain ASGI, not Starlette's BaseHTTPMiddleware, so that streams and disconnects pass
    through untouched.

    A web page the user visits can send requests to a server on their machine: with a name that
    resolves to 127.0.0.1 (DNS rebinding), which the Host check refuses, or as a cross-origin "simple"
    request, which may not carry `Content-Type: application/json`: the JSON-only rule refuses those."""

    def __init__(self, app: ASGIApp, config: ServerConfig, metrics: Metrics) -> None:
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self._refusal(scope)
        if refused is not None:
            await JSONResponse(refused.body(), status_code=refused.status)(scope, receive, send)
            self.metrics.requests.labels(str(refused.status)).inc()
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)

    def _refusal(self, scope: Scope) -> ApiError | None:
        headers = dict(scope["headers"])
        hosts = self.config.hosts
        host = headers.get(b"host", b"").decode("latin-1")
        if hosts is not None and _host_name(host) not in hosts:
            return ApiError(
                403, f"this server answers to {', '.join(sorted(hosts))}, not {host!r}", "bad_host"
            )
        key = self.config.api_key
        given = headers.get(b"authorization", b"")
        if (
            key is not None
            and scope["path"] not in OPEN_PATHS
            and not is_page(scope["path"])
            and not hmac.compare_digest(given, b"Bearer " + key.encode())
        ):
            return ApiError(
                401, "a valid API key is needed: send 'Authorization: Bearer KEY'", "invalid_api_key"
            )
        content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if scope["method"] == "POST" and content_type != b"application/json":
            return ApiError(415, "send the body as JSON, with 'Content-Type: application/json'", "not_json")
        return None


def _host_name(host: str) -> str:
    """A Host header's name without its port (`[::1]:8080` -> `[::1]`)."""
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() else host
