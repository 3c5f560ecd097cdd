"""`llmx chat`: an interactive multi-turn conversation rendered with the model's chat template.

The whole conversation is re-rendered each turn (templates may rewrite earlier turns), and the KV
cache is reused for the prefix that did not change, so each turn only processes its new tokens.
"""

from __future__ import annotations

import argparse
import sys

from llmx.commands.common import (
    add_model_argument,
    add_sampling_arguments,
    print_load_report,
    print_timings,
    sampling_from_args,
)
from llmx.plan.options import add_options, options_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("-sys", "--system-prompt", default=None, help="a system message to start with")
    add_sampling_arguments(parser)
    add_options(parser)


def run(args: argparse.Namespace) -> int:
    from llmx.api import load_with_options
    from llmx.commands.progress import load_progress
    from llmx.text.tokenizer import StreamDecoder

    sampling = sampling_from_args(args)  # a bad sampling flag fails before the model loads
    model = load_with_options(args.model, options_from_args(args), progress=load_progress())
    print_load_report(model)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    context: list[int] = []  # ids currently in the KV cache
    interactive = sys.stdin.isatty()
    print("chat with the model; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.rstrip("\n")})
        prompt = model.chat_prompt(messages)
        keep = _common_prefix(context, prompt)
        model.engine.n_past = keep  # rewind the cache to the unchanged prefix
        decoder, reply_ids = StreamDecoder(model.tokenizer), []
        for token in model.stream_ids(prompt[keep:], args.n_predict, keep_context=True, **sampling):
            reply_ids.append(token)
            sys.stdout.write(decoder.push(token))
            sys.stdout.flush()
        sys.stdout.write(decoder.flush() + "\n")
        context = (prompt + reply_ids)[: model.engine.n_past]  # what the cache really holds
        messages.append({"role": "assistant", "content": model.tokenizer.decode(reply_ids)})
    print_timings(model.load_seconds, model.engine.timings)
    return 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the shared prefix, keeping at least one new token to process."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return min(n, len(b) - 1)
