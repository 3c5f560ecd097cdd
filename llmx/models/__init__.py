"""Architecture registry keyed by GGUF's `general.architecture`, with lazy imports.

Adding an architecture is one file defining a `Model` subclass and one line here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from llmx.errors import LlmxError

if TYPE_CHECKING:
    from llmx.models.common import Model

# general.architecture -> module defining `MODEL` (mistral and mixtral GGUFs say "llama"; some converters
# write "mistral")
ARCHITECTURES = {
    "llama": "llmx.models.llama",
    "mistral": "llmx.models.llama",
    "qwen2": "llmx.models.qwen",
    "qwen3": "llmx.models.qwen",
    "qwen2moe": "llmx.models.qwen_moe",
    "qwen3moe": "llmx.models.qwen_moe",
    "gemma3": "llmx.models.gemma3",
}


def model_class(arch: str) -> type[Model]:
    """The Model class for a GGUF architecture name; unknown names list the supported ones."""
    module = ARCHITECTURES.get(arch)
    if module is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise LlmxError(f"unknown model architecture {arch!r}; llmx supports {supported}")
    return importlib.import_module(module).MODEL
