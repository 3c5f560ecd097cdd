"""The chat page at `/` in a real browser: the system's headless Chromium driven by Playwright, against
a real `llmx serve` (SmolLM2, CPU) that requires an API key. The page asks for the key, streams the
reply the API gives at temperature 0, draws the plan's placement, shows the slots and the throughput
counters move, and its stop button ends a stream without keeping the engine busy."""

from __future__ import annotations

import re
import shutil

import pytest
from test_server_http import KEY, Server

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="the page's tests need playwright: scripts/setup.sh installs it"
)
expect = sync_api.expect

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="the page's tests need Chromium: apt-get install chromium (scripts/setup.sh)",
)
WAIT_MS = 60_000  # a reply on a 2-core machine that other jobs share


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    playwright = sync_api.sync_playwright().start()
    browser = playwright.chromium.launch(executable_path=CHROMIUM)
    yield browser
    browser.close()
    playwright.stop()


@pytest.fixture
def page(browser, server):
    """The page, its key typed in and its panels drawn (so that nothing moves under a click)."""
    page = browser.new_page()
    page.goto(server.url)
    page.fill("#key", KEY)
    page.press("#key", "Enter")
    expect(page.locator("#model")).to_have_text("SmolLM2-135M-Instruct.Q4_1")
    expect(page.locator("#slots tbody tr")).to_have_count(1)
    expect(page.locator(".map")).to_be_visible()
    yield page
    page.close()


def send(page, text: str, max_tokens: int) -> None:
    """`text` sent at temperature 0 (greedy: the same reply as the API's, and a known length)."""
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_without_its_key_the_page_asks_for_it(browser, server):
    page = browser.new_page()
    page.goto(server.url)
    expect(page.locator("#error")).to_have_text("This server needs its API key: type it above.")
    expect(page.locator("#model")).to_be_empty()
    page.close()


def test_the_streamed_reply_is_the_apis_at_temperature_0(page, server):
    with server.http() as http:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
        whole = http.post("/v1/chat/completions", json=body).json()
    send(page, "Hi", 8)
    reply = page.locator(".message.assistant.done")
    expect(reply).to_have_count(1, timeout=WAIT_MS)
    assert reply.locator(".text").text_content() == whole["choices"][0]["message"]["content"]
    tokens = whole["usage"]["completion_tokens"]
    expect(reply.locator(".meta")).to_contain_text(re.compile(rf"^{tokens} tokens"))


def test_the_placement_shows_every_layer_on_the_cpu(page, server):
    with server.http() as http:
        plan = http.get("/placement").json()
    n_layer = len(plan["layers"]) - 2  # the input and output rows besides the repeating layers
    ranges = page.locator(".ranges li")
    expect(ranges).to_have_text([f"cpu layers 0-{n_layer - 1} ({n_layer})", "cpu output layer"])
    cells = page.locator(".map .cell[data-device]:not([data-device=''])")
    devices = set(cells.evaluate_all("cells => cells.map(c => c.dataset.device)"))
    assert devices == {"cpu"} and cells.count() >= 3 * n_layer  # attention, FFN and KV of each layer
    page.click(".map .cell[data-layer='0']")
    listed = page.locator("#tensors details[data-device='cpu'] li")
    expect(listed).to_contain_text(["blk.0.attn_q.weight"])
    assert all(name.startswith("blk.0.") for name in listed.all_text_contents())


def test_the_live_panel_counts_a_reply(page):
    generated = page.locator("#stats [data-stat='generated']")
    expect(generated).to_have_text(re.compile(r"^\d+$"))
    before = int(generated.text_content())
    send(page, "Name a colour.", 4)
    reply = page.locator(".message.assistant.done")
    expect(reply).to_have_count(1, timeout=WAIT_MS)
    tokens = int(reply.locator(".meta").text_content().split()[0])  # "4 tokens, 30.1 t/s"
    expect(generated).to_have_text(str(before + tokens))  # within a poll or two
    expect(page.locator("#stats [data-stat='decode']")).to_have_text(re.compile(r"^\d+\.\d t/s$"))


def test_stop_ends_the_stream_frees_the_slot_and_the_next_message_is_answered(page):
    send(page, "Tell me a long story about a dragon.", 400)  # runs all 400 tokens unless stopped
    streaming = page.locator(".message.assistant.streaming .text")
    expect(streaming).not_to_be_empty(timeout=WAIT_MS)
    expect(page.locator("#slots tr[data-state='processing']")).to_have_count(1)
    page.click("#stop")
    expect(page.locator(".message.assistant.stopped")).to_have_count(1)
    expect(page.locator("#stop")).to_be_disabled()
    expect(page.locator("#slots tr[data-state='idle']")).to_have_count(1)  # the server let go
    send(page, "Hi", 4)
    expect(page.locator(".message.assistant.done")).to_have_count(1, timeout=WAIT_MS)
    expect(page.locator(".message")).to_have_count(4)
