"""Mixture-of-experts models: the router, the experts' FFN, and Qwen3-MoE, Qwen2-MoE and Mixtral against
Hugging Face transformers.

- `route` against a direct reference of each model's definition (softmax over all, top-k, renormalised
  or not; Mixtral's top-k of the logits then softmax over those k); the native router of a CPU decode
  step against `route` of its logits.
- `moe_ffn` on random expert stacks of several types against a loop over the tokens on dequantized
  weights, with tokens sharing experts and experts left unused.
- Tiny random models (`tiny_models.TINY_MOE_SHAPES`: 2 layers, 4-8 experts, 2-4 a token) written as
  GGUF in F32, F16, Q8_0 and Q4_K_M by the project's writer, against transformers' Qwen3MoeForCausalLM,
  Qwen2MoeForCausalLM and MixtralForCausalLM built from the file's hyperparameters with its weights
  dequantized by gguf-py: all logits of every position of 2 prompts, and greedy continuations.
  (transformers' own GGUF loader is not used: it reads no Mixtral, and its Qwen3-MoE config would not
  say that llama.cpp renormalises the top-k weights.)
- Placement: `--cpu-moe` and `-ot exps=CPU` plans put exactly the expert stacks on the CPU, the loaded
  weights are where the plan says, and the tokens do not change; `llmx plan` on a MoE file for a
  GPU box keeps the experts in RAM.
- Experts in RAM under GPU layers: the layers a captured decode step meets the host at, the crossing
  `moe_ffn` hands such an x to, a trip there and back (the host served from another thread; a host or
  GPU that stops waiting), and a prompt's staged experts (a compact stack of the used ones, ids
  renumbered, the threshold's arithmetic); on a GPU, decode replays one graph with a trip a layer and
  a prompt copies exactly the experts its routing chose.
"""

from __future__ import annotations

import gc
import json
import operator
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from references import DECISIVE_MARGIN, GREEDY, decisive, transformers_outputs
from tiny_models import TINY_MOE_SHAPES, random_prompt, write_tiny
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import llmx
from llmx.api import LoadedModel
from llmx.bench.blocks import random_data
from llmx.cli import main
from llmx.errors import LlmxError
from llmx.gguf import open_gguf
from llmx.kernels import host_handoff as handoff
from llmx.measured import remembered
from llmx.model_config import ModelConfig
from llmx.models.common import TensorGroup
from llmx.models.layout import check_tensors
from llmx.models.qwen_moe import QwenMoe
from llmx.ops import moe as moe_ops
from llmx.ops import moe_ffn, route, router
from llmx.ops.moe import crossing
from llmx.plan.shapes import ModelShape
from llmx.quant import cpu_native, qtype
from llmx.quant.triton import layout
from llmx.quant.weight import QWeight, as_matrix, dequantize, prepare_cpu
from llmx.runtime import expert_staging, host_trips
from llmx.runtime.counters import host_reads
from llmx.runtime.expert_staging import compact_ids, compact_stack, runs, tokens_worth_staging
from llmx.runtime.offload import NEVER, THRESHOLD_FILE
from llmx.runtime.segments import Segment, host_expert_layers

OPTIONS = dict(cache_type_k="f32", cache_type_v="f32", threads=1)  # as test_models.py, and why
TYPES = ("F32", "F16", "Q8_0", "Q4_K_M")
PROMPT_LENGTHS = (40, 56)  # more than one ubatch of 32, so prompts take the grouped multi-row path
N_GREEDY = 16
# Max |ours - transformers| over all logits of every position. Both multiply the same dequantized
# weights in float32, so what remains is summation order, and for the quantized files the native
# GEMV's 16-bit codes of x in decode-sized ubatches: measured <= 5e-6 for F32 and F16, <= 3.1e-4 for
# Q8_0 and Q4_K_M. A token routed to another expert would move its logits by ~1.
MAX_ABS_DIFF = 2e-3


# --- the router ---------------------------------------------------------------------------------


def test_route_is_softmax_then_top_k_renormalised_where_asked():
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0)) * 3
    for k, normalize in ((2, True), (4, False), (8, True)):
        weights, ids = route(logits, k, normalize)
        assert weights.dtype == torch.float32 and ids.shape == (50, k)
        for t in range(50):
            p = np.exp(logits[t].double().numpy() - logits[t].max().item())
            p /= p.sum()
            best = np.argsort(-p, kind="stable")[:k]
            want = p[best] / p[best].sum() if normalize else p[best]
            assert ids[t].tolist() == best.tolist()
            np.testing.assert_allclose(weights[t].numpy(), want, rtol=1e-5)


def test_route_renormalised_equals_mixtral_softmax_over_the_top_k_logits():
    logits = torch.randn(30, 8, generator=torch.Generator().manual_seed(1))
    weights, ids = route(logits, 2, normalize=True)
    top, top_ids = logits.topk(2, dim=-1)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, torch.softmax(top, dim=-1), rtol=1e-6, atol=1e-6)


native_cpu = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels did not build")


def float_router(rows: torch.Tensor) -> QWeight:
    return QWeight(rows.contiguous(), qtype("F32"), tuple(rows.shape), "ffn_gate_inp")


