"""A working GPT-2-style BPE vocabulary of any size, for synthetic models.

Real checkpoints' vocabularies are not ours to ship, but a synthetic model still has to tokenize
and detokenize anything, so benchmarks can feed it real text. The vocabulary is the 256 byte tokens
(in GPT-2's byte-to-unicode spelling, so every string is encodable), then merged tokens built from
them in a fixed order (common characters first: byte pairs, then pair + byte, ...), then the
special tokens (BOS, EOS) as control tokens at the end, as Llama 3 and Qwen place theirs.
"""

from __future__ import annotations

from typing import Any

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


def synthetic_vocab(n_vocab: int) -> dict[str, Any]:
    """The `tokenizer.ggml.*` metadata of a BPE vocabulary with exactly `n_vocab` tokens."""
    symbols = byte_symbols()
    n_merged = n_vocab - len(symbols) - len(SPECIALS)
    if n_merged < 0:
        raise LlmxError(f"a vocabulary needs at least {len(symbols) + len(SPECIALS)} tokens, got {n_vocab}")
    tokens, merges = list(symbols), []
    parts = _merge_order(symbols)
    # Level k merges every token of level k-1 with every byte symbol, until the vocabulary is full:
    # each merge "left right" makes a token whose two parts already exist, as BPE requires.
    level = parts
    while len(merges) < n_merged:
        next_level = []
        for left in level:
            for right in parts:
                if len(merges) == n_merged:
                    break
                merges.append(f"{left} {right}")
                next_level.append(left + right)
        tokens += next_level
        level = next_level
    tokens += SPECIALS
    types = [TOKEN_NORMAL] * (len(tokens) - len(SPECIALS)) + [TOKEN_CONTROL] * len(SPECIALS)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index(BOS),
        "tokenizer.ggml.eos_token_id": tokens.index(EOS),
        "tokenizer.ggml.add_bos_token": True,
    }
