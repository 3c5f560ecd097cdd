"""A prompt batch's attention over the KV cache in one Triton launch: flash attention (tiles of keys,
online softmax; the scores never leave registers) over cache rows of any cache type.

T queries at `positions` (ascending: a prompt chunk, the last T of the n_read rows read) attend over
cache rows 0..n_read-1, a key visible when its position k satisfies k <= p (and p - window < k for a
sliding window), as `ops.causal_mask` and `ops.ring_mask` say. The rows are float (f32, f16, bf16)
or GGUF blocks (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl; K and V each their own type; grouped, as
`llmx.quant.kv_layout` lays a GPU's cache out), dequantized as a tile is loaded
(`cache_rows.load_rows`). Every tile of queries converts each key and value tile it reads, so a prompt
of many such tiles for a KV head (DEQUANTIZE_FIRST_TILES) converts the block rows once, into a float
copy the kernel then reads as a float cache's: the same operands, the same result.

Grid (tiles, Hk): for KV head h the G = H/Hk query heads of its group are rows t * G + g of one
[T * G, D] matrix, cut into tiles of BLOCK_M rows (BLOCK_M / G consecutive queries), so every key
and value tile is loaded once for the whole group (no `repeat_interleave` of the cache). A tile's
keys split into ranges by what its queries see (from the positions, read on the device, so a CUDA
graph replays it): blocks of keys visible to every query of the tile go without a mask, blocks on
the diagonal or the window's edge with one, and blocks that no query of the tile sees are never
read. A ring cache (a sliding-window layer's, once wrapped: `key_positions` gives each row's
position) is read whole, masked by those positions.

Over a paged cache (`paged_prefill_attention`: a server step's prompt chunks of several sequences, as
`runtime.paged` lays them out) a third grid axis takes the chunks: a program finds its chunk's
queries from their starts and reads its sequence's keys through the block table, so one launch a
layer serves every chunk of the step.

Scores, softmax and sums are float32 (softcap * tanh(s / softcap) for Gemma 2's soft-capping); the
two products take f16 operands for the block types and f16 caches, bf16 for bf16 caches (tensor
cores), float32 for f32 caches and under TRITON_INTERPRET=1 (numpy cannot multiply bf16).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmx.kernels import cache_rows
from llmx.kernels.cache_rows import TL_DTYPE, dot, head_at, load_rows
from llmx.quant import QType

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)

# Query tiles of a KV head from which a GPU prompt converts a block cache's rows first (a float copy of
# the rows read: 2 bytes a value on top of the cache, planned in `plan.memory`): one conversion pass
# costs about a read and a write of the rows, where each tile's own conversion made a q8_0 cache's
# tile of 512 queries over 32K rows take twice an f16 cache's time. An H100 (bench/prefill_attention.py
# --first off|on, 32 heads on 8, q8_0 over 32K rows, tiles of 128 query rows): 512 queries (16 tiles
# a KV head) 1.49 -> 0.74 ms (f16: 0.67), 64 queries (2 tiles) 1.54 -> 0.73. One tile converts each
# key tile once either way, and the copy would add its write and read.
DEQUANTIZE_FIRST_TILES = 2


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    *,
    types: tuple[QType, QType] | None = None,
    key_positions: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    dequantize_first: bool | None = None,
) -> torch.Tensor:
    """q [T, H, D] at `positions` [T] (ascending) over cache rows k, v [N, Hk, row]: float rows of D
    values, or uint8 GGUF blocks of `types` (K's, V's; None: float caches). Row n holds position n,
    or `key_positions`[n] for a ring (negative: never written). Scores scaled by `scale` (default
    1/sqrt(D)), then soft-capped where `softcap` is set. `block_m`/`block_n` override the tiles,
    `dequantize_first` the choice to convert block rows first (tests). Returns [T, H * D] in q's
    dtype."""
    t, n_head, d = q.shape
    n_read, n_kv = k.shape[0], k.shape[1]
    group = n_head // n_kv
    if types is not None:
        # the operands' type where block rows meet q: f16 on a GPU's tensor cores, float32 elsewhere
        operand = torch.float16 if q.is_cuda else torch.float32
        if dequantize_first is None:
            tiles = triton.cdiv(t * group, block_m or _tiles(d, q.is_cuda, False, True)[0])
            dequantize_first = q.is_cuda and tiles >= DEQUANTIZE_FIRST_TILES
        if dequantize_first and all(x.dtype in (torch.uint8, operand) for x in (k, v)):
            k, v = (
                cache_rows.dequantized(x, qt, d, operand) if x.dtype == torch.uint8 else x
                for x, qt in zip((k, v), types, strict=True)
            )
            types = None
    q = q if q.stride(-1) == 1 else q.contiguous()
    positions = positions.to(q.device)
    ring = key_positions is not None
    kpos = key_positions.to(q.device) if ring else positions  # not read without a ring
    return _launch(
        q, k, v, positions, kpos, None, t, n_read, 1, types=types, ring=ring, window=window, scale=scale,
        softcap=softcap, block_m=block_m, block_n=block_n,
    )  # fmt: skip


def paged_prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    positions: torch.Tensor,
    starts: torch.Tensor,
    tables: torch.Tensor,
    longest: int,
    *,
    block_rows: int,
    types: tuple[QType, QType] | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The prompt chunks of C sequences over a paged cache (`runtime.paged`) in one launch: chunk c is
    rows starts[c]..starts[c+1]-1 of q [T, H, D] at `positions` [T] (a chunk's positions consecutive,
    its keys and values already stored), and attends over its sequence's positions 0..its last, pool
    rows tables[c, p // block_rows] * block_rows + p % block_rows (`tables` int32 [C, W]). `starts`
    int32 [C + 1] on q's device; `longest`: the most rows a chunk has (the grid's tiles). Masks,
    windows and soft-capping as `prefill_attention`'s; block rows are converted tile by tile (no
    float copy of a pool). Returns [T, H * D] in q's dtype."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    return _launch(
        q, k_pool, v_pool, positions, positions, (tables, block_rows, starts), longest, 0,
        starts.shape[0] - 1, types=types, ring=False, window=window, scale=scale, softcap=softcap,
    )  # fmt: skip


def _launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, kpos: torch.Tensor,
    paged: tuple[torch.Tensor, int, torch.Tensor] | None, t: int, n_read: int, n_chunks: int, *,
    types: tuple[QType, QType] | None, ring: bool, window: int | None, scale: float | None,
    softcap: float | None, block_m: int | None = None, block_n: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """The kernel over a contiguous cache (`paged` None: one chunk of `t` queries over rows
    0..n_read-1) or over a paged one (`paged`: the tables, their block rows and the chunks' starts;
    `t` the longest chunk)."""
    n_head, d = q.shape[1], q.shape[2]
    n_kv = k.shape[1]
    group = n_head // n_kv
    (kt, kb), (vt, vb) = cache_rows.codes(types, k, v)
    # dequantized rows meet q in f16 on a GPU's tensor cores, as an f16 cache's do
    dot_type = tl.float32 if not q.is_cuda else tl.float16 if k.dtype == torch.uint8 else TL_DTYPE[k.dtype]
    bm, bn, warps, stages = _tiles(
        d, q.is_cuda, torch.float32 in (k.dtype, v.dtype), torch.uint8 in (k.dtype, v.dtype)
    )
    bm, bn = block_m or bm, block_n or bn
    tables, block_rows, starts = paged if paged is not None else (positions, 1, positions)  # unread unpaged
    out = torch.empty(q.shape[0], n_head * d, dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(t * group, bm), n_kv, n_chunks)
    prefill_kernel[grid](
        q, k, v, out, positions, kpos, cache_rows.levels(q.device), starts, tables,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), tables.stride(0),
        t, n_read, window or 0, 1.0 / math.sqrt(d) if scale is None else scale, softcap or 1.0,
        G=group, D=d, WINDOW=window is not None, SOFTCAP=softcap is not None, RING=ring, DOT=dot_type,
        KT=kt, KB=kb, VT=vt, VB=vb, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, triton.next_power_of_2(d)),
        PAGED=paged is not None, BR=block_rows, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _tiles(d: int, cuda: bool, wide: bool, blocks: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for head dim `d`; `wide`: a float32 cache; `blocks`:
    a cache of GGUF blocks.

    On a GPU: 128 query rows x 64 keys for D <= 128 (K and V tiles of 16 KB each a stage in f16);
    64 x 64 for D = 256 at two stages (64 KB of K and V a stage, 128 KB in all, under an H100's
    227 KB of shared memory); float32 operands halve the keys and, at D = 256, go unpipelined.
    Block tiles take two stages at D <= 128 (a q8_0 cache of 32K rows, T = 512, on an H100: 1.99 ms
    at 2 stages, 2.00 at 3, 2.23 at 1, `bench/prefill_attention.py --sweep`) and none at D = 256.
    The interpreter takes small tiles, so tests cross many tile edges on small shapes."""
    if not cuda:
        return 16, 16, 4, 1
    if d <= 128:
        return (128, 32, 8, 2) if wide else (128, 64, 8 if d > 64 else 4, 2 if blocks else 3)
    return (64, 32, 8, 1) if wide else (64, 64, 8, 1 if blocks else 2)