@native_cpu
@pytest.mark.parametrize(("n_expert", "k", "normalize"), [(8, 2, True), (60, 4, False), (128, 8, True)])
def test_the_native_router_is_route_of_the_router_logits(n_expert, k, normalize):
    """A decode step's tokens (up to 15) take the native router: one-hot x gives it logits that are
    the router's columns exactly, and it picks route's experts with route's weights; random x, whose
    dots it sums in another order than torch's matmul, the same experts and weights within rounding."""
    g = torch.Generator().manual_seed(n_expert)
    rows = torch.randn(n_expert, 256, generator=g) * 3
    w = float_router(rows)
    columns = torch.randint(0, 256, (15,), generator=g)
    one_hot = torch.nn.functional.one_hot(columns, 256).float()
    for x, tolerance in ((one_hot, 0.0), (torch.randn(15, 256, generator=g), 1e-4)):
        weights, ids = router(x, w, k, normalize)
        want_weights, want_ids = route(x.double() @ rows.double().t(), k, normalize)
        assert ids.dtype == torch.int64 and torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights.float(), rtol=tolerance + 1e-6, atol=1e-7)


@native_cpu
def test_the_native_router_puts_the_lower_id_first_of_equal_logits():
    rows = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    rows[9] = rows[2] = rows.abs().sum(0)  # experts 2 and 9: equal logits, the largest for x >= 0
    weights, ids = router(torch.rand(3, 64), float_router(rows), 4, True)
    assert ids[:, :2].tolist() == [[2, 9]] * 3 and torch.equal(weights[:, 0], weights[:, 1])


# --- the experts' FFN ---------------------------------------------------------------------------


def expert_stack(name: str, shape: tuple[int, int, int], seed: int) -> QWeight:
    """A random stack [n_expert, out, in] of type `name`, as the loader makes it (CPU, prepared)."""
    qt = qtype(name)
    data = torch.from_numpy(
        random_data(qt, int(np.prod(shape)), shape[2] ** -0.5, np.random.default_rng(seed))
    )
    if qt.name in ("F32", "F16"):
        raw = data.view(torch.float32 if qt.name == "F32" else torch.float16).view(shape)
    else:
        raw = data.view(shape[0] * shape[1], qt.row_bytes(shape[2]))
    return prepare_cpu(QWeight(raw, qt, shape, f"{name} stack"))


