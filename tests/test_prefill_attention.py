"""The Triton flash kernel for prompt batches (`llmx.kernels.prefill_attention`) against float64
attention over the same cache rows (dequantized for the block types), and its place in
`ops.cached_attention` (`AttentionKernels.prefill`).

Without CUDA the kernel runs under TRITON_INTERPRET=1 with 16 x 16 tiles, so small shapes cross
many tile edges: ragged T and n_read, first chunks (T == n_read) and later ones, windows narrower
and wider than a tile, soft-capping, GQA groups of 1, 3 and 4, head dims 64 and 256, a wrapped
ring, every cache type for K and V. The `gpu` tests take Llama-3-8B's attention shape (32 heads,
8 KV heads, D = 128) and Gemma 3's (D = 256, a window over a ring) with the GPU's tiles.

Tolerances, as ||kernel - reference|| / ||reference||: 1e-5 under the interpreter (float32
products); on a GPU 1e-5 for f32 caches, 5e-3 for f16 and the block types (q and the softmax
weights rounded to f16 for the tensor cores), 2e-2 for bf16.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from llmx.kernels import prefill_attention as kernel  # noqa: E402
from llmx.ops.cached_attention import AttentionKernels, cached_attention  # noqa: E402
from llmx.ops.masks import causal_mask, ring_mask  # noqa: E402
from llmx.quant import kv_layout, qtype  # noqa: E402
from llmx.quant.quantize import KV_BLOCK_TYPES, quantize  # noqa: E402
from llmx.quant.torch_ops import dequantize  # noqa: E402
from llmx.runtime.cache import BlockWriter, LayerWriter  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
TYPES = [*FLOATS, *KV_BLOCK_TYPES]
PAIRS = [(t, t) for t in TYPES] + [("Q8_0", "Q4_0"), ("F16", "Q8_0"), ("Q4_1", "F32"), ("BF16", "IQ4_NL")]
pytestmark = pytest.mark.usefixtures("grouped_caches")  # block caches as the kernel reads them


def tolerance(kt: str) -> float:
    if DEVICE == "cpu" or kt == "F32":
        return 1e-5
    return 2e-2 if kt == "BF16" else 5e-3


def cache_rows(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, Hk, D] float32 stored as a cache of type `name` on DEVICE (blocks in its layout): (the
    rows, what they hold as float64)."""
    if name in FLOATS:
        rows = x.to(FLOATS[name])
        return rows.to(DEVICE), rows.double()
    rows = quantize(x, qtype(name))
    n, n_kv = rows.shape[:2]
    deq = dequantize(rows.reshape(n * n_kv, -1), qtype(name)).reshape(n, n_kv, -1).double()
    return kv_layout.stored(rows.to(DEVICE), qtype(name), DEVICE), deq


def reference(q, k, v, mask, scale, softcap) -> torch.Tensor:
    """float64 attention: q [T, H, D] over k, v [N, Hk, D] (float64), `mask` [T, N] -> [T, H * D]."""
    t, n_head, d = q.shape
    group = n_head // k.shape[1]
    kh, vh = (x.to(q.device).repeat_interleave(group, 1) for x in (k, v))
    mask = mask.to(q.device)
    s = torch.einsum("thd,nhd->htn", q.double(), kh) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("htn,nhd->thd", s.softmax(-1), vh).reshape(t, n_head * d)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """|out - ref| / |ref|, on the CPU (a GPU writer's output beside a reference on its inputs' device)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


@dataclass(frozen=True)
class Heads:
    """The attention's heads and masks, for a case of one chunk (`Case`) or several (`Chunks`)."""

    n_head: int = 8
    n_head_kv: int = 2
    d: int = 64
    window: int | None = None
    softcap: float | None = None
    scale: float = 0.125

    def __str__(self) -> str:
        extra = "".join(f"-{k}{v}" for k, v in (("w", self.window), ("cap", self.softcap)) if v)
        return f"h{self.n_head}kv{self.n_head_kv}-d{self.d}{extra}"


@dataclass(frozen=True, kw_only=True)
class Case(Heads):
    t: int
    n_read: int

    def __str__(self) -> str:
        return f"t{self.t}of{self.n_read}-{super().__str__()}"


