"""Result rows (flat dicts) as a markdown table, CSV or JSON: the three `-o` formats of llama-bench."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llmx.bench.results import plain


@dataclass(frozen=True)
class Column:
    """One markdown column: a header, how to render a row's cell, and its alignment."""

    header: str
    cell: Callable[[dict[str, Any]], str]
    right: bool = True


def markdown(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """A GitHub markdown table with padded cells, readable as plain text too."""
    cells = [[c.cell(r) for c in columns] for r in rows]
    widths = [max([len(c.header), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        padded = (
            v.rjust(w) if c.right else v.ljust(w) for v, w, c in zip(values, widths, columns, strict=True)
        )
        return "| " + " | ".join(padded) + " |"

    rule = (
        "| "
        + " | ".join("-" * (w - 1) + (":" if c.right else "-") for w, c in zip(widths, columns, strict=True))
        + " |"
    )
    return "\n".join([line([c.header for c in columns]), rule, *(line(r) for r in cells)])


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    """CSV with every field of every row; lists and dicts are written as JSON inside the cell."""
    fields = list(dict.fromkeys(k for r in rows for k in r))
    out = io.StringIO()
    w = csv.DictWriter(out, fields, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(
            {k: json.dumps(plain(v)) if isinstance(v, (list, tuple, dict)) else v for k, v in r.items()}
        )
    return out.getvalue()


def json_text(data: Any) -> str:
    return json.dumps(plain(data), indent=2)


def render(rows: Sequence[dict[str, Any]], output: str, columns: Sequence[Column]) -> str:
    """Rows in one of llama-bench's `-o` formats: md (the columns), csv or json (every field)."""
    if output == "json":
        return json_text(rows)
    if output == "csv":
        return csv_text(rows).rstrip("\n")
    return markdown(rows, columns)


# --- cell formatters ---


def human_bytes(n: float) -> str:
    """Binary units, as llama-bench prints sizes: '4.58 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: float) -> str:
    """Decimal magnitudes, as parameter counts are quoted: '8.03 B', '134.52 M'."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return str(int(n))


def mean_pm(mean: float | None, std: float | None, digits: int = 2) -> str:
    """'264.90 ± 1.23'; an empty cell when there is no value."""
    if mean is None:
        return ""
    return f"{mean:.{digits}f} ± {std or 0:.{digits}f}"


def number(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "" if value is None else f"{value:.{digits}f}{suffix}"
