"""The app's prompt-cache fields and its shutdown, in-process over a stub scheduler (no model, no
subprocess): llama-server's `cache_prompt` checked and handed to the scheduler, the FinishEvent's
`cached_tokens` in OpenAI's usage (non-streamed and the streamed usage chunk), the access log and
/metrics; the drain a signal starts (k3kit.serve.server.draining_server): new requests 503, running
ones ended with an error event and [DONE] or a 503, uvicorn stopped; the prompt cache's flush.
`k3kit serve` itself receiving SIGTERM is test_shutdown.py."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from serving import metrics, raw  # noqa: E402

from k3kit.gguf.shards import Model  # noqa: E402
from k3kit.serve.app import ServerState, build_app  # noqa: E402
from k3kit.serve.metrics import metrics_page  # noqa: E402
from k3kit.serve.scheduler import (  # noqa: E402
    FinishEvent,
    GenerationRequest,
    RequestStream,
    SchedulerStats,
    TokenEvent,
)
from k3kit.serve.server import draining_server, flush_prompt_cache  # noqa: E402
from k3kit.tokenizer.codec import TextCodec  # noqa: E402

MINI = Path(__file__).resolve().parents[2] / "src/k3kit/mini/assets/mini-k3/mini-k3.gguf"
CTX = 256         # a chat prompt in the K3 template starts with its thinking-effort system message
CACHED = 7
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "hi", "max_tokens": 4}


@pytest.fixture(scope="module")
def codec():
    model = Model.open(MINI)
    try:
        return TextCodec(model.kv)
    finally:
        model.close()


class Stub:
    """A Scheduler that answers "hi" and finishes with cached_tokens=7 at once, or (`hold`) answers
    "hi" and then nothing until cancelled."""

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.requests: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self.closed = False

    def submit(self, request: GenerationRequest) -> RequestStream:
        self.requests.append(request)
        stream = RequestStream(request, self.cancel)
        stream.post(TokenEvent("hi", (5,)))
        if not self.hold:
            stream.post(FinishEvent("stop", len(request.prompt_ids), 1, cached_tokens=CACHED))
        return stream

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def prefill_ahead(self, prompt_ids, like: GenerationRequest) -> bool:
        return False

    def stats(self) -> SchedulerStats:
        return SchedulerStats(prompt_cached_tokens=CACHED * len(self.requests))

    def close(self) -> None:
        self.closed = True


class Running:
    """The app over `stub` in a uvicorn server on a thread: plain, or the signal-draining one."""

    def __init__(self, codec: TextCodec, stub: Stub, drain_timeout: float | None = None) -> None:
        self.state = ServerState(model_id="toy", access_log=self.log)
        self.lines: list[str] = []
        self.said: list[str] = []
        self.state.metrics = metrics_page(stub.stats)
        self.state.ready(stub, codec, CTX)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(self.state), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
        self.uv = (uvicorn.Server(config) if drain_timeout is None
                   else draining_server(config, self.state, drain_timeout, say=self.said.append))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        for _ in range(500):
            if self.uv.started:
                break
            time.sleep(0.01)

    def log(self, line: str) -> None:
        self.lines.append(line)

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def served(codec):
    stub = Stub()
    run = Running(codec, stub)
    yield run, stub
    run.stop()


def sse(text: str) -> list:
    """The `data:` payloads of a streamed body, JSON decoded ([DONE] kept as the string)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- cache_prompt -------------------------------------------------------------------------------

def test_cache_prompt_passed_through(served):
    run, stub = served
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        for given, want in ((None, True), (True, True), (False, False)):
            extra = {} if given is None else {"cache_prompt": given}
            status, out = raw(run.url, "POST", path, body | extra)
            assert status == 200, out
            assert stub.requests[-1].cache_prompt is want, (path, given)


@pytest.mark.parametrize("value", [1, "false", None, [True], {"on": True}])
def test_cache_prompt_must_be_a_bool(served, value):
    run, stub = served
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        status, out = raw(run.url, "POST", path, body | {"cache_prompt": value})
        if value is None:                  # JSON null: the field left at its default, as OpenAI's are
            assert status == 200 and stub.requests[-1].cache_prompt is True
            continue
        assert status == 400, out
        assert out["error"]["param"] == "cache_prompt" and out["error"]["type"] == "invalid_request_error"
        assert set(out["error"]) == {"message", "type", "param", "code"}
    assert all(r.cache_prompt for r in stub.requests)


# ---- cached_tokens in usage ---------------------------------------------------------------------

