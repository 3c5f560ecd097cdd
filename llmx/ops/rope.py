"""Rotary position embedding with GGUF's parameters: per-device angle tables and the rotation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Yarn:
    """YaRN's blend of extrapolated and interpolated frequencies, as GGML computes it (ggml_rope_yarn).

    Dimension pairs that turn more than `beta_fast` times over the original context `n_ctx_orig`
    keep their frequency; those that turn fewer than `beta_slow` times are slowed by the scaling
    factor; a linear ramp (weighted by `ext_factor`) joins the two. With ext_factor > 0, cos and sin
    are multiplied by attn_factor * (1 + 0.1 ln factor), which scales every score by its square.
    """

    n_ctx_orig: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    ext_factor: float = 1.0
    attn_factor: float = 1.0

    def extrapolated(self, n_dims: int, base: float, device: torch.device) -> torch.Tensor:
        """[n_dims / 2] the weight of each pair's unscaled frequency (1 below the ramp, 0 above it)."""

        def corr_dim(rotations: float) -> float:
            return n_dims * math.log(self.n_ctx_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(0.0, math.floor(corr_dim(self.beta_fast)))
        high = min(n_dims - 1.0, math.ceil(corr_dim(self.beta_slow)))
        pair = torch.arange(n_dims // 2, dtype=torch.float64, device=device)
        ramp = ((pair - low) / max(0.001, high - low)).clamp(0.0, 1.0)
        return (1.0 - ramp) * self.ext_factor

    def magnitude(self, factor: float) -> float:
        """What cos and sin are multiplied by."""
        stretch = 1.0 + 0.1 * math.log(factor) if self.ext_factor else 1.0
        return self.attn_factor * stretch


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding with GGUF's parameters.

    `neox` rotates the two halves of each head (GPT-NeoX, Qwen, Gemma); otherwise adjacent pairs
    (GGML's "normal" mode, which Llama GGUFs use because the converter permutes Q/K for it).
    Only the first `n_dims` of each head rotate. `freq_factors` (Llama 3.1's rope_freqs tensor, which
    carries its "llama3" scaling) divide the frequencies; linear scaling divides them by `scale`,
    YaRN (`yarn`) only those of the slow-turning pairs.
    """

    n_dims: int
    base: float
    neox: bool
    scale: float = 1.0  # position scaling factor, linear or YaRN (1 = none)
    freq_factors: torch.Tensor | None = None
    yarn: Yarn | None = None

    # per-device tables; init=False so that dataclasses.replace() gives a variant its own
    _cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    # tables a longer context replaced: a CUDA graph captured earlier still reads them by address
    _outgrown: list[tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=list, init=False, compare=False, repr=False
    )

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """[n_dims / 2] radians per position of each rotated pair, scaling included (float64)."""
        exps = torch.arange(0, self.n_dims, 2, dtype=torch.float64, device=device) / self.n_dims
        inv = 1.0 / (self.base**exps)
        if self.freq_factors is not None:
            inv = inv / self.freq_factors.to(device=device, dtype=torch.float64)
        if self.yarn is None:
            return inv / self.scale
        kept = self.yarn.extrapolated(self.n_dims, self.base, device)
        return inv * ((1.0 - kept) / self.scale + kept)

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
            angles = pos[:, None] * self.inv_freq(positions.device)[None, :]
            magnitude = 1.0 if self.yarn is None else self.yarn.magnitude(self.scale)
            cos, sin = (angles.cos() * magnitude).float(), (angles.sin() * magnitude).float()
            self._cache[positions.device] = cos, sin
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
