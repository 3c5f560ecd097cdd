"""`llmx run -m MODEL -p TEXT -n N`: stream a completion, then llama.cpp-style timings."""

from __future__ import annotations

import argparse
import sys

from llmx.commands.common import (
    add_model_argument,
    add_sampling_arguments,
    print_load_report,
    print_timings,
    read_prompt,
    sampling_from_args,
)
from llmx.plan.options import add_options, options_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("-p", "--prompt", default=None, help="prompt text")
    parser.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    parser.add_argument(
        "-cnv",
        "--conversation",
        action="store_true",
        help="wrap the prompt in the model's chat template as one user turn",
    )
    add_sampling_arguments(parser)
    add_options(parser)


def run(args: argparse.Namespace) -> int:
    from llmx.api import load_with_options
    from llmx.commands.progress import load_progress

    text = read_prompt(args)  # a bad prompt file or sampling flag fails before the model loads
    sampling = sampling_from_args(args)
    model = load_with_options(args.model, options_from_args(args), progress=load_progress())
    print_load_report(model)
    prompt = (
        model.chat_prompt([{"role": "user", "content": text}]) if args.conversation else model.encode(text)
    )
    if not args.conversation:
        sys.stdout.write(text)
    for piece in model.stream(prompt, args.n_predict, **sampling):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print_timings(model.load_seconds, model.engine.timings)
    return 0
