"""The one reader of a GGUF's `{arch}.*` hyperparameters: llama.cpp's required keys and defaults, and
one line naming the file for a value it cannot use. The planner and the models hold what it reads."""

from __future__ import annotations

import pytest

from llmx.errors import LlmxError
from llmx.model_config import ModelConfig
from llmx.plan.model import ModelSpec

REQUIRED = {
    "block_count": 2,
    "embedding_length": 64,
    "attention.head_count": 4,
    "context_length": 512,
    "attention.layer_norm_rms_epsilon": 1e-5,
    "vocab_size": 100,
}


def config(arch: str = "llama", **keys) -> ModelConfig:
    md = {"general.architecture": arch} | {
        f"{arch}.{k}": v for k, v in (REQUIRED | keys).items() if v is not None
    }
    return ModelConfig.from_metadata(md, "m.gguf")


def test_defaults_follow_llama_cpp():
    c = config()
    assert (c.n_head_kv, c.head_dim, c.head_dim_v, c.rope_dims) == (4, 16, 16, 16)
    assert (c.n_ff, c.n_ff_exp, c.n_expert, c.n_expert_used, c.rope_base) == (0, 0, 0, 0, 10000.0)
    assert (c.sliding_window, c.window(0)) == (0, None)


def test_gemma3_layers_are_local_but_every_sixth():
    c = config("gemma3", **{"attention.sliding_window": 512})
    assert [c.window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert config("llama", **{"attention.sliding_window": 512}).window(0) is None  # llama ignores the key


def test_per_layer_arrays_take_the_widest_layer():
    assert config(feed_forward_length=[128, 256]).n_ff == 256


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"context_length": None}, "m.gguf: metadata key llama.context_length is missing"),
        ({"attention.head_count": 0}, "m.gguf: metadata key llama.attention.head_count is 0"),
        ({"block_count": "two"}, "m.gguf: metadata key llama.block_count is 'two', not a number"),
        (
            {"rope.dimension_count": 17},
            "m.gguf: llama.rope.dimension_count is 17; it must be even and at most 16",
        ),
    ],
)
def test_a_value_it_cannot_use_is_one_line_naming_the_file(keys, message):
    with pytest.raises(LlmxError) as e:
        config(**keys)
    assert str(e.value) == message


def test_the_planner_and_the_model_read_the_same_config(smollm2_path):
    import llmx

    model = llmx.load(smollm2_path, ctx_size=64)
    assert model.config == ModelSpec.from_gguf(model.file).config
    assert (model.config.n_layer, model.config.n_ctx_train, model.config.n_ff) == (30, 8192, 1536)
