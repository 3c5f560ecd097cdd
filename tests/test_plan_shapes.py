"""Model shapes: tensor lists and metadata as llama.cpp writes them, sizes as real files have them."""

from __future__ import annotations

import re

import gguf
import pytest

from llmx.errors import LlmxError
from llmx.plan.model import ModelSpec
from llmx.plan.shapes import SHAPES, get_shape, parse_shape_spec

# Published file sizes in GB (1e9 bytes), as listed on Hugging Face: bartowski (Llama 3, Qwen2.5),
# Qwen (Qwen3), unsloth (DeepSeek-R1), TheBloke (Mixtral Q8_0).
REAL_SIZES_GB = {
    ("llama3-8b", "Q3_K_S"): 3.66,
    ("llama3-8b", "Q3_K_M"): 4.02,
    ("llama3-8b", "Q4_K_S"): 4.69,
    ("llama3-8b", "Q4_K_M"): 4.92,
    ("llama3-8b", "Q5_K_M"): 5.73,
    ("llama3-8b", "Q8_0"): 8.54,
    ("llama3-70b", "Q3_K_S"): 30.91,
    ("llama3-70b", "Q4_K_M"): 42.52,
    ("llama3-70b", "Q8_0"): 74.97,
    ("qwen2.5-72b", "Q4_K_M"): 47.42,
    ("qwen3-8b", "Q4_K_M"): 5.03,
    ("qwen3-30b-a3b", "Q4_K_M"): 18.6,
    ("qwen3-235b-a22b", "Q4_K_M"): 142.6,
    ("mixtral-8x7b", "Q8_0"): 49.62,
    ("deepseek-r1", "Q4_K_M"): 404.0,
}


@pytest.mark.parametrize(("name", "recipe"), list(REAL_SIZES_GB))
def test_sizes_match_published_files(name, recipe):
    size = ModelSpec.from_shape(get_shape(name), recipe).nbytes / 1e9
    assert size == pytest.approx(REAL_SIZES_GB[name, recipe], rel=0.02)


def test_q4_k_m_gives_half_the_layers_q6_k_attn_v_and_ffn_down():
    types = {t.name: t.qtype for t in get_shape("llama3-8b").tensors("Q4_K_M")}
    six = [i for i in range(32) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert len(six) == 16 and six[:4] == [0, 1, 2, 3] and six[-4:] == [28, 29, 30, 31]
    assert [i for i in range(32) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"] == six
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.0.attn_norm.weight"] == "F32"


def test_rows_that_are_not_whole_k_blocks_fall_back():
    # Qwen2.5-72B's FFN width 29568 is 115.5 blocks of 256: llama.cpp stores ffn_down as Q5_0/Q8_0.
    types = {t.qtype for t in get_shape("qwen2.5-72b").tensors("Q4_K_M") if "ffn_down" in t.name}
    assert types == {"Q5_0", "Q8_0"}


def test_smollm2_shape_is_the_embedded_model_exactly():
    from llmx.gguf import open_gguf
    from llmx.models_on_disk import default_model_path

    try:
        real = open_gguf(default_model_path())
    except LlmxError as e:
        pytest.skip(str(e))
    shape = get_shape("smollm2-135m")
    mine = {t.name: (t.qtype, t.shape, t.nbytes) for t in shape.tensors("Q4_1")}
    assert mine == {t.name: (t.qtype.name, t.shape, t.nbytes) for t in real.tensors.values()}
    for key, value in shape.metadata("Q4_1").items():
        if key not in ("general.name", "llama.attention.layer_norm_rms_epsilon"):
            assert real.metadata[key] == value, key


@pytest.mark.parametrize("name", list(SHAPES))
def test_names_and_keys_are_gguf_vocabulary(name):
    shape = get_shape(name)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == shape.arch)
    known = {gguf.TENSOR_NAMES[t].replace("{bid}", r"\d+") for t in gguf.MODEL_TENSORS[arch]}
    pattern = re.compile("|".join(f"(?:{k})" for k in known))
    for t in shape.tensors("Q8_0"):
        assert pattern.fullmatch(t.name.rsplit(".", 1)[0]), t.name
    key_templates = set()
    for group in (gguf.Keys.General, gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope, gguf.Keys.Tokenizer):
        key_templates |= {v.replace("{arch}", shape.arch) for v in vars(group).values() if isinstance(v, str)}
    md = shape.metadata("Q8_0")
    assert set(md) <= key_templates
    spec = ModelSpec.from_metadata(name, md, shape.tensors("Q8_0"))
    assert (spec.config.n_layer, spec.config.n_embd, spec.config.n_vocab) == (
        shape.n_layer,
        shape.n_embd,
        shape.n_vocab,
    )


def test_mla_metadata_and_cache_dims():
    spec = ModelSpec.from_shape(get_shape("deepseek-r1"), "IQ4_KS")
    assert (spec.config.n_head_kv, spec.config.head_dim, spec.config.head_dim_v) == (1, 576, 0)
    types = {t.name: t.qtype for t in spec.tensors}
    assert types["blk.3.ffn_up_exps.weight"] == "IQ4_KS"
    assert types["blk.3.attn_k_b.weight"] == "IQ4_NL"  # 128 columns: not whole 256-blocks


def test_shape_specs_and_errors():
    shape, recipe = parse_shape_spec("Qwen3-235B-A22B:q4_k_m")
    assert (shape.name, recipe) == ("qwen3-235b-a22b", "Q4_K_M")
    assert parse_shape_spec("seed-70b")[0].name == "qwen2.5-72b"
    with pytest.raises(LlmxError, match="known shapes: smollm2-135m"):
        get_shape("llama9-1t")
    with pytest.raises(LlmxError, match="known recipes"):
        parse_shape_spec("llama3-8b:Q9_Z")
