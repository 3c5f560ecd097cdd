"""Materialize a GGUF's tensors on their devices, keeping quantized blocks quantized.

CPU tensors are zero-copy views of the file's mmap (nothing is read until a kernel touches it),
optionally repacked once into a faster CPU layout. GPU tensors live in one arena per device: a
single allocation filled with the raw blocks through two pinned staging buffers, so reading the
file and copying to the GPU overlap and no tensor gets an allocation of its own.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from llmx.gguf import ModelFile, TensorInfo
from llmx.models.common import TensorGroup
from llmx.models.naming import group_key
from llmx.quant import QType
from llmx.quant.weight import QWeight, prepare_cpu

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


def _finish(info: TensorInfo, raw: torch.Tensor, repack: bool) -> QWeight | torch.Tensor:
    """Vectors (norms, biases) become float32 tensors; matrices become QWeights."""
    if len(info.shape) == 1:
        return raw.float().reshape(info.shape).clone() if raw.device.type == "cpu" else raw.float()
    w = QWeight(raw, info.qtype, info.shape, info.name)
    return prepare_cpu(w, repack=repack) if raw.device.type == "cpu" else w


def upload_arena(
    infos: list[TensorInfo], device: torch.device, progress: Callable[[int], None]
) -> dict[str, torch.Tensor]:
    """Copy the raw bytes of `infos` (in file order) into one allocation on `device`; return views."""
    offsets, total = {}, 0
    for info in infos:
        offsets[info.name] = total
        total += -(-info.nbytes // ARENA_ALIGN) * ARENA_ALIGN
    arena = torch.empty(total, dtype=torch.uint8, device=device)
    staging = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done = [torch.cuda.Event() for _ in staging]
    stream = torch.cuda.Stream(device)
    turn = 0
    with torch.cuda.stream(stream):
        for info in infos:
            src = info.data
            for start in range(0, info.nbytes, STAGING_BYTES):
                n = min(STAGING_BYTES, info.nbytes - start)
                buf = staging[turn]
                done[turn].synchronize()  # the copy that last used this buffer has finished
                buf[:n].numpy()[:] = src[start : start + n]  # the file read (page cache or disk)
                dst = offsets[info.name] + start
                arena[dst : dst + n].copy_(buf[:n], non_blocking=True)
                done[turn].record(stream)
                turn ^= 1
                progress(n)
    stream.synchronize()
    return {
        info.name: shape_raw(
            arena[offsets[info.name] : offsets[info.name] + info.nbytes], info.qtype, info.shape
        )
        for info in infos
    }


def load_weights(
    mf: ModelFile,
    device_of: Callable[[str], str],
    repack: bool = True,
    progress: Callable[[Iterable[TensorInfo], int], Callable[[int], None]] | None = None,
) -> tuple[TensorGroup, list[TensorGroup], LoadReport]:
    """Place every tensor of `mf` on `device_of(name)` ("cpu", "cuda:0", ...).

    Returns the top-level tensors, one group per layer (named as in the GGUF) and a report.
    """
    t0 = time.perf_counter()
    report = LoadReport()
    by_device: dict[str, list[TensorInfo]] = {}
    for info in sorted(mf.tensors.values(), key=lambda t: t.offset):
        by_device.setdefault(device_of(info.name), []).append(info)

    placed: dict[str, QWeight | torch.Tensor] = {}
    for device, infos in by_device.items():
        report.bytes_per_device[device] = sum(i.nbytes for i in infos)
        td = time.perf_counter()
        if device == "cpu":
            raws = {i.name: host_view(i) for i in infos}
        else:
            tick = progress(infos, report.bytes_per_device[device]) if progress else (lambda n: None)
            raws = upload_arena(infos, torch.device(device), tick)
        report.upload_seconds[device] = time.perf_counter() - td
        for info in infos:
            placed[info.name] = _finish(info, raws[info.name], repack)
            if isinstance(placed[info.name], QWeight) and device == "cpu":
                fmt = placed[info.name].describe()
                report.cpu_formats[fmt] = report.cpu_formats.get(fmt, 0) + 1

    top: dict[str, object] = {}
    layers: dict[int, dict[str, object]] = {}
    for name, value in placed.items():
        layer, key = group_key(name)
        (top if layer is None else layers.setdefault(layer, {}))[key] = value
    n_layer = max(layers) + 1 if layers else 0
    groups = [TensorGroup(f"blk.{i}.", layers.get(i, {})) for i in range(n_layer)]
    report.seconds = time.perf_counter() - t0
    return TensorGroup("", top), groups, report
