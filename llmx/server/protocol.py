"""The OpenAI-compatible request and response shapes, as pure functions over JSON-ready data.

`decode_body` turns request bytes into JSON a handler can trust (no lone surrogates, no absurd
nesting); `parse_request` turns that into a `Request` or raises `LlmxError` with one line saying
which field is wrong; `Reply` builds the response objects. No HTTP, no model: `llmx.server.app`
does those.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from llmx.errors import LlmxError
from llmx.text.tool_calls import ToolFormat

Kind = Literal["chat", "completion"]
MAX_STOPS = 4  # as OpenAI's API
MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}  # as OpenAI's API
MAX_DEPTH = 32  # of nested JSON: OpenAI's requests nest 6 deep; more is an attack or a bug
DEFAULT_MAX_TOKENS = 256
MAX_N = 16  # choices per request: each is a whole generation, and each takes a place in the queue
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # as OpenAI's API
TOOL_CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function tool that states no parameters
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
    messages: tuple[dict[str, Any], ...] = ()  # chat
    prompt: str = ""  # completion
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: dict[str, Any] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    top_logprobs: int | None = None  # None: no logprobs; 0: the chosen token's only
    schema: dict[str, Any] | None = None  # response_format: the JSON schema the reply must follow
    n: int = 1  # choices
    tools: tuple[dict[str, Any], ...] = ()  # function tools the template is given and calls are read for
    tool_choice: str = "auto"  # "auto", or "required": the reply is calls (of `tool_name` only, if set)
    tool_name: str | None = None
    parallel_tool_calls: bool = True  # whether a required reply may hold several calls
    return_tokens: bool = False  # llama-server's: each choice also carries its tokens' ids ("tokens")

    def for_choice(self, index: int) -> Request:
        """The request the `index`th choice is generated for: this one, with its own seed derived
        from the request's (choice 0 keeps it), so that the choices differ and each is reproducible."""
        seed = self.sampling.get("seed")
        if seed is None or index == 0:
            return self
        seed += index
        return replace(
            self, sampling=self.sampling | {"seed": seed - (1 << 64) if seed >= SEEDS[1] else seed}
        )


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


