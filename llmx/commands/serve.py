"""`llmx serve -m MODEL [placement options] [--host H] [--port P]`: the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import sys

from llmx.commands.common import add_model_argument, print_load_report
from llmx.errors import LlmxError
from llmx.plan.options import add_options, options_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("--alias", default=None, help="the model's name in the API (default: the file's)")
    add_options(parser)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from llmx.server.app import make_app
    except ImportError as e:
        raise LlmxError(f"the server needs {e.name}: pip install 'llmx[server]'") from None
    from llmx.api import load_with_options
    from llmx.commands.progress import load_progress

    model = load_with_options(args.model, options_from_args(args), progress=load_progress())
    print_load_report(model)
    name = args.alias or model.file.path.stem
    print(f"llmx: serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(make_app(model, name), host=args.host, port=args.port, log_level="warning")
    return 0
