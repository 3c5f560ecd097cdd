"""The end-to-end rows of bench/RESULTS.md: one suite per machine, JSON kept, one markdown table.

    python bench/e2e.py run cpu               # SmolLM2-135M (the embedded model) on this CPU
    python bench/e2e.py run gpu               # synthetic Llama-3-8B Q4_K_M and Q8_0, all layers on GPU 0
    python bench/e2e.py run hybrid            # synthetic Llama-3-8B Q4_K_M at -ngl 24, 16 and 0
    python bench/e2e.py table bench/results/*.json   # one table from any saved runs

`run` writes synthetic models into ~/.cache/llmx/synth once, re-measures this machine's ceilings,
runs `llmx bench -o json` and saves the rows to bench/results/SUITE-HOST-DATE.json (each row holds
the environment and the full plan), then prints the markdown. Each suite stays well under ten
minutes on an H200 machine, so they can run one at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import time
from pathlib import Path

from llmx import cli
from llmx.bench.rows import bench_columns
from llmx.bench.synth import synthesize
from llmx.bench.tables import markdown

RESULTS = Path(__file__).parent / "results"
SYNTH = Path.home() / ".cache" / "llmx" / "synth"

# suite -> (synthetic models to write as (shape, type), llmx bench arguments with {name} placeholders)
SUITES: dict[str, tuple[list[tuple[str, str]], list[str]]] = {
    "cpu": ([], ["-p", "512", "-n", "128", "-r", "5"]),
    "gpu": (
        [("llama3-8b", "Q4_K_M"), ("llama3-8b", "Q8_0")],
        [
            "-m",
            "{llama3-8b-Q4_K_M}",
            "-m",
            "{llama3-8b-Q8_0}",
            "-ngl",
            "99",
            "-p",
            "512",
            "-n",
            "128",
            "-r",
            "3",
        ],
    ),
    "hybrid": (
        [("llama3-8b", "Q4_K_M")],
        ["-m", "{llama3-8b-Q4_K_M}", "-ngl", "24,16,0", "-p", "512", "-n", "128", "-r", "3"],
    ),
}


def synthetic(shape: str, type_name: str) -> Path:
    """The synthetic model, written on first use."""
    path = SYNTH / f"{shape}-{type_name}.gguf"
    if not path.exists():
        SYNTH.mkdir(parents=True, exist_ok=True)
        synthesize(shape, type_name, path)
    return path


def run_suite(name: str) -> list[dict]:
    models, argv = SUITES[name]
    paths = {f"{shape}-{type_name}": str(synthetic(shape, type_name)) for shape, type_name in models}
    cli.main(["bench", "--ceilings"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["bench", *(a.format(**paths) for a in argv), "-o", "json"])
    if code:
        raise SystemExit(code)
    rows = json.loads(out.getvalue())
    RESULTS.mkdir(exist_ok=True)
    saved = RESULTS / f"{name}-{platform.node()}-{time.strftime('%Y%m%d-%H%M')}.json"
    saved.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"saved {saved}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("run").add_argument("suite", choices=SUITES)
    sub.add_parser("table").add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    if args.what == "run":
        rows = run_suite(args.suite)
    else:
        rows = [row for f in args.files for row in json.loads(f.read_text())]
    print(markdown(rows, bench_columns(rows)))


if __name__ == "__main__":
    main()
