"""The OpenAI-compatible request and response shapes, as pure functions over JSON-ready data.

`decode_body` turns request bytes into JSON a handler can trust (no lone surrogates, no absurd
nesting); `parse_request` turns that into a `Request` or raises `LlmxError` with one line saying
which field is wrong; `Reply` builds the response objects. No HTTP, no model: `llmx.server.app`
does those.
"""

from __future__ import annotations

import json
import math
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from llmx.errors import LlmxError

Kind = Literal["chat", "completion"]
MAX_STOPS = 4  # as OpenAI's API
MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}  # as OpenAI's API
MAX_DEPTH = 32  # of nested JSON: OpenAI's requests nest 6 deep; more is an attack or a bug
DEFAULT_MAX_TOKENS = 256
SEEDS = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes
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
INTEGER_FIELDS = ("top_k", "seed")


@dataclass(frozen=True)
class Request:
    kind: Kind
    messages: tuple[dict[str, str], ...] = ()  # chat
    prompt: str = ""  # completion
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: dict[str, Any] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    top_logprobs: int | None = None  # None: no logprobs; 0: the chosen token's only
    schema: dict[str, Any] | None = None  # response_format: the JSON schema the reply must follow


# --- request bodies ----------------------------------------------------------------------------


def decode_body(raw: bytes) -> Any:
    """The JSON of a request body, refused (LlmxError) when it is not JSON, nests deeper than
    MAX_DEPTH, or holds a string that is not Unicode text (a lone UTF-16 surrogate, which JSON's
    `\\ud800` escapes can spell but no UTF-8 encoder takes)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise LlmxError(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise LlmxError("the request body is not valid JSON") from None
    except ValueError:  # Python's cap on the digits of an integer it reads
        limit = sys.get_int_max_str_digits()
        raise LlmxError(f"the request body holds an integer of more than {limit} digits") from None
    todo = [(body, 1)]
    while todo:  # a loop, not recursion: the depth is what is being checked
        value, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise LlmxError(f"the request body nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key)
                todo.append((item, depth + 1))
        elif isinstance(value, list):
            todo += [(item, depth + 1) for item in value]
    return body


def _no_constant(name: str) -> None:
    raise LlmxError(f"the request body holds {name}, which is not JSON (use a finite number)")


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise LlmxError(
            f"a string in the request body holds a lone UTF-16 surrogate (U+{ord(text[e.start]):04X}); "
            "send Unicode text"
        ) from None


def parse_request(kind: Kind, body: Any, takes_tools: bool = False) -> Request:
    """A request body (decoded JSON) for /v1/chat/completions or /v1/completions, checked.
    `takes_tools`: whether the model's chat template renders tools."""
    if not isinstance(body, dict):
        raise LlmxError("the request body must be a JSON object")
    messages: tuple[dict[str, str], ...] = ()
    prompt = ""
    if kind == "chat":
        messages = _messages(body.get("messages"))
        _refuse_tools(body.get("tools"), takes_tools)
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
        raise LlmxError(f"'max_tokens' must be a positive integer, got {_shown(limit)}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise LlmxError(f"'stream' must be true or false, got {_shown(stream)}")
    return Request(
        kind,
        messages,
        prompt,
        limit,
        _sampling(body),
        _stops(body.get("stop")),
        stream,
        _include_usage(body.get("stream_options"), stream),
        _top_logprobs(kind, body),
        _schema(body.get("response_format")),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A value a client sent, short enough for a one-line message (it may be a 4000-digit number)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _sampling(body: dict) -> dict[str, Any]:
    sampling = {}
    for name, param in SAMPLING_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        if name in INTEGER_FIELDS:
            if not _is_int(value):
                raise LlmxError(f"'{name}' must be an integer, got {_shown(value)}")
        elif not _finite(value):
            raise LlmxError(f"'{name}' must be a finite number, got {_shown(value)}")
        sampling[param] = value
    if sampling.get("temperature", 0) < 0:
        raise LlmxError(f"'temperature' must be >= 0, got {sampling['temperature']}")
    seed = sampling.get("seed")
    if seed is not None and not SEEDS[0] <= seed < SEEDS[1]:
        raise LlmxError(f"'seed' must be in [-2**63, 2**64), got {_shown(seed)}")
    return sampling


def _finite(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer too large for a float
        return False


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise LlmxError("'stream_options' is only allowed with 'stream': true")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise LlmxError("'stream_options' must be an object like {\"include_usage\": true}")
    return options.get("include_usage", False)


def _top_logprobs(kind: Kind, body: dict) -> int | None:
    """How many alternatives each token's logprobs list, or None for no logprobs. Chat asks with
    `logprobs: true` and `top_logprobs: N`; the legacy completions API with `logprobs: N`."""
    top, most = body.get("logprobs"), MAX_TOP_LOGPROBS[kind]
    if kind == "chat":
        if top is None or top is False:
            if body.get("top_logprobs") is not None:
                raise LlmxError("'top_logprobs' needs 'logprobs': true")
            return None
        if top is not True:
            raise LlmxError(f"'logprobs' must be true or false, got {_shown(top)}")
        top = body.get("top_logprobs") or 0
    elif top is None:
        return None
    if not _is_int(top) or not 0 <= top <= most:
        name = "top_logprobs" if kind == "chat" else "logprobs"
        raise LlmxError(f"'{name}' must be an integer from 0 to {most}, got {_shown(top)}")
    return top


def _refuse_tools(tools: Any, takes_tools: bool) -> None:
    """Tools are refused rather than dropped: a client that sends them expects `tool_calls` back."""
    if not tools:
        return
    if not takes_tools:
        raise LlmxError("'tools': this model's chat template does not take tools; send none")
    raise LlmxError("'tools': tool calls are not parsed from the reply yet; send none")


def _schema(value: Any) -> dict[str, Any] | None:
    """The JSON schema of a `response_format` (`json_object`: any object), None for plain text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None  # OpenAI: no schema, any JSON
        if isinstance(schema, dict):
            return schema
        raise LlmxError("'response_format.json_schema' must be an object with a 'schema' object")
    raise LlmxError("'response_format.type' must be text, json_object or json_schema")


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

LOWEST_LOGPROB = -9999.0  # OpenAI's floor: JSON has no -inf


@dataclass(frozen=True)
class Candidate:
    """A token as logprobs show it: its text, its bytes (part of a character, maybe) and log p."""

    text: str
    data: bytes
    logprob: float

    def chat(self) -> dict[str, Any]:
        return {"token": self.text, "logprob": max(self.logprob, LOWEST_LOGPROB), "bytes": list(self.data)}


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the `top` most likely tokens at its step."""

    chosen: Candidate
    top: tuple[Candidate, ...]


def chat_logprobs(tokens: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [t.chosen.chat() | {"top_logprobs": [c.chat() for c in t.top]} for t in tokens]}


def completion_logprobs(tokens: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions API's columns; `offset`: where the first token's text starts in the reply."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.chosen.text)
    return {
        "tokens": [t.chosen.text for t in tokens],
        "token_logprobs": [max(t.chosen.logprob, LOWEST_LOGPROB) for t in tokens],
        "top_logprobs": [{c.text: max(c.logprob, LOWEST_LOGPROB) for c in t.top} for t in tokens],
        "text_offset": offsets,
    }


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

    def _logprobs(self, tokens: list[TokenLogprob] | None, offset: int) -> dict[str, Any] | None:
        if tokens is None:
            return None
        return chat_logprobs(tokens) if self.kind == "chat" else completion_logprobs(tokens, offset)

    def body(
        self,
        text: str,
        finish_reason: str,
        usage: dict[str, Any],
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict:
        """The whole (non-streamed) response with its `usage` (`usage()`); `logprobs` None: not asked
        for."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(logprobs, 0)
        return self._head(False) | {"choices": [choice], "usage": usage}

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
        offset: int = 0,
    ) -> dict:
        """One streamed piece; `first` opens a chat reply with the assistant's role; `offset`: where
        `text` starts in the whole reply (for the completions API's text_offset)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if self.kind == "chat":
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = self._logprobs(logprobs, offset)
        return self._head(True) | {"choices": [choice]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict:
        """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
        return self._head(True) | {"choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens whose keys and values were reused."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
