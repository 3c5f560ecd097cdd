"""`llmx bench`: llama-bench's table (pp/tg tokens/s per placement), with GB/s and % of the floor,
then what the engine measured: host ms per generated token, the CPU segments' ms and GB/s in
hybrid runs, bytes streamed by op offload, and each GPU's compute memory beside the plan's estimate.

llmx bench -m model.gguf -p 512 -n 128 -ngl 0,16,99 -ctk f16,bf16 -o md
llmx bench --ceilings          # measure and cache every device's bandwidth and matrix rate
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from llmx.bench.grid import int_list, option_grid
from llmx.commands.common import add_model_argument
from llmx.plan.options import add_options, options_from_args

EPILOG = (
    "Every placement option takes a comma list (or a range first-last+step) and gives one row per "
    "combination, as in llama-bench; -ts separates GPUs with '/' (3/1,1/1) and -ot separates one "
    "alternative's rules with ';'."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    add_model_argument(parser, several=True)
    parser.add_argument(
        "-p", "--n-prompt", default="512", metavar="N,...", help="prompt tokens (default 512)"
    )
    parser.add_argument(
        "-n", "--n-gen", default="128", metavar="N,...", help="generated tokens (default 128)"
    )
    parser.add_argument(
        "-d",
        "--n-depth",
        default="0",
        metavar="N,...",
        help="tokens already in the context before each test (default 0)",
    )
    parser.add_argument(
        "-r",
        "--repetitions",
        type=int,
        default=5,
        metavar="N",
        help="timed runs per test, after one warm-up run (default 5)",
    )
    parser.add_argument("-o", "--output", choices=("md", "csv", "json"), default="md", help="table format")
    parser.add_argument(
        "--ceilings",
        action="store_true",
        help="(re)measure and cache every device's bandwidth and matrix rate, and print them",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt tokens")
    add_options(parser)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from llmx.api import check_runnable
    from llmx.bench.ceilings import ceilings_for, visible_devices
    from llmx.bench.loaded import free_memory, load_for_bench
    from llmx.bench.results import environment, model_info
    from llmx.bench.rows import CEILING_COLUMNS, bench_columns, bench_row
    from llmx.bench.runner import Counters, Speed, bench_tests, time_test, warmup_runs
    from llmx.bench.tables import markdown, render
    from llmx.commands.progress import load_progress
    from llmx.errors import LlmxError

    if args.ceilings:
        measured = ceilings_for(visible_devices(), remeasure=True, notify=lambda m: print(m, file=sys.stderr))
        print(
            markdown([asdict(c) | {"device": d} for d, c in measured.items()], CEILING_COLUMNS),
            file=sys.stderr,
        )
        if args.model is None:
            return 0
    tests = bench_tests(int_list(args.n_prompt), int_list(args.n_gen), int_list(args.n_depth))
    if not tests or args.repetitions < 1:
        raise LlmxError("nothing to measure: give -p or -n above 0 and -r of at least 1")
    placements = [options_from_args(ns) for ns in option_grid(args)]
    for opts in placements:  # every row's options, before the first row loads
        check_runnable(opts)
    env = environment()
    rows = []
    for path in args.model or [None]:
        for opts in placements:
            if "ctx_size" not in opts.given:  # as llama-bench, a context just large enough for the tests
                opts = opts.replace(ctx_size=max(t.n_ctx for t in tests))
            bm = load_for_bench(path, opts, progress=load_progress())
            info = model_info(bm.model.file)
            runs = sum(args.repetitions + warmup_runs(t) for t in tests)
            bar = tqdm(total=runs, desc="benchmarking", leave=False, disable=None)
            for test in tests:
                bm.memory.start()
                samples = time_test(
                    bm.model.engine, test, args.repetitions, bm.n_vocab, args.seed, bar.update
                )
                roof = bm.roofline(test.n_depth, test.n_gen) if test.n_gen else None
                speed = Speed(test.n_tokens, tuple(s.seconds for s in samples))
                counters = Counters.of(samples)
                rows.append(
                    bench_row(
                        env, info, bm.options, bm.placement, test, speed, roof, counters, bm.memory.measure()
                    )
                )
            bar.close()
            bm = None  # drop the model before the next placement loads
            free_memory()
    print(render(rows, args.output, bench_columns(rows)))
    return 0
