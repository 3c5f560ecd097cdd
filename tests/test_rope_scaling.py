"""Long-context RoPE scaling against Hugging Face transformers: Llama 3.1's "llama3" factors and YaRN.

Tiny random models (`tiny_models.TINY_ROPE_SHAPES`) stretched from an original context of 64 tokens,
written as GGUF by the project's writer the way llama.cpp's converter writes real ones: the llama3
scaling as the rope_freqs tensor (no metadata key), YaRN as `rope.scaling.*` keys. transformers' GGUF
loader reads the weights but neither scaling, so the reference is the same model rebuilt with the
scaling its Hugging Face config would state. Prompts of 200 tokens reach three times past the
original context, where the scaled frequencies decide the logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import ROPE_CTX_ORIG, TINY_ROPE_SHAPES, random_prompt, write_tiny
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import llmx
from llmx.bench.synth import weight_filler
from llmx.errors import LlmxError
from llmx.gguf import open_gguf
from llmx.model_config import ModelConfig
from llmx.models.common import Model
from llmx.plan.shapes import get_shape

OPTIONS = dict(cache_type_k="f32", cache_type_v="f32", threads=1)  # as test_models.py, and why
PROMPT_LENGTH = 200
MAX_ABS_DIFF = 2e-3  # F32 weights: float32 summation order only (test_models.py measures <= 1e-5)
# Each shape's rope_parameters as its Hugging Face config states them (the GGUF's source).
HF_ROPE = {
    "llama3-rope": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": ROPE_CTX_ORIG},
    "qwen2-yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ROPE_CTX_ORIG},
}  # fmt: skip


def transformers_logits(path: Path, ids: list[int], rope: dict | None) -> torch.Tensor:
    """[T, vocab] of transformers' model of the file, with `rope` added to its rope_parameters (None:
    the unscaled RoPE its GGUF loader builds)."""
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    if rope is not None:
        config = hf.config
        config.rope_parameters = {**config.rope_parameters, **rope}
        scaled = type(hf)(config)
        scaled.load_state_dict(hf.state_dict())
        hf = scaled
    with torch.no_grad():
        return hf.eval()(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", params=list(TINY_ROPE_SHAPES))
def scaled(request, tmp_path_factory):
    path = write_tiny(request.param, "F32", tmp_path_factory.mktemp("rope"))
    return request.param, path, random_prompt(PROMPT_LENGTH, seed=0)


def test_logits_match_transformers_past_the_original_context(scaled):
    arch, path, ids = scaled
    model = llmx.load(path, ctx_size=256, ubatch_size=64, **OPTIONS)  # four ubatches
    logits = model.engine.prefill(ids, all_logits=True)
    expected = transformers_logits(path, ids, HF_ROPE[arch])
    diff = (logits - expected).abs().max().item()
    assert diff < MAX_ABS_DIFF, f"max |logit difference| {diff:.2e}"
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    # decode steps take the fused kernels, with the same tables
    model.engine.reset()
    model.engine.prefill(ids[:-1])
    assert (model.engine.decode(ids[-1]) - expected[-1]).abs().max().item() < MAX_ABS_DIFF
    # the scaling decides the logits past the original context, and only there
    unscaled = transformers_logits(path, ids, None)
    assert (unscaled[ROPE_CTX_ORIG:] - expected[ROPE_CTX_ORIG:]).abs().max().item() > 100 * MAX_ABS_DIFF


def test_llama31_shape_writes_the_converters_rope_freqs():
    """rope_freqs of Llama-3.1-8B's shape against transformers' llama3 frequencies for its config
    (factor 8, low 1, high 4, original context 8192, theta 500000): the tensor divides the plain
    frequencies into transformers' ones (29 pairs kept, 6 on the ramp, 29 divided by 8)."""
    shape = get_shape("llama3.1-8b")
    rope = HF_ROPE["llama3-rope"] | {"original_max_position_embeddings": 8192, "rope_theta": shape.rope_base}
    config = LlamaConfig(hidden_size=shape.n_embd, num_attention_heads=shape.n_head, rope_parameters=rope,
                         max_position_embeddings=shape.ctx_train)  # fmt: skip
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    plain = 1.0 / shape.rope_base ** (
        torch.arange(0, shape.head_dim, 2, dtype=torch.float64) / shape.head_dim
    )
    freqs = torch.tensor(shape.rope_freqs(), dtype=torch.float64)
    torch.testing.assert_close(plain / freqs, scaled.double(), rtol=1e-6, atol=0)
    assert (freqs == 1.0).sum() == 29 and (freqs == 8.0).sum() == 29 and shape.ctx_train == 131072
    tensor = shape.tensors("Q4_K_M")[0]
    assert (tensor.name, tensor.qtype, tensor.shape) == ("rope_freqs.weight", "F32", (64,))
    written = weight_filler(shape, seed=0)(tensor, 0, 64, (0, 0)).view(np.float32)  # `llmx synth`'s
    assert written.tolist() == freqs.float().tolist()


def test_an_unsupported_scaling_type_is_one_line_before_loading(tmp_path):
    path = write_tiny("llama", "F32", tmp_path)
    md = dict(open_gguf(path).metadata) | {"llama.rope.scaling.type": "longrope"}
    config = ModelConfig.from_metadata(md, path.name)
    with pytest.raises(LlmxError, match="RoPE scaling type 'longrope' is not supported yet"):
        Model.check_config(config, path.name)
