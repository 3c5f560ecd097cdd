"""Materialize a GGUF's tensors on their devices, keeping quantized blocks quantized.

CPU tensors are zero-copy views of the file's mmap (nothing is read until a kernel touches it),
optionally repacked once into a faster CPU layout. GPU tensors live in one arena per device: a
single allocation filled with the raw blocks through two pinned staging buffers, so reading the
file and copying to the GPU overlap and no tensor gets an allocation of its own. There, the rows of
an expert stack of the integer-dot types are placed `layout.row_pitch` bytes apart (whole 16-byte
units, as the grouped integer-dot GEMV reads them: Qwen3-30B-A3B's Q6_K down projections have
630-byte rows), the only tensors whose arena bytes exceed the file's.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from llmx.errors import LlmxError
from llmx.gguf import ModelFile, TensorInfo
from llmx.models.common import TensorGroup
from llmx.models.naming import group_key
from llmx.ops import RowSplit
from llmx.plan.placement import Plan
from llmx.quant import QType
from llmx.quant.triton.layout import row_pitch
from llmx.quant.weight import QWeight, prepare_cpu, prepare_gpu, prepare_shared

# Matrices of a layer that the models multiply by the same x in one call (`ops.linear_many`,
# `ops.swiglu`): prepared at load to run as one CPU call (`quant.weight.prepare_shared`). Expert
# stacks are not: the native MoE call (`quant.weight.moe_swiglu`) takes a layer's stacks whole.
SHARED_INPUT = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("ffn_gate_shexp", "ffn_up_shexp"))
ARENA_ALIGN = 256  # bytes: keeps every tensor view aligned for vectorised GPU loads
STAGING_BYTES = 64 << 20

_TORCH_FLOAT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass
class LoadReport:
    """What loading did, per device: bytes placed, seconds spent, how CPU weights were prepared."""

    bytes_per_device: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    upload_seconds: dict[str, float] = field(default_factory=dict)
    cpu_formats: dict[str, int] = field(default_factory=dict)  # "Q4_1 -> int4pack" -> tensor count


def host_view(info: TensorInfo) -> torch.Tensor:
    """The tensor's bytes as a torch view of the mmap: [rows, row_bytes] uint8, or the float tensor."""
    with warnings.catch_warnings():  # the map is read-only and nothing writes through these views
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(info.data)
    return shape_raw(raw, info.qtype, info.shape)


