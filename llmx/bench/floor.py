"""The bandwidth floor: the least time one generated token can take on the devices that hold it.

Decode is memory-bound, so a token costs at least the bytes it must read divided by the bandwidth
of the device they sit on, summed over devices (GPU bytes / HBM bandwidth + CPU bytes / RAM
bandwidth; the devices work one after another during decode, not in parallel). The bytes are every
weight except the token embedding table (one row of it is read, not the table), plus only the
active experts' share of MoE expert tensors, plus the KV cache at the current depth (of a
sliding-window layer's ring, at most the positions it holds). With tied
embeddings (no `output.weight`) the embedding table is the output matrix and is read in full.
Pure arithmetic: no torch, so it is tested on hand-computed cases. A `-sm row` split counts each
GPU's rows on that GPU; those GPUs read concurrently, so for row splits the sum is an upper bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmx.plan.memory import kv_read_bytes
from llmx.plan.tensor_parallel import kv_parts

if TYPE_CHECKING:
    from llmx.plan.placement import Plan

EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"
GB = 1e9  # bandwidths are quoted in decimal GB/s, as hardware vendors and llama.cpp users quote them


@dataclass(frozen=True)
class TokenBytes:
    """Bytes read to generate one token, per device: fixed weights plus the KV caches it reads."""

    weights: dict[str, float] = field(default_factory=dict)  # device -> bytes of weights read
    # device -> its layers' caches as (K+V bytes a position, positions held)
    kv: dict[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)

    def at_depth(self, n_kv: float) -> dict[str, float]:
        """device -> bytes read for a token that attends over `n_kv` cached positions."""
        devices = self.weights.keys() | self.kv.keys()
        return {
            d: self.weights.get(d, 0.0) + kv_read_bytes(self.kv.get(d, ()), n_kv) for d in sorted(devices)
        }

    def total(self, n_kv: float) -> float:
        return sum(self.at_depth(n_kv).values())


def weight_read_fraction(name: str, tied_embeddings: bool, n_expert_used: int, n_expert: int) -> float:
    """The share of tensor `name` that one token reads during decode."""
    if name == EMBEDDING:
        return 1.0 if tied_embeddings else 0.0
    if "_exps." in name and n_expert:
        return n_expert_used / n_expert
    return 1.0


def token_bytes(
    tensors: Iterable[tuple[str, int, str]],
    kv: Mapping[str, tuple[tuple[float, int], ...]],
    n_expert_used: int = 0,
    n_expert: int = 0,
) -> TokenBytes:
    """Sum `(name, nbytes, device)` tensors into per-device bytes read per generated token; `kv` is
    each device's caches as (K+V bytes a position, positions held)."""
    tensors = list(tensors)
    tied = not any(name == OUTPUT for name, _, _ in tensors)
    weights: dict[str, float] = {}
    for name, nbytes, device in tensors:
        share = weight_read_fraction(name, tied, n_expert_used, n_expert)
        weights[device] = weights.get(device, 0.0) + nbytes * share
    return TokenBytes(weights, dict(kv))


def placed_tensors(plan: Plan, tensors: Iterable[tuple[str, int]]) -> list[tuple[str, int, str]]:
    """`(name, nbytes)` -> `(name, nbytes, device)` as `plan` places them; split matrices per GPU share
    (a `-sm row` layer's vectors, copied to every GPU of the split, count once: a few KB)."""
    out = []
    for name, nbytes in tensors:
        split = plan.row_split(name) or plan.column_split(name)
        if split:
            rows = sum(end - first for _, first, end in split)
            out += [(name, nbytes * (end - first) // rows, dev) for dev, first, end in split]
        elif name == EMBEDDING:
            # Only read per token when tied, and then as the output matrix, on the output's device.
            out.append((name, nbytes, plan.output_device))
        else:
            out.append((name, nbytes, plan.device_of(name)))
    return out


def kv_layers(plan: Plan) -> dict[str, tuple[tuple[float, int], ...]]:
    """device -> its layers' caches as (K+V bytes a position, positions held), from the plan."""
    out: dict[str, tuple[tuple[float, int], ...]] = {}
    for row in plan.layers:
        if row.kv_bytes and isinstance(row.layer, int):
            rows = plan.kv_rows[row.layer]
            split = plan.split if row.layer in plan.split_layers else ()
            for device, share in kv_parts(split, plan.kv_device(row.layer)):
                out[device] = (*out.get(device, ()), (row.kv_bytes * share / rows, rows))
    return out


def plan_token_bytes(
    plan: Plan, tensors: Iterable[tuple[str, int]], n_expert_used: int, n_expert: int
) -> TokenBytes:
    """Bytes per generated token, per device, of a model with `tensors` placed by `plan`."""
    return token_bytes(placed_tensors(plan, tensors), kv_layers(plan), n_expert_used, n_expert)


def floor_seconds(bytes_per_device: Mapping[str, float], bandwidth_gbs: Mapping[str, float]) -> float | None:
    """Sum of bytes / bandwidth over devices; None when a device holding bytes has no measured bandwidth."""
    total = 0.0
    for device, nbytes in bytes_per_device.items():
        if not nbytes:
            continue
        bw = bandwidth_gbs.get(device)
        if not bw:
            return None
        total += nbytes / (bw * GB)
    return total


def mean_depth(n_depth: int, n_gen: int) -> float:
    """The average number of cached positions a token attends over while generating n_gen after n_depth.

    Token i (0-based) of the test attends over n_depth + i positions written before it (plus itself,
    which the engine writes first; the +1 is noise next to the weights, so it is left out).
    """
    return n_depth + (n_gen - 1) / 2 if n_gen else float(n_depth)


@dataclass(frozen=True)
class Roofline:
    """A measured generation speed against its floor."""

    bytes_per_token: float
    floor_seconds: float | None  # None: a device's bandwidth was not measured

    def gbs(self, tokens_per_second: float) -> float:
        """Effective bandwidth: bytes read per token times tokens per second, in GB/s."""
        return self.bytes_per_token * tokens_per_second / GB

    def floor_tps(self) -> float | None:
        return 1.0 / self.floor_seconds if self.floor_seconds else None

    def percent_of_floor(self, tokens_per_second: float) -> float | None:
        """Measured speed as a percentage of the speed the floor allows (100% = at the floor)."""
        ceiling = self.floor_tps()
        return 100.0 * tokens_per_second / ceiling if ceiling else None


def roofline(tb: TokenBytes, n_depth: int, n_gen: int, bandwidth_gbs: Mapping[str, float]) -> Roofline:
    """The floor of a generation test of `n_gen` tokens after `n_depth` cached tokens."""
    per_device = tb.at_depth(mean_depth(n_depth, n_gen))
    return Roofline(sum(per_device.values()), floor_seconds(per_device, bandwidth_gbs))
