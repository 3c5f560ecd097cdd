"""`llmx bench-serve`: a load benchmark of a running server, like vLLM's serving benchmark.

llmx serve -np 8 &
llmx bench-serve --clients 8 -n 64 --prompt-tokens 128 --max-tokens 64 [--rate 4] [-o json]

Each request streams a greedy completion of a seeded prompt of exactly --prompt-tokens tokens (as the
server's /tokenize counts them). Then each distinct prompt is served again alone, one at a time, and
every response under load must be that text: a mismatch is listed and the command exits with 1, unless
the texts part at a near tie of the run alone (its two likeliest tokens within 0.1 nats: batched
kernels round differently and may pick either), which is listed and counted apart. Where the server
is llmx with batched steps, its /metrics read before and after the load tell how many steps it ran
and where a step's time went (`bench.serve_steps`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from llmx.errors import LlmxError

if TYPE_CHECKING:
    from llmx.bench.serve_client import Client

DEFAULT_URL = "http://127.0.0.1:8080"  # where `llmx serve` listens by default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=DEFAULT_URL, help=f"the server, its root or its /v1 (default {DEFAULT_URL})"
    )
    parser.add_argument("--api-key", default=None, metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "-n", "--requests", type=int, default=64, metavar="N", help="requests to send (default 64)"
    )
    parser.add_argument(
        "--clients",
        type=int,
        default=8,
        metavar="N",
        help="requests in flight at most: concurrent users (default 8)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=math.inf,
        metavar="R",
        help="requests a second, arriving as a Poisson process (default inf: all at once)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=128, metavar="N", help="tokens of every prompt (default 128)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, metavar="N", help="tokens to generate per request (default 64)"
    )
    parser.add_argument(
        "--distinct",
        type=int,
        default=None,
        metavar="K",
        help="distinct prompts, sent in turn (default: one per request)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table", help="report format")


def run(args: argparse.Namespace) -> int:
    try:
        from llmx.bench.serve_client import Client
    except ImportError as e:
        raise LlmxError(f"bench-serve needs {e.name}: pip install 'llmx[client]'") from None
    n_distinct = args.requests if args.distinct is None else args.distinct
    if min(args.requests, args.clients, args.prompt_tokens, args.max_tokens, n_distinct) < 1:
        raise LlmxError("-n, --clients, --prompt-tokens, --max-tokens and --distinct must be at least 1")
    if not args.rate > 0:
        raise LlmxError(f"--rate must be above 0 (inf: all at once), got {args.rate}")
    result = asyncio.run(_bench(Client(args.url, args.api_key), args, min(n_distinct, args.requests)))
    _print(result, args.output)
    return 1 if any(not m["near_tie"] for m in result["check"]["mismatches"]) else 0


async def _bench(client: Client, args: argparse.Namespace, n_distinct: int) -> dict[str, Any]:
    from tqdm import tqdm

    from llmx.bench.serve_check import NEAR_TIE_NATS, mismatches
    from llmx.bench.serve_client import alone, check_prompt_lengths, load_run, prompt_words
    from llmx.bench.serve_stats import summary
    from llmx.bench.serve_steps import step_split
    from llmx.bench.serve_workload import WORDS, workload

    async with client:
        model = await client.model()
        words, n_words = await prompt_words(client, WORDS, args.prompt_tokens)
        work = workload(words, n_words, args.requests, n_distinct, args.rate, args.seed)
        await check_prompt_lengths(client, work.prompts, args.prompt_tokens)
        before = await client.metrics()
        with tqdm(total=args.requests, desc="under load", unit="req", leave=False, disable=None) as bar:
            streams, duration = await load_run(
                client, model, work, args.clients, args.max_tokens, lambda: bar.update()
            )
        after = await client.metrics()
        with tqdm(total=n_distinct, desc="served alone", unit="req", leave=False, disable=None) as bar:
            replies = await alone(client, model, work.prompts, args.max_tokens, lambda: bar.update())
    wrong = mismatches(streams, work.prompt_of, replies)
    totals = summary(streams, duration)
    steps = step_split(before, after, totals["output_tokens"]) if before and after else None
    return {
        "kind": "bench-serve",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "url": client.url,
        "model": model,
        "settings": {
            "requests": args.requests,
            "clients": args.clients,
            "rate": "inf" if math.isinf(args.rate) else args.rate,  # JSON has no infinity
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "distinct": n_distinct,
            "seed": args.seed,
        },
        "summary": totals,
        "server_steps": steps,
        "check": {
            "prompts": n_distinct,
            "near_tie_nats": NEAR_TIE_NATS,
            "mismatches": [asdict(m) | {"near_tie": m.near_tie, "line": m.line()} for m in wrong],
        },
    }


def _print(result: dict[str, Any], output: str) -> None:
    from llmx.bench.serve_report import headline, tables, verdict

    if output == "json":
        print(json.dumps(result, indent=2))
        for line in verdict(result):
            print(line, file=sys.stderr)
        return
    from rich.console import Console

    console = Console(highlight=False)
    console.print(headline(result), markup=False)
    for table in tables(result):
        console.print(table)
    for line in verdict(result):
        console.print(line, markup=False)
