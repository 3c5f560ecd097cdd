"""Byte-level BPE (GGUF `tokenizer.ggml.model` = `gpt2`): GPT-2, Llama 3, Qwen, SmolLM, ...

Text is split by the family's pre-tokenizer (`pretokenize.py`), each piece's UTF-8 bytes are spelled
with GPT-2's byte alphabet (byte 0x20 is `Ġ`, 0x0A is `Ċ`), and the ranked merges run inside each
piece. Splitting and merging are Hugging Face `tokenizers`' own (Rust, fast, the reference the
tests compare with), built from the GGUF's vocabulary and merges; this module only wires them up
and undoes the byte alphabet when decoding.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as _RustTokenizer
from tokenizers import models

from llmx.errors import LlmxError
from llmx.text.pretokenize import Preset, pre_tokenizer


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, the other 68
    (controls, space, ...) take the characters from U+0100 upward, so no piece contains whitespace."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + i) for i, b in enumerate(others)})
    return chars


_CHAR_TO_BYTE = {c: b for b, c in byte_alphabet().items()}
# Every character below U+0144 to the Latin-1 character of the byte(s) it spells: the alphabet's to
# their byte, the others (controls, U+0080-U+00A0, U+00AD as themselves) to their UTF-8 bytes.
_TO_LATIN1 = {ord(c): chr(b) for c, b in _CHAR_TO_BYTE.items()} | {
    u: chr(u).encode("utf-8").decode("latin-1") for u in range(0x100) if chr(u) not in _CHAR_TO_BYTE
}


def spelled_bytes(token: str) -> bytes:
    """The bytes a vocabulary entry spells; a character outside the alphabet stands for its UTF-8."""
    try:  # one C pass for the usual entry, all of whose characters are below U+0144
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        pass
    out = bytearray()
    for c in token:
        b = _CHAR_TO_BYTE.get(c)
        if b is None:
            out += c.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


class ByteLevelBPE:
    """Encodes text that holds no special tokens; `normal_bytes` turns a normal token back into bytes."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], p: Preset) -> None:
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = []
        for m in merges:
            # "Ġ t" -> ("Ġ", "t"); llama.cpp splits at the first space after the first character.
            cut = m.find(" ", 1)
            if cut < 0:
                raise LlmxError(f"malformed BPE merge {m!r} in tokenizer.ggml.merges")
            pairs.append((m[:cut], m[cut + 1 :]))
        self._rust = _RustTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=p.ignore_merges))
        self._rust.pre_tokenizer = pre_tokenizer(p)

    def encode(self, text: str) -> list[int]:
        return self._rust.encode(text, add_special_tokens=False).ids

    @staticmethod
    def normal_bytes(token: str) -> bytes:
        return spelled_bytes(token)
