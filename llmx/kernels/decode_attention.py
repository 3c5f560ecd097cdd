"""One decode token's attention layer in one launch (two where the keys are split): RoPE on q and k,
the KV-cache write, and grouped-query attention over the cache, flash-decoding style (split over the
keys, then combined); for one token of each of B sequences over a paged cache, the same launches
(`paged_decode_attention`).

The eager path (`Rope.apply`, the cache's `index_copy_`, `ops.attention`) costs ~25 small kernels a
layer. Shapes (one token): q [1, H, D], k, v [1, Hk, D], cos/sin [1, n_dims/2] float32 (the step's
RoPE tables), caches [R, Hk, D] (f16, bf16 or f32) or, for the block types, uint8 [R, Hk, D / 32 *
block bytes] (GGUF blocks: q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl; K and V each their own type; each
head's blocks in the grouped layout, `llmx.quant.kv_layout`), `positions` [1] int64 on the same
device. Position p lives in row p mod R: R is the context for most layers, a ring for sliding-window
ones. A block type's rows are dequantized in the tile loads, and this step's key and value
quantized in the kernel (the bytes of `llmx.quant.quantize`, grouped), so the row it attends to is
the one stored.

- `attention_kernel`, grid (Hk, S, B): program (kv head, split, token) rotates the G = H/Hk
  queries of its KV head and this step's key, then reads its share of the visible keys [lo, pos] (lo = 0, or
  pos - window + 1 for a sliding window). The visible range is cut into S chunks on the device,
  from pos, so the masked tail of a CUDA-graph bucket (rows pos+1..n_read-1) and keys left of the
  window are never read, and a window layer still spreads over all S programs. The program whose
  chunk holds pos writes the new key and value to the cache and takes that row from its registers;
  no other program reads the row, so the write needs no ordering. With one chunk the program
  writes its heads' output; with S it leaves an unnormalized output with its running max and sum.
- `combine_kernel`, grid (B * H,): merges a head's S partial outputs with log-sum-exp weights, in
  the chunks' order. A launch of its own: merging in the attention launch, by the last of a (token,
  KV head)'s S programs to finish, made the kernel 13-50% slower on an H100 (a serial tail after an
  atomic counter, at 512 / 8K / 32K keys f16 8.0 / 24.2 / 60.8 us against 5.9 / 16.2 / 52.7).
Where the o projection reads int8 x, the output row is also written quantized for it.

Paged (`runtime.paged`, `PAGED`): token b's position pos = positions[b] lives in pool row
tables[b, pos // BR] * BR + pos % BR (blocks of BR rows), and so does each key it reads: the visible
keys [lo, pos] of a tile are gathered block by block through the table, and the new row is stored
at its block's row. No ring (a paged sliding-window layer keeps every position; the window is by
position) and no bucket tail (each token reads up to its own position). S comes from B, Hk and the
tables' width (`split_count`): one sequence at 32K splits to fill the GPU, 64 sequences not at all.
Shared blocks (the prefix cache) are only read: a sequence writes its own last block.

The KV cache calls it (`runtime.cache.LayerWriter.rope_store_attend`, the paged one
`runtime.paged.DecodeTokens.rope_store_attend`): it owns the buffers this writes. Nothing depends
on a value read back to the host, so a CUDA graph captured for one n_read replays correctly for
every position below it (a paged one for B tokens and tables of W blocks: every position and table
that fits them). Scores, softmax and sums are float32; the two products take
their operands in the cache's dtype on a GPU (tensor cores; `ops.attention` attends in it there
too) and in float32 under TRITON_INTERPRET=1 (numpy cannot multiply bf16, and the CPU path attends
in float32).
"""

from __future__ import annotations

import math
from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llmx.kernels import cache_rows
from llmx.kernels.cache_rows import TL_DTYPE, dot, head_at, load_rows
from llmx.kernels.cache_store import blocks_value, quantize_head, store_head
from llmx.kernels.hadamard import hadamard
from llmx.quant import QType
from llmx.quant.triton import activation, launch
from llmx.quant.triton.dot8 import store_quantized

