"""`llmx synth --shape NAME --type TYPE -o FILE.gguf`: a synthetic GGUF of a real model's shape."""

from __future__ import annotations

import argparse
import sys

from llmx.bench.synth import synth_types, synthesize
from llmx.bench.tables import human_bytes, human_count
from llmx.plan.shapes import SHAPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", required=True, metavar="NAME", help=f"model shape: {', '.join(SHAPES)}")
    parser.add_argument(
        "--type",
        default="Q4_K_M",
        metavar="TYPE",
        help=f"llama.cpp recipe or single type (default Q4_K_M): {', '.join(synth_types())}",
    )
    parser.add_argument("-o", "--output", required=True, metavar="FILE.gguf", help="the file to write")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="repeat N layers instead of the model's own count (a quick, smaller stand-in)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed; equal seeds write equal files")
    parser.add_argument("-t", "--threads", type=int, default=None, help="writer threads (default: all cores)")


def run(args: argparse.Namespace) -> int:
    r = synthesize(
        args.shape, args.type, args.output, seed=args.seed, n_layer=args.layers, threads=args.threads
    )
    rate = r.nbytes / r.seconds / 1e6 if r.seconds else 0.0
    print(
        f"wrote {r.path}: {r.shape} {r.type_name}, {r.n_tensors} tensors, {human_count(r.n_params)} params, "
        f"{human_bytes(r.nbytes)} in {r.seconds:.1f} s ({rate:.0f} MB/s)",
        file=sys.stderr,
    )
    return 0
