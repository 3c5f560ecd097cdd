"""What a llmx server's own /metrics say of a load run: its batched steps and their time by part, read
before and after the run (a difference, so the runs alone that the check makes later do not count).
Pure: two Prometheus texts in, one JSON-ready dict out; None where the server keeps no such metrics
(another server, or llmx with -np 1, which runs no batched steps)."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from llmx.server.step_metrics import PROMPT_SECONDS, PROMPT_STEPS, SECONDS, STEPS

COUNTERS = (STEPS, PROMPT_STEPS, SECONDS, PROMPT_SECONDS)


def _counters(text: str) -> dict[tuple[str, str], float]:
    """Every `_total` sample of the step counters, by (family, its `part` label or "")."""
    out = {}
    try:
        for family in text_string_to_metric_families(text):  # typed counters, or untyped `_total` lines
            for sample in family.samples:
                name = sample.name.removesuffix("_total")
                if sample.name.endswith("_total") and name in COUNTERS:
                    out[name, sample.labels.get("part", "")] = sample.value
    except ValueError:  # not Prometheus' text format: no such counters
        return {}
    return out


def step_split(before: str, after: str, output_tokens: int) -> dict[str, Any] | None:
    """The run's batched steps from /metrics texts read `before` and `after` it: how many, how many
    carried prompt chunks, output tokens a step, and milliseconds a step by part (plan, forward,
    sample, wait, text, hand_over: `server.scheduler`), over all steps and, where the server counts
    them apart, over the decode-only steps and over those with a prompt chunk."""
    first, last = _counters(before), _counters(after)

    def run(name: str, part: str = "") -> float:
        return last.get((name, part), 0.0) - first.get((name, part), 0.0)

    steps, prompt_steps = run(STEPS), run(PROMPT_STEPS)
    if steps <= 0:
        return None
    parts = [part for name, part in last if name == SECONDS]
    split: dict[str, Any] = {
        "steps": int(steps),
        "prompt_steps": int(prompt_steps),
        "output_tokens_per_step": output_tokens / steps,
        "ms_per_step": {part: 1e3 * run(SECONDS, part) / steps for part in parts},
    }
    if any((PROMPT_SECONDS, part) in last for part in parts):
        by_kind = split["ms_per_step_by_kind"] = {}
        if steps > prompt_steps:
            by_kind["decode"] = {
                part: 1e3 * (run(SECONDS, part) - run(PROMPT_SECONDS, part)) / (steps - prompt_steps)
                for part in parts
            }
        if prompt_steps > 0:
            by_kind["prompt"] = {part: 1e3 * run(PROMPT_SECONDS, part) / prompt_steps for part in parts}
    return split
