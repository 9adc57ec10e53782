"""The chat page's server side in-process over a toy model: the page and its assets (public, with
a Content-Security-Policy), /openapi.json kept and /docs off, GET /v1/k3kit/stats against /metrics,
one access-log line per request, and k3kit's `draft: false` request field. The page itself runs
in a real browser in test_chat_page.py."""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from serving import metrics, raw  # noqa: E402
from test_scheduler import ToyModel  # noqa: E402

from k3kit.gguf.shards import Model  # noqa: E402
from k3kit.runtime.sampling import make_sampling  # noqa: E402
from k3kit.serve.api import ChatRequest, generation_request  # noqa: E402
from k3kit.serve.app import ServerState, build_app  # noqa: E402
from k3kit.serve.metrics import metrics_page  # noqa: E402
from k3kit.serve.scheduler import GenerationRequest, SchedulerStats  # noqa: E402
from k3kit.serve.serial import SerialScheduler  # noqa: E402
from k3kit.serve.stats import History, ratios  # noqa: E402
from k3kit.tokenizer.codec import TextCodec  # noqa: E402

MINI = "src/k3kit/mini/assets/mini-k3/mini-k3.gguf"
KEY = "page-test-key"


@pytest.fixture(scope="module")
def codec():
    from pathlib import Path

    model = Model.open(Path(__file__).resolve().parents[2] / MINI)
    try:
        return TextCodec(model.kv)
    finally:
        model.close()


class CountingStep:
    """A decode step over the toy model, as a draft server's would be: counts the requests it served."""

    built = 0

    def __init__(self, model, sampler):
        type(self).built += 1
        self.model, self.sampler = model, sampler

    def __call__(self, anchor, remaining):
        return [self.sampler(self.model.forward([anchor])[-1])]


@pytest.fixture
def server(codec):
    """A loaded toy server with an API key, an access log into a list, and a draft-like step."""
    lines: list[str] = []
    state = ServerState(model_id="toy", api_key=KEY, access_log=lines.append)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", access_log=False,
                                       lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if uv.started:
            break
        time.sleep(0.01)
    toy = ToyModel(codec.encode("hello world", add_bos=False) * 4, vocab=codec.n_vocab)
    CountingStep.built = 0
    sched = SerialScheduler(toy, codec, max_queue=4, step_factory=CountingStep)
    state.stats = sched.stats
    state.metrics = metrics_page(sched.stats)
    yield url, state, sched, lines
    uv.should_exit = True
    thread.join(10)
    sock.close()
    sched.close()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_page_and_assets_are_public_and_self_contained(server):
    url, state, sched, _ = server
    for path, ctype in (("/", "text/html"), ("/static/chat.js", "text/javascript"),
                        ("/static/markdown.js", "text/javascript"), ("/static/chat.css", "text/css"),
                        ("/static/icon.svg", "image/svg+xml")):
        import http.client

        conn = http.client.HTTPConnection(url.split("//")[1], timeout=10)
        conn.request("GET", path)       # no API key: the page must load to ask for it
        resp = conn.getresponse()
        body = resp.read().decode()
        conn.close()
        assert resp.status == 200, (path, body)
        assert resp.getheader("Content-Type").startswith(ctype)
        csp = resp.getheader("Content-Security-Policy")
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp
        # nothing in the shipped files names another origin (no CDN, no fonts from elsewhere)
        assert not re.search(r"(src|href)=\"(https?:)?//", body), path
        assert "@import" not in body and "url(http" not in body
        if path == "/":
            assert 'data-auth="required"' in body      # the page asks for the key before calling
    status, body = raw(url, "GET", "/static/../app.py")
    assert status == 404
    status, body = raw(url, "GET", "/static/nothing.js")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    # everything else still wants the key
    assert raw(url, "GET", "/v1/k3kit/stats")[0] == 401
    assert raw(url, "GET", "/openapi.json")[0] == 401


def test_openapi_kept_and_docs_off(server):
    url, *_ = server
    status, spec = raw(url, "GET", "/openapi.json", headers=auth())
    assert status == 200 and spec["info"]["title"] == "k3kit"
    assert {"/v1/chat/completions", "/v1/completions", "/v1/k3kit/stats", "/metrics"} <= set(spec["paths"])
    assert "/" not in spec["paths"]
    chat_fields = spec["components"]["schemas"]["ChatRequest"]["properties"]
    assert "draft" in chat_fields
    for path in ("/docs", "/redoc"):
        status, body = raw(url, "GET", path, headers=auth())
        assert status == 404 and body["error"]["message"] == f"no route {path}"


