"""Tool calls in a model's own words: the format a chat template teaches, the calls read out of a reply
as it streams, and the grammar that makes a model write one when the client requires it.

Two formats cover most GGUF chat templates that take tools (`FORMATS`, the one table of them):

- Hermes (Qwen 2/2.5/3, Hermes, many fine-tunes): calls anywhere in the reply, each
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`; text around them is content;
- Llama 3.1/3.2/3.3 JSON: the whole reply is one `{"name": "f", "parameters": {...}}`.

`ToolCallParser` reads a reply a piece at a time and answers content text and `CallDelta`s in
OpenAI's streaming order (a call's name first, then fragments of its arguments' JSON text), so a
stream and a whole reply read the same: a whole reply is one piece. A call is recognized by its head
(`{"name": "f", "arguments":`); what follows up to the call's closing brace is its arguments as the
model wrote them (OpenAI's arguments need not be valid JSON either). Text that only looks like a
call (`<tool_call>` with no such head before `</tool_call>`) stays content.

Pure: text in, events out; no model, no HTTP.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str  # text whose presence in a chat template says it teaches this format
    opener: str  # starts a call; "" : the reply as a whole is the call
    closer: str  # ends a call; "" : the reply's end does
    arguments_key: str  # the call object's key for its arguments
    parallel: bool  # whether one reply may hold several calls


FORMATS = (
    ToolFormat("hermes", "<tool_call>", "<tool_call>", "</tool_call>", "arguments", parallel=True),
    # Llama 3.1's template asks for `{"name": function name, "parameters": dictionary of ...}`
    ToolFormat("llama3-json", '"parameters"', "", "", "parameters", parallel=False),
)
CALL_SEPARATOR = "\n"  # between the calls of a forced reply, as Qwen writes them
# A forced call's JSON in the format's canonical spacing: flexible whitespace would let a model
# (a random one, say) fill max_tokens with blanks.
JSON_SPACING = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_OPEN_STRING = re.compile(r'"(?:[^"\\]|\\.)*\\?')  # a string not closed yet


def template_format(template: str) -> ToolFormat | None:
    """The call format a chat template (that takes tools) teaches, None if it is none of FORMATS."""
    return next((f for f in FORMATS if f.marker in template), None)


@dataclass(frozen=True)
class CallDelta:
    """A piece of the `index`th call: its name (in the call's first delta only) and/or the next
    fragment of its arguments' JSON text."""

    index: int
    name: str | None
    arguments: str


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass
class _Call:
    """The call being read: its arguments' text so far (from their first non-space character), how
    much of it went out, and how far a scan for the end of its JSON value got."""

    text: str = ""
    sent: int = 0
    scanned: int = 0
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    end: int | None = None  # where the arguments' JSON value ends, once it has

    def scan(self) -> None:
        """Find where an object, array or string value closes; a bare scalar's end is found only
        at the call's end (it has no closing bracket)."""
        if not self.text or self.text[0] not in '{["':
            return
        for i in range(self.scanned, len(self.text)):
            if self.end is not None:
                break
            c = self.text[i]
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (c == "\\", c != '"')
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
            if self.depth == 0 and not self.in_string:
                self.end = i + 1
        self.scanned = len(self.text)

    def arguments(self, ended: bool) -> str:
        """The arguments' text that is certain so far; `ended`: the call has ended."""
        if self.end is not None:
            return self.text[: self.end]
        text = self.text.rstrip()
        if self.text[:1] in ("{", "[", '"'):  # not closed yet, or cut short
            return text
        if not ended:
            return ""
        return text[:-1].rstrip() if text.endswith("}") else text  # less the call object's brace


@dataclass
class ToolCallParser:
    """A reply's text in pieces -> content text and `CallDelta`s (see the module docstring)."""

    format: ToolFormat
    calls: int = 0  # calls begun so far
    _held: str = ""  # text not answered yet: maybe an opener, a call's head, or spacing
    _call: _Call | None = None  # inside a call, past its head
    _inside: bool = False  # past an opener (or, without one, the reply's first brace)
    _plain: bool = False  # a reply of the single-call format that is not a call: all content
    _out: list[str | CallDelta] = field(default_factory=list)

    def push(self, text: str) -> list[str | CallDelta]:
        self._held += text
        self._advance(final=False)
        out, self._out = self._out, []
        return out

    def finish(self) -> list[str | CallDelta]:
        """What the reply's end releases: the last call's arguments, or text held back."""
        self._advance(final=True)
        out, self._out = self._out, []
        return out

    def _advance(self, final: bool) -> None:
        progress = True
        while progress and (self._held or self._call is not None and final):
            if self._plain:
                self._content(self._held)
                self._held = ""
            elif self._call is not None:
                progress = self._arguments(final)
            elif self._inside:
                progress = self._head(final)
            else:
                progress = self._text(final)

    def _content(self, text: str) -> None:
        if text:
            self._out.append(text)

    def _text(self, final: bool) -> bool:
        """Content until an opener. Spacing next to a call is the format's, not content: it is held
        until text follows it."""
        opener = self.format.opener
        if not opener:  # the single-call format: the reply is a call iff it starts with a brace
            lead = self._held.lstrip()
            if not lead and not final:
                return False
            self._inside = lead.startswith("{")
            self._plain = not self._inside
            self._held = lead if self._inside else self._held
            return True
        at = self._held.find(opener)
        if at >= 0:
            self._content(self._held[:at].rstrip())
            self._held, self._inside = self._held[at + len(opener) :], True
            return True
        if final:
            self._content(self._held.rstrip() if self.calls else self._held)
            self._held = ""
            return False
        rest = self._held[: len(self._held) - _partial(self._held, opener)]
        self._content(rest.rstrip())
        self._held = self._held[len(rest.rstrip()) :]
        return False

    def _head(self, final: bool) -> bool:
        """Past an opener: wait for the call's head, then start the call; or give the text back as
        content when it cannot be a call."""
        closer, opener = self.format.closer, self.format.opener
        end = self._held.find(closer) if closer else -1
        body = self._held if end < 0 else self._held[:end]
        state, name, start = _read_head(body, self.format.arguments_key)
        if state == "match":
            self._begin(name)
            self._held = self._held[start:]
            return True
        if end < 0 and not final and (state == "maybe" or closer):
            return False  # more may come (a Hermes call's keys may also come in another order)
        whole = _whole_call(body, self.format.arguments_key)
        if whole is not None:
            self._begin(whole.name)
            self._out.append(CallDelta(self.calls - 1, None, whole.arguments))
            self._call = None
        else:
            self._content(opener + body + (closer if end >= 0 else ""))
            self._plain = not opener
        self._held = "" if end < 0 else self._held[end + len(closer) :]
        self._inside = False
        return True

    def _begin(self, name: str) -> None:
        self._out.append(CallDelta(self.calls, name, ""))
        self.calls += 1
        self._call = _Call()

    def _arguments(self, final: bool) -> bool:
        """A call's arguments, sent as they come, up to the end of their JSON value (what follows
        is the call object's own brace)."""
        call, closer = self._call, self.format.closer
        assert call is not None
        end = self._held.find(closer) if closer else -1
        region = (
            self._held[:end] if end >= 0 else self._held[: len(self._held) - _partial(self._held, closer)]
        )
        call.text = region.lstrip()
        call.scan()
        ended = end >= 0 or final
        arguments = call.arguments(ended)
        if len(arguments) > call.sent:
            self._out.append(CallDelta(self.calls - 1, None, arguments[call.sent :]))
            call.sent = len(arguments)
        if not ended:
            return False
        self._held = "" if end < 0 else self._held[end + len(closer) :]
        self._call, self._inside = None, False
        return True


def _partial(text: str, word: str) -> int:
    """The length of the longest end of `text` that begins `word` (0 if none)."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if word.startswith(text[-n:]):
            return n
    return 0


def _read_head(text: str, key: str) -> tuple[str, str, int]:
    """Whether `text` begins with a call's head `{"name": "f", "<key>":` (spacing allowed): ("match",
    name, where the arguments start), ("maybe", "", 0) while it may yet, ("no", "", 0)."""
    pos, name = 0, ""
    for piece in ("{", '"name"', ":", None, ",", f'"{key}"', ":"):
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return "maybe", "", 0
        if piece is None:  # the name: a JSON string
            m = _STRING.match(text, pos)
            if m is None:
                return ("maybe" if _OPEN_STRING.fullmatch(text, pos) else "no"), "", 0
            try:
                name = json.loads(m.group())
            except json.JSONDecodeError:
                return "no", "", 0
            pos = m.end()
            continue
        chunk = text[pos : pos + len(piece)]
        if not piece.startswith(chunk):
            return "no", "", 0
        if len(chunk) < len(piece):
            return "maybe", "", 0
        pos += len(piece)
    return "match", name, pos


def _whole_call(text: str, key: str) -> ToolCall | None:
    """`text` as a whole call object whose keys came in another order, or None."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or key not in call:
        return None
    arguments = call[key]
    return ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def collect(events: list[str | CallDelta]) -> tuple[str, list[ToolCall]]:
    """A whole reply's content and calls from its parser's events."""
    content, calls = [], []
    for e in events:
        if isinstance(e, str):
            content.append(e)
        elif e.name is not None:
            calls.append(ToolCall(e.name, e.arguments))
        else:
            calls[e.index].arguments += e.arguments
    return "".join(content), calls


def forced_call_grammar(
    format: ToolFormat, tools: list[dict[str, Any]], name: str | None, parallel: bool
) -> str:
    """A Lark grammar (llguidance's dialect) of replies that are calls of `tools` (OpenAI function
    tools, checked) in `format`: one call of `name`, or one or more (`parallel`) of any tool."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, format.arguments_key: f["parameters"]},
            "required": ["name", format.arguments_key],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    schema = (options[0] if len(options) == 1 else {"anyOf": options}) | {"x-guidance": JSON_SPACING}
    head = json.dumps(format.opener + "\n") + " " if format.opener else ""
    tail = " " + json.dumps("\n" + format.closer) if format.closer else ""
    many = parallel and format.parallel and name is None
    start = f"call ({json.dumps(CALL_SEPARATOR)} call)*" if many else "call"
    return f"start: {start}\ncall: {head}%json {json.dumps(schema)}{tail}\n"
