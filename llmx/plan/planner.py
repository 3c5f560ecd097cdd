"""The placement planner: (model, inventory, options) -> Plan, with llama.cpp's semantics. Pure.

How a tensor's device is decided, in order:
1. the first override rule that matches its name (`-ot`, then `--cpu-moe`/`--n-cpu-moe`);
2. token embeddings (and other non-layer tensors) stay on the CPU: a lookup gains nothing on a GPU;
3. a repeating layer's tensors follow their layer: `-ngl N` puts the *last* N layers on GPUs, and
   with N > n_layer the output layer too (llama_model::load_tensors, `i_gpu_start`);
4. `-sm layer` spreads the GPU layers over the GPUs in proportion to `-ts` (default: free memory),
   GPU 0 taking the first of them; `-sm none` uses the `-mg` GPU only; `-sm row` keeps the layers on
   the `-mg` GPU but divides each GPU layer's heads and FFN width between the GPUs in proportion to
   `-ts` (`tensor_parallel`), and the output matrix's rows.
A layer's KV cache lives with the layer (a split layer's: by KV heads), or on the CPU with
`--no-kv-offload`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from llmx.errors import LlmxError
from llmx.plan.devices import Device, GiB, Inventory, MiB
from llmx.plan.memory import (
    compute_bytes,
    context_length,
    exchange_bytes,
    kv_layer_bytes,
    kv_rows,
    stream_bytes,
)
from llmx.plan.model import ModelSpec
from llmx.plan.options import ALL_LAYERS, Options
from llmx.plan.placement import DeviceUse, LayerRow, Plan
from llmx.plan.rules import Rule, compile_rules
from llmx.plan.tensor_parallel import Shard, cut, kv_parts, shards
from llmx.plan.tensors import ROLES, TensorSpec

OUTPUT_TENSORS = ("output_norm.weight", "output.weight")
ROW_ROUNDING = 64  # row-split boundaries fall on multiples of 64 rows, as ggml-cuda rounds them


@dataclass(frozen=True)
class _Where:
    """The placement decisions, before any accounting."""

    tensor_device: dict[str, str]
    row_splits: dict[str, tuple[tuple[str, int, int], ...]]
    column_splits: dict[str, tuple[tuple[str, int, int], ...]]
    replicas: dict[str, tuple[str, ...]]
    extra_copies: dict[str, str]
    layer_dev: list[str]
    output_dev: str
    kv_devices: tuple[str, ...]
    split: tuple[Shard, ...]
    split_layers: frozenset[int]

    def parts(self, t: TensorSpec) -> tuple[tuple[str, int], ...]:
        """(device, bytes) pieces of `t`: one unless it is split or copied to several GPUs."""
        for splits, axis in ((self.row_splits, 0), (self.column_splits, 1)):
            if t.name in splits:
                return tuple((dev, t.nbytes * (hi - lo) // t.shape[axis]) for dev, lo, hi in splits[t.name])
        return tuple((dev, t.nbytes) for dev in (self.tensor_device[t.name], *self.replicas.get(t.name, ())))

    def kv_parts(self, layer: int) -> tuple[tuple[str, float], ...]:
        """(device, share) of layer `layer`'s KV cache: one device, or a split layer's GPUs by heads."""
        return kv_parts(self.split if layer in self.split_layers else (), self.kv_devices[layer])


def place(model: ModelSpec, inv: Inventory, opts: Options, notes: tuple[str, ...] = ()) -> Plan:
    """Apply `opts` exactly (no fitting) and account for every byte."""
    gpus = gpus_in_use(inv, opts)
    layer_dev, output_dev, n_offloaded = assign_layers(model, opts, gpus, inv)
    rules = compile_rules(opts, inv)
    hits: list[list[str]] = [[] for _ in rules]
    tensor_device: dict[str, str] = {}
    pinned: set[str] = set()
    for t in model.tensors:
        for i, rule in enumerate(rules):
            if rule.matches(t.name):
                tensor_device[t.name] = rule.device
                hits[i].append(t.name)
                pinned.add(t.name)
                break
        else:
            tensor_device[t.name] = _home(t, layer_dev, output_dev)

    row_splits, column_splits, replicas = {}, {}, {}
    split: tuple[Shard, ...] = ()
    split_layers: frozenset[int] = frozenset()
    split_warnings = []
    if opts.split_mode == "row" and len(gpus) > 1:
        shares = _shares(opts, gpus, inv)
        split, why = _tensor_parallel(model, opts, gpus, shares, inv)
        if why:
            split_warnings.append(f"-sm row: {why}; the layers run whole on {inv.gpus[opts.main_gpu].name}")
        held = {t.layer for t in model.tensors if t.name in pinned}  # -ot keeps such a layer whole
        split_layers = frozenset(i for i, d in enumerate(layer_dev) if split and d != "cpu" and i not in held)
        for t in model.tensors:
            if t.layer in split_layers:
                p = cut(t, model, split)
                if p.axis is None:
                    replicas[t.name] = tuple(d for d, _, _ in p.parts if d != tensor_device[t.name])
                else:
                    (row_splits if p.axis == 0 else column_splits)[t.name] = p.parts
            elif t.name == "output.weight" and tensor_device[t.name] != "cpu" and t.name not in pinned:
                row_splits[t.name] = _row_ranges(t.shape[0], gpus, shares)  # its rows' products gathered

    extra_copies = {}
    tied = not any(t.name == "output.weight" for t in model.tensors)
    if tied and output_dev != tensor_device.get("token_embd.weight", "cpu"):
        extra_copies["token_embd.weight"] = output_dev  # the output matrix is the embedding table

    kv_devices = tuple("cpu" if opts.no_kv_offload else d for d in layer_dev)
    where = _Where(
        tensor_device,
        row_splits,
        column_splits,
        replicas,
        extra_copies,
        layer_dev,
        output_dev,
        kv_devices,
        split,
        split_layers,
    )
    usage = _usage(model, inv, opts, where)
    main_gpu = inv.gpus[opts.main_gpu].name if gpus else None
    usage, op_offload, offload_notes = _reserve_streaming(model, opts, layer_dev, output_dev, main_gpu, usage)
    notes = (
        *notes,
        *(rule_note(r, names) for r, names in zip(rules, hits, strict=True) if names),
        *offload_notes,
        *((split_note(split, len(split_layers)),) if split_layers else ()),
    )
    warnings = [f"{r.source} matched no tensor" for r, names in zip(rules, hits, strict=True) if not names]
    warnings += split_warnings
    warnings += _empty_gpu_warnings(opts, gpus, usage, n_offloaded)
    if not inv.gpus and opts.n_gpu_layers:
        warnings.append(f"no GPU: -ngl {opts.n_gpu_layers} has no effect, everything runs on the CPU")
    return Plan(
        model=model.name,
        options=opts,
        n_layer=model.config.n_layer,
        ctx=context_length(model, opts),
        tensor_device=tensor_device,
        layer_device=tuple(layer_dev),
        output_device=output_dev,
        kv_devices=kv_devices,
        kv_rows=tuple(kv_rows(model, opts, i) for i in range(model.config.n_layer)),
        usage=usage,
        layers=_layer_rows(model, opts, where),
        n_offloaded=n_offloaded,
        row_splits=row_splits,
        column_splits=column_splits,
        replicas=replicas,
        split=split,
        split_layers=tuple(sorted(split_layers)),
        extra_copies=extra_copies,
        warnings=tuple(warnings),
        notes=notes,
        op_offload=op_offload,
    )


def rule_note(rule: Rule, names: list[str]) -> str:
    """What an override rule took, so that a regex that caught more than meant shows (-ot regexes are
    searched anywhere in a name: `output\\.weight` also takes every blk.N.attn_output.weight)."""
    shown = names if len(names) <= 3 else [*names[:2], "...", names[-1]]
    count = f"{len(names)} tensor{'s' if len(names) > 1 else ''}"
    return f"{rule.source} put {count} on {rule.device}: {', '.join(shown)}"


def _reserve_streaming(
    model: ModelSpec,
    opts: Options,
    layer_dev: list[str],
    output_dev: str,
    main_gpu: str | None,
    usage: tuple[DeviceUse, ...],
) -> tuple[tuple[DeviceUse, ...], str | None, tuple[str, ...]]:
    """Op offload (prompt batches of CPU layers computed on a GPU with their weights streamed) where
    the runtime would do it: some layers on the CPU, and a GPU to stream to: the first one in layer
    order, or with no layer on a GPU (-ngl 0, as llama.cpp does then) the main one (-mg). Its buffers
    (the streamed layers, and a layer's scratch where it runs no layer of its own) are added to that
    GPU's compute when they fit within its free memory and margin; when they do not, op offload is
    planned off, and a note says so. Returns the usage, that GPU (None: off), notes."""
    holding = [d for d in (*layer_dev, output_dev) if d != "cpu"]
    target = holding[0] if holding else main_gpu
    cpu_layers = [i for i, d in enumerate(layer_dev) if d == "cpu"]
    if opts.no_op_offload or target is None or not cpu_layers or opts.n_ubatch < 2:
        return usage, None, ()
    need = stream_bytes(model, cpu_layers)
    if target not in layer_dev:
        need += compute_bytes(model, opts, attention=True, ffn=True, output=False, inp=False, gpu=True)
    i = next(k for k, u in enumerate(usage) if u.device == target)
    u = usage[i]
    if u.total and u.left - u.margin < need:
        note = (
            f"op offload off: streaming CPU layers to {u.device} for prompts needs {need / GiB:.2f} GiB "
            f"beyond its fit margin ({u.left / GiB:.2f} GiB left); the CPU layers run prompts on the CPU"
        )
        return usage, None, (note,)
    grown = replace(u, compute=u.compute + need)
    return (*usage[:i], grown, *usage[i + 1 :]), target, ()


# --- layers -> devices ---


def gpus_in_use(inv: Inventory, opts: Options) -> list[Device]:
    """The GPUs layers may go to: all of them, or only the -mg one with -sm none."""
    if not inv.gpus:
        return []
    if opts.main_gpu >= len(inv.gpus):
        raise LlmxError(f"-mg {opts.main_gpu}: this machine has {len(inv.gpus)} GPU(s), numbered from 0")
    if opts.split_mode == "none":
        return [inv.gpus[opts.main_gpu]]
    return list(inv.gpus)


def assign_layers(
    model: ModelSpec, opts: Options, gpus: list[Device], inv: Inventory
) -> tuple[list[str], str, int]:
    """(device of each repeating layer, device of the output layer, number of offloaded layers)."""
    n = model.config.n_layer
    if not gpus:
        return ["cpu"] * n, "cpu", 0
    ngl = ALL_LAYERS if opts.n_gpu_layers is None else opts.n_gpu_layers
    start, act = max(n - ngl, 0), min(ngl, n + 1)
    main = inv.gpus[opts.main_gpu].name
    points = _split_points(_shares(opts, gpus, inv)) if opts.split_mode == "layer" else []

    def device(il: int) -> str:
        if il < start or il - start >= act:
            return "cpu"
        if opts.split_mode != "layer":
            return main
        # llama.cpp: the first split point above the layer's position among the GPU layers
        k = bisect.bisect_right(points, (il - start) / act)
        return gpus[min(k, len(gpus) - 1)].name

    return [device(i) for i in range(n)], device(n), act


def _shares(opts: Options, gpus: list[Device], inv: Inventory) -> list[float]:
    """Each in-use GPU's proportion: -ts (indexed by CUDA number) or its free memory."""
    if opts.tensor_split is None:
        shares = [float(g.free) for g in gpus]
    else:
        if len(opts.tensor_split) > len(inv.gpus):
            raise LlmxError(
                f"-ts gives {len(opts.tensor_split)} proportions but this machine has {len(inv.gpus)} GPU(s)"
            )
        padded = list(opts.tensor_split) + [0.0] * (len(inv.gpus) - len(opts.tensor_split))
        shares = [padded[g.index] for g in gpus]
    if sum(shares) <= 0:
        raise LlmxError("-ts gives every GPU in use a zero share; give at least one a positive proportion")
    return shares


def _split_points(shares: list[float]) -> list[float]:
    total, acc, points = sum(shares), 0.0, []
    for s in shares:
        acc += s
        points.append(acc / total)
    return points


def split_note(split: tuple[Shard, ...], n_layers: int) -> str:
    """Which heads and FFN columns each GPU of a `-sm row` split holds."""
    parts = "; ".join(
        f"{s.device} KV heads {s.kv_heads[0]}-{s.kv_heads[1] - 1}, FFN columns {s.ff[0]}-{s.ff[1] - 1}"
        for s in split
    )
    return f"-sm row divides {n_layers} layers: {parts}; partial sums are added across the GPUs twice a layer"


def _tensor_parallel(
    model: ModelSpec, opts: Options, gpus: list[Device], shares: list[float], inv: Inventory
) -> tuple[tuple[Shard, ...], str]:
    """The GPUs' parts of every split layer, the main GPU first (its copy of the residual stream goes
    on to the output layer), or () and why the layers cannot be split."""
    main = inv.gpus[opts.main_gpu].name
    order = sorted(
        ((g.name, s) for g, s in zip(gpus, shares, strict=True) if s > 0), key=lambda p: p[0] != main
    )
    if len(order) < 2 or order[0][0] != main:
        return (), "it needs the main GPU (-mg) and another one with a -ts share"
    result = shards(model, [d for d, _ in order], [s for _, s in order])
    return ((), result) if isinstance(result, str) else (result, "")


def _row_ranges(rows: int, gpus: list[Device], shares: list[float]) -> tuple[tuple[str, int, int], ...]:
    points = _split_points(shares)
    bounds = [0] + [int(rows * p) // ROW_ROUNDING * ROW_ROUNDING for p in points[:-1]] + [rows]
    return tuple((g.name, lo, hi) for g, lo, hi in zip(gpus, bounds[:-1], bounds[1:], strict=True) if hi > lo)


def _home(t: TensorSpec, layer_dev: list[str], output_dev: str) -> str:
    if t.layer is not None:
        return layer_dev[t.layer]
    return output_dev if t.name in OUTPUT_TENSORS else "cpu"


# --- accounting ---


def _usage(model: ModelSpec, inv: Inventory, opts: Options, where: _Where) -> tuple[DeviceUse, ...]:
    weights = {d.name: 0 for d in inv.devices}
    runs: dict[str, set[str]] = {d.name: set() for d in inv.devices}  # the roles of ops each device runs
    for t in model.tensors:
        for dev, nbytes in where.parts(t):
            weights[dev] += nbytes
            runs[dev].add(t.role)
    for t in model.tensors:
        if t.name in where.extra_copies:
            weights[where.extra_copies[t.name]] += t.nbytes
    kv = {d.name: 0 for d in inv.devices}
    for layer in range(model.config.n_layer):
        for dev, share in where.kv_parts(layer):
            kv[dev] += round(kv_layer_bytes(model, opts, layer) * share)
    for dev in where.layer_dev:
        runs[dev].add("attn")  # a layer's attention runs where the layer lives
    for s in where.split:
        runs[s.device] |= {"attn", "ffn"}
    usage = []
    for d in inv.devices:
        compute = 0
        if weights[d.name] or kv[d.name] or d.name == where.output_dev:
            compute = compute_bytes(
                model,
                opts,
                attention="attn" in runs[d.name],
                ffn=bool(runs[d.name] & {"ffn", "experts", "shared"}),
                output=d.name == where.output_dev,
                inp=d.name == where.tensor_device.get("token_embd.weight"),
                gpu=d.is_gpu,
            )
        if any(s.device == d.name for s in where.split):
            compute += exchange_bytes(model, opts, len(where.split))
        margin = opts.margin_mib(d.index) * MiB
        usage.append(
            DeviceUse(
                d.name, d.label, d.bus_id, d.total, d.free, weights[d.name], kv[d.name], compute, margin
            )
        )
    return tuple(usage)


def _layer_rows(model: ModelSpec, opts: Options, where: _Where) -> tuple[LayerRow, ...]:
    groups: dict[int | str, list[TensorSpec]] = {
        "input": [],
        **{i: [] for i in range(model.config.n_layer)},
        "output": [],
    }
    for t in model.tensors:
        key = t.layer if t.layer is not None else ("output" if t.name in OUTPUT_TENSORS else "input")
        groups[key].append(t)
    rows = []
    for key, tensors in groups.items():
        nbytes = {r: 0 for r in ROLES}
        devices: dict[str, set[str]] = {r: set() for r in ROLES}
        for t in tensors:
            nbytes[t.role] += t.nbytes
            devices[t.role] |= {dev for dev, _ in where.parts(t)}
        joined = {r: "+".join(sorted(devices[r], key=_device_order)) for r in ROLES}
        kv: tuple[int, str] = (0, "")
        if isinstance(key, int):
            kv_on = "+".join(sorted((d for d, _ in where.kv_parts(key)), key=_device_order))
            kv = (kv_layer_bytes(model, opts, key), kv_on)
        rows.append(LayerRow(key, nbytes, joined, *kv))
    return tuple(rows)


def _device_order(name: str) -> tuple[int, int]:
    return (1, 0) if name == "cpu" else (0, int(name.split(":")[1]))


def _empty_gpu_warnings(
    opts: Options, gpus: list[Device], usage: tuple[DeviceUse, ...], n_offloaded: int
) -> list[str]:
    if not n_offloaded and not any(u.weights for u in usage if u.device != "cpu"):
        return []
    in_use = {g.name for g in gpus}
    out = []
    for u in usage:
        if u.device == "cpu" or u.weights or u.kv:
            continue
        if u.device not in in_use:
            out.append(f"{u.device} is left empty: -sm none uses only -mg {opts.main_gpu}")
        elif opts.tensor_split is not None:
            out.append(f"{u.device} is left empty: -ts gives it no share of the {n_offloaded} GPU layers")
        else:
            out.append(f"{u.device} is left empty: its share of the {n_offloaded} GPU layers rounds to none")
    return out
