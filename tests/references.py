"""Comparisons shared by the model tests: top-k logits of a committed reference, transformers' outputs,
greedy continuations up to the stop token, batched prefill against token-by-token decode, greedy
choices compared only where they are decisive, and a prompt's greedy steps in the engine alone (what
batched paths are checked against)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmx.api import LoadedModel
from llmx.text.sampler import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel


DECISIVE_MARGIN = 1e-2


def decisive(logits: torch.Tensor, margin: float) -> torch.Tensor:
    """Which rows of `logits` [..., vocab] have their top two more than `margin` times the row's
    largest |logit| apart: where a computation that differs by rounding must still pick the same
    token (random tiny models have near-ties, which rounding may break either way)."""
    top2 = logits.double().topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1] > margin * logits.double().abs().amax(-1)


def greedy_agrees_until_a_near_tie(got: Sequence[int], want: Sequence[int], want_logits: torch.Tensor):
    """Greedy tokens `got` equal `want` (chosen by `want_logits` [len(want), vocab]) at every step up to
    the first near-tie of `want_logits` (DECISIVE_MARGIN), after which either choice is right and the
    continuations may part."""
    steps = decisive(want_logits[: len(want)], DECISIVE_MARGIN)
    n = len(want) if bool(steps.all()) else int((~steps).nonzero()[0, 0])
    assert n >= len(want) // 4, f"only {n} of {len(want)} greedy steps are decisive"
    assert list(got[:n]) == list(want[:n])


# A batch's rows against the same sequences run alone on a GPU, as a fraction of the logits' largest
# magnitude: the two take different GEMVs for the same token (alone: a prompt of 16 rows or more the
# float dequant GEMM, a decode step the integer-dot GEMV with x rounded to int8; in a batch of 2 to 15
# rows dot8_rows, also int8), the fused decode attention or PyTorch's, and under --no-kv-offload a q8_0
# cache attended on the CPU. Rounding x to int8 (1/254 of a row's largest value) through a few random
# layers moves a logit up to ~3.5% of the largest (an H100, a Llama-shaped Q8_0 model), not 5e-3.
GPU_BATCH_TOLERANCE = 4e-2

GREEDY = SamplingParams(temperature=0.0)  # `Engine.generate`'s argmax, sampled on the model's device


def transformers_outputs(
    hf: PreTrainedModel, prompts: list[list[int]], n_greedy: int
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """A transformers model's logits [T, vocab] at every position of each prompt, and its greedy
    continuation of `n_greedy` ids (through EOS: random weights may well predict it, and llmx without
    stop ids continues too)."""
    hf.generation_config.eos_token_id = None
    logits, continuations = [], []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            logits.append(hf(x).logits[0].float())
            out = hf.generate(x, max_new_tokens=n_greedy, do_sample=False, attention_mask=torch.ones_like(x))
            continuations.append(out[0, len(ids) :].tolist())
    return logits, continuations


def top_logits_vs_reference(model: LoadedModel, ref: np.lib.npyio.NpzFile, i: int) -> tuple[float, bool]:
    """Prefill prompt `i` of a `scripts/make_logits_reference.py` file: the max |ours - reference| over the
    reference's top-k ids at every position, and whether the argmax agrees at every position."""
    model.engine.reset()
    logits = model.engine.prefill(ref[f"ids_{i}"].tolist(), all_logits=True)  # [T, vocab]
    top_ids = torch.from_numpy(ref[f"top_ids_{i}"]).long()
    diff = (logits.gather(1, top_ids) - torch.from_numpy(ref[f"top_values_{i}"])).abs().max().item()
    return diff, torch.equal(logits.argmax(-1), top_ids[:, 0])


def until_stop(expected: Sequence[int], stop: Collection[int]) -> list[int]:
    """transformers' greedy ids up to (not including) the first stop id: llmx stops at it, unyielded."""
    ids = list(expected)
    return ids[: next((k for k, t in enumerate(ids) if t in stop), len(ids))]


def prefill_and_decode(model: LoadedModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, vocab] of one batched prefill of `ids`, and of feeding them one token at a time."""
    model.engine.reset()
    batched = model.engine.prefill(ids, all_logits=True)
    model.engine.reset()
    stepwise = torch.stack([model.engine.decode(t) for t in ids])
    return batched, stepwise


def greedy_alone(model: LoadedModel, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """The engine alone: greedy tokens after `prompt` and the logits [steps + 1, vocab] that chose them
    (the prompt's, then each decode step's)."""
    engine = model.engine
    engine.reset()
    logits, tokens = [engine.prefill(prompt)], []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits.append(engine.decode(tokens[-1]))
    return tokens, torch.stack(logits)
