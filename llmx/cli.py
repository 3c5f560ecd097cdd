"""`llmx` command line: a table of subcommands, each a module in `llmx.commands` imported lazily.

Each command module defines `add_arguments(parser)` and `run(args) -> int`. A `LlmxError` becomes one
line on stderr and exit code 1, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "run": "generate text from a prompt",
    "chat": "interactive multi-turn chat using the model's chat template",
    "inspect": "print a GGUF's metadata, tensor types and per-layer sizes",
    "tokenize": "print the token ids of a text",
    "plan": "print where every tensor would go, without loading weights",
    "bench": "llama-bench style prompt/generation speed table",
    "sweep-bench": "speed as the context fills, window by window",
    "perplexity": "llama-perplexity's perplexity of a text, and KL divergence from a saved base run",
    "synth": "write a synthetic GGUF of a real model's shape",
    "serve": "OpenAI-compatible HTTP server",
    "bench-serve": "load a running server with concurrent streams: throughput, TTFT, ITL; checks every reply",
}


def _module(name: str):
    return importlib.import_module(f"llmx.commands.{name.replace('-', '_')}")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmx", description="Run GGUF models on CPUs and GPUs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Only the chosen command's module is imported, so `llmx plan` never pulls in torch.
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            _module(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    from llmx.errors import LlmxError

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(_module(args.command).run(args) or 0)
    except LlmxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
