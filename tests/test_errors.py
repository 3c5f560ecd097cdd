"""Every input a user can get wrong gives one clear line on stderr and a non-zero exit, no traceback."""

from __future__ import annotations

import numpy as np
import pytest

from llmx.cli import main
from tests.conftest import craft_gguf

LLAMA_META = {"general.architecture": "llama", "llama.block_count": 1}


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err.strip()
    return rc, err


def assert_one_clear_line(rc: int, err: str, *needles: str) -> None:
    assert rc != 0
    assert "Traceback" not in err
    # A load report (lines starting "llmx:") may come first; the failure itself is one last line.
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("llmx: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert err.rstrip().endswith(lines[0])
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def tensors():
    return {"token_embd.weight": np.zeros((4, 32), np.float32)}


def test_missing_file(capsys):
    assert_one_clear_line(*run_cli(capsys, "run", "-m", "/no/such/model.gguf", "-p", "hi"), "not found")


def test_not_a_gguf(capsys, tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("these are not weights")
    assert_one_clear_line(*run_cli(capsys, "inspect", str(path)), "not a GGUF file")


def test_unsupported_version(capsys, tmp_path, tensors):
    path = craft_gguf(tmp_path / "v9.gguf", LLAMA_META, tensors, version=9)
    assert_one_clear_line(*run_cli(capsys, "inspect", str(path)), "version 9", "not supported")


def test_truncated_file(capsys, tmp_path, tensors):
    path = craft_gguf(tmp_path / "cut.gguf", LLAMA_META, tensors, truncate=100)
    assert_one_clear_line(
        *run_cli(capsys, "run", "-m", str(path), "-p", "hi"), "truncated", "token_embd.weight"
    )


def test_truncated_header(capsys, tmp_path, tensors):
    path = craft_gguf(tmp_path / "cut.gguf", LLAMA_META, tensors)
    path.write_bytes(path.read_bytes()[:40])
    assert_one_clear_line(*run_cli(capsys, "inspect", str(path)), "truncated")


def test_unknown_tensor_type(capsys, tmp_path, tensors):
    path = craft_gguf(tmp_path / "t.gguf", LLAMA_META, tensors, type_ids={"token_embd.weight": 99})
    assert_one_clear_line(*run_cli(capsys, "inspect", str(path)), "token_embd.weight", "99")


def test_unknown_architecture(capsys, tmp_path, tensors):
    path = craft_gguf(tmp_path / "a.gguf", {"general.architecture": "rwkv9"}, tensors)
    assert_one_clear_line(*run_cli(capsys, "run", "-m", str(path), "-p", "hi"), "rwkv9", "llama")


def test_prompt_longer_than_context(capsys, smollm2_path):
    # -c is padded to whole 256-token cells (as llama.cpp does), so 400 words overflow -c 64.
    rc, err = run_cli(capsys, "run", "-m", str(smollm2_path), "-p", "word " * 400, "-c", "64", "-n", "4")
    assert_one_clear_line(rc, err, "context", "-c")


def test_prompt_file_missing(capsys, smollm2_path):
    rc, err = run_cli(capsys, "run", "-m", str(smollm2_path), "-f", "/no/such/prompt.txt", "-n", "4")
    assert_one_clear_line(rc, err, "prompt.txt")
