"""Auto-fit: choose -ngl, --n-cpu-moe and -ts so every device keeps its margin free.

Like llama.cpp's common/fit.cpp, the answer is options a user could have typed, so the plan report
can print them and a user can pin them. The preference order is what speeds decode most per byte:

1. every layer's attention, norms, shared experts and KV on a GPU (`-ngl` as high as allowed);
2. for MoE models, routed experts spill to the CPU first, whole layers at a time from layer 0
   (`--n-cpu-moe K`, the smallest K that fits);
3. only then whole layers leave the GPUs (`-ngl` lowered), dense FFNs with them;
4. across GPUs, layers go in CUDA order (llama.cpp's layer split), and the per-GPU counts are
   chosen so the fastest GPU (by bandwidth, else size) is filled first: slower GPUs get as few
   layers as still fit, emitted as `-ts` counts such as `-ts 35,20`.

Values the user set are bounds, never overridden the other way: a given -ngl is a ceiling, a
given --n-cpu-moe a floor, -ts/-sm/-mg/-ot are kept. Every candidate is checked with the real
planner, so a fitted plan never exceeds a budget.
"""

from __future__ import annotations

from collections.abc import Callable

from llmx.errors import LlmxError
from llmx.plan.devices import Inventory, MiB, fmt_bytes
from llmx.plan.memory import compute_bytes, kv_layer_bytes
from llmx.plan.model import ModelSpec
from llmx.plan.options import Options
from llmx.plan.placement import Plan
from llmx.plan.planner import OUTPUT_TENSORS, gpus_in_use, place
from llmx.plan.rules import compile_rules


def plan(model: ModelSpec, inv: Inventory, opts: Options) -> Plan:
    """The entry point: fit first when --fit is on (explicitly, or by default without -ngl)."""
    if opts.fit_enabled(bool(inv.gpus)):
        fitted, notes = _fit(model, inv, opts)
        return place(model, inv, fitted, notes)
    return place(model, inv, opts)


def fit(model: ModelSpec, inv: Inventory, opts: Options) -> Options:
    """Options that place `model` on `inv` with every margin kept; LlmxError says how short it is."""
    return _fit(model, inv, opts)[0]


def suggestion(model: ModelSpec, inv: Inventory, opts: Options) -> str:
    """For an over-budget plan: the nearest options that fit (without margins), as a hint."""
    try:
        fitted = fit(model, inv, opts.replace(fit_margin_mib=0, gpu_fit_margin=()))
    except LlmxError:
        return "the model does not fit in this machine's memory at all; try a smaller quant or a shorter -c"
    hints = []
    if fitted.n_cpu_moe != opts.n_cpu_moe:
        hints.append(f"-ncmoe {fitted.n_cpu_moe}")
    if fitted.n_gpu_layers != opts.n_gpu_layers:
        hints.append(f"-ngl {fitted.n_gpu_layers}")
    return f"try {' '.join(hints)} or --fit" if hints else "try --fit"


# --- the search ---


def _fit(model: ModelSpec, inv: Inventory, opts: Options) -> tuple[Options, tuple[str, ...]]:
    margins = {d.name: opts.margin_mib(d.index) * MiB for d in inv.devices}
    if not inv.gpus:
        cpu_only = opts.replace(n_gpu_layers=0, fit=False)
        p = place(model, inv, cpu_only)
        if not p.fits(margins):
            raise LlmxError(f"{model.name} does not fit: {_shortfall(p, margins)}")
        return cpu_only, ("--fit: no GPU, everything runs on the CPU",)
    n = model.config.n_layer
    ceiling = n + 1 if opts.n_gpu_layers is None else min(opts.n_gpu_layers, n + 1)
    tried: dict[tuple[int, int], tuple[Options, Plan | None]] = {}

    def attempt(ngl: int, k: int) -> tuple[Options, Plan | None]:
        if (ngl, k) not in tried:
            tried[ngl, k] = _attempt(model, inv, opts, ngl, k, margins)
        return tried[ngl, k]

    def gpus_fit(ngl: int, k: int) -> bool:
        p = attempt(ngl, k)[1]
        return p is not None and all(u.left >= margins[u.device] for u in p.usage if u.device != "cpu")

    k = opts.n_cpu_moe
    ngl: int | None = ceiling
    if any(t.role == "experts" for t in model.tensors) and not opts.cpu_moe:
        k = _first_true(opts.n_cpu_moe, n, lambda k: gpus_fit(ceiling, k))
        if k is None:
            k = n  # all experts on the CPU is not enough: whole layers must leave too
            ngl = _last_true(0, ceiling, lambda g: gpus_fit(g, n))
    else:
        ngl = _last_true(0, ceiling, lambda g: gpus_fit(g, k))
    if ngl is None:
        _, p = attempt(0, k)
        raise LlmxError(f"{model.name} does not fit even with no layer on a GPU: {_shortfall(p, margins)}")
    chosen, p = attempt(ngl, k)
    if p is None or not p.fits(margins):
        raise LlmxError(f"{model.name} does not fit: {_shortfall(p, margins)}")
    return chosen, _notes(opts, chosen, model, margins)


