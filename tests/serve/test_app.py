"""The HTTP app in-process over a toy model (no torch model, no subprocess): the loading phase
(503 until ready), the switch to serving, and request shapes checked cheaply. The real model is
driven through `k3kit serve` in test_server.py."""

from __future__ import annotations

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
from k3kit.serve.app import ServerState, build_app  # noqa: E402
from k3kit.serve.metrics import metrics_page  # noqa: E402
from k3kit.serve.serial import SerialScheduler  # noqa: E402
from k3kit.tokenizer.codec import TextCodec  # noqa: E402

MINI = "src/k3kit/mini/assets/mini-k3/mini-k3.gguf"
CTX = 32


@pytest.fixture(scope="module")
def codec():
    from pathlib import Path

    model = Model.open(Path(__file__).resolve().parents[2] / MINI)
    try:
        return TextCodec(model.kv)
    finally:
        model.close()


@pytest.fixture
def app(codec):
    """A server whose model 'loads' when the test says so."""
    state = ServerState(model_id="toy")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", access_log=False,
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    script = codec.encode("hello world", add_bos=False) * 4
    toy = ToyModel(script, vocab=codec.n_vocab)
    sched: list[SerialScheduler] = []

    def load():
        s = SerialScheduler(toy, codec, max_queue=4)
        sched.append(s)
        state.metrics = metrics_page(s.stats)
        state.ready(s, codec, CTX)

    yield url, load, script
    server.should_exit = True
    thread.join(10)
    sock.close()
    for s in sched:
        s.close()


def test_loading_then_ready(app, codec):
    url, load, script = app
    assert raw(url, "GET", "/health") == (503, {"status": "loading"})
    status, body = raw(url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 503 and body["error"]["code"] == "model_loading"
    status, body = raw(url, "POST", "/tokenize", {"content": "x"})
    assert status == 503
    assert raw(url, "GET", "/v1/models")[1]["data"][0]["id"] == "toy"
    load()
    assert raw(url, "GET", "/health") == (200, {"status": "ok"})
    # the toy model continues with its script from the prompt's length on
    prompt = codec.encode("x")
    status, body = raw(url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 0})
    assert status == 200, body
    want = codec.decode_bytes(script[len(prompt) - 1:len(prompt) + 2]).decode()
    assert body["choices"][0]["text"] == want and body["usage"]["completion_tokens"] == 3
    assert metrics(url, None)["k3kit_sequences_active"] == 0


def test_context_and_prompt_checks(app, codec):
    url, load, _ = app
    load()
    status, body = raw(url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": CTX})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == "max_tokens"
    status, body = raw(url, "POST", "/v1/completions", {"prompt": "word " * CTX})   # no max_tokens
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, body = raw(url, "POST", "/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = raw(url, "POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 1, "temperature": 0})
    assert status == 200 and body["usage"]["prompt_tokens"] == 2
    status, body = raw(url, "POST", "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert status == 400 and body["error"]["param"] == "messages[0].content[0]"
    status, body = raw(url, "POST", "/v1/completions", {"prompt": "x", "presence_penalty": 2.5})
    assert status == 400 and body["error"]["param"] == "presence_penalty"
    status, body = raw(url, "PUT", "/v1/completions", {"prompt": "x"})
    assert status == 405 and set(body["error"]) == {"message", "type", "param", "code"}
