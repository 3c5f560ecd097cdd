"""Sweep-bench curves: prompt and generation speed against the context already filled (N_KV).

One line per run, so several JSON results (two placements, two builds, llmx and a llama.cpp log
converted to the same rows) compare at a glance; the generation panel draws each run's bandwidth
floor as a dashed line of the same colour when the run recorded one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from llmx.errors import LlmxError


def plot_sweeps(runs: Sequence[dict[str, Any]], path: str | os.PathLike, title: str | None = None) -> None:
    """Write a PNG with PP t/s and TG t/s against N_KV; `runs` are sweep-bench results (`label`, `rows`)."""
    if not runs or not any(r.get("rows") for r in runs):
        raise LlmxError("nothing to plot: the sweep-bench results have no rows")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed, and no GUI toolkit imported
        import matplotlib.pyplot as plt
    except ImportError:
        raise LlmxError("--plot needs matplotlib: pip install 'llmx[plot]'") from None

    fig, (ax_pp, ax_tg) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for i, run in enumerate(runs):
        rows = run["rows"]
        n_kv = [r["n_kv"] for r in rows]
        color = f"C{i % 10}"
        label = run.get("label") or f"run {i + 1}"
        ax_pp.plot(n_kv, [r["speed_pp"] for r in rows], "o-", color=color, label=label, markersize=3)
        ax_tg.plot(n_kv, [r["speed_tg"] for r in rows], "o-", color=color, label=label, markersize=3)
        floors = [r.get("floor_tg") for r in rows]
        if all(f is not None for f in floors):
            ax_tg.plot(n_kv, floors, "--", color=color, alpha=0.6, label=f"{label}: at the bandwidth floor")
    for ax, what in ((ax_pp, "prompt processing (PP)"), (ax_tg, "generation (TG)")):
        ax.set_xlabel("N_KV (tokens already in the context)")
        ax.set_ylabel("tokens/s")
        ax.set_title(what)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
