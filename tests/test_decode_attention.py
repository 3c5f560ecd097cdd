"""The fused decode attention (`llmx.kernels.decode_attention`) against the eager path it replaces
(`Rope.apply`, the cache writer's `index_copy_`, `ops.attention`), both reached through
`ops.rope_attention` over a cache whose `AttentionKernels` decode "on" and "off".

Without CUDA the kernel runs on CPU tensors under TRITON_INTERPRET=1 (set here before triton is
first imported) with small shapes that still take several splits, sliding windows that cut through
them, and CUDA-graph buckets (n_read past pos, with stale rows in the tail that must stay unseen).
The `gpu` tests take Llama-3-8B's attention shape (32 heads, 8 KV heads, D = 128), also replayed
from a CUDA graph.

Tolerances on the output, as ||fused - eager|| / ||eager||:
- interpreter, f32/f16 cache: 1e-5 (both attend in float32 over the same cache rows);
- interpreter, bf16 cache: 1e-2, because the interpreter truncates float32 to bf16 where torch and
  the GPU round, so this step's key and value may sit one bf16 step apart;
- GPU: f32 1e-5; f16 5e-3 and bf16 2e-2, where both paths round q and the softmax weights to the
  cache's dtype for the tensor cores, in different places.
The written cache row equals eager's within one step of the cache's dtype (float32 RoPE sums may
round differently); every other row is untouched, bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from tiny_models import greedy_steps, random_prompt, write_tiny  # noqa: E402

import llmx  # noqa: E402
from llmx import ops  # noqa: E402
from llmx.ops import Rope, causal_mask  # noqa: E402
from llmx.ops.cached_attention import AttentionKernels  # noqa: E402
from llmx.runtime.cache import LayerWriter  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: 1e-5, F16: 5e-3, BF16: 2e-2} if DEVICE == "cuda" else {F32: 1e-5, F16: 1e-5, BF16: 1e-2}


@dataclass(frozen=True)
class Case:
    n_head: int
    n_head_kv: int
    head_dim: int
    n_dims: int  # rotated dims of each head
    neox: bool
    dtype: torch.dtype  # the cache's
    pos: int
    n_read: int
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    n_ctx: int = 160

    def __str__(self) -> str:
        rope = f"{'neox' if self.neox else 'pairs'}{self.n_dims}of{self.head_dim}"
        extra = "".join(
            f"-{k}{v}" for k, v in (("w", self.window), ("cap", self.softcap), ("s", self.scale)) if v
        )
        heads = f"h{self.n_head}kv{self.n_head_kv}"
        return f"{heads}-{rope}-{str(self.dtype)[6:]}-pos{self.pos}of{self.n_read}{extra}"


# Chunks are 64 keys (BLOCK_N), so n_read 160 takes three splits and 128 exactly two.
CASES = [
    Case(4, 2, 32, 32, True, F32, pos=37, n_read=38),  # decoding over exactly its past
    Case(4, 2, 32, 32, False, F16, pos=100, n_read=160),  # graph bucket: masked tail of stale rows
    Case(6, 2, 40, 24, True, F16, pos=159, n_read=160, softcap=30.0, scale=0.1),  # last row, partial
    Case(2, 2, 32, 16, False, BF16, pos=0, n_read=1),  # first token, no grouping, partial
    Case(4, 1, 32, 32, True, F16, pos=130, n_read=160, window=50),  # window over two chunks
    Case(4, 2, 32, 32, False, F32, pos=150, n_read=160, window=8, softcap=5.0),
    Case(2, 2, 32, 32, True, BF16, pos=64, n_read=128, window=64, softcap=20.0),  # window = one chunk
    Case(8, 1, 32, 32, False, F32, pos=5, n_read=160, window=200),  # window wider than the context
    Case(4, 2, 32, 32, True, F16, pos=127, n_read=128),  # two full chunks
    Case(4, 2, 32, 32, False, F32, pos=63, n_read=160),  # pos at a chunk's end
    Case(6, 2, 32, 32, True, F16, pos=690, n_read=704, n_ctx=704),  # 11 splits
]


def random_step(c: Case, seed: int = 0):
    """q, k, v [1, heads, D] and cache buffers full of stale random rows, on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, c.n_head, c.head_dim, generator=g)
    k, v = (torch.randn(1, c.n_head_kv, c.head_dim, generator=g) for _ in range(2))
    kc, vc = (torch.randn(c.n_ctx, c.n_head_kv, c.head_dim, generator=g).to(c.dtype) for _ in range(2))
    return tuple(t.to(DEVICE) for t in (q, k, v, kc, vc))


