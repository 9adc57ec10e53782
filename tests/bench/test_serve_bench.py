"""benchmarks/bench_serve.py's client and timing path, and benchmarks/llama_server.py's build plumbing.

The client is driven against small in-process OpenAI-shaped servers that stream llama-server's
chunk shape with known delays: one that serves its requests concurrently, as llama-server's slots
do, and one that serves them one at a time; k3kit.bench.concurrency's LlamaServer against a fake
`llama-server` executable. test_real_llama_server_serves_the_mini_to_concurrent_clients serves the
shipped mini through a real llama-server, only when one is built (`python benchmarks/llama_server.py`,
~30 min of 2 cores): CI does not build it, so there that test is skipped.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from benchmark_scripts import BENCH, load

bench_serve = load("bench_serve")
llama_server = load("llama_server")


# ----------------------------------------------------------------------------- a fake server

class Fake:
    """/v1/completions streamed as llama-server does: one chunk per token (finish_reason null), then a
    final chunk with finish_reason and usage (unless usage=False), then [DONE]. The first token comes
    `first` s after the request, each next one `per_token` s later; serial=True serves one request at
    a time."""

    def __init__(self, first: float, per_token: float, serial: bool = False, usage: bool = True):
        self.first, self.per_token, self.usage = first, per_token, usage
        self.lock = threading.Lock() if serial else None
        self.prompts: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.prompts.append(req["prompt"])
                if fake.lock:
                    with fake.lock:
                        self.stream(req)
                else:
                    self.stream(req)

            def stream(self, req: dict[str, Any]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                n = int(req["max_tokens"])
                time.sleep(fake.first)
                for i in range(n):
                    if i:
                        time.sleep(fake.per_token)
                    chunk = {"choices": [{"text": f"<{i}>", "index": 0, "logprobs": None,
                                          "finish_reason": None}]}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                final: dict[str, Any] = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}]}
                if fake.usage:
                    final["usage"] = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
                self.wfile.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def server(self, tmp: Path) -> Any:
        return bench_serve.Server("fake", self.port, None, tmp / "fake.log", False, "fake-model")


@pytest.fixture
def fakes() -> Iterator[list[Fake]]:
    made: list[Fake] = []
    yield made
    for f in made:
        f.httpd.shutdown()
        f.httpd.server_close()


def test_one_streamed_request_counts_tokens_and_times_the_first(fakes, tmp_path):
    f = Fake(first=0.3, per_token=0.02)
    fakes.append(f)
    r = bench_serve.complete(f.server(tmp_path), "def f(", 6)
    assert r.tokens == 6
    assert r.text == "".join(f"<{i}>" for i in range(6))
    assert 0.3 <= r.ttft < 0.3 + 0.2            # the first token chunk, not the response headers
    assert r.seconds >= 0.3 + 5 * 0.02 and r.seconds > r.ttft
    assert f.prompts == ["def f("]


def test_without_a_usage_chunk_tokens_are_the_token_chunks(fakes, tmp_path):
    f = Fake(first=0.0, per_token=0.0, usage=False)
    fakes.append(f)
    r = bench_serve.complete(f.server(tmp_path), "x", 5)
    assert r.tokens == 5                        # the final (finish_reason) chunk is not a token


def test_concurrent_clients_overlap_on_a_batching_server_and_queue_on_a_serial_one(fakes, tmp_path):
    """4 clients x 1 request of 8 tokens, ~0.36 s each: all at once on the batching server (wall ~
    one request), one after the other on the serial one (wall ~ four, the last client's first token
    after three whole requests). The same client code; only the server differs."""
    batching, serial = Fake(0.15, 0.03), Fake(0.15, 0.03, serial=True)
    fakes += [batching, serial]
    one = 0.15 + 7 * 0.03
    b = bench_serve.run_step(batching.server(tmp_path), 4, 1, 8)
    s = bench_serve.run_step(serial.server(tmp_path), 4, 1, 8)
    for step in (b, s):
        assert (step.requests, step.tokens) == (4, 32)
        assert step.tok_s == pytest.approx(step.tokens / step.seconds)
    assert b.seconds < 2 * one
    assert s.seconds >= 4 * one
    assert b.tok_s > 2.5 * s.tok_s
    assert s.ttft_max >= 3 * one > b.ttft_max
    assert sorted(batching.prompts) == sorted(bench_serve.PROMPTS[:4])   # one prompt per client


def test_goal_figures_at_8_clients():
    rows = [{"server": "k3kit AR", "concurrency": 1, "tok_s": 5.0},
            {"server": "k3kit AR", "concurrency": 8, "tok_s": 18.0},
            {"server": "llama-server", "concurrency": 8, "tok_s": 12.0}]
    g = bench_serve.goal_figures(rows, "k3kit AR", "llama-server")
    assert g["vs_single_stream"] == pytest.approx(3.6) and g["vs_peer"] == pytest.approx(1.5)
    assert "NOT met" in g["text"].split(",")[0] and g["text"].endswith("met)")
    assert bench_serve.goal_figures(rows[1:], "k3kit AR", "llama-server") is None    # no single stream


# ----------------------------------------------------------------------------- options, peer command

def test_llama_server_peer_gets_a_slot_per_client_of_k3kits_context(tmp_path):
    model, exe = tmp_path / "m.gguf", tmp_path / "llama-server"
    model.write_bytes(b"GGUF")
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    args, levels = bench_serve.parse_args(["--model", str(model), "--concurrency", "1,8,4", "--threads", "3",
                                           "--ctx", "512", "--llama-server", str(exe)])
    assert levels == [1, 8, 4] and args.slots == 8
    cmd = bench_serve.llama_cmd(args, 4321, "llama-server")
    assert cmd[0] == str(exe)

    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]
    assert flag("-m") == str(model) and flag("--port") == "4321" and flag("--host") == "127.0.0.1"
    assert (flag("-np"), flag("-c"), flag("-t"), flag("-tb")) == ("8", "4096", "3", "3")
    assert {"--cont-batching", "--no-cache-prompt", "--no-repack"} <= set(cmd)
    k3 = bench_serve.k3kit_cmd(args, 1234, None)
    assert k3[k3.index("--ctx") + 1] == "512" and k3[k3.index("--threads") + 1] == "3"


@pytest.mark.parametrize("argv, msg", [
    (["--concurrency", "1,x"], "expected comma-separated integers"),
    (["--concurrency", "0,2"], "every level must be >= 1"),
    (["--ctx", "0"], "must be >= 1"),
    (["--settle", "-1"], "--settle -1: must be >= 0 seconds"),
    (["--settle", "nan"], "--settle nan: must be >= 0 seconds"),
    (["--model", "/nonexistent/m.gguf"], "/nonexistent/m.gguf: no such model file"),
    (["--llama-server", "/nonexistent/llama-server", "--peer", "llama-server"], "not an executable file"),
])
def test_bad_options_are_one_line(argv, msg, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(SystemExit, match=msg):
        args, _ = bench_serve.parse_args(["--model", str(model), *argv])
        bench_serve.choose_peer(args)


def test_peer_llama_server_without_a_binary_says_how_to_build_it(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("K3KIT_LLAMA_SERVER_DIR", str(tmp_path / "nothing-built"))
    monkeypatch.delenv("K3KIT_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    args, _ = bench_serve.parse_args(["--model", str(model), "--peer", "llama-server"])
    with pytest.raises(SystemExit, match="python benchmarks/llama_server.py"):
        bench_serve.choose_peer(args)


# ----------------------------------------------------------------------------- llama_server.py

def _tarball(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_extract_takes_vendor_llama_cpp_only_and_strips_the_prefix(tmp_path):
    pre = f"{llama_server.SDIST}/vendor/llama.cpp/"
    tb = _tarball(tmp_path / "s.tar.gz", {pre + "CMakeLists.txt": b"project(x)",
                                          pre + "tools/server/a.cpp": b"a",
                                          f"{llama_server.SDIST}/setup.py": b"no"})
    dest = llama_server.extract(tb, tmp_path / "src")
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == ["CMakeLists.txt", "tools/server/a.cpp"]
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_extract_refuses_a_tarball_without_llama_cpp(tmp_path):
    tb = _tarball(tmp_path / "s.tar.gz", {f"{llama_server.SDIST}/setup.py": b"no"})
    with pytest.raises(llama_server.BuildError, match="no .*CMakeLists.txt"):
        llama_server.extract(tb, tmp_path / "src")
    assert not (tmp_path / "src").exists()


def test_build_without_cmake_is_one_line(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path), "K3KIT_LLAMA_SERVER_DIR": str(tmp_path / "b")}
    r = subprocess.run([sys.executable, str(BENCH / "llama_server.py")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip() == ("llama_server.py: cmake not found on PATH: install cmake (>= 3.14) "
                                "and a C++17 compiler")


def test_a_built_binary_is_found_without_rebuilding(tmp_path, monkeypatch):
    monkeypatch.setenv("K3KIT_LLAMA_SERVER_DIR", str(tmp_path))
    monkeypatch.delenv("K3KIT_LLAMA_SERVER", raising=False)
    exe = llama_server.built_binary()
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert llama_server.find_binary() == exe
    assert llama_server.build() == exe          # no cmake run: it would fail on this fake tree


# ----------------------------------------------------------------------------- the real llama-server

def test_real_llama_server_serves_the_mini_to_concurrent_clients(tmp_path):
    """Skipped unless llama-server is built (`python benchmarks/llama_server.py`); CI does not build it."""
    exe = llama_server.find_binary()
    if exe is None:
        pytest.skip("no llama-server binary: build one with `python benchmarks/llama_server.py` (~30 min)")
    args, _ = bench_serve.parse_args(["--concurrency", "2", "--threads", "1", "--ctx", "256",
                                      "--llama-server", str(exe)])
    port = bench_serve.free_port()
    server = bench_serve.start("llama-server", bench_serve.llama_cmd(args, port, "llama-server"), port,
                               tmp_path, False)
    try:
        one = bench_serve.complete(server, bench_serve.PROMPTS[0], 4)
        assert one.tokens == 4 and 0 < one.ttft <= one.seconds
        step = bench_serve.run_step(server, 2, 1, 3)
        assert (step.requests, step.tokens) == (2, 6)
    finally:
        server.stop()


# ----------------------------------------------------------------------------- k3kit.bench.concurrency

FAKE_LLAMA_SERVER = """#!{python}
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
if "--fail" in open({flags!r}).read():
    sys.exit("error: invalid argument: --no-such-flag")
