"""Constrained sampling: only tokens a JSON schema allows next, through llguidance (Microsoft's grammar
engine, the one llama.cpp and vLLM use).

`Grammars(tokenizer)` builds llguidance's view of the vocabulary once per model (~0.5 s for 49k
tokens); `compile(schema)` (or `compile_lark(grammar)`, for forced tool calls) makes a generation's
`Constraint`, which masks each step's logits to the tokens the grammar allows next (an end-of-turn
token only once the text is complete) and is told which one was picked. Logits beyond the tokenizer's
vocabulary (padding rows some models have) are never allowed.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import numpy as np
import torch

from llmx.errors import LlmxError
from llmx.text.tokenizer import Tokenizer, TokenType


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads off a tokenizer: every token's bytes, the special ones,
    and a way to tokenize text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        ids = range(tokenizer.vocab_size)
        self.tokens = [tokenizer.token_bytes(i) for i in ids]
        self.special_token_ids = [i for i in ids if tokenizer.token_type(i) == TokenType.CONTROL]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance probes with bytes; a TypeError tells it to send str
            raise TypeError("text only")
        return self._tokenizer.encode(text, add_special=False, parse_special=False)


class Grammars:
    """Constraints for one model's vocabulary."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer))
        self._tokenizer = llguidance.LLTokenizer(wrapper, eos_token=sorted(tokenizer.stop_ids))
        self.vocab_size = tokenizer.vocab_size

    def compile(self, schema: dict[str, Any]) -> Constraint:
        """The constraint of JSON that `schema` (a JSON schema) accepts; a schema llguidance cannot
        compile is one LlmxError line. Takes up to ~0.1 s for a large schema."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        except ValueError as e:
            raise LlmxError(f"'response_format': the JSON schema is not usable: {e}") from None
        return self._constraint(grammar, "'response_format': the JSON schema")

    def compile_lark(self, source: str, what: str) -> Constraint:
        """The constraint of text that the Lark grammar `source` (llguidance's dialect, which embeds
        JSON schemas as `%json {...}`) accepts; `what` names the grammar's origin in errors."""
        return self._constraint(llguidance.LLMatcher.grammar_from_lark(source), what)

    def _constraint(self, grammar: str, what: str) -> Constraint:
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise LlmxError(f"{what} is not usable: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size)


class Constraint:
    """One generation's grammar state: `mask` a step's logits, then `accept` the token picked."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] with every token the grammar does not allow next at -inf."""
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # bit i: token i allowed
        allowed = np.zeros(len(logits), dtype=bool)
        n = min(len(logits), self.vocab_size)
        allowed[:n] = np.unpackbits(words, bitorder="little")[:n]
        return logits.masked_fill(torch.from_numpy(~allowed), float("-inf"))

    def fork(self) -> Constraint:
        """A copy in the same state, for another generation of the same request (`n` > 1)."""
        return Constraint(self.matcher.deep_copy(), self.vocab_size)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise LlmxError(f"constrained decoding failed: {self.matcher.get_error()}")