def run(c: Case, mode: str, q, k, v, kc, vc, norms: ops.HeadNorms | None = None) -> torch.Tensor:
    """`ops.rope_attention` as `Model.self_attention` calls it, writing into kc, vc, with the fused
    decode kernels `mode`."""
    rope = Rope(c.n_dims, 10000.0, c.neox)
    positions = torch.tensor([c.pos], device=DEVICE)
    cos, sin = rope.tables(positions, c.n_read)
    mask = causal_mask(positions, c.n_read, c.window)
    cache = LayerWriter(kc, vc, positions, c.n_read, AttentionKernels(decode=mode))
    return ops.rope_attention(q, k, v, rope, cos, sin, cache, mask, c.window, c.scale, c.softcap, norms)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check(c: Case, seed: int = 0, norms: ops.HeadNorms | None = None) -> None:
    q, k, v, kc0, vc0 = random_step(c, seed)
    ref_k, ref_v = kc0.clone(), vc0.clone()
    ref = run(c, "off", q, k, v, ref_k, ref_v, norms)
    out_k, out_v = kc0.clone(), vc0.clone()
    out = run(c, "on", q, k, v, out_k, out_v, norms)

    assert out.shape == (1, c.n_head * c.head_dim) and out.dtype == q.dtype
    err = relative_error(out, ref)
    assert err < TOL[c.dtype], f"relative error {err:.2e}"
    for fused, eager, before in ((out_k, ref_k, kc0), (out_v, ref_v, vc0)):
        others = torch.arange(c.n_ctx, device=DEVICE) != c.pos
        assert torch.equal(fused[others], before[others]), "rows other than pos changed"
        eps = torch.finfo(c.dtype).eps
        torch.testing.assert_close(fused[c.pos].float(), eager[c.pos].float(), rtol=eps, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fused_matches_eager(case: Case) -> None:
    check(case)


def test_combine_merges_the_splits_a_few_at_a_time(monkeypatch) -> None:
    """11 splits merged 4 a step (three steps, the last partial), as a long context's 256 are 32 a step."""
    from llmx.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "MERGE_SPLITS", 4)
    check(CASES[-1])


# Fewer programs than tiles (a long context's shape): each chunk's key loop takes several tiles, its
# last one partial and holding pos in pos's chunk (the other tests' chunks are one tile each).
SEVERAL_TILES = [
    (Case(4, 2, 32, 32, False, F16, pos=300, n_read=400, n_ctx=400), 2),  # two splits: 3 tiles, 2
    (Case(4, 1, 32, 32, True, F32, pos=350, n_read=400, window=300, n_ctx=400), 1),  # one split: 5 tiles
    (Case(6, 2, 40, 24, True, F16, pos=255, n_read=256, softcap=30.0, n_ctx=256), 1),  # 4 whole tiles
]


@pytest.mark.parametrize(("case", "splits"), SEVERAL_TILES, ids=str)
def test_chunks_of_several_tiles(case: Case, splits: int, monkeypatch) -> None:
    from llmx.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "target_programs", lambda device: splits * case.n_head_kv)
    check(case)


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]], ids=str)
@pytest.mark.parametrize("which", ["q and k", "q", "k"])
def test_fused_applies_the_head_norms_before_rope(case: Case, which: str) -> None:
    """Qwen3's and Gemma 3's per-head q/k RMSNorm inside the kernel, as the eager path applies it
    before RoPE (`ops.HeadNorms`): one head norm or both."""
    g = torch.Generator().manual_seed(11)
    weights = [(torch.rand(case.head_dim, generator=g) + 0.5).to(DEVICE) for _ in range(2)]
    q_weight = weights[0] if "q" in which else None
    k_weight = weights[1] if "k" in which else None
    check(case, norms=ops.HeadNorms(q_weight, k_weight, 1e-6))