def check_kernel(
    c: Case, kt: str, vt: str, block: int | None = None, seed: int = 0, first: bool | None = None
) -> torch.Tensor:
    """The kernel's output for case `c` against the reference (`first`: its `dequantize_first`)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(c.t, c.n_head, c.d, generator=g)
    k, v = (torch.randn(c.n_read, c.n_head_kv, c.d, generator=g) for _ in range(2))
    (kc, kf), (vc, vf) = cache_rows(kt, k), cache_rows(vt, v)
    positions = torch.arange(c.n_read - c.t, c.n_read)
    types = None if kt in FLOATS and vt in FLOATS else (qtype(kt), qtype(vt))
    q, kc, vc, positions = (x.to(DEVICE) for x in (q, kc, vc, positions))
    out = kernel.prefill_attention(
        q, kc, vc, positions, types=types, window=c.window, scale=c.scale, softcap=c.softcap,
        block_m=block, block_n=block, dequantize_first=first,
    )  # fmt: skip
    assert out.shape == (c.t, c.n_head * c.d) and out.dtype == q.dtype
    mask = causal_mask(positions, c.n_read, c.window)
    ref = reference(q, kf.to(DEVICE), vf.to(DEVICE), mask, c.scale, c.softcap)
    err = relative_error(out, ref)
    assert err < tolerance(kt), f"relative error {err:.2e}"
    return out


@pytest.mark.parametrize(("kt", "vt"), PAIRS, ids=lambda p: p)
def test_every_cache_type(kt: str, vt: str) -> None:
    check_kernel(Case(t=21, n_read=53), kt, vt)


@pytest.mark.parametrize(
    ("kt", "vt"), [("Q8_0", "Q4_0"), ("Q5_0", "IQ4_NL"), ("Q5_1", "Q4_1")], ids=lambda p: p
)
def test_heads_of_blocks_that_start_2_aligned(kt: str, vt: str) -> None:
    """Three blocks a head (D = 96: 102 bytes of q8_0, 54 of q4_0) put every other head at an odd
    multiple of 2, its codes and Q5's fifth-bit words too."""
    check_kernel(Case(t=21, n_read=53, d=96), kt, vt)


@pytest.mark.parametrize(
    ("kt", "vt"), [("Q8_0", "Q8_0"), ("Q4_0", "Q5_1"), ("IQ4_NL", "Q4_1"), ("Q5_0", "F32")], ids=lambda p: p
)
def test_block_rows_converted_first_give_what_the_tiles_do(kt: str, vt: str) -> None:
    """A prompt of many query tiles converts the block rows once (`cache_rows.dequantized`) and reads
    the copy as a float cache: the same operands in the same tiles, the same output bit for bit; a
    float cache beside a block one is read as it is."""
    case = Case(t=21, n_read=53, window=30)
    converted, tiles = (check_kernel(case, kt, vt, first=first) for first in (True, False))
    assert torch.equal(converted, tiles)


def test_dequantized_rows_hold_the_blocks_values() -> None:
    x = torch.randn(37, 3, 96, generator=torch.Generator().manual_seed(1))
    for name in KV_BLOCK_TYPES:
        rows, values = cache_rows(name, x)
        got = kernel.cache_rows.dequantized(rows, qtype(name), 96, torch.float32)
        assert got.shape == (37, 3, 96) and torch.equal(got.double().cpu(), values), name


