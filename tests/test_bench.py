"""Benchmarks: floor arithmetic by hand, tables, JSON, the plot, and runs on a tiny model."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from bench.kernels import gpu_state, parse_shapes, sustained, table_row
from llmx import cli
from llmx.bench.floor import Roofline, floor_seconds, mean_depth, plan_token_bytes, roofline, token_bytes
from llmx.bench.grid import expand, int_list, option_grid
from llmx.bench.plot import plot_sweeps
from llmx.bench.rows import BENCH_COLUMNS, SWEEP_COLUMNS, bench_columns, bench_row, sweep_row
from llmx.bench.runner import BenchTest, Speed, bench_tests, time_test
from llmx.bench.sweep import sweep
from llmx.bench.synth import synthesize
from llmx.bench.tables import csv_text, json_text, markdown
from llmx.engine import Timings
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
    tb = token_bytes(tensors, {"cuda:0": ((1e6, 4096),)}, n_expert_used=2, n_expert=8)
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


def test_a_sliding_window_ring_is_read_only_as_far_as_it_holds():
    """A token reads every position of a full-context cache up to its depth, but of a sliding-window
    layer's ring at most the positions the ring holds."""
    tb = token_bytes([("blk.0.attn_q.weight", GB, "cpu")], {"cpu": ((100.0, 4096), (100.0, 520))})
    assert tb.at_depth(300) == {"cpu": GB + 100 * 300 + 100 * 300}
    assert tb.at_depth(1000) == {"cpu": GB + 100 * 1000 + 100 * 520}


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


@pytest.mark.parametrize(("free_pages", "want_gib"), [(1 << 30, 4.0), (1 << 20, 1.0), (1 << 16, 0.25)])
def test_the_ram_probe_is_4_gib_or_a_quarter_of_free_memory(monkeypatch, free_pages, want_gib):
    from llmx.bench import ceilings

    # 4 KiB pages: 4 TiB, 4 GiB and 256 MiB free -> 4 GiB, a quarter (1 GiB), and no less than 256 MiB
    monkeypatch.setattr(ceilings.os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else free_pages)
    assert ceilings.ram_probe_bytes() == want_gib * (1 << 30)


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


# --- timing loops, on an engine that only counts ---


class CountingEngine:
    """Stands in for llmx.engine.Engine: records calls, keeps n_past like the real one."""

    def __init__(self) -> None:
        self.n_past, self.calls, self.timings = 0, [], Timings()

    def reset(self) -> None:
        self.n_past, self.timings = 0, Timings()
        self.calls.append(("reset",))

    def prefill(self, ids):
        self.calls.append(("prefill", self.n_past, len(ids)))
        self.n_past += len(ids)

    def token_ids(self, ids):
        return torch.tensor(ids)

    def decode(self, token, on_device=False):
        self.calls.append(("decode", self.n_past))
        self.n_past += 1
        self.timings.gen_tokens += 1
        self.timings.gen_host_seconds += 0.001
        return torch.zeros(8)

    def synchronize(self) -> None:
        pass


def test_tests_follow_llama_bench_order_and_names():
    tests = bench_tests([512], [128], [0, 4096])
    assert [t.name for t in tests] == ["pp512", "tg128", "pp512 @ d4096", "tg128 @ d4096"]
    assert tests[3].n_ctx == 4096 + 128


def test_time_test_fills_the_depth_untimed_once_and_rewinds_to_it_for_each_repetition():
    engine = CountingEngine()
    samples = time_test(engine, BenchTest(0, 3, n_depth=10), reps=2, n_vocab=100)
    assert len(samples) == 2  # the warm-up is not a sample
    steps = [("decode", 10), ("decode", 11), ("decode", 12)]
    assert engine.calls == [("reset",), ("prefill", 0, 10)] + steps * 3


def test_prompt_tests_warm_up_twice_so_that_timed_runs_replay_the_prompt_graph():
    engine = CountingEngine()
    samples = time_test(engine, BenchTest(16, 0), reps=3, n_vocab=100)
    assert len(samples) == 3
    # 2 warm-ups (eager, capture) + 3 timed, each from position 0
    assert engine.calls == [("reset",)] + [("prefill", 0, 16)] * 5


