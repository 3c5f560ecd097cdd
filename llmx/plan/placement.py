"""The result of planning: where every tensor and every layer's KV cache lives, and what it costs.

A `Plan` is plain data the runtime executes: `device_of(tensor)`, `kv_device(layer)`,
`row_split(tensor)` / `column_split(tensor)` / `replicas` and `split` for `-sm row`
(`tensor_parallel`), and `extra_copies` for tensors needed on a second device. The
per-device usage and per-layer table are what `llmx plan` prints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from llmx.errors import LlmxError
from llmx.plan.devices import GiB, fmt_bytes
from llmx.plan.options import Options
from llmx.plan.tensor_parallel import Shard


@dataclass(frozen=True)
class DeviceUse:
    """One device's bill. `free` is what it had before loading; 0 (CPU only) means unknown."""

    device: str
    label: str
    bus_id: str
    total: int
    free: int
    weights: int
    kv: int
    compute: int
    margin: int  # the free memory --fit keeps (informational unless fitting)

    @property
    def used(self) -> int:
        return self.weights + self.kv + self.compute

    @property
    def left(self) -> int:
        return self.free - self.used

    @property
    def over(self) -> int:
        """Bytes beyond what the device has (0 when it fits or its memory is unknown)."""
        return max(0, -self.left) if self.total else 0


@dataclass(frozen=True)
class LayerRow:
    """One row of the per-layer table: bytes and device per role (attn/ffn/experts/shared/other).

    `layer` is an int for repeating layers, "input" (token embeddings) or "output"."""

    layer: int | str
    nbytes: dict[str, int]
    devices: dict[str, str]  # role -> device, "cuda:0+cuda:1" when split, "" when the role is absent
    kv_bytes: int = 0
    kv_device: str = ""


@dataclass(frozen=True)
class Plan:
    model: str
    options: Options  # the options actually planned (after --fit)
    n_layer: int
    ctx: int
    tensor_device: dict[str, str]
    layer_device: tuple[str, ...]
    output_device: str
    kv_devices: tuple[str, ...]
    kv_rows: tuple[int, ...]  # positions each layer's cache holds (a ring for sliding-window layers)
    usage: tuple[DeviceUse, ...]
    layers: tuple[LayerRow, ...]
    n_offloaded: int
    row_splits: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)
    column_splits: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)
    replicas: dict[str, tuple[str, ...]] = field(default_factory=dict)  # copies on the other split GPUs
    split: tuple[Shard, ...] = ()  # -sm row: each GPU's heads and FFN width, the main GPU first
    split_layers: tuple[int, ...] = ()  # the layers divided that way
    extra_copies: dict[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # how the options came about (e.g. what --fit chose)
    op_offload: str | None = None  # the GPU that runs CPU layers' prompt batches (its buffers counted)

    # --- what the runtime asks ---

    def device_of(self, tensor: str) -> str:
        """ "cpu" or "cuda:N". A row-split tensor answers the main GPU; see `row_split`."""
        try:
            return self.tensor_device[tensor]
        except KeyError:
            raise LlmxError(f"the plan has no tensor {tensor!r}") from None

    def kv_device(self, layer: int) -> str:
        return self.kv_devices[layer]

    def row_split(self, tensor: str) -> tuple[tuple[str, int, int], ...] | None:
        """For `-sm row`: ((device, first_row, end_row), ...) covering the tensor's rows; else None."""
        return self.row_splits.get(tensor)

    def column_split(self, tensor: str) -> tuple[tuple[str, int, int], ...] | None:
        """For `-sm row`: ((device, first_column, end_column), ...) of a matrix whose products are
        partial sums, added across the GPUs; else None."""
        return self.column_splits.get(tensor)

    @property
    def offloaded_line(self) -> str:
        return f"offloaded {self.n_offloaded}/{self.n_layer + 1} layers to GPU"

    def device_use(self, device: str) -> DeviceUse:
        return next(u for u in self.usage if u.device == device)

    # --- budget checks ---

    def over_budget(self) -> list[str]:
        """One message per device that cannot hold its share, naming the numbers."""
        out = []
        for u in self.usage:
            if u.over:
                out.append(
                    f"{u.device} is over budget by {fmt_bytes(u.over)} (weights {u.weights / GiB:.2f} + KV "
                    f"{u.kv / GiB:.2f} + compute {u.compute / GiB:.2f} GiB = {fmt_bytes(u.used)} > "
                    f"{fmt_bytes(u.free)} free)"
                )
        return out

    def fits(self, margins: dict[str, int] | None = None) -> bool:
        """Every device with known memory keeps `margins[device]` bytes (default 0) free."""
        margins = margins or {}
        return all(u.left >= margins.get(u.device, 0) for u in self.usage if u.total)

    def check(self, suggestion: str = "") -> None:
        """Raise a one-line LlmxError if any device is over budget."""
        problems = self.over_budget()
        if problems:
            raise LlmxError("; ".join(problems) + (f"; {suggestion}" if suggestion else ""))

    # --- data out ---

    def to_dict(self) -> dict:
        """Everything in the report, as JSON-ready data."""
        return {
            "model": self.model,
            "options": self.options.to_args(),
            "ctx": self.ctx,
            "offloaded": {"layers": self.n_offloaded, "of": self.n_layer + 1},
            "devices": [{**asdict(u), "used": u.used, "left": u.left, "over": u.over} for u in self.usage],
            "layers": [asdict(r) for r in self.layers],
            "tensors": self.tensor_device,
            "kv": list(self.kv_devices),
            "row_splits": {k: [list(p) for p in v] for k, v in self.row_splits.items()},
            "column_splits": {k: [list(p) for p in v] for k, v in self.column_splits.items()},
            "replicas": {k: list(v) for k, v in self.replicas.items()},
            "split": [asdict(s) for s in self.split],
            "extra_copies": self.extra_copies,
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "op_offload": self.op_offload,
            "errors": self.over_budget(),
        }
