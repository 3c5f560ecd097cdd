"""Synthetic GGUFs of real models' shapes: exact tensor names, shapes, types and metadata, random weights.

Speed does not depend on the weights' values, so an 8B or 235B benchmark needs no download: the
shape table (`llmx.plan.shapes`, the same one `llmx plan --shape` reads) gives the tensor list and
metadata of a real file under a llama.cpp quant recipe, `vocab` a working tokenizer of the right
size, and `blocks` random valid data. The weights are scaled so that activations stay finite
through every layer: each matrix has weights of standard deviation 1/sqrt(fan-in) (a unit-scale
input gives a unit-scale output), norm weights are 1.0 and biases 0.0. The result runs, in llmx and
in llama.cpp, and produces fluent nonsense.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import LlamaFileType

from llmx.bench.blocks import can_generate, chunk_rng, constant_data, random_data
from llmx.bench.vocab import synthetic_vocab
from llmx.bench.writer import Fill, write_gguf
from llmx.errors import LlmxError
from llmx.plan.recipes import RECIPES
from llmx.plan.shapes import ModelShape, get_shape
from llmx.plan.tensors import TensorSpec
from llmx.quant import BY_NAME, qtype


@dataclass(frozen=True)
class SynthResult:
    path: Path
    shape: str
    type_name: str
    n_tensors: int
    n_params: int
    nbytes: int  # the whole file
    seconds: float


def synth_types() -> list[str]:
    """Every `--type` llmx can write: llama.cpp's recipes, then single types ("pure" files).

    A recipe is listed when its base type can be written; the few extra types a mix hands out
    (Q6_K output, Q5_0 fallbacks, ...) are checked per file by `synthesize`.
    """
    recipes = [name for name, r in RECIPES.items() if can_generate(qtype(r.base))]
    singles = [q.name for q in BY_NAME.values() if q.supported and can_generate(q) and q.name not in recipes]
    return recipes + singles


def synth_tensors(shape: ModelShape, type_name: str) -> list[TensorSpec]:
    """The file's tensors: a llama.cpp recipe's mix, or one type for every quantizable matrix.

    A single type that is not a recipe is a "pure" file (llama-quantize --pure): every matrix in
    that type, except those whose rows are not whole blocks of it, which stay F16.
    """
    name = type_name.upper()
    if name in RECIPES:
        return shape.tensors(name)
    qt = BY_NAME.get(name)
    if qt is None or not qt.supported:
        raise LlmxError(f"unknown --type {type_name!r}; llmx can write {', '.join(synth_types())}")
    out = []
    for t in shape.tensors("F16"):  # F16 marks exactly the tensors llama.cpp would quantize
        if t.qtype == "F16" and t.shape[-1] % qt.block_elems == 0:
            t = dataclasses.replace(t, qtype=qt.name, nbytes=qt.nbytes(t.shape))
        out.append(t)
    return out


def synth_metadata(shape: ModelShape, type_name: str, seed: int) -> dict[str, Any]:
    """The shape's metadata, a synthetic vocabulary at the real BOS/EOS ids, and a note on the origin."""
    name = type_name.upper()
    md = shape.metadata(name if name in RECIPES else None)
    if name not in RECIPES:
        ftype = "ALL_F32" if name == "F32" else f"MOSTLY_{name}"
        md["general.file_type"] = LlamaFileType[
            ftype if ftype in LlamaFileType.__members__ else "GUESSED"
        ].value
    md.update(
        synthetic_vocab(shape.n_vocab, md["tokenizer.ggml.bos_token_id"], md["tokenizer.ggml.eos_token_id"])
    )
    md["general.name"] = f"{shape.name} (synthetic)"
    md["general.description"] = (
        f"random weights in the {shape.name} shape ({name}, seed {seed}); not a trained model"
    )
    return md


def rope_freqs_data(shape: ModelShape, t: TensorSpec, first: int, count: int) -> np.ndarray | None:
    """rope_freqs.weight's real values (random ones would be random RoPE frequencies), or None for
    any other tensor."""
    if t.name != "rope_freqs.weight":
        return None
    return np.array(shape.rope_freqs()[first : first + count], dtype=np.float32).view(np.uint8)


def weight_filler(shape: ModelShape, seed: int) -> Fill:
    """The writer's fill function: norms 1.0, other vectors 0.0 (rope_freqs their values), matrices
    random with std 1/sqrt(fan-in)."""

    def fill(t: TensorSpec, first: int, count: int, path: tuple[int, int]) -> np.ndarray:
        qt = qtype(t.qtype)
        if (freqs := rope_freqs_data(shape, t, first, count)) is not None:
            return freqs
        if len(t.shape) == 1:
            return constant_data(qt, count, 1.0 if "norm" in t.name else 0.0)
        return random_data(qt, count, 1.0 / math.sqrt(t.shape[-1]), chunk_rng(seed, *path))

    return fill


def synthesize(
    shape_name: str,
    type_name: str,
    path: str | os.PathLike,
    seed: int = 0,
    n_layer: int | None = None,
    threads: int | None = None,
    progress: bool = True,
) -> SynthResult:
    """Write a synthetic GGUF of `shape_name` in `type_name` (a recipe such as Q4_K_M, or one type).

    `n_layer` shortens (or lengthens) the model while keeping every other dimension: a 2-layer
    Llama-3-8B is a quick stand-in with the real matrix sizes.
    """
    shape = get_shape(shape_name)
    if n_layer is not None:
        if n_layer < 1:
            raise LlmxError(f"--layers must be at least 1, got {n_layer}")
        shape = dataclasses.replace(
            shape, n_layer=n_layer, n_leading_dense=min(shape.n_leading_dense, n_layer)
        )
    tensors = synth_tensors(shape, type_name)
    cannot = sorted({t.qtype for t in tensors if not can_generate(qtype(t.qtype))})
    if cannot:
        raise LlmxError(
            f"{type_name} uses {', '.join(cannot)}, which llmx cannot write yet; "
            f"try one of {', '.join(synth_types())}"
        )
    t0 = time.perf_counter()
    nbytes = write_gguf(
        path,
        shape.arch,
        synth_metadata(shape, type_name, seed),
        tensors,
        weight_filler(shape, seed),
        threads=threads,
        progress=progress,
    )
    n_params = sum(int(np.prod(t.shape)) for t in tensors)
    return SynthResult(
        Path(path), shape.name, type_name.upper(), len(tensors), n_params, nbytes, time.perf_counter() - t0
    )
