"""The decode tokens of a batch in one Triton launch (and its combine) over the paged cache
(`kernels.decode_attention.paged_decode_attention`, reached through `runtime.paged.DecodeTokens`),
against the path each sequence took alone before it (RoPE in torch, `store_rows`, its rows gathered,
`cached_attention` with the fused kernels off), against the single-sequence Triton kernel over each
sequence's rows gathered into a contiguous cache, and against float64 attention over the pools it
leaves. Ragged lengths (one sequence long enough for several splits, one at its first position),
blocks handed out in a shuffled pool order, full blocks shared through the prefix cache, sliding
windows, a softcap, partial rotation, GQA groups of 1 and 4, float and block cache types.

Without CUDA the kernel runs on CPU tensors under TRITON_INTERPRET=1 (conftest sets it), attending in
float32 as the eager path does: 1e-5 of the output's norm against it and against float64 (the
pools' own rounding aside). The stored rows: bit for bit the single-sequence kernel's, and as the
eager path stores them (block types bit for bit, floats to a step of their dtype: the rotation's
sums may round in another order). The `gpu` tests take Llama-3-8B's attention shape (32 heads, 8 KV
heads, D = 128) for 1 to 64 sequences, also replayed from a CUDA graph.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from hadamard_reference import hadamard_blocks  # noqa: E402
from paged_sequences import ragged_tables  # noqa: E402
from references import GPU_BATCH_TOLERANCE, greedy_alone  # noqa: E402
from tiny_models import random_prompt, write_tiny  # noqa: E402

import llmx  # noqa: E402
from llmx.kernels import decode_attention, prefill_attention  # noqa: E402
from llmx.ops import Rope  # noqa: E402
from llmx.ops.cached_attention import AttentionKernels, cached_attention  # noqa: E402
from llmx.ops.hadamard import kv_rotation, rotate  # noqa: E402
from llmx.ops.masks import causal_mask  # noqa: E402
from llmx.quant import kv_layout, qtype  # noqa: E402
from llmx.quant.quantize import quantize  # noqa: E402
from llmx.quant.torch_ops import dequantize  # noqa: E402
from llmx.runtime.batch import Chunk, forward_batch  # noqa: E402
from llmx.runtime.blocks import BlockPool, BlockTable  # noqa: E402
from llmx.runtime.paged import PagedKVCache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Tests whose CPU tensors meet the Triton kernels forced "on": only the interpreter takes them, which a
# machine with CUDA does not run (TRITON_INTERPRET is read once, at import); the `gpu` tests cover it there.
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors for Triton: interpreted only")
ROWS, N_BLOCKS, SEQ_BLOCKS = 16, 24, 12
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
OFF, ON = AttentionKernels(decode="off"), AttentionKernels(decode="on")
pytestmark = pytest.mark.usefixtures("grouped_caches")  # block caches as the kernels read them


@dataclass(frozen=True)
class Case:
    kt: str
    vt: str
    n_head: int
    n_kv: int
    d: int
    n_dims: int
    neox: bool
    window: int | None = None
    softcap: float | None = None

    def __str__(self) -> str:
        extra = "".join(f"-{k}{v}" for k, v in (("w", self.window), ("cap", self.softcap)) if v)
        rope = f"{'neox' if self.neox else 'pairs'}{self.n_dims}of{self.d}"
        return f"{self.kt}-{self.vt}-h{self.n_head}kv{self.n_kv}-{rope}{extra}"

    @property
    def types(self):
        return None if self.kt in FLOATS and self.vt in FLOATS else (qtype(self.kt), qtype(self.vt))


CASES = [
    Case("F16", "F16", 8, 2, 64, 64, False),  # groups of 4
    Case("Q8_0", "Q8_0", 4, 4, 64, 64, True, window=20),  # groups of 1; the window cuts shared blocks
    Case("Q4_0", "Q8_0", 8, 2, 64, 32, True, softcap=20.0),  # half the dims rotate
    Case("F32", "F32", 4, 4, 32, 32, False, window=40, softcap=5.0),
    Case("Q4_1", "Q5_0", 8, 2, 64, 64, False),
    Case("F16", "Q5_1", 4, 1, 64, 64, True, window=70),  # the window spans two splits of the long one
    Case("F16", "F16", 4, 2, 40, 24, True),  # heads narrower than their tile
]


def pool(c: Case, name: str, seed: int) -> torch.Tensor:
    """A pool [N_BLOCKS * ROWS, Hk, row] of random rows in cache type `name`."""
    x = torch.randn(N_BLOCKS * ROWS, c.n_kv, c.d, generator=torch.Generator().manual_seed(seed))
    if name in FLOATS:
        return x.to(FLOATS[name])
    return kv_layout.stored(quantize(x, qtype(name)), qtype(name), torch.device("cpu"))


def shuffle(blocks: BlockPool, seed: int) -> None:
    """Make `blocks` hand its blocks out in a random order: each taken alone, released shuffled."""
    singles = [BlockTable() for _ in range(blocks.n_blocks)]
    for t in singles:
        blocks.reserve(t, 1)
    random.Random(seed).shuffle(singles)
    for t in singles:
        blocks.free(t)


def setup(c: Case, kernels: AttentionKernels) -> tuple[PagedKVCache, list[BlockTable]]:
    paged = PagedKVCache(
        [pool(c, c.kt, 1)], [pool(c, c.vt, 2)], c.types, kernels, n_seq=N_BLOCKS // SEQ_BLOCKS,
        seq_ctx=SEQ_BLOCKS * ROWS, block_rows=ROWS,
    )  # fmt: skip
    shuffle(paged.blocks, seed=7)
    ts = ragged_tables(paged.blocks)
    every = [b for t in ts for b in t.blocks]
    assert every != sorted(every), "the blocks lie in pool order"
    return paged, ts


def step_inputs(c: Case, rope: Rope, positions: torch.Tensor):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(positions), c.n_head, c.d, generator=g) * 3  # peaked scores: the softmax matters
    k, v = (torch.randn(len(positions), c.n_kv, c.d, generator=g) for _ in range(2))
    cos, sin = rope.tables(positions, int(positions.max()) + 1)
    return q, k, v, cos, sin


def batched(c: Case, paged: PagedKVCache, ts: list[BlockTable], rope: Rope) -> torch.Tensor:
    positions = torch.tensor([t.length for t in ts])
    q, k, v, cos, sin = step_inputs(c, rope, positions)
    tokens = paged.decode(0, paged.tables(ts), positions)
    out = tokens.rope_store_attend(q, k, v, rope, cos, sin, c.window, None, c.softcap)
    assert out is not None, "the Triton kernel did not take the step"
    return out


def one_by_one(c: Case, paged: PagedKVCache, ts: list[BlockTable], rope: Rope) -> torch.Tensor:
    """What forward_batch did before, sequence by sequence, over the eager ops (the pool's rotation
    as `ops.rope_attention` makes it)."""
    positions = torch.tensor([t.length for t in ts])
    q, k, v, cos, sin = step_inputs(c, rope, positions)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    rot_k, rot_v = paged.rotation[0]
    q, k, v = rotate(q, rot_k), rotate(k, rot_k), rotate(v, rot_v)
    outs = []
    for b, t in enumerate(ts):
        pos = positions[b : b + 1]
        rows = paged.rows(t, t.length + 1, torch.device("cpu"))
        view = paged.layer(0, pos, rows[t.length :], rows)
        mask = causal_mask(pos, t.length + 1, c.window) if c.window else None
        outs.append(
            cached_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], view, mask, c.window, None, c.softcap)
        )
    return rotate(torch.cat(outs), rot_v)


def single_kernel(c: Case, pools: tuple[torch.Tensor, torch.Tensor], ts: list[BlockTable], rope: Rope):
    """The single-sequence Triton kernel, each sequence over its rows of `pools` (as the batched call
    found them) gathered into a contiguous cache: the outputs, and the key and value rows it stored."""
    positions = torch.tensor([t.length for t in ts])
    q, k, v, cos, sin = step_inputs(c, rope, positions)
    outs, stored = [], []
    rotation = kv_rotation(c.types, (c.d, c.d), pools[0].device) if c.types else (0, 0)
    for b, t in enumerate(ts):
        rows = torch.tensor([blk * ROWS + r for blk in t.blocks for r in range(ROWS)])[: t.length + 1]
        kc, vc = pools[0][rows].clone(), pools[1][rows].clone()
        outs.append(decode_attention.decode_attention(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], cos[b : b + 1], sin[b : b + 1], kc, vc,
            positions[b : b + 1], t.length + 1, n_dims=c.n_dims, neox=c.neox, softcap=c.softcap,
            window=c.window, types=c.types, rotation=rotation,
        ))  # fmt: skip
        stored.append((kc[t.length], vc[t.length]))
    return torch.cat(outs), stored


def float64_reference(c: Case, paged: PagedKVCache, ts: list[BlockTable], rope: Rope) -> torch.Tensor:
    """Attention in float64 over the pools as the call left them, each sequence's rows gathered: q
    rotated as the pools' keys are, the output back as their values are."""
    positions = torch.tensor([t.length for t in ts])
    q, _, _, cos, sin = step_inputs(c, rope, positions)
    rot_k, rot_v = paged.rotation[0]
    q = hadamard_blocks(rope.apply(q, cos, sin).double(), rot_k)
    types = c.types or (qtype(c.kt), qtype(c.vt))
    k, v = (dequantize(kv_layout.gguf_rows(p, qt).reshape(p.shape[0] * c.n_kv, -1), qt)
            .reshape(p.shape[0], c.n_kv, c.d).double()
            for p, qt in zip((paged.k[0], paged.v[0]), types, strict=True))  # fmt: skip
    outs = []
    for b, t in enumerate(ts):
        rows = paged.rows(t, t.length + 1, torch.device("cpu"))
        if c.window:
            rows = rows[max(0, t.length + 1 - c.window) :]
        kb, vb = (x[rows].repeat_interleave(c.n_head // c.n_kv, dim=1) for x in (k, v))  # [N, H, D]
        scores = torch.einsum("hd,nhd->hn", q[b], kb) / c.d**0.5
        if c.softcap:
            scores = c.softcap * torch.tanh(scores / c.softcap)
        outs.append(torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), vb).reshape(1, -1))
    return hadamard_blocks(torch.cat(outs), rot_v)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def assert_row(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    if ours.is_floating_point():
        eps = torch.finfo(ours.dtype).eps
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=eps, atol=1e-6)
    else:
        assert torch.equal(ours, theirs)


