"""Which cached keys each query of a step sees: causal, with an optional sliding window, by row
(`causal_mask`) or by the positions a ring of rows holds (`ring_mask`). True = visible."""

from __future__ import annotations

import torch


def ring_mask(positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """[T, R] visibility over a ring of keys whose positions are `key_positions` [R] (negative: not
    written): as `causal_mask`, by position rather than by row."""
    return (key_positions[None, :] >= 0) & _visible(positions, key_positions, window)


def causal_mask(positions: torch.Tensor, n_keys: int, window: int | None = None) -> torch.Tensor:
    """[T, N] visibility: key j is visible to a query at position p when j <= p (and j > p - window
    for sliding-window layers)."""
    return _visible(positions, torch.arange(n_keys, device=positions.device), window)


def _visible(positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """[T, N]: whether a key at key_positions[n] is visible to a query at positions[t]."""
    p, kp = positions[:, None], key_positions[None, :]
    mask = kp <= p
    if window is not None:
        mask &= kp > p - window
    return mask