# --- kernels ------------------------------------------------------------------------------------


@triton.jit
def prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, pos_ptr, kpos_ptr, levels_ptr, starts_ptr, tables_ptr,
    sq_t, sq_h, sk_n, sk_h, sv_n, sv_h, s_table,
    n_q, n_read, window, scale, softcap,
    G: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, RING: tl.constexpr,
    DOT: tl.constexpr, KT: tl.constexpr, KB: tl.constexpr, VT: tl.constexpr, VB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr,
    BR: tl.constexpr,
):  # fmt: skip
    tile, kvh = tl.program_id(0), tl.program_id(1)
    if PAGED:  # chunk c: its queries, outputs and positions from its start, its keys through its table
        c = tl.program_id(2)
        first = tl.load(starts_ptr + c)
        n_q = tl.load(starts_ptr + c + 1) - first
        if tile * BLOCK_M >= n_q * G:  # the grid's tiles are the longest chunk's
            return
        q_ptr += first.to(tl.int64) * sq_t
        out_ptr += first.to(tl.int64) * (tl.num_programs(1) * G * D)
        pos_ptr += first
        n_read = tl.load(pos_ptr + n_q - 1).to(tl.int32) + 1
        tables_ptr += c.to(tl.int64) * s_table
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # rows t * G + g of this KV head's queries
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qt = tl.minimum(r // G, n_q - 1)  # rows past the last query repeat it (never stored)
    heads = kvh * G + r % G
    q_ptrs = q_ptr + qt[:, None].to(tl.int64) * sq_t + heads[:, None] * sq_h + d[None, :]
    q = tl.load(q_ptrs, mask=dmask[None, :], other=0.0).to(DOT)
    qpos = tl.load(pos_ptr + qt).to(tl.int32)
    p_first = tl.load(pos_ptr + (tile * BLOCK_M) // G).to(tl.int32)
    p_last = tl.load(pos_ptr + tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // G, n_q - 1)).to(tl.int32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if RING:  # rows in no position order: all of them, masked by the positions they hold
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, qpos, 0, n_read, k_ptr, v_ptr, kpos_ptr, tables_ptr, levels_ptr, kvh, sk_n,
            sk_h, sv_n, sv_h, n_read, window, scale, softcap,
            True, WINDOW, SOFTCAP, RING, DOT, D, KT, KB, VT, VB, BLOCK_N, BLOCK_D, PAGED, BR,
        )  # fmt: skip
    else:
        # Keys [lo, hi) are visible to some query of the tile, [full_lo, full_hi) to all of them:
        # masked blocks [lo, a) (a window's edge), unmasked [a, b), masked [b, hi) (the diagonal).
        hi = tl.minimum(p_last + 1, n_read)
        full_hi = tl.minimum(p_first + 1, n_read)
        a = 0
        if WINDOW:
            lo = tl.maximum(p_first + 1 - window, 0)
            full_lo = tl.maximum(p_last + 1 - window, 0)
            start = lo // BLOCK_N * BLOCK_N
            a = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, start), hi)
            acc, m_i, l_i = _attend(
                acc, m_i, l_i, q, qpos, start, a, k_ptr, v_ptr, kpos_ptr, tables_ptr, levels_ptr, kvh, sk_n,
                sk_h, sv_n, sv_h, n_read, window, scale, softcap,
                True, WINDOW, SOFTCAP, RING, DOT, D, KT, KB, VT, VB, BLOCK_N, BLOCK_D, PAGED, BR,
            )  # fmt: skip
        b = tl.maximum(full_hi // BLOCK_N * BLOCK_N, a)
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, qpos, a, b, k_ptr, v_ptr, kpos_ptr, tables_ptr, levels_ptr, kvh, sk_n, sk_h,
            sv_n, sv_h, n_read, window, scale, softcap,
            False, WINDOW, SOFTCAP, RING, DOT, D, KT, KB, VT, VB, BLOCK_N, BLOCK_D, PAGED, BR,
        )  # fmt: skip
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, qpos, b, hi, k_ptr, v_ptr, kpos_ptr, tables_ptr, levels_ptr, kvh, sk_n, sk_h,
            sv_n, sv_h, n_read, window, scale, softcap,
            True, WINDOW, SOFTCAP, RING, DOT, D, KT, KB, VT, VB, BLOCK_N, BLOCK_D, PAGED, BR,
        )  # fmt: skip

    # every query sees at least its own key, so l_i > 0 for every row stored
    out = acc / l_i[:, None]
    o_row = qt[:, None].to(tl.int64) * (tl.num_programs(1) * G * D)  # out is [T, H * D]
    o_ptrs = out_ptr + o_row + heads[:, None] * D + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(r < n_q * G)[:, None] & dmask[None, :])


