"""Prompts through GPU layers whose experts live in RAM: the experts a batch uses are copied to the GPU
and computed there (ik_llama.cpp's offload of only the activated experts).

A prompt batch of T tokens routes T * k (token, slot) pairs over a layer's X experts; multiplying them
on the CPU costs about T times a token's time, while copying the experts they use costs their bytes
over PCIe, at most the whole stacks. Past a threshold measured on this machine (`staging_threshold`),
each such layer reads its expert ids on the host (one wait a layer: which experts to copy is known
only after its router ran), copies the used experts' rows from the stacks' page-locked bytes into
compact stacks on the GPU (consecutive experts in one copy), renumbers the ids into them and runs the
grouped kernels. The copies are the bytes `bytes_streamed` counts.

They are not overlapped with compute: the next layer's experts are known only once this layer's
output reached its router.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmx.measured import best_seconds, remember, remembered
from llmx.ops import moe
from llmx.quant.weight import QWeight
from llmx.runtime.offload import MEASURE_TOKENS, NEVER, THRESHOLD_FILE, pinned_raw

Stacks = tuple[QWeight, QWeight, QWeight]  # a layer's gate, up and down experts


@dataclass
class ExpertStager:
    """Runs routed experts whose stacks live in RAM on x's GPU, their used experts copied there: an
    `ops.moe.Crossing`, installed with `ops.moe.crossing` around a prompt batch of a GPU segment.
    `k`: the experts a token takes; `layers`: the stacks of every layer whose experts live in RAM."""

    k: int
    layers: list[Stacks]
    bytes_streamed: int = 0
    _threshold: int | None = None

    def worth_it(self, tokens: int, device: torch.device) -> bool:
        """Whether a batch of `tokens` runs the CPU experts faster staged on `device` (the threshold is
        measured on the first call)."""
        if self._threshold is None:
            self._threshold = staging_threshold(self.layers, self.k, device)
        return tokens >= self._threshold

    def __call__(
        self,
        x: torch.Tensor,
        gate: QWeight,
        up: QWeight,
        down: QWeight,
        weights: torch.Tensor,
        ids: torch.Tensor,
        fused: bool,
    ) -> torch.Tensor:
        used = torch.unique(ids).tolist()  # the one wait for the GPU: which experts to copy
        staged = [self._stage(s, used, x.device) for s in (gate, up, down)]
        return moe.moe_ffn(x, *staged, weights, compact_ids(ids, used, gate.shape[0]), fused)

    def _stage(self, stack: QWeight, used: list[int], device: torch.device) -> QWeight:
        staged = compact_stack(stack, pinned_raw(stack), used, device)
        self.bytes_streamed += staged.raw.nbytes
        return staged


def compact_stack(stack: QWeight, raw: torch.Tensor, used: list[int], device: torch.device) -> QWeight:
    """The experts `used` (ascending) of `stack`, whose GGUF rows are `raw` (its own, or a pinned
    copy), in that order as a stack on `device`; copied on the current stream, where the kernels
    that read it follow."""
    n = stack.shape[1]
    out = torch.empty((len(used) * n, raw.shape[1]), dtype=raw.dtype, device=device)
    at = 0
    for first, count in runs(used):
        out[at * n : (at + count) * n].copy_(raw[first * n : (first + count) * n], non_blocking=True)
        at += count
    return QWeight(out, stack.qtype, (len(used), *stack.shape[1:]), stack.name)


def runs(used: list[int]) -> list[tuple[int, int]]:
    """Ascending expert numbers as (first, count) runs of consecutive ones: one copy each."""
    out: list[tuple[int, int]] = []
    for e in used:
        if out and out[-1][0] + out[-1][1] == e:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((e, 1))
    return out


def compact_ids(ids: torch.Tensor, used: list[int], n_expert: int) -> torch.Tensor:
    """Expert ids renumbered into the compact stack of the experts `used` (ascending): used[j] -> j."""
    position = torch.zeros(n_expert, dtype=ids.dtype, device=ids.device)
    order = torch.arange(len(used), dtype=ids.dtype, device=ids.device)
    position[torch.tensor(used, dtype=torch.long, device=ids.device)] = order
    return position[ids]


def tokens_worth_staging(cpu_per_token: float, copy_seconds: float, k: int, n_expert: int) -> int:
    """The fewest tokens (at least 2) whose experts take longer on the CPU, `cpu_per_token` each,
    than copying the experts they use to a GPU (all of them: `copy_seconds`), each token taking k of
    n_expert experts at random: T tokens leave an expert unused with probability (1 - k/n_expert)^T."""
    every = max(2, math.ceil(copy_seconds / cpu_per_token))  # where even copying all of them pays
    for t in range(2, every):
        if t * cpu_per_token >= copy_seconds * (1 - (1 - k / n_expert) ** t):
            return t
    return every


def staging_threshold(layers: list[Stacks], k: int, device: torch.device) -> int:
    """Prompt tokens from which staging the used experts of `layers` on `device` beats computing them
    on the CPU: the CPU's time a token for MEASURE_TOKENS tokens routed at random through the first
    layer's experts, against copying its stacks whole from pinned memory (`tokens_worth_staging`
    counts the share a batch uses). Measured once per (CPU, GPU, thread count, type, k of X experts)
    and kept; NEVER where the grouped kernels do not read every layer's stacks (float types)."""
    if not layers or not all(moe.grouped_readable(*stacks) for stacks in layers):
        return NEVER
    stacks = layers[0]
    n_expert, _, n_embd = stacks[0].shape
    key = (
        f"experts|{torch.cuda.get_device_name(device)}|{torch.get_num_threads()} threads|"
        f"{stacks[0].qtype.name}|{k} of {n_expert}"
    )
    kept = remembered(THRESHOLD_FILE).get(key)
    if kept is not None:
        return int(kept)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(MEASURE_TOKENS, n_embd, generator=g)
    weights, ids = moe.route(torch.randn(MEASURE_TOKENS, n_expert, generator=g), k, True)
    pinned = [pinned_raw(s) for s in stacks]  # as staging reads them, and will

    def copy() -> None:
        for p in pinned:
            p.to(device, non_blocking=True)

    # each the quickest of three runs: the threshold is kept for every later process
    cpu_per_token = best_seconds(lambda: moe.moe_ffn(x, *stacks, weights, ids), 3) / MEASURE_TOKENS
    copy_seconds = best_seconds(copy, 3, lambda: torch.cuda.synchronize(device))
    threshold = tokens_worth_staging(cpu_per_token, copy_seconds, k, n_expert)
    remember(THRESHOLD_FILE, key, threshold)
    return threshold
