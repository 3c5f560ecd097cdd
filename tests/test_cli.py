"""The CLI's happy paths on the embedded model: tokenize, inspect, run."""

from __future__ import annotations

import ast

from llmx.cli import main
from llmx.gguf import open_gguf
from llmx.text.tokenizer import Tokenizer


def test_tokenize_prints_the_ids_as_one_list_on_the_last_line(capsys, smollm2_path):
    text = "<|im_start|>Hello world"
    tok = Tokenizer.from_metadata(open_gguf(smollm2_path).metadata)
    assert main(["tokenize", "-m", str(smollm2_path), "-p", text, "--ids"]) == 0
    ids = ast.literal_eval(capsys.readouterr().out.strip().splitlines()[-1])
    assert ids == tok.encode(text) and ids[0] == tok.special_id("<|im_start|>")
    assert main(["tokenize", "-m", str(smollm2_path), "-p", text, "--ids", "--no-parse-special"]) == 0
    plain = ast.literal_eval(capsys.readouterr().out.strip().splitlines()[-1])
    assert plain == tok.encode(text, parse_special=False) and tok.special_id("<|im_start|>") not in plain


def test_inspect_prints_metadata_types_and_layers(capsys, smollm2_path):
    assert main(["inspect", str(smollm2_path)]) == 0
    out = capsys.readouterr().out
    assert "general.architecture" in out and "'llama'" in out
    assert "Q4_1" in out and "210 tensors" in out and "blk.29" in out


def test_run_streams_text_and_prints_llama_cpp_timings(capsys, smollm2_path):
    rc = main(
        [
            "run",
            "-m",
            str(smollm2_path),
            "-p",
            "The capital of France is",
            "-n",
            "8",
            "--temp",
            "0",
            "-c",
            "256",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0
    assert captured.out.startswith("The capital of France is") and "Paris" in captured.out
    for label in ("load time", "prompt eval time", "eval time", "offloaded 0/31 layers to GPU"):
        assert label in captured.err
