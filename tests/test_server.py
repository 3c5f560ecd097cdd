"""`llmx serve`'s API over the embedded SmolLM2: OpenAI's shapes, the same greedy text as the Python
API, streaming equal to the whole reply, stop strings, and one-line 400s for bad requests."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

import llmx  # noqa: E402
from llmx.plan.report import layer_ranges  # noqa: E402
from llmx.server.app import ServerConfig, make_app  # noqa: E402
from llmx.server.errors import ApiError  # noqa: E402
from llmx.server.generation import Piece  # noqa: E402
from llmx.server.metrics import Metrics  # noqa: E402
from llmx.server.protocol import Candidate, Request, StopScanner, TokenLogprob, completion_logprobs  # noqa: E402
from llmx.server.worker import Outbox, Ticket, Worker  # noqa: E402

JSON = {"content-type": "application/json"}
MESSAGES = [{"role": "user", "content": "Name three primary colours."}]


@pytest.fixture(scope="module")
def model(smollm2_path):
    return llmx.load(smollm2_path, ctx_size=512)


@pytest.fixture(scope="module")
def client(model):
    worker = Worker(model, 8, Metrics())
    engine = threading.Thread(target=worker.run)
    engine.start()
    yield TestClient(make_app(worker, ServerConfig("smollm2")))
    worker.stop()
    engine.join()


def events(response) -> list:
    """The data of a server-sent event stream, `[DONE]` as the string."""
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_completion_is_the_apis_greedy_text(client, model):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    ids = model.chat_prompt(MESSAGES)
    assert body["object"] == "chat.completion" and body["model"] == "smollm2"
    choice = body["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": model.generate(ids, 16, temperature=0),
    }
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(ids) and 0 < usage["completion_tokens"] <= 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert choice["finish_reason"] == ("length" if usage["completion_tokens"] == 16 else "stop")


def test_streamed_chat_equals_the_whole_reply(client):
    request = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    whole = client.post("/v1/chat/completions", json=request).json()
    r = client.post("/v1/chat/completions", json=request | {"stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = events(r)
    assert chunks[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_completion_stops_before_a_stop_string(client):
    request = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    full = client.post("/v1/completions", json=request).json()["choices"][0]
    assert full["finish_reason"] == "length" and len(full["text"]) > 4
    stop = full["text"][3:5]  # somewhere inside the reply, across a token boundary or not
    cut = client.post("/v1/completions", json=request | {"stop": [stop, "@@@"]}).json()["choices"][0]
    cut_text = full["text"][: full["text"].find(stop)]
    assert cut == {"index": 0, "finish_reason": "stop", "text": cut_text, "logprobs": None}
    streamed = events(client.post("/v1/completions", json=request | {"stop": stop, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == cut["text"]


def test_return_tokens_gives_each_choice_the_ids_of_its_text(client, model):
    """llama-server's `return_tokens`: the generated ids, whole and a piece at a time when streamed."""
    request = {
        "prompt": "The capital of France is",
        "max_tokens": 10,
        "temperature": 0,
        "return_tokens": True,
    }
    choice = client.post("/v1/completions", json=request).json()["choices"][0]
    ids = choice["tokens"]
    assert choice["finish_reason"] == "length" and len(ids) == 10
    assert model.tokenizer.decode(ids) == choice["text"]
    streamed = events(client.post("/v1/completions", json=request | {"stream": True}))
    assert [i for c in streamed[:-1] for i in c["choices"][0]["tokens"]] == ids
    chat = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "return_tokens": True}
    message = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
    assert model.tokenizer.decode(message["tokens"]) == message["message"]["content"]
    assert (
        "tokens"
        not in client.post("/v1/completions", json=request | {"return_tokens": False}).json()["choices"][0]
    )
    bad = client.post("/v1/completions", json=request | {"return_tokens": 1})
    assert (
        bad.status_code == 400 and "'return_tokens' must be true or false" in bad.json()["error"]["message"]
    )


def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["smollm2"]


def test_placement_is_the_loaded_plan_and_stats_count_a_reply(client, model):
    placement = client.get("/placement").json()
    assert placement["tensors"] == model.plan.tensor_device
    assert placement["layer_ranges"] == [list(r) for r in layer_ranges(model.plan)]
    assert len(placement["layers"]) == model.config.n_layer + 2  # and the input and output rows
    before = client.get("/stats").json()
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    tokens = r.json()["usage"]["completion_tokens"]
    deadline = time.monotonic() + 10  # the worker counts a reply just after sending its last event
    while (after := client.get("/stats").json())["generated_tokens"] < before["generated_tokens"] + tokens:
        assert time.monotonic() < deadline, after
        time.sleep(0.01)
    assert after["generated_tokens"] - before["generated_tokens"] == tokens
    assert after["decode_steps"] - before["decode_steps"] == tokens - 1  # the first comes from the prompt
    assert after["prompt_tokens"] > before["prompt_tokens"] and after["processing"] == 0


