"""Placement semantics, option by option, and the two worked examples of the seeds."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from llmx.errors import LlmxError
from llmx.plan import ModelSpec, Options, get_shape, parse_devices, place, plan
from llmx.plan.devices import GiB, parse_size
from llmx.plan.memory import compute_bytes, context_length, kv_layer_bytes, kv_rows, stream_bytes

SEED_MACHINE = "cuda0=16GiB,cuda1=8GiB,cpu=64GiB"
# The seed's RTX 4080 also drives the display: 2.5 GiB of it is in use before llmx starts.
SEED_MACHINE_IN_USE = "cuda0=16GiB:free=13.5GiB:name=RTX 4080,cuda1=8GiB:name=RTX 3070,cpu=64GiB"


def model(name: str, recipe: str = "Q4_K_M") -> ModelSpec:
    return ModelSpec.from_shape(get_shape(name), recipe)


def layers_on(p, device: str) -> list[int]:
    return [i for i, d in enumerate(p.layer_device) if d == device]


# --- seed 003: a 70B model over a 16 GB and an 8 GB GPU and the CPU, -ngl 55 ---


def test_seed_70b_ngl55_puts_the_first_25_layers_on_the_cpu_and_splits_55_by_free_memory():
    p = plan(model("llama3-70b", "Q3_K_S"), parse_devices(SEED_MACHINE_IN_USE), Options(n_gpu_layers=55))
    assert layers_on(p, "cpu") == list(range(25))
    assert layers_on(p, "cuda:0") == list(range(25, 60))  # 35 layers
    assert layers_on(p, "cuda:1") == list(range(60, 80))  # 20 layers
    assert p.output_device == "cpu" and p.device_of("output.weight") == "cpu"
    assert p.device_of("token_embd.weight") == "cpu"
    assert p.offloaded_line == "offloaded 55/81 layers to GPU"
    assert p.over_budget() == [] and p.warnings == ()
    assert p.device_of("blk.24.ffn_down.weight") == "cpu" and p.kv_device(24) == "cpu"
    assert p.device_of("blk.59.attn_q.weight") == "cuda:0" and p.kv_device(60) == "cuda:1"
    # about 0.4 GB a layer, as the seed's 14.5 + 7.2 GB for 55 layers implies
    per_layer = [u.weights + u.kv for u in p.usage if u.device.startswith("cuda")]
    assert sum(per_layer) / 55 == pytest.approx(0.4e9, rel=0.05)


def test_equal_free_memory_split_follows_llama_cpp_rounding():
    # 2:1 free memory: llama.cpp's split point 2/3 of 55 GPU layers gives 37 and 18.
    p = plan(model("llama3-70b", "Q3_K_S"), parse_devices(SEED_MACHINE), Options(n_gpu_layers=55))
    assert (len(layers_on(p, "cuda:0")), len(layers_on(p, "cuda:1"))) == (37, 18)


def test_seed_70b_at_q4_k_m_names_the_device_over_budget_and_fit_chooses_fewer_layers():
    m, inv = model("llama3-70b", "Q4_K_M"), parse_devices(SEED_MACHINE_IN_USE)
    p = plan(m, inv, Options(n_gpu_layers=55))
    problems = p.over_budget()
    assert problems and all("over budget by" in e and "GiB free" in e for e in problems)
    assert any(e.startswith("cuda:1 is over budget by") for e in problems)
    with pytest.raises(LlmxError, match="over budget"):
        p.check()
    fitted = plan(m, inv, Options(n_gpu_layers=55, fit=True))
    assert fitted.n_offloaded < 55 and fitted.fits({u.device: u.margin for u in fitted.usage})
    assert fitted.layer_device[:25] == ("cpu",) * 25 and fitted.notes


# --- seed 004: Qwen3-235B over 2x5090 + 2x4090 with four -ot rules ---

QWEN_RULES = [
    r"blk\.([0-9]|1[0-5])\.ffn=CUDA0",
    r"blk\.(1[6-9]|2[0-7])\.ffn=CUDA1",
    r"blk\.(2[8-9]|3[0-9])\.ffn=CUDA2",
    r"blk\.(4[0-9]|5[0-5])\.ffn=CUDA3",
    "exps=CPU",
]


def test_seed_qwen3_235b_ot_rules_pin_each_layer_ranges_ffn_to_its_gpu():
    inv = parse_devices("cuda0=32GiB,cuda1=24GiB,cuda2=24GiB,cuda3=32GiB,cpu=256GiB")
    opts = Options(n_gpu_layers=100, override_tensor=QWEN_RULES, ctx_size=65536, cache_type_k="q8_0",
                   cache_type_v="q8_0", flash_attn="on", batch_size=4096, ubatch_size=4096)  # fmt: skip
    m = model("qwen3-235b-a22b")
    p = plan(m, inv, opts)
    ranges = {
        "cuda:0": range(0, 16),
        "cuda:1": range(16, 28),
        "cuda:2": range(28, 40),
        "cuda:3": range(40, 56),
    }
    for gpu, layers in ranges.items():
        for i in layers:
            for t in m.tensors:
                if t.name.startswith(f"blk.{i}.ffn"):
                    assert p.device_of(t.name) == gpu, t.name
    for i in range(56, 94):  # no rule for them: experts go to the CPU, the rest follows -ngl
        assert p.device_of(f"blk.{i}.ffn_up_exps.weight") == "cpu"
        assert p.device_of(f"blk.{i}.ffn_gate_inp.weight") == p.layer_device[i] != "cpu"
    assert all(d != "cpu" for d in p.layer_device) and p.output_device != "cpu"
    assert p.offloaded_line == "offloaded 95/95 layers to GPU"
    assert p.over_budget() == [] and p.warnings == ()


# --- option semantics ---


@pytest.mark.parametrize(
    ("ngl", "cpu_layers", "output", "offloaded"),
    [
        (0, 32, "cpu", 0),
        (10, 22, "cpu", 10),
        (32, 0, "cpu", 32),
        (33, 0, "cuda:0", 33),
        (999, 0, "cuda:0", 33),
    ],
)
def test_ngl_offloads_the_last_layers_and_the_output_only_past_n_layer(ngl, cpu_layers, output, offloaded):
    p = place(model("llama3-8b"), parse_devices("cuda0=80GiB,cpu=64GiB"), Options(n_gpu_layers=ngl))
    assert layers_on(p, "cpu") == list(range(cpu_layers))
    assert (p.output_device, p.n_offloaded) == (output, offloaded)
    assert p.device_of("token_embd.weight") == "cpu"


def test_tensor_split_proportions_and_main_gpu_for_split_mode_none():
    m, inv = model("llama3-8b"), parse_devices("cuda0=24GiB,cuda1=24GiB,cpu=64GiB")
    p = place(m, inv, Options(n_gpu_layers=999, tensor_split=(3, 1)))
    assert (len(layers_on(p, "cuda:0")), len(layers_on(p, "cuda:1"))) == (25, 7)
    assert p.output_device == "cuda:1"
    none = place(m, inv, Options(n_gpu_layers=999, split_mode="none", main_gpu=1))
    assert set(none.layer_device) == {"cuda:1"} and none.output_device == "cuda:1"
    assert none.warnings == ("cuda:0 is left empty: -sm none uses only -mg 1",)


def test_row_split_of_a_model_whose_layers_cannot_be_divided_keeps_them_on_the_main_gpu():
    """-sm row divides heads and FFN columns (tests/test_tensor_parallel.py); expert stacks cannot be,
    so such a model's layers stay whole on the main GPU, with a warning; its output rows still split."""
    m, inv = model("qwen3-30b-a3b"), parse_devices("cuda0=24GiB,cuda1=24GiB,cpu=64GiB")
    p = place(m, inv, Options(n_gpu_layers=999, split_mode="tensor", tensor_split=(1, 1), main_gpu=1))
    assert p.split == () and p.row_split("blk.3.attn_q.weight") is None
    assert p.device_of("blk.3.ffn_up_exps.weight") == "cuda:1" and p.kv_device(3) == "cuda:1"
    assert p.warnings == (
        "-sm row: its layers hold matrices only one GPU can multiply (ffn_down_exps, ffn_gate_exps, "
        "ffn_gate_inp, ffn_up_exps); the layers run whole on cuda:1",
    )
    assert p.row_split("output.weight") == (("cuda:0", 0, 75968), ("cuda:1", 75968, 151936))  # 64-row cuts


