"""What the files llmx keeps once per machine (in `settings.cache_dir()`) are keyed by: the CPU's
feature flags. Deleting that folder only costs re-measuring and rebuilding.
"""

from __future__ import annotations

import platform
from pathlib import Path


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
