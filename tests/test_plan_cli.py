"""`llmx plan`: the report, --json, shapes without files, GGUF files, and errors without tracebacks."""

from __future__ import annotations

import json

import pytest

from llmx.cli import main
from llmx.errors import LlmxError

SEED = ["--devices", "cuda0=16GiB:free=13.5GiB,cuda1=8GiB,cpu=64GiB", "-ngl", "55"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_seed_report_shows_ranges_devices_and_the_offload_line(capsys):
    rc, out, _ = run(capsys, "--shape", "llama3-70b:Q3_K_S", *SEED)
    assert rc == 0
    assert "cpu      layers 0-24 (25)" in out
    assert "cuda:0   layers 25-59 (35)" in out and "cuda:1   layers 60-79 (20)" in out
    assert "cpu      output layer" in out
    assert "offloaded 55/81 layers to GPU" in out
    for column in ("attention", "dense FFN", "KV", "weights", "compute", "total", "free", "left"):
        assert column in out


def test_over_budget_is_an_error_with_numbers_and_a_fix(capsys):
    rc, out, err = run(capsys, "--shape", "llama3-70b:Q4_K_M", *SEED)
    assert rc == 1 and err == ""
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors and "cuda:1 is over budget by" in out and "GiB" in errors[-1]
    assert errors[-1].endswith("or --fit") and "-ngl " in errors[-1]


def test_fit_report_and_json(capsys):
    rc, out, _ = run(capsys, "--shape", "llama3-70b:Q4_K_M", *SEED, "--fit", "--json")
    data = json.loads(out)
    assert rc == 0 and data["errors"] == []
    assert data["offloaded"]["layers"] < 55 and data["offloaded"]["of"] == 81
    assert data["notes"][0].startswith("--fit chose -ngl ")
    assert {d["device"] for d in data["devices"]} == {"cuda:0", "cuda:1", "cpu"}
    assert data["tensors"]["token_embd.weight"] == "cpu" and len(data["kv"]) == 80


def test_moe_shape_without_a_file(capsys):
    rc, out, _ = run(capsys, "--shape", "qwen3-235b-a22b:Q4_K_M", "--devices", "cuda0=24GiB,cpu=256GiB")
    assert rc == 0 and "experts" in out and "note: --fit chose -ngl 95 -ncmoe" in out


def test_gguf_file(capsys):
    from llmx.models_on_disk import default_model_path

    try:
        path = default_model_path()
    except LlmxError as e:
        pytest.skip(str(e))
    rc, out, _ = run(capsys, "-m", str(path), "--devices", "cuda0=1GiB,cpu=4GiB", "-ngl", "all")
    assert rc == 0 and "offloaded 31/31 layers to GPU" in out and "cuda:0   output layer" in out


def test_shape_list(capsys):
    rc, out, _ = run(capsys, "--shape", "list")
    assert rc == 0 and "deepseek-r1" in out and "qwen3-30b-a3b" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-ot", "exps=CUDA7"], "unknown buffer type 'CUDA7' in -ot; available: CPU, CUDA0, CUDA1"),
        (["-ot", "blk.(=CPU"], "bad regular expression 'blk.('"),
        (["--shape", "llama9:Q4_K_M"], "unknown model shape 'llama9'"),
    ],
)
def test_errors_are_one_line(capsys, argv, message):
    argv = ["--shape", "llama3-8b:Q4_K_M", "--devices", "cuda0=8GiB,cuda1=8GiB,cpu=32GiB", *argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 1 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