def test_speed_reports_llama_bench_statistics():
    s = Speed(n_tokens=100, samples_s=(1.0, 0.5))
    assert s.samples_ts == [100, 200] and s.avg_ts == 150
    assert s.stddev_ts == pytest.approx(70.7107, rel=1e-4)  # sample stddev, as llama-bench
    assert s.samples_ns == [10**9, 5 * 10**8]


def test_sweep_times_each_window_and_drops_the_generated_tokens():
    engine = CountingEngine()
    rows = list(sweep(engine, n_ctx=64, n_ubatch=16, n_gen=4, n_vocab=100))
    assert [r["n_kv"] for r in rows] == [0, 16, 32, 48]
    assert all(r["pp"] == 16 and r["tg"] == 4 and r["speed_pp"] > 0 and r["rss_bytes"] > 0 for r in rows)
    # the last window: 4 decodes at 48..51, then the prompt ubatch again from 48
    assert engine.calls[-5:] == [
        ("decode", 48),
        ("decode", 49),
        ("decode", 50),
        ("decode", 51),
        ("prefill", 48, 16),
    ]
    with pytest.raises(LlmxError, match="-ub"):
        list(sweep(engine, n_ctx=8, n_ubatch=16, n_gen=4, n_vocab=100))


def test_sweep_of_a_single_window_fills_the_whole_context():
    engine = CountingEngine()
    rows = list(sweep(engine, n_ctx=16, n_ubatch=16, n_gen=4, n_vocab=100))
    assert [r["n_kv"] for r in rows] == [0]
    assert max(c[1] + (c[2] if c[0] == "prefill" else 1) for c in engine.calls if c[0] != "reset") == 16


# --- rows, tables, plot ---

ENV = {"llmx_commit": "abc", "cpu": "BenchTest CPU", "gpus": []}
MODEL = {"model_filename": "m.gguf", "model_name": "m", "model_arch": "llama", "model_ftype": "Q4_K_M",
         "model_size": 2**30, "model_n_params": 10**9}  # fmt: skip
PLACEMENT = {"devices": ["cpu"], "summary": "default", "plan": {}, "bandwidth_gbs": {"cpu": 10.0},
             "load_seconds": 0.1, "n_offloaded": 0}  # fmt: skip
LLAMA_BENCH_FIELDS = [
    "n_prompt", "n_gen", "n_depth", "avg_ts", "stddev_ts", "samples_ts", "avg_ns", "stddev_ns", "samples_ns",
    "model_type", "model_size", "model_n_params", "n_threads", "type_k", "type_v", "n_gpu_layers",
    "build_commit", "cpu_info", "backends", "test_time",
]  # fmt: skip


def bench_rows() -> list[dict]:
    roof = Roofline(bytes_per_token=10**9, floor_seconds=0.1)
    return [
        bench_row(ENV, MODEL, Options(), PLACEMENT, BenchTest(512, 0), Speed(512, (1.0, 1.0)), roof),
        bench_row(ENV, MODEL, Options(), PLACEMENT, BenchTest(0, 128), Speed(128, (25.6, 25.6)), roof),
    ]


def test_bench_rows_carry_llama_bench_fields_and_the_floor_for_generation_only():
    pp, tg = bench_rows()
    assert all(field in tg for field in LLAMA_BENCH_FIELDS)
    assert tg["avg_ts"] == pytest.approx(5) and tg["gbs"] == pytest.approx(5)
    assert tg["floor_ts"] == pytest.approx(10) and tg["pct_floor"] == pytest.approx(50)
    assert pp["gbs"] is None and pp["pct_floor"] is None
    json.loads(json_text([pp, tg]))  # JSON-ready as it stands


def test_bench_markdown_has_every_column():
    text = markdown(bench_rows(), BENCH_COLUMNS)
    header, rule, pp, tg = text.splitlines()
    for name in ["model", "size", "params", "devices", "placement", "test", "t/s", "GB/s", "% of floor"]:
        assert f" {name} " in header
    assert "1.00 GiB" in pp and "1.00 B" in pp and "pp512" in pp and "512.00 ± 0.00" in pp
    assert "tg128" in tg and "5.00 ± 0.00" in tg and "50%" in tg
    assert len({len(line) for line in text.splitlines()}) == 1  # aligned


