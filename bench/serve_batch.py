"""Aggregate decode throughput of `llmx serve` with N concurrent streams: the engine alone (-np 1,
one stream) against batched steps (-np N, N streams).

    python bench/serve_batch.py [-m MODEL] [-n 64] [--streams 1,4,8] [-t THREADS]

For each N a server is started with `-np N` (N = 1: the single-sequence engine; a batch of one is
also measured, with -np 2 and one stream), N clients each ask for `-n` greedy tokens of a different
prompt at once (ignoring end-of-text would need a sampler option: prompts that run long are chosen),
and the aggregate rate is all completion tokens / the wall time from the first request to the last
reply. The clients share one `httpx.Client` whose connections the warm round opens: a client made per
request (its SSL context) took 30-70 ms on the 2-core EPYC, and eight made at once held the last
request back ~250 ms. Every server is started first and the rounds take the cases in turn, so a
machine shared with other work slows each alike. Prints one markdown table: the median of `--rounds`,
and of each round's rate against that round's engine alone.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from serve_speed import start_server

# -c a slot holds, as the engine alone's: -np slots share -c, and 512 split eight ways cut each reply
# at 64 positions, prompt included (55-61 tokens, the last steps with fewer rows)
CTX_A_SLOT = 512

PROMPTS = [
    "Once upon a time",
    "Write a long story about a dragon:",
    "The history of the Roman empire begins",
    "Here is a detailed recipe for bread:",
    "Explain how a computer works, step by step:",
    "A poem about the sea:",
    "The rules of chess are",
    "My favourite places to visit are",
]


def aggregate(client: httpx.Client, streams: int, n: int) -> tuple[float, float]:
    """(completion tokens / second over all streams, the mean tokens a stream got)."""

    def one(k: int) -> int:
        body = {"prompt": PROMPTS[k % len(PROMPTS)], "max_tokens": n, "temperature": 0}
        return client.post("/v1/completions", json=body).json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = list(pool.map(one, range(streams)))
    return sum(tokens) / (time.perf_counter() - t0), sum(tokens) / streams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", default=None)
    args = ap.parse_args()
    model = (["-m", args.model] if args.model else []) + (["-t", args.threads] if args.threads else [])
    cases = [(1, 1), (2, 1)] + [(s, s) for s in map(int, args.streams.split(",")) if s > 1]
    with contextlib.ExitStack() as stack:
        clients = []
        for slots, streams in cases:
            server, url = start_server([*model, "-np", str(slots)], ctx=CTX_A_SLOT * slots)
            stack.callback(server.wait)
            stack.callback(server.terminate)
            clients.append(stack.enter_context(httpx.Client(base_url=url, timeout=600)))
            aggregate(clients[-1], streams, 4)  # warm: the first steps of a shape are slower
        # round by round, every case in turn: a machine shared with other work slows each alike
        runs = [
            [aggregate(client, streams, args.n) for client, (_, streams) in zip(clients, cases, strict=True)]
            for _ in range(args.rounds)
        ]
    print("| -np | streams | aggregate t/s | x one stream (engine) | tokens a stream |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for k, (slots, streams) in enumerate(cases):
        rate = statistics.median(r[k][0] for r in runs)
        ratio = statistics.median(r[k][0] / r[0][0] for r in runs)  # each round's own engine
        print(f"| {slots} | {streams} | {rate:.1f} | {ratio:.2f} | {runs[0][k][1]:.0f} |", flush=True)


if __name__ == "__main__":
    main()
