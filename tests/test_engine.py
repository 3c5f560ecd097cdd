"""The engine's own behaviour over token ids: the warm-up a GPU load runs leaves no trace."""

from __future__ import annotations

import llmx
from llmx.engine import WARM_UP_PROMPTS


def test_warm_up_leaves_the_engine_as_it_found_it(smollm2_path):
    """A warm-up runs every kind of step once, then forgets it: the context is empty, the timings are
    zero, and greedy tokens are the ones a model that never warmed up gives."""
    model = llmx.load(smollm2_path, ctx_size=64)
    assert model.warm_up is None  # all on the CPU: nothing to compile
    fresh = list(model.stream_ids("The sea is", 8, temperature=0))
    ticks = []
    seconds = model.engine.warm_up(ticks.append)
    assert seconds > 0 and ticks == [1] * (len(WARM_UP_PROMPTS) + 1)
    assert model.engine.n_past == 0 and model.engine.timings.prompt_tokens == 0
    assert list(model.stream_ids("The sea is", 8, temperature=0)) == fresh
