"""`llmx serve -np 4` as its users meet it: requests served together in batched steps give the text
each gets alone, prompts longer than -ub are prefilled in chunks beside the others' decode steps, a
client that leaves frees its slot, the slots share -c as llama-server's do, and a system prompt two
requests share is computed once (the prefix cache; its eviction: `test_batch.py`)."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_server_http import CTX, KEY, Server

import llmx
from llmx.runtime.paged import BLOCK_ROWS

openai = pytest.importorskip("openai")

N_SLOTS = 4
UBATCH = 16  # shorter than the chat prompts: they are prefilled in several steps
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest",
    "def fibonacci(n):",
    "List three colours:",
]
MAX_TOKENS = 16
STORM_TOKENS = 4  # each of the 64 concurrent streams'
SYSTEM = (
    "You are the assistant of a small bakery in Lyon. Answer questions about bread, pastries, opening "
    "hours and orders in one friendly sentence. Never invent prices, and say so when you do not know. "
    "The bakery opens at seven every morning but Monday, sells sourdough, rye and brioche, and takes "
    "orders for cakes two days ahead. "
)  # 70 tokens, and as many of the prompts' 79 and 80 as they share: 4 whole blocks
QUESTIONS = ["Q: When do you open on Sundays?\nA:", "Q: Do you bake rye bread?\nA:"]
REPLY_TOKENS = 4  # what the prefix cache changes is the prompt's keys and values: the first tokens tell


@pytest.fixture(scope="module")
def server():
    s = Server("-np", str(N_SLOTS), "-ub", str(UBATCH), "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def engine_alone(smollm2_path):
    """The engine alone, with a slot's context: the text each request should get."""
    return llmx.load(smollm2_path, ctx_size=CTX // N_SLOTS)


def _complete(client, prompt: str) -> str:
    reply = client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return reply.choices[0].text


def _chat_stream(client, prompt: str) -> str:
    chunks = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True,
    )  # fmt: skip
    return "".join(c.choices[0].delta.content or "" for c in chunks)


def _completion_stream(client, prompt: str) -> str:
    request = {"prompt": prompt, "max_tokens": STORM_TOKENS, "temperature": 0, "stream": True}
    chunks = client.completions.create(model="m", **request)
    return "".join(c.choices[0].text for c in chunks)


def test_concurrent_greedy_requests_each_get_the_text_they_get_alone(server, client, engine_alone):
    want = [engine_alone.generate(p, MAX_TOKENS, temperature=0) for p in PROMPTS]
    assert [_complete(client, p) for p in PROMPTS] == want  # one at a time: a batch of one
    with ThreadPoolExecutor(2 * N_SLOTS) as pool:
        completions = [pool.submit(_complete, client, p) for p in PROMPTS]
        chats = [pool.submit(_chat_stream, client, p) for p in PROMPTS]
        assert [f.result() for f in completions] == want
        together = [f.result() for f in chats]
    assert together == [_chat_stream(client, p) for p in PROMPTS]
    assert server.metric("llmx_requests_processing") == 0


def test_sixty_four_concurrent_streams_all_complete_with_the_text_each_gets_alone(server, client):
    """Far more streams than slots (64 over 4, the default --max-queue): all are served, each its text
    alone (the same request sent when nothing else runs)."""
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]  # 8 distinct
    alone = {p: _completion_stream(client, p) for p in prompts}
    sent = [prompts[i % len(prompts)] for i in range(64)]
    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(lambda p: _completion_stream(client, p), sent))
    assert got == [alone[p] for p in sent]
    server.wait_idle()
    assert server.metric("llmx_requests_processing") == 0


def test_slots_share_the_context_and_a_client_that_leaves_frees_its_slot(server, client):
    with server.http() as http:
        props = http.get("/props").json()
        assert props["total_slots"] == N_SLOTS
        assert {s["n_ctx"] for s in http.get("/slots").json()} == {CTX // N_SLOTS}
        long_prompt = {"prompt": "word " * CTX, "max_tokens": 1}
        assert http.post("/v1/completions", json=long_prompt).status_code == 400  # beyond a slot's
        before = server.metric("llmx_tokens_predicted_total")
        endless = {"prompt": "Once upon a time", "max_tokens": CTX, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=endless) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            busy = [s for s in http.get("/slots").json() if s["is_processing"]]
            assert len(busy) == 1 and busy[0]["n_past"] >= busy[0]["n_prompt_tokens"] > 0
    server.wait_idle()
    assert server.metric("llmx_tokens_predicted_total") - before < 40  # not the slot's ~120
    assert server.metric("llmx_requests_cancelled_total") >= 1
    assert _complete(client, PROMPTS[0])


def test_a_shared_system_prompt_is_computed_once_and_the_replies_are_those_without_the_cache(
    server, client, engine_alone
):
    """The engine alone has no prefix cache: it computes every prompt whole."""
    prompts = [SYSTEM + q for q in QUESTIONS]
    ids = [engine_alone.encode(p) for p in prompts]
    shared = len(os.path.commonprefix(ids)) // BLOCK_ROWS * BLOCK_ROWS  # whole blocks
    assert shared == 4 * BLOCK_ROWS
    counted = ("llmx_prompt_tokens_total", "llmx_prompt_tokens_cached_total")
    before = [server.metric(name) for name in counted]
    replies = []
    for p in prompts:  # the second sent once the first is over (and counted in /metrics)
        replies.append(client.completions.create(model="m", prompt=p, max_tokens=REPLY_TOKENS, temperature=0))
        server.wait_idle()
    ran, cached = (server.metric(name) - b for name, b in zip(counted, before, strict=True))
    assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, shared]
    assert cached == shared and ran == len(ids[0]) + len(ids[1]) - shared  # the second ran its suffix
    texts = [r.choices[0].text for r in replies]
    assert texts == [engine_alone.generate(p, REPLY_TOKENS, temperature=0) for p in prompts]


def test_metrics_split_the_batched_steps_time(server, client):
    """/metrics counts the batched steps, those with a prompt chunk, and where their time went: the
    chunks planned, the forward issued, the sampling, the wait for the step before's ids, their
    replies' text, the hand-over to the handlers."""
    counters = ("llmx_batch_steps_total", "llmx_batch_prompt_steps_total")
    before = [server.metric(name) for name in counters]
    _complete(client, PROMPTS[0])
    server.wait_idle()
    steps, prompt_steps = (server.metric(name) - b for name, b in zip(counters, before, strict=True))
    assert 1 <= prompt_steps < steps  # the prompt's chunk, then its decode steps
    with server.http() as http:
        text = http.get("/metrics").text
    parts = dict(re.findall(r'^llmx_batch_step_seconds_total\{part="(\w+)"\} (\S+)$', text, re.M))
    assert set(parts) == {"plan", "forward", "sample", "wait", "text", "hand_over"}
    assert float(parts["forward"]) > 0 and all(float(v) >= 0 for v in parts.values())
    prompt = dict(re.findall(r'^llmx_batch_prompt_step_seconds_total\{part="(\w+)"\} (\S+)$', text, re.M))
    assert set(prompt) == set(parts)  # the steps with a prompt chunk: part of the whole
    assert 0 < float(prompt["forward"]) < float(parts["forward"])
    assert all(0 <= float(prompt[p]) <= float(parts[p]) for p in parts)


def test_a_requests_choices_run_as_parallel_sequences(client):
    reply = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in reply.choices] == [0, 1] and reply.choices[0].text == reply.choices[1].text
    assert reply.usage.completion_tokens == 8