@interpreted
@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_batchs_decode_tokens_in_one_launch_match_each_alone(case: Case) -> None:
    rope = Rope(case.n_dims, 10000.0, case.neox)
    paged, ts = setup(case, ON)
    before = paged.k[0].clone(), paged.v[0].clone()
    twin = PagedKVCache([before[0].clone()], [before[1].clone()], paged.types, OFF, 2, SEQ_BLOCKS * ROWS)
    out = batched(case, paged, ts, rope)
    want = one_by_one(case, twin, ts, rope)
    assert out.shape == (len(ts), case.n_head * case.d) and out.dtype == torch.float32
    assert relative_error(out, want) < 1e-5
    assert relative_error(out, float64_reference(case, paged, ts, rope)) < 1e-5
    alone, alone_rows = single_kernel(case, before, ts, rope)
    assert relative_error(out, alone) < 1e-5
    # each token's row holds its key and value as both single-sequence paths stored them, and no other
    # row changed, the shared blocks included
    slots = torch.cat([paged.rows(t, t.length + 1, torch.device("cpu"))[-1:] for t in ts])
    others = torch.ones(paged.k[0].shape[0], dtype=torch.bool)
    others[slots] = False
    for i, (ours, theirs, old) in enumerate(zip(paged.k + paged.v, twin.k + twin.v, before, strict=True)):
        assert torch.equal(ours[others], old[others])
        assert_row(ours[slots], theirs[slots])
        assert torch.equal(ours[slots], torch.stack([r[i] for r in alone_rows]))


