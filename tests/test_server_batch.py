"""`llmx serve -np 4` as its users meet it: requests served together in batched steps give the text
each gets alone, prompts longer than -ub are prefilled in chunks beside the others' decode steps, a
client that leaves frees its slot, and the slots share -c as llama-server's do."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from test_server_http import CTX, KEY, Server

import llmx

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


@pytest.fixture(scope="module")
def server():
    s = Server("-np", str(N_SLOTS), "-ub", str(UBATCH), "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _complete(client, prompt: str) -> str:
    reply = client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return reply.choices[0].text


def _chat_stream(client, prompt: str) -> str:
    chunks = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True,
    )  # fmt: skip
    return "".join(c.choices[0].delta.content or "" for c in chunks)


def test_concurrent_greedy_requests_each_get_the_text_they_get_alone(server, client, smollm2_path):
    engine_alone = llmx.load(smollm2_path, ctx_size=CTX // N_SLOTS)
    want = [engine_alone.generate(p, MAX_TOKENS, temperature=0) for p in PROMPTS]
    assert [_complete(client, p) for p in PROMPTS] == want  # one at a time: a batch of one
    with ThreadPoolExecutor(2 * N_SLOTS) as pool:
        completions = [pool.submit(_complete, client, p) for p in PROMPTS]
        chats = [pool.submit(_chat_stream, client, p) for p in PROMPTS]
        assert [f.result() for f in completions] == want
        together = [f.result() for f in chats]
    assert together == [_chat_stream(client, p) for p in PROMPTS]
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


def test_a_requests_choices_run_as_parallel_sequences(client):
    reply = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in reply.choices] == [0, 1] and reply.choices[0].text == reply.choices[1].text
    assert reply.usage.completion_tokens == 8
