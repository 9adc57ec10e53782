"""The chat page of `k3kit serve`, in a real headless Chromium driven by Playwright.

One server (the shipped mini model, its drafter, an API key) and one browser for the module. The
page must load with no console error and fetch nothing outside the server's origin (every request
is routed through the test, and one that leaves the origin is refused and fails the test); ask for
the key; stream a reply to a typed message (the greedy text the API gives for the same
conversation); stop a long reply; show in its panel the figures /metrics exports; keep the
conversation across a reload; send `draft: false` when DSpark is switched off; render Markdown
safely, reasoning folded and tool calls as calls. A screenshot goes to out/chat-page.png (and
pytest's tmp dir).

The browser is the system's Chromium (Debian's `chromium`, which .ci/run installs), never
Playwright's download. Where it cannot be had the browser tests skip, except under CI (CI=true),
where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
from serving import REPO, Server, metrics, raw, wait_idle

KEY = "chat-page-key"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _chromium() -> str | None:
    env = os.environ.get("K3KIT_CHROMIUM")
    if env:
        return env
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


def _need_browser():
    """The Playwright module and a Chromium binary, or a skip (a failure in CI) saying which is missing."""
    missing = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append("the playwright package (pip install -e '.[browser]')")
        sync_playwright = None
    exe = _chromium()
    if exe is None:
        missing.append("a chromium binary (apt-get install chromium, or K3KIT_CHROMIUM=PATH)")
    if missing:
        why = "the chat page test needs " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(why + " (.ci/run installs both)")
        pytest.skip(why)
    return sync_playwright, exe


@pytest.fixture(scope="module")
def server():
    s = Server(["--draft", "default", "--api-key", KEY]).wait_ready()
    yield s
    code = s.stop()
    assert code == 0 and "Traceback" not in s.stderr_text, s.stderr_text[-2000:]
    # one access-log line per request on stderr; the page's replies among them, the stopped one too
    log = s.stderr_text
    if '"GET /" 200' in log:          # the browser tests ran
        assert re.search(r'"POST /v1/chat/completions" 200 chatcmpl-req-\d+ prompt=\d+ cached=\d+ '
                         r'completion=\d+ ttft=\d+\.\d+s [\d.]+tok/s finish=(stop|length) ', log), log[-3000:]
        assert re.search(r'"POST /v1/chat/completions" 200 chatcmpl-req-\d+ .*finish=cancelled', log), \
            log[-3000:]
        assert re.search(r'"GET /v1/k3kit/stats" 200 - \d+\.\d+s', log)


@pytest.fixture(scope="module")
def browser():
    sync_playwright, exe = _need_browser()     # before the server starts: a skip costs nothing
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield b
        b.close()


class Page:
    """A browser context on the server: every request routed (off-origin ones refused and recorded),
    console errors and page errors collected."""

    def __init__(self, browser, server: Server) -> None:
        self.origin = server.url
        self.context = browser.new_context(viewport={"width": 1440, "height": 900})
        self.outside: list[str] = []
        self.errors: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.set_default_timeout(60_000)
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.sent: list[dict] = []
        self.page.on("request", self._request)

    def _console(self, message) -> None:
        if message.type == "error":
            self.errors.append(f"console: {message.text}")

    def _route(self, route) -> None:
        url = route.request.url
        if url == self.origin or url.startswith(self.origin + "/"):
            route.continue_()
        else:
            self.outside.append(url)
            route.abort()

    def _request(self, request) -> None:
        if request.url.endswith("/v1/chat/completions") and request.method == "POST":
            self.sent.append(json.loads(request.post_data or "{}"))

    def clean(self) -> None:
        assert not self.outside, f"the page fetched outside the server: {self.outside}"
        assert not self.errors, f"console errors: {self.errors}"

    def value(self, element_id: str) -> str:
        return self.page.get_attribute(f"#{element_id}", "data-value") or ""

    def stored(self) -> list[dict]:
        return json.loads(self.page.evaluate("localStorage.getItem('k3kit.conversations')"))

    def settings(self, **values: str) -> None:
        for name, value in values.items():
            self.page.fill(f"#set-{name}", value)

    def ask(self, text: str) -> None:
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")

    def wait_reply(self, state: str = "done", timeout: float = 120_000) -> None:
        self.page.wait_for_selector(f"#messages .msg.assistant:last-child[data-state={state}]",
                                    timeout=timeout)

    def close(self) -> None:
        self.context.close()


def greedy_reply(server: Server, messages: list[dict], max_tokens: int) -> tuple[str, str, str]:
    """(content, reasoning, finish reason) of the API's greedy answer."""
    status, body = raw(server.url, "POST", "/v1/chat/completions",
                       {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "top_p": 1},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert status == 200, body
    msg = body["choices"][0]["message"]
    return msg.get("content") or "", msg.get("reasoning_content") or "", body["choices"][0]["finish_reason"]


def test_chat_page_in_chromium(browser, server, tmp_path):
    pg = Page(browser, server)
    page = pg.page
    try:
        page.goto(server.url + "/")
        # the server has a key: the page asks before its first call
        page.wait_for_selector("#key-overlay:not([hidden])")
        page.fill("#key-input", KEY)
        page.click("#key-save")
        page.wait_for_selector("#status-dot.ok")
        assert page.inner_text("#model-name") == server.model_id
        assert page.is_visible("#draft-badge") and page.is_visible("#set-draft")
        pg.settings(temperature="0", **{"max-tokens": "24"}, system="")

        # a typed message streams the greedy reply the API gives for the same conversation
        question = "Write a Python function that adds two numbers."
        pg.ask(question)
        page.wait_for_selector("#stop:not([hidden])")
        pg.wait_reply()
        conv = pg.stored()[0]
        reply = conv["messages"][1]
        want, reasoning, finish = greedy_reply(server, [{"role": "user", "content": question}], 24)
        assert (reply["content"], reply["reasoning"], reply["finish"]) == (want, reasoning, finish)
        assert want or reasoning
        assert page.is_visible("#send") and not page.is_visible("#stop")
        ttft = float(pg.value("r-ttft"))
        assert 0 < ttft < 60_000
        completion = int(pg.value("r-completion"))
        assert completion == 24 if finish == "length" else completion > 0
        assert pg.value("r-cached") == "0"                      # no prompt cache yet
        assert float(pg.value("r-toks")) > 0
        sent = pg.sent[-1]
        assert sent["stream"] is True and sent["temperature"] == 0 and "draft" not in sent

        # stop: a reply that would run long (sampled hot with a fixed seed: checked below to run
        # all 400 tokens)
        long_q = "Count from one to one thousand, one number per line."
        before = wait_idle(server.url, KEY)
        pg.settings(**{"max-tokens": "400", "temperature": "2", "seed": "3"})
        pg.ask(long_q)
        last = "#messages .msg.assistant:last-child"
        page.wait_for_selector(f"{last} details.reasoning, {last} .content:not(:empty)")
        page.click("#stop")
        pg.wait_reply("stopped")
        again = {k: v for k, v in pg.sent[-1].items() if k != "stream_options"} | {"stream": False}
        status, full = raw(server.url, "POST", "/v1/chat/completions", again,
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        assert status == 200 and full["choices"][0]["finish_reason"] == "length", full
        after = wait_idle(server.url, KEY)
        cancelled = 'k3kit_requests_total{reason="cancelled"}'
        assert after[cancelled] == before[cancelled] + 1
        assert page.get_attribute("#r-finish", "data-value") == "stopped"
        stopped = pg.stored()[0]["messages"][3]
        assert stopped["state"] == "stopped" and 0 < len(stopped["content"] + stopped["reasoning"])
        pg.settings(temperature="0", seed="")

        # DSpark off: the request says draft: false and no target pass verifies a draft block for it
        page.uncheck("#set-draft")
        pg.settings(**{"max-tokens": "8"})
        before = wait_idle(server.url, KEY)
        pg.ask("Hello!")
        pg.wait_reply()
        after = wait_idle(server.url, KEY)
        assert pg.sent[-1]["draft"] is False
        assert after["k3kit_speculative_passes_total"] == before["k3kit_speculative_passes_total"]
        assert after["k3kit_decode_passes_total"] > before["k3kit_decode_passes_total"]
        page.check("#set-draft")

        # the panel shows what /metrics exports (idle: nothing moves between the two reads)
        idle = time.time()
        m = wait_idle(server.url, KEY)
        # (the page's CSP forbids eval, so no wait_for_function: poll the attribute from here)
        deadline = time.monotonic() + 30
        while float(page.get_attribute("#updated", "data-time") or 0) <= idle:
            assert time.monotonic() < deadline, "the panel did not refresh"
            time.sleep(0.1)
        m = metrics(server.url, KEY)
        for element, series in (("s-hit-rate", "k3kit_expert_cache_hit_rate"),
                                ("s-payload", "k3kit_expert_payload_bytes_per_token"),
                                ("s-committed", "k3kit_speculative_committed_per_pass"),
                                ("s-acceptance", "k3kit_speculative_acceptance"),
                                ("s-active", "k3kit_sequences_active"), ("s-queue", "k3kit_queue_depth"),
                                ("s-batch", "k3kit_batch_rows"),
                                ("s-generated", "k3kit_generated_tokens_total")):
            assert float(pg.value(element)) == m[series], (element, pg.value(element), m[series])
        assert float(page.get_attribute("#s-batch", "data-sequences")) == m["k3kit_batch_sequences"]
        assert m["k3kit_speculative_committed_per_pass"] > 0 and m["k3kit_expert_cache_hit_rate"] > 0
        assert int(page.get_attribute("#plot-toks", "data-points")) > 0

        shot = tmp_path / "chat-page.png"
        page.screenshot(path=str(shot))
        out = REPO / "out"
        out.mkdir(exist_ok=True)
        shutil.copy(shot, out / "chat-page.png")

        # reload: the conversation, its replies and the key are still there
        texts = page.locator("#messages .msg").all_inner_texts()
        page.reload()
        page.wait_for_selector("#status-dot.ok")
        assert not page.is_visible("#key-overlay")
        assert page.locator("#messages .msg").all_inner_texts() == texts
        assert page.locator("#messages .msg.assistant[data-state=stopped]").count() == 1
        assert page.locator("#conversations .conv").count() == 1
        pg.clean()
    finally:
        pg.close()


CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
ARGS = {"index": 0, "function": {"arguments": "{\"city\": \"Paris\"}"}}
SSE = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "The user wants *code*."}}]},
    {"choices": [{"index": 0, "delta": {"content": "# Title\n\nSome **bold** and `x<y`.\n\n```python\n"}}]},
    {"choices": [{"index": 0, "delta": {"content": "print('<b>hi</b>')\n```\n\n"
                                        "<img src=x onerror=\"window.pwned=1\">"
                                        "<script>window.pwned=2</script>\n"
                                        "[ok](https://example.com) [bad](javascript:alert(1))\n- a\n- b"}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [CALL]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [ARGS]}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 30, "total_tokens": 39,
                              "prompt_tokens_details": {"cached_tokens": 4}}},
]


