"""`-sm row` as tensor parallelism: every GPU holds some of each GPU layer's attention heads and part of
its FFN width, in proportion to `-ts`, so a decode step reads each GPU's share of the weights at once
and the GPUs meet only twice a layer (Megatron-LM's split). Pure: names and shapes in, ranges out.

For the GPUs in use (the main GPU first) and each layer split this way, GPU j holds
    attn_q, attn_k, attn_v (and their biases)   the rows of its KV heads and of their query heads
    attn_output                                 the columns of those query heads   -> a partial sum
    ffn_gate, ffn_up                            rows [f0, f1) of the FFN width
    ffn_down                                    columns [f0, f1)                   -> a partial sum
    every other tensor of the layer (norms)     a copy
and the layer's KV cache for its KV heads. The two partial sums are added across the GPUs in the
same order on each, so every GPU keeps the same copy of the residual stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmx.plan.model import ModelSpec
from llmx.plan.tensors import TensorSpec
from llmx.quant import qtype

QUERY_ROWS = ("attn_q",)
KV_ROWS = ("attn_k", "attn_v")
FFN_ROWS = ("ffn_gate", "ffn_up")
HEAD_COLUMNS = ("attn_output",)
FFN_COLUMNS = ("ffn_down",)
SPLIT = (*QUERY_ROWS, *KV_ROWS, *FFN_ROWS, *HEAD_COLUMNS, *FFN_COLUMNS)


@dataclass(frozen=True)
class Shard:
    """One GPU's part of every split layer: KV heads [h0, h1) (query heads follow their group) and FFN
    width [f0, f1)."""

    device: str
    kv_heads: tuple[int, int]
    ff: tuple[int, int]


@dataclass(frozen=True)
class Cut:
    """Where a split layer's tensor goes: `axis` 0 (rows) or 1 (columns) cut into (device, lo, hi)
    ranges, or `axis` None: a whole copy on each device."""

    axis: int | None
    parts: tuple[tuple[str, int, int], ...]


def shards(model: ModelSpec, devices: list[str], shares: list[float]) -> tuple[Shard, ...] | str:
    """Each device's heads and FFN width, or why the model's layers cannot be split this way."""
    c = model.config
    if c.n_head_kv < 2 or not c.n_ff or c.n_head % c.n_head_kv:
        return f"{c.n_head_kv} KV head(s) and an FFN of {c.n_ff} cannot be divided between GPUs"
    layer_tensors = [t for t in model.tensors if t.layer is not None and len(t.shape) > 1]
    other = sorted({t.short for t in layer_tensors} - set(SPLIT))
    if other:
        return f"its layers hold matrices only one GPU can multiply ({', '.join(other)})"
    headed = sorted({t.qtype for t in layer_tensors if t.short in SPLIT and qtype(t.qtype).row_meta_bytes})
    if headed:
        return f"{', '.join(headed)} rows start with a scale of their own and cannot be cut into columns"
    heads = _apportion(c.n_head_kv, shares)
    unit = max(_columns_unit(t) for t in layer_tensors if t.short in FFN_COLUMNS)
    ff = _apportion(c.n_ff // unit, shares) if c.n_ff % unit == 0 else None
    if ff is None or min(b - a for a, b in heads) == 0 or min(b - a for a, b in ff) == 0:
        return f"{len(devices)} GPUs cannot each take a whole KV head and {unit} FFN columns"
    group = c.n_head // c.n_head_kv
    for t in layer_tensors:  # the attention output's column cuts must fall between its blocks
        if t.short in HEAD_COLUMNS and any(a * group * c.head_dim_v % _columns_unit(t) for a, _ in heads):
            return f"its attention heads do not end on {t.qtype} block boundaries"
    return tuple(
        Shard(d, h, (f0 * unit, f1 * unit)) for d, h, (f0, f1) in zip(devices, heads, ff, strict=True)
    )


def cut(t: TensorSpec, model: ModelSpec, split: tuple[Shard, ...]) -> Cut:
    """How tensor `t` of a split layer is divided among `split`'s devices."""
    short = t.short
    c = model.config
    group, dk, dv = c.n_head // c.n_head_kv, c.head_dim, c.head_dim_v

    def ranges(scale: int, of: str) -> tuple[tuple[str, int, int], ...]:
        return tuple((s.device, getattr(s, of)[0] * scale, getattr(s, of)[1] * scale) for s in split)

    if short in QUERY_ROWS:
        return Cut(0, ranges(group * dk, "kv_heads"))
    if short in KV_ROWS:
        return Cut(0, ranges(dk if short == "attn_k" else dv, "kv_heads"))
    if short in FFN_ROWS:
        return Cut(0, ranges(1, "ff"))
    if short in HEAD_COLUMNS and t.is_matrix:
        return Cut(1, ranges(group * dv, "kv_heads"))
    if short in FFN_COLUMNS and t.is_matrix:
        return Cut(1, ranges(1, "ff"))
    return Cut(None, tuple((s.device, 0, t.shape[0]) for s in split))


def kv_parts(split: tuple[Shard, ...], device: str) -> tuple[tuple[str, float], ...]:
    """(device, fraction) of a layer's KV cache planned on `device`: a split layer's (`split` given)
    is divided between the GPUs by KV heads, unless it stays on the CPU (`--no-kv-offload`)."""
    if not split or device == "cpu":
        return ((device, 1.0),)
    total = sum(s.kv_heads[1] - s.kv_heads[0] for s in split)
    return tuple((s.device, (s.kv_heads[1] - s.kv_heads[0]) / total) for s in split)


def _columns_unit(t: TensorSpec) -> int:
    """The fewest columns a cut of `t` may hold: its quantization blocks stay whole."""
    return qtype(t.qtype).block_elems


def _apportion(units: int, shares: list[float]) -> list[tuple[int, int]]:
    """`units` cut into consecutive ranges in proportion to `shares` (largest remainders), each range
    of a positive share holding at least one unit where there are enough."""
    total = sum(shares)
    exact = [units * s / total for s in shares]
    counts = [int(e) for e in exact]
    for i in sorted(range(len(shares)), key=lambda i: exact[i] - counts[i], reverse=True)[
        : units - sum(counts)
    ]:
        counts[i] += 1
    for i in range(len(counts)):  # lend a unit to an empty range from the largest one
        if counts[i] == 0 and shares[i] > 0:
            j = max(range(len(counts)), key=lambda j: counts[j])
            if counts[j] > 1:
                counts[j] -= 1
                counts[i] += 1
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return list(zip(bounds[:-1], bounds[1:], strict=True))