CASES = [
    Case(t=37, n_read=37, n_head=4, n_head_kv=1),  # a first chunk, group of 4
    Case(t=21, n_read=53, n_head=4, n_head_kv=4),  # a later chunk, no grouping
    Case(t=5, n_read=70, n_head=6, n_head_kv=2),  # groups of 3: tiles hold partial token groups
    Case(t=30, n_read=70, window=10),  # a window narrower than a tile
    Case(t=40, n_read=90, window=33),  # unmasked blocks between the window's edge and the diagonal
    Case(t=20, n_read=20, window=64),  # a window wider than the context
    Case(t=19, n_read=40, n_head=4, n_head_kv=4, softcap=2.0, scale=0.3),
    Case(t=9, n_read=33, n_head=4, n_head_kv=1, d=256, window=12, softcap=30.0),  # Gemma's shape
    Case(t=32, n_read=96, n_head=2, n_head_kv=2),  # whole tiles
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_shapes_and_masks(case: Case) -> None:
    check_kernel(case, "F16", "F16")


def test_default_tiles_on_the_interpreter_are_small() -> None:
    """The tile sizes the tests assume: small ones, so the shapes above cross tile edges."""
    assert kernel._tiles(64, cuda=False, wide=False)[:2] == (16, 16)


# --- a paged cache: the prompt chunks of several sequences in one launch ----------------------------


@dataclass(frozen=True, kw_only=True)
class Chunks(Heads):
    """Prompt chunks of several sequences over one paged pool: (first position, rows) of each."""

    chunks: tuple[tuple[int, int], ...]
    block_rows: int = 16

    def __str__(self) -> str:
        shape = "+".join(f"{p}:{t}" for p, t in self.chunks)
        return f"{shape}-br{self.block_rows}-{super().__str__()}"


def check_paged(c: Chunks, kt: str, vt: str, seed: int = 0) -> torch.Tensor:
    """`paged_prefill_attention` over every chunk of `c` at once, each sequence's blocks scattered over
    the pool in random order, against the reference over that sequence's rows gathered."""
    g = torch.Generator().manual_seed(seed)
    br = c.block_rows
    spans = [-(-(p + t) // br) for p, t in c.chunks]  # blocks each sequence holds
    order = torch.randperm(sum(spans) + 3, generator=g)  # three blocks nobody holds
    ends = torch.tensor(spans).cumsum(0).tolist()
    blocks = [order[a - n : a].tolist() for n, a in zip(spans, ends, strict=True)]
    n_rows = len(order) * br
    k, v = (torch.randn(n_rows, c.n_head_kv, c.d, generator=g) for _ in range(2))
    (kc, kf), (vc, vf) = cache_rows(kt, k), cache_rows(vt, v)
    tables = torch.tensor([b + [0] * (max(spans) - len(b)) for b in blocks], dtype=torch.int32)
    q = torch.randn(sum(t for _, t in c.chunks), c.n_head, c.d, generator=g)
    positions = torch.cat([torch.arange(p, p + t) for p, t in c.chunks])
    starts = torch.tensor([0, *torch.tensor([t for _, t in c.chunks]).cumsum(0).tolist()], dtype=torch.int32)
    types = None if kt in FLOATS and vt in FLOATS else (qtype(kt), qtype(vt))
    out = kernel.paged_prefill_attention(
        q.to(DEVICE), kc, vc, positions.to(DEVICE), starts.to(DEVICE), tables.to(DEVICE),
        max(t for _, t in c.chunks), block_rows=br, types=types, window=c.window, scale=c.scale,
        softcap=c.softcap,
    )  # fmt: skip
    assert out.shape == (q.shape[0], c.n_head * c.d) and out.dtype == q.dtype
    refs = []
    for j, (p, t) in enumerate(c.chunks):
        rows = (torch.tensor(blocks[j])[:, None] * br + torch.arange(br)).flatten()[: p + t]
        a = int(starts[j])
        mask = causal_mask(positions[a : a + t], p + t, c.window)
        refs.append(reference(q[a : a + t].to(DEVICE), kf[rows].to(DEVICE), vf[rows].to(DEVICE), mask,
                              c.scale, c.softcap))  # fmt: skip
    err = relative_error(out, torch.cat(refs))
    assert err < tolerance(kt), f"relative error {err:.2e}"
    return out


PAGED_CASES = [
    Chunks(chunks=((0, 37), (21, 5), (53, 1), (40, 20))),  # first and later chunks, one of a single row
    Chunks(chunks=((0, 3), (70, 33)), n_head=6, n_head_kv=2),  # groups of 3; one chunk many tiles long
    Chunks(chunks=((30, 30), (0, 12), (77, 9)), window=10),  # a window narrower than a tile
    Chunks(chunks=((19, 40), (0, 40)), window=33, block_rows=8),  # unmasked blocks inside the window
    Chunks(chunks=((5, 19), (40, 2)), n_head=4, n_head_kv=4, softcap=2.0, scale=0.3),
    Chunks(chunks=((24, 9), (0, 33)), n_head=4, n_head_kv=1, d=256, window=12, softcap=30.0),  # Gemma's shape
]


@pytest.mark.parametrize("case", PAGED_CASES, ids=str)
def test_paged_chunks_shapes_and_masks(case: Chunks) -> None:
    check_paged(case, "F16", "F16")


@pytest.mark.parametrize(
    ("kt", "vt"), [("F32", "F32"), ("BF16", "BF16"), ("Q8_0", "Q4_0"), ("Q5_1", "IQ4_NL"), ("F16", "Q5_0")],
    ids=lambda p: p,
)  # fmt: skip
def test_paged_chunks_read_every_cache_type(kt: str, vt: str) -> None:
    check_paged(Chunks(chunks=((0, 21), (30, 23))), kt, vt)


# --- through ops.cached_attention: the cache's writer, positions, a ring ---------------------------


@dataclass(frozen=True)
class Step:
    p0: int  # the chunk's first position
    t: int
    rows: int  # the cache's rows: fewer than p0 + t, a ring that has wrapped
    window: int | None = None

    def __str__(self) -> str:
        return f"p{self.p0}+{self.t}-rows{self.rows}" + (f"-w{self.window}" if self.window else "")


STEPS = [Step(0, 20, 64), Step(33, 20, 64), Step(50, 20, 40, window=16)]


def writer_step(kt: str, vt: str, s: Step, prefill: str, seed: int = 0):
    """One prompt chunk through `cached_attention` over a cache holding positions 0..p0-1 already:
    (output, the cache's rows after the write as float64, its key positions)."""
    n_head, n_kv, d = 4, 2, 64
    g = torch.Generator().manual_seed(seed)
    history, chunk = (torch.randn(n, n_kv, d, generator=g) for n in (s.p0 + s.t, s.t))
    q = torch.randn(s.t, n_head, d, generator=g)
    types = (qtype(kt), qtype(vt))
    kc, vc = (torch.zeros(s.rows, n_kv, d) for _ in range(2))
    kc, vc = cache_rows(kt, kc)[0], cache_rows(vt, vc)[0]
    kernels = AttentionKernels(prefill=prefill)
    if s.p0:  # the history: the positions a ring still holds, as earlier steps stored them
        held = torch.arange(max(0, s.p0 - s.rows), s.p0)
        before = LayerWriter(kc, vc, held.to(DEVICE), s.p0, kernels, types)
        before(history[held].to(DEVICE), history[held].flip(-1).to(DEVICE))
    positions = torch.arange(s.p0, s.p0 + s.t, device=DEVICE)
    n_read = s.p0 + s.t
    blocks = not (kt in FLOATS and vt in FLOATS)
    cache = (BlockWriter if blocks else LayerWriter)(
        kc, vc, positions, n_read, kernels, types if blocks else None
    )
    mask = causal_mask(positions, min(n_read, s.rows), s.window)
    k, v = chunk.to(DEVICE), (chunk * 0.5).to(DEVICE)
    out = cached_attention(q.to(DEVICE), k, v, cache, mask, s.window, 0.2, None)
    key_positions = cache.key_positions()
    if key_positions is None:
        key_positions = torch.arange(n_read, device=DEVICE)
    rows_k = kc if kt in FLOATS else cache_rows_read(kc, kt)
    rows_v = vc if vt in FLOATS else cache_rows_read(vc, vt)
    return out, q, rows_k.double()[: s.rows], rows_v.double()[: s.rows], positions, key_positions


def cache_rows_read(rows: torch.Tensor, name: str) -> torch.Tensor:
    n, n_kv = rows.shape[:2]
    rows = kv_layout.gguf_rows(rows, qtype(name))
    return dequantize(rows.reshape(n * n_kv, -1), qtype(name)).reshape(n, n_kv, -1)


@pytest.mark.parametrize(("kt", "vt"), [("F16", "F16"), ("Q8_0", "Q4_0")], ids=lambda p: p)
@pytest.mark.parametrize("step", STEPS, ids=str)
def test_cached_attention_takes_the_kernel(kt, vt, step, monkeypatch) -> None:
    calls = []
    real = kernel.prefill_attention
    monkeypatch.setattr(kernel, "prefill_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out, q, k, v, positions, key_positions = writer_step(kt, vt, step, "on")
    assert calls == [1]
    mask = ring_mask(positions, key_positions, step.window)[:, : k.shape[0]]
    ref = reference(q, k[: mask.shape[1]], v[: mask.shape[1]], mask, 0.2, None)
    err = relative_error(out, ref)
    assert err < tolerance(kt), f"relative error {err:.2e}"
    if DEVICE == "cpu":  # and as the path before the kernel attends ("off": the CPU's)
        off, *_ = writer_step(kt, vt, step, "off")
        assert relative_error(out, off.double()) < 1e-5


def test_the_cpu_keeps_its_path_unless_asked(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(kernel, "prefill_attention", lambda *a, **kw: calls.append(1))
    writer_step("F16", "F16", STEPS[1], "auto")
    assert calls == ([1] if DEVICE == "cuda" else [])


# --- GPU: the model shapes, the GPU's tiles ----------------------------------------------------------

LLAMA3 = {"n_head": 32, "n_head_kv": 8, "d": 128}


@pytest.mark.gpu
@pytest.mark.parametrize("kt", ["F16", "BF16", "F32", "Q8_0", "Q4_0"])
@pytest.mark.parametrize(("t", "n_read"), [(512, 512), (512, 4096), (300, 1000)])
def test_gpu_llama3_shape(kt: str, t: int, n_read: int) -> None:
    out = check_kernel(Case(t=t, n_read=n_read, scale=128**-0.5, **LLAMA3), kt, kt)
    if kt not in FLOATS:  # 512 queries of 4 heads a KV head convert the rows first: as the tiles would
        tiles = check_kernel(Case(t=t, n_read=n_read, scale=128**-0.5, **LLAMA3), kt, kt, first=False)
        assert torch.equal(out, tiles)


@pytest.mark.gpu
@pytest.mark.parametrize(("kt", "vt"), [("F16", "F16"), ("Q8_0", "Q8_0"), ("BF16", "Q4_1"), ("F32", "F32")])
@pytest.mark.parametrize(("t", "n_read"), [(512, 512), (512, 2000)])
def test_gpu_gemma3_shape(kt: str, vt: str, t: int, n_read: int) -> None:
    case = Case(t=t, n_read=n_read, n_head=4, n_head_kv=1, d=256, window=512, scale=256**-0.5)
    check_kernel(case, kt, vt)
    check_kernel(Case(t=t, n_read=n_read, n_head=8, n_head_kv=4, d=256, softcap=50.0), kt, vt)


@pytest.mark.gpu
@pytest.mark.parametrize(("kt", "vt"), [("F16", "F16"), ("Q8_0", "Q4_0")], ids=lambda p: p)
@pytest.mark.parametrize("step", [*STEPS, Step(600, 128, 700, window=512)], ids=str)
def test_gpu_cached_attention_takes_the_kernel(kt, vt, step, monkeypatch) -> None:
    test_cached_attention_takes_the_kernel(kt, vt, step, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize(("kt", "vt"), [("F16", "F16"), ("BF16", "BF16"), ("Q8_0", "Q8_0"), ("Q4_0", "Q8_0")])
def test_gpu_paged_chunks_llama3_shape(kt: str, vt: str) -> None:
    """A server's step: prompt chunks of 128 to 512 rows, one long history, beside a single row."""
    chunks = ((0, 128), (384, 128), (0, 512), (1500, 300), (700, 1), (128, 77))
    check_paged(Chunks(chunks=chunks, scale=128**-0.5, **LLAMA3), kt, vt)


@pytest.mark.gpu
def test_gpu_paged_chunks_gemma3_shape() -> None:
    chunks = ((0, 300), (600, 200), (1000, 64))
    check_paged(
        Chunks(chunks=chunks, n_head=4, n_head_kv=1, d=256, window=512, scale=256**-0.5), "Q8_0", "F16"
    )