@pytest.mark.parametrize("head_dim", [32, 40])
@pytest.mark.parametrize("pos", [37, 150])  # one chunk; three, merged by the combine kernel
def test_output_carries_its_quantized_form_where_heads_hold_whole_groups(head_dim, pos, monkeypatch) -> None:
    """The kernels write the row quantized as `quantize_x` would (asked for as on a GPU), from the
    one chunk's program or the combine kernel; with heads of 40 a group of 32 would straddle two
    heads, so none is written."""
    from llmx.quant.triton import activation

    monkeypatch.setattr(activation, "wants_quantized", lambda x: True)
    c = Case(4, 2, head_dim, 32, True, F32, pos=pos, n_read=pos + 1)
    out = run(c, "on", *random_step(c))
    qx = activation.PENDING.quantized(out)
    if head_dim % 32:
        assert qx is None
    else:
        ref = activation.quantize_x(out)
        assert torch.equal(qx.q, ref.q) and torch.equal(qx.dx, ref.dx) and torch.equal(qx.sums, ref.sums)


@pytest.mark.skipif(DEVICE == "cuda", reason="checks that CPU tensors stay on the eager path")
def test_auto_keeps_cpu_and_prompts_eager() -> None:
    """ "auto" fuses only CUDA steps; a prompt step (T > 1) stays eager even when forced "on"."""
    c = CASES[1]
    q, k, v, kc, vc = random_step(c)
    ref = run(c, "off", q, k, v, kc.clone(), vc.clone())
    assert torch.equal(run(c, "auto", q, k, v, kc.clone(), vc.clone()), ref)

    t, rope = 3, Rope(c.n_dims, 10000.0, c.neox)
    q, k, v = q.expand(t, -1, -1), k.expand(t, -1, -1), v.expand(t, -1, -1)
    positions = torch.arange(c.pos, c.pos + t)
    cos, sin = rope.tables(positions, c.n_read)
    mask = causal_mask(positions, c.n_read)
    outs = []
    for mode in ("off", "on"):
        cache = LayerWriter(kc.clone(), vc.clone(), positions, c.n_read, AttentionKernels(decode=mode))
        outs.append(ops.rope_attention(q, k, v, rope, cos, sin, cache, mask))
    assert torch.equal(*outs)


# --- a tiny model, decoded greedily with and without the fused path ------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # adjacent pairs + GQA; NeoX + window + q/k norm
def test_tiny_model_greedy_decode_is_unchanged(arch: str, tmp_path) -> None:
    # -ub 4: gemma3's local layers keep a ring of 8 + 4 = 12 positions, which 12 + 8 tokens wrap
    model = llmx.load(write_tiny(arch, "F32", tmp_path), ctx_size=64, ubatch_size=4, threads=1)
    assert arch != "gemma3" or model.engine.executor.cache.k[0].shape[0] == 12
    prompt = random_prompt(12, seed=3)  # longer than gemma3's 8-token window

    def decode(mode: str) -> tuple[list[int], torch.Tensor]:
        model.engine.executor.cache.kernels = AttentionKernels(decode=mode)
        return greedy_steps(model, prompt)

    eager_tokens, eager_logits = decode("off")
    fused_tokens, fused_logits = decode("on")
    assert fused_tokens == eager_tokens
    diff = (fused_logits - eager_logits).abs().max().item()
    assert diff < 1e-3, f"max |logit difference| {diff:.2e}"


