"""Decode speed of `llmx serve` against `llmx run`, and of a model decoded off the thread that loaded it.

    python bench/serve_speed.py [-m MODEL] [-n 64] [--rounds 3]

Three ways to decode the same greedy tokens, each round in this order:

- `run`: `llmx run` in a process of its own; its "eval time" line;
- `serve`: one `llmx serve` (started once), a /v1/completions request; the engine's decode rate is
  the change in /metrics' llmx_decode_steps / llmx_decode_seconds, as `llmx run` counts its eval
  time; the client's is tokens / request time (prompt, HTTP and all);
- `thread`: this process loads the model, then decodes on a second thread, as the server did before
  its engine ran on the loading thread.

For the server and the thread, also the process's voluntary context switches a token: libgomp's
workers sleeping between parallel regions instead of spinning (see `llmx.server.worker`).

Prints one markdown table: the median over rounds (the rounds interleave, so a machine shared with
other work slows each way alike).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

import llmx
from llmx.api import LoadedModel

PROMPT = "Once upon a time"
ROOT = Path(__file__).resolve().parents[1]


def llmx_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmx.cli", *args]


def run_speed(model: list[str], n: int) -> float:
    out = subprocess.run(
        llmx_command("run", *model, "-p", PROMPT, "-n", str(n), "--temp", "0", "-c", "512"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    # the decode line ("llmx:        eval time = ..."), not the "prompt eval time" line above it
    return float(re.search(r"^llmx:\s+eval time .*?([\d.]+) tokens per second", out, re.M).group(1))


def start_server(model: list[str], ctx: int = 512) -> tuple[subprocess.Popen, str]:
    """`llmx serve` with `model`'s flags and -c `ctx` on a free port: the process and its URL, once it
    answers /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = llmx_command("serve", *model, "-c", str(ctx), "--port", str(port))
    server = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1)
            return server, url
        except httpx.TransportError:
            if server.poll() is not None:
                sys.exit("llmx serve did not start")
            time.sleep(0.2)


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {k: float(v) for k, v in re.findall(r"^(llmx_decode_\w+_total) (\S+)$", text, re.M)}


def serve_speed(url: str, n: int, pid: int) -> tuple[float, float, float]:
    """(engine decode tokens/s, client tokens/s over the whole request, the server's voluntary
    context switches a token)."""
    before, switches = counters(url), voluntary_switches(pid)
    t0 = time.perf_counter()
    reply = httpx.post(
        f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": n, "temperature": 0}, timeout=600
    ).json()
    seconds = time.perf_counter() - t0
    after, switches = counters(url), voluntary_switches(pid) - switches
    steps = after["llmx_decode_steps_total"] - before["llmx_decode_steps_total"]
    decode = after["llmx_decode_seconds_total"] - before["llmx_decode_seconds_total"]
    tokens = reply["usage"]["completion_tokens"]
    return steps / decode, tokens / seconds, switches / tokens


def voluntary_switches(pid: int | str = "self") -> int:
    """A process's voluntary context switches so far, all threads."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return total


def thread_speed(model: LoadedModel, n: int) -> tuple[float, float]:
    """(decode tokens/s, voluntary switches per token) of a generation on a fresh thread."""
    out: list[tuple[float, float]] = []

    def generate() -> None:
        switches = voluntary_switches()
        tokens = sum(1 for _ in model.stream_ids(PROMPT, n, temperature=0))
        out.append((model.engine.timings.gen_tps, (voluntary_switches() - switches) / tokens))

    worker = threading.Thread(target=generate)
    worker.start()
    worker.join()
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("-n", type=int, default=64, help="tokens to generate (default 64)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model_flag = ["-m", args.model] if args.model else []
    loaded = llmx.load(args.model, ctx_size=512)
    loaded.generate(PROMPT, 4, temperature=0)  # on this (the loading) thread, as `llmx run` does
    server, url = start_server(model_flag)
    serve_speed(url, 4, server.pid)  # the server's first request pays for first-use work; not timed
    rows: dict[str, list[float]] = {
        k: [] for k in ("run", "serve", "serve client", "serve switches", "thread", "thread switches")
    }
    try:
        for _ in range(args.rounds):
            rows["run"].append(run_speed(model_flag, args.n))
            engine, client, switches = serve_speed(url, args.n, server.pid)
            rows["serve"].append(engine)
            rows["serve client"].append(client)
            rows["serve switches"].append(switches)
            tps, switches = thread_speed(loaded, args.n)
            rows["thread"].append(tps)
            rows["thread switches"].append(switches)
    finally:
        server.terminate()
        server.wait()
    print(
        f"| way (n={args.n}, {args.rounds} rounds, median) | decode tokens/s | voluntary switches a token |"
    )
    print("| --- | ---: | ---: |")
    for name in ("run", "serve", "serve client", "thread"):
        switches = rows.get(f"{name} switches")
        shown = f"{statistics.median(switches):.0f}" if switches else ""
        print(f"| {name} | {statistics.median(rows[name]):.1f} | {shown} |")


if __name__ == "__main__":
    main()
