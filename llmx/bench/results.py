"""What every benchmark result records so that two results can be compared later.

A tokens/s figure means little without the machine and the build behind it, so each result carries
the llmx version and commit, the Python/torch/CUDA/driver versions, the CPU and GPU names, the
model (file, type, size, parameters) and the full placement. Results are saved as JSON; `load_json`
reads them back for plots and comparisons.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
import torch
from gguf import LlamaFileType

from llmx.cpu_info import cpu_name
from llmx.errors import LlmxError
from llmx.gguf import ModelFile


def tool_output(cmd: list[str], cwd: Path | None = None) -> str | None:
    """stdout of a helper program, or None when it is missing or fails (results stay writable)."""
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def git_commit() -> str | None:
    """The commit llmx runs from, with '+dirty' when tracked files changed; None outside a checkout."""
    src = Path(__file__).resolve().parent
    commit = tool_output(["git", "rev-parse", "--short=12", "HEAD"], cwd=src)
    if commit is None:
        return None
    dirty = tool_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=src)
    return commit + ("+dirty" if dirty else "")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_names() -> list[str]:
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def environment() -> dict[str, Any]:
    """The software and hardware a result was measured on."""
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(
            {"index": i, "name": props.name, "memory_bytes": props.total_memory, "uuid": str(props.uuid)}
        )
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    driver = tool_output(query) if gpus else None
    return {
        "llmx_version": _version("llmx"),
        "llmx_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver.splitlines()[0] if driver else None,
        "triton": _version("triton"),
        "os": platform.platform(),
        "cpu": cpu_name(),
        "cpu_cores": psutil.cpu_count(logical=False),
        "cpu_threads": psutil.cpu_count(logical=True),
        "ram_bytes": psutil.virtual_memory().total,
        "torch_threads": torch.get_num_threads(),
        "gpus": gpus,
    }


def file_type_name(mf: ModelFile) -> str:
    """llama.cpp's name of the file's quantization mix ('Q4_K_M'), or the most common tensor type."""
    ftype = mf.metadata.get("general.file_type")
    try:
        return LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        by_type: dict[str, int] = {}
        for t in mf.tensors.values():
            by_type[t.qtype.name] = by_type.get(t.qtype.name, 0) + t.nbytes
        return max(by_type, key=by_type.__getitem__) if by_type else "?"


def model_info(mf: ModelFile) -> dict[str, Any]:
    """The model columns of a result: file, architecture, type, bytes and parameters."""
    return {
        "model_filename": str(mf.path),
        "model_name": str(mf.metadata.get("general.name") or mf.path.stem),
        "model_arch": mf.architecture,
        "model_ftype": file_type_name(mf),
        "model_size": sum(t.nbytes for t in mf.tensors.values()),
        "model_n_params": sum(t.n_elements for t in mf.tensors.values()),
    }


def plain(value: Any) -> Any:
    """A JSON-ready copy of dataclasses, tuples, sets and paths inside `value`."""
    if hasattr(value, "__dataclass_fields__"):
        return plain(asdict(value))
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return [plain(v) for v in items]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def save_json(data: Any, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(plain(data), indent=2) + "\n")


def load_json(path: str | os.PathLike) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise LlmxError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise LlmxError(f"{path} is not a JSON result: {e}") from None
