"""The network side of `llmx bench-serve`: requests to a running OpenAI-compatible server.

Streams go through the official `openai` async client (which parses the server-sent events); the
llama-server endpoints outside OpenAI's API (`/tokenize`) and `/v1/models` through `httpx`. Every
failure (no server, a 4xx/5xx, an error inside a stream) becomes one `LlmxError` line.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import httpx
import openai

from llmx.bench.serve_stats import Streamed
from llmx.bench.serve_workload import Workload
from llmx.errors import LlmxError, first_line

TIMEOUT_S = 600.0  # `llmx serve`'s own default --timeout: a request may wait in its queue that long

T = TypeVar("T")


class Client:
    """One server at `url` (`http://host:port`, or the OpenAI base URL `http://host:port/v1`), with
    its API key; use as `async with Client(...)`."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No connection cap: the benchmark's --clients is what limits concurrent requests.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(base_url=self.url, headers=auth, timeout=TIMEOUT_S, limits=limits)
        self.openai = openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=api_key or "none", max_retries=0, timeout=TIMEOUT_S
        )

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()
        await self.openai.close()

    @contextlib.contextmanager
    def _answers(self, what: str) -> Iterator[None]:
        """Turns a failed `what` into one LlmxError line."""
        try:
            yield
        except (httpx.TransportError, openai.APIConnectionError) as e:
            cause = first_line(e.__cause__ or e)
            raise LlmxError(
                f"cannot reach a server at {self.url} ({cause}); is `llmx serve` running?"
            ) from None
        except openai.APIStatusError as e:
            raise LlmxError(f"{what}: the server answered {e.status_code}: {_message(e.body)}") from None
        except httpx.HTTPStatusError as e:
            raise LlmxError(
                f"{what}: the server answered {e.response.status_code}: {_message(_json(e.response))}"
            ) from None
        except openai.APIError as e:  # an error event inside a stream that had begun
            raise LlmxError(f"{what}: the stream ended with an error: {e.message}") from None

    async def _request(self, what: str, method: str, path: str, body: Any = None) -> Any:
        with self._answers(what):
            response = await self.http.request(method, path, json=body)
            response.raise_for_status()
            return response.json()

    async def model(self) -> str:
        """The name of the model the server serves (the first /v1/models lists)."""
        listed = await self._request("listing the models", "GET", "/v1/models")
        return listed["data"][0]["id"]

    async def metrics(self) -> str | None:
        """The server's /metrics text, or None where it gives none (an error status: llama-server
        without --metrics answers 501)."""
        with self._answers("/metrics"):
            response = await self.http.get("/metrics")
            return None if response.is_error else response.text

    async def count_tokens(self, text: str, add_special: bool) -> int:
        """How many tokens the server's tokenizer makes of `text`; `add_special`: with the BOS/EOS it
        adds to a prompt."""
        body = {"content": text, "add_special": add_special}
        return len((await self._request("/tokenize", "POST", "/tokenize", body))["tokens"])

    async def stream(
        self, what: str, model: str, prompt: str, max_tokens: int, start: float,
        top_logprobs: int | None = None,
    ) -> Streamed:  # fmt: skip
        """One greedy completion of `prompt`, streamed, with its token ids where the server returns them
        (llama-server's `return_tokens`, which costs it nothing), and each token's `top_logprobs` likeliest
        logprobs if asked (the server then samples on the host: for the runs alone, not under load);
        `start`: the run's start on perf_counter's clock."""
        sent = time.perf_counter()
        chunks, pieces, ids, tops, usage = [], [], [], [], None
        logprobs = {} if top_logprobs is None else {"logprobs": top_logprobs}
        with self._answers(what):
            stream = await self.openai.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"return_tokens": True},
                **logprobs,
            )
            async for chunk in stream:
                usage = chunk.usage or usage
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                if choice.text:
                    chunks.append(time.perf_counter() - sent)
                    pieces.append(choice.text)
                ids += getattr(choice, "tokens", None) or []
                if choice.logprobs is not None and choice.logprobs.top_logprobs:
                    tops += [tuple(sorted(t.values(), reverse=True)) for t in choice.logprobs.top_logprobs]
        done = time.perf_counter() - sent
        if usage is None:
            raise LlmxError(f"{what}: the server's stream has no usage (stream_options.include_usage)")
        return Streamed(
            sent - start, tuple(chunks), done, usage.prompt_tokens, usage.completion_tokens, "".join(pieces),
            tuple(ids), tuple(tops),
        )  # fmt: skip


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _message(body: Any) -> str:
    """The first line of an error body's message: OpenAI's `{"error": {"message": ...}}`, or the body."""
    inner = body.get("error", body) if isinstance(body, dict) else body
    text = (
        inner["message"] if isinstance(inner, dict) and isinstance(inner.get("message"), str) else str(inner)
    )
    return (text.strip().splitlines() or ["(no message)"])[0]


async def _all(jobs: Sequence[Awaitable[T]]) -> list[T]:
    """The results of `jobs` run concurrently; the first to fail cancels the others and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(job) for job in jobs]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


async def prompt_words(client: Client, words: Sequence[str], n_tokens: int) -> tuple[list[str], int]:
    """The `words` that are one token each after a space, and how many of them make a prompt of
    `n_tokens` tokens as the server counts it (its BOS/EOS included)."""
    counts = await _all([client.count_tokens(" " + w, False) for w in words])
    ones = [w for w, n in zip(words, counts, strict=True) if n == 1]
    n_words = n_tokens - await client.count_tokens("", True)
    if not ones or n_words < 1:
        raise LlmxError(
            f"cannot build prompts of {n_tokens} tokens from this server's tokenizer "
            f"({len(ones)} of {len(words)} words are one token; {n_tokens - n_words} tokens are added)"
        )
    return ones, n_words


async def check_prompt_lengths(client: Client, prompts: Sequence[str], n_tokens: int) -> None:
    """Refuses prompts the server does not count as `n_tokens` tokens (a tokenizer that joins words)."""
    counts = await _all([client.count_tokens(p, True) for p in prompts])
    wrong = [(k, n) for k, n in enumerate(counts) if n != n_tokens]
    if wrong:
        k, n = wrong[0]
        raise LlmxError(
            f"prompt {k} is {n} tokens, not {n_tokens}: this server's tokenizer joins words across spaces"
        )


async def load_run(
    client: Client,
    model: str,
    work: Workload,
    clients: int,
    max_tokens: int,
    tick: Callable[[], None],
) -> tuple[list[Streamed], float]:
    """Every request of `work` sent at its arrival time by at most `clients` at once (a request that
    arrives while all are busy waits for one); the streams and the seconds from start to the last end."""
    busy = asyncio.Semaphore(clients)
    start = time.perf_counter()

    async def one(i: int) -> Streamed:
        await asyncio.sleep(start + work.arrivals[i] - time.perf_counter())
        async with busy:
            streamed = await client.stream(
                f"request {i}", model, work.prompts[work.prompt_of[i]], max_tokens, start
            )
        tick()
        return streamed

    streams = await _all([one(i) for i in range(len(work.arrivals))])
    return streams, time.perf_counter() - start


async def alone(
    client: Client, model: str, prompts: Sequence[str], max_tokens: int, tick: Callable[[], None]
) -> list[Streamed]:
    """What each prompt gets served alone, one request at a time, with each token's two likeliest
    logprobs (how near a tie each choice was: `serve_check`)."""
    replies = []
    for k, prompt in enumerate(prompts):
        what, now = f"prompt {k} alone", time.perf_counter()
        replies.append(await client.stream(what, model, prompt, max_tokens, now, top_logprobs=2))
        tick()
    return replies