@interpreted
def test_a_sequence_in_a_batch_attends_as_in_a_batch_of_one() -> None:
    """Splits are chosen per launch (from B and the tables' width): a sequence's output does not
    depend on its batch but to float rounding."""
    c = CASES[0]
    rope = Rope(c.n_dims, 10000.0, c.neox)
    paged, ts = setup(c, ON)
    k0, v0 = paged.k[0].clone(), paged.v[0].clone()
    together = batched(c, paged, ts, rope)
    paged.k[0].copy_(k0)
    paged.v[0].copy_(v0)
    positions = torch.tensor([t.length for t in ts])
    q, k, v, cos, sin = step_inputs(c, rope, positions)
    alone = torch.cat([
        paged.decode(0, paged.tables([t]), positions[b : b + 1]).rope_store_attend(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], rope, cos[b : b + 1], sin[b : b + 1], None, None, None)
        for b, t in enumerate(ts)
    ])  # fmt: skip
    assert relative_error(together, alone) < 1e-6


def test_splits_fill_the_gpu_for_one_long_sequence_and_not_for_a_wide_batch() -> None:
    """`split_count` from B, Hk and the longest span, for the interpreter's 132 SMs (an H200's:
    256 programs)."""
    cpu = torch.device("cpu")
    assert decode_attention.split_count(1, 8, 32768, cpu) == 32  # 8 heads x 32 splits of 1024 keys
    assert decode_attention.split_count(1, 8, 100, cpu) == 2  # no chunk below a 64-key tile
    assert decode_attention.split_count(4, 8, 32768, cpu) == 8
    assert decode_attention.split_count(64, 8, 32768, cpu) == 1  # 512 programs already
    assert decode_attention.split_count(32, 1, 4096, cpu) == 8


