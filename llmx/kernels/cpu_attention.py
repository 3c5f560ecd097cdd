"""One token attending over a long CPU cache, with the cache's conversion fused into the attention.

`ops.attention` on the CPU converts the cache's keys and values to float32 and runs PyTorch's flash
kernel; for one token over a long f16 cache that conversion writes and reads the whole cache again,
every layer and every token. SmolLM2-135M at 2048 tokens of context on 2 cores: 418 µs a layer, 12.7
of a token's 21.9 ms. Here the same math is compiled by torch.compile (Inductor's C++): each
group's query heads meet their key/value head in two fused reductions that read the cache once,
in its own dtype, 141-193 µs a layer there.

It is compiled on first use (a few seconds; longer the first time on a machine) and taken from
MIN_KEYS keys on, where the gain outweighs a compiled call's overhead. Where compiling fails (no
C++ toolchain), the caller keeps the flash path.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import torch

from llmx.errors import first_line

MIN_KEYS = 512  # shorter caches stay on PyTorch's flash kernel (~30 µs a call at 64 keys)

_compiled: list[Callable[..., torch.Tensor] | None] = []  # [] until first use; [None] when it failed


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T) v per group: q [Hk, G, D] float32, already scaled; k, v [N, Hk, D] in the
    cache's dtype -> [Hk, G, D] float32. The G query heads of group h share key/value head h."""
    scores = (q[:, :, None, :] * k.permute(1, 0, 2).float()[:, None, :, :]).sum(-1)  # [Hk, G, N]
    weights = torch.softmax(scores, dim=-1)
    return (weights[:, :, :, None] * v.permute(1, 0, 2).float()[:, None, :, :]).sum(2)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q [1, H, D] float32 over k, v [N, Hk, D] (every key visible) -> [1, H * D] float32, or None
    when the compiled kernel is not available here."""
    kernel = _kernel()
    if kernel is None:
        return None
    n_head, head_dim = q.shape[1], q.shape[2]
    n_kv = k.shape[1]
    qg = q.reshape(n_kv, n_head // n_kv, head_dim) * scale
    try:
        out = kernel(qg, k, v)
    except Exception as e:  # a compiler failure surfaces at the first call: keep the flash path
        _compiled[0] = None
        why = f"llmx: CPU attention kernel unavailable ({first_line(e)}); long contexts decode slower"
        warnings.warn(why, stacklevel=2)
        return None
    return out.reshape(1, n_head * head_dim)


def _kernel() -> Callable[..., torch.Tensor] | None:
    if not _compiled:
        print("llmx: compiling the CPU attention kernel for long contexts (once a process)", file=sys.stderr)
        _compiled.append(torch.compile(grouped_attention, dynamic=True))
    return _compiled[0]