@pytest.mark.parametrize("name", ["F32", "F16", "Q8_0", "Q4_K", "Q5_0"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_moe_ffn_is_the_weighted_sum_of_the_chosen_experts(name, tokens):
    """Q5_0 is repacked for the CPU (not a native type): its experts read row views of the packed stack."""
    n_expert, k, e, f = 6, 2, 256, 256
    gate, up, down = (
        expert_stack(name, s, i) for i, s in enumerate([(n_expert, f, e), (n_expert, f, e), (n_expert, e, f)])
    )
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, e, generator=g)
    # experts 0-2 only, so some experts have no tokens and the rest several
    weights, ids = route(
        torch.randn(tokens, n_expert, generator=g) - 100 * (torch.arange(n_expert) > 2), k, True
    )
    dense = [dequantize(w).double() for w in (gate, up, down)]
    want = torch.zeros(tokens, e, dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            ex, xt = ids[t, j], x[t].double()
            h = torch.nn.functional.silu(dense[0][ex] @ xt) * (dense[1][ex] @ xt)
            want[t] += weights[t, j].double() * (dense[2][ex] @ h)
    got = moe_ffn(x, gate, up, down, weights, ids)
    # decode-sized row counts take the native GEMV, which reads x as 16-bit codes
    assert (got.double() - want).abs().max().item() < 2e-3 * want.abs().max().item()


def test_a_stack_prepared_for_triton_row_by_row_is_its_experts_prepared_one_by_one():
    """`prepare_gpu` rearranges a stack as one tall matrix; each expert's view must then hold exactly
    the rows its own matrix prepared alone would (the layout is per row)."""
    for name in ("Q8_0", "Q4_K"):
        stack = expert_stack(name, (3, 64, 256), 0)
        whole = layout.prepare(as_matrix(stack))
        for e, view in enumerate(stack.experts):
            alone = layout.prepare(QWeight(view.raw.clone(), view.qtype, view.shape))
            assert torch.equal(whole.raw[e * 64 : (e + 1) * 64], alone.raw)


def test_an_expert_stack_of_the_wrong_shape_is_one_line_naming_it(tmp_path):
    path = write_tiny("qwen3moe", "Q8_0", tmp_path)
    mf = open_gguf(path)
    config = ModelConfig.from_metadata(mf.metadata, path.name)
    bad = replace(config, n_ff_exp=128)  # what a file whose metadata disagrees with its experts says
    tensors = [(t.name, t.qtype, t.shape) for t in mf.tensors.values()]
    with pytest.raises(
        LlmxError, match=r"blk\.0\.ffn_gate_exps\.weight has shape \[8, 256, 256\]; .* \[8, 128, 256\]"
    ):
        check_tensors(path.name, bad, tensors, QwenMoe.layer_tensors(bad))
    check_tensors(path.name, config, tensors, QwenMoe.layer_tensors(config))


# --- experts in RAM under GPU layers --------------------------------------------------------------


def stacks(name: str, n_expert: int, seed: int) -> tuple[QWeight, QWeight, QWeight]:
    """A layer's gate, up and down stacks of 256-wide experts."""
    shapes = [(n_expert, 256, 256)] * 3
    return tuple(expert_stack(name, shape, seed + i) for i, shape in enumerate(shapes))


def test_layers_with_all_their_experts_in_ram_are_where_a_gpu_step_crosses():
    on_cpu = stacks("Q8_0", 4, 0)
    elsewhere = tuple(QWeight(w.raw.to("meta"), w.qtype, w.shape) for w in on_cpu)  # stands in for a GPU
    experts = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    layers = [
        TensorGroup("blk.0.", dict(zip(experts, on_cpu, strict=True))),
        TensorGroup("blk.1.", dict(zip(experts, elsewhere, strict=True))),
        TensorGroup("blk.2.", dict(zip(experts, (on_cpu[0], *elsewhere[1:]), strict=True))),  # split: no
        TensorGroup("blk.3.", {"ffn_gate": on_cpu[0].experts[0]}),  # a dense FFN in RAM is no crossing
    ]
    model = SimpleNamespace(layers=layers)
    assert host_expert_layers(Segment(torch.device("cuda:0"), range(4), False), model) == (0,)
    assert host_expert_layers(Segment(torch.device("cuda:0"), range(1, 4), True), model) == ()
    assert host_expert_layers(Segment(torch.device("cpu"), range(4), False), model) == ()


def test_moe_ffn_hands_an_x_on_another_device_to_the_crossing_within_its_context():
    gate, up, down = stacks("Q8_0", 4, 0)
    x = torch.empty(3, 256, device="meta")  # another device than the stacks'
    weights, ids = route(torch.randn(3, 4), 2, True)
    seen, result = [], torch.ones(3, 256)

    def cross(*args):
        seen.append(args)
        return result

    with crossing(cross):
        assert moe_ffn(x, gate, up, down, weights, ids, False) is result
    assert len(seen) == 1 and all(map(operator.is_, seen[0], (x, gate, up, down, weights, ids, False)))
    with pytest.raises(NotImplementedError, match="meta"):  # outside it, x moves to the stacks
        moe_ffn(x, gate, up, down, weights, ids)


def trip_operands(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode token's x [1, 256] and routing over 4 experts (k = 2) on `device`."""
    g = torch.Generator().manual_seed(3)
    weights, ids = route(torch.randn(1, 4, generator=g), 2, True)
    return torch.randn(1, 256, generator=g).to(device), weights.to(device), ids.to(device)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: the kernels under the interpreter


@pytest.fixture
def bounded_waits(monkeypatch):
    """A GPU side left waiting by a failed test gives up within seconds: a poll takes about a microsecond on
    a GPU and five under the interpreter, where a loaded machine's host thread may wait a second for its
    turn at the interpreter's lock."""
    monkeypatch.setattr(handoff, "MAX_SPINS", 2_000_000)


def crossed(trips: host_trips.HostTrips, operands: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The only trip of `trips` there and back, its GPU side issued from another thread while the host
    serves it as a replay's would be (a trip the GPU stopped waiting for raises, not a stale sum)."""
    (trip,) = trips.trips
    got: list[torch.Tensor] = []
    gpu = threading.Thread(target=lambda: got.append(trip.cross(*operands).cpu()))
    gpu.start()
    try:
        trips.run(lambda: None)
    finally:
        gpu.join()
    return got[0]


def test_a_trip_hands_its_operands_to_the_host_and_takes_the_experts_sum_back(bounded_waits):
    """A trip's kernels write x, the weights and the ids where the host reads them, and wait for its
    experts' sum; counted flags let the same trip run again (a graph's replays)."""
    layer = stacks("Q8_0", 4, 0)
    x, weights, ids = trip_operands(DEVICE)
    want = moe_ffn(x.cpu(), *layer, weights.cpu(), ids.cpu())
    trips = host_trips.HostTrips(torch.device(DEVICE))
    trip = trips.add(x, weights, layer, True)
    for _ in range(3):
        assert torch.equal(crossed(trips, (x, weights, ids)), want)
        assert torch.equal(trip.ids, ids.cpu().to(torch.int64)) and torch.equal(trip.weights, weights.cpu())
    x2 = x.flip(1)
    want = moe_ffn(x2.cpu(), *layer, weights.cpu(), ids.cpu())
    assert torch.equal(crossed(trips, (x2, weights, ids)), want)


HANDOFF_FOR_HOPPER = """
import re, sys
sys.path.insert(0, "bench")
from ptx_gemv import compile_for_hopper
from llmx.kernels import host_handoff as h
over = {"x": "*fp32", "weights": "*fp32", "ids": "*i32", "row": "*i64", "counter": "*i32"}
over |= {"n_x": "i32", "n_k": "i32"}
back = {"y": "*fp32", "row": "*i64", "counter": "*i32", "n_y": "i32"}
fixed = {"BLOCK": h.BLOCK, "FENCE": True}
kernels = [(h._hand_over_kernel, over, {"K_BLOCK": 8}), (h._take_back_kernel, back, {"MAX_SPINS": 9})]
for fn, sig, more in kernels:
    ptx = compile_for_hopper(fn, sig, fixed | more, (), {"num_warps": 4})["ptx"]
    print(ptx.count("fence.sc.sys"), len(re.findall(r"ld\\.volatile", ptx)))
"""


def test_the_handoff_kernels_compile_for_hopper_with_their_fences():
    """The interpreter skips the inline PTX: compiled for sm_90 (no GPU needed), each kernel keeps its
    system-scope fence, and take_back polls and reads host memory with volatile loads."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", HANDOFF_FOR_HOPPER], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (over_fences, over_volatile), (back_fences, back_volatile) = (
        map(int, ln.split()) for ln in out.stdout.split("\n")[:2]
    )
    assert over_fences == back_fences == 1 and over_volatile == 0 and back_volatile >= 3


def test_a_steps_trips_are_served_by_one_native_call(bounded_waits):
    """Trips whose experts are native calls (two layers of different types) are served by one native
    call a step, the GPU's side here from another thread, the same sums as each served alone."""
    layers = [stacks("Q8_0", 4, 0), stacks("Q4_K", 4, 10)]
    x, weights, ids = trip_operands(DEVICE)
    trips = host_trips.HostTrips(torch.device(DEVICE))
    for layer in layers:
        trips.add(x, weights, layer, True)
    trips.seal()
    assert trips.native is not None
    for step in range(2):
        xs = [x * (step + 1), -x]
        got: list[torch.Tensor] = []

        def gpu_side(xs=xs, got=got):
            got.extend(t.cross(xi, weights, ids).cpu() for t, xi in zip(trips.trips, xs, strict=True))

        gpu = threading.Thread(target=gpu_side)
        gpu.start()
        trips.run(lambda: None)
        gpu.join()
        for y, xi, layer in zip(got, xs, layers, strict=True):
            assert torch.equal(y, moe_ffn(xi.cpu(), *layer, weights.cpu(), ids.cpu()))


def test_trips_a_host_cannot_serve_end_with_one_line_and_leave_the_next_step_whole(
    bounded_waits, monkeypatch
):
    """A host that gives up lets the GPU's waits end, and one the GPU stopped waiting for says so; the
    flags are then set so that the next step's trips meet as before."""
    layer = stacks("Q8_0", 4, 0)
    x, weights, ids = trip_operands(DEVICE)
    trips = host_trips.HostTrips(torch.device(DEVICE))
    trip = trips.add(x, weights, layer, False)
    wait, spins = host_trips.HOST_WAIT, handoff.MAX_SPINS
    monkeypatch.setattr(host_trips, "HOST_WAIT", 0.05)
    with pytest.raises(LlmxError, match="did not reach a layer whose experts are in RAM"):
        trips.run(lambda: None)  # nothing launched: the operands never come
    monkeypatch.setattr(handoff, "MAX_SPINS", 20)
    trip.cross(x, weights, ids)  # no host serving: the GPU stops waiting
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    with pytest.raises(LlmxError, match="the GPU stopped waiting"):
        trips.run(lambda: None)
    monkeypatch.setattr(host_trips, "HOST_WAIT", wait)
    monkeypatch.setattr(handoff, "MAX_SPINS", spins)
    assert torch.equal(crossed(trips, (x, weights, ids)), moe_ffn(x.cpu(), *layer, weights.cpu(), ids.cpu()))


def test_runs_of_consecutive_experts_are_one_copy_each():
    assert runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 1), (7, 2)]
    assert runs([6]) == [(6, 1)] and runs([]) == []


def test_ids_are_renumbered_into_the_compact_stack():
    ids = torch.tensor([[5, 0], [7, 5]])
    assert compact_ids(ids, [0, 5, 7], 8).tolist() == [[1, 0], [2, 1]]


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_the_used_experts_staged_compute_what_the_whole_stacks_do(name):
    n_expert, tokens = 8, 5
    full = stacks(name, n_expert, 1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, 256, generator=g)
    never = 100 * (torch.arange(n_expert) % 3 == 1)  # experts 1, 4 and 7 are never chosen
    weights, ids = route(torch.randn(tokens, n_expert, generator=g) - never, 2, True)
    used = torch.unique(ids).tolist()
    assert set(used).isdisjoint({1, 4, 7})
    staged = [compact_stack(w, w.raw, used, torch.device("cpu")) for w in full]
    for w, s in zip(full, staged, strict=True):
        assert s.shape == (len(used), *w.shape[1:])
        for j, e in enumerate(used):
            assert torch.equal(s.experts[j].raw, w.experts[e].raw)
    got = moe_ffn(x, *staged, weights, compact_ids(ids, used, n_expert))
    torch.testing.assert_close(got, moe_ffn(x, *full, weights, ids), rtol=1e-6, atol=1e-6)


def test_staging_threshold_counts_the_share_of_experts_a_batch_uses():
    # a token's CPU time pays for copying its own experts: from the smallest batch
    assert tokens_worth_staging(cpu_per_token=1.0, copy_seconds=10.0, k=2, n_expert=32) == 2
    # every token uses every expert: staging pays once the CPU time reaches one copy of the stacks
    assert tokens_worth_staging(cpu_per_token=1.0, copy_seconds=50.0, k=8, n_expert=8) == 50
    # 1 of 64 experts a token: a batch of t leaves some unused, so it pays before 100 tokens
    t = tokens_worth_staging(cpu_per_token=1.0, copy_seconds=100.0, k=1, n_expert=64)

    def share(n: int) -> float:
        return 1 - (63 / 64) ** n

    assert 2 < t < 100 and t >= 100 * share(t) and t - 1 < 100 * share(t - 1)


def test_float_expert_stacks_are_never_staged():
    """The grouped kernels read GGUF blocks: stacks of floats stay on the CPU (decided before any GPU
    is asked)."""
    layers = [stacks("Q8_0", 4, 0), stacks("F16", 4, 0)]
    assert expert_staging.staging_threshold(layers, 2, torch.device("cuda:0")) == NEVER


# --- tiny models against transformers -----------------------------------------------------------

HF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}  # fmt: skip
HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{a}.{p}": f"self_attn.{a}_proj.{p}" for a in "qkv" for p in ("weight", "bias")},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")},
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}


