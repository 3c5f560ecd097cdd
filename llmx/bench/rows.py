"""Result rows of `llmx bench` and `llmx sweep-bench`, and the markdown columns that show them.

A bench row carries llama-bench's JSON field names (`n_prompt`, `n_gen`, `n_depth`, `avg_ts`,
`stddev_ts`, `samples_ts`, `type_k`, `n_gpu_layers`, ...) so tools written for llama-bench read it,
plus llmx's own: the roofline (`bytes_per_token`, `gbs`, `floor_ts`, `pct_floor`, the bandwidth
used per device), the placement and full plan, and the environment; then, last, what the engine
measured: host time per generated token, the CPU segments' time and GB/s (against the measured RAM
bandwidth), the bytes op offload streamed, and per GPU the weights+KV and compute bytes measured
beside the plan's. The markdown table adds those as its last columns. A sweep row keeps
ik_llama.cpp's sweep-bench names (`n_kv`, `t_pp`, `speed_pp`, `t_tg`, `speed_tg`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from llmx.bench.floor import Roofline
from llmx.bench.runner import BenchTest, Counters, Speed
from llmx.bench.tables import Column, human_bytes, human_count, mean_pm, number
from llmx.plan.options import Options


def placement_summary(opts: Options, n_offloaded: int, n_layer: int) -> str:
    """The flags a user would type for this placement, and how many layers that put on GPUs."""
    flags = " ".join(opts.to_args()) or "default"
    return f"{flags} ({n_offloaded}/{n_layer + 1} layers on GPU)" if n_offloaded else flags


def bench_row(
    env: Mapping[str, Any],
    model: Mapping[str, Any],
    opts: Options,
    placement: Mapping[str, Any],
    test: BenchTest,
    speed: Speed,
    roof: Roofline | None,
    counters: Counters | None = None,
    gpu_memory: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """One llama-bench JSON row plus llmx's fields. `placement` holds devices, summary, plan, load time;
    `counters` the engine's averages over the repetitions; `gpu_memory` `GpuMemory.measure()`."""
    tg = roof is not None and test.n_gen > 0
    c = counters or Counters(None, None, None, 0.0)
    ram = placement["bandwidth_gbs"].get("cpu")
    return {
        # --- llama-bench's fields ---
        "build_commit": env.get("llmx_commit"),
        "cpu_info": env.get("cpu"),
        "gpu_info": ", ".join(g["name"] for g in env.get("gpus", [])),
        "backends": "CUDA" if any(d.startswith("cuda") for d in placement["devices"]) else "CPU",
        "model_filename": model["model_filename"],
        "model_type": f"{model['model_arch']} {model['model_ftype']}",
        "model_size": model["model_size"],
        "model_n_params": model["model_n_params"],
        "n_batch": opts.batch_size,
        "n_ubatch": opts.n_ubatch,
        "n_threads": opts.n_threads,
        "type_k": opts.cache_type_k,
        "type_v": opts.cache_type_v,
        "n_gpu_layers": placement.get("n_offloaded"),
        "split_mode": opts.split_mode,
        "main_gpu": opts.main_gpu,
        "no_kv_offload": opts.no_kv_offload,
        "flash_attn": opts.flash_attn,
        "tensor_split": "/".join(f"{p:g}" for p in opts.tensor_split or ()),
        "tensor_buft_overrides": ";".join(f"{r}={b}" for r, b in opts.override_tensor),
        "use_mmap": not opts.no_mmap,
        "n_prompt": test.n_prompt,
        "n_gen": test.n_gen,
        "n_depth": test.n_depth,
        "test_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "avg_ns": speed.avg_ns,
        "stddev_ns": speed.stddev_ns,
        "avg_ts": speed.avg_ts,
        "stddev_ts": speed.stddev_ts,
        "samples_ns": speed.samples_ns,
        "samples_ts": speed.samples_ts,
        # --- llmx's fields ---
        "test": test.name,
        "model_name": model["model_name"],
        "devices": placement["devices"],
        "placement": placement["summary"],
        "bytes_per_token": roof.bytes_per_token if tg else None,
        "gbs": roof.gbs(speed.avg_ts) if tg else None,
        "floor_ts": roof.floor_tps() if tg else None,
        "pct_floor": roof.percent_of_floor(speed.avg_ts) if tg else None,
        "bandwidth_gbs": placement["bandwidth_gbs"],
        "load_seconds": placement["load_seconds"],
        "environment": dict(env),
        "plan": placement["plan"],
        # --- what the engine measured ---
        "host_ms_per_token": c.host_ms_per_token,
        "cpu_ms_per_token": c.cpu_ms_per_token,
        "cpu_bytes_per_token": c.cpu_bytes_per_token,
        "cpu_gbs": c.cpu_gbs,
        "cpu_pct_ram": 100 * c.cpu_gbs / ram if c.cpu_gbs and ram else None,
        "bytes_streamed": c.bytes_streamed,
        "gpu_memory": {d: dict(m) for d, m in (gpu_memory or {}).items()},
    }


def _devices(r: Mapping[str, Any]) -> str:
    return "+".join(r["devices"])


def _hybrid(r: Mapping[str, Any]) -> bool:
    return r["backends"] == "CUDA" and r.get("cpu_ms_per_token") is not None


