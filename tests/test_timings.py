"""The engine's counters (host time, CPU segments, bytes streamed) are filled, averaged and printed.

On the CPU the whole model is one CPU segment, so the counters have exact expectations: the bytes
a decode step reads are the floor's bytes for that step, and the host time is the whole step.
"""

from __future__ import annotations

import io
import json

import pytest
from tiny_models import random_prompt, write_tiny

import llmx
from llmx.bench.floor import Roofline, plan_token_bytes
from llmx.bench.rows import bench_columns, bench_row
from llmx.bench.runner import BenchTest, Counters, Sample, Speed, time_test
from llmx.bench.tables import csv_text, markdown
from llmx.commands.common import print_timings
from llmx.engine import Timings


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny("llama", "Q8_0", tmp_path_factory.mktemp("timings"))
    return llmx.load(path, ctx_size=256)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """Sliding-window layers whose rings (window 8 + -ub 4 = 12 positions) the decode steps outgrow."""
    path = write_tiny("gemma3", "Q8_0", tmp_path_factory.mktemp("timings-gemma3"))
    return llmx.load(path, ctx_size=256, ubatch_size=4)


@pytest.mark.parametrize("model", ["tiny", "tiny_gemma3"])
def test_decode_steps_fill_the_host_and_cpu_segment_counters(model, request):
    tiny = request.getfixturevalue(model)
    engine = tiny.engine
    engine.reset()
    prompt = random_prompt(10, seed=0)
    engine.prefill(prompt)
    for token in random_prompt(4, seed=1):
        engine.decode(token)
    t = engine.timings
    assert t.gen_tokens == 4
    assert 0 < t.gen_cpu_seconds <= t.gen_host_seconds <= t.gen_seconds
    assert t.prompt_bytes_streamed == 0  # no GPU: nothing to stream to
    # Each step reads every weight once (tied output: the embedding table too) and the KV cache of
    # the positions so far, exactly what the bandwidth floor counts for that depth.
    files = [(x.name, x.nbytes) for x in tiny.file.tensors.values()]
    tb = plan_token_bytes(tiny.plan, files, 0, 0)
    expected = sum(tb.at_depth(len(prompt) + i + 1)["cpu"] for i in range(4))
    assert t.gen_cpu_bytes == expected
    # the last step, at depth 14, by hand from the cache buffers: a full-context layer's 14 positions,
    # a ring's every row (12 for the Gemma 3's sliding layers)
    cache = engine.executor.cache
    buffers = zip(cache.k, cache.v, strict=True)
    kv = sum((k.nbytes + v.nbytes) * min(14, k.shape[0]) // k.shape[0] for k, v in buffers)
    assert tb.at_depth(14)["cpu"] - tb.at_depth(0)["cpu"] == kv
    assert any(k.shape[0] == 12 for k in cache.k) == (model == "tiny_gemma3")
    assert t.cpu_gbs == pytest.approx(t.gen_cpu_bytes / t.gen_cpu_seconds / 1e9)
    assert t.host_ms_per_token == pytest.approx(1000 * t.gen_host_seconds / 4)


def test_timings_since_an_earlier_copy_count_only_what_came_after():
    later = Timings(prompt_tokens=10, gen_tokens=5, gen_host_seconds=0.5, prompt_bytes_streamed=300)
    earlier = Timings(prompt_tokens=8, gen_tokens=1, gen_host_seconds=0.1, prompt_bytes_streamed=100)
    d = later.since(earlier)
    assert (d.prompt_tokens, d.gen_tokens, d.prompt_bytes_streamed) == (2, 4, 200)
    assert d.gen_host_seconds == pytest.approx(0.4)


def test_bench_samples_keep_the_counters_of_the_timed_part_only(tiny):
    samples = time_test(tiny.engine, BenchTest(0, 3, n_depth=8), reps=2, n_vocab=1000)
    assert len(samples) == 2
    for s in samples:
        # the depth fill is a prompt, and is not counted: only the three timed decode steps are
        assert s.timings.prompt_tokens == 0 and s.timings.gen_tokens == 3
        assert 0 < s.timings.gen_host_seconds <= s.timings.gen_seconds <= s.seconds


def test_counters_average_per_generated_token_over_repetitions():
    def sample(host: float, cpu: float, nbytes: int, streamed: int) -> Sample:
        t = Timings(gen_tokens=4, gen_host_seconds=host, gen_cpu_seconds=cpu, gen_cpu_bytes=nbytes,
                    prompt_bytes_streamed=streamed)  # fmt: skip
        return Sample(1.0, t)

    c = Counters.of([sample(0.004, 0.002, 4 * 10**8, 100), sample(0.012, 0.006, 4 * 10**8, 300)])
    assert c.host_ms_per_token == pytest.approx(2.0)  # 16 ms over 8 tokens
    assert c.cpu_ms_per_token == pytest.approx(1.0)
    assert c.cpu_bytes_per_token == pytest.approx(10**8)
    assert c.cpu_gbs == pytest.approx(100)  # 1e8 bytes in 1 ms
    assert c.bytes_streamed == 200
    prompt_only = Counters.of([Sample(1.0, Timings(prompt_tokens=512, prompt_bytes_streamed=10))])
    assert prompt_only.host_ms_per_token is None and prompt_only.cpu_gbs is None


# --- rows and tables ---

ENV = {"llmx_commit": "abc", "cpu": "CPU", "gpus": [{"name": "GPU"}]}
MODEL = {"model_filename": "m.gguf", "model_name": "m", "model_arch": "llama", "model_ftype": "Q4_K_M",
         "model_size": 2**30, "model_n_params": 10**9}  # fmt: skip
HYBRID = {"devices": ["cuda:0", "cpu"], "summary": "-ngl 16", "plan": {}, "load_seconds": 1.0,
          "bandwidth_gbs": {"cuda:0": 4000.0, "cpu": 80.0}, "n_offloaded": 16}  # fmt: skip
GPU_MEMORY = {"cuda:0": {"weights_kv": 100, "weights_kv_planned": 101, "compute_peak": 300 * 2**20,
                         "compute_planned": 512 * 2**20, "reserved_peak": 2**30}}  # fmt: skip


def hybrid_rows() -> list[dict]:
    from llmx.plan.options import Options

    roof = Roofline(bytes_per_token=5 * 10**9, floor_seconds=0.1)
    pp = Counters(None, None, None, bytes_streamed=2 * 2**30)
    tg = Counters(host_ms_per_token=60.0, cpu_ms_per_token=50.0, cpu_bytes_per_token=2.5e9, bytes_streamed=0)
    opts = Options(n_gpu_layers=16)
    return [
        bench_row(ENV, MODEL, opts, HYBRID, BenchTest(512, 0), Speed(512, (0.5,)), None, pp, GPU_MEMORY),
        bench_row(ENV, MODEL, opts, HYBRID, BenchTest(0, 128), Speed(128, (8.0,)), roof, tg, GPU_MEMORY),
    ]


def test_bench_rows_carry_the_measured_fields_after_llama_bench_ones():
    pp, tg = hybrid_rows()
    keys = list(tg)
    assert keys.index("host_ms_per_token") > keys.index("samples_ts") and keys[-1] == "gpu_memory"
    assert tg["host_ms_per_token"] == 60.0 and tg["cpu_ms_per_token"] == 50.0
    assert tg["cpu_gbs"] == pytest.approx(50.0)  # 2.5 GB in 50 ms
    assert tg["cpu_pct_ram"] == pytest.approx(62.5)  # of the 80 GB/s measured
    assert pp["bytes_streamed"] == 2 * 2**30 and pp["host_ms_per_token"] is None
    assert tg["gpu_memory"]["cuda:0"]["compute_planned"] == 512 * 2**20
    json.dumps(tg)
    header = csv_text([pp, tg]).splitlines()[0].split(",")
    assert header[-7:] == ["host_ms_per_token", "cpu_ms_per_token", "cpu_bytes_per_token", "cpu_gbs",
                           "cpu_pct_ram", "bytes_streamed", "gpu_memory"]  # fmt: skip


def test_markdown_adds_cpu_streamed_and_compute_columns_when_they_apply():
    rows = hybrid_rows()
    lines = markdown(rows, bench_columns(rows)).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[-5:] == ["host ms/t", "CPU ms/t", "CPU GB/s", "streamed", "compute MiB (planned)"]
    pp, tg = ([c.strip() for c in line.strip("|").split("|")][-5:] for line in lines[2:])
    assert pp == ["", "", "", "2.00 GiB", "300 (512)"]
    assert tg == ["60.00", "50.00", "50.0 (62%)", "", "300 (512)"]


# --- print_timings ---


def test_print_timings_prints_host_cpu_segment_and_streamed_lines(tmp_path, monkeypatch):
    from llmx.bench import ceilings

    monkeypatch.setattr(ceilings, "cache_path", lambda: tmp_path / "ceilings.json")
    t = Timings(prompt_tokens=512, prompt_seconds=1.0, gen_tokens=10, gen_seconds=0.5,
                gen_host_seconds=0.1, gen_cpu_seconds=0.08, gen_cpu_bytes=4 * 10**9,
                prompt_bytes_streamed=3 * 2**20)  # fmt: skip
    out = io.StringIO()
    print_timings(2.0, t, file=out)
    text = out.getvalue()
    assert "host time =     100.00 ms /    10 tokens (   10.00 ms per token,  20.0% of eval time)" in text
    assert "cpu segments =      80.00 ms /    10 tokens (    8.00 ms per token,    50.00 GB/s)" in text
    assert "prompt streamed =       3.00 MiB" in text
    # with the RAM bandwidth measured (llmx bench --ceilings), the share of it
    key = ceilings.device_key("cpu")
    ceilings.save_cache({key: ceilings.Ceiling(key, "cpu", 100.0, 1.0, "f32")})
    out = io.StringIO()
    print_timings(2.0, t, file=out)
    assert "50.00 GB/s, 50% of 100.0 GB/s RAM)" in out.getvalue()


def test_print_timings_leaves_out_lines_without_data():
    out = io.StringIO()
    print_timings(1.0, Timings(prompt_tokens=4, prompt_seconds=0.1), file=out)
    text = out.getvalue()
    assert "prompt eval time" in text and "host time" not in text
    assert "cpu segments" not in text and "streamed" not in text
