"""`/metrics`: the server's counters in Prometheus' text format (`prometheus-client`).

Each app has a registry of its own, so two servers in one process (the tests) count apart. Names
follow Prometheus' conventions under an `llmx_` prefix; the token counters are llama-server's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from llmx.engine import Timings
from llmx.server import step_metrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        # prompt tokens run through the model: those reused from the prefix cache are not
        self.prompt_tokens = Counter("llmx_prompt_tokens", "Prompt tokens processed", registry=registry)
        self.generated_tokens = Counter("llmx_tokens_predicted", "Tokens generated", registry=registry)
        self.cached_tokens = Counter(
            "llmx_prompt_tokens_cached", "Prompt tokens reused from the prefix cache", registry=registry
        )
        self.prompt_seconds = Counter("llmx_prompt_seconds", "Time spent on prompts", registry=registry)
        # a reply's first token comes from its prompt's step: decode steps are one fewer than its tokens
        self.decode_steps = Counter("llmx_decode_steps", "Decode steps run", registry=registry)
        self.decode_seconds = Counter("llmx_decode_seconds", "Time spent in decode steps", registry=registry)
        self.requests = Counter(
            "llmx_requests", "Requests answered, by status", ["status"], registry=registry
        )
        self.cancelled = Counter(
            "llmx_requests_cancelled", "Generations stopped because the client left", registry=registry
        )
        self.rejected = Counter("llmx_requests_rejected", "Requests refused: queue full", registry=registry)
        # where a batched step's host time goes (-np > 1): "plan" the step's chunks, "forward" the
        # forward (all of it on a CPU; its launches on a GPU, a graph's replay or, with a prompt chunk,
        # every kernel), "sample" the sampling issued and the host's picks, "wait" for the step before's
        # ids (a GPU's time beyond the host's), "text" those ids through their replies, "hand_over" the
        # events to the HTTP handlers
        self.batch_steps = Counter(step_metrics.STEPS, "Batched steps run", registry=registry)
        self.prompt_steps = Counter(
            step_metrics.PROMPT_STEPS, "Batched steps that carried a prompt chunk", registry=registry
        )
        self.batch_step_seconds = Counter(
            step_metrics.SECONDS, "Batched steps' time, by part", ["part"], registry=registry
        )
        # the same for the steps that carried a prompt chunk alone: decode-only steps are the rest
        self.prompt_step_seconds = Counter(
            step_metrics.PROMPT_SECONDS,
            "Time of the batched steps that carried a prompt chunk, by part",
            ["part"],
            registry=registry,
        )
        self.running = Gauge("llmx_requests_processing", "Requests being generated for", registry=registry)
        self.queued = Gauge("llmx_requests_deferred", "Requests waiting for the engine", registry=registry)

    def add(self, timings: Timings, generated: int) -> None:
        """One request's engine counters, and the tokens it generated."""
        self.prompt_tokens.inc(timings.prompt_tokens)
        self.generated_tokens.inc(generated)
        self.prompt_seconds.inc(timings.prompt_seconds)
        self.decode_steps.inc(timings.gen_tokens)
        self.decode_seconds.inc(timings.gen_seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, float]:
        """The throughput counters and the request gauges as plain numbers (the chat page's view)."""
        names = {
            "prompt_tokens": "llmx_prompt_tokens_total",
            "prompt_seconds": "llmx_prompt_seconds_total",
            "generated_tokens": "llmx_tokens_predicted_total",
            "decode_steps": "llmx_decode_steps_total",
            "decode_seconds": "llmx_decode_seconds_total",
            "processing": "llmx_requests_processing",
            "deferred": "llmx_requests_deferred",
        }
        return {key: self.registry.get_sample_value(name) or 0.0 for key, name in names.items()}
