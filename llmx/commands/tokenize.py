"""`llmx tokenize -m MODEL -p TEXT --ids`: the token ids of a text, like `llama-tokenize`."""

from __future__ import annotations

import argparse

from llmx.commands.common import add_model_argument, read_prompt
from llmx.gguf import open_gguf
from llmx.models_on_disk import default_model_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("-p", "--prompt", default=None, help="text to tokenize")
    parser.add_argument("-f", "--file", default=None, help="read the text from a file")
    parser.add_argument("--ids", action="store_true", help="print only the ids, as one list")
    parser.add_argument(
        "--no-parse-special",
        action="store_true",
        help="treat special-token text such as <|im_start|> as plain text",
    )
    parser.add_argument("--no-bos", action="store_true", help="do not add the BOS token")


def run(args: argparse.Namespace) -> int:
    from llmx.text.tokenizer import Tokenizer

    mf = open_gguf(args.model or default_model_path())
    tok = Tokenizer.from_gguf(mf)
    ids = tok.encode(read_prompt(args), add_special=not args.no_bos, parse_special=not args.no_parse_special)
    if not args.ids:
        for i in ids:
            print(f"{i:6d} -> {tok.token_text(i)!r}")
    print(ids)
    return 0