def test_cached_tokens_in_usage(served):
    run, _ = served
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        status, out = raw(run.url, "POST", path, body)
        assert status == 200, out
        usage = out["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": CACHED}
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        # streamed: only the final usage chunk carries it (every other chunk has usage null)
        streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
        status, out = raw(run.url, "POST", path, streamed)
        assert status == 200
        events = sse(out["text"])
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert last["choices"] == [] and last["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED}
        assert all(e["usage"] is None for e in events[:-2])
        # without include_usage no chunk has a usage field
        status, out = raw(run.url, "POST", path, body | {"stream": True})
        assert all("usage" not in e for e in sse(out["text"])[:-1])


def test_access_log_and_metrics_count_cached_tokens(served):
    run, stub = served
    status, _ = raw(run.url, "POST", "/v1/completions", COMPLETION)
    assert status == 200
    wait_for(lambda: any('"POST /v1/completions" 200' in x for x in run.lines))   # written after the body
    line = next(x for x in run.lines if '"POST /v1/completions" 200' in x)
    assert " prompt=" in line and f" cached={CACHED} completion=1 " in line and "finish=stop" in line
    m = metrics(run.url, None)
    assert m["k3kit_prompt_cached_tokens_total"] == CACHED * len(stub.requests)


# ---- the drain ----------------------------------------------------------------------------------

def open_stream(url: str, path: str, body: dict) -> tuple[http.client.HTTPConnection,
                                                           http.client.HTTPResponse]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", path, body=json.dumps(body | {"stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("hurry", [False, True], ids=["timeout", "second-signal"])
def test_signal_drains_then_ends_what_still_runs(codec, hurry):
    stub = Stub(hold=True)                # its requests never finish by themselves
    timeout = 60.0 if hurry else 0.5
    run = Running(codec, stub, drain_timeout=timeout)
    try:
        conn, resp = open_stream(run.url, "/v1/chat/completions", CHAT)
        assert resp.readline().startswith(b"data: ")          # the role chunk: the stream runs
        waiting, answer = in_thread(raw, run.url, "POST", "/v1/completions", COMPLETION)
        wait_for(lambda: len(run.state.running) == 2)
        t0 = time.monotonic()
        run.uv.handle_exit(signal.SIGTERM, None)
        wait_for(lambda: run.state.draining)
        status, out = raw(run.url, "POST", "/v1/chat/completions", CHAT)
        assert status == 503 and out["error"]["code"] == "shutting_down", out
        assert raw(run.url, "GET", "/health") == (503, {"status": "shutting_down"})
        assert len(stub.requests) == 2                        # the refused one never reached the scheduler
        if hurry:
            run.uv.handle_exit(signal.SIGINT, None)
        events = sse(resp.read().decode())                    # the rest of the stream, to its end
        conn.close()
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down", events
        # the K3 template's generation prompt opens the think channel: the stub's "hi" is reasoning
        assert any(e.get("choices") and e["choices"][0]["delta"].get("reasoning_content") == "hi"
                   for e in events[:-2])
        waiting.join(10)
        status, out = answer[0]
        assert status == 503 and out["error"]["code"] == "shutting_down", out
        run.thread.join(15)
        assert not run.thread.is_alive()                      # uvicorn stopped after the drain
        took = time.monotonic() - t0
        assert took < (10 if hurry else timeout + 10), took
        assert set(stub.cancelled) == {r.id for r in stub.requests}     # cancel is idempotent
        assert run.said[0] == f"k3kit: shutting down: 2 request(s) running, up to {timeout:g}s to finish"
        assert run.said[1] == "k3kit: shutting down: 2 request(s) still running were ended"
        wait_for(lambda: sum("finish=shutdown" in x for x in run.lines) == 2)
    finally:
        run.stop()


def test_signal_with_nothing_running_stops_at_once(codec):
    run = Running(codec, Stub(), drain_timeout=60)
    try:
        assert raw(run.url, "POST", "/v1/completions", COMPLETION)[0] == 200
        t0 = time.monotonic()
        run.uv.handle_exit(signal.SIGTERM, None)
        run.thread.join(15)
        assert not run.thread.is_alive() and time.monotonic() - t0 < 5
        assert run.said == ["k3kit: shutting down: 0 request(s) running, up to 60s to finish"]
    finally:
        run.stop()


# ---- the prompt cache's flush -------------------------------------------------------------------

class Cache:
    def __init__(self, fail: bool = False) -> None:
        self.flushed, self.fail = 0, fail

    def flush(self) -> None:
        if self.fail:
            raise OSError("disk full")
        self.flushed += 1


def test_flush_prompt_cache():
    said: list[str] = []
    assert flush_prompt_cache(Stub(), said.append) and said == []     # no prompt_cache attribute
    sched = Stub()
    sched.prompt_cache = None                                            # type: ignore[attr-defined]
    assert flush_prompt_cache(sched, said.append) and said == []
    sched.prompt_cache = cache = Cache()                                 # type: ignore[attr-defined]
    assert flush_prompt_cache(sched, said.append) and cache.flushed == 1
    assert len(said) == 1 and said[0].startswith("k3kit: prompt cache flushed (")
    sched.prompt_cache = Cache(fail=True)                                # type: ignore[attr-defined]
    assert not flush_prompt_cache(sched, said.append)
    assert said[-1] == "k3kit: prompt cache not flushed: OSError: disk full"