def test_stats_endpoint_reads_what_metrics_exports(server, codec):
    url, state, sched, _ = server
    status, body = raw(url, "GET", "/v1/k3kit/stats", headers=auth())
    assert status == 200 and body["loaded"] is False and body["stats"] is None
    state.ready(sched, codec, 256, draft=True)
    for n in (3, 5):
        status, out = raw(url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": n, "temperature": 0},
                          headers=auth())
        assert status == 200, out
    status, body = raw(url, "GET", "/v1/k3kit/stats", headers=auth())
    m = metrics(url, KEY)
    assert status == 200 and body["loaded"] is True and body["draft"] is True and body["model"] == "toy"
    s, r = body["stats"], body["ratios"]
    assert s["generated_tokens"] == m["k3kit_generated_tokens_total"] == 8
    assert s["prompt_tokens"] == m["k3kit_prompt_tokens_total"]
    assert s["active"] == m["k3kit_sequences_active"] == 0
    assert s["queued"] == m["k3kit_queue_depth"] and s["max_queue"] == m["k3kit_queue_capacity"] == 4
    assert s["batch_rows"] == m["k3kit_batch_rows"] and s["batch_sequences"] == m["k3kit_batch_sequences"]
    assert s["requests"]["length"] == m['k3kit_requests_total{reason="length"}'] == 2
    for name in ("expert_cache_hit_rate", "expert_payload_bytes_per_token", "speculative_committed_per_pass",
                 "speculative_acceptance"):
        assert r[name] == m[f"k3kit_{name}"], name
    assert body["history"] and body["history"][-1]["generated_tokens"] == 8


def test_ratios_and_history():
    s = SchedulerStats(expert_hits=3, expert_misses=1, expert_payload_bytes=1000, prompt_tokens=6,
                       generated_tokens=4, spec_passes=4, spec_committed=10, spec_proposed=8, spec_accepted=6)
    assert ratios(s) == {"expert_cache_hit_rate": 0.75, "expert_payload_bytes_per_token": 100.0,
                         "speculative_committed_per_pass": 2.5, "speculative_acceptance": 0.75}
    assert set(ratios(SchedulerStats()).values()) == {0}
    now = [100.0]
    h = History(seconds=10, every=1, clock=lambda: now[0])
    assert len(h.record(s)) == 1
    now[0] += 0.5
    assert len(h.record(s)) == 1             # younger than `every`: not kept
    for _ in range(20):
        now[0] += 1
        samples = h.record(s)
    assert len(samples) == 11 and samples[-1]["t"] - samples[0]["t"] == 10
    assert samples[-1]["expert_hits"] == 3


def test_access_log_one_line_per_request(server, codec):
    url, state, sched, lines = server
    state.ready(sched, codec, 256)
    raw(url, "GET", "/health")
    raw(url, "GET", "/v1/models")                                    # no key: 401
    status, _ = raw(url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0},
                    headers=auth())
    assert status == 200
    status, _ = raw(url, "POST", "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
                    headers=auth())
    assert status == 200
    raw(url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": "four"}, headers=auth())
    deadline = time.monotonic() + 5
    while len(lines) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(lines) == 5, lines
    assert re.fullmatch(r'k3kit: 127\.0\.0\.1 "GET /health" 200 - \d+\.\d{3}s', lines[0]), lines[0]
    assert '"GET /v1/models" 401 - ' in lines[1]
    done = re.fullmatch(r'k3kit: 127\.0\.0\.1 "POST /v1/completions" 200 (cmpl-req-\d+) prompt=(\d+) '
                        r'cached=0 completion=4 ttft=\d+\.\d{3}s [\d.]+tok/s finish=length \d+\.\d{3}s',
                        lines[2])
    assert done, lines[2]
    assert int(done.group(2)) == len(codec.encode("x"))
    assert re.search(r'"POST /v1/chat/completions" 200 chatcmpl-req-\d+ prompt=\d+ cached=0 '
                     r'completion=3 ttft=\S+ '
                     r'\S+tok/s finish=length', lines[3]), lines[3]
    assert '"POST /v1/completions" 400 - ' in lines[4] and "prompt=" not in lines[4]


def test_draft_false_is_served_without_the_draft(server, codec):
    url, state, sched, _ = server
    state.ready(sched, codec, 256, draft=True)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    status, with_draft = raw(url, "POST", "/v1/chat/completions", body, headers=auth())
    assert status == 200 and CountingStep.built == 1
    status, without = raw(url, "POST", "/v1/chat/completions", body | {"draft": False}, headers=auth())
    assert status == 200 and CountingStep.built == 1          # no decode step built for it
    assert without["choices"][0]["message"] == with_draft["choices"][0]["message"]
    status, _ = raw(url, "POST", "/v1/chat/completions", body | {"draft": True}, headers=auth())
    assert status == 200 and CountingStep.built == 2
    status, err = raw(url, "POST", "/v1/chat/completions", body | {"draft": "no"}, headers=auth())
    assert status == 400 and err["error"]["param"] == "draft"


def test_generation_request_carries_draft():
    def gen(**extra) -> GenerationRequest:
        req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **extra})
        return generation_request(req, [1, 2], 16)

    assert gen().draft and gen().may_draft and gen(draft=True).may_draft
    assert not gen(draft=False).draft and not gen(draft=False).may_draft
    assert not gen(logprobs=True).may_draft and gen(logprobs=True).draft
    plain = GenerationRequest(prompt_ids=(1,), max_tokens=1, sampling=make_sampling(0.0, 1.0, 0, 1))
    assert plain.draft and plain.may_draft
