"""The tokenizer a GGUF describes: text <-> token ids, with llama.cpp's rules for special tokens.

`Tokenizer.from_metadata(meta)` reads the `tokenizer.*` keys and picks the model: byte-level BPE
(`gpt2`, in `bpe.py`) or SentencePiece (`llama`, in `spm.py`). What this module adds on top is what
both share, following llama.cpp (`llama_vocab::impl::tokenize` / `detokenize`):

- special tokens: the text of control (type 3), user-defined (4) and unknown (2) tokens is cut out
  before the model sees the text; control and unknown ones only when `parse_special`, user-defined
  ones always. The leftmost match wins, and the longest at a position (Hugging Face's rule; llama.cpp
  cuts the longest tokens out first, which differs only where two special tokens overlap).
- BOS/EOS added when the file says so (`tokenizer.ggml.add_bos_token` / `add_eos_token`), and the
  set of ids that end a turn (`stop_ids`).
- SentencePiece's space prefix (`tokenizer.ggml.add_space_prefix`, on by default): each text
  fragment at the start or right after a special token gets a leading space, which decoding removes.
- decoding through bytes, so byte-level BPE pieces and `<0xNN>` byte tokens join into whole
  characters; `StreamDecoder` does it incrementally and never emits half a UTF-8 character.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from enum import IntEnum
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from llmx.errors import LlmxError, first_line
from llmx.text.bpe import ByteLevelBPE
from llmx.text.pretokenize import preset
from llmx.text.spm import SentencePieceBPE

if TYPE_CHECKING:
    from llmx.gguf import ModelFile


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Tokens that end a turn even when the file names only one EOS (llama.cpp's `special_eog_ids`
# heuristic: chat models often stop on a turn marker that is not their EOS).
END_OF_TURN_TEXTS = frozenset(
    [
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "<｜end▁of▁sentence｜>",
        "<end_of_utterance>",
    ]  # fmt: skip
)

_TYPE_OF = {int(t): t for t in TokenType}  # a dict lookup: TokenType(t) costs ~1 µs, 128k times
_PARSED_TYPES = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
_HIDDEN_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)  # left out of decoded text when skip_special


class _Model(Protocol):
    """What a tokenizer model provides: ids for text without special tokens, bytes of a normal token."""

    def encode(self, text: str) -> list[int]: ...

    @staticmethod
    def normal_bytes(token: str) -> bytes: ...


class Tokenizer:
    """Encode text to ids and decode ids to text; build it with `Tokenizer.from_metadata`."""

    def __init__(
        self,
        tokens: Sequence[str],
        types: Sequence[int],
        model: _Model,
        *,
        bos_id: int | None,
        eos_id: int | None,
        unk_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        stop_ids: Iterable[int],
        chat_template: str | None = None,
    ) -> None:
        if add_bos and bos_id is None:
            raise LlmxError("the GGUF asks to add a BOS token (tokenizer.ggml.add_bos_token) but names none")
        if add_eos and eos_id is None:
            raise LlmxError("the GGUF asks to add an EOS token (tokenizer.ggml.add_eos_token) but names none")
        self._tokens = list(tokens)
        # llama.cpp gives a type it does not know no text and never parses it: as unused.
        self._types = [_TYPE_OF.get(t, TokenType.UNUSED) for t in types]
        self._model = model
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = bos_id, eos_id, unk_id, pad_id
        self.add_bos, self.add_eos, self.add_space_prefix = add_bos, add_eos, add_space_prefix
        self.stop_ids: frozenset[int] = frozenset(stop_ids)
        self.chat_template = chat_template
        self._bytes = [self._piece(text, kind) for text, kind in zip(self._tokens, self._types, strict=True)]
        parsed = [i for i, kind in enumerate(self._types) if kind in _PARSED_TYPES and self._tokens[i]]
        self._special_ids = {self._tokens[i]: i for i in parsed}

    @classmethod
    def from_gguf(cls, mf: ModelFile) -> Tokenizer:
        """The tokenizer of an opened GGUF; whatever stops it being built is one LlmxError naming the file."""
        try:
            return cls.from_metadata(mf.metadata)
        except LlmxError as e:
            raise LlmxError(f"{mf.path.name}: {e}") from None
        except Exception as e:  # a damaged vocabulary fails inside the tokenizer library
            raise LlmxError(f"{mf.path.name}: its vocabulary cannot be built ({first_line(e)})") from None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (`ModelFile.metadata`); raises LlmxError for what llmx cannot read."""
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise LlmxError("the GGUF has no vocabulary (tokenizer.ggml.tokens)")
        types = meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)

        def token_id(key: str, default: int | None) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}", default)
            return value if value is not None and 0 <= value < len(tokens) else None

        model: _Model
        if kind == "gpt2":
            p = preset(meta.get("tokenizer.ggml.pre"))
            if "tokenizer.ggml.merges" not in meta:
                raise LlmxError("the GGUF's BPE vocabulary has no merges (tokenizer.ggml.merges)")
            model = ByteLevelBPE(tokens, meta["tokenizer.ggml.merges"], p)
            bos_id, eos_id, unk_id = (
                token_id("bos_token_id", None),
                token_id("eos_token_id", None),
                token_id("unknown_token_id", None),
            )
            add_bos_default, add_space_prefix = p.add_bos, False
        elif kind == "llama":
            # llama.cpp's defaults for a SentencePiece file that does not say: <unk> = 0, <s> = 1, </s> = 2.
            bos_id, eos_id, unk_id = (
                token_id("bos_token_id", 1),
                token_id("eos_token_id", 2),
                token_id("unknown_token_id", 0),
            )
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            model = SentencePieceBPE(tokens, scores, unk_id)
            add_bos_default = True
            add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        else:
            raise LlmxError(
                f"tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; llmx reads "
                "'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
            )

        named = [eos_id, token_id("eot_token_id", None), token_id("eom_token_id", None)]
        by_text = [i for i, t in enumerate(tokens) if t in END_OF_TURN_TEXTS]
        return cls(
            tokens,
            types,
            model,
            bos_id=bos_id,
            eos_id=eos_id,
            unk_id=unk_id,
            pad_id=token_id("padding_token_id", None),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=add_space_prefix,
            stop_ids=[i for i in named + by_text if i is not None],
            chat_template=meta.get("tokenizer.chat_template"),
        )

    # --- vocabulary --------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as the GGUF stores it (`Ġworld`, `▁world`, `<|im_end|>`)."""
        return self._tokens[token_id]

    def token_type(self, token_id: int) -> TokenType:
        return self._types[token_id]

    def special_id(self, text: str) -> int | None:
        """The id of the control, user-defined or unknown token spelled `text` (`<|im_end|>`), if any."""
        return self._special_ids.get(text)

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes a token stands for in decoded text (possibly part of a UTF-8 character)."""
        if skip_special and self._types[token_id] in _HIDDEN_TYPES:
            return b""
        return self._bytes[token_id]

    def _piece(self, text: str, kind: TokenType) -> bytes:
        if kind in _PARSED_TYPES:
            return text.encode("utf-8")
        if kind == TokenType.BYTE:
            return bytes([int(text[3:5], 16)])  # "<0x0A>"
        if kind == TokenType.NORMAL:
            return self._model.normal_bytes(text)
        return b""  # unused tokens have no text (llama.cpp's token_to_piece)

    # --- encoding ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; `add_special` adds BOS/EOS as the file asks, `parse_special` turns the
        text of control tokens (`<|im_start|>`) into those tokens instead of spelling it out."""
        ids = [self.bos_id] if add_special and self.add_bos else []
        after_special = True
        for fragment in self._fragments(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
                continue
            if self.add_space_prefix and after_special:
                fragment = " " + fragment
            ids += self._model.encode(fragment)
            after_special = False
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def _fragments(self, text: str, parse_special: bool) -> Iterator[str | int]:
        """`text` cut into plain-text pieces (str) and special tokens (their id)."""
        matcher = self._all_specials if parse_special else self._user_defined
        start = 0
        if matcher is not None:
            for m in matcher.finditer(text):
                if m.start() > start:
                    yield text[start : m.start()]
                yield self._special_ids[m.group()]
                start = m.end()
        if start < len(text):
            yield text[start:]

    @cached_property
    def _all_specials(self) -> re.Pattern[str] | None:
        return _alternation(self._special_ids)

    @cached_property
    def _user_defined(self) -> re.Pattern[str] | None:
        user = TokenType.USER_DEFINED
        return _alternation(t for t, i in self._special_ids.items() if self._types[i] == user)

    # --- decoding ----------------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`; `skip_special` leaves out control tokens such as BOS and `<|im_end|>`."""
        stream = StreamDecoder(self, skip_special)
        return "".join([stream.push(i) for i in ids]) + stream.flush()


def _alternation(texts: Iterable[str]) -> re.Pattern[str] | None:
    """One regex matching any of `texts`, longest first so the longest wins at a position."""
    ordered = sorted(texts, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


class StreamDecoder:
    """Token-by-token decoding for streaming output: `push(id)` returns the text that is complete
    so far, holding back the bytes of a character split across tokens; `flush()` ends the stream
    (an unfinished character becomes U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._fragment_start = True  # the next text token begins a fragment (see add_space_prefix)

    def push(self, token_id: int) -> str:
        data = self._tok.token_bytes(token_id, self._skip_special)
        if self._tok.token_type(token_id) in _PARSED_TYPES:
            self._fragment_start = True
        elif data:
            if self._fragment_start and self._tok.add_space_prefix and data.startswith(b" "):
                data = data[1:]  # the space encode() put in front of the fragment
            self._fragment_start = False
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
