"""A working GPT-2-style BPE vocabulary of any size, for synthetic models.

Real checkpoints' vocabularies are not ours to ship, but a synthetic model still has to tokenize
and detokenize anything, so benchmarks can feed it real text. The vocabulary is the 256 byte tokens
(in GPT-2's byte-to-unicode spelling, so every string is encodable), then common English words after
a space as whole tokens (as in a real vocabulary: English text takes about as many tokens as with the
real model's, and `llmx bench-serve` finds words of one token to build prompts of exact length), then
merged tokens built in a fixed order (common characters first: byte pairs, then pair + byte, ...), and the
special tokens BOS and EOS as control tokens at the ids the real model uses (by default the last
two, where Llama 3 and Qwen place their specials), so prompts and stop ids look like the real thing.
"""

from __future__ import annotations

from typing import Any

from llmx.bench.serve_workload import WORDS
from llmx.errors import LlmxError

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIALS = (BOS, EOS)
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3  # llama.cpp's token types


def byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode map: byte b is spelled by symbol [b], a printable character.

    Printable Latin-1 bytes stand for themselves; the rest (controls, space, ...) map to 256 + k in
    byte order, which is why a space is spelled 'Ġ' (chr(288)) in every GPT-2-style vocabulary.
    """
    ranges = (("!", "~"), ("¡", "¬"), ("®", "ÿ"))
    printable = [b for lo, hi in ranges for b in range(ord(lo), ord(hi) + 1)]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in symbols)
    symbols.update({b: chr(256 + k) for k, b in enumerate(others)})
    return [symbols[b] for b in range(256)]


def _merge_order(symbols: list[str]) -> list[str]:
    """Byte symbols from most to least useful as merge parts: letters, space, digits, punctuation, rest."""
    ascii_order = "etaoinsrhldcumfpgwybvkxjqzĠETAOINSRHLDCUMFPGWYBVKXJQZ0123456789Ċ.,'\"-:;!?()"
    first = [s for s in ascii_order if s in symbols]
    return first + [s for s in symbols if s not in first]


def synthetic_vocab(n_vocab: int, bos_id: int | None = None, eos_id: int | None = None) -> dict[str, Any]:
    """The `tokenizer.ggml.*` metadata of a BPE vocabulary with exactly `n_vocab` tokens."""
    bos_id = n_vocab - 2 if bos_id is None else bos_id
    eos_id = n_vocab - 1 if eos_id is None else eos_id
    if bos_id == eos_id or not (0 <= bos_id < n_vocab and 0 <= eos_id < n_vocab):
        raise LlmxError(f"BOS {bos_id} and EOS {eos_id} must be two different ids below {n_vocab}")
    symbols = byte_symbols()
    n_merged = n_vocab - len(symbols) - len(SPECIALS)
    if n_merged < 0:
        raise LlmxError(f"a vocabulary needs at least {len(symbols) + len(SPECIALS)} tokens, got {n_vocab}")
    tokens, merges = list(symbols), []
    known = set(tokens)

    def merge(left: str, right: str) -> None:
        if len(merges) < n_merged and left + right not in known:
            merges.append(f"{left} {right}")
            tokens.append(left + right)
            known.add(left + right)

    # Each word after a space grows from its first letter one byte at a time ("Ġ t", "Ġt h", "Ġth e"),
    # ranked before every other merge, so the word is one token wherever it follows a space.
    for word in WORDS:
        spelled = symbols[ord(" ")] + word
        for end in range(2, len(spelled) + 1):
            merge(spelled[: end - 1], spelled[end - 1])
    # Level k merges every token of level k-1 with every byte symbol, until the vocabulary is full:
    # each merge "left right" makes a token whose two parts already exist, as BPE requires.
    parts = _merge_order(symbols)
    level = parts
    while len(merges) < n_merged:
        next_level = []
        for left in level:
            for right in parts:
                if len(merges) == n_merged:
                    break
                merge(left, right)
                next_level.append(left + right)
        level = next_level
    types = [TOKEN_NORMAL] * len(tokens)
    for token_id, special in sorted(((bos_id, BOS), (eos_id, EOS))):
        tokens.insert(token_id, special)
        types.insert(token_id, TOKEN_CONTROL)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": bos_id,
        "tokenizer.ggml.eos_token_id": eos_id,
        "tokenizer.ggml.add_bos_token": True,
    }