# --- GPU: Llama-3-8B's attention shape -------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LLAMA3 = dict(n_head=32, n_head_kv=8, head_dim=128, n_dims=128, neox=False)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=str)
@pytest.mark.parametrize("n_read", [256, 8192])
@pytest.mark.parametrize("variant", ["plain", "bucket", "window-softcap"])
def test_gpu_llama3_shapes(dtype: torch.dtype, n_read: int, variant: str) -> None:
    pos = n_read - 100 if variant == "bucket" else n_read - 1
    extra = dict(window=4096, softcap=50.0, neox=True) if variant == "window-softcap" else {}
    check(Case(**{**LLAMA3, **extra}, dtype=dtype, pos=pos, n_read=n_read, n_ctx=n_read))


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replays_at_every_position() -> None:
    """One capture for a 512-row bucket serves every position below it, as the executor uses it."""
    c = Case(**LLAMA3, dtype=F16, pos=0, n_read=512, n_ctx=512)
    q, k, v, kc, vc = random_step(c)
    rope, positions = Rope(c.n_dims, 10000.0, c.neox), torch.zeros(1, dtype=torch.long, device=DEVICE)

    def step() -> torch.Tensor:
        cos, sin = rope.tables(positions, c.n_read)
        cache = LayerWriter(kc, vc, positions, c.n_read, AttentionKernels(decode="auto"))
        return ops.rope_attention(q, k, v, rope, cos, sin, cache, causal_mask(positions, c.n_read))

    step()  # compile and build the RoPE table outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for pos in (0, 200, 511):
        ref_k, ref_v = kc.clone(), vc.clone()
        positions.fill_(pos)
        graph.replay()
        at = Case(**LLAMA3, dtype=F16, pos=pos, n_read=512, n_ctx=512)
        ref = run(at, "off", q, k, v, ref_k, ref_v)
        assert relative_error(out, ref) < TOL[F16]
        torch.testing.assert_close(kc[pos].float(), ref_k[pos].float(), rtol=1e-3, atol=1e-6)


# --- prompt batches: the implicit causal mask of causal_prompt_attention --------------------------


@pytest.mark.parametrize(("t", "n_keys"), [(7, 7), (5, 12)], ids=["first-batch", "later-batch"])
@pytest.mark.parametrize("n_head_kv", [1, 2, 4])
def test_causal_prompt_attention_matches_the_masked_path(t: int, n_keys: int, n_head_kv: int) -> None:
    gen = torch.Generator().manual_seed(t * 10 + n_head_kv)
    q = torch.randn(t, 4, 16, generator=gen)
    k, v = (
        torch.randn(n_keys, n_head_kv, 16, generator=gen),
        torch.randn(n_keys, n_head_kv, 16, generator=gen),
    )
    mask = causal_mask(torch.arange(n_keys - t, n_keys), n_keys)
    expected = ops.attention(q, k, v, mask, scale=0.3)
    got = ops.causal_prompt_attention(q, k, v, scale=0.3)
    assert got.shape == expected.shape == (t, 64)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "n_keys"), [(512, 512), (512, 4096)])
def test_gpu_causal_prompt_attention(t: int, n_keys: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(t, 32, 128, device="cuda", generator=gen)
    k = torch.randn(n_keys, 8, 128, device="cuda", generator=gen).half()
    v = torch.randn(n_keys, 8, 128, device="cuda", generator=gen).half()
    mask = causal_mask(torch.arange(n_keys - t, n_keys, device="cuda"), n_keys)
    expected = ops.attention(q, k, v, mask)
    got = ops.causal_prompt_attention(q, k, v)
    assert torch.allclose(got, expected, atol=2e-3, rtol=2e-3)


def test_a_ring_cache_keeps_the_latest_positions_and_says_which() -> None:
    rows, k_buf = 12, torch.zeros(12, 1, 1)
    written = []
    for start in range(0, 30, 5):  # 5-token steps over positions 0..29
        positions = torch.arange(start, start + 5)
        writer = LayerWriter(k_buf, torch.zeros_like(k_buf), positions, start + 5)
        keys, _ = writer(positions.float().view(5, 1, 1), positions.float().view(5, 1, 1))
        written.append(writer.key_positions())
        if start + 5 <= rows:  # not wrapped: the prefix, in position order
            assert written[-1] is None and keys[:, 0, 0].tolist() == list(range(start + 5))
        else:  # every row holds the position key_positions says, or was never written (< 0)
            held = keys[:, 0, 0].long()
            assert keys.shape[0] == rows and torch.equal(
                held[written[-1] >= 0], written[-1][written[-1] >= 0]
            )
    assert sorted(written[-1].tolist()) == list(range(18, 30))
    mask = ops.ring_mask(torch.tensor([27, 29]), written[-1], window=4)
    assert [sorted(written[-1][m].tolist()) for m in mask] == [[24, 25, 26, 27], [26, 27, 28, 29]]
