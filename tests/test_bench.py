"""Benchmarks: floor arithmetic by hand, tables, JSON, the plot, and runs on a tiny model."""

from __future__ import annotations

import argparse

import pytest

from llmx.bench.floor import floor_seconds, mean_depth, plan_token_bytes, roofline, token_bytes
from llmx.bench.grid import expand, int_list, option_grid
from llmx.errors import LlmxError
from llmx.plan.devices import parse_devices
from llmx.plan.model import ModelSpec
from llmx.plan.options import Options, add_options, options_from_args
from llmx.plan.planner import place
from llmx.plan.shapes import get_shape

GB = 10**9

# --- the floor, by hand ---


def test_floor_of_a_hybrid_moe_placement_by_hand():
    tensors = [
        ("token_embd.weight", 5 * GB, "cpu"),  # looked up, not read: excluded
        ("output.weight", 1 * GB, "cuda:0"),
        ("blk.0.attn_q.weight", 3 * GB, "cuda:0"),
        ("blk.1.ffn_up_exps.weight", 8 * GB, "cpu"),  # 2 of 8 experts read: 2 GB
    ]
    tb = token_bytes(tensors, {"cuda:0": 1e6}, n_expert_used=2, n_expert=8)
    assert tb.weights == {"cpu": 2 * GB, "cuda:0": 4 * GB}
    # one token at depth 1000: cuda:0 reads 4 GB + 1000 * 1 MB = 5 GB, the CPU 2 GB
    assert tb.at_depth(1000) == {"cpu": 2 * GB, "cuda:0": 5 * GB}
    # 5 GB / 1000 GB/s + 2 GB / 100 GB/s = 5 ms + 20 ms
    assert floor_seconds(tb.at_depth(1000), {"cuda:0": 1000, "cpu": 100}) == pytest.approx(0.025)
    r = roofline(tb, n_depth=1000, n_gen=1, bandwidth_gbs={"cuda:0": 1000, "cpu": 100})
    assert r.bytes_per_token == 7 * GB
    assert r.floor_tps() == pytest.approx(40)
    assert r.percent_of_floor(20) == pytest.approx(50)
    assert r.gbs(20) == pytest.approx(140)


def test_tied_embeddings_are_read_as_the_output_matrix():
    tb = token_bytes([("token_embd.weight", 2 * GB, "cpu"), ("blk.0.attn_q.weight", GB, "cpu")], {})
    assert tb.weights == {"cpu": 3 * GB}


def test_floor_is_unknown_without_the_bandwidth_of_a_device_holding_bytes():
    assert floor_seconds({"cpu": GB, "cuda:0": GB}, {"cpu": 100}) is None
    assert floor_seconds({"cpu": GB, "cuda:0": 0}, {"cpu": 100}) == pytest.approx(0.01)


def test_mean_depth_of_a_generation_test():
    # tokens attend over 512, 513, ..., 512 + 127 positions: the mean is 512 + 63.5
    assert mean_depth(512, 128) == 575.5
    assert mean_depth(0, 0) == 0


# --- ceilings ---


def test_cpu_ceilings_are_measured_cached_and_reused(tmp_path, monkeypatch):
    from llmx.bench import ceilings

    monkeypatch.setenv("LLMX_CACHE_DIR", str(tmp_path))
    small = ceilings.measure_cpu(size_bytes=64 << 20, matmul_n=256, reps=2)
    monkeypatch.setattr(ceilings, "measure_cpu", lambda: small)
    notes = []
    first = ceilings.ceilings_for(["cpu"], notify=notes.append)["cpu"]
    assert first.mem_gbs > 0 and first.matmul_tflops > 0 and first.threads >= 1 and len(notes) == 1
    assert (tmp_path / "ceilings.json").exists()
    monkeypatch.setattr(ceilings, "measure_cpu", lambda: pytest.fail("a cached device was re-measured"))
    assert ceilings.ceilings_for(["cpu"], notify=notes.append)["cpu"] == first and len(notes) == 1


def test_a_corrupt_ceilings_cache_reads_as_empty(tmp_path):
    from llmx.bench.ceilings import load_cache

    (tmp_path / "ceilings.json").write_text("{not json")
    assert load_cache(tmp_path / "ceilings.json") == {}


@pytest.mark.parametrize(
    ("recipe", "ngl", "floor_tps"),
    [("Q4_K_M", 99, 903), ("Q8_0", 99, 523), ("Q4_K_M", 0, 19.5)],
)
def test_floor_of_a_planned_llama3_8b_matches_the_anchor_numbers(recipe, ngl, floor_tps):
    # bench/ANCHORS: H200 4178 GB/s, CPU 90 GB/s; tg128 on a synthetic Llama-3-8B.
    spec = ModelSpec.from_shape(get_shape("llama3-8b"), recipe)
    plan = place(spec, parse_devices("cuda0=141GiB,cpu=125GiB"), Options(n_gpu_layers=ngl))
    tb = plan_token_bytes(plan, [(t.name, t.nbytes) for t in spec.tensors], 0, 0)
    r = roofline(tb, n_depth=0, n_gen=128, bandwidth_gbs={"cuda:0": 4178, "cpu": 90})
    assert r.floor_tps() == pytest.approx(floor_tps, rel=0.01)


def test_moe_floor_reads_only_the_active_experts():
    spec = ModelSpec.from_shape(get_shape("qwen3-30b-a3b"), "Q4_K_M")
    plan = place(spec, parse_devices("cpu=125GiB"), Options())
    tensors = [(t.name, t.nbytes) for t in spec.tensors]
    active = plan_token_bytes(plan, tensors, n_expert_used=8, n_expert=128).weights["cpu"]
    every = plan_token_bytes(plan, tensors, n_expert_used=128, n_expert=128).weights["cpu"]
    experts = sum(n for name, n in tensors if "_exps." in name)
    assert every - active == pytest.approx(experts * 120 / 128)


# --- value lists ---


def test_value_lists_and_ranges_expand_like_llama_bench():
    assert expand("0,16,99") == ["0", "16", "99"]
    assert expand("0-32+8") == ["0", "8", "16", "24", "32"]
    assert expand("1-8*2") == ["1", "2", "4", "8"]
    assert int_list("128, 512") == [128, 512]
    with pytest.raises(LlmxError):
        int_list("a,b")


def test_option_grid_gives_one_options_per_combination():
    parser = argparse.ArgumentParser()
    add_options(parser)
    args = parser.parse_args(["-ngl", "0,16", "-ctk", "f16,q8_0", "-ot", "exps=CPU;output=CPU,exps=CUDA0",
                              "-ts", "3/1", "--devices", "cuda0=16GiB,cpu=64GiB"])  # fmt: skip
    combos = [options_from_args(ns) for ns in option_grid(args)]
    assert len(combos) == 2 * 2 * 2
    assert {(o.n_gpu_layers, o.cache_type_k) for o in combos} == {
        (0, "f16"),
        (0, "q8_0"),
        (16, "f16"),
        (16, "q8_0"),
    }
    assert {o.override_tensor for o in combos} == {(("exps", "CPU"), ("output", "CPU")), (("exps", "CUDA0"),)}
    assert all(o.tensor_split == (3.0, 1.0) and o.devices == "cuda0=16GiB,cpu=64GiB" for o in combos)