def test_override_rules_first_match_wins_over_layers():
    m, inv = model("llama3-8b"), parse_devices("cuda0=24GiB,cuda1=24GiB,cpu=64GiB")
    opts = Options(
        n_gpu_layers=0, override_tensor=[r"blk\.1\.=CUDA1", r"blk\.1\d*\.=CUDA0", "token_embd=CUDA0"]
    )
    p = place(m, inv, opts)
    assert p.device_of("blk.1.attn_q.weight") == "cuda:1"
    assert p.device_of("blk.12.attn_q.weight") == "cuda:0"
    assert p.device_of("blk.2.attn_q.weight") == "cpu" and p.kv_device(1) == "cpu"
    assert p.device_of("token_embd.weight") == "cuda:0"


def test_each_override_rule_notes_what_it_took():
    """A regex searched anywhere in a name can take more than meant: `output\\.weight` also takes every
    blk.N.attn_output.weight, and the plan says so; `^output` takes the output layer alone."""
    m, inv = model("llama3-8b"), parse_devices("cuda0=24GiB,cpu=64GiB")
    loose = place(m, inv, Options(n_gpu_layers=23, override_tensor=[r"output\.weight=CUDA0"]))
    note = next(n for n in loose.notes if n.startswith("-ot output"))
    assert note.startswith(r"-ot output\.weight=CUDA0 put 33 tensors on cuda:0: blk.0.attn_output.weight, ")
    assert loose.device_of("blk.0.attn_output.weight") == "cuda:0"
    anchored = place(m, inv, Options(n_gpu_layers=23, override_tensor=["^output=CUDA0"]))
    assert "-ot ^output=CUDA0 put 2 tensors on cuda:0: output_norm.weight, output.weight" in anchored.notes
    assert anchored.device_of("blk.0.attn_output.weight") == "cpu"


