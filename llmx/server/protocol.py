"""The OpenAI-compatible request and response shapes, as pure functions over JSON-ready data.

`parse_request` turns a decoded request body into a `Request` or raises `LlmxError` with one line
saying which field is wrong; the `*_body` and `*_chunk` functions build the response objects. No
HTTP, no model: `llmx.server.app` does those.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from llmx.errors import LlmxError

Kind = Literal["chat", "completion"]
MAX_STOPS = 4  # as OpenAI's API
DEFAULT_MAX_TOKENS = 256
# OpenAI's sampling fields -> llmx's SamplingParams names (the rest keep llama.cpp's defaults)
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repeat_penalty": "repeat_penalty",
}


@dataclass(frozen=True)
class Request:
    kind: Kind
    messages: tuple[dict[str, str], ...] = ()  # chat
    prompt: str = ""  # completion
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: dict[str, Any] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stream: bool = False


def parse_request(kind: Kind, body: Any) -> Request:
    """A request body (decoded JSON) for /v1/chat/completions or /v1/completions, checked."""
    if not isinstance(body, dict):
        raise LlmxError("the request body must be a JSON object")
    messages: tuple[dict[str, str], ...] = ()
    prompt = ""
    if kind == "chat":
        messages = _messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise LlmxError("'prompt' must be a non-empty string")
    if body.get("n", 1) != 1:
        raise LlmxError("'n' must be 1: this server returns one choice")
    limit = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
    if limit is None:
        limit = DEFAULT_MAX_TOKENS
    if not _is_int(limit) or limit < 1:
        raise LlmxError(f"'max_tokens' must be a positive integer, got {limit!r}")
    sampling = {}
    for name, param in SAMPLING_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        if name in ("top_k", "seed"):
            if not _is_int(value):
                raise LlmxError(f"'{name}' must be an integer, got {value!r}")
        elif not isinstance(value, int | float) or isinstance(value, bool):
            raise LlmxError(f"'{name}' must be a number, got {value!r}")
        sampling[param] = value
    if sampling.get("temperature", 0) < 0:
        raise LlmxError(f"'temperature' must be >= 0, got {sampling['temperature']}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise LlmxError(f"'stream' must be true or false, got {stream!r}")
    return Request(kind, messages, prompt, limit, sampling, _stops(body.get("stop")), stream)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise LlmxError("'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise LlmxError(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: only text ones are understood here
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise LlmxError(f"messages[{i}].content: only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise LlmxError(f"messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise LlmxError("'stop' must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise LlmxError(f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}")
    return tuple(stops)


class StopScanner:
    """Text pieces in, text out, ended at the first stop string (which is not returned). Text that
    could be the start of a stop string is held back until the next piece says otherwise."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.stopped = stops, False
        self._held = ""

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)]
        keep = max((_partial(text, s) for s in self.stops), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _partial(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop` (0 if none)."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0


# --- responses ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What a response carries: its id, creation time and model name."""

    model: str
    kind: Kind
    id: str = field(default_factory=lambda: f"llmx-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        # OpenAI streams completions as text_completion objects too; chat pieces are chunks
        obj = "text_completion" if self.kind == "completion" else "chat.completion" + ".chunk" * chunk
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        """The whole (non-streamed) response."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return self._head(False) | {"choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        """One streamed piece; `first` opens a chat reply with the assistant's role."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if self.kind == "chat":
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._head(True) | {"choices": [choice]}


def error_body(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}
