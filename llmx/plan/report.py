"""The plan as the user reads it: plain aligned text, llama.cpp's vocabulary.

Sections: the devices (name, bus id, memory); where the layers went as ranges; a per-layer table of
bytes and device for attention, dense FFN, experts, shared experts and other tensors (consecutive
layers with identical rows are folded into one line); the per-device bill; the `offloaded N/M`
line; then notes, warnings and errors.
"""

from __future__ import annotations

from llmx.plan.devices import GiB, fmt_bytes
from llmx.plan.placement import LayerRow, Plan
from llmx.plan.tensors import ROLES

_HEAD = {
    "attn": "attention",
    "ffn": "dense FFN",
    "experts": "experts",
    "shared": "shared exp",
    "other": "other",
}


def render(plan: Plan, errors: list[str] | None = None) -> str:
    """The whole report. `errors` (e.g. over-budget messages with a suggestion) go last."""
    out = [f"model   {plan.model}   ({plan.n_layer} layers, ctx {plan.ctx}, "
           f"KV {plan.options.cache_type_k}/{plan.options.cache_type_v})"]  # fmt: skip
    if plan.options.to_args():
        out.append(f"options {' '.join(plan.options.to_args())}")
    out += ["", "layers"]
    out += [f"  {dev:<8} {spans}" for dev, spans in layer_ranges(plan)]
    out += ["", *_table(_layer_lines(plan)), "", *_table(_device_lines(plan)), "", plan.offloaded_line]
    out += [f"note: {n}" for n in plan.notes]
    out += [f"warning: {w}" for w in plan.warnings]
    out += [f"error: {e}" for e in errors or []]
    return "\n".join(out)


def layer_ranges(plan: Plan) -> list[tuple[str, str]]:
    """[(device, "layers 0-24 (25)")...] in layer order; the output layer is named where it goes."""
    spans: list[tuple[str, int, int]] = []
    for i, dev in enumerate(plan.layer_device):
        if spans and spans[-1][0] == dev and spans[-1][2] == i - 1:
            spans[-1] = (dev, spans[-1][1], i)
        else:
            spans.append((dev, i, i))
    out = []
    for dev, lo, hi in spans:
        text = f"layers {lo}-{hi} ({hi - lo + 1})" if hi > lo else f"layer {lo} (1)"
        out.append((dev, text))
    out.append((plan.output_device, "output layer"))
    return out


def _layer_lines(plan: Plan) -> list[list[str]]:
    shown = [r for r in ROLES if any(row.nbytes[r] for row in plan.layers)]
    lines = [["layer", *(_HEAD[r] for r in shown), "KV", "KV on"]]
    folded: list[tuple[str, LayerRow]] = []
    for row in plan.layers:
        label = str(row.layer)
        if folded and isinstance(row.layer, int) and _same(folded[-1][1], row):
            first = folded[-1][0].split("-")[0]
            folded[-1] = (f"{first}-{row.layer}", row)
        else:
            folded.append((label, row))
    for label, row in folded:
        cells = [f"{_mib(row.nbytes[r])} {row.devices[r]}" if row.nbytes[r] else "-" for r in shown]
        kv = [_mib(row.kv_bytes), row.kv_device] if row.kv_bytes else ["-", ""]
        lines.append([label, *cells, *kv])
    return lines


def _same(a: LayerRow, b: LayerRow) -> bool:
    return isinstance(a.layer, int) and (a.nbytes, a.devices, a.kv_bytes, a.kv_device) == (
        b.nbytes, b.devices, b.kv_bytes, b.kv_device,
    )  # fmt: skip


def _device_lines(plan: Plan) -> list[list[str]]:
    lines = [["device", "name", "weights", "KV", "compute", "total", "free", "left", "fit margin"]]
    for u in plan.usage:
        name = " ".join(x for x in (u.label, u.bus_id) if x) or "-"
        weights = _gib(u.weights) + (" (mmap)" if u.device == "cpu" and not plan.options.no_mmap else "")
        free = _gib(u.free) if u.total else "?"
        left = (_gib(u.left) + ("  OVER" if u.over else "")) if u.total else "?"
        lines.append([u.device, name, weights, _gib(u.kv), _gib(u.compute), _gib(u.used), free, left,
                      fmt_bytes(u.margin)])  # fmt: skip
    return lines


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _mib(n: int) -> str:
    """Compact sizes for the layer table: 436M, or 12K for norms."""
    return f"{n / 2**20:.0f}M" if n >= 2**20 else f"{-(-n // 1024)}K"
