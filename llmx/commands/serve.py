"""`llmx serve -m MODEL [placement options] [--host H] [--port P]`: the OpenAI-compatible HTTP API.

The main thread loads the model and then generates (`Worker.run`: see there why it must be the
thread that loaded); the HTTP server runs its event loop on a second thread. SIGTERM or Ctrl-C stops
the worker (the request in generation and those waiting get a 503), then the HTTP server, which
gives open connections SHUTDOWN_SECONDS to finish.
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import sys
import threading
import time

from llmx.commands.common import add_model_argument, print_load_report
from llmx.errors import LlmxError
from llmx.plan.options import add_options, options_from_args

SHUTDOWN_SECONDS = 3
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
START_POLL_SECONDS = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    g.add_argument("-a", "--alias", default=None, help="the model's name in the API (default: the file's)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    g.add_argument(
        "-to", "--timeout", type=float, default=600, help="seconds a request may take, waiting included (600)"
    )
    g.add_argument(
        "--max-queue", type=int, default=64, help="requests that may wait (>= 1); more get 503 (default 64)"
    )
    g.add_argument(
        "-np", "--parallel", type=int, default=1,
        help="requests generated at once, in batched steps; they share -c (default 1: the engine alone)",
    )  # fmt: skip
    g.add_argument(
        "--cache-prompt", action=argparse.BooleanOptionalAction, default=True,
        help="with -np > 1: a prompt prefix computed for an earlier request (a system prompt) is reused, "
        "not computed again (default: on)",
    )  # fmt: skip
    g.add_argument("--max-body", type=float, default=4, help="largest request body in MiB (default 4)")
    g.add_argument(
        "--cors", default=None, metavar="ORIGIN", help="let pages of ORIGIN call the API (default: none)"
    )
    add_options(parser)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from llmx.server.app import ServerConfig, make_app
        from llmx.server.metrics import Metrics
        from llmx.server.scheduler import Batcher
        from llmx.server.worker import Worker
    except ImportError as e:
        raise LlmxError(f"the server needs {e.name}: pip install 'llmx[server]'") from None
    from llmx.api import load_with_options
    from llmx.commands.progress import load_progress

    if args.max_queue < 1 or args.parallel < 1 or args.max_body <= 0 or args.timeout <= 0:
        raise LlmxError("--max-queue and -np must be at least 1, --max-body and --timeout above 0")
    model = load_with_options(args.model, options_from_args(args), progress=load_progress())
    print_load_report(model)
    name = args.alias or model.file.path.stem
    if args.parallel == 1:
        worker = Worker(model, args.max_queue, Metrics())
    else:
        worker = Batcher(
            model, args.max_queue, Metrics(), args.parallel, model.options.n_ubatch, args.cache_prompt
        )
    config = ServerConfig(
        name, args.api_key, int(args.max_body * (1 << 20)), args.timeout, _hosts(args.host), args.cors
    )
    server = uvicorn.Server(
        uvicorn.Config(
            make_app(worker, config),
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=SHUTDOWN_SECONDS,
        )
    )
    http = threading.Thread(target=server.run, name="llmx-http")
    http.start()
    while not server.started and http.is_alive():
        time.sleep(START_POLL_SECONDS)
    if not server.started:
        raise LlmxError(f"could not listen on {args.host}:{args.port} (in use, or not an address here)")
    print(f"llmx: serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    try:
        worker.run()
    finally:  # the HTTP thread is not a daemon: it must be told to end, or the process stays
        server.should_exit = True
        http.join()
    return 0


def _hosts(address: str) -> frozenset[str] | None:
    """The Host names a server bound to `address` answers to: a loopback one only its own (a web page
    the user visits may reach it by another name that resolves to 127.0.0.1); None: any."""
    try:
        loopback = address == "localhost" or ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name
        return None
    return LOOPBACK_NAMES | {address if ":" not in address else f"[{address}]"} if loopback else None
