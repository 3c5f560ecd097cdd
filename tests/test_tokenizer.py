"""Tokenizer tests: the same ids as Hugging Face on the real models, plus the rules on tiny vocabularies.

The real-model comparison reads `tests/data/tokenizer_reference.json`, written once by
`scripts/make_tokenizer_reference.py` from transformers' own GGUF conversion (slow: ~20 s). Set
LLMX_LIVE_HF=1 to recompute it live instead. Like for like:

- HF `add_special_tokens=True/False` is llmx `add_special=True/False`: Gemma's file asks for BOS and
  both add it; SmolLM2's does not and neither adds anything.
- HF always cuts out its added tokens (our `parse_special=True`); HF `split_special_tokens=True`
  spells out only the special ones and keeps user-defined ones, which is llama.cpp's (and our)
  `parse_special=False`.
- SmolLM2 is compared with its own pre-tokenizer (digits isolated first), which transformers'
  GGUF conversion drops; `test_gguf_conversion_differs_only_where_it_drops_the_digit_split` pins
  down the one corpus text where that matters.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmx.errors import LlmxError
from llmx.gguf import open_gguf
from llmx.models_on_disk import default_model_path, gemma3_270m_path
from llmx.text.bpe import byte_alphabet, spelled_bytes
from llmx.text.pretokenize import PRESETS, pre_tokenizer, preset
from llmx.text.tokenizer import StreamDecoder, Tokenizer

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "data" / "tokenizer_reference.json"


def _model_path(name: str) -> Path:
    path = default_model_path() if name == "smollm2" else gemma3_270m_path()
    if path is None:
        pytest.skip(f"{name} is not installed (see llmx.models_on_disk)")
    return path


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request) -> tuple[str, Path, Tokenizer]:
    path = _model_path(request.param)
    return request.param, path, Tokenizer.from_metadata(open_gguf(path).metadata)


@pytest.fixture(scope="module")
def reference(model) -> dict:
    name, path, _ = model
    if os.environ.get("LLMX_LIVE_HF") == "1":
        spec = importlib.util.spec_from_file_location(
            "make_ref", REPO / "scripts" / "make_tokenizer_reference.py"
        )
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        return script.reference(path)
    ref = json.loads(REFERENCE.read_text(encoding="utf-8"))["models"][name]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == ref["sha256"], f"{path.name} changed; rerun scripts/make_tokenizer_reference.py"
    return ref


# --- the real models against Hugging Face ---------------------------------------------------------


def test_corpus_is_broad(reference):
    assert len(reference["cases"]) >= 40


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("ids", {}),
        ("ids_no_special", {"add_special": False}),
        ("ids_split_special", {"add_special": False, "parse_special": False}),
    ],
)
def test_same_ids_as_hugging_face(model, reference, field, kwargs):
    _, _, tok = model
    wrong = [
        (case["text"], tok.encode(case["text"], **kwargs), case[field])
        for case in reference["cases"]
        if tok.encode(case["text"], **kwargs) != case[field]
    ]
    assert not wrong, f"{len(wrong)} texts differ, first: {wrong[0]}"


def test_same_text_as_hugging_face_decode(model, reference):
    _, _, tok = model
    for case in reference["cases"]:
        assert tok.decode(case["ids_no_special"]) == case["decoded"], case["text"]


def test_gguf_conversion_differs_only_where_it_drops_the_digit_split(model, reference):
    # Digits isolated first: "line \n42" keeps " \n" together ("ĠĊ"); GPT-2's regex alone cuts " " from "\n".
    name, _, tok = model
    differ = {
        c["text"] for c in reference["cases"] if tok.encode(c["text"], False) != c["gguf_conversion_ids"]
    }
    assert differ == ({"line \n42 \n 7"} if name == "smollm2" else set())


def test_round_trip_on_the_corpus(model, reference):
    _, _, tok = model
    for case in reference["cases"]:
        assert tok.decode(tok.encode(case["text"], add_special=False)) == case["text"]


# What cannot round-trip, in HF and llama.cpp alike, is left out: SmolLM2's vocabulary has no token for
# a few bytes (some C0 controls, the lead bytes of planes 4-11), so those characters are dropped; and
# SentencePiece spells a space "▁", so a literal "▁" in the text comes back as a space.
_SPELLABLE = st.characters(exclude_categories=("Cs", "Cc"), exclude_characters="▁", max_codepoint=0x3FFFF)


@settings(max_examples=150, deadline=None)
@given(text=st.text(_SPELLABLE, max_size=40))
def test_round_trip_on_any_text(model, text):
    # Byte-level BPE and SentencePiece with byte fallback lose nothing, special-token text included.
    _, _, tok = model
    assert tok.decode(tok.encode(text, add_special=False)) == text


def test_special_ids_smollm2():
    tok = Tokenizer.from_metadata(open_gguf(_model_path("smollm2")).metadata)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (49152, 1, 2, False)
    assert tok.token_text(2) == "<|im_end|>"
    assert tok.stop_ids == {0, 2}  # <|endoftext|> and <|im_end|>
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


def test_special_ids_gemma3():
    tok = Tokenizer.from_metadata(open_gguf(_model_path("gemma3")).metadata)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (262144, 2, 1, True)
    assert tok.stop_ids == {1, 106}  # <eos> and <end_of_turn>
    assert tok.encode("") == [2]


def test_stream_never_emits_half_a_character(model):
    _, _, tok = model
    text = "é日本🤖👨‍👩‍👧 ok"
    ids = tok.encode(text, add_special=False)
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


# --- tiny vocabularies: the rules one at a time -------------------------------------------------------

CONTROL, USER, BYTE, NORMAL = 3, 4, 6, 1


def spm_meta(pieces: dict[str, float], **keys) -> dict:
    """A SentencePiece GGUF vocabulary: <unk> <s> </s> <ctl>, user-defined <u>, 256 byte tokens, `pieces`."""
    head = [("<unk>", 2), ("<s>", CONTROL), ("</s>", CONTROL), ("<ctl>", CONTROL), ("<u>", USER)]
    tokens = head + [(f"<0x{b:02X}>", BYTE) for b in range(256)] + [(p, NORMAL) for p in pieces]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [t for t, _ in tokens],
        "tokenizer.ggml.token_type": [k for _, k in tokens],
        "tokenizer.ggml.scores": [0.0] * len(head) + [0.0] * 256 + list(pieces.values()),
        **keys,
    }


def texts(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.token_text(i) for i in ids]


NO_PREFIX = {"tokenizer.ggml.add_space_prefix": False}


def test_spm_merges_the_best_scoring_pair_first():
    # Left to right, "ab" would come first; the higher score of "bc" wins.
    tok = Tokenizer.from_metadata(spm_meta({"a": -1, "b": -1, "c": -1, "ab": -5, "bc": -2}, **NO_PREFIX))
    assert texts(tok, tok.encode("abc", add_special=False)) == ["a", "bc"]


def test_spm_breaks_ties_leftmost():
    tok = Tokenizer.from_metadata(spm_meta({"a": -1, "b": -1, "c": -1, "ab": -2, "bc": -2}, **NO_PREFIX))
    assert texts(tok, tok.encode("abc", add_special=False)) == ["ab", "c"]


def test_spm_space_prefix_and_bos_by_default():
    tok = Tokenizer.from_metadata(spm_meta({"hi": -2, "yo": -2, "▁hi": -1, "▁yo": -1}))
    assert texts(tok, tok.encode("hi yo")) == ["<s>", "▁hi", "▁yo"]
    # A fragment after a special token starts with the space prefix again; decode removes it.
    ids = tok.encode("hi<ctl>yo")
    assert texts(tok, ids) == ["<s>", "▁hi", "<ctl>", "▁yo"]
    assert tok.decode(ids) == "<s>hi<ctl>yo"
    assert tok.decode(ids, skip_special=True) == "hiyo"


def test_spm_without_space_prefix():
    no_bos = {"tokenizer.ggml.add_bos_token": False}
    tok = Tokenizer.from_metadata(spm_meta({"▁": -3, "hi": -1, "yo": -2, "▁yo": -1}, **NO_PREFIX, **no_bos))
    assert texts(tok, tok.encode("hi yo")) == ["hi", "▁yo"]
    assert tok.decode(tok.encode(" hi")) == " hi"


def test_spm_byte_fallback_and_streaming():
    tok = Tokenizer.from_metadata(spm_meta({"▁": -1}, **NO_PREFIX))
    ids = tok.encode("é", add_special=False)
    assert texts(tok, ids) == ["<0xC3>", "<0xA9>"]
    stream = StreamDecoder(tok)
    assert (stream.push(ids[0]), stream.push(ids[1])) == ("", "é")
    stream.push(ids[0])
    assert stream.flush() == "\ufffd"  # an unfinished character at the end of the stream


def test_parse_special_controls_only_control_tokens():
    tok = Tokenizer.from_metadata(spm_meta({}, **NO_PREFIX))
    assert texts(tok, tok.encode("<ctl><u>", add_special=False)) == ["<ctl>", "<u>"]
    # Without parse_special, control text is spelled out but user-defined tokens still match.
    spelled = tok.encode("<ctl><u>", add_special=False, parse_special=False)
    assert texts(tok, spelled)[-1] == "<u>" and len(spelled) == 6
    assert tok.decode(spelled) == "<ctl><u>"


def test_eos_added_when_the_file_asks():
    tok = Tokenizer.from_metadata(spm_meta({"▁a": -1}, **{"tokenizer.ggml.add_eos_token": True}))
    assert texts(tok, tok.encode("a")) == ["<s>", "▁a", "</s>"]
    assert tok.stop_ids == {2}


def bpe_meta(pre: str, words: list[str], merges: list[str], **keys) -> dict:
    """A byte-level BPE vocabulary: <|end|> (control), the 256 byte characters, then `words`."""
    tokens = ["<|end|>", *byte_alphabet().values(), *words]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [CONTROL] + [NORMAL] * (len(tokens) - 1),
        "tokenizer.ggml.merges": merges,
        **keys,
    }


def test_bpe_merges_in_rank_order():
    tok = Tokenizer.from_metadata(
        bpe_meta("gpt-2", ["he", "ll", "hell", "hello"], ["l l", "h e", "he ll", "hell o"])
    )
    assert texts(tok, tok.encode("hello hi")) == ["hello", "Ġ", "h", "i"]


def test_llama3_looks_whole_words_up_before_merging():
    # "hello" is in the vocabulary but no merge reaches it: llama 3 (ignore_merges) still finds it.
    meta = bpe_meta("llama-bpe", ["hello"], [], **{"tokenizer.ggml.bos_token_id": 0})
    tok = Tokenizer.from_metadata(meta)
    assert texts(tok, tok.encode("hello")) == ["<|end|>", "hello"]  # llama 3 adds BOS by default
    meta["tokenizer.ggml.pre"] = "gpt-2"
    assert len(Tokenizer.from_metadata(meta).encode("hello")) == 5


def test_bpe_special_tokens_and_stop_ids():
    tok = Tokenizer.from_metadata(bpe_meta("qwen2", [], [], **{"tokenizer.ggml.eos_token_id": 0}))
    assert tok.encode("a<|end|>") == [tok.encode("a")[0], 0]
    assert tok.decode([0]) == "<|end|>" and tok.decode([0], skip_special=True) == ""
    assert tok.stop_ids == {0}


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        ("gpt-2", "I'm 12345 ok", ["I", "'m", "Ġ12345", "Ġok"]),
        ("smollm", "x 123", ["x", "Ġ", "1", "2", "3"]),
        ("llama-bpe", "HE'S 1234567", ["HE", "'S", "Ġ", "123", "456", "7"]),
        ("qwen2", "a 42\n\n b", ["a", "Ġ", "4", "2", "ĊĊ", "Ġb"]),
        ("default", "a+b=10,000", ["a", "+", "b", "=", "10", ",", "000"]),
    ],
)
def test_pre_tokenizer_presets(pre, text, pieces):
    assert [p for p, _ in pre_tokenizer(preset(pre)).pre_tokenize_str(text)] == pieces


def test_every_preset_compiles_and_splits():
    sample = "Hello, WORLD! It's 2024 — ça va? 日本語 🤖\n\tend  "
    for name, p in PRESETS.items():
        pieces = [piece for piece, _ in pre_tokenizer(p).pre_tokenize_str(sample)]
        assert b"".join(_spelled(piece) for piece in pieces) == sample.encode(), name


@given(st.lists(st.one_of(st.sampled_from(sorted(byte_alphabet().values())), st.characters(codec="utf-8"))))
def test_spelled_bytes_undo_the_alphabet_and_keep_other_characters_utf8(chars):
    to_byte = {c: b for b, c in byte_alphabet().items()}
    want = b"".join(bytes([to_byte[c]]) if c in to_byte else c.encode() for c in chars)
    assert spelled_bytes("".join(chars)) == want


def _spelled(piece: str) -> bytes:
    to_byte = {c: b for b, c in byte_alphabet().items()}
    return bytes(to_byte[c] for c in piece)


def test_unknown_pre_tokenizer_and_model_are_user_errors():
    with pytest.raises(LlmxError, match="unknown pre-tokenizer 'nope'.*smollm"):
        Tokenizer.from_metadata(bpe_meta("nope", [], []))
    with pytest.raises(LlmxError, match="'bert'.*not supported"):
        Tokenizer.from_metadata({**spm_meta({}), "tokenizer.ggml.model": "bert"})