@interpreted
def test_the_auto_kernels_keep_a_cpu_step_native(monkeypatch) -> None:
    """On the CPU only "on" takes the Triton kernel; "auto" keeps the native call, "off" neither."""
    calls: list[int] = []
    kernel = decode_attention.paged_decode_attention
    monkeypatch.setattr(
        decode_attention, "paged_decode_attention", lambda q, *a, **kw: calls.append(1) or kernel(q, *a, **kw)
    )
    c = CASES[0]
    rope = Rope(c.n_dims, 10000.0, c.neox)
    for kernels, taken in ((OFF, False), (AttentionKernels(), False), (ON, True)):
        paged, ts = setup(c, kernels)
        positions = torch.tensor([t.length for t in ts])
        q, k, v, cos, sin = step_inputs(c, rope, positions)
        out = paged.decode(0, paged.tables(ts), positions).rope_store_attend(
            q, k, v, rope, cos, sin, None, None, None
        )
        assert (out is not None) == (kernels != OFF) and bool(calls) == taken
        calls.clear()


# --- forward_batch on a tiny model: the decode rows take the kernel, each sequence gets its logits ---


def _alone(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """`references.greedy_alone` on the eager path (the fused kernels off)."""
    model.engine.executor.cache.kernels = OFF
    return greedy_alone(model, prompt, steps)


FORWARD_CASES = [("llama", "q8_0"), ("gemma3", "f16")]  # gemma3: windows, groups of 2, D 256


@interpreted
@pytest.mark.parametrize(("arch", "cache_type"), FORWARD_CASES)
def test_forward_batch_sends_its_decode_rows_to_one_launch_a_layer(arch, cache_type, tmp_path, monkeypatch):
    """Sequences decode beside one whose prompt joins in chunks: every step's decode tokens make one
    launch a layer (the chunk takes the eager path), and every sequence's logits are its own alone
    (the engine's with the fused kernels off)."""
    check_forward_batch(arch, cache_type, 0, ON, tmp_path, monkeypatch)


@interpreted
@pytest.mark.parametrize(("arch", "cache_type"), FORWARD_CASES)
def test_forward_batch_sends_its_prompt_chunks_to_one_launch_a_layer(arch, cache_type, tmp_path, monkeypatch):
    """With the flash kernel for prompts (as on a GPU), the prompt chunks of every sequence in a step
    make one more launch a layer (`PromptChunks`), and every sequence's logits are still its own."""
    check_forward_batch(
        arch, cache_type, 0, AttentionKernels(decode="on", prefill="on"), tmp_path, monkeypatch
    )


def check_forward_batch(arch, cache_type, n_gpu_layers, kernels, tmp_path, monkeypatch) -> None:
    steps, chunk = 3, 8
    model = llmx.load(write_tiny(arch, "Q8_0", tmp_path), ctx_size=256, n_gpu_layers=n_gpu_layers,
                      cache_type_k=cache_type, cache_type_v=cache_type)  # fmt: skip
    executor = model.engine.executor
    lengths = [5, 19, 1, 2 * chunk + 3]  # the last joins late, in three chunks; 19 outruns gemma3's window
    prompts = [random_prompt(n, seed) for seed, n in enumerate(lengths)]
    alone = [_alone(model, p, steps) for p in prompts]  # first: the pools below lie over the engine's cache
    paged = PagedKVCache.over(executor.cache, n_seq=4)
    paged.kernels = kernels
    calls: list[int] = []  # the decode tokens of each launch
    chunked: list[int] = []  # the prompt chunks of each launch
    kernel, prompt_kernel = decode_attention.paged_decode_attention, prefill_attention.paged_prefill_attention
    monkeypatch.setattr(
        decode_attention,
        "paged_decode_attention",
        lambda q, *a, **kw: calls.append(len(q)) or kernel(q, *a, **kw),
    )
    monkeypatch.setattr(
        prefill_attention,
        "paged_prefill_attention",
        lambda q, k, v, positions, starts, *a, **kw: (
            chunked.append(len(starts) - 1) or prompt_kernel(q, k, v, positions, starts, *a, **kw)
        ),
    )
    one_launch = kernels.prefill == "on" or (kernels.prefill == "auto" and n_gpu_layers == "all" and
                                             torch.cuda.is_available())  # fmt: skip
    tables = [BlockTable() for _ in prompts]
    early, late = range(len(prompts) - 1), len(prompts) - 1
    got = {}
    out = forward_batch(executor, paged, [Chunk(tables[j], prompts[j]) for j in early])
    assert calls == [1] * model.config.n_layer  # the prompt of one token is a decode-shaped row
    assert chunked == ([2] * model.config.n_layer if one_launch else [])
    calls.clear()
    chunked.clear()
    got |= {(j, 0): out[j] for j in early}
    done = 0
    for s in range(steps):
        chunks = [Chunk(tables[j], [alone[j][0][s]]) for j in early]
        piece = prompts[late][done : done + chunk]
        done += len(piece)
        chunks.append(Chunk(tables[late], piece, logits=done == lengths[late]))
        out = forward_batch(executor, paged, chunks)
        assert calls == [len(early)] * model.config.n_layer
        assert chunked == ([1] * model.config.n_layer if one_launch else [])
        calls.clear()
        chunked.clear()
        got |= {(j, s + 1): out[j] for j in early}
    got[late, 0] = out[-1]
    tolerance = GPU_BATCH_TOLERANCE if n_gpu_layers == "all" and torch.cuda.is_available() else 5e-3
    for (j, s), logits in got.items():
        want = alone[j][1][s]
        torch.testing.assert_close(logits, want, atol=tolerance * want.abs().max().item(), rtol=0)


# --- GPU: Llama-3-8B's attention shape, 1 to 64 sequences -----------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("arch", "cache_type"), FORWARD_CASES)
def test_gpu_forward_batch_takes_the_kernel_by_default(arch, cache_type, tmp_path, monkeypatch):
    """On a GPU the default kernels ("auto") send the decode rows to the launch."""
    check_forward_batch(arch, cache_type, "all", AttentionKernels(), tmp_path, monkeypatch)


LLAMA3 = dict(n_head=32, n_kv=8, d=128, n_dims=128, neox=False)
GPU_TOL = {"F16": 5e-3, "BF16": 2e-2, "F32": 1e-5, "Q8_0": 5e-3, "Q4_0": 5e-3}


def gpu_pools(c: Case, n_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pools of `n_blocks` blocks on the GPU in the case's cache types: 64 blocks of random
    rows, repeated (quantizing 32K rows on the CPU would take longer than the test)."""
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(64 * ROWS, c.n_kv, c.d, generator=g) for _ in range(2)]
    pools = (t.to(DEVICE, FLOATS[n]) if n in FLOATS else kv_layout.stored(quantize(t, qtype(n)).to(DEVICE),
             qtype(n), DEVICE) for t, n in zip(x, (c.kt, c.vt), strict=True))  # fmt: skip
    return tuple(p.repeat(-(-n_blocks // 64), 1, 1)[: n_blocks * ROWS].contiguous() for p in pools)  # type: ignore[return-value]


def gpu_step(c: Case, blocks: BlockPool, lengths: list[int], seed: int):
    """Tables of `lengths` positions (and the decode token's) taken from `blocks` in a shuffled
    order, and one decode step's inputs on the GPU: (the tables, positions, rope, (q, k, v, cos, sin))."""
    shuffle(blocks, seed)
    ts = []
    for n in lengths:
        t = BlockTable()
        blocks.reserve(t, n + 1)
        t.length = n
        ts.append(t)
    positions = torch.tensor(lengths, device=DEVICE)
    rope = Rope(c.n_dims, 500000.0, c.neox)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lengths), c.n_head, c.d, generator=g)
    k, v = (torch.randn(len(lengths), c.n_kv, c.d, generator=g) for _ in range(2))
    cos, sin = rope.tables(positions, int(positions.max()) + 1)
    return ts, positions, rope, (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cos, sin)


def gpu_eager(c: Case, paged: PagedKVCache, ts, rope, inputs, positions) -> torch.Tensor:
    """Each sequence alone on the eager path (fused kernels off), over `paged`'s pools (rotated as
    `ops.rope_attention` rotates them)."""
    q, k, v, cos, sin = inputs
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    rot_k, rot_v = paged.rotation[0]
    q, k, v = rotate(q, rot_k), rotate(k, rot_k), rotate(v, rot_v)
    outs = []
    for b, t in enumerate(ts):
        rows = paged.rows(t, t.length + 1, torch.device(DEVICE))
        view = paged.layer(0, positions[b : b + 1], rows[t.length :], rows)
        mask = causal_mask(positions[b : b + 1], t.length + 1, c.window) if c.window else None
        outs.append(
            cached_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], view, mask, c.window, None, c.softcap)
        )
    return rotate(torch.cat(outs), rot_v)


