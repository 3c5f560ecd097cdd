"""Tool calls and `n` choices in `llmx serve`, as the official `openai` client meets them: a tiny random
Qwen2 carrying Qwen 2.5's real chat template (which takes tools), served with `-np 2` so that a
request's choices run as parallel sequences. A random model writes a valid call only when the
grammar makes it, which is what `tool_choice` "required" or a named function must guarantee.

The parser is checked on handwritten replies of each format, whole and cut into pieces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_server_http import KEY, Server
from tiny_models import write_tiny
from transformers.utils.chat_template_utils import render_jinja_template

from llmx.server.protocol import parse_request
from llmx.text.chat import render_template
from llmx.text.tool_calls import FORMATS, ToolCall, ToolCallParser, collect, template_format

openai = pytest.importorskip("openai")

TEMPLATE = (Path(__file__).parent / "data" / "qwen2.5-chat-template.jinja").read_text()
HERMES, LLAMA3 = FORMATS
UNITS = ["C", "F"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 4},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
                "unit": {"enum": UNITS},
            },
            "required": ["city", "days", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    # no arguments at all: without "additionalProperties": false any key would be valid, and a tiny random
    # model sampled at temperature 1 may spend max_tokens on one
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


# --- the parser, on handwritten replies ------------------------------------------------------------


def _parse(format, text: str, size: int | None = None) -> tuple[str, list[ToolCall]]:
    parser = ToolCallParser(format)
    pieces = [text] if size is None else [text[i : i + size] for i in range(0, len(text), size)]
    return collect([e for p in pieces for e in parser.push(p)] + parser.finish())


TWO_CALLS = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "x": [1, "}"]}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
PARSED = [
    (HERMES, TWO_CALLS, ("Let me look.", [ToolCall("get_weather", '{"city": "Oslo", "x": [1, "}"]}'),
                                          ToolCall("get_time", "{}")])),
    (HERMES, '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>',
     ("", [ToolCall("f", '{"a": 1}')])),
    (HERMES, "Plain text, with a < and spacing \n", ("Plain text, with a < and spacing \n", [])),
    (HERMES, "<tool_call>not json</tool_call> then text", ("<tool_call>not json</tool_call> then text", [])),
    (HERMES, '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
     ('<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', [])),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": "cut sh', ("", [ToolCall("f", '{"a": "cut sh')])),
    (LLAMA3, ' {"name": "get_time", "parameters": {"zone": "UTC"}} \n',
     ("", [ToolCall("get_time", '{"zone": "UTC"}')])),
    (LLAMA3, '{"answer": 42}', ('{"answer": 42}', [])),
    (LLAMA3, "It is {warm} today", ("It is {warm} today", [])),
]  # fmt: skip


@pytest.mark.parametrize(("format", "text", "expected"), PARSED)
def test_calls_are_read_the_same_whole_and_in_any_pieces(format, text, expected):
    assert _parse(format, text) == expected
    for size in (1, 2, 5):
        assert _parse(format, text, size) == expected


def test_a_streamed_call_gives_its_name_first_then_argument_fragments():
    parser = ToolCallParser(HERMES)
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>'
    events = [e for i in range(0, len(text), 4) for e in parser.push(text[i : i + 4])] + parser.finish()
    calls = [e for e in events if not isinstance(e, str)]
    assert calls[0].name == "f" and calls[0].arguments == ""
    assert all(c.name is None for c in calls[1:]) and len(calls) > 3  # arguments arrive in fragments
    assert "".join(c.arguments for c in calls) == '{"a": [1, 2]}'


def test_the_format_comes_from_the_template():
    assert template_format(TEMPLATE) is HERMES
    assert template_format('Respond as {"name": function name, "parameters": dictionary}') is LLAMA3
    assert template_format("{{ tools | tojson }}") is None


def test_tool_messages_render_as_the_template_expects():
    """An assistant's calls (arguments sent as JSON text) and tool results, as transformers renders
    the same conversation with the arguments as objects."""
    arguments = {"city": "Oslo", "days": 2, "unit": "C"}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    sent = json.loads(json.dumps(conversation))
    sent[1]["tool_calls"][0]["function"]["arguments"] = json.dumps(arguments)
    job = parse_request("chat", {"messages": sent, "tools": [WEATHER]}, HERMES)
    ours = render_template(TEMPLATE, job.messages, add_generation_prompt=True, tools=list(job.tools))
    (theirs,), _ = render_jinja_template(
        conversations=[conversation], chat_template=TEMPLATE, tools=[WEATHER], add_generation_prompt=True
    )
    assert ours == theirs and '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"' in ours


# --- the server --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny("qwen2", "F32", tmp_path_factory.mktemp("qwen"), chat_template=TEMPLATE)
    s = Server("-m", str(path), "-c", "2048", "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _check_weather(call) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "days", "unit"} and arguments["unit"] in UNITS
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 4
    assert type(arguments["days"]) is int and 1 <= arguments["days"] <= 9


def test_a_named_tool_is_called_with_arguments_of_its_schema_streamed_or_not(client):
    kw = {
        "model": "m", "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 100, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }  # fmt: skip
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    _check_weather(call)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_required_call_is_one_of_the_tools(client):
    reply = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
        max_tokens=100, temperature=1, seed=3,
    )  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name in {"get_weather", "get_time"}
    if call.function.name == "get_weather":
        _check_weather(call)
    else:
        assert json.loads(call.function.arguments) == {}


def test_n_choices_equal_at_temperature_0_and_reproducible_with_a_seed(client):
    kw = {"model": "m", "prompt": "Once upon", "max_tokens": 6}
    greedy = client.completions.create(n=3, temperature=0, **kw)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.text for c in greedy.choices}) == 1
    one = client.completions.create(temperature=0, **kw)
    assert one.choices[0].text == greedy.choices[0].text
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    seeded = [client.completions.create(n=2, temperature=1, seed=7, **kw) for _ in range(2)]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]
    assert seeded[0].choices[0].text != seeded[0].choices[1].text  # each choice its own seed
    alone = client.completions.create(temperature=1, seed=7, **kw)
    assert alone.choices[0].text == seeded[0].choices[0].text  # the first keeps the request's
    chunks = list(
        client.chat.completions.create(model="m", messages=ASK, n=2, max_tokens=4, temperature=0, stream=True)
    )
    texts = ["", ""]
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1] and texts[0] == texts[1] != ""


BAD = [
    {"tools": [{"type": "function", "function": {"name": "has space"}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": "none"}}]},
    {"tools": [WEATHER, WEATHER]},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": [WEATHER], "tool_choice": "sometimes"},
    {"tool_choice": "required"},
    {"n": 17},
    {"n": 0},
]


@pytest.mark.parametrize("extra", BAD)
def test_bad_tools_and_n_are_openai_400s(server, extra):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1} | extra)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
