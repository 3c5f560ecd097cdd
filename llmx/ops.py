"""The only compute API model files see: linear, embedding, norms, RoPE, attention, activations.

Each op runs on the device of its inputs; `linear` and `embedding` hand quantized weights to the one
kernel dispatcher in `llmx.quant.weight`, so models never branch on a quant type or a device.
Shapes: T = tokens in this step, H = query heads, Hk = KV heads, D = head dim, E = embedding width.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Protocol

import torch
import torch.nn.functional as F

from llmx import settings
from llmx.quant import cpu_native
from llmx.quant import weight as qw
from llmx.quant.weight import QWeight, embedding

__all__ = [
    "LayerKV",
    "PartialSum",
    "Rope",
    "RowSplit",
    "add_rms_norm",
    "attention",
    "causal_mask",
    "causal_prompt_attention",
    "current_device",
    "ring_mask",
    "embedding",
    "gelu_tanh",
    "linear",
    "rms_norm",
    "rope_attention",
    "swiglu",
]

# One-token steps on a GPU take the fused Triton decode attention ("auto"), and on the CPU a native
# kernel (`llmx.kernels.cpu_attention`); "off" keeps the eager ops everywhere (to compare), "on"
# takes the Triton kernel on the CPU too (tests, under TRITON_INTERPRET=1).
# Read once; tests set the module attribute.
FUSED_ATTENTION = settings.fused_attention()

# Likewise for the row ops of a decode step (rms_norm, add_rms_norm, swiglu's silu(g) * u): steps of
# at most FUSED_NORM_MAX_TOKENS tokens on a GPU take `llmx.kernels.norm` ("auto"), one launch each.
FUSED_NORM = settings.fused_norm()
FUSED_NORM_MAX_TOKENS = 16
FUSED_NORM_MAX_WIDTH = 16384  # the widest row the norm kernels hold in registers (norm.MAX_WIDTH)


def current_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make `device` CUDA's current device while work for it is issued: Triton launches its kernels
    on the current device, whatever their tensors' device (on another GPU that is an illegal
    memory access)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class RowSplit:
    """A matrix whose output rows are spread over several GPUs (`-sm row`): each GPU multiplies its
    slice, and the slices are gathered on the main GPU. Launches on different GPUs run concurrently."""

    parts: list[QWeight]
    main: torch.device

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return tuple(p.raw.device for p in self.parts)

    @staticmethod
    def linear_many(x: torch.Tensor, ws: list[RowSplit]) -> list[torch.Tensor]:
        """[x @ W^T for W in ws] for matrices split over the same devices (q/k/v, gate/up): each
        device gets x once and multiplies its slices of all of them in one joined call, and sends
        its results back in one copy, so the GPUs meet once per group rather than once per matrix."""
        blocks, widths = [], []
        for j, device in enumerate(ws[0].devices):
            with current_device(device):
                outs = qw.linear_many(x.to(device, non_blocking=True), [w.parts[j] for w in ws])
                joined = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
            blocks.append(joined.to(ws[0].main, non_blocking=True))
            widths.append([o.shape[-1] for o in outs])
        pieces = [block.split(sizes, dim=-1) for block, sizes in zip(blocks, widths, strict=True)]
        return [torch.cat([p[i] for p in pieces], dim=-1) for i in range(len(ws))]


@dataclass
class PartialSum:
    """One GPU's columns of a matrix whose product is summed over GPUs (`-sm row`: the attention
    output and FFN down matrices): `reduce` adds this GPU's partial product to the others'."""

    weight: QWeight
    reduce: Callable[[torch.Tensor], torch.Tensor]


def linear(
    x: torch.Tensor, w: QWeight | RowSplit | PartialSum, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] @ W^T -> [..., out], computed where W lives (only the activation moves); plus
    `residual` (on x's device) where given: a decode step's GPU GEMV adds it as it stores."""
    if isinstance(w, QWeight) and x.device == w.raw.device:
        return qw.linear(x, w, residual=residual)
    if isinstance(w, PartialSum):
        y = w.reduce(qw.linear(x, w.weight))
    elif isinstance(w, RowSplit):
        y = RowSplit.linear_many(x, [w])[0].to(x.device)
    else:
        y = qw.linear(x.to(w.raw.device), w).to(x.device)
    return y if residual is None else y + residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, ..., E] scaled to unit root-mean-square, then by `weight` [E] (brought to x: a few KB)."""
    if _native_cpu_rows(x, weight):
        return cpu_native.rms_norm(x, weight, eps)[1]
    if _fused_rows(x) and x.shape[-1] <= FUSED_NORM_MAX_WIDTH:
        from llmx.kernels import norm

        return norm.rms_norm(x, weight.to(x.device), eps)
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.device), eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's next value and its norm: h = x + delta, (h, rms_norm(h, weight, eps)).
    One launch for decode steps on a GPU (see FUSED_NORM)."""
    same = delta.shape == x.shape and delta.dtype == x.dtype and delta.device == x.device
    if same and _native_cpu_rows(x, weight):
        return cpu_native.rms_norm(x, weight, eps, delta)
    if same and _fused_rows(x) and x.shape[-1] <= FUSED_NORM_MAX_WIDTH:
        from llmx.kernels import norm

        return norm.add_rms_norm(x, delta, weight.to(x.device), eps)
    h = x + delta
    return h, rms_norm(h, weight, eps)