@triton.jit
def _attend(
    acc, m_i, l_i, q, qpos, start, end, k_ptr, v_ptr, kpos_ptr, tables_ptr, levels_ptr, kvh, sk_n, sk_h,
    sv_n, sv_h, n_read, window, scale, softcap,
    MASK: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, RING: tl.constexpr, DOT: tl.constexpr,
    D: tl.constexpr, KT: tl.constexpr, KB: tl.constexpr, VT: tl.constexpr, VB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    """Key blocks [start, end) (multiples of BLOCK_N) into the running (acc, max, sum) of the queries
    q [BLOCK_M, BLOCK_D] at `qpos`; with MASK each key is checked against each query (and rows past
    n_read dropped), without it every key is visible to every query. PAGED: key position n lives in
    pool row tables[n // BR] * BR + n % BR."""
    k_ptr += head_at(kvh, sk_h, D, KT, KB)  # this KV head's start in a row
    v_ptr += head_at(kvh, sv_h, D, VT, VB)
    for n in range(start, end, BLOCK_N):
        rows = n + tl.arange(0, BLOCK_N)
        rmask = rows < n_read
        if PAGED:
            block = tl.load(tables_ptr + rows // BR, mask=rmask, other=0).to(tl.int64)
            r64 = (block * BR + rows % BR)[:, None]
        else:
            r64 = rows.to(tl.int64)[:, None]
        keys = load_rows(k_ptr + r64 * sk_n, rmask[:, None], levels_ptr, D, KT, KB, BLOCK_D, DOT)
        s = dot(q, tl.trans(keys.to(DOT)), DOT)  # [BLOCK_M, BLOCK_N]
        # soft-capping: softcap * tanh(s * scale / softcap), with tanh(x) = 2 sigmoid(2x) - 1
        # (in log2 units, for exp2)
        if SOFTCAP:
            s = (softcap * LOG2E) * (2.0 * tl.sigmoid(s * (2.0 * scale / softcap)) - 1.0)
        else:
            s = s * (scale * LOG2E)
        if MASK:
            kpos = rows
            if RING:
                kpos = tl.load(kpos_ptr + rows, mask=rmask, other=-1).to(tl.int32)
            visible = (kpos[None, :] <= qpos[:, None]) & (rmask & (kpos >= 0))[None, :]
            if WINDOW:
                visible = visible & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query that has seen no key yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        values = load_rows(v_ptr + r64 * sv_n, rmask[:, None], levels_ptr, D, VT, VB, BLOCK_D, DOT)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p, values.to(DOT), DOT)
        m_i = m_new
    return acc, m_i, l_i