def hf_config(s: ModelShape) -> object:
    common = dict(
        vocab_size=s.n_vocab, hidden_size=s.n_embd, num_hidden_layers=s.n_layer, num_attention_heads=s.n_head,
        num_key_value_heads=s.n_head_kv, head_dim=s.head_dim, rms_norm_eps=s.rms_eps,
        max_position_embeddings=s.ctx_train, tie_word_embeddings=False, num_experts_per_tok=s.n_expert_used,
        rope_parameters={"rope_type": "default", "rope_theta": s.rope_base},
    )  # fmt: skip
    if s.arch == "llama":  # Mixtral
        return MixtralConfig(**common, num_local_experts=s.n_expert, intermediate_size=s.n_ff_exp)
    moe = dict(num_experts=s.n_expert, moe_intermediate_size=s.n_ff_exp, decoder_sparse_step=1)
    if s.arch == "qwen3moe":  # llama.cpp renormalises Qwen3-MoE's top-k weights, as the real configs ask
        return Qwen3MoeConfig(**common, **moe, norm_topk_prob=True)
    return Qwen2MoeConfig(**common, **moe, norm_topk_prob=False, shared_expert_intermediate_size=s.n_ff_shexp)


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which reorders each Llama head's Q/K rows for GGML's adjacent-pair
    rotation (`LlamaModel.permute` in convert_hf_to_gguf.py): back to transformers' rotate-half order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def transformers_model(path: Path, s: ModelShape) -> PreTrainedModel:
    """The transformers model of the file: built from its hyperparameters, with its weights as gguf-py
    dequantizes them, renamed (and Mixtral's Q/K unpermuted) as convert_hf_to_gguf.py maps them."""
    tensors = {
        t.name: torch.from_numpy(np.array(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32))
        for t in GGUFReader(path).tensors
    }
    state = {}
    for name, value in tensors.items():
        if not name.startswith("blk."):
            state[HF_TOP[name]] = value
            continue
        _, layer, short = name.split(".", 2)
        if s.arch == "llama" and short in ("attn_q.weight", "attn_k.weight"):
            value = unpermute(value, s.n_head if short == "attn_q.weight" else s.n_head_kv)
        if short == "ffn_gate_exps.weight":
            value, short = torch.cat([value, tensors[f"blk.{layer}.ffn_up_exps.weight"]], dim=1), "gate_up"
        elif short == "ffn_up_exps.weight":
            continue
        hf = "mlp.experts.gate_up_proj" if short == "gate_up" else HF_LAYER[short]
        state[f"model.layers.{layer}.{hf}"] = value
    cls = {"llama": MixtralForCausalLM, "qwen3moe": Qwen3MoeForCausalLM, "qwen2moe": Qwen2MoeForCausalLM}
    model = cls[s.arch](hf_config(s))
    model.load_state_dict(state, strict=True)  # every parameter comes from the file
    return model.eval()


