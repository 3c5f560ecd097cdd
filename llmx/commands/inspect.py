"""`llmx inspect MODEL`: metadata, tensor-type counts and per-layer sizes, read from the header only."""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path

from llmx.commands.common import add_model_argument
from llmx.gguf import open_gguf
from llmx.models.naming import group_key
from llmx.models_on_disk import default_model_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", type=Path, default=None, help="the GGUF file, or give it with -m")
    add_model_argument(parser)
    parser.add_argument("--tensors", action="store_true", help="also list every tensor")


def _short(value: object) -> str:
    if isinstance(value, list):
        head = ", ".join(repr(v) for v in value[:4])
        return f"[{head}{', ...' if len(value) > 4 else ''}] ({len(value)} items)"
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 100 else text[:97] + "..."


def gib(n: int) -> str:
    return f"{n / 2**20:9.2f} MiB"


def run(args: argparse.Namespace) -> int:
    mf = open_gguf(args.file or args.model or default_model_path())
    print(
        f"{mf.path}  (GGUF v{mf.version}, {gib(mf.nbytes).strip()}, {len(mf.tensors)} tensors, "
        f"alignment {mf.alignment})"
    )
    print("\nmetadata:")
    for key, value in mf.metadata.items():
        print(f"  {key:45s} {_short(value)}")

    print("\ntensor types:")
    counts, sizes = Counter(), Counter()
    for t in mf.tensors.values():
        counts[t.qtype.name] += 1
        sizes[t.qtype.name] += t.nbytes
    for name, n in counts.most_common():
        print(f"  {name:8s} {n:5d} tensors {gib(sizes[name])}")

    per_layer: dict[int | None, int] = defaultdict(int)
    for t in mf.tensors.values():
        per_layer[group_key(t.name)[0]] += t.nbytes
    print("\nper layer:")
    print(f"  {'non-layer':10s} {gib(per_layer.pop(None, 0))}")
    for layer in sorted(per_layer):
        print(f"  blk.{layer:<6d} {gib(per_layer[layer])}")
    params = sum(t.n_elements for t in mf.tensors.values())
    print(f"\n{params / 1e6:.1f} M parameters, {8 * mf.nbytes / params:.2f} bits per weight")

    if args.tensors:
        print("\ntensors:")
        for t in sorted(mf.tensors.values(), key=lambda t: t.offset):
            print(f"  {t.name:40s} {t.qtype.name:7s} {str(t.shape):20s} {gib(t.nbytes)}")
    return 0