def test_override_errors_and_unmatched_warning():
    m, inv = model("llama3-8b"), parse_devices("cuda0=24GiB,cpu=64GiB")
    with pytest.raises(LlmxError, match=r"unknown buffer type 'CUDA3' in -ot; available: CPU, CUDA0"):
        place(m, inv, Options(override_tensor=["exps=CUDA3"]))
    with pytest.raises(LlmxError, match=re.escape(r"bad regular expression 'blk\.('")):
        Options(override_tensor=[r"blk\.(=CPU"])
    p = place(m, inv, Options(n_gpu_layers=10, override_tensor=["exps=CPU"], cpu_moe=True))
    assert p.warnings == ("-ot exps=CPU matched no tensor", "--cpu-moe matched no tensor")


def test_cpu_moe_and_n_cpu_moe_keep_experts_on_the_cpu():
    m, inv = model("qwen3-30b-a3b"), parse_devices("cuda0=80GiB,cpu=64GiB")
    p = place(m, inv, Options(n_gpu_layers=999, n_cpu_moe=5))
    assert [p.device_of(f"blk.{i}.ffn_down_exps.weight") for i in (0, 4, 5)] == ["cpu", "cpu", "cuda:0"]
    assert (
        p.device_of("blk.0.ffn_gate_inp.weight") == "cuda:0"
        and p.device_of("blk.0.attn_k.weight") == "cuda:0"
    )
    every = place(m, inv, Options(n_gpu_layers=999, cpu_moe=True))
    assert {every.device_of(t.name) for t in m.tensors if t.role == "experts"} == {"cpu"}