# the per-head RMSNorms of q and k (`ops.HeadNorms`): their weights [D] (None: that side has none), eps
Norms = tuple[torch.Tensor | None, torch.Tensor | None, float]
BLOCK_N = 64  # keys per loop step
MERGE_SPLITS = 32  # the most splits `combine_kernel` loads at once
INTERPRETED_SMS = 132  # the SMs a CPU (TRITON_INTERPRET) splits for: an H200's, so tests split as it does


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    n_read: int,
    *,
    n_dims: int,
    neox: bool,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    types: tuple[QType, QType] | None = None,
    norms: Norms | None = None,
    rotation: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """RoPE'd q [1, H, D] attending over cache rows 0..n_read-1 after k, v [1, Hk, D] (k rotated)
    are written at row positions[0]; keys j <= pos are visible (and j > pos - window with a window).

    `norms`: each head of q and k RMS-normalized first (`Norms`). Rotation as
    `ops.Rope.apply` with `n_dims` and `neox`; scores scaled by `scale` (default 1/sqrt(D)), then
    soft-capped to softcap * tanh(s / softcap) when `softcap` is set. `types`: the caches' (K's,
    V's) where either is GGUF blocks, None for float caches. `rotation`: the caches' Walsh-Hadamard
    blocks (`ops.hadamard`): q and k after RoPE in the first, v in the second, the output back.
    Requires n_read > pos. Returns [1, H * D] in q's dtype.
    """
    span = n_read if window is None else min(n_read, window)
    return _launch(
        q, k, v, cos, sin, k_cache, v_cache, positions, None, n_read, 1, span, n_dims=n_dims, neox=neox,
        scale=scale, softcap=softcap, window=window, types=types, norms=norms, rotation=rotation,
    )  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    block_rows: int,
    n_dims: int,
    neox: bool,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    types: tuple[QType, QType] | None = None,
    norms: Norms | None = None,
    rotation: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """`decode_attention` for one token of each of B sequences over a paged cache
    (`runtime.paged`), in the same launch: q [B, H, D], k, v [B, Hk, D], cos/sin [B, n_dims/2]
    (each token's angles); sequence b's token sits at positions[b] (int64 [B]) and its positions
    0..positions[b] in the pools' blocks of `block_rows` rows listed by tables[b] (int32 [B, W]):
    position p is pool row tables[b, p // block_rows] * block_rows + p % block_rows. Its k and v are
    stored at its position's row, and its queries attend to its keys j <= pos (j > pos - window with a
    window). Everything on q's device: nothing is read back to the host, and the launches' shapes
    depend only on B and W (a CUDA graph per batch bucket replays for every position and table that
    fits W blocks). Returns [B, H * D] in q's dtype."""
    span = tables.shape[1] * block_rows if window is None else min(tables.shape[1] * block_rows, window)
    return _launch(
        q, k, v, cos, sin, k_pool, v_pool, positions, (tables, block_rows), 0, q.shape[0], span,
        n_dims=n_dims, neox=neox, scale=scale, softcap=softcap, window=window, types=types, norms=norms,
        rotation=rotation,
    )  # fmt: skip


# Pipeline stages of the key loop by cache type (K and V alike; 3 otherwise). An H100's sweep of the
# kernel alone (`bench/decode_attention.py --stages 2,3`, 512 / 8K / 32K keys, Llama-3-8B's heads):
# q8_0 8.1 / 23.9 / 63.9 us at 2 against 8.5 / 25.2 / 71.1 at 3; f16 7.6 / 25.5 / 64.9 against 7.7 /
# 22.1 / 60.3; q4_0 level but at 32K (62.9 against 59.4); raw bench/results/h100-20261207-s47-*.
STAGES_BY_TYPE = {"Q8_0": 2}


def pipeline_stages(types: tuple[QType, QType] | None, k_dtype: torch.dtype, v_dtype: torch.dtype) -> int:
    """The key loop's pipeline stages for a cache of `types` (None: float rows of k_dtype, v_dtype).
    Float32 tiles go unpipelined: staged, D = 256 needs more than an H200's 227 KB of shared memory
    (348 KB at 3 stages, 86 KB at 1; f16/bf16 take 43 KB at any depth). Block tiles are staged: in the
    grouped layout a head's codes are one contiguous tile, compiled without spills (H100, q8_0, 32K
    rows: 78 us at 3 stages, 91 at 1)."""
    if torch.float32 in (k_dtype, v_dtype):
        return 1
    if types is not None and types[0].name == types[1].name:
        return STAGES_BY_TYPE.get(types[0].name, 3)
    return 3