def gpu_cache(c: Case, n_blocks: int, seq_ctx: int, kernels: AttentionKernels, seed: int = 0) -> PagedKVCache:
    k, v = gpu_pools(c, n_blocks, seed)
    return PagedKVCache([k], [v], c.types, kernels, n_blocks * ROWS // seq_ctx, seq_ctx, block_rows=ROWS)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lengths", [[32767], [5, 900, 4096, 77], [100 + 37 * i for i in range(64)]],
                         ids=["one-32k", "four-ragged-window", "sixty-four"])  # fmt: skip
@pytest.mark.parametrize(
    "types", [("F16", "F16"), ("BF16", "BF16"), ("Q8_0", "Q8_0"), ("Q4_0", "Q8_0")], ids=str
)
def test_gpu_llama3_batches(lengths: list[int], types: tuple[str, str]) -> None:
    c = Case(*types, **LLAMA3, window=4096 if len(lengths) == 4 else None)
    seq_ctx = -(-(max(lengths) + 1) // ROWS) * ROWS
    paged = gpu_cache(c, len(lengths) * seq_ctx // ROWS, seq_ctx, AttentionKernels())
    ts, positions, rope, inputs = gpu_step(c, paged.blocks, lengths, seed=1)
    twin = PagedKVCache([paged.k[0].clone()], [paged.v[0].clone()], paged.types, OFF, paged.n_seq, seq_ctx)
    tokens = paged.decode(0, paged.tables(ts).to(DEVICE), positions)
    out = tokens.rope_store_attend(*inputs[:3], rope, *inputs[3:], c.window, None, c.softcap)
    assert out is not None and out.shape == (len(lengths), c.n_head * c.d)
    want = gpu_eager(c, twin, ts, rope, inputs, positions)
    err = relative_error(out, want)
    assert err < GPU_TOL[c.kt], f"relative error {err:.2e}"
    slots = torch.cat([paged.rows(t, t.length + 1, torch.device(DEVICE))[-1:] for t in ts])
    for ours, theirs in zip(paged.k + paged.v, twin.k + twin.v, strict=True):
        if ours.is_floating_point():
            torch.testing.assert_close(ours[slots].float(), theirs[slots].float(), rtol=1e-2, atol=1e-6)
        else:  # the kernel's and torch's float32 RoPE may round a value across a code's boundary
            assert (ours[slots] != theirs[slots]).float().mean() < 1e-2


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replays_for_other_positions_and_tables() -> None:
    """One capture for B = 8 and tables 64 blocks wide serves every position and table that fits:
    the step's inputs, tables and positions are copied into the captured buffers."""
    c = Case("F16", "F16", **LLAMA3)
    seq_ctx = 64 * ROWS
    paged = gpu_cache(c, 8 * 64, seq_ctx, AttentionKernels())
    ts, positions, rope, inputs = gpu_step(c, paged.blocks, [seq_ctx - 1] * 8, seed=1)
    tables = paged.tables(ts).to(DEVICE)
    tokens = paged.decode(0, tables, positions)
    tokens.rope_store_attend(*inputs[:3], rope, *inputs[3:], None, None, None)  # compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tokens.rope_store_attend(*inputs[:3], rope, *inputs[3:], None, None, None)
    for seed, lengths in enumerate(([3, 700, 1000, 16, 17, 0, 512, 64], [seq_ctx - 1] * 8), start=2):
        for t in ts:
            paged.blocks.free(t)
        ts, new_positions, _, new_inputs = gpu_step(c, paged.blocks, lengths, seed)
        twin = PagedKVCache([paged.k[0].clone()], [paged.v[0].clone()], None, OFF, 8, seq_ctx)
        want = gpu_eager(c, twin, ts, rope, new_inputs, new_positions)
        new_tables = paged.tables(ts)
        tables.zero_()
        tables[:, : new_tables.shape[1]].copy_(new_tables)
        positions.copy_(new_positions)
        for static, new in zip(inputs, new_inputs, strict=True):
            static.copy_(new)
        graph.replay()
        assert relative_error(out, want) < GPU_TOL["F16"]
        slots = torch.cat([paged.rows(t, t.length + 1, torch.device(DEVICE))[-1:] for t in ts])
        torch.testing.assert_close(paged.k[0][slots].float(), twin.k[0][slots].float(), rtol=1e-2, atol=1e-6)