def test_no_kv_offload_keeps_the_cache_on_the_cpu():
    p = place(
        model("llama3-8b"),
        parse_devices("cuda0=24GiB,cpu=64GiB"),
        Options(n_gpu_layers=999, no_kv_offload=True),
    )
    assert set(p.kv_devices) == {"cpu"} and p.device_use("cuda:0").kv == 0
    assert p.device_use("cpu").kv == 32 * kv_layer_bytes(model("llama3-8b"), Options(), 0)


def test_kv_cache_bytes():
    m = model("llama3-8b")
    assert kv_layer_bytes(m, Options(), 0) == 4096 * 2 * 1024 * 2  # K and V, 8 heads x 128, f16
    q8 = Options(cache_type_k="q8_0", cache_type_v="q8_0")
    assert kv_layer_bytes(m, q8, 0) == 4096 * 2 * 1024 * 34 // 32
    assert kv_layer_bytes(m, Options(ctx_size=1000), 0) == 1024 * 2 * 1024 * 2  # padded to 256 tokens
    ds = model("deepseek-r1", "IQ4_KS")
    assert kv_layer_bytes(ds, Options(), 0) == 4096 * 576 * 2  # MLA: one latent, V read from it


def test_tied_embeddings_get_a_copy_on_the_output_gpu():
    m = ModelSpec.from_shape(get_shape("smollm2-135m"), "Q8_0")
    p = place(m, parse_devices("cuda0=8GiB,cpu=8GiB"), Options(n_gpu_layers=999))
    embd = next(t.nbytes for t in m.tensors if t.name == "token_embd.weight")
    assert p.device_of("token_embd.weight") == "cpu" and p.extra_copies == {"token_embd.weight": "cuda:0"}
    assert p.device_use("cuda:0").weights == m.nbytes - embd + embd


def test_every_tensor_is_placed_once_and_bytes_add_up():
    m = model("deepseek-v3", "Q4_K_M")
    p = place(m, parse_devices("cuda0=80GiB,cuda1=80GiB,cpu=512GiB"), Options(n_gpu_layers=40, n_cpu_moe=10))
    assert set(p.tensor_device) == {t.name for t in m.tensors}
    assert sum(u.weights for u in p.usage) == m.nbytes


def test_no_gpu_runs_everything_on_the_cpu():
    p = plan(model("llama3-8b"), parse_devices("cpu=64GiB"), Options(n_gpu_layers=20))
    assert set(p.tensor_device.values()) == {"cpu"} and p.n_offloaded == 0
    assert p.warnings == ("no GPU: -ngl 20 has no effect, everything runs on the CPU",)


def test_bad_split_options():
    m, inv = model("llama3-8b"), parse_devices("cuda0=24GiB,cuda1=24GiB,cpu=64GiB")
    with pytest.raises(LlmxError, match="-ts gives 3 proportions but this machine has 2 GPU"):
        place(m, inv, Options(n_gpu_layers=10, tensor_split=(1, 1, 1)))
    with pytest.raises(LlmxError, match="-mg 2"):
        place(m, inv, Options(main_gpu=2))


# --- devices ---