def _native_cpu_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a CPU decode step's norm takes the native kernel (`cpu_native.rms_norm`): a few
    float32 tokens, contiguous, their weight on the CPU in float32 (not with FUSED_NORM "off")."""
    return (
        FUSED_NORM == "auto"
        and x.is_cpu
        and weight.is_cpu
        and x.dtype == weight.dtype == torch.float32
        and x.dim() > 1
        and x.shape[0] <= FUSED_NORM_MAX_TOKENS
        and x.is_contiguous()
        and cpu_native.available()
    )


def _fused_rows(x: torch.Tensor) -> bool:
    """Whether `llmx.kernels.norm` takes x [T, ..., E]: a few tokens of a float dtype, and Triton
    at hand (FUSED_NORM "auto" also wants x on a GPU)."""
    if FUSED_NORM == "off" or x.dim() == 0 or (x.dim() > 1 and x.shape[0] > FUSED_NORM_MAX_TOKENS):
        return False
    if FUSED_NORM == "auto" and not (x.is_cuda and _has_triton()):
        return False
    return x.dtype in (torch.float32, torch.float16, torch.bfloat16)


def linear_many(x: torch.Tensor, ws: list[QWeight | RowSplit]) -> list[torch.Tensor]:
    """[linear(x, w) for w in ws] for weights sharing an input (q/k/v, gate/up): one joined kernel
    call where they live together on x's device, separate calls otherwise."""
    device = x.device
    if all(isinstance(w, QWeight) and w.raw.device == device for w in ws):
        return qw.linear_many(x, ws)
    if all(isinstance(w, RowSplit) for w in ws) and len({w.devices for w in ws}) == 1:
        return [y.to(x.device) for y in RowSplit.linear_many(x, ws)]
    return [linear(x, w) for w in ws]


def swiglu(
    x: torch.Tensor, gate: QWeight, up: QWeight, down: QWeight, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The gated FFN of Llama-family models: down(silu(gate(x)) * up(x)), plus `residual` where
    given (the block's residual stream, added by the down projection's GEMV on a GPU)."""
    if (
        all(isinstance(w, QWeight) for w in (gate, up, down))
        and (y := qw.swiglu(x, gate, up, down)) is not None
    ):
        return y if residual is None else y.add_(residual)  # a CPU decode step: one native call
    g, u = linear_many(x, [gate, up])
    if _fused_rows(g) and u.shape == g.shape and u.dtype == g.dtype and u.device == g.device:
        from llmx.kernels import norm

        return linear(norm.silu_mul(g, u), down, residual)
    # in place: g is this call's own, and a prompt's gate is -ub x n_ff floats (twice saved)
    return linear(F.silu(g, inplace=True).mul_(u), down, residual)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


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


class LayerKV(Protocol):
    """One layer's KV cache as a step sees it (`llmx.runtime.cache.KVCache.writer` makes one).

    Called with this step's k, v [T, Hk, D], it stores them at `positions` and returns the first
    `n_read` rows of keys and values for `attention`; the fused decode path writes the buffers itself.
    """

    k: torch.Tensor  # [rows, Hk, D] keys: of every position, or a ring of the latest ones
    v: torch.Tensor  # [rows, Hk, D] values
    positions: torch.Tensor  # [T] this step's positions, on the buffers' device
    n_read: int  # attention reads rows 0..n_read-1 (a ring: all its rows)

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def key_positions(self) -> torch.Tensor | None: ...


def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: Rope,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: LayerKV,
    mask: torch.Tensor | None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, H, D] and k [T, Hk, D] rotated by `rope` (cos/sin from `Rope.tables`), k and v stored
    in `cache`, then `attention` over its first n_read rows: [T, H * D].

    `mask` (from `causal_mask`, for the eager path) and `window` (for the fused kernel) describe the
    same visibility. One token on a GPU takes `llmx.kernels.decode_attention`: two kernel launches
    instead of ~25 (see FUSED_ATTENTION).
    """
    if _fused_decode(q, v, cache):
        from llmx.kernels.decode_attention import decode_attention

        return decode_attention(
            q, k, v, cos, sin, cache.k, cache.v, cache.positions, cache.n_read,
            n_dims=rope.n_dims, neox=rope.neox, scale=scale, softcap=softcap, window=window,
        )  # fmt: skip
    if _native_cpu_step(q, cache, mask, softcap):
        from llmx.kernels import cpu_attention

        scale_ = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        out = cpu_attention.rope_decode_attention(q, k, v, rope, (cos, sin), cache, scale_)
        if out is not None:
            return out
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    keys, values = cache(k, v)
    ring = cache.key_positions()
    if ring is not None:  # a sliding-window layer's ring: rows are not in position order
        mask = ring_mask(cache.positions, ring, window).to(q.device)  # --no-kv-offload: from the CPU
    # A prompt batch ends at the last cached key, so its mask is causal aligned to the bottom right,
    # unless a sliding window cuts in; then a GPU can attend without materializing the scores.
    if q.is_cuda and q.shape[0] > 1 and softcap is None and (window is None or cache.n_read <= window):
        return causal_prompt_attention(q, keys, values, scale)
    return attention(q, keys, values, mask, scale, softcap)


def causal_prompt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """`attention` for T queries at the last T of N positions, each seeing the keys up to its own.

    On a GPU this is PyTorch's flash or memory-efficient kernel (the mask is implicit, the scores are
    never stored: -ub x context x heads x ~13 bytes on the math path); on the CPU it falls back to
    the masked math path. q [T, H, D], k and v [N, Hk, D] -> [T, H * D].
    """
    from torch.nn.attention.bias import causal_lower_right

    t, n_head, head_dim = q.shape
    n_keys, n_head_kv = k.shape[0], k.shape[1]
    dtype = k.dtype if q.is_cuda else q.dtype
    qh = q.transpose(0, 1)[None].to(dtype)
    kh, vh = k.transpose(0, 1)[None].to(dtype), v.transpose(0, 1)[None].to(dtype)
    if t == n_keys:  # the first batch of a sequence: plain causal, GQA done by the kernel
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:  # the bottom-right variant reaches the fused kernels only with one K/V head per query head
        group = n_head // n_head_kv
        kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(t, n_keys), scale=scale)
    return out[0].transpose(0, 1).reshape(t, n_head * head_dim).to(q.dtype)


