"""Chat templates rendered like Hugging Face: the real SmolLM2 template against `apply_chat_template`
on the tokenizer transformers builds from the same GGUF, and template features against transformers'
own renderer (`render_jinja_template`, what `apply_chat_template` calls) on hand-written templates."""

from __future__ import annotations

from datetime import datetime

import pytest
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from llmx.errors import LlmxError
from llmx.gguf import open_gguf
from llmx.models_on_disk import default_model_path, gemma3_270m_path
from llmx.text.chat import (
    CHATML_TEMPLATE,
    GEMMA_TEMPLATE,
    chat_ids,
    render_chat,
    render_template,
    special_token_texts,
    takes_tools,
)
from llmx.text.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!\nHow are you?"},
        {"role": "assistant", "content": "Très bien, merci. 😊"},
        {"role": "user", "content": "  And the weather\ttoday?  "},
    ],
    [
        {"role": "user", "content": "Write code"},
        {"role": "assistant", "content": "```python\nprint('<|im_end|> is text here')\n```"},
        {"role": "user", "content": "Thanks"},
    ],
]


@pytest.fixture(scope="module")
def smollm2() -> tuple[Tokenizer, object]:
    path = default_model_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Tokenizer.from_metadata(open_gguf(path).metadata), hf


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_apply_chat_template(smollm2, messages, add_generation_prompt):
    tok, hf = smollm2
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert render_chat(tok, messages, add_generation_prompt) == expected
    # Tokenized the same way too: HF encodes the rendered text without adding tokens, parsing specials.
    expected_ids = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)["input_ids"]
    assert chat_ids(tok, messages, add_generation_prompt) == expected_ids


def test_gemma3_has_no_template_and_gets_gemma_turns():
    path = gemma3_270m_path()
    if path is None:
        pytest.skip("gemma3-270m packages are not installed")
    tok = Tokenizer.from_metadata(open_gguf(path).metadata)
    assert tok.chat_template is None
    messages = CONVERSATIONS[2]
    text = render_chat(tok, messages)
    assert text == (
        "<bos><start_of_turn>user\nYou answer in French.\n\nHello!\nHow are you?<end_of_turn>\n"
        "<start_of_turn>model\nTrès bien, merci. 😊<end_of_turn>\n"
        "<start_of_turn>user\n  And the weather\ttoday?  <end_of_turn>\n<start_of_turn>model\n"
    )
    ids = chat_ids(tok, messages)
    assert ids[:3] == [tok.bos_id, tok.special_id("<start_of_turn>"), tok.encode("user", False)[0]]
    assert ids.count(tok.bos_id) == 1  # the template writes <bos>; chat_ids adds no second one


def test_chatml_when_nothing_else_fits(smollm2):
    tok, hf = smollm2
    meta = {
        k: v for k, v in open_gguf(default_model_path()).metadata.items() if k != "tokenizer.chat_template"
    }
    bare = Tokenizer.from_metadata(meta)
    messages = CONVERSATIONS[1]
    assert render_chat(bare, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render_chat(bare, messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=CHATML_TEMPLATE
    )


def test_takes_tools_when_the_template_reads_them(smollm2):
    tok, _ = smollm2
    meta = open_gguf(default_model_path()).metadata
    with_tools = meta | {"tokenizer.chat_template": "{% if tools %}{{ tools | tojson }}{% endif %}"}
    loop_var = meta | {
        "tokenizer.chat_template": "{% for tools in messages %}{{ tools.content }}{% endfor %}"
    }
    assert not takes_tools(tok)  # SmolLM2's template has no tools
    assert takes_tools(Tokenizer.from_metadata(with_tools))
    assert not takes_tools(Tokenizer.from_metadata(loop_var))  # a name it sets itself is not the variable


# --- template features, against apply_chat_template with a template passed in ---------------------

FEATURES = {
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one.
    "whitespace": (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n"
        "    {% endif %}\n{% endfor %}\n"
    ),
    "tojson": (
        "{{ messages | tojson }}|{{ tools | tojson(indent=2) }}|"
        "{{ {'b': 1, 'a': '<&>'} | tojson(sort_keys=True) }}"
    ),
    "loop controls": (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ loop.index }}:{{ m.content }};{% if loop.index >= 2 %}{% break %}{% endif %}{% endfor %}"
    ),
    "namespace and slicing": (
        "{% set ns = namespace(n=0) %}{% for m in messages[1:] %}{% set ns.n = ns.n + m.content | length %}"
        "{% endfor %}{{ ns.n }} {{ messages[-1]['role'] }} {{ messages | length }}"
    ),
    "generation tag": (
        "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
    ),
    # A key whose value is None is dropped before rendering.
    "missing keys": (
        "{% for m in messages %}{{ m.role }}{% if 'tool_calls' in m %}+tools{% endif %} {% endfor %}"
    ),
    "tools and documents": (
        "{% if tools is not none %}T{{ tools | length }}{% endif %}{% if documents is none %}D{% endif %}"
    ),
    "special tokens": (
        "{{ bos_token }}{% for m in messages %}{{ m.content + eos_token }}{% endfor %}"
        "{{ unk_token + pad_token }}{% if add_generation_prompt %}>{% endif %}"
    ),
}


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "f", "parameters": {}}}]])
@pytest.mark.parametrize("name", list(FEATURES))
def test_template_features_match_transformers(smollm2, name, tools):
    tok, hf = smollm2
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "héllo <b>", "tool_calls": None},
        {"role": "assistant", "content": "ok", "tool_calls": [{"name": "f"}]},
        {"role": "user", "content": "bye"},
    ]
    source = FEATURES[name]
    expected = hf.apply_chat_template(
        messages, chat_template=source, tools=tools, add_generation_prompt=True, tokenize=False
    )
    ours = render_template(
        source, messages, add_generation_prompt=True, tools=tools, **special_token_texts(tok)
    )
    assert ours == expected


def test_gemma_fallback_matches_transformers():
    messages = CONVERSATIONS[2]
    (expected,), _ = render_jinja_template(
        conversations=[messages], chat_template=GEMMA_TEMPLATE, add_generation_prompt=True, bos_token="<bos>"
    )
    assert (
        render_template(GEMMA_TEMPLATE, messages, add_generation_prompt=True, bos_token="<bos>") == expected
    )


def test_raise_exception_becomes_a_user_error():
    source = (
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('Conversations must start with a user turn') }}{% endif %}ok"
    )
    with pytest.raises(
        LlmxError, match="refused the conversation: Conversations must start with a user turn$"
    ):
        render_template(source, [{"role": "assistant", "content": "x"}])
    assert render_template(source, [{"role": "user", "content": "x"}]) == "ok"


def test_strftime_now():
    assert render_template("{{ strftime_now('%Y-%m-%d') }}", []) == datetime.now().strftime("%Y-%m-%d")


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__ }}",  # the sandbox blocks underscore attributes
        "{% set _ = messages.append({'role': 'x'}) %}",  # immutable: no mutating the inputs
        "{{ undefined_function() }}",
    ],
)
def test_unsafe_or_broken_templates_are_user_errors(source):
    with pytest.raises(LlmxError, match="chat template failed"):
        render_template(source, [{"role": "user", "content": "x"}])


def test_syntax_error_names_the_line():
    with pytest.raises(LlmxError, match=r"does not parse: .* \(template line 2\)"):
        render_template("ok\n{% for m in messages %}", [])
