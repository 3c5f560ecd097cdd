"""The one place that asks the hardware what it has: GPUs through torch, host RAM through psutil.

`probe()` returns a `llmx.plan.devices.Inventory` with GPUs in the order CUDA numbers them, which
is the order CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER give (torch honours both), and each GPU's
name and PCI bus id so the plan report shows which physical card is `cuda:0`.
`inventory(description)` is what commands call: a described machine (never importing torch) or
the probed one.
"""

from __future__ import annotations

from llmx.cpu_info import cpu_name
from llmx.plan.devices import Device, Inventory, parse_devices


def inventory(description: str | None) -> Inventory:
    """The described devices when given (a dry run: torch is not imported), else the real ones."""
    return parse_devices(description) if description else probe()


def probe() -> Inventory:
    """Host RAM and every visible CUDA GPU, with free memory measured now."""
    import psutil
    import torch

    ram = psutil.virtual_memory()
    cpu = Device("cpu", int(ram.total), int(ram.available), label=cpu_name())
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            props = torch.cuda.get_device_properties(i)
            gpus.append(
                Device(f"cuda:{i}", int(total), int(free), props.name, _bus_id(props), _bandwidth(props))
            )
    return Inventory(cpu, tuple(gpus))


def _bus_id(props) -> str:
    parts = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if None in parts:
        return ""
    domain, bus, dev = parts
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def _bandwidth(props) -> float:
    """Peak memory bandwidth in bytes/s from the memory clock (kHz, double data rate) and bus width."""
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    return 2.0 * clock_khz * 1e3 * bus_bits / 8