def _compute(r: Mapping[str, Any]) -> str:
    """Measured compute peak and (planned) estimate per GPU, MiB: '812 (1024)', GPUs joined by ' / '."""
    mem = (r.get("gpu_memory") or {}).values()
    return " / ".join(f"{m['compute_peak'] / 2**20:.0f} ({m['compute_planned'] / 2**20:.0f})" for m in mem)


BENCH_COLUMNS = [
    Column("model", lambda r: r["model_name"], right=False),
    Column("size", lambda r: human_bytes(r["model_size"])),
    Column("params", lambda r: human_count(r["model_n_params"])),
    Column("devices", _devices, right=False),
    Column("placement", lambda r: r["placement"], right=False),
    Column("test", lambda r: r["test"]),
    Column("t/s", lambda r: mean_pm(r["avg_ts"], r["stddev_ts"])),
    Column("GB/s", lambda r: number(r["gbs"])),
    Column("% of floor", lambda r: number(r["pct_floor"], 0, "%")),
    Column("floor t/s", lambda r: number(r["floor_ts"])),
]


# Runtime settings that `placement` does not show, by llama-bench field and column name: a column
# appears when its value differs between rows (`-t 1,2`, `-ctk f16,q8_0`, ...), as in llama-bench.
VARYING_FIELDS = {
    "n_threads": "threads",
    "type_k": "type_k",
    "type_v": "type_v",
    "n_batch": "n_batch",
    "n_ubatch": "n_ubatch",
    "flash_attn": "fa",
    "use_mmap": "mmap",
}


def bench_columns(rows: list[dict[str, Any]]) -> list[Column]:
    """BENCH_COLUMNS plus a column, before `test`, for each runtime setting that varies between rows."""
    extra = [
        Column(header, lambda r, f=field: str(r[f]))
        for field, header in VARYING_FIELDS.items()
        if len({str(r[field]) for r in rows}) > 1
    ]
    at = next(i for i, c in enumerate(BENCH_COLUMNS) if c.header == "test")
    return BENCH_COLUMNS[:at] + extra + BENCH_COLUMNS[at:] + measured_columns(rows)


def measured_columns(rows: list[dict[str, Any]]) -> list[Column]:
    """The last columns: host ms per generated token always; the CPU segments' ms per token and GB/s
    when a row ran layers on the CPU beside a GPU; bytes streamed by op offload when any were; and
    the GPUs' compute memory, measured (planned), when a GPU was measured."""
    cols = [Column("host ms/t", lambda r: number(r.get("host_ms_per_token"), 2))]
    if any(_hybrid(r) for r in rows):
        cols.append(Column("CPU ms/t", lambda r: number(r["cpu_ms_per_token"], 2) if _hybrid(r) else ""))
        cols.append(Column("CPU GB/s", lambda r: _cpu_gbs(r) if _hybrid(r) else ""))
    if any(r.get("bytes_streamed") for r in rows):
        cols.append(Column("streamed", _streamed))
    if any(r.get("gpu_memory") for r in rows):
        cols.append(Column("compute MiB (planned)", _compute))
    return cols


def _streamed(r: Mapping[str, Any]) -> str:
    return human_bytes(r["bytes_streamed"]) if r["bytes_streamed"] else ""


def _cpu_gbs(r: Mapping[str, Any]) -> str:
    """'45.6 (51%)': the CPU segments' GB/s and its share of the measured RAM bandwidth."""
    pct = r.get("cpu_pct_ram")
    return number(r["cpu_gbs"]) + (f" ({pct:.0f}%)" if pct is not None else "")


def sweep_row(row: Mapping[str, Any], roof: Roofline | None) -> dict[str, Any]:
    """A sweep window with its generation roofline at that depth."""
    speed = row["speed_tg"]
    return {
        **row,
        "gbs_tg": roof.gbs(speed) if roof else None,
        "floor_tg": roof.floor_tps() if roof else None,
        "pct_floor_tg": roof.percent_of_floor(speed) if roof else None,
    }


SWEEP_COLUMNS = [
    Column("PP", lambda r: str(r["pp"])),
    Column("TG", lambda r: str(r["tg"])),
    Column("N_KV", lambda r: str(r["n_kv"])),
    Column("T_PP s", lambda r: number(r["t_pp"], 3)),
    Column("S_PP t/s", lambda r: number(r["speed_pp"], 2)),
    Column("T_TG s", lambda r: number(r["t_tg"], 3)),
    Column("S_TG t/s", lambda r: number(r["speed_tg"], 2)),
    Column("GB/s", lambda r: number(r["gbs_tg"])),
    Column("% of floor", lambda r: number(r["pct_floor_tg"], 0, "%")),
]


def memory_columns(gpus: list[str]) -> list[Column]:
    """Host RSS and per-GPU allocated bytes, for `sweep-bench --mem`."""
    cols = [Column("RSS", lambda r: human_bytes(r["rss_bytes"]))]
    for dev in gpus:
        cols.append(Column(f"{dev} alloc", lambda r, d=dev: human_bytes(r["gpu_allocated"].get(d, 0))))
    return cols


CEILING_COLUMNS = [
    Column("device", lambda r: r["device"], right=False),
    Column("name", lambda r: r["key"], right=False),
    Column("memory GB/s", lambda r: number(r["mem_gbs"])),
    Column("H2D pinned GB/s", lambda r: number(r["h2d_pinned_gbs"])),
    Column("H2D pageable GB/s", lambda r: number(r["h2d_pageable_gbs"])),
    Column("matmul TFLOP/s", lambda r: f"{number(r['matmul_tflops'], 2)} {r['matmul_dtype']}"),
]
