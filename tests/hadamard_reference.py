"""The orthonormal Walsh-Hadamard matrix built independently of `llmx.ops.hadamard` (Kronecker powers
in float64), for the tests of rotated caches' references."""

from __future__ import annotations

import torch


def walsh_hadamard(n: int) -> torch.Tensor:
    """The orthonormal n x n matrix, float64, as Kronecker powers of [[1, 1], [1, -1]]."""
    h, two = torch.ones(1, 1, dtype=torch.float64), torch.tensor([[1.0, 1.0], [1.0, -1.0]]).double()
    while h.shape[0] < n:
        h = torch.kron(two, h)
    return h / n**0.5


def hadamard_blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., D] float64, each run of n values times `walsh_hadamard(n)` (n = 0: x)."""
    return x if n == 0 else (x.reshape(-1, n) @ walsh_hadamard(n)).reshape(x.shape)
