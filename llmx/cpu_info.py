"""The machine's CPU as /proc/cpuinfo describes it: its model name (how measurements are labelled and
keyed) and its feature flags (what the files llmx keeps once per machine in `settings.cache_dir()`,
such as kernels compiled with -march=native, are keyed by). The one reader of /proc/cpuinfo.
Deleting the cache folder only costs re-measuring and rebuilding.
"""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_features() -> str:
    """The CPU's feature flags (/proc/cpuinfo's flags line, else the platform's processor string):
    what kernels compiled with -march=native for this machine are keyed by."""
    return _cpuinfo_line("flags") or platform.processor()


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo spells it (else the platform's processor or machine string)."""
    line = _cpuinfo_line("model name")
    return line.split(":", 1)[1].strip() if line else platform.processor() or platform.machine() or "cpu"


def _cpuinfo_line(key: str) -> str:
    """The first /proc/cpuinfo line starting with `key`, whole; "" where there is none."""
    lines = read_or_empty("/proc/cpuinfo").splitlines()
    return next((ln for ln in lines if ln.startswith(key)), "")


def read_or_empty(path: str) -> str:
    """A text file's contents, or "" where it cannot be read (not Linux, no permission)."""
    try:
        return Path(path).read_text()
    except OSError:
        return ""