def split_count(n_seq: int, n_kv: int, span: int, device: torch.device) -> int:
    """How many chunks each (sequence, KV head) cuts its visible keys into: enough that the
    n_seq * n_kv * splits programs make `target_programs` (a long context of one sequence fills the
    GPU), but no chunk shorter than a BLOCK_N tile of the longest `span` (a wide batch is not
    over-split: 64 sequences of 8 KV heads already make 512 programs, one split each)."""
    return max(1, min(triton.cdiv(span, BLOCK_N), triton.cdiv(target_programs(device), n_seq * n_kv)))


def _launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
    paged: tuple[torch.Tensor, int] | None, n_read: int, n_seq: int, span: int, *, n_dims: int,
    neox: bool, scale: float | None, softcap: float | None, window: int | None,
    types: tuple[QType, QType] | None, norms: Norms | None, rotation: tuple[int, int],
) -> torch.Tensor:  # fmt: skip
    """The kernel for `n_seq` tokens: over a contiguous cache (`paged` None: one token, rows
    0..n_read-1, a ring past its rows) or a paged one (`paged`: the block tables and block rows)."""
    _, n_head, d = q.shape
    n_kv = k.shape[1]
    splits = split_count(n_seq, n_kv, span, q.device)
    out = torch.empty(n_seq, n_head * d, dtype=q.dtype, device=q.device)
    partial = stats = out  # unread with one split
    if splits > 1:
        partial = torch.empty(n_seq * n_head, splits, d, dtype=torch.float32, device=q.device)
        # max (log2 units), sum
        stats = torch.empty(n_seq * n_head, splits, 2, dtype=torch.float32, device=q.device)
    q, k, v, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, cos, sin))
    tables, block_rows = paged if paged is not None else (positions, 1)  # unread without `paged`
    block_d = max(16, triton.next_power_of_2(d))
    stages = pipeline_stages(types, k_cache.dtype, v_cache.dtype)
    (kt, kb), (vt, vb) = cache_rows.codes(types, k_cache, v_cache)
    # dequantized rows meet q in f16 on a GPU's tensor cores, as an f16 cache does
    dot_type = (
        tl.float32
        if not q.is_cuda
        else tl.float16
        if k_cache.dtype == torch.uint8
        else TL_DTYPE[k_cache.dtype]
    )
    # The output goes on to the o projection: quantized here for its integer-dot GEMV, by heads.
    qx = activation.quantized_output(out, None if d == block_d and d % 32 == 0 else False)
    qn, kn = _norm_weights(norms, q)
    pdl = launch.programmatic_launch(q.device)  # after the q/k/v GEMV: resident as it ends
    attention_kernel[(n_kv, splits, n_seq)](
        q, k, v, cos, sin, positions, tables, k_cache, v_cache, partial, stats, out,
        *activation.quantized_pointers(out, qx), qn, kn, cache_rows.levels(q.device),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        sin.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        tables.stride(0),
        n_read, k_cache.shape[0], window or 0, 1.0 / math.sqrt(d) if scale is None else scale,
        softcap or 1.0, splits, 0.0 if norms is None else norms[2],
        Q_NORM=norms is not None and norms[0] is not None, K_NORM=norms is not None and norms[1] is not None,
        G=n_head // n_kv, D=d, N_DIMS=n_dims, NEOX=neox, WINDOW=window is not None,
        SOFTCAP=softcap is not None, DOT=dot_type, KT=kt, KB=kb, VT=vt, VB=vb,
        BLOCK_G=max(16, triton.next_power_of_2(n_head // n_kv)), BLOCK_D=block_d, BLOCK_N=BLOCK_N,
        PAGED=paged is not None, BR=block_rows, WAIT=pdl, SPLIT=splits > 1, QUANT=qx is not None,
        TRIGGER=qx is not None and pdl and splits == 1, ROT_K=rotation[0], ROT_V=rotation[1],
        num_warps=4, num_stages=stages, launch_pdl=pdl,
    )  # fmt: skip
    if splits > 1:
        combine_kernel[(n_seq * n_head,)](
            partial, stats, out, *activation.quantized_pointers(out, qx), splits, n_head, D=d,
            QUANT=qx is not None, TRIGGER=qx is not None and pdl, ROT_V=rotation[1],
            MERGE_SPLITS=min(triton.next_power_of_2(splits), MERGE_SPLITS), BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out


def _norm_weights(norms: Norms | None, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The query and key norms' weights on q's device, q standing in (unread) for an absent one."""
    if norms is None:
        return q, q
    qn, kn = (q if w is None else w.to(q.device) for w in norms[:2])
    return qn, kn


@cache
def target_programs(device: torch.device) -> int:
    """How many programs (Hk * S) to split the keys into on `device`: the power of two nearest two
    waves of its SMs (256 on an H200's 132), so every SM gets work and a power-of-two Hk divides it."""
    return 1 << round(math.log2(2 * launch.sm_count(device, INTERPRETED_SMS)))


# --- kernels ------------------------------------------------------------------------------------


@triton.jit
def _rotate(
    ptrs, d, mask, cos_ptr, sin_ptr, N_DIMS: tl.constexpr, NEOX: tl.constexpr, norm_ptr, eps,
    AXIS: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """The values at ptrs + d rotated as `Rope.apply` does, in float32: each pair (a, b) of the first
    N_DIMS becomes (a cos - b sin, a sin + b cos); the rest pass through. `d` indexes the last axis,
    AXIS, of D values a head. NORM: each head RMS-normalized first, by the weights at norm_ptr."""
    rotating = d < N_DIMS
    if NEOX:  # pairs (i, i + N_DIMS/2)
        first = d < N_DIMS // 2
        partner = tl.where(first, d + N_DIMS // 2, d - N_DIMS // 2)
        angle = tl.where(first, d, d - N_DIMS // 2)
    else:  # GGML's adjacent pairs (2i, 2i + 1)
        first = d % 2 == 0
        partner = d ^ 1
        angle = d // 2
    partner = tl.where(rotating, partner, d)
    x = tl.load(ptrs + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(ptrs + partner, mask=mask & rotating, other=0.0).to(tl.float32)
    if NORM:  # as `ops.rms_norm` of the head: x * rsqrt(mean(x^2) + eps) * w
        r = tl.rsqrt(tl.sum(x * x, axis=AXIS, keep_dims=True) / D + eps)
        x *= r * tl.load(norm_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        xp *= r * tl.load(norm_ptr + partner, mask=d < D, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + angle, mask=rotating, other=1.0)
    sin = tl.load(sin_ptr + angle, mask=rotating, other=0.0)
    return x * cos + tl.where(first, -xp, xp) * sin


@triton.jit
def attention_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, table_ptr, kc_ptr, vc_ptr, part_ptr, stats_ptr,
    out_ptr, xq_ptr, dx_ptr, xs_ptr, qn_ptr, kn_ptr, levels_ptr,
    sq_b, sq, sk_b, sk, sv_b, sv, scos_b, ssin_b, skc_n, skc_h, svc_n, svc_h, st_b,
    n_read, n_rows, window, scale, softcap, n_splits, eps, Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
    G: tl.constexpr, D: tl.constexpr, N_DIMS: tl.constexpr, NEOX: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT: tl.constexpr, KT: tl.constexpr, KB: tl.constexpr, VT: tl.constexpr,
    VB: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, BR: tl.constexpr, WAIT: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr,
    TRIGGER: tl.constexpr, ROT_K: tl.constexpr, ROT_V: tl.constexpr,
):  # fmt: skip
    if WAIT:  # launched as a programmatic dependent (norm.rms_norm_kernel's note)
        gdc_wait()
    kvh, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    gmask, dmask = g < G, d < D
    pos = tl.load(pos_ptr + b).to(tl.int32)
    b64 = b.to(tl.int64)
    q_ptr, k_ptr, v_ptr = q_ptr + b64 * sq_b, k_ptr + b64 * sk_b, v_ptr + b64 * sv_b
    cos_ptr, sin_ptr, table_ptr = cos_ptr + b * scos_b, sin_ptr + b * ssin_b, table_ptr + b64 * st_b

    # This program's chunk [start, end) of the visible keys [lo, hi): a paged sequence's are its
    # positions up to its own (its table holds them all: no ring, no CUDA-graph bucket's tail).
    hi = pos + 1 if PAGED else tl.minimum(pos + 1, n_read)
    lo = 0
    if WINDOW:
        lo = tl.maximum(pos + 1 - window, 0)
    chunk = tl.cdiv(tl.cdiv(hi - lo, n_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, hi)

    heads = kvh * G + g  # of this token's
    qmask = gmask[:, None] & dmask[None, :]
    q_at = q_ptr + heads[:, None] * sq
    q = _rotate(q_at, d[None, :], qmask, cos_ptr, sin_ptr, N_DIMS, NEOX, qn_ptr, eps, 1, D, Q_NORM)
    k_new = _rotate(k_ptr + kvh * sk, d, dmask, cos_ptr, sin_ptr, N_DIMS, NEOX, kn_ptr, eps, 0, D, K_NORM)
    v_new = tl.load(v_ptr + kvh * sv + d, mask=dmask, other=0.0).to(tl.float32)
    # the caches' Walsh-Hadamard rotation (`ops.hadamard`): q and k alike, v (the output goes back)
    q = hadamard(q, ROT_K)
    k_new = tl.reshape(hadamard(tl.reshape(k_new, (1, BLOCK_D)), ROT_K), (BLOCK_D,))
    v_new = tl.reshape(hadamard(tl.reshape(v_new, (1, BLOCK_D)), ROT_V), (BLOCK_D,))
    # this step's row as the cache will hold it: rounded to its dtype, or quantized (codes kept to store)
    if KT == 0:
        k_new = k_new.to(kc_ptr.dtype.element_ty)
    else:
        k_codes, k_d, k_m = quantize_head(k_new, levels_ptr, KT, BLOCK_D)
        k_new = blocks_value(k_codes, k_d, k_m, levels_ptr, KT, BLOCK_D)
    if VT == 0:
        v_new = v_new.to(vc_ptr.dtype.element_ty)
    else:
        v_codes, v_d, v_m = quantize_head(v_new, levels_ptr, VT, BLOCK_D)
        v_new = blocks_value(v_codes, v_d, v_m, levels_ptr, VT, BLOCK_D)

    kc_ptr += head_at(kvh, skc_h, D, KT, KB)  # this KV head's start in a row
    vc_ptr += head_at(kvh, svc_h, D, VT, VB)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n in range(start, end, BLOCK_N):
        rows = n + tl.arange(0, BLOCK_N)
        rmask = rows < end
        fresh = (rows == pos)[:, None]  # this step's row: from registers, not (yet) from the cache
        if PAGED:  # position p in row table[p // BR] * BR + p % BR
            block = tl.load(table_ptr + rows // BR, mask=rmask, other=0).to(tl.int64)
            r64 = (block * BR + rows % BR)[:, None]
        else:
            r64 = (rows % n_rows).to(tl.int64)[:, None]  # a sliding-window layer's cache is a ring
        keys = load_rows(kc_ptr + r64 * skc_n, rmask[:, None], levels_ptr, D, KT, KB, BLOCK_D, DOT)
        keys = tl.where(fresh, k_new[None, :], keys)
        s = dot(q, tl.trans(keys), DOT)  # [BLOCK_G, BLOCK_N]
        # soft-capping: softcap * tanh(s * scale / softcap), with tanh(x) = 2 sigmoid(2x) - 1
        s = softcap * (2.0 * tl.sigmoid(s * (2.0 * scale / softcap)) - 1.0) if SOFTCAP else s * scale
        s = tl.where(rmask[None, :], s * 1.4426950408889634, float("-inf"))  # to log2 units for exp2
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every step has a visible key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        values = load_rows(vc_ptr + r64 * svc_n, rmask[:, None], levels_ptr, D, VT, VB, BLOCK_D, DOT)
        values = tl.where(fresh, v_new[None, :], values)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p, values, DOT)
        m_i = m_new

    # The chunk holding pos stores this step's key and value. After the loop: the interpreter runs
    # programs one after another, and a store before it would hide a missing substitution from the
    # tests. (tl.where rather than `dmask & scalar`, which the interpreter turns into int32.)
    holds_pos = (start <= pos) & (pos < end)
    mine = tl.where(holds_pos, dmask, False)
    if PAGED:
        slot = tl.load(table_ptr + pos // BR).to(tl.int64) * BR + pos % BR
    else:
        slot = (pos % n_rows).to(tl.int64)
    if KT == 0:
        tl.store(kc_ptr + slot * skc_n + d, k_new, mask=mine)
    else:
        store_head(kc_ptr + slot * skc_n, k_codes, k_d, k_m, holds_pos, D, KT, KB, BLOCK_D)
    if VT == 0:
        tl.store(vc_ptr + slot * svc_n + d, v_new, mask=mine)
    else:
        store_head(vc_ptr + slot * svc_n, v_codes, v_d, v_m, holds_pos, D, VT, VB, BLOCK_D)

    if TRIGGER:  # the o projection's GEMV may start loading its weights (norm.rms_norm_kernel's note)
        gdc_launch_dependents()
    n_kv = tl.num_programs(0)
    if not SPLIT:
        o = acc / tl.where(gmask, l_i, 1.0)[:, None]
        _finish(hadamard(o, ROT_V), out_ptr, xq_ptr, dx_ptr, xs_ptr, b64, kvh, n_kv, G, D, QUANT)
    else:
        # An empty chunk (a split past the visible keys) leaves max -inf and sum 0: weight 0 in combine.
        first = (b64 * (n_kv * G) + heads) * n_splits  # this token's heads' partials of split 0
        tl.store(part_ptr + (first + split)[:, None] * D + d[None, :], acc, mask=qmask)
        tl.store(stats_ptr + (first + split) * 2, m_i, mask=gmask)
        tl.store(stats_ptr + (first + split) * 2 + 1, l_i, mask=gmask)


@triton.jit
def combine_kernel(
    part_ptr, stats_ptr, out_ptr, xq_ptr, dx_ptr, xs_ptr, n_splits, n_head, D: tl.constexpr,
    QUANT: tl.constexpr, TRIGGER: tl.constexpr, ROT_V: tl.constexpr, MERGE_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program h: token h // n_head's head h % n_head, its output from the splits' partials."""
    if TRIGGER:  # the o projection's GEMV may start loading its weights (norm.rms_norm_kernel's note)
        gdc_launch_dependents()
    h = tl.program_id(0)
    o = _merge(part_ptr, stats_ptr, h, n_splits, D, MERGE_SPLITS, BLOCK_D)
    _finish(hadamard(o, ROT_V), out_ptr, xq_ptr, dx_ptr, xs_ptr, h // n_head, h % n_head, n_head, 1, D, QUANT)


@triton.jit
def _merge(
    part_ptr, stats_ptr, head, n_splits, D: tl.constexpr, MERGE_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr
):  # fmt: skip
    """The output [1, BLOCK_D] of `head` (of all tokens' heads) from its n_splits partial outputs
    (split i at row head * n_splits + i of part, its max in log2 units and sum in stats'), in their
    order, MERGE_SPLITS of them a step with their loads issued together. Rescaled as the running max
    grows, as the key loop does; an empty split (max -inf) adds nothing, and the split holding pos
    makes the max finite."""
    d = tl.arange(0, BLOCK_D)
    top = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1, BLOCK_D], tl.float32)
    weight = tl.zeros([1], tl.float32)
    for i in range(0, n_splits, MERGE_SPLITS):
        s = i + tl.arange(0, MERGE_SPLITS)
        row = head * n_splits + s
        ok = s < n_splits
        m_s = tl.load(stats_ptr + row * 2, mask=ok, other=float("-inf"))
        l_s = tl.load(stats_ptr + row * 2 + 1, mask=ok, other=0.0)
        rows = part_ptr + row[:, None] * D + d[None, :]
        part = tl.load(rows, mask=ok[:, None] & (d < D)[None, :], other=0.0)
        new = tl.maximum(top, tl.max(m_s, 0))
        finite = tl.where(new == float("-inf"), 0.0, new)
        kept, w = tl.exp2(top - finite), tl.exp2(m_s - finite)
        total = total * kept[:, None] + tl.sum(w[:, None] * part, 0)[None, :]
        weight = weight * kept + tl.sum(w * l_s, 0)
        top = new
    return total / weight[:, None]


@triton.jit
def _finish(
    o, out_ptr, xq_ptr, dx_ptr, xs_ptr, b, kvh, n_kv, G: tl.constexpr, D: tl.constexpr, QUANT: tl.constexpr
):
    """Heads kvh * G.. of token b's output, o [BLOCK_G, BLOCK_D] (rows past G and columns past D not
    stored), in out's dtype; QUANT (D == BLOCK_D, a multiple of 32): also quantized, as rounded,
    for the o projection's integer-dot GEMV (its groups are the row's kvh * G * D / 32..)."""
    BLOCK_G: tl.constexpr = o.shape[0]
    BLOCK_D: tl.constexpr = o.shape[1]
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    n = n_kv * G * D  # a token's output row
    o = o.to(out_ptr.dtype.element_ty)
    ok = (g < G)[:, None] & (d < D)[None, :]
    tl.store(out_ptr + b * n + (kvh * G + g)[:, None] * D + d[None, :], o, mask=ok)
    if QUANT:
        NG: tl.constexpr = BLOCK_G * BLOCK_D // 32
        r = tl.arange(0, NG)
        groups = tl.reshape(o.to(tl.float32), (NG, 32))
        store_quantized(groups, kvh * (G * D // 32) + r, r < G * D // 32, b, n, xq_ptr, dx_ptr, xs_ptr)
