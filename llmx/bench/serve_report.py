"""How a `llmx bench-serve` result reads: rich tables of throughput and latencies, and the check's
verdict. Pure: the result (JSON-ready, as `-o json` prints it) in, renderables and lines out."""

from __future__ import annotations

from typing import Any

from rich.table import Table

KIND_COLUMNS = {"decode": "decode-only steps", "prompt": "steps with a prompt chunk"}
LATENCIES = {
    "ttft_ms": "time to first token",
    "tpot_ms": "time per output token",
    "itl_ms": "inter-token latency",
    "e2e_ms": "end-to-end latency",
}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def headline(result: dict[str, Any]) -> str:
    """What was run: the server, its model and the load."""
    run = result["settings"]
    rate = "all at once" if run["rate"] == "inf" else f"{run['rate']} a second (Poisson)"
    return (
        f"{result['model']} at {result['url']}: {run['requests']} requests by {run['clients']} clients, "
        f"arriving {rate}; {run['prompt_tokens']} prompt tokens, up to {run['max_tokens']} out"
    )


def tables(result: dict[str, Any]) -> list[Table]:
    """The throughput table and the latency table of `result`."""
    s = result["summary"]
    totals = Table()
    totals.add_column("throughput")
    totals.add_column("value", justify="right")
    totals.add_row("duration (s)", f"{s['duration_s']:.2f}")
    totals.add_row("prompt / output tokens", f"{s['prompt_tokens']} / {s['output_tokens']}")
    totals.add_row("requests/s", f"{s['requests_per_s']:.2f}")
    totals.add_row("output tokens/s", f"{s['output_tokens_per_s']:.1f}")
    totals.add_row("prompt + output tokens/s", f"{s['total_tokens_per_s']:.1f}")
    latency = Table()
    latency.add_column("latency (ms)")
    for column in ("mean", "median", "p99"):
        latency.add_column(column, justify="right")
    for key, name in LATENCIES.items():
        d = s[key]
        latency.add_row(name, _ms(d["mean"]), _ms(d["median"]), _ms(d["p99"]))
    steps = result.get("server_steps")
    return [totals, latency] if steps is None else [totals, latency, _steps_table(steps)]


def _steps_table(steps: dict[str, Any]) -> Table:
    """The server's batched steps over the load run, from its /metrics: ms a step by part over all
    of them, and apart for the decode-only steps and those with a prompt chunk where it counts them."""
    kinds = steps.get("ms_per_step_by_kind", {})
    table = Table()
    table.add_column("server's batched steps (/metrics)")
    table.add_column("all", justify="right")
    for kind in kinds:
        table.add_column(KIND_COLUMNS[kind], justify="right")
    blank = [""] * len(kinds)
    table.add_row("steps (with a prompt chunk)", f"{steps['steps']} ({steps['prompt_steps']})", *blank)
    table.add_row("output tokens a step", f"{steps['output_tokens_per_step']:.1f}", *blank)
    for part, ms in steps["ms_per_step"].items():
        table.add_row(
            f"ms a step: {part}", f"{ms:.2f}", *(f"{by_part[part]:.2f}" for by_part in kinds.values())
        )
    return table


def verdict(result: dict[str, Any]) -> list[str]:
    """The check's lines: one saying whether every response equals its prompt served alone (those that
    part at a near tie counted apart), then one per mismatch."""
    check = result["check"]
    n, wrong = result["summary"]["requests"], check["mismatches"]
    if not wrong:
        return [f"check: all {n} responses equal their prompt served alone ({check['prompts']} prompts)"]
    ties = sum(m["near_tie"] for m in wrong)
    apart = (
        f"{ties} of {n} responses part from their prompt served alone at a near tie (its top two "
        f"tokens within {check['near_tie_nats']} nats, where batched kernels may pick either)"
    )
    if ties == len(wrong):
        head = f"check: {apart}; the other {n - ties} equal it"
    else:
        head = f"check FAILED: {len(wrong) - ties} of {n} responses differ from their prompt served alone"
        head += f"; {apart}" if ties else ""
    return [head, *(m["line"] for m in wrong)]
