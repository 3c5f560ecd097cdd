"""Chat templates: a conversation rendered into the prompt text the model was trained on.

A GGUF carries its chat template as jinja2 source (`tokenizer.chat_template`), written for Hugging
Face's `apply_chat_template`; it is rendered here the same way: a sandboxed, immutable jinja2
environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, HF's `tojson`
(no HTML escaping, keeps non-ASCII), `raise_exception(msg)` and `strftime_now(fmt)`, the
`{% generation %}` tag (rendered as its body), and the variables `messages`, `tools`, `documents`,
`add_generation_prompt`, `bos_token`, `eos_token`, `unk_token`, `pad_token`. Message keys whose
value is None are dropped first, as HF does, so templates see a missing key rather than "None".

A file without a template gets one of two simple formats (`fallback_template`):

- Gemma's turns, when the vocabulary has `<start_of_turn>` and `<end_of_turn>`:
  `<bos><start_of_turn>user\\n{system}\\n\\n{content}<end_of_turn>\\n<start_of_turn>model\\n` (a system
  message is folded into the first user turn, the assistant role is called `model`);
- otherwise ChatML, llama.cpp's default:
  `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then `<|im_start|>assistant\\n`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmx.errors import LlmxError
from llmx.text.tokenizer import Tokenizer
from llmx.text.tool_calls import ToolFormat, template_format

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ ns.system + message['content'] + '<end_of_turn>\n' }}{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

Message = Mapping[str, Any]


def fallback_template(tokenizer: Tokenizer) -> str:
    """The format for a model whose GGUF has no chat template (see the module docstring)."""
    gemma = (
        tokenizer.special_id("<start_of_turn>") is not None
        and tokenizer.special_id("<end_of_turn>") is not None
    )
    return GEMMA_TEMPLATE if gemma else CHATML_TEMPLATE


def render_chat(
    tokenizer: Tokenizer, messages: Sequence[Message], add_generation_prompt: bool = True, **variables: Any
) -> str:
    """The prompt text for `messages` ({"role", "content"} dicts) with the model's template."""
    return render_template(
        tokenizer.chat_template or fallback_template(tokenizer),
        messages,
        add_generation_prompt=add_generation_prompt,
        **{**special_token_texts(tokenizer), **variables},
    )


def takes_tools(tokenizer: Tokenizer) -> bool:
    """Whether the model's chat template renders the `tools` it is given (the fallbacks do not)."""
    source = tokenizer.chat_template or fallback_template(tokenizer)
    _compile(source)  # a template that does not parse fails here, with its line
    return "tools" in meta.find_undeclared_variables(_environment().parse(source))


def tool_format(tokenizer: Tokenizer) -> ToolFormat | None:
    """The format in which the model's chat template teaches tool calls; None when it takes no tools,
    or teaches a format `llmx.text.tool_calls` does not read."""
    return template_format(tokenizer.chat_template or "") if takes_tools(tokenizer) else None


def chat_ids(
    tokenizer: Tokenizer, messages: Sequence[Message], add_generation_prompt: bool = True, **variables: Any
) -> list[int]:
    """The prompt ids for `messages`: the rendered text with its special tokens parsed, and BOS in
    front when the model wants one and the template did not write it (no double BOS)."""
    ids = tokenizer.encode(
        render_chat(tokenizer, messages, add_generation_prompt, **variables), add_special=False
    )
    if tokenizer.add_bos and ids[:1] != [tokenizer.bos_id]:
        ids.insert(0, tokenizer.bos_id)
    return ids


def render_template(
    source: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **variables: Any,
) -> str:
    """Render a HF-style chat template; template errors become LlmxError."""
    plain = [{k: v for k, v in message.items() if v is not None} for message in messages]
    try:
        return _compile(source).render(
            messages=plain,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except _TemplateRaised as e:
        raise LlmxError(f"the chat template refused the conversation: {e.message}") from None
    except jinja2.TemplateError as e:
        raise LlmxError(f"the chat template failed: {e}") from None


def special_token_texts(tokenizer: Tokenizer) -> dict[str, str]:
    """`bos_token`, `eos_token`, `unk_token`, `pad_token` as HF hands them to templates (the ones the
    file names)."""
    ids = {
        "bos_token": tokenizer.bos_id,
        "eos_token": tokenizer.eos_id,
        "unk_token": tokenizer.unk_id,
        "pad_token": tokenizer.pad_id,
    }
    return {name: tokenizer.token_text(i) for name, i in ids.items() if i is not None}


class _TemplateRaised(jinja2.TemplateError):
    """What `raise_exception(message)` in a template raises."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; prompts need the plain JSON HF renders.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant text for training masks with it;
    for inference it is just its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise LlmxError(f"the chat template does not parse: {e.message} (template line {e.lineno})") from None
