"""What the planner knows about one tensor: name, GGML type, shape, exact bytes, and the role that
decides where `-ngl`, `-ot`, `--cpu-moe` and `--fit` put it. Pure: stdlib only."""

from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER = re.compile(r"^blk\.(\d+)\.")

# Report columns, in order. "experts" are routed expert stacks; "shared" experts run for every
# token, so --fit treats them like attention (GPU first).
ROLES = ("attn", "ffn", "experts", "shared", "other")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as stored in the file: `qtype` is a GGML type name, `nbytes` its exact size."""

    name: str
    qtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def layer(self) -> int | None:
        """The repeating layer (`blk.N.`) this tensor belongs to; None for embeddings/output."""
        m = _LAYER.match(self.name)
        return int(m.group(1)) if m else None

    @property
    def short(self) -> str:
        """A layer tensor's name within its layer, `blk.3.attn_q.weight` -> `attn_q`; "" outside layers."""
        return self.name.split(".")[2] if self.layer is not None else ""

    @property
    def role(self) -> str:
        """attn / ffn (dense) / experts / shared / other (norms, router, embeddings, output)."""
        short = self.short
        if short.endswith("_exps"):
            return "experts"
        if short.endswith("_shexp"):
            return "shared"
        if short.startswith("attn_") and short != "attn_norm":
            return "attn"
        if short in ("ffn_gate", "ffn_up", "ffn_down"):
            return "ffn"
        return "other"

    @property
    def is_matrix(self) -> bool:
        """A 2-D weight: what `-sm row` splits by rows across GPUs."""
        return len(self.shape) == 2 and self.name.endswith(".weight")
