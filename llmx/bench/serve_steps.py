"""What a llmx server's own /metrics say of a load run: its batched steps and their time by part, read
before and after the run (a difference, so the runs alone that the check makes later do not count).
Pure: two Prometheus texts in, one JSON-ready dict out; None where the server keeps no such metrics
(another server, or llmx with -np 1, which runs no batched steps)."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

STEPS, PROMPT_STEPS, SECONDS = "llmx_batch_steps", "llmx_batch_prompt_steps", "llmx_batch_step_seconds"


def _counters(text: str) -> dict[tuple[str, str], float]:
    """Every `_total` sample of the three step counters, by (family, its `part` label or "")."""
    out = {}
    try:
        for family in text_string_to_metric_families(text):  # typed counters, or untyped `_total` lines
            for sample in family.samples:
                name = sample.name.removesuffix("_total")
                if sample.name.endswith("_total") and name in (STEPS, PROMPT_STEPS, SECONDS):
                    out[name, sample.labels.get("part", "")] = sample.value
    except ValueError:  # not Prometheus' text format: no such counters
        return {}
    return out


def step_split(before: str, after: str, output_tokens: int) -> dict[str, Any] | None:
    """The run's batched steps from /metrics texts read `before` and `after` it: how many, how many
    carried prompt chunks, output tokens a step, and milliseconds a step by part (plan, forward,
    sample, wait, text, hand_over: `server.scheduler`)."""
    first, last = _counters(before), _counters(after)
    steps = last.get((STEPS, ""), 0.0) - first.get((STEPS, ""), 0.0)
    if steps <= 0:
        return None
    parts = {
        part: 1e3 * (seconds - first.get((SECONDS, part), 0.0)) / steps
        for (name, part), seconds in last.items()
        if name == SECONDS
    }
    return {
        "steps": int(steps),
        "prompt_steps": int(last.get((PROMPT_STEPS, ""), 0.0) - first.get((PROMPT_STEPS, ""), 0.0)),
        "output_tokens_per_step": output_tokens / steps,
        "ms_per_step": parts,
    }
