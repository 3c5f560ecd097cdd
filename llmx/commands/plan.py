"""`llmx plan`: print where every tensor would go and what each device would hold, loading nothing.

Works on a GGUF file (`-m`, only its header is read) or on a named shape with no file at all
(`--shape qwen3-235b-a22b:Q4_K_M`), for the real machine or a described one (`--devices ...`, which
never imports torch). Exit status 1 when a device is over budget, with the numbers and a fix.
"""

from __future__ import annotations

import argparse
import json

from llmx.commands.common import add_model_argument
from llmx.plan import ModelSpec, add_options, options_from_args, parse_shape_spec, plan, suggestion
from llmx.plan.report import render
from llmx.plan.shapes import SHAPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add_model_argument(parser)
    add("--shape", metavar="NAME[:RECIPE]", help="a known shape, no file: llama3-70b:Q4_K_M ('list': all)")
    add("--json", action="store_true", help="print the plan as JSON")
    add_options(parser)


def run(args: argparse.Namespace) -> int:
    if args.shape == "list":
        for s in SHAPES.values():
            print(f"{s.name:18} {s.arch:10} {s.size_label:10} {s.n_layer} layers")
        return 0
    opts = options_from_args(args)
    model = _model(args, opts.no_mmap)
    # Imported here so that a described machine (--devices) never imports torch.
    from llmx.runtime.devices import inventory

    inv = inventory(opts.devices)
    p = plan(model, inv, opts)
    errors = p.over_budget()
    if errors:
        errors[-1] += f"; {suggestion(model, inv, p.options)}"
    if args.json:
        data = p.to_dict()
        data["errors"] = errors
        print(json.dumps(data, indent=1))
    else:
        print(render(p, errors))
    return 1 if errors else 0


def _model(args: argparse.Namespace, no_mmap: bool) -> ModelSpec:
    if args.shape:
        shape, recipe = parse_shape_spec(args.shape)
        return ModelSpec.from_shape(shape, recipe)
    from llmx.gguf import open_gguf
    from llmx.models_on_disk import default_model_path

    return ModelSpec.from_gguf(open_gguf(args.model or default_model_path(), mmap=not no_mmap))
