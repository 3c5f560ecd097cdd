"""What the planner knows about a model: its tensors (name, type, shape, bytes) and its config, the
hyperparameters that size the KV cache and the compute buffers (`llmx.model_config`, the reader
the models use too).

Built the same way from a GGUF file's header (`ModelSpec.from_gguf`) or from a named shape
(`ModelSpec.from_shape`), because both come down to GGUF metadata keys plus a tensor list.
Pure: no torch, and no import of the GGUF reader (a `ModelFile` is passed in, duck-typed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmx.errors import LlmxError
from llmx.model_config import ModelConfig
from llmx.plan.tensors import TensorSpec

if TYPE_CHECKING:
    from llmx.gguf import ModelFile
    from llmx.plan.shapes import ModelShape


@dataclass(frozen=True)
class ModelSpec:
    """The planner's view of a model: `config` says how many layers, heads and tokens it has."""

    name: str
    config: ModelConfig
    tensors: tuple[TensorSpec, ...]

    @classmethod
    def from_metadata(cls, name: str, md: dict[str, Any], tensors: list[TensorSpec]) -> ModelSpec:
        config = ModelConfig.from_metadata(md, name)
        layers = {t.layer for t in tensors if t.layer is not None}
        last = max(layers, default=-1)
        if len(layers) != config.n_layer or last != config.n_layer - 1:
            upto = f", up to blk.{last}" if layers else ""
            raise LlmxError(
                f"{name}: the metadata states {config.n_layer} layers; the tensors fill {len(layers)}{upto}"
            )
        return cls(name, config, tuple(tensors))

    @classmethod
    def from_gguf(cls, mf: ModelFile) -> ModelSpec:
        """From an opened GGUF: exact byte sizes straight from its tensor infos."""
        tensors = [TensorSpec(t.name, t.qtype.name, tuple(t.shape), t.nbytes) for t in mf.tensors.values()]
        return cls.from_metadata(mf.path.name, mf.metadata, tensors)

    @classmethod
    def from_shape(cls, shape: ModelShape, recipe: str) -> ModelSpec:
        """From a named shape and a quant recipe, as if the file were there."""
        return cls.from_metadata(f"{shape.name}:{recipe}", shape.metadata(recipe), shape.tensors(recipe))

    @property
    def n_params(self) -> int:
        total = 0
        for t in self.tensors:
            n = 1
            for d in t.shape:
                n *= d
            total += n
        return total

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
