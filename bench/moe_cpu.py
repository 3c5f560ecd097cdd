"""One MoE layer's routed experts on the CPU: the per-expert path against the one native call.

A Qwen3-30B-A3B layer (128 experts, 8 a token, n_embd 2048, expert width 768) of random Q4_K_M-like
stacks (gate and up Q4_K, down Q6_K or --down-type), ~390 MB: the chosen experts stream from RAM as in
a real decode step. For each thread count and batch M, the two ways of `ops.moe_ffn` take turns, round
by round, on the same fresh routings (random top-8 per token, as a router spreads them):

- per expert: `ops.moe.grouped_ffn`, the path before the one call (argsort/bincount, one native SwiGLU
  call an expert that has tokens, weighted index_add);
- one call:   `ops.moe_ffn`'s native call (`cpu_native.moe_swiglu`), for decode steps and prompts.

Each round times `--calls` layer calls; the table gives ms a call and per token, and GB/s of the
chosen experts' bytes (each expert once a call, whichever tokens share it), as the range over rounds
(best first) and as a share of the RAM read rate `llmx bench --ceilings` measured for that thread count.

    PYTHONPATH=. python bench/moe_cpu.py [--threads 1,2] [--m 1] [--rounds 5] [--calls 20]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from llmx.bench.blocks import random_data
from llmx.bench.ceilings import ceilings_for
from llmx.bench.tables import Column, markdown
from llmx.ops import moe
from llmx.quant import qtype
from llmx.quant.weight import QWeight, prepare_cpu, prepare_shared

N_EXPERT, K_USED, N_EMBD, N_FF = 128, 8, 2048, 768


def stack(name: str, rows: int, cols: int, seed: int) -> QWeight:
    """A random stack [N_EXPERT, rows, cols] of type `name`, as the loader makes it (CPU, prepared)."""
    qt = qtype(name)
    data = random_data(qt, N_EXPERT * rows * cols, cols**-0.5, np.random.default_rng(seed))
    raw = torch.from_numpy(data).view(N_EXPERT * rows, qt.row_bytes(cols))
    return prepare_cpu(QWeight(raw, qt, (N_EXPERT, rows, cols), f"{name} stack"))


def routings(m: int, calls: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`calls` routings of m tokens: (weights [m, K_USED] summing to 1, distinct expert ids [m, K_USED])."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(calls):
        ids = torch.stack([torch.randperm(N_EXPERT, generator=g)[:K_USED] for _ in range(m)])
        weights = torch.rand(m, K_USED, generator=g)
        out.append((weights / weights.sum(1, keepdim=True), ids))
    return out


def timed(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], routes: list) -> float:
    t0 = time.perf_counter()
    for weights, ids in routes:
        fn(weights, ids)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    ap.add_argument("--m", default="1", help="tokens a call (decode: 1; prompts: e.g. 64), comma-separated")
    ap.add_argument("--down-type", default="Q6_K", help="the down stack's type (Q4_K_M mixes Q6_K and Q4_K)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20, help="layer calls a round")
    args = ap.parse_args()
    gate, up = stack("Q4_K", N_FF, N_EMBD, 1), stack("Q4_K", N_FF, N_EMBD, 2)
    down = stack(args.down_type, N_EMBD, N_FF, 3)
    for matrices in zip(gate.experts, up.experts, strict=True):  # as the per-expert path had them
        prepare_shared(matrices)
    expert_bytes = sum(w.raw.nbytes for w in (gate, up, down)) // N_EXPERT
    ways = {
        "per expert": lambda x, w, i: moe.grouped_ffn(x, gate, up, down, w, i),
        "one call": lambda x, w, i: moe.moe_ffn(x, gate, up, down, w, i),
    }
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        ram = ceilings_for(["cpu"], notify=print)["cpu"].mem_gbs
        for m in [int(v) for v in args.m.split(",")]:
            x = torch.randn(m, N_EMBD)
            seconds: dict[str, list[tuple[float, int]]] = {name: [] for name in ways}  # and bytes read
            for r in range(args.rounds + 1):  # round 0 warms up
                routes = routings(m, args.calls, seed=r)
                chosen = sum(len(set(ids.reshape(-1).tolist())) for _, ids in routes) * expert_bytes
                for name, fn in ways.items():
                    s = timed(lambda w, i, fn=fn, x=x: fn(x, w, i), routes)
                    if r:
                        seconds[name].append((s, chosen))
            for name, runs in seconds.items():
                ms = sorted(s / args.calls * 1e3 for s, _ in runs)
                gbs = sorted((c / s / 1e9 for s, c in runs), reverse=True)
                rows.append(dict(threads=threads, m=m, way=name, ms=ms, gbs=gbs, ram=ram))
    print(markdown(rows, COLUMNS))


def _range(v: list[float], fmt: str) -> str:
    return f"{v[0]:{fmt}}-{v[-1]:{fmt}}"


COLUMNS = [
    Column("threads", lambda r: str(r["threads"])),
    Column("M", lambda r: str(r["m"])),
    Column("way", lambda r: r["way"], right=False),
    Column("ms a layer", lambda r: _range(r["ms"], ".2f")),
    Column("ms a token", lambda r: _range([v / r["m"] for v in r["ms"]], ".2f")),
    Column("GB/s of chosen experts", lambda r: _range(r["gbs"], ".1f")),
    Column("% of RAM read", lambda r: _range([100 * g / r["ram"] for g in r["gbs"]], ".0f")),
    Column("RAM GB/s", lambda r: f"{r['ram']:.1f}"),
]


if __name__ == "__main__":
    main()
