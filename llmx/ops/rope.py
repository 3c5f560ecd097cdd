"""Rotary position embedding with GGUF's parameters: per-device angle tables and the rotation."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding with GGUF's parameters.

    `neox` rotates the two halves of each head (GPT-NeoX, Qwen, Gemma); otherwise adjacent pairs
    (GGML's "normal" mode, which Llama GGUFs use because the converter permutes Q/K for it).
    Only the first `n_dims` of each head rotate. `freq_factors` (Llama 3.1's rope_freqs tensor)
    divide the frequencies; linear scaling divides the positions by `scale`.
    """

    n_dims: int
    base: float
    neox: bool
    scale: float = 1.0  # linear position scaling factor (1 = none)
    freq_factors: torch.Tensor | None = None

    # per-device tables; init=False so that dataclasses.replace() gives a variant its own
    _cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    # tables a longer context replaced: a CUDA graph captured earlier still reads them by address
    _outgrown: list[tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=list, init=False, compare=False, repr=False
    )

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        exps = torch.arange(0, self.n_dims, 2, dtype=torch.float64, device=device) / self.n_dims
        inv = 1.0 / (self.base**exps)
        if self.freq_factors is not None:
            inv = inv / self.freq_factors.to(device=device, dtype=torch.float64)
        return inv

    def tables(self, positions: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, n_dims/2] for integer `positions` [T], all below `bound`.

        Rows come from a per-device table of every position below a power of two >= bound, built
        in float64 once (and again only when the context outgrows it), so a step costs two gathers.
        """
        cos, sin = self._cache.get(positions.device, (None, None))
        if cos is None or cos.shape[0] < bound:
            if cos is not None:
                self._outgrown.append((cos, sin))
            size = 1 << max(8, (bound - 1).bit_length())
            pos = torch.arange(size, dtype=torch.float64, device=positions.device)
            angles = pos[:, None] / self.scale * self.inv_freq(positions.device)[None, :]
            cos, sin = self._cache[positions.device] = angles.cos().float(), angles.sin().float()
        return cos[positions], sin[positions]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by the angles of `tables` (cos/sin [T, n_dims/2]).

        Each rotated pair (a, b) is the complex number a + ib times cos + i sin: one complex multiply
        over views of x, instead of a dozen small ops on its halves.
        """
        t, heads, dim = x.shape
        half = self.n_dims // 2
        rot = x[..., : self.n_dims].float()
        # pairs: GGML's mode rotates adjacent elements, NeoX's the two halves of the rotated part
        pairs = rot.view(t, heads, 2, half).transpose(-1, -2) if self.neox else rot.view(t, heads, half, 2)
        turned = torch.view_as_complex(pairs.contiguous()) * torch.complex(cos, sin)[:, None, :]
        out = torch.view_as_real(turned)
        out = (out.transpose(-1, -2) if self.neox else out).reshape(t, heads, self.n_dims).to(x.dtype)
        return torch.cat((out, x[..., self.n_dims :]), dim=-1) if self.n_dims < dim else out