def parse_request(kind: Kind, body: Any, tool_format: ToolFormat | None = None) -> Request:
    """A request body (decoded JSON) for /v1/chat/completions or /v1/completions, checked.
    `tool_format`: how the model's chat template writes tool calls (None: it takes no tools)."""
    if not isinstance(body, dict):
        raise LlmxError("the request body must be a JSON object")
    messages: tuple[dict[str, Any], ...] = ()
    prompt = ""
    tools: dict[str, Any] = {}
    if kind == "chat":
        messages = _messages(body.get("messages"))
        tools = _tools(body, tool_format)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise LlmxError("'prompt' must be a non-empty string")
    n = 1 if body.get("n") is None else body["n"]
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise LlmxError(f"'n' must be an integer from 1 to {MAX_N}, got {_shown(n)}")
    limit = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
    if limit is None:
        limit = DEFAULT_MAX_TOKENS
    if not _is_int(limit) or limit < 1:
        raise LlmxError(f"'max_tokens' must be a positive integer, got {_shown(limit)}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise LlmxError(f"'stream' must be true or false, got {_shown(stream)}")
    return_tokens = body.get("return_tokens", False)
    if not isinstance(return_tokens, bool):
        raise LlmxError(f"'return_tokens' must be true or false, got {_shown(return_tokens)}")
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
        n,
        return_tokens=return_tokens,
        **tools,
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


def _tools(body: dict, tool_format: ToolFormat | None) -> dict[str, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls`, checked, as Request fields. Tools are refused
    rather than dropped when the template cannot take them: a client that sends them expects calls.
    With `tool_choice` "none" the template is not given them: a model told of tools may call one."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not tools:
        if choice is not None and choice != "none":
            raise LlmxError("'tool_choice' needs 'tools'")
        return {}
    if tool_format is None:
        raise LlmxError(
            "'tools': this model's chat template does not take tools, or writes calls in a format "
            "llmx does not read (Hermes <tool_call>, Llama 3 JSON); send none"
        )
    checked = _tool_list(tools)
    names = [t["function"]["name"] for t in checked]
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = (
            function.get("name") if choice.get("type") == "function" and isinstance(function, dict) else None
        )
        if name not in names:
            raise LlmxError(
                f"'tool_choice' must name one of the tools ({', '.join(names)}), got {_shown(choice)}"
            )
        choice = "required"
    elif choice is None:
        choice = "auto"
    elif choice not in TOOL_CHOICES:
        raise LlmxError(f"'tool_choice' must be none, auto, required or a function, got {_shown(choice)}")
    if not isinstance(parallel, bool):
        raise LlmxError(f"'parallel_tool_calls' must be true or false, got {_shown(parallel)}")
    if choice == "required" and body.get("response_format") not in (None, {"type": "text"}):
        raise LlmxError("'response_format' and a required tool call cannot both shape the reply")
    if choice == "none":
        return {}
    return {"tools": checked, "tool_choice": choice, "tool_name": name, "parallel_tool_calls": parallel}


def _tool_list(tools: Any) -> tuple[dict[str, Any], ...]:
    """OpenAI function tools, each with a name and a JSON-schema `parameters` (an object)."""
    if not isinstance(tools, list):
        raise LlmxError("'tools' must be a list of {type: function, function: {...}} objects")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise LlmxError(f"tools[{i}] must be an object with type 'function' and a 'function' object")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise LlmxError(
                f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {_shown(name)}"
            )
        if any(t["function"]["name"] == name for t in out):
            raise LlmxError(f"tools[{i}]: a second function named {name!r}")
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise LlmxError(f"tools[{i}].function.parameters must be a JSON schema object")
        if not isinstance(function.get("description", ""), str):
            raise LlmxError(f"tools[{i}].function.description must be a string")
        out.append({"type": "function", "function": function | {"parameters": parameters}})
    return tuple(out)


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


def _messages(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise LlmxError("'messages' must be a non-empty list of {role, content} objects")
    return tuple(_message(i, m) for i, m in enumerate(value))


def _message(i: int, m: Any) -> dict[str, Any]:
    """A message as templates read it: its role and text, an assistant's `tool_calls` (their arguments
    as JSON values, which templates print with `tojson`), a tool result's `tool_call_id`."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise LlmxError(f"messages[{i}] must be an object with a string 'role'")
    content = m.get("content")
    if isinstance(content, list):  # OpenAI's content parts: only text ones are understood here
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise LlmxError(f"messages[{i}].content: only text parts are supported")
        content = "".join(str(p.get("text", "")) for p in content)
    calls = m.get("tool_calls") if m["role"] == "assistant" else None
    if not isinstance(content, str) and not (content is None and calls):
        raise LlmxError(f"messages[{i}].content must be a string")
    out: dict[str, Any] = {"role": m["role"], "content": content}
    if calls:
        out["tool_calls"] = _message_calls(i, calls)
    if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _message_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise LlmxError(f"{where} must be a list of calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise LlmxError(f"{where}[{j}] must have a function with a string name and arguments")
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, too long a number, too deep
            raise LlmxError(f"{where}[{j}].function.arguments must be JSON text") from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": value}})
    return out


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
        "top_logprobs": [_by_text(t.top) for t in tokens],
        "text_offset": offsets,
    }


def _by_text(top: Sequence[Candidate]) -> dict[str, float]:
    """The completions API's {text: logprob} of the likeliest tokens, best first. Two tokens may read
    the same (pieces of one character each decode to U+FFFD): the text keeps the likelier one's."""
    out: dict[str, float] = {}
    for c in top:
        out.setdefault(c.text, max(c.logprob, LOWEST_LOGPROB))
    return out


@dataclass(frozen=True)
class Reply:
    """What a response carries: its id, creation time and model name."""

    model: str
    kind: Kind
    tokens: bool = False  # whether choices carry their tokens' ids (`return_tokens`)
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

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str,
        logprobs: list[TokenLogprob] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        ids: Sequence[int] = (),
    ) -> dict[str, Any]:
        """One choice of a whole response; `logprobs` None: not asked for; `tool_calls`: OpenAI's
        call objects (a reply with calls and no text has null content); `ids`: its tokens'."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text if text or not tool_calls else None}
            if tool_calls:
                choice["message"]["tool_calls"] = tool_calls
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(logprobs, 0)
        if self.tokens:
            choice["tokens"] = list(ids)
        return choice

    def body(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict:
        """The whole (non-streamed) response with its `usage` (`usage()`, all choices')."""
        return self._head(False) | {"choices": choices, "usage": usage}

    def chunk(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None = None,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
        offset: int = 0,
        tool_calls: list[dict[str, Any]] | None = None,
        ids: Sequence[int] = (),
    ) -> dict:
        """One streamed piece of the `index`th choice; `first` opens a chat reply with the assistant's
        role; `offset`: where `text` starts in the whole reply (for the completions API's text_offset);
        `tool_calls`: OpenAI's call deltas; `ids`: the tokens that made the piece."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = self._logprobs(logprobs, offset)
        if self.tokens:
            choice["tokens"] = list(ids)
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
