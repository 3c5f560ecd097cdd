"""A streamed GGUF writer: metadata and tensor infos first, then tensor data chunk by chunk.

A 70B file does not fit in memory, and need not: gguf-py's `GGUFWriter` writes the header, the
metadata and the tensor infos from sizes alone, and the data section is then appended chunk by
chunk. Chunks are produced by a thread pool (numpy's generators and array ops release the GIL) and
written in order by the calling thread, with a bounded number in flight so memory stays at a few
chunks whatever the file size.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from tqdm import tqdm

from llmx.errors import LlmxError
from llmx.plan.tensors import TensorSpec
from llmx.quant import qtype

CHUNK_BYTES = 32 << 20  # big enough to amortise a task, small enough that 2 x threads of them are cheap


# fill(tensor, first_element, n_elements, path) -> raw bytes of elements [first, first + n); `path` is
# (tensor index, chunk index), for seeding a generator per chunk.
Fill = Callable[[TensorSpec, int, int, tuple[int, int]], np.ndarray]


def metadata_type(value: Any) -> GGUFValueType:
    """The GGUF type llama.cpp expects for a plain Python value (it checks scalar types strictly)."""
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        if value < 0:
            return GGUFValueType.INT32
        return GGUFValueType.UINT32 if value < 2**32 else GGUFValueType.UINT64
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, (list, tuple)):
        return GGUFValueType.ARRAY
    raise LlmxError(f"cannot write metadata value {value!r} of type {type(value).__name__} to GGUF")


def _chunks(tensors: Sequence[TensorSpec]) -> Iterator[tuple[int, int, TensorSpec, int, int]]:
    """(tensor index, chunk index, tensor, first element, element count) over all tensors in order.

    Chunks hold whole blocks, so every chunk is a valid run of blocks on its own.
    """
    for t_index, t in enumerate(tensors):
        qt = qtype(t.qtype)
        n_elements = int(np.prod(t.shape))
        step = max(1, CHUNK_BYTES // qt.block_bytes) * qt.block_elems
        for c_index, first in enumerate(range(0, n_elements, step)):
            yield t_index, c_index, t, first, min(step, n_elements - first)


def write_gguf(
    path: str | os.PathLike,
    arch: str,
    metadata: dict[str, Any],
    tensors: Sequence[TensorSpec],
    fill: Fill,
    threads: int | None = None,
    progress: bool = True,
) -> int:
    """Write a GGUF whose tensor data comes from `fill`; returns the file size in bytes.

    The file appears under its name only when complete (it is written as NAME.part, then renamed),
    so an interrupted run never leaves a truncated model behind.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise LlmxError(f"cannot write {path}: the directory {path.parent} does not exist")
    partial = path.with_name(path.name + ".part")
    writer = _header(partial, arch, metadata, tensors)
    assert writer.fout is not None
    bar = tqdm(total=sum(t.nbytes for t in tensors), unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"writing {path.name}", disable=None if progress else True)  # fmt: skip
    workers = threads or os.cpu_count() or 1
    try:
        with ThreadPoolExecutor(workers) as pool:
            in_flight: deque[tuple[TensorSpec, int, int, Future[np.ndarray]]] = deque()
            for t_index, c_index, t, first, count in _chunks(tensors):
                in_flight.append((t, first, count, pool.submit(fill, t, first, count, (t_index, c_index))))
                if len(in_flight) >= 2 * workers:
                    _write_next(writer.fout[0], in_flight, writer.data_alignment, bar)
            while in_flight:
                _write_next(writer.fout[0], in_flight, writer.data_alignment, bar)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    writer.close()
    partial.replace(path)
    return path.stat().st_size


def _header(path: Path, arch: str, metadata: dict[str, Any], tensors: Sequence[TensorSpec]) -> GGUFWriter:
    """Open `path` and write the GGUF header, the metadata and the tensor infos (offsets from sizes)."""
    writer = GGUFWriter(path, arch)
    for key, value in metadata.items():
        if key != "general.architecture":  # GGUFWriter writes it from `arch`
            writer.add_key_value(
                key, list(value) if isinstance(value, tuple) else value, metadata_type(value)
            )
    for t in tensors:
        qt = qtype(t.qtype)
        # gguf-py takes raw blocks as uint8 rows of bytes and recovers the weight shape from the type.
        byte_shape = (*t.shape[:-1], qt.row_bytes(t.shape[-1]))
        writer.add_tensor_info(
            t.name, byte_shape, np.dtype(np.uint8), t.nbytes, GGMLQuantizationType(qt.ggml_id)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return writer


def _write_next(out, in_flight: deque, align: int, bar: tqdm) -> None:
    """Write the oldest chunk; tensors start on `align`-byte boundaries, as GGUF requires."""
    t, first, count, future = in_flight.popleft()
    data = future.result()
    if data.nbytes != qtype(t.qtype).nbytes((count,)):
        raise LlmxError(f"{t.name}: the filler returned {data.nbytes} bytes for {count} {t.qtype} weights")
    if first == 0:
        out.write(bytes(-out.tell() % align))
    data.tofile(out)
    bar.update(data.nbytes)