def test_settings_that_vary_between_rows_get_a_column():
    roof = Roofline(bytes_per_token=10**9, floor_seconds=0.1)
    rows = [
        bench_row(ENV, MODEL, Options(threads=t), PLACEMENT, BenchTest(0, 8), Speed(8, (1.0,)), roof)
        for t in (1, 2)
    ]
    headers = [c.header for c in bench_columns(rows)]
    assert headers.index("threads") == headers.index("test") - 1
    assert "type_k" not in headers and "threads" not in [c.header for c in bench_columns(rows[:1])]


def test_bench_csv_has_a_column_per_field():
    lines = csv_text(bench_rows()).splitlines()
    assert len(lines) == 3 and "avg_ts" in lines[0].split(",")


def test_sweep_plot_is_a_valid_png(tmp_path):
    window = {"pp": 16, "tg": 4, "t_pp": 0.1, "speed_pp": 160.0, "t_tg": 0.2, "speed_tg": 20.0}
    rows = [sweep_row({**window, "n_kv": n}, Roofline(10**8, 0.01)) for n in (0, 16, 32)]
    path = tmp_path / "sweep.png"
    plot_sweeps([{"label": "a", "rows": rows}, {"label": "b", "rows": rows}], path, title="test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(path) as image:
        image.verify()
        assert image.size[0] > 500
    assert "S_TG t/s" in markdown(rows, SWEEP_COLUMNS)


# --- the commands, end to end on a tiny synthetic model ---


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """SmolLM2's shape with two layers: real widths, a real 49152-token vocabulary, 36 MB."""
    path = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    return synthesize("smollm2-135m", "Q4_0", path, n_layer=2, progress=False).path


@pytest.fixture
def quick_ceilings(tmp_path, monkeypatch):
    """Ceilings cached in a temporary file and measured on small buffers, so tests stay fast."""
    from llmx.bench import ceilings

    monkeypatch.setattr(ceilings, "cache_path", lambda: tmp_path / "ceilings.json")
    quick = ceilings.measure_cpu(size_bytes=32 << 20, matmul_n=128, reps=1)
    monkeypatch.setattr(ceilings, "measure", lambda device: quick)
    return quick


def cells(line: str) -> list[str]:
    """The cells of one markdown table line, stripped."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def run_cli(capsys, *argv: str) -> tuple[str, str]:
    assert cli.main(list(argv)) == 0
    out = capsys.readouterr()
    return out.out, out.err


def test_bench_json_has_a_row_per_placement_and_test_with_llama_bench_fields(
    tiny_model, quick_ceilings, capsys
):
    out, _ = run_cli(capsys, "bench", "-m", str(tiny_model), "-p", "16", "-n", "4", "-r", "2",
                     "-ctk", "f16,bf16", "-o", "json")  # fmt: skip
    rows = json.loads(out)
    assert [(r["test"], r["type_k"]) for r in rows] == [("pp16", "f16"), ("tg4", "f16"), ("pp16", "bf16"),
                                                       ("tg4", "bf16")]  # fmt: skip
    for row in rows:
        assert all(field in row for field in LLAMA_BENCH_FIELDS)
        assert len(row["samples_ts"]) == 2 and row["avg_ts"] > 0
        assert row["devices"] == ["cpu"] and row["bandwidth_gbs"]["cpu"] == pytest.approx(
            quick_ceilings.mem_gbs
        )
        assert row["plan"]["tensors"]["blk.1.ffn_down.weight"] == "cpu"
        assert row["environment"]["llmx_version"] and row["environment"]["torch"]
    tg = rows[1]
    assert tg["floor_ts"] > 0 and tg["pct_floor"] == pytest.approx(100 * tg["avg_ts"] / tg["floor_ts"])
    assert tg["gbs"] == pytest.approx(tg["bytes_per_token"] * tg["avg_ts"] / 1e9)
    assert rows[0]["pct_floor"] is None
    # what the engine measured: on the CPU the host time is the whole step, all in a CPU segment
    # reading the floor's bytes (the floor counts a token at the test's mean depth)
    assert 0 < tg["cpu_ms_per_token"] <= tg["host_ms_per_token"] <= 1000 / min(tg["samples_ts"])
    assert tg["cpu_bytes_per_token"] == pytest.approx(tg["bytes_per_token"], rel=0.01)
    assert tg["cpu_pct_ram"] == pytest.approx(100 * tg["cpu_gbs"] / quick_ceilings.mem_gbs)
    assert rows[0]["host_ms_per_token"] is None and rows[0]["bytes_streamed"] == 0
    assert all(r["gpu_memory"] == {} for r in rows)  # no GPU to measure


def test_bench_markdown_by_default_and_ceilings_on_request(tiny_model, quick_ceilings, capsys):
    out, err = run_cli(capsys, "bench", "-m", str(tiny_model), "-p", "8", "-n", "2", "-r", "1", "--ceilings")
    assert "memory GB/s" in err and "matmul TFLOP/s" in err
    header, _, pp, tg = (cells(line) for line in out.splitlines())
    assert header[-1] == "host ms/t"  # llmx's measured columns come after llama-bench's
    pp, tg = dict(zip(header, pp, strict=True)), dict(zip(header, tg, strict=True))
    assert pp["test"] == "pp8" and tg["test"] == "tg2" and tg["% of floor"].endswith("%")
    assert pp["host ms/t"] == "" and float(tg["host ms/t"]) > 0


def test_sweep_bench_json_then_plot_of_two_results(tiny_model, quick_ceilings, capsys, tmp_path):
    out, err = run_cli(
        capsys, "sweep-bench", "-m", str(tiny_model), "-c", "64", "-ub", "16", "-n", "2", "-o", "json"
    )
    result = json.loads(out)
    assert [r["n_kv"] for r in result["rows"]] == [0, 16, 32, 48]
    assert all(r["floor_tg"] > 0 and r["rss_bytes"] > 0 for r in result["rows"])
    assert result["environment"]["cpu"] and result["placement"]["plan"]["ctx"] >= 64
    saved = tmp_path / "run.json"
    saved.write_text(out)
    out_q8, _ = run_cli(
        capsys, "sweep-bench", "-m", str(tiny_model), "-c", "32", "-ub", "16", "-n", "2", "-o", "json",
        "-ctk", "q8_0", "-ctv", "q8_0",
    )  # fmt: skip
    # runs that differ only in their cache types have different names in a plot
    assert json.loads(out_q8)["label"] == result["label"] + " -ctk q8_0 -ctv q8_0"
    png = tmp_path / "curves.png"
    run_cli(capsys, "sweep-bench", "--plot", str(png), str(saved), str(saved))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_bench_table_with_memory_columns(tiny_model, quick_ceilings, capsys):
    out, _ = run_cli(
        capsys, "sweep-bench", "-m", str(tiny_model), "-c", "32", "-ub", "16", "-n", "2", "--mem"
    )
    header = out.splitlines()[0]
    for name in ("PP", "TG", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "% of floor", "RSS"):
        assert f" {name} " in header
    assert len(out.splitlines()) == 4


# --- the kernel benchmark's launch shapes (bench/kernels.py) ---


def test_kernel_sweep_shapes_round_trip() -> None:
    text = "2/2048/1,4/2048/2/late,2/2048/1/r128,4/2048/2/late/r72,2/2048/1/r128/s4"
    shapes = parse_shapes(text)
    assert [str(c) for c in shapes] == text.split(",")
    assert shapes[1].late_headers and not shapes[2].late_headers
    assert [c.max_registers for c in shapes] == [None, None, 128, 72, 128]
    assert [c.stagger for c in shapes] == [1, 1, 1, 1, 4]


def test_kernel_rows_name_how_long_they_were_sustained_and_the_clocks_it_left(monkeypatch) -> None:
    row = {"type": "Q4_K", "n": 14336, "k": 4096, "m": 1, "kernel": "dot8", "layout": "prepared"}
    row |= {"ms": 0.0101, "gbs": 3272.0, "tflops": 0.0, "frac": 0.764}
    assert sustained(0.0) == {} and "s on" not in table_row(row)
    monkeypatch.setenv("PATH", "")  # no nvidia-smi: the state is unknown, not an error
    assert gpu_state() == {}
    line = table_row(row | sustained(1.0))
    assert "| dot8 (1 s on: ? MHz, ? W) |" in line and "| 76% of copy |" in line
    line = table_row(row | {"sustain_s": 1.0, "sm_mhz": 1485.0, "watts": 713.9})
    assert "dot8 (1 s on: 1485.0 MHz, 713.9 W)" in line