@dataclass
class Tiny:
    model: LoadedModel
    path: Path
    prompts: list[list[int]]
    logits: list[torch.Tensor]  # transformers', [T, vocab] per prompt
    greedy: list[list[int]]


@pytest.fixture(scope="module", params=[(a, t) for a in TINY_MOE_SHAPES for t in TYPES], ids="-".join)
def tiny(request, tmp_path_factory) -> Tiny:
    arch, type_name = request.param
    path = write_tiny(arch, type_name, tmp_path_factory.mktemp("moe"))
    prompts = [random_prompt(n, seed=k) for k, n in enumerate(PROMPT_LENGTHS)]
    hf = transformers_model(path, TINY_MOE_SHAPES[arch])
    logits, continuations = transformers_outputs(hf, prompts, N_GREEDY)
    # placed as a user's load would be: on a machine with a GPU, --fit puts it there, so the GPU checks
    # below compare GPU placements with the all-GPU model; the CPU is farther from it (see ROW_TOL)
    model = llmx.load(path, ctx_size=128, ubatch_size=32, **OPTIONS)
    return Tiny(model, path, prompts, logits, continuations)


def on_gpu(model: LoadedModel) -> bool:
    return any(device != "cpu" for device in model.plan.tensor_device.values())


# On a machine with a GPU `tiny` runs there, where a row of logits may differ from transformers' by a
# token routed elsewhere (the GPU section's ROW_TOL says why): there the rows are checked as the GPU
# placements' are, per row and at decisive greedy steps; on the CPU, exactly.
def test_logits_match_transformers(tiny):
    for ids, expected in zip(tiny.prompts, tiny.logits, strict=True):
        tiny.model.engine.reset()
        logits = tiny.model.engine.prefill(ids, all_logits=True)
        if on_gpu(tiny.model):
            assert most_rows_close(logits.cpu(), expected), f"{len(ids)}-token prompt"
            continue
        diff = (logits - expected).abs().max().item()
        assert diff < MAX_ABS_DIFF, f"{len(ids)}-token prompt: max |logit difference| {diff:.2e}"
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_greedy_continuation_matches_transformers(tiny):
    for ids, expected in zip(tiny.prompts, tiny.greedy, strict=True):
        assert_greedy_continuation(tiny.model, ids, expected)