def test_rendering_is_safe_and_shows_reasoning_and_tool_calls(browser, server):
    """A reply with Markdown, HTML that must stay text, reasoning_content and tool calls (the server
    streams none of those two yet: the reply is the test's, through the page's own stream parser)."""
    pg = Page(browser, server)
    page = pg.page
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in SSE) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    try:
        page.add_init_script(f"localStorage.setItem('k3kit.apiKey', {json.dumps(KEY)})")
        page.goto(server.url + "/")
        page.wait_for_selector("#status-dot.ok")
        pg.ask("weather?")
        pg.wait_reply()
        bubble = page.locator("#messages .msg.assistant .bubble")
        assert page.evaluate("window.pwned") is None
        assert bubble.locator("img, script").count() == 0
        content = bubble.locator(".content")
        assert "<img src=x" in content.inner_text() and "<script>" in content.inner_text()
        assert content.locator("h3").inner_text() == "Title"
        assert content.locator("strong").inner_text() == "bold"
        assert content.locator("p code").first.inner_text() == "x<y"
        assert content.locator("pre code.lang-python").inner_text() == "print('<b>hi</b>')"
        assert content.locator("li").all_inner_texts() == ["a", "b"]
        links = content.locator("a")
        assert links.count() == 1 and links.get_attribute("href") == "https://example.com"
        reasoning = bubble.locator("details.reasoning")
        assert reasoning.get_attribute("open") is None                       # folded
        assert "The user wants code." in reasoning.text_content() and reasoning.locator("em").count() == 1
        call = bubble.locator(".tool-call")
        assert call.locator(".fn").inner_text() == "get_weather"
        assert '{"city": "Paris"}' in call.inner_text()
        assert (pg.value("r-cached"), pg.value("r-prompt"), pg.value("r-completion")) == ("4", "9", "30")
        assert pg.value("r-finish") == "tool_calls"
        out = REPO / "out"
        out.mkdir(exist_ok=True)
        page.screenshot(path=str(out / "chat-page-rendering.png"))
        pg.clean()
    finally:
        pg.close()


def test_a_refused_key_is_asked_for_again(browser, server):
    """A stored key the server refuses (401): the page forgets it, asks, and goes on with the new one."""
    pg = Page(browser, server)
    page = pg.page
    try:
        page.add_init_script("if (!sessionStorage.getItem('seeded')) { sessionStorage.setItem('seeded', 1);"
                             " localStorage.setItem('k3kit.apiKey', 'wrong-key'); }")
        page.goto(server.url + "/")
        page.wait_for_selector("#key-overlay:not([hidden])")
        assert "refused" in page.inner_text("#key-message")
        assert page.evaluate("localStorage.getItem('k3kit.apiKey')") is None
        page.fill("#key-input", KEY)
        page.press("#key-input", "Enter")
        page.wait_for_selector("#status-dot.ok")
        assert page.evaluate("localStorage.getItem('k3kit.apiKey')") == KEY
        # the browser reports the refused call itself as a failed resource load; nothing else may fail
        pg.errors = [e for e in pg.errors if "401" not in e]
        pg.clean()
    finally:
        pg.close()