def test_device_descriptions():
    inv = parse_devices("cuda1=8GiB, cuda0=16GiB:free=13.5GiB:bw=717GB/s:name=RTX 4080, cpu=64G")
    assert [g.name for g in inv.gpus] == ["cuda:0", "cuda:1"]
    g0 = inv.gpus[0]
    assert (g0.total, g0.free, g0.bandwidth, g0.label) == (16 * GiB, int(13.5 * GiB), 717e9, "RTX 4080")
    assert inv.cpu.total == 64 * GiB and inv.bufts() == ["CPU", "CUDA0", "CUDA1"]
    assert parse_size("24GB") == 24 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert not parse_devices("cuda0=8GiB").cpu.known


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cuda0=16", "with a unit"),
        ("gpu0=16GiB", "unknown device 'gpu0'"),
        ("cuda1=8GiB", "without gaps"),
        ("cuda0=8GiB:free=9GiB", "exceeds its total"),
        ("cuda0=8GiB:speed=1", "unknown field 'speed'"),
        ("cuda0", "NAME=SIZE"),
    ],
)
def test_bad_device_descriptions(text, message):
    with pytest.raises(LlmxError, match=message):
        parse_devices(text)


def test_the_planner_and_a_dry_run_never_import_torch():
    code = (
        "import sys, contextlib, io\n"
        "import llmx.plan, llmx.commands.plan\n"
        "from llmx.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['plan', '--shape', 'llama3-8b:Q4_K_M', '--devices', 'cuda0=8GiB,cpu=32GiB'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- compute scratch: what the runtime's kernels allocate ---


def test_the_planners_copies_of_runtime_sizes_match_the_runtime():
    """The planner imports no torch, so it keeps its own copies of the runtime's buffer sizes."""
    from llmx.plan import memory
    from llmx.quant import choice, weight
    from llmx.quant.triton import matmul

    assert memory.GPU_DEQUANT_MIN_M == choice.DEQUANT_MIN_M
    assert memory.GPU_DEQUANT_CHUNK_BYTES == matmul.DEQUANT_CHUNK_BYTES
    assert memory.CPU_DEQUANT_CHUNK_BYTES == weight.DEQUANT_CHUNK_BYTES


def test_prompt_attention_stores_no_scores_but_fa_off_does():
    m = model("llama3-8b")
    g = dataclasses.replace(
        m, config=dataclasses.replace(m.config, sliding_window=1024)
    )  # as Gemma 3's local layers
    opts = Options(ctx_size=32768)

    def attn(spec: ModelSpec, gpu: bool, ctx: int, fa: str = "auto") -> int:
        o = opts.replace(ctx_size=ctx, flash_attn=fa)
        return compute_bytes(spec, o, attention=True, ffn=False, output=False, inp=False, gpu=gpu)

    # GPU, full attention: grows with the context through K/V only (MB per 1k tokens, not 100s)
    assert attn(m, True, 32768) - attn(m, True, 4096) < 32768 * 32 * 128 * 2 * 2
    # the CPU's flash kernel: K and V in float32 and the mask grow with the context, not the scores
    # (under a quarter of the growth of one float32 copy of them)
    assert attn(m, False, 32768) - attn(m, False, 4096) < 512 * (32768 - 4096) * 32 * 4 // 4
    # -fa off: the CPU's math path stores a score per (head, query, key): over -ub x ctx x heads bytes
    scores = 512 * 32768 * 32 * 4  # one float32 copy of them
    assert attn(m, False, 32768) < scores // 2 and attn(m, False, 32768, "off") > 13 * scores // 4
    # a GPU's Triton prompt kernel takes sliding windows too: nothing grows with the window's layers
    assert attn(g, True, 32768) == attn(m, True, 32768)
    # heads wider than that kernel takes go to PyTorch's kernels, K and V repeated to every query head
    wide = dataclasses.replace(m, config=dataclasses.replace(m.config, head_dim=512, head_dim_v=512))
    assert attn(wide, True, 32768) - attn(wide, True, 4096) >= (32768 - 4096) * 32 * 512 * 2 * 2
    # -fa off: a GPU attends over stored scores as the CPU does (llama.cpp's attention without -fa)
    off = opts.replace(flash_attn="off")
    assert (
        compute_bytes(m, off, attention=True, ffn=False, output=False, inp=False, gpu=True)
        > 512 * 32768 * 32 * 13
    )


def test_a_gpu_prompt_over_a_block_cache_plans_its_f16_copy():
    """A GPU prompt converts a block cache's rows into f16 before the flash kernel reads them
    (`prefill_attention.DEQUANTIZE_FIRST_TILES`): K and V of every position in f16, on the GPU only."""
    m, opts = model("llama3-8b"), Options(ctx_size=32768)

    def attn(gpu: bool, cache_type: str) -> int:
        o = opts.replace(cache_type_k=cache_type, cache_type_v=cache_type)
        return compute_bytes(m, o, attention=True, ffn=False, output=False, inp=False, gpu=gpu)

    ctx = context_length(m, opts)
    assert attn(True, "q8_0") - attn(True, "f16") == ctx * 8 * (128 + 128) * 2
    assert attn(False, "q8_0") == attn(False, "f16")


def test_op_offload_buffers_are_reserved_on_the_first_gpu_or_planned_off():
    m = model("llama3-8b")
    roomy = plan(m, parse_devices("cuda0=80GiB,cpu=64GiB"), Options(n_gpu_layers=16))
    assert roomy.op_offload and not any("op offload" in n for n in roomy.notes)
    without = place(m, parse_devices("cuda0=80GiB,cpu=64GiB"), Options(n_gpu_layers=16, no_op_offload=True))
    cpu_layers = [i for i, d in enumerate(roomy.layer_device) if d == "cpu"]
    added = stream_bytes(m, cpu_layers)
    assert added > 0 and not without.op_offload
    gpu = next(u for u in roomy.usage if u.device == "cuda:0")
    assert gpu.compute - next(u for u in without.usage if u.device == "cuda:0").compute == added

    # a GPU with room for its layers but not for the streamed ones: planned off, with a note
    weights_16 = gpu.weights + gpu.kv + gpu.compute - added
    tight = parse_devices(f"cuda0={(weights_16 + 1.1 * GiB) / GiB:.3f}GiB,cpu=64GiB")  # margin 1 GiB
    p = place(m, tight, Options(n_gpu_layers=16))
    assert not p.op_offload and p.over_budget() == []
    assert any(n.startswith("op offload off: streaming CPU layers to cuda:0") for n in p.notes)
    # with no layer on a GPU (-ngl 0), the main GPU runs the prompts, as llama.cpp's does
    two_gpus = parse_devices("cuda0=80GiB,cuda1=24GiB,cpu=64GiB")
    none_on = place(m, two_gpus, Options(n_gpu_layers=0, main_gpu=1))
    assert none_on.op_offload == "cuda:1"
    layer_scratch = compute_bytes(
        m, Options(n_gpu_layers=0), attention=True, ffn=True, output=False, inp=False, gpu=True
    )
    streamed = stream_bytes(m, list(range(m.config.n_layer)))
    assert next(u for u in none_on.usage if u.device == "cuda:1").compute == streamed + layer_scratch
    assert not place(m, parse_devices("cpu=64GiB"), Options(n_gpu_layers=0)).op_offload


def test_sliding_window_layers_keep_a_ring_of_window_plus_ubatch_positions():
    llama = model("llama3-8b")
    config = dataclasses.replace(llama.config, sliding_window=1024, sliding_window_pattern=6)
    gemma_like = dataclasses.replace(llama, config=config)
    opts = Options(ctx_size=32768, ubatch_size=512)
    assert [kv_rows(gemma_like, opts, i) for i in range(7)] == [1536] * 5 + [32768, 1536]
    assert kv_rows(gemma_like, opts.replace(ctx_size=1024), 0) == 1024  # a context below the ring
    assert kv_layer_bytes(gemma_like, opts, 0) * 32768 == kv_layer_bytes(gemma_like, opts, 5) * 1536
    p = place(gemma_like, parse_devices("cpu=256GiB"), opts)
    assert p.kv_rows[:6] == (1536,) * 5 + (32768,)
    assert p.device_use("cpu").kv == sum(kv_layer_bytes(gemma_like, opts, i) for i in range(32))