def assert_greedy_continuation(model: LoadedModel, ids: list[int], expected: list[int]) -> None:
    """Greedy decoding after `ids` gives `expected`: exactly on the CPU, at decisive steps on a GPU."""
    if on_gpu(model):
        steps = forced_logits(model, ids, expected)[len(ids) - 1 :]
        assert_decisive_steps_pick(steps, expected)
        return
    model.engine.reset()
    assert list(model.engine.generate(ids, N_GREEDY, GREEDY)) == expected


def test_logits_are_not_degenerate(tiny):
    """The comparison means something: logits spread, and the argmax moves with the context (over
    fewer ids for Q4_K_M, whose random blocks favour a few output rows, as test_models.py explains)."""
    logits = tiny.logits[0]
    assert logits.std() > 0.5 and len(set(logits.argmax(-1).tolist())) >= 3


# --- placement ----------------------------------------------------------------------------------


# placement does not depend on the type: one is enough
ONE_TYPE = [(a, "Q8_0") for a in TINY_MOE_SHAPES]


@pytest.mark.parametrize("tiny", ONE_TYPE, indirect=True, ids="-".join)
@pytest.mark.parametrize("placement", [dict(cpu_moe=True), dict(override_tensor=["exps=CPU"])])
def test_expert_placement_is_the_plan_and_keeps_the_tokens(tiny, placement):
    model = llmx.load(tiny.path, ctx_size=128, ubatch_size=32, **OPTIONS, **placement)
    placed = {name: dev for name, dev in model.plan.tensor_device.items() if "_exps." in name}
    assert placed and set(placed.values()) == {"cpu"}
    layers = model.engine.executor.model.layers
    for name, device in model.plan.tensor_device.items():
        if name.startswith("blk."):
            _, i, short = name.split(".", 2)
            value = getattr(layers[int(i)], short.removesuffix(".weight").replace(".", "_"))
            assert (value.raw if isinstance(value, QWeight) else value).device.type == device
    for ids, expected in zip(tiny.prompts, tiny.greedy, strict=True):
        assert_greedy_continuation(model, ids, expected)


@pytest.mark.parametrize("tiny", ONE_TYPE, indirect=True, ids="-".join)
def test_plan_for_a_gpu_box_keeps_the_experts_in_ram(tiny, capsys):
    rc = main(
        [
            "plan",
            "-m",
            str(tiny.path),
            "--devices",
            "cuda0=8GiB,cpu=64GiB",
            "-ngl",
            "99",
            "--cpu-moe",
            "--json",
        ]
    )
    tensors = json.loads(capsys.readouterr().out)["tensors"]
    assert rc == 0
    assert {d for n, d in tensors.items() if "_exps." in n} == {"cpu"}
    assert {d for n, d in tensors.items() if "attn_q." in n or "ffn_gate_inp." in n} == {"cuda:0"}


@pytest.mark.parametrize("tiny", ONE_TYPE, indirect=True, ids="-".join)
def test_a_cpu_step_counts_the_bytes_of_the_experts_a_token_uses(tiny):
    executor = tiny.model.engine.executor
    model, config = executor.model, tiny.model.config
    (seg,) = executor.segments
    stacks = dense = 0
    for group in model.layers:
        for _, value in group.items():
            nbytes = value.raw.nbytes if isinstance(value, QWeight) else value.nbytes
            if isinstance(value, QWeight) and value.experts:
                stacks += nbytes
            else:
                dense += nbytes
    head = model.top.output.raw.nbytes + model.top.output_norm.nbytes
    weights, _ = host_reads(seg, model, executor.cache)
    assert weights == pytest.approx(dense + head + stacks * config.n_expert_used / config.n_expert, abs=8)


# --- on a GPU -----------------------------------------------------------------------------------

# A GPU multiplies prompts on tensor cores and decodes quantized weights on int8-quantized x (as
# test_gpu.py's LOGITS_TOL explains), the routed experts of up to 8 tokens too; the reference (the
# all-GPU model, `tiny`) takes the same kernels as the all-GPU placements, but experts in RAM are
# multiplied on the CPU (x in 16 bits) or, for a prompt, staged in GGUF order for the float GEMV.
# Rounding x and the experts' heavy-tailed silu(gate) * up to int8 per 32 values moves these tiny
# models' rows by up to ~1.7% (Q8_0 qwen3moe and mixtral, emulated in float64 on the CPU). Where a
# token's k-th and (k+1)-th experts are nearly tied, that is enough to route it elsewhere, which moves
# its row of logits by ~1. So the checks are per row: most rows within ROW_TOL, and a greedy step
# compared only where its top two logits are decisively apart (random tiny models have near-ties).
# Against the CPU model (H100, s35) the all-GPU Q8_0 qwen3moe's prompt rows are 0.04% off and its
# decode rows 1-1.5%, one prompt row rerouted (69%) and the decode rows after it 2-12% through the
# cache; with float GEMVs everywhere (LLMX_GPU_KERNEL=gemm) every row is within 0.3%.
ROW_TOL = 2e-2
MOST_ROWS = 0.9
GPU_PLACEMENTS = {
    "all-gpu": dict(n_gpu_layers="all"),
    "no-fmoe": dict(n_gpu_layers="all", no_fused_moe=True),
    "cpu-moe": dict(n_gpu_layers="all", cpu_moe=True),
    "ncmoe-1": dict(n_gpu_layers="all", n_cpu_moe=1),
    "experts-split": dict(n_gpu_layers="all", override_tensor=[r"blk\.0\.ffn_.*_exps=CPU"]),
}


