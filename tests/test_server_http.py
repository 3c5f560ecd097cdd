"""`llmx serve` as its users meet it: a real server process on loopback, the official `openai` client
and raw HTTP. Clients that leave free the engine, any number wait in the queue up to its limit,
/health answers under load, every error is OpenAI's error object, SIGTERM ends it in seconds.

Timing-sensitive checks count tokens rather than seconds where they can: the test machine is shared."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test"
ORIGIN = "http://app.example"
CTX = 512
LONG = {"prompt": "Once upon a time", "max_tokens": CTX, "temperature": 0}  # runs until -c is full
HI = {"messages": [{"role": "user", "content": "Hi"}]}
UNUSABLE = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no such type"}}}


class Server:
    """`llmx serve` on a free loopback port, with `flags`."""

    def __init__(self, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "llmx.cli",
            "serve",
            "-c",
            str(CTX),
            "--port",
            str(self.port),
            *flags,
        ]
        # a file, not a pipe (a full one would block the server), open as long as the server runs
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.process = subprocess.Popen(command, cwd=ROOT, stderr=self.log)
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None, self.log.seek(0) or self.log.read()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)

    def http(self, key: str | None = KEY, timeout: float = 60) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def metric(self, name: str) -> float:
        with self.http() as http:
            lines = http.get("/metrics").text.splitlines()
        return sum(float(line.split()[-1]) for line in lines if line.startswith(name + " "))

    def wait_idle(self, seconds: float = 20) -> float:
        """Seconds until no request is being generated for."""
        t0 = time.monotonic()
        while self.metric("llmx_requests_processing") or self.metric("llmx_requests_deferred"):
            assert time.monotonic() - t0 < seconds, "the engine stayed busy"
            time.sleep(0.05)
        return time.monotonic() - t0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server():
    s = Server("--alias", "smol", "--api-key", KEY, "--cors", ORIGIN)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def test_openai_client_streams_the_whole_reply_and_its_usage(client):
    kw = {"model": "smol", "max_tokens": 8, "temperature": 0, **HI}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert whole.model == "smol" and chunks[-1].choices == []
    assert chunks[-1].usage == whole.usage and whole.usage.completion_tokens == 8
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content


def test_logprobs_rank_the_greedy_token_first(client):
    reply = client.chat.completions.create(
        model="smol", max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, **HI
    )
    tokens = reply.choices[0].logprobs.content
    assert "".join(t.token for t in tokens) == reply.choices[0].message.content and len(tokens) == 4
    for t in tokens:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert bytes(t.bytes).decode() == t.token
    legacy = client.completions.create(
        model="smol", prompt="The sky is", max_tokens=3, temperature=0, logprobs=2
    )
    columns = legacy.choices[0].logprobs
    assert "".join(columns.tokens) == legacy.choices[0].text and columns.text_offset[0] == 0
    assert all(len(top) == 2 for top in columns.top_logprobs)


def test_json_schema_response_format_gives_json_of_that_schema(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    person = json.loads(reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop" and set(person) == {"name", "age"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 12 and isinstance(person["age"], int)
    any_object = client.chat.completions.create(
        model="smol", max_tokens=3, temperature=0, response_format={"type": "json_object"}, **HI
    )
    assert any_object.choices[0].message.content.startswith("{")  # unconstrained, it says "Hello"


def test_models_tokenize_detokenize_props_metrics(server, client):
    assert [m.id for m in client.models.list()] == ["smol"]
    with server.http() as http:
        ids = http.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": "Hello world"}
        assert http.get("/slots").json() == [{"id": 0, "n_ctx": CTX, "is_processing": False}]
        props = http.get("/props").json()
        assert props["model_alias"] == "smol" and props["n_ctx"] == CTX and props["total_slots"] == 1
        metrics = http.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    before = server.metric("llmx_tokens_predicted_total")
    client.completions.create(model="smol", prompt="Hi", max_tokens=2)
    assert server.metric("llmx_tokens_predicted_total") - before == 2


def test_a_client_leaving_mid_stream_frees_the_engine_at_once(server, client):
    before = server.metric("llmx_tokens_predicted_total")
    with server.http() as http, http.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        (slot,) = http.get("/slots").json()
        assert slot["is_processing"] and slot["n_past"] >= slot["n_prompt_tokens"] > 0
    server.wait_idle()
    # the request would have run until the context was full (~500 tokens): it stopped within steps
    assert server.metric("llmx_tokens_predicted_total") - before < 40
    assert server.metric("llmx_requests_cancelled_total") >= 1
    reply = client.chat.completions.create(model="smol", max_tokens=2, **HI)
    assert reply.usage.completion_tokens == 2


def test_a_client_giving_up_on_a_whole_reply_stops_its_generation(server):
    before = server.metric("llmx_tokens_predicted_total")
    with server.http(timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):  # ~100 tokens on a fast CPU
        http.post("/v1/completions", json=LONG)
    server.wait_idle()
    assert server.metric("llmx_tokens_predicted_total") - before < 200  # not the ~500 to a full context


def test_many_more_clients_than_threads_are_all_served_and_health_answers(server):
    n = 44  # past anyio's 40 worker threads, which the server used to run requests on
    request = {"prompt": "Hi", "max_tokens": 1}

    def one(_: int) -> int:
        with server.http() as http:
            return http.post("/v1/completions", json=request).status_code

    with ThreadPoolExecutor(n) as pool:
        statuses = pool.map(one, range(n))
        time.sleep(0.5)  # they are queued now
        with server.http() as http:  # a frozen server never answers: the client gives up
            assert http.get("/health", timeout=5).json() == {"status": "ok"}
        assert list(statuses) == [200] * n


BAD = [
    ("POST", "/v1/nothing", {"json": {}}, 404, None),
    ("GET", "/v1/chat/completions", {}, 405, None),
    ("POST", "/v1/completions", {"content": b"{no"}, 400, None),
    ("POST", "/v1/completions", {"content": b"[" * 100_000 + b"]" * 100_000}, 400, None),
    (
        "POST",
        "/v1/completions",
        {"content": b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}"},
        400,
        None,
    ),
    ("POST", "/v1/completions", {"json": {"prompt": "a", "seed": 2**64}}, 400, None),
    ("POST", "/v1/completions", {"content": b'{"prompt": "a\\ud800"}'}, 400, None),
    ("POST", "/v1/completions", {"content": b'{"prompt": "a", "temperature": NaN}'}, 400, None),
    ("POST", "/v1/completions", {"content": b'{"prompt": "a", "temperature": Infinity}'}, 400, None),
    ("POST", "/v1/completions", {"content": b'{"prompt": "a", "temperature": 1e400}'}, 400, None),
    ("POST", "/v1/completions", {"json": {"prompt": "a", "temperature": 10**400}}, 400, None),
    (
        "POST",
        "/v1/completions",
        {"content": b'{"prompt": "' + b"a" * (5 << 20) + b'"}'},
        413,
        "body_too_large",
    ),
    ("POST", "/v1/chat/completions", {"json": HI | {"response_format": {"type": "xml"}}}, 400, None),
    ("POST", "/v1/chat/completions", {"json": HI | {"response_format": UNUSABLE}}, 400, None),
    ("POST", "/v1/chat/completions", {"json": HI | {"tools": [{"type": "function"}]}}, 400, None),
    ("POST", "/detokenize", {"json": {"tokens": [10**9]}}, 400, None),
]


@pytest.mark.parametrize(
    ("method", "path", "send", "status", "code"), BAD, ids=[f"{b[1]}-{b[3]}" for b in BAD]
)
def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, method, path, send, status, code):
    with server.http() as http:
        r = http.request(method, path, headers={"content-type": "application/json"}, **send)
        assert r.status_code == status
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
        assert "\n" not in error["message"] and "Traceback" not in error["message"]
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_the_api_key_is_required_except_for_health_and_the_chat_page(server, key):
    with server.http(key) as http:
        for path in ("/v1/models", "/placement", "/stats"):
            r = http.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # the page must load before its user can type the key into it; its data needs the key
        assert [http.get(p).status_code for p in ("/health", "/", "/web/main.js")] == [200, 200, 200]


def test_web_pages_reach_it_only_from_the_cors_origin_with_json_and_by_its_own_name(server):
    with server.http() as http:
        preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        r = http.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = http.options("/v1/chat/completions", headers=preflight | {"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        # a form or text/plain POST needs no preflight, so a page of any origin can send it
        r = http.post(
            "/v1/completions", content=json.dumps({"prompt": "Hi"}), headers={"content-type": "text/plain"}
        )
        assert r.status_code == 415 and r.json()["error"]["code"] == "not_json"
        # DNS rebinding: another name that resolves to 127.0.0.1
        for path in ("/v1/models", "/"):
            r = http.get(path, headers={"Host": f"rebind.example:{server.port}"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "bad_host"
        assert http.get("/v1/models", headers={"Host": f"localhost:{server.port}"}).status_code == 200


def test_queue_limit_and_time_out():
    # replies of up to 4096 tokens: longer than the time-out on any machine (512 take ~3 s on a fast CPU)
    s = Server("--max-queue", "1", "--timeout", "3", "-c", "4096")
    longer = LONG | {"max_tokens": 4096}
    try:
        with s.http() as a, s.http() as b, s.http() as c, ThreadPoolExecutor(2) as pool:
            running = pool.submit(a.post, "/v1/completions", json=longer)
            while not s.metric("llmx_requests_processing"):
                time.sleep(0.05)
            waiting = pool.submit(b.post, "/v1/completions", json=longer)
            while not s.metric("llmx_requests_deferred"):
                time.sleep(0.05)
            refused = c.post("/v1/completions", json=LONG)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
            for r in (running.result(), waiting.result()):  # the time-out ends both
                assert r.status_code == 503 and r.json()["error"]["code"] == "timeout"
            assert s.wait_idle() < 5  # and frees the engine
    finally:
        s.stop()


def test_sigterm_ends_a_stream_with_an_error_and_exits_in_seconds():
    s = Server()
    try:
        with s.http() as http, http.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            next(lines)
            t0 = time.monotonic()
            s.process.send_signal(signal.SIGTERM)
            assert s.process.wait(timeout=10) == 0
            assert time.monotonic() - t0 < 5
            assert "shutting down" in "".join(lines)
    finally:
        s.stop()
