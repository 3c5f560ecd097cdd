"""Synthetic models: random valid blocks, the synthetic vocabulary, and whole GGUFs of real shapes."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from llmx.bench.blocks import FLOAT_TYPES, SCALE_FIELDS, chunk_rng, random_data
from llmx.bench.vocab import BOS, EOS, byte_symbols, synthetic_vocab
from llmx.errors import LlmxError
from llmx.quant import qtype

# --- random valid blocks ---


@pytest.mark.parametrize("name", list(SCALE_FIELDS) + list(FLOAT_TYPES))
def test_random_data_dequantizes_to_finite_centred_values_of_the_asked_std(name):
    qt = qtype(name)
    n = 256 * 512
    raw = random_data(qt, n, std=0.02, rng=chunk_rng(7, 1))
    assert raw.dtype == np.uint8 and raw.nbytes == qt.nbytes((n,))
    values = dequantize(raw.reshape(-1, qt.block_bytes), GGMLQuantizationType(qt.ggml_id)).reshape(-1)
    assert values.size == n
    assert np.isfinite(values).all()
    assert values.std() == pytest.approx(0.02, rel=0.1)
    # Random signs on the scales centre every type (Q4_0's codes alone average -0.5 d).
    assert abs(values.mean()) < 0.02 * 0.05


def test_random_data_is_reproducible_per_seed_and_differs_between_chunks():
    qt = qtype("Q4_K")
    a = random_data(qt, 256 * 8, 0.01, chunk_rng(1, 2, 3))
    b = random_data(qt, 256 * 8, 0.01, chunk_rng(1, 2, 3))
    c = random_data(qt, 256 * 8, 0.01, chunk_rng(1, 2, 4))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_random_data_refuses_types_it_cannot_fill():
    with pytest.raises(LlmxError, match="IQ2_XXS"):
        random_data(qtype("IQ2_XXS"), 256, 0.01, chunk_rng(0))


# --- the synthetic vocabulary ---


def test_byte_symbols_are_gpt2s_byte_to_unicode_map():
    symbols = byte_symbols()
    assert len(set(symbols)) == 256
    assert symbols[ord("a")] == "a" and symbols[ord(" ")] == "Ġ" and symbols[ord("\n")] == "Ċ"


@pytest.mark.parametrize("n_vocab", [300, 49152, 151936])
def test_synthetic_vocab_has_exactly_n_tokens_and_valid_merges(n_vocab):
    meta = synthetic_vocab(n_vocab)
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == len(set(tokens)) == len(meta["tokenizer.ggml.token_type"]) == n_vocab
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "default"
    assert tokens[meta["tokenizer.ggml.bos_token_id"]] == BOS
    assert tokens[meta["tokenizer.ggml.eos_token_id"]] == EOS
    assert meta["tokenizer.ggml.token_type"][-1] == 3 and meta["tokenizer.ggml.token_type"][0] == 1
    known = set(tokens)
    for merge in meta["tokenizer.ggml.merges"][:: max(1, n_vocab // 1000)]:
        left, right = merge.split(" ")
        assert left in known and right in known and left + right in known


def test_synthetic_vocab_puts_the_specials_at_the_real_models_ids():
    meta = synthetic_vocab(49152, bos_id=1, eos_id=2)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert tokens[1] == BOS and tokens[2] == EOS and types[1:3] == [3, 3]
    assert types.count(3) == 2 and len(tokens) == 49152


def test_synthetic_vocab_needs_room_for_bytes_and_specials():
    with pytest.raises(LlmxError, match="at least 258"):
        synthetic_vocab(100)
