"""`llmx sweep-bench`: llama-sweep-bench's table, speed window by window as the context fills.

llmx sweep-bench -m model.gguf -c 8192 -ub 512 -o json > run.json
llmx sweep-bench --plot curves.png run.json other.json     # one line per result
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmx.commands.common import add_model_argument
from llmx.plan.options import add_options, options_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument(
        "-n",
        "--n-gen",
        type=int,
        default=None,
        metavar="N",
        help="tokens generated per window (default: ubatch/4, as llama-sweep-bench)",
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=("md", "json"),
        default="md",
        help="md: the table; json: the whole result, for --plot and later comparison",
    )
    parser.add_argument(
        "--mem", action="store_true", help="add host RSS and per-GPU allocated memory columns"
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="draw PP and TG t/s against N_KV for this run and/or the given JSON results",
    )
    parser.add_argument(
        "--label", default=None, help="this run's name in plots (default: model and placement)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    parser.add_argument(
        "results",
        nargs="*",
        type=Path,
        metavar="RESULT.json",
        help="earlier `sweep-bench -o json` results to plot with --plot",
    )
    add_options(parser)


def run(args: argparse.Namespace) -> int:
    from llmx.bench.plot import plot_sweeps
    from llmx.bench.results import load_json
    from llmx.errors import LlmxError

    runs = [load_json(p) for p in args.results]
    if runs and args.plot is None:
        raise LlmxError("JSON results are only read for plotting; add --plot FILE.png")
    if not runs or args.model is not None:
        runs.append(sweep_run(args))
    if args.plot is not None:
        plot_sweeps(runs, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def default_label(info: dict, placement: str, cache_k: str, cache_v: str) -> str:
    """A run's name in plots: model, weight type, placement, and the cache's types where not f16
    (runs of one model that differ only in their cache must not share a name)."""
    cache = "" if (cache_k, cache_v) == ("f16", "f16") else f" -ctk {cache_k} -ctv {cache_v}"
    return f"{info['model_name']} {info['model_ftype']} {placement}{cache}"


def sweep_run(args: argparse.Namespace) -> dict:
    """Load the model, sweep its context, print the table or the JSON result, and return the result."""
    from llmx.bench.loaded import load_for_bench
    from llmx.bench.results import environment, model_info
    from llmx.bench.rows import SWEEP_COLUMNS, memory_columns, sweep_row
    from llmx.bench.sweep import sweep
    from llmx.bench.tables import json_text, markdown
    from llmx.commands.progress import load_progress

    opts = options_from_args(args)
    bm = load_for_bench(args.model, opts, progress=load_progress())
    ub = opts.n_ubatch
    n_gen = ub // 4 if args.n_gen is None else args.n_gen
    # The planner pads the cache to whole 256-token cells, as llama.cpp does; sweep the -c asked for.
    n_ctx = min(opts.ctx_size or bm.model.engine.n_ctx, bm.model.engine.n_ctx)
    rows = []
    for window in sweep(bm.model.engine, n_ctx, ub, n_gen, bm.n_vocab, args.seed):
        rows.append(sweep_row(window, bm.roofline(window["n_kv"], n_gen) if n_gen else None))
        print(
            f"N_KV {window['n_kv']:>7}: PP {window['speed_pp']:9.2f} t/s, TG {window['speed_tg']:8.2f} t/s",
            file=sys.stderr,
        )
    info = model_info(bm.model.file)
    result = {
        "kind": "sweep-bench",
        "label": args.label
        or default_label(info, bm.placement["summary"], opts.cache_type_k, opts.cache_type_v),
        "environment": environment(),
        "model": info,
        "placement": bm.placement,
        "n_ctx": n_ctx,
        "n_ubatch": ub,
        "n_gen": n_gen,
        "rows": rows,
    }
    if args.output == "json":
        print(json_text(result))
    else:
        gpus = sorted(rows[0]["gpu_allocated"]) if rows else []
        columns = SWEEP_COLUMNS + (memory_columns(gpus) if args.mem else [])
        print(markdown(rows, columns))
    return result
