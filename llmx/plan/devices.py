"""The machine as the planner sees it: a CPU and GPUs with total and free memory, in order.

An `Inventory` comes from the hardware (`llmx.runtime.devices.probe`, the only code that asks
torch) or from a description for dry runs:

    cuda0=16GiB,cuda1=8GiB,cpu=64GiB
    cuda0=16GiB:free=13.5GiB:bw=717GB/s:name=RTX 4080,cuda1=8GiB,cpu=64GiB:bw=89.6GB/s

Each entry is DEVICE=TOTAL with optional `:free=`, `:bw=` (memory bandwidth, used by --fit to fill
the fastest GPU first) and `:name=` fields. GPUs are numbered by their position as CUDA numbers
them after CUDA_VISIBLE_DEVICES; a description lists them in that order. Without a `cpu=` entry the
host RAM is unknown and not checked. Stdlib only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmx.errors import LlmxError

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # a bare k/m/g/t is binary, as in nvidia-smi and llama.cpp's logs
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip
GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class Device:
    """One memory pool that can hold tensors. `name` is torch's spelling: "cpu", "cuda:0", ..."""

    name: str
    total: int  # bytes; 0 = unknown (not budgeted)
    free: int  # bytes available to llmx now
    label: str = ""  # product name, e.g. "NVIDIA GeForce RTX 4080"
    bus_id: str = ""  # PCI bus id, so a CUDA_VISIBLE_DEVICES mix-up shows in the report
    bandwidth: float = 0.0  # bytes/s; 0 = unknown

    @property
    def is_gpu(self) -> bool:
        return self.name.startswith("cuda")

    @property
    def index(self) -> int | None:
        return int(self.name.split(":")[1]) if self.is_gpu else None

    @property
    def buft(self) -> str:
        """llama.cpp's buffer-type name for -ot: CPU, CUDA0, CUDA1, ..."""
        return f"CUDA{self.index}" if self.is_gpu else "CPU"

    @property
    def known(self) -> bool:
        return self.total > 0


@dataclass(frozen=True)
class Inventory:
    """The CPU and the GPUs, GPUs in CUDA order."""

    cpu: Device
    gpus: tuple[Device, ...] = ()

    @property
    def devices(self) -> tuple[Device, ...]:
        return (*self.gpus, self.cpu)

    def get(self, name: str) -> Device:
        for d in self.devices:
            if d.name == name:
                return d
        raise LlmxError(f"no device {name}; this machine has {', '.join(d.name for d in self.devices)}")

    def bufts(self) -> list[str]:
        """The -ot targets this machine offers."""
        return ["CPU", *(g.buft for g in self.gpus)]

    def resolve_buft(self, buft: str) -> str:
        """An -ot BUFT (CPU, CUDA0, CUDA_Host, ...) -> device name; unknown ones list the valid ones."""
        key = buft.strip().upper()
        if key in ("CPU", "CUDA_HOST"):  # pinned host memory is still the CPU's RAM
            return "cpu"
        for g in self.gpus:
            if key == g.buft:
                return g.name
        raise LlmxError(f"unknown buffer type {buft!r} in -ot; available: {', '.join(self.bufts())}")


def parse_size(text: str, what: str = "size") -> int:
    """ "16GiB" / "8G" / "512MiB" / "24GB" -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise LlmxError(f"bad {what} {text!r}: write a number with a unit, e.g. 16GiB, 8G, 512MiB or 24GB")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_devices(description: str) -> Inventory:
    """Build an Inventory from a description (see the module docstring)."""
    cpu = Device("cpu", 0, 0)
    gpus: dict[int, Device] = {}
    for entry in filter(None, (e.strip() for e in description.split(","))):
        key, sep, rest = entry.partition("=")
        if not sep:
            raise LlmxError(f"bad device {entry!r} in --devices: write NAME=SIZE, e.g. cuda0=16GiB")
        m = re.fullmatch(r"(cpu|cuda:?(\d+))", key.strip().lower())
        if not m:
            raise LlmxError(f"unknown device {key!r} in --devices: use cpu, cuda0, cuda1, ...")
        device = _device_fields("cpu" if m.group(2) is None else f"cuda:{int(m.group(2))}", rest)
        if device.is_gpu:
            gpus[device.index] = device
        else:
            cpu = device
    if sorted(gpus) != list(range(len(gpus))):
        raise LlmxError(f"--devices numbers GPUs {sorted(gpus)}; CUDA numbers them 0, 1, 2, ... without gaps")
    return Inventory(cpu, tuple(gpus[i] for i in sorted(gpus)))


def _device_fields(name: str, text: str) -> Device:
    total_text, *fields = text.split(":")
    total = parse_size(total_text, f"{name} memory")
    free, bandwidth, label = total, 0.0, ""
    for f in fields:
        key, _, value = f.partition("=")
        key = key.strip().lower()
        if key == "free":
            free = parse_size(value, f"{name} free memory")
        elif key == "bw":
            bandwidth = float(parse_size(value.lower().removesuffix("/s"), f"{name} bandwidth"))
        elif key == "name":
            label = value.strip()
        else:
            raise LlmxError(f"unknown field {key!r} for {name} in --devices; use free=, bw= or name=")
    if free > total:
        raise LlmxError(f"{name}: free memory {free / GiB:.1f} GiB exceeds its total {total / GiB:.1f} GiB")
    return Device(name, total, free, label, "", bandwidth)


def fmt_bytes(n: float) -> str:
    """Bytes as GiB (or MiB below 1 GiB), the unit users compare against nvidia-smi."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.0f} MiB"