def test_the_chat_page_and_its_files(client):
    page = client.get("/")
    assert page.headers["content-type"].startswith("text/html") and 'src="web/main.js"' in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/web/main.js").headers["content-type"].startswith("text/javascript")
    missing = client.get("/web/nothing.js")
    assert missing.status_code == 404 and "/web/nothing.js" in missing.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/v1/chat/completions", b"{not json", "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", "JSON object"),
        ("/v1/chat/completions", {"max_tokens": 4}, "'messages'"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "'max_tokens'"),
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, "'temperature'"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 2}, "top-p"),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 17}, "'n' must be an integer from 1 to 16"),
        ("/v1/chat/completions", {"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
        ("/v1/completions", {"prompt": ""}, "'prompt'"),
        ("/v1/completions", {"prompt": "word " * 600}, "context holds 512"),
    ],
)
def test_bad_requests_are_one_line_400s(client, path, body, says):
    send = {"content": body, "headers": JSON} if isinstance(body, bytes) else {"json": body}
    r = client.post(path, **send)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert says in message and "\n" not in message and "Traceback" not in message


def test_stop_scanner_holds_back_a_possible_stop_and_cuts_at_the_first():
    scan = StopScanner(("END", "xy"))
    assert [scan.push(p) for p in ("ab", "cE", "N", "q ", "x")] == ["ab", "c", "", "ENq ", ""]
    assert scan.push("yz") == "" and scan.stopped and scan.push("more") == "" and scan.flush() == ""
    tail = StopScanner(("END",))
    assert tail.push("aE") == "a" and tail.flush() == "E" and not tail.stopped


def test_completion_logprobs_keep_the_likelier_of_two_tokens_that_read_the_same():
    """Pieces of one character each decode to U+FFFD: the completions API's {text: logprob} keeps the
    likelier one's logprob for the text, as the chosen token's column says."""
    torn = [
        Candidate("\ufffd", b"\xe2", -0.5),
        Candidate("\ufffd", b"\xe3", -0.7),
        Candidate("a", b"a", -2.0),
    ]
    columns = completion_logprobs([TokenLogprob(torn[0], tuple(torn))], 0)
    assert columns["token_logprobs"] == [-0.5]
    assert columns["top_logprobs"] == [{"\ufffd": -0.5, "a": -2.0}]


def test_the_queue_refuses_past_its_limit_frees_cancelled_places_and_answers_them_at_stop(model):
    worker, loop = Worker(model, 1, Metrics()), asyncio.new_event_loop()
    tickets = [Ticket(Request("completion", prompt="Hi"), [1], loop) for _ in range(3)]
    worker.submit(tickets[0])
    with pytest.raises(ApiError) as full:
        worker.submit(tickets[1])
    assert full.value.status == 503 and full.value.headers() == {"Retry-After": "1"}
    tickets[0].cancel()  # its client left while it waited
    worker.submit(tickets[2])
    worker.stop()
    worker.run()  # returns at once, answering what waits
    answer = loop.run_until_complete(asyncio.wait_for(tickets[2].events.get(), 1))
    assert isinstance(answer, ApiError) and answer.code == "shutting_down"
    with pytest.raises(ApiError):
        worker.submit(tickets[1])
    loop.close()


def test_an_outbox_wakes_each_loop_once_and_keeps_every_tickets_order():
    """A batched step's events reach their handlers in one wake of their loop, each ticket's in order."""
    loops = [asyncio.new_event_loop() for _ in range(2)]
    wakes: list[int] = []
    for k, loop in enumerate(loops):
        wake = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, k=k, wake=wake: wakes.append(k) or wake(*a)  # type: ignore[method-assign]
    tickets = [Ticket(Request("completion", prompt="Hi"), [1], loops[k % 2]) for k in range(3)]
    outbox = Outbox()
    for n in range(4):
        for k, ticket in enumerate(tickets):
            outbox.put(ticket, Piece(f"{k}:{n}"))
    assert wakes == []  # nothing is handed over before the flush
    outbox.flush()
    assert sorted(wakes) == [0, 1]
    for k, ticket in enumerate(tickets):
        loop = ticket.loop
        got = [loop.run_until_complete(asyncio.wait_for(ticket.events.get(), 1)).text for _ in range(4)]
        assert got == [f"{k}:{n}" for n in range(4)]
    outbox.flush()  # emptied by the first: no wake more
    assert sorted(wakes) == [0, 1]
    for loop in loops:
        loop.close()


def test_a_prompt_stops_between_its_chunks_once_cancelled(model):
    """A long prompt runs a -ub chunk at a time and stops at the first chunk boundary after its client
    left: the engine holds the chunks before it, not the whole prompt, and nothing is generated."""
    from llmx.server.generation import generate

    engine = model.engine
    ubatch, engine.ubatch = engine.ubatch, 8
    try:
        ran: list[int] = []
        steps = generate(model, Request("completion", prompt="x"), list(range(1, 41)), None,
                         lambda: (ran.append(engine.n_past) or len(ran)) > 2)  # fmt: skip
        assert list(steps) == []
        assert ran == [0, 8, 16] and engine.n_past == 16
        whole = generate(model, Request("completion", prompt="x", max_tokens=1), list(range(1, 41)))
        assert len(list(whole)) >= 1 and engine.n_past == 40
    finally:
        engine.ubatch = ubatch