port = int(argv[argv.index("--port") + 1])
open({flags!r}, "w").write(json.dumps(argv))
t_ready = time.monotonic() + 0.5
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        code = 200 if time.monotonic() > t_ready else 503
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b'{{"status": "ok"}}')
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert isinstance(req["prompt"], list)
        self.send_response(200)
        self.end_headers()
        n = req["max_tokens"]
        tok = {{"choices": [{{"text": "x", "finish_reason": None}}]}}
        for i in range(n):
            self.wfile.write(b"data: " + json.dumps(tok).encode() + b"\\n\\n")
        usage = {{"completion_tokens": n, "prompt_tokens": len(req["prompt"])}}
        end = {{"choices": [{{"text": "", "finish_reason": "length"}}], "usage": usage}}
        self.wfile.write(b"data: " + json.dumps(end).encode() + b"\\n\\ndata: [DONE]\\n\\n")
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _fake_llama_server(tmp_path: Path, fail: bool) -> tuple[Path, Path]:
    flags = tmp_path / "flags.json"
    flags.write_text("--fail" if fail else "")
    exe = tmp_path / "llama-server"
    exe.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, flags=str(flags)))
    exe.chmod(0o755)
    return exe, flags


def test_llama_server_peer_waits_for_health_then_serves_rounds(tmp_path):
    from k3kit.bench import concurrency as conc
    exe, flags = _fake_llama_server(tmp_path, fail=False)
    t0 = time.monotonic()
    server = conc.LlamaServer(exe, tmp_path / "m.gguf", slots=4, ctx=256, threads=2)
    try:
        assert time.monotonic() - t0 >= 0.5          # /health was 503 until then
        argv = json.loads(flags.read_text())
        assert argv[argv.index("-np") + 1] == "4" and argv[argv.index("-c") + 1] == "1024"
        rounds = conc.run_rounds(server, [[1, 2, 3], [4, 5]], 5, [1, 4], 1, lambda what: None)
    finally:
        server.close()
    assert [(r.clients, r.tokens) for r in rounds] == [(1, 5), (4, 20)]
    assert server.proc.poll() is not None


def test_llama_server_that_exits_is_a_one_line_error(tmp_path):
    from k3kit.bench import concurrency as conc
    from k3kit.errors import K3Error
    exe, _ = _fake_llama_server(tmp_path, fail=True)
    with pytest.raises(K3Error, match=r"llama-server did not start \(exit 1\): error: invalid argument"):
        conc.LlamaServer(exe, tmp_path / "m.gguf", slots=1, ctx=64, threads=1)
