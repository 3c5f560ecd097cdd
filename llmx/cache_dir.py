"""Where llmx keeps what it measures or builds once per machine: $LLMX_CACHE_DIR, else ~/.cache/llmx.

Device ceilings, the op-offload threshold and the compiled CPU kernels live there; deleting it only
costs re-measuring and rebuilding.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("LLMX_CACHE_DIR") or Path.home() / ".cache" / "llmx")