def _attempt(
    model, inv, opts: Options, ngl: int, k: int, margins: dict[str, int]
) -> tuple[Options, Plan | None]:
    """Options for (ngl, k) with -ts counts when fit chooses the split; the plan, or None if the
    layers cannot be partitioned over the GPUs at all."""
    cand = opts.replace(n_gpu_layers=ngl, n_cpu_moe=k, fit=False)
    gpus = gpus_in_use(inv, cand)
    if ngl and opts.split_mode == "layer" and len(gpus) > 1 and opts.tensor_split is None:
        counts = _layer_counts(model, inv, cand, margins)
        if counts is None:
            return cand, None
        cand = cand.replace(tensor_split=tuple(float(c) for c in counts))
    return cand, place(model, inv, cand)


def _layer_counts(
    model: ModelSpec, inv: Inventory, opts: Options, margins: dict[str, int]
) -> list[int] | None:
    """How many of the GPU layers each GPU takes (contiguous, in CUDA order), filling the fastest
    GPU first; None if no partition fits."""
    n, ngl = model.config.n_layer, opts.n_gpu_layers or 0
    start, act = max(n - ngl, 0), min(ngl, n + 1)
    rules = compile_rules(opts, inv)
    fixed = {g.name: 0 for g in inv.gpus}  # bytes the -ot rules pin to each GPU whatever the split
    cost = [0] * (n + 1)  # bytes that follow layer i onto its GPU (i = n: the output layer)
    for t in model.tensors:
        pinned = next((r.device for r in rules if r.matches(t.name)), None)
        if pinned is not None:
            if pinned != "cpu":
                fixed[pinned] += t.nbytes
        elif t.layer is not None:
            cost[t.layer] += t.nbytes
        elif t.name in OUTPUT_TENSORS:
            cost[n] += t.nbytes
    if not any(t.name == "output.weight" for t in model.tensors):
        cost[n] += next(t.nbytes for t in model.tensors if t.name == "token_embd.weight")
    cost[n] += compute_bytes(model, opts, attention=False, ffn=False, output=True, inp=False, gpu=True)
    if not opts.no_kv_offload:
        cost[:n] = [c + kv_layer_bytes(model, opts, i) for i, c in enumerate(cost[:n])]
    scratch = compute_bytes(model, opts, attention=True, ffn=True, output=False, inp=False, gpu=True)
    room = [g.free - margins[g.name] - fixed[g.name] - scratch for g in inv.gpus]
    layers = cost[start : start + act]

    def partition(caps: list[int]) -> list[int] | None:
        # Greedy in CUDA order: each GPU takes the longest run that fits. For contiguous parts with
        # monotone limits this is optimal, so None means no partition exists under these caps.
        counts, i = [], 0
        for g, cap in enumerate(caps):
            used, c = 0, 0
            while i < len(layers) and c < cap and used + layers[i] <= room[g]:
                used, c, i = used + layers[i], c + 1, i + 1
            counts.append(c)
        return counts if i == len(layers) else None

    caps = [len(layers)] * len(inv.gpus)
    if partition(caps) is None:
        return None
    by_speed = sorted(range(len(inv.gpus)), key=lambda g: (inv.gpus[g].bandwidth, inv.gpus[g].total, -g))
    for g in by_speed[:-1]:  # slowest first: give it as few layers as still fit
        caps[g] = _first_true(
            0, len(layers), lambda c, g=g: partition(caps[:g] + [c] + caps[g + 1 :]) is not None
        )
    return partition(caps)


# --- helpers ---


def _first_true(lo: int, hi: int, pred: Callable[[int], bool]) -> int | None:
    """Smallest x in [lo, hi] with pred(x), for pred false...false true...true; None if none."""
    if lo > hi or not pred(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _last_true(lo: int, hi: int, pred: Callable[[int], bool]) -> int | None:
    """Largest x in [lo, hi] with pred(x), for pred true...true false...false; None if none."""
    if lo > hi or not pred(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _shortfall(p: Plan | None, margins: dict[str, int]) -> str:
    if p is None:
        return "the GPU layers cannot be split over the GPUs"
    short = [
        f"{u.device} is short by {fmt_bytes(margins[u.device] - u.left)} (needs {fmt_bytes(u.used)} "
        f"+ {fmt_bytes(margins[u.device])} margin, has {fmt_bytes(u.free)} free)"
        for u in p.usage
        if u.total and u.left < margins[u.device]
    ]
    return (
        "; ".join(short)
        + "; try a smaller quant, a shorter -c, a quantized KV cache (-ctk q8_0) or --fit-margin"
    )


def _notes(user: Options, chosen: Options, model: ModelSpec, margins: dict[str, int]) -> tuple[str, ...]:
    keep = ", ".join(f"{d} {m // MiB} MiB" for d, m in margins.items())
    notes = [f"--fit chose {' '.join(chosen.to_args()) or 'the defaults'} (keeping free: {keep})"]
    if user.n_gpu_layers is not None and chosen.n_gpu_layers < min(
        user.n_gpu_layers, model.config.n_layer + 1
    ):
        notes.append(f"--fit lowered -ngl {user.n_gpu_layers} to {chosen.n_gpu_layers}")
    if chosen.n_cpu_moe > user.n_cpu_moe:
        notes.append(f"--fit keeps the experts of layers 0-{chosen.n_cpu_moe - 1} on the CPU")
    return tuple(notes)
