"""Where llmx keeps what it measures or builds once per machine: $LLMX_CACHE_DIR, else ~/.cache/llmx.

Device ceilings, the op-offload threshold and the compiled CPU kernels live there; deleting it only
costs re-measuring and rebuilding.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("LLMX_CACHE_DIR") or Path.home() / ".cache" / "llmx")


def cpu_features() -> str:
    """The CPU's feature flags (/proc/cpuinfo's flags line, else the platform's processor string):
    what kernels compiled with -march=native for this machine are keyed by."""
    lines = read_or_empty("/proc/cpuinfo").splitlines()
    return next((ln for ln in lines if ln.startswith("flags")), platform.processor())


def read_or_empty(path: str) -> str:
    """A text file's contents, or "" where it cannot be read (not Linux, no permission)."""
    try:
        return Path(path).read_text()
    except OSError:
        return ""
