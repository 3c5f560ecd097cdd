"""Pre-tokenizer presets for byte-level BPE, keyed by GGUF's `tokenizer.ggml.pre`.

A byte-level BPE vocabulary only works with the text split the way its merges were learned. The GGUF
names that split (`smollm`, `llama-bpe`, `qwen2`, ...); llama.cpp maps each name to a list of regexes
applied in turn (`llm_tokenizer_bpe` in src/llama-vocab.cpp). Each regex cuts every piece the previous
one left into its matches and the text between them, which is what a `tokenizers` `Split` with
`behavior="isolated"` does, so a preset becomes a `Sequence` of those.

Where llama.cpp rewrote a model's regex for its own engine (case-insensitive groups spelled out,
lookaheads in place of Unicode classes), the original from the model's `tokenizer.json` is used here:
the `tokenizers` engine (Oniguruma) runs it as Hugging Face does.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

from llmx.errors import LlmxError


@dataclass(frozen=True)
class Preset:
    """How one family splits text before BPE.

    `patterns` run in order; `ignore_merges` looks a whole piece up in the vocabulary before merging
    (llama 3 does, so a word the vocabulary holds is one token even when no merge path reaches it);
    `add_bos` is llama.cpp's default when the GGUF has no `tokenizer.ggml.add_bos_token`.
    """

    patterns: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


# GPT-2's split; several families run it after isolating digits or punctuation first.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Cased words: an optional run of upper-case letters, then lower-case ones (or the reverse).
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek LLM's letters, as listed in its tokenizer.json: the cased letters of Latin, Greek,
# Cyrillic, Armenian, Georgian, Cherokee, Glagolitic, Coptic, Deseret... Written as escapes because
# several (Greek with oxia U+1F7D, Kelvin sign U+212A, Ohm sign U+2126) change under Unicode
# normalization, which an editor may apply silently.
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)
_CJK_HANGUL = "[一-龥ࠀ-一가-퟿]+"

_DEFAULT = Preset((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))

# (the `tokenizer.ggml.pre` names that share a split, the split), grouped as in llama.cpp.
_FAMILIES: list[tuple[str, Preset]] = [
    ("default", _DEFAULT),
    (
        "gpt-2 phi-2 mpt olmo jais trillion exaone4 mellum a.x-4.0 gigachat jina-es jina-de jina-v2-es "
        "jina-v2-de jina-v1-en jina-v2-code roberta-bpe modern-bert granite-docling",
        Preset((_GPT2,)),
    ),
    # Digits one by one, then GPT-2's split.
    ("smollm starcoder refact command-r codeshell exaone minerva-7b mellum2", Preset((r"\p{N}", _GPT2))),
    (
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        Preset((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    ("dbrx smaug-bpe chatglm-bpe glm4", Preset((_LLAMA3,))),
    ("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan", Preset((_QWEN2,))),
    ("qwen35", Preset((_QWEN35,))),
    ("gpt-4o llama4 kanana2 talkie minimax-m2", Preset((_GPT4O,))),
    ("tekken", Preset((_TEKKEN,), ignore_merges=True, add_bos=True)),
    ("falcon", Preset((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"))),
    (
        "deepseek-llm",
        Preset(
            (
                r"[\r\n]",
                rf"\s?[{_DEEPSEEK_LETTERS}]+",
                r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
                r"\s+$",
                _CJK_HANGUL,
                r"\p{N}+",
            )
        ),
    ),
    ("deepseek-coder", Preset((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"))),
    (
        "deepseek-v3",
        Preset(
            (
                r"\p{N}{1,3}",
                r"[一-龥぀-ゟ゠-ヿ]+",
                r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            )
        ),
    ),
]

PRESETS: dict[str, Preset] = {name: preset for names, preset in _FAMILIES for name in names.split()}


def preset(name: str | None) -> Preset:
    """The preset for a `tokenizer.ggml.pre` value; a file without one gets llama.cpp's `default`."""
    if name is None:
        return _DEFAULT
    try:
        return PRESETS[name]
    except KeyError:
        raise LlmxError(
            f"unknown pre-tokenizer {name!r} (tokenizer.ggml.pre); llmx knows: {', '.join(sorted(PRESETS))}"
        ) from None


def pre_tokenizer(p: Preset) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pipeline for `p`: its regex splits, then GPT-2's bytes-to-characters mapping."""
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in p.patterns]
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, to_bytes])
