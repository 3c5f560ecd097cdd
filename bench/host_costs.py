"""The host's per-token costs outside the model: sampling one token and encoding a prompt.

A decode step on a GPU takes ~2 ms, so the sampler's filters over a large vocabulary (Gemma 3's 262144
tokens, repeat penalty on) must stay far below that, and a prompt's encoding far below its prefill:

    PYTHONPATH=. python bench/host_costs.py [-m MODEL] [--vocab 262144] [--reps 20]

Prints ms a sampled token (the default filters, then temperature 0) and ms to encode 512 tokens of
`bench/data/kjv-genesis-1-14.txt` with the model's tokenizer (the embedded SmolLM2 without -m): the
best of --reps each, as both run on the serving thread between steps.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from llmx.gguf import open_gguf
from llmx.models_on_disk import default_model_path
from llmx.text.sampler import Sampler, SamplingParams
from llmx.text.tokenizer import Tokenizer

TEXT = Path(__file__).parent / "data" / "kjv-genesis-1-14.txt"


def best_ms(fn: Callable[[], object], reps: int) -> float:
    fn()  # first use: lazy set-up (the tokenizer's special-token matcher)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    logits = torch.randn(args.vocab, generator=torch.Generator().manual_seed(0))
    history = list(range(64))
    for name, params in (
        ("default filters, repeat penalty 1.1", SamplingParams(seed=0, repeat_penalty=1.1)),
        ("temperature 0", SamplingParams(temperature=0.0)),
    ):
        sampler = Sampler(params)
        ms = best_ms(lambda sampler=sampler: sampler(logits, history), args.reps)
        print(f"sample one token of {args.vocab}, {name}: {ms:.2f} ms")
    path = args.model or default_model_path()
    tok = Tokenizer.from_metadata(open_gguf(path).metadata)
    text = TEXT.read_text()
    while len(tok.encode(text)) > 512:
        text = text[: len(text) * 9 // 10]
    n = len(tok.encode(text))
    print(f"encode {n} tokens ({Path(path).name}): {best_ms(lambda: tok.encode(text), args.reps):.2f} ms")


if __name__ == "__main__":
    main()
