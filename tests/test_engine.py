"""The engine's own behaviour over token ids: the warm-up a GPU load runs leaves no trace; the decode loop
samples on the device and reads each token one step late, ending exactly where a waiting loop would."""

from __future__ import annotations

import pytest
import torch
from references import GREEDY
from tiny_models import greedy_steps, random_prompt, write_tiny

import llmx
from llmx.engine import WARM_UP_PROMPTS
from llmx.text.device_sampler import DeviceSampler
from llmx.text.sampler import SamplingParams


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


# --- the decode loop: sampled on the device, read one step late -------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return llmx.load(write_tiny("llama", "Q8_0", tmp_path_factory.mktemp("engine")), ctx_size=64)


def reference(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy ids the plain way: each step's logits read on the host, its argmax fed to the next."""
    tokens, _ = greedy_steps(model, prompt, steps)
    return tokens


def test_greedy_generation_is_the_step_by_step_argmax_and_the_context_holds_what_it_gave(tiny, monkeypatch):
    prompt = random_prompt(6, seed=3)
    want = reference(tiny, prompt, 10)
    tiny.engine.reset()
    steps = []
    decode = tiny.engine.decode
    monkeypatch.setattr(tiny.engine, "decode", lambda *a, **kw: steps.append(1) or decode(*a, **kw))
    assert list(tiny.engine.generate(prompt, 10, GREEDY)) == want
    # every token but the last is stored, as when each step waited for its token; with max_tokens
    # known, no step runs after the last one
    assert len(steps) == 9 and tiny.engine.n_past == len(prompt) + 10 - 1


def test_a_stop_id_read_one_step_late_ends_at_it_and_its_extra_step_is_taken_back(tiny):
    prompt = random_prompt(6, seed=3)
    want = reference(tiny, prompt, 10)
    stop = want[4]
    first = want.index(stop)
    tiny.engine.reset()
    assert list(tiny.engine.generate(prompt, 10, GREEDY, stop_ids={stop})) == want[:first]
    assert tiny.engine.n_past == len(prompt) + first  # the stop id's step, issued early, forgotten
    # the context goes on from there as if nothing more had run: the next ids are the reference's
    more = list(tiny.engine.generate(want[first : first + 1], 3, GREEDY))
    tiny.engine.reset()
    assert more == reference(tiny, prompt + want[: first + 1], 3)


def test_a_caller_that_stops_reading_leaves_the_context_at_the_last_token_it_took(tiny):
    prompt = random_prompt(5, seed=4)
    tiny.engine.reset()
    tokens = tiny.engine.generate(prompt, 20, SamplingParams(temperature=1.0, seed=11))
    taken = [next(tokens) for _ in range(4)]
    tokens.close()
    assert tiny.engine.n_past == len(prompt) + 3
    tiny.engine.reset()
    assert list(tiny.engine.generate(prompt, 4, SamplingParams(temperature=1.0, seed=11))) == taken


@pytest.mark.gpu
def test_gpu_decode_steps_are_issued_without_waiting_for_the_host(tmp_path):
    """With the embedding table on the GPU (`-ot token_embd=CUDA0`), a decode step fed the id sampled
    on the device and the next sample run with host syncs made errors; and the generated greedy ids
    are the step-by-step host argmax's."""
    path = write_tiny("llama", "Q8_0", tmp_path)
    model = llmx.load(path, ctx_size=64, n_gpu_layers="all", override_tensor=[r"token_embd\.weight=CUDA0"])
    engine, prompt = model.engine, random_prompt(6, seed=3)
    want = reference(model, prompt, 8)
    engine.reset()
    assert list(engine.generate(prompt, 8, GREEDY)) == want
    engine.reset()
    logits = engine.prefill(prompt, on_device=True)
    sampler = DeviceSampler(1, logits.shape[-1], logits.device)
    sampler.start(0, SamplingParams(temperature=0.8, seed=1), prompt)
    token = sampler(logits[None], [0])
    token = sampler(engine.decode(token, on_device=True)[None], [0])  # the decode graph is captured
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            token = sampler(engine.decode(token, on_device=True)[None], [0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
