"""`k3kit serve` on the shipped mini receiving SIGTERM/SIGINT while it streams: with a short
--shutdown-timeout the stream is ended with an error event and `data: [DONE]` (never a cut
connection), a request sent after the signal is refused without hanging, and the process exits 0;
with a long one the stream finishes normally and the process exits 0 after it.

One server per test (a signal ends it); each loads the mini in a few seconds."""

from __future__ import annotations

import http.client
import json
import signal
import time
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from serving import Server, raw  # noqa: E402

# greedy, the mini continues this code for 1000+ tokens without an end token (~16 s alone)
COMPLETION = {"prompt": "import os\n", "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}


def start_stream(url: str, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(COMPLETION | {"max_tokens": max_tokens}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(2):                    # generated text: the sequence runs
        assert resp.readline().startswith(b"data: ")
        resp.readline()
    return conn, resp


def events(resp: http.client.HTTPResponse) -> list:
    """The rest of the stream to its end (IncompleteRead if the connection were cut)."""
    out = []
    for line in resp.read().decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def refused_or_503(url: str) -> str:
    try:
        status, body = raw(url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=10)
    except ConnectionError:
        return "refused"
    assert status == 503 and body["error"]["code"] == "shutting_down", (status, body)
    return "503"


def stopped(server: Server, timeout: float) -> int:
    """The exit code of a server already signalled (waiting no longer than `timeout`)."""
    code = server.proc.wait(timeout)
    server.stop()                         # collects stderr
    return code


def test_sigterm_ends_a_long_stream_with_an_error_event_and_done():
    s = Server(["--shutdown-timeout", "1"]).wait_ready()
    try:
        conn, resp = start_stream(s.url, max_tokens=1000)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert refused_or_503(s.url) == "503"          # the socket stays open during the drain
        got = events(resp)
        conn.close()
        took = time.monotonic() - t0
        assert got[-1] == "[DONE]", got[-3:]
        assert got[-2]["error"]["code"] == "shutting_down" and got[-2]["error"]["type"] == "unavailable_error"
        assert all("error" not in e for e in got[:-2])
        assert 0.9 < took < 10, took                   # the timeout was waited out, not much more
        code = stopped(s, 30)
    finally:
        if s.proc.poll() is None:
            s.stop()
    assert code == 0, s.stderr_text[-2000:]
    assert "Traceback" not in s.stderr_text, s.stderr_text[-2000:]
    assert "k3kit: shutting down: 1 request(s) running, up to 1s to finish" in s.stderr_text
    assert "k3kit: shutting down: 1 request(s) still running were ended" in s.stderr_text
    assert "finish=shutdown" in s.stderr_text
    with pytest.raises(ConnectionError):           # after the drain: nobody listens
        raw(s.url, "GET", "/health", timeout=5)


def test_sigint_lets_a_short_stream_finish():
    s = Server(["--shutdown-timeout", "120"]).wait_ready()
    try:
        # long enough to outlast the 0.3 s below at any decode speed here (~250 tok/s on the mini)
        conn, resp = start_stream(s.url, max_tokens=400)
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        refused = refused_or_503(s.url)
        got = events(resp)
        conn.close()
        assert got[-1] == "[DONE]"
        usage = got[-2]["usage"]
        assert got[-2]["choices"] == [] and usage["prompt_tokens_details"] == {"cached_tokens": 0}
        reasons = [c["finish_reason"] for e in got[:-2] for c in e["choices"] if c["finish_reason"]]
        assert reasons == ["length"] and usage["completion_tokens"] == 400
        assert all("error" not in e for e in got)
        code = stopped(s, 30)                          # without waiting out the 120 s
    finally:
        if s.proc.poll() is None:
            s.stop()
    assert refused == "503"
    assert code == 0, s.stderr_text[-2000:]
    assert "Traceback" not in s.stderr_text and "still running were ended" not in s.stderr_text
