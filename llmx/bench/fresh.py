"""Measurements in a fresh Python process: a snippet run with `python -c`, whose last line of
output is a JSON object. Benchmarks compare engines or commits this way so that neither inherits
the other's allocations, threads or compiled caches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_snippet(code: str, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> dict:
    """The JSON object the snippet `code` prints last, run with `args` as sys.argv[1:]."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])
