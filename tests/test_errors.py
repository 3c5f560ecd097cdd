"""Every input a user can get wrong gives one clear line on stderr and a non-zero exit, no traceback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import llmx.api
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


# torch's message for a CUDA allocation that fails, as a GPU run would raise it mid-step
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.19 GiB of which "
    "1.05 GiB is free. Of the allocated memory 75.1 GiB is allocated by PyTorch"
)


def test_out_of_memory_during_a_step_is_one_line_and_keeps_the_context(capsys, smollm2_path, monkeypatch):
    import llmx
    from llmx.errors import LlmxError

    model = llmx.load(smollm2_path, ctx_size=256)
    engine = model.engine
    engine.prefill([1, 2, 3])

    def oom(*_):
        raise torch.OutOfMemoryError(CUDA_OOM)

    monkeypatch.setattr(engine.executor, "forward", oom)
    with pytest.raises(LlmxError) as err:
        engine.prefill([4, 5])
    assert str(err.value) == (
        "out of memory on cuda:1 running 2 tokens (2.00 GiB more were needed); "
        "lower -ub, -c or -ngl, or use --fit"
    )
    assert engine.n_past == 3  # nothing of the failed step counts

    def ram(*_):
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes."
        )

    monkeypatch.setattr(engine.executor, "forward", ram)
    with pytest.raises(LlmxError, match=r"^out of RAM running 1 tokens; lower -ub or -c"):
        engine.decode(6)
    assert engine.n_past == 3


def test_out_of_memory_for_the_weights_names_the_device_and_the_sizes(monkeypatch):
    from llmx.errors import LlmxError
    from llmx.runtime import weights

    real_empty = torch.empty

    def empty(*args, device=None, **kw):
        if device is not None and torch.device(device).type == "cuda":
            raise torch.OutOfMemoryError(CUDA_OOM)
        return real_empty(*args, device=device, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 << 30, 80 << 30))
    piece = weights.Piece("w@cuda:0", None, "cuda:0")
    monkeypatch.setattr(weights.Piece, "nbytes", property(lambda self: 5 << 20))
    monkeypatch.setattr(weights.Piece, "arena_bytes", property(lambda self: 5 << 20))
    with pytest.raises(
        LlmxError, match=r"out of memory on cuda:0: its weights need [\d.]+ GiB and 3\.00 GiB are"
    ):
        weights.upload_arena([piece], torch.device("cuda:0"), lambda n: None)


# Options llama.cpp has that the runtime cannot honour yet: refused before the file is even opened.
def _no_loading(*args, **kwargs):
    pytest.fail("the weights loaded before the option was refused")


REFUSED = [
    (("--mlock",), "--mlock"),
    (("--devices", "cpu=8GiB"), "--devices"),
    (("--top-p", "2"), "--top-p"),
]


@pytest.mark.parametrize(("flags", "needle"), REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_options_the_runtime_cannot_honour_fail_before_loading(
    capsys, smollm2_path, monkeypatch, flags, needle
):
    monkeypatch.setattr(llmx.api, "load_weights", _no_loading)
    rc, err = run_cli(capsys, "run", "-m", str(smollm2_path), "-p", "hi", "-n", "1", *flags)
    assert_one_clear_line(rc, err, needle)


def test_bench_refuses_every_row_s_options_before_the_first_loads(capsys, smollm2_path, monkeypatch):
    monkeypatch.setattr(llmx.api, "load_weights", _no_loading)
    rc, err = run_cli(
        capsys, "bench", "-m", str(smollm2_path), "-p", "8", "-n", "0", "-ngl", "0,1", "--mlock"
    )
    assert_one_clear_line(rc, err, "--mlock")
