"""Placement planner: where every tensor and KV cache lives, decided before anything loads.

Pure data in, data out (no torch, no I/O), so `llmx plan` can dry-run any machine:

    model = ModelSpec.from_shape(get_shape("llama3-70b"), "Q4_K_M")  # or .from_gguf(open_gguf(path))
    inv = parse_devices("cuda0=16GiB,cuda1=8GiB,cpu=64GiB")  # or llmx.runtime.devices.probe()
    p = plan(model, inv, Options(n_gpu_layers=55))  # fits first when --fit applies
    p.device_of("blk.30.attn_q.weight"), p.kv_device(30), p.over_budget()
"""

from llmx.plan.devices import Device, Inventory, parse_devices
from llmx.plan.fit import fit, plan, suggestion
from llmx.plan.model import ModelSpec
from llmx.plan.options import Options, add_options, options_from_args, options_from_kwargs
from llmx.plan.placement import DeviceUse, LayerRow, Plan
from llmx.plan.planner import place
from llmx.plan.shapes import ModelShape, get_shape, parse_shape_spec
from llmx.plan.tensors import TensorSpec

__all__ = [
    "Device", "DeviceUse", "Inventory", "LayerRow", "ModelShape", "ModelSpec", "Options", "Plan",
    "TensorSpec",
    "add_options", "fit", "get_shape", "options_from_args", "options_from_kwargs", "parse_devices",
    "parse_shape_spec", "place", "plan", "suggestion",
]  # fmt: skip