def shape_raw(raw: torch.Tensor, qt: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """Give flat bytes their logical layout: float types become float tensors, blocks stay uint8 rows."""
    if qt.name in _TORCH_FLOAT:
        return raw.view(_TORCH_FLOAT[qt.name]).view(shape)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return raw.view(rows, qt.row_bytes(shape[-1]))


def _finish(
    name: str, qt: QType, shape: tuple[int, ...], raw: torch.Tensor, repack: bool
) -> QWeight | torch.Tensor:
    """Vectors (norms, biases) become float32 tensors; matrices become QWeights."""
    if len(shape) == 1:
        return raw.float().reshape(shape).clone() if raw.device.type == "cpu" else raw.float()
    w = QWeight(raw, qt, shape, name)
    if raw.device.type == "cpu":
        return prepare_cpu(w, repack=repack)
    return prepare_gpu(w) if repack else w


@dataclass(frozen=True)
class Sharded:
    """A tensor of a `-sm row` layer: one part a GPU, in the order of `Plan.split` (the rows or columns
    of each GPU, or the same copy on each). A `partial` matrix's products are partial sums."""

    parts: tuple[QWeight | torch.Tensor, ...]
    partial: bool = False


@dataclass(frozen=True)
class Piece:
    """The bytes of one tensor, or of a row or column range of it (`-sm row`), bound for one device."""

    key: str  # unique per piece: the tensor name, with "@device" for split parts and copies
    info: TensorInfo
    device: str
    rows: tuple[int, int] | None = None
    columns: tuple[int, int] | None = None  # whole blocks of every row (the planner cuts there)

    @property
    def shape(self) -> tuple[int, ...]:
        rows, cols = self.info.shape[0], self.info.shape[1:]
        if self.rows is not None:
            rows = self.rows[1] - self.rows[0]
        if self.columns is not None:
            cols = (self.columns[1] - self.columns[0],)
        return (rows, *cols)

    @property
    def nbytes(self) -> int:
        return self.info.qtype.nbytes(self.shape)

    @property
    def pitch(self) -> int | None:
        """Bytes from one row to the next where the arena spaces them out (`layout.row_pitch`: GPU
        expert stacks of the integer-dot types whose rows are not whole 16-byte units), else None."""
        shape, qt = self.shape, self.info.qtype
        if len(shape) != 3 or self.device == "cpu" or qt.name in _TORCH_FLOAT:
            return None
        pitch = row_pitch(qt.name, qt.row_bytes(shape[-1]))
        return pitch if pitch != qt.row_bytes(shape[-1]) else None

    @property
    def arena_bytes(self) -> int:
        """Bytes the piece takes in a GPU arena: its own, or its rows at `pitch`."""
        pitch = self.pitch
        return self.nbytes if pitch is None else int(np.prod(self.shape[:-1])) * pitch

    @property
    def data(self) -> np.ndarray:
        row_bytes = self.info.nbytes // self.info.shape[0]
        if self.rows is not None:
            return self.info.data[self.rows[0] * row_bytes : self.rows[1] * row_bytes]
        if self.columns is not None:  # a strided cut of the file: copied once into its own bytes
            qt, (c0, c1) = self.info.qtype, self.columns
            start, end = qt.row_bytes(c0), qt.row_bytes(c1)
            grid = self.info.data.reshape(self.info.shape[0], row_bytes)
            return np.ascontiguousarray(grid[:, start:end]).reshape(-1)
        return self.info.data


def pieces(mf: ModelFile, plan: Plan) -> list[Piece]:
    """Every byte range to place, in file order (so uploads read the file sequentially)."""
    out = []
    for info in sorted(mf.tensors.values(), key=lambda t: t.offset):
        if split := plan.row_split(info.name):
            out += [Piece(f"{info.name}@{dev}", info, dev, rows=(r0, r1)) for dev, r0, r1 in split]
        elif split := plan.column_split(info.name):
            out += [Piece(f"{info.name}@{dev}", info, dev, columns=(c0, c1)) for dev, c0, c1 in split]
        else:
            out.append(Piece(info.name, info, plan.device_of(info.name)))
        copies = [plan.extra_copies[info.name]] if info.name in plan.extra_copies else []
        out += [
            Piece(f"{info.name}@{dev}", info, dev) for dev in [*copies, *plan.replicas.get(info.name, ())]
        ]
    return out


def upload_arena(
    parts: list[Piece], device: torch.device, progress: Callable[[int], None]
) -> dict[str, torch.Tensor]:
    """Copy the raw bytes of `parts` into one allocation on `device`; return a view per piece."""
    offsets, total = {}, 0
    for piece in parts:
        offsets[piece.key] = total
        total += -(-piece.arena_bytes // ARENA_ALIGN) * ARENA_ALIGN
    try:
        arena = torch.empty(total, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        free = torch.cuda.mem_get_info(device)[0]
        raise LlmxError(
            f"out of memory on {device}: its weights need {total / 2**30:.2f} GiB and {free / 2**30:.2f} GiB "
            "are free (another process may be using it); lower -ngl, or use --fit"
        ) from None
    staging = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done = [torch.cuda.Event() for _ in staging]
    stream = torch.cuda.Stream(device)
    turn = 0
    views = {p.key: _arena_view(arena, offsets[p.key], p) for p in parts}
    with torch.cuda.stream(stream):
        for piece in parts:
            src = piece.data
            # chunks of whole rows where the rows are spaced out (each lands at its row), else of bytes
            unit = src.nbytes // views[piece.key].shape[0] if piece.pitch else 1
            step = max(unit, STAGING_BYTES // unit * unit)
            for start in range(0, src.nbytes, step):
                n = min(step, src.nbytes - start)
                buf = staging[turn]
                done[turn].synchronize()  # the copy that last used this buffer has finished
                buf[:n].numpy()[:] = src[start : start + n]  # the file read (page cache or disk)
                if piece.pitch:
                    rows = views[piece.key][start // unit : (start + n) // unit]
                    rows.copy_(buf[:n].view(-1, unit), non_blocking=True)
                else:
                    dst = offsets[piece.key] + start
                    arena[dst : dst + n].copy_(buf[:n], non_blocking=True)
                done[turn].record(stream)
                turn ^= 1
                progress(n)
    stream.synchronize()
    return views


def _arena_view(arena: torch.Tensor, offset: int, piece: Piece) -> torch.Tensor:
    """The piece's tensor in the arena from `offset`: its bytes in their logical layout
    (`shape_raw`), or with a `pitch`, rows [N, row bytes] that many bytes apart."""
    if piece.pitch is None:
        return shape_raw(arena[offset : offset + piece.nbytes], piece.info.qtype, piece.shape)
    rows = int(np.prod(piece.shape[:-1]))
    grid = arena[offset : offset + rows * piece.pitch].view(rows, piece.pitch)
    return grid[:, : piece.info.qtype.row_bytes(piece.shape[-1])]


def sharded(
    info: TensorInfo,
    plan: Plan,
    shapes: dict[str, tuple[int, ...]],
    raws: dict[str, torch.Tensor],
    repack: bool,
) -> Sharded:
    """A `-sm row` layer's tensor from its pieces (`shapes` and `raws` by piece key): each GPU's rows
    or columns, or its copy (the main GPU's under the plain name)."""
    home = plan.device_of(info.name)
    cut = plan.row_split(info.name) or plan.column_split(info.name)
    keys = [info.name if s.device == home and not cut else f"{info.name}@{s.device}" for s in plan.split]
    parts = tuple(_finish(info.name, info.qtype, shapes[k], raws[k], repack) for k in keys)
    return Sharded(parts, partial=plan.column_split(info.name) is not None)


def load_weights(
    mf: ModelFile,
    plan: Plan,
    repack: bool = True,
    progress: Callable[..., Callable[[int], None]] | None = None,
) -> tuple[TensorGroup, list[TensorGroup], LoadReport]:
    """Place every tensor of `mf` where `plan` says.

    Returns the top-level tensors, one group per layer (named as in the GGUF) and a report. Every
    tensor of a `-sm row` layer becomes `Sharded` (`runtime.tensor_parallel` deals the parts out); the
    row-split output matrix becomes a `RowSplit` of per-GPU parts; a tied embedding copied to the
    output device (`plan.extra_copies`) serves as the model's `output`.
    """
    t0 = time.perf_counter()
    report = LoadReport()
    by_device: dict[str, list[Piece]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for piece in pieces(mf, plan):
        by_device.setdefault(piece.device, []).append(piece)
        shapes[piece.key] = piece.shape

    raws: dict[str, torch.Tensor] = {}
    for device, parts in by_device.items():
        report.bytes_per_device[device] = sum(p.nbytes for p in parts)
        td = time.perf_counter()
        if device == "cpu":
            raws |= {p.key: host_view(p.info) for p in parts}
        else:
            total = report.bytes_per_device[device]
            tick = progress(f"loading {device}", total) if progress else (lambda n: None)
            raws |= upload_arena(parts, torch.device(device), tick)
        report.upload_seconds[device] = time.perf_counter() - td

    placed: dict[str, object] = {}
    split_layers = set(plan.split_layers)
    for info in mf.tensors.values():
        if group_key(info.name)[0] in split_layers:
            placed[info.name] = sharded(info, plan, shapes, raws, repack)
            continue
        split = plan.row_split(info.name)
        if split:
            keys = [f"{info.name}@{dev}" for dev, _, _ in split]
            parts = [_finish(info.name, info.qtype, shapes[k], raws[k], repack) for k in keys]
            placed[info.name] = RowSplit(parts, torch.device(plan.device_of(info.name)))
            continue
        # A token-embedding table that is not also the output matrix here is only read a few rows at
        # a time: repacking it for the CPU GEMV would cost memory (and, on a first run, building
        # the CPU kernels) for nothing.
        lookup_only = info.name == "token_embd.weight" and (
            "output.weight" in mf.tensors or info.name in plan.extra_copies
        )
        placed[info.name] = w = _finish(
            info.name, info.qtype, info.shape, raws[info.name], repack and not lookup_only
        )
        if isinstance(w, QWeight) and w.raw.device.type == "cpu":
            report.cpu_formats[w.describe()] = report.cpu_formats.get(w.describe(), 0) + 1
    for name, dev in plan.extra_copies.items():
        copy = _finish(name, mf.tensors[name].qtype, mf.tensors[name].shape, raws[f"{name}@{dev}"], repack)
        if name == "token_embd.weight":  # tied output: the head multiplies by the embedding table
            placed["output.weight"] = copy

    top: dict[str, object] = {}
    layers: dict[int, dict[str, object]] = {}
    for name, value in placed.items():
        layer, key = group_key(name)
        (top if layer is None else layers.setdefault(layer, {}))[key] = value
    for group in layers.values():
        for names in SHARED_INPUT:
            ws = [group.get(n) for n in names]
            if all(isinstance(w, QWeight) for w in ws):
                prepare_shared(ws)
    n_layer = max(layers) + 1 if layers else 0
    groups = [TensorGroup(f"blk.{i}.", layers.get(i, {})) for i in range(n_layer)]
    report.seconds = time.perf_counter() - t0
    return TensorGroup("", top), groups, report