def _fused_decode(q: torch.Tensor, v: torch.Tensor, cache: LayerKV) -> bool:
    """Whether the fused kernel can run this step: one token, everything on one device (not a GPU
    layer whose cache stays on the CPU), equal key and value widths, and Triton at hand."""
    if FUSED_ATTENTION == "off" or q.shape[0] != 1:
        return False
    if FUSED_ATTENTION == "auto" and not (q.is_cuda and _has_triton()):
        return False
    one_device = q.device == cache.k.device == cache.v.device == cache.positions.device
    return one_device and q.shape[-1] == v.shape[-1] == cache.k.shape[-1] == cache.v.shape[-1]


@cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Grouped-query attention of T queries over the N cached keys.

    q [T, H, D]; k, v [N, Hk, D]: the cache's first N rows, this step's keys included. `mask` [T, N]
    (True = visible) comes from `causal_mask`; None means every key is visible to every query.
    Returns [T, H * D].
    """
    t, n_head, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if _native_cpu_decode(q, k, mask, softcap):
        from llmx.kernels import cpu_attention

        out = cpu_attention.decode_attention(q, k, v, scale)
        if out is not None:
            return out
    # On a GPU attend in the cache's dtype (f16/bf16 tensor-core kernels, no cache-sized conversion);
    # on the CPU in float32, where half-precision math is slow.
    dtype = k.dtype if q.is_cuda else q.dtype
    qh, kh, vh = q.transpose(0, 1).to(dtype), k.transpose(0, 1).to(dtype), v.transpose(0, 1).to(dtype)
    if softcap is None:
        # Unmasked (a decode step over exactly its past): 4-D [batch, heads, tokens, dim] tensors,
        # which reach PyTorch's fused kernels (the CPU's flash attention: 3-5x faster per step than
        # the math path that 3-D tensors take). Masked prompts keep the math path, whose summation
        # order matches the float32 references' (tests/test_logits.py).
        if mask is None:
            qh, kh, vh = qh[None], kh[None], vh[None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        out = out[0] if mask is None else out
    else:  # logit soft-capping is outside SDPA's vocabulary: spell attention out
        group = n_head // kh.shape[0]
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
        scores = softcap * torch.tanh((qh @ kh.transpose(1, 2)) * scale / softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1) @ vh
    return out.transpose(0, 1).reshape(t, n_head * head_dim).to(q.dtype)


def _native_cpu_step(
    q: torch.Tensor, cache: LayerKV, mask: torch.Tensor | None, softcap: float | None
) -> bool:
    """Whether a CPU step's RoPE, cache write and attention can go to `cpu_attention` in one call: as
    `_native_cpu_decode`, with its cache on the CPU too."""
    return _native_cpu_decode(q, cache.k, mask, softcap) and cache.positions.device.type == "cpu"


def _native_cpu_decode(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, softcap: float | None
) -> bool:
    """Whether a CPU step takes `llmx.kernels.cpu_attention`: one float32 token seeing every key of
    its cache (not with FUSED_ATTENTION "off")."""
    if FUSED_ATTENTION == "off" or mask is not None or softcap is not None:
        return False
    return q.shape[0] == 1 and q.dtype == torch.float32 and not q.is_cuda and not k.is_cuda


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
