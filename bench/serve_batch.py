"""Aggregate decode throughput of `llmx serve` with N concurrent streams: the engine alone (-np 1,
one stream) against batched steps (-np N, N streams).

    python bench/serve_batch.py [-m MODEL] [-n 64] [--streams 1,4,8] [-t THREADS]

For each N a server is started with `-np N` (N = 1: the single-sequence engine; a batch of one is
also measured, with -np 2 and one stream), N clients each ask for `-n` greedy tokens of a different
prompt at once, streamed (ignoring end-of-text would need a sampler option: prompts that run long are
chosen). Two rates: all completion tokens / the wall time from the first request to the last reply
(prompts included), and the aggregate decode rate, the sum of each stream's tokens after its first over
the time from its first to its last (as llama-batched-bench's S_TG leaves the prompts out; a stream's
time still holds the prompt steps of later requests that came while it decoded). The clients share one
`httpx.Client` whose connections the warm round opens: a client made per request (its SSL context) took
30-70 ms on the 2-core EPYC, and eight made at once held the last request back ~250 ms. Every server is
started first and the rounds take the cases in turn, so a machine shared with other work slows each
alike. Prints one markdown table: the median of `--rounds`, and of each round's rates against that
round's engine alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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


def streamed(client: httpx.Client, prompt: str, n: int) -> tuple[int, float]:
    """One greedy completion of `prompt`, streamed: (its tokens, its decode rate: tokens after the
    first a second, from the first's arrival to the end)."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    first, tokens = None, 0
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["choices"] and first is None:
                first = time.perf_counter()
            tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
    assert first is not None and tokens > 1, f"a reply of {tokens} tokens"
    return tokens, (tokens - 1) / (time.perf_counter() - first)


def aggregate(client: httpx.Client, streams: int, n: int) -> tuple[float, float, float]:
    """(completion tokens / second over all streams, the sum of the streams' decode rates, the mean
    tokens a stream got)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        replies = list(pool.map(lambda k: streamed(client, PROMPTS[k % len(PROMPTS)], n), range(streams)))
    tokens = sum(t for t, _ in replies)
    return tokens / (time.perf_counter() - t0), sum(rate for _, rate in replies), tokens / streams


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
    head = "aggregate t/s | x one stream (engine) | decode t/s | x one stream"
    print(f"| -np | streams | {head} | tokens a stream |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k, (slots, streams) in enumerate(cases):
        cells = []
        for i in (0, 1):  # prompts included, then decode alone; each ratio against its round's engine
            cells.append(statistics.median(r[k][i] for r in runs))
            cells.append(statistics.median(r[k][i] / r[0][i] for r in runs))
        shown = " | ".join(f"{v:.1f}" if j % 2 == 0 else f"{v:.2f}" for j, v in enumerate(cells))
        print(f"| {slots} | {streams} | {shown} | {runs[0][k][2]:.0f} |", flush=True)


if __name__ == "__main__":
    main()