def forced_logits(model: LoadedModel, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Every prompt position's logits, then each decode step's with `tokens` fed in turn (the same
    path whatever the model would pick): [len(prompt) + len(tokens) - 1, vocab], float64."""
    engine = model.engine
    engine.reset()
    rows = [engine.prefill(prompt, all_logits=True)]
    rows += [engine.decode(t).reshape(1, -1) for t in tokens[:-1]]
    return torch.cat(rows).double()


@pytest.mark.gpu
@pytest.mark.parametrize("tiny", [(a, t) for a in TINY_MOE_SHAPES for t in ("Q8_0", "Q4_K_M")], indirect=True,
                         ids="-".join)  # fmt: skip
@pytest.mark.parametrize("placement", GPU_PLACEMENTS.values(), ids=GPU_PLACEMENTS)
def test_gpu_placements_keep_the_logits_and_tokens(tiny, placement):
    model = llmx.load(tiny.path, ctx_size=128, ubatch_size=32, **OPTIONS, **placement)
    if "cpu_moe" not in placement and "n_cpu_moe" not in placement and "override_tensor" not in placement:
        assert all(model.engine.executor._graphable)  # the routing stays on the GPU: decode replays graphs
    keeps_the_cpus_logits(tiny, model)


def reference_prompt_logits(tiny: Tiny) -> list[torch.Tensor]:
    """Every position's logits of each of the tiny model's prompts by the reference model (the all-GPU
    one, whose kernels the placements share; transformers' are a step farther, see ROW_TOL)."""
    return [forced_logits(tiny.model, prompt, prompt[-1:]) for prompt in tiny.prompts]


def most_rows_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether at least MOST_ROWS of the rows of logits are within ROW_TOL (relative) of `want`'s."""
    rows = (got.double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1)
    return (rows < ROW_TOL).double().mean().item() >= MOST_ROWS


def keeps_the_cpus_logits(tiny: Tiny, model: LoadedModel) -> None:
    """Prompt and decode logits, the CPU's greedy tokens fed in, close to the CPU's row by row; the
    greedy choice the same at every decisive step."""
    for prompt, tokens in zip(tiny.prompts, tiny.greedy, strict=True):
        want = forced_logits(tiny.model, prompt, tokens)  # the reference model's (see `tiny`)
        got = forced_logits(model, prompt, tokens)
        assert most_rows_close(got, want), f"{len(prompt)}-token prompt"
        steps = want[len(prompt) - 1 :]
        assert_decisive_steps_pick(got[len(prompt) - 1 :], steps.argmax(-1).tolist(), decided_by=steps)


def assert_decisive_steps_pick(
    steps: torch.Tensor, tokens: list[int], decided_by: torch.Tensor | None = None
) -> None:
    """`steps`' greedy choices are `tokens` wherever `decided_by`'s (default: `steps`') top two logits
    are decisively apart, which at least half the steps are."""
    sure = decisive(steps if decided_by is None else decided_by, DECISIVE_MARGIN)
    assert sure.sum() >= len(tokens) // 2
    assert torch.equal(steps.argmax(-1).cpu()[sure.cpu()], torch.tensor(tokens)[sure.cpu()])


CPU_EXPERTS = {
    "cpu-moe": dict(n_gpu_layers="all", cpu_moe=True),
    "ncmoe-1": dict(n_gpu_layers="all", n_cpu_moe=1),
}
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.mark.gpu
@pytest.mark.parametrize("tiny", [(a, t) for a in TINY_MOE_SHAPES for t in ("Q8_0", "Q4_K_M")], indirect=True,
                         ids="-".join)  # fmt: skip
@pytest.mark.parametrize("placement", CPU_EXPERTS.values(), ids=CPU_EXPERTS)
def test_decode_with_experts_in_ram_replays_one_graph_with_a_trip_a_layer(tiny, placement):
    """Each layer whose experts stay in RAM is one trip to the CPU inside the decode step's graph (the
    warm-up at load captured it; the graphs of all context buckets share the trips), and the tokens are
    transformers'."""
    model = llmx.load(tiny.path, ctx_size=128, ubatch_size=32, **OPTIONS, **placement)
    in_ram = [
        n for n, d in model.plan.tensor_device.items() if n.endswith("ffn_gate_exps.weight") and d == "cpu"
    ]
    assert len(in_ram) == (tiny.model.config.n_layer if "cpu_moe" in placement else 1)
    executor = model.engine.executor
    keeps_the_cpus_logits(tiny, model)
    graphs = list(executor.graphs.decode.values())
    assert graphs and all(len(g.trips) == len(in_ram) for g in graphs)
    assert len({id(g.trips) for g in graphs}) == 1  # one set of pinned buffers for every context bucket


@pytest.mark.gpu
@pytest.mark.parametrize("tiny", [("qwen3moe", "Q8_0")], indirect=True, ids="-".join)
def test_a_capture_outlasts_pinned_garbage(tiny, monkeypatch):
    """The collector waits while a step is captured: pinned host memory that only it would free (an
    earlier model's trips; here made just before each capture, with a copy in flight as a trip's
    are) freed mid-capture would invalidate the capture (a collection every 10 new objects)."""
    begin = torch.cuda.CUDAGraph.capture_begin

    def begin_beside_garbage(graph, *args, **kwargs):
        host = torch.empty(1 << 16, pin_memory=True)
        host.copy_(torch.ones(1 << 16, device="cuda"), non_blocking=True)
        cycle: list = [host]
        cycle.append(cycle)
        begin(graph, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", begin_beside_garbage)
    threshold = gc.get_threshold()
    gc.set_threshold(10, 1000, 1000)  # the young generation (the cycle) collected often; no full sweeps
    try:
        model = llmx.load(tiny.path, ctx_size=128, ubatch_size=32, **OPTIONS, **CPU_EXPERTS["cpu-moe"])
    finally:
        gc.set_threshold(*threshold)
    graphs = list(model.engine.executor.graphs.decode.values())
    assert graphs and all(g.trips for g in graphs)
    keeps_the_cpus_logits(tiny, model)


@pytest.mark.gpu
@pytest.mark.parametrize("tiny", [(a, t) for a in TINY_MOE_SHAPES for t in ("Q8_0", "Q4_K_M")], indirect=True,
                         ids="-".join)  # fmt: skip
def test_a_prompt_copies_exactly_the_experts_its_routing_chose(tiny, monkeypatch):
    """Above the staging threshold (here: from 2 tokens) each layer's experts in RAM that the batch
    routes to, and only those, are copied to the GPU: bytes_streamed is the sum, over every layer of
    every chunk, of the chosen experts' bytes; the logits stay transformers'."""
    from llmx.kernels import router as router_kernel  # GPU tests only: it imports triton

    route_tokens = router_kernel.route_tokens
    expected_logits = reference_prompt_logits(tiny)  # before the spies: the reference's prompts run as graphs
    monkeypatch.setattr(expert_staging, "staging_threshold", lambda layers, k, device: 2)
    model = llmx.load(tiny.path, ctx_size=128, ubatch_size=32, **OPTIONS, **CPU_EXPERTS["cpu-moe"])
    executor, config = model.engine.executor, tiny.model.config
    layers = executor.model.layers
    expert_bytes = [sum(getattr(w, s).raw.nbytes for s in EXPERTS) // config.n_expert for w in layers]
    chosen: list[int] = []  # experts used, by each router call in turn (layer 0, 1, 0, 1, ... as run)

    def recorded(logits, k, normalize):
        weights, ids = route(logits, k, normalize)
        chosen.append(ids.unique().numel())
        return weights, ids

    def recorded_tokens(x, w, k, normalize):  # a few tokens' logits and choice in one launch
        routed = route_tokens(x, w, k, normalize)
        if routed is not None:
            chosen.append(routed[1].unique().numel())
        return routed

    # after the load: its decode graph has no host read
    monkeypatch.setattr(moe_ops, "route", recorded)
    monkeypatch.setattr(router_kernel, "route_tokens", recorded_tokens)

    def prefill(ids: list[int]) -> tuple[torch.Tensor, int]:
        model.engine.reset()
        chosen.clear()
        before = executor.bytes_streamed
        logits = model.engine.prefill(ids, all_logits=True)
        streamed = executor.bytes_streamed - before
        assert streamed == sum(n * expert_bytes[j % len(layers)] for j, n in enumerate(chosen))
        return logits, streamed

    for ids, expected in zip(tiny.prompts, expected_logits, strict=True):
        logits, streamed = prefill(ids)
        assert streamed > 0
        assert most_rows_close(logits, expected)
    _, streamed = prefill(tiny.prompts[0][:2])
    if 2 * config.n_expert_used < config.n_expert:  # two tokens cannot use every expert
        assert 0 < streamed < sum(expert_bytes) * config.n_expert


@pytest.mark.gpu
@pytest.mark.parametrize("tiny", ONE_TYPE, indirect=True, ids="-".join)
def test_no_op_offload_keeps_a_prompts_experts_on_the_cpu(tiny, monkeypatch):
    monkeypatch.setattr(expert_staging, "staging_threshold", lambda layers, k, device: 2)
    model = llmx.load(tiny.path, ctx_size=128, ubatch_size=32, **OPTIONS, **CPU_EXPERTS["cpu-moe"],
                      no_op_offload=True)  # fmt: skip
    for ids, expected in zip(tiny.prompts, reference_prompt_logits(tiny), strict=True):
        model.engine.reset()
        assert most_rows_close(model.engine.prefill(ids, all_logits=True), expected)
    assert model.engine.executor.bytes_streamed == 0


@pytest.mark.gpu
def test_the_staging_threshold_is_measured_once_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMX_CACHE_DIR", str(tmp_path))  # measured, not read from this machine's cache
    layer, gpu = stacks("Q8_0", 8, 0), torch.device("cuda:0")
    threshold = expert_staging.staging_threshold([layer], 2, gpu)
    assert 2 <= threshold < NEVER
    kept = {k: v for k, v in remembered(THRESHOLD_FILE).items() if k.startswith("experts|")}
    assert list(kept.values()) == [threshold]
