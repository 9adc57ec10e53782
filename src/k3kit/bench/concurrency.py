"""`--concurrency 1,4,...`: `k3kit serve` on a free port, driven by N concurrent API clients.

Only the HTTP API is used (the server is started as its own process, `python -m k3kit serve
... --port 0`, and read from its announced URL), so the rows measure what an OpenAI client
sees: per round, N clients each stream one greedy /v1/completions request of the workload's
token prompts; aggregate tok/s = completion tokens of all N / the round's wall time, TTFT =
time from sending a request to its first streamed token. -r rounds per client count.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from k3kit.bench.llama_cpp import server_repack_args
from k3kit.errors import K3Error

LOAD_TIMEOUT = 600.0
REQUEST_TIMEOUT = 900.0
SERVING = re.compile(r"serving .* on (http://\S+)")


@dataclass
class ClientResult:
    ttft_s: float = 0.0
    seconds: float = 0.0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class Round:
    clients: int
    wall_s: float
    results: list[ClientResult] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(r.completion_tokens for r in self.results)


class Server:
    """A `k3kit serve` child process on 127.0.0.1 and a free port; stopped by `close()`."""

    def __init__(self, model: Path, extra: Sequence[str]):
        cmd = [sys.executable, "-m", "k3kit", "serve", str(model), "--host", "127.0.0.1", "--port", "0",
               *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # stderr to a file and stdout drained by a thread: a full pipe would stall the server
        self._err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        self.url = self._wait_url()

    def _wait_url(self) -> str:
        found: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                m = SERVING.search(line)
                if m and not found:
                    found.append(m.group(1))
                    ready.set()
            ready.set()             # the server exited
        threading.Thread(target=read, daemon=True).start()
        ready.wait(LOAD_TIMEOUT)
        if not found:
            self.close()
            self._err.seek(0)
            err = self._err.read().strip().splitlines()
            raise K3Error(f"k3kit serve did not start: {err[-1] if err else 'no output'}")
        return found[0]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()


def llama_server_cmd(binary: Path, model: Path, port: int, slots: int, ctx: int, threads: int) -> list[str]:
    """llama.cpp's server as the peer of k3kit serve: one slot of ctx tokens per client (-np, -c is the
    total) and continuous batching, so every decoding slot shares one batch per pass as k3kit's
    sequences do; the same threads for decode and prompt. Prompt caching off: k3kit has none and a
    benchmark's prompts repeat. Weight repacking off, as every llama.cpp peer runs here: on a CPU
    with AMX-INT8 llama.cpp aborts on kimi-k3 files with it (k3kit.bench.llama_cpp.repack_choice)."""
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(ctx * slots), "--cont-batching",
            "-t", str(threads), "-tb", str(threads), "--no-cache-prompt", *server_repack_args(False)]


class LlamaServer(Server):
    """A `llama-server` child process on 127.0.0.1 and a free port, ready once /health answers 200."""

    def __init__(self, binary: Path, model: Path, slots: int, ctx: int, threads: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        self._err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(llama_server_cmd(binary, model, port, slots, ctx, threads),
                                     stdout=self._err, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     text=True)
        self.url = f"http://127.0.0.1:{port}"
        t_end = time.monotonic() + LOAD_TIMEOUT
        while time.monotonic() < t_end and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass                    # not listening yet: poll again until the timeout
            time.sleep(0.2)
        self.close_with_error()

    def close_with_error(self) -> None:
        rc = self.proc.poll()
        self._err.seek(0)
        lines = [x for x in self._err.read().splitlines() if x.strip()]
        self.close()
        why = lines[-1].strip() if lines else "no output"
        raise K3Error(f"llama-server did not start ({'exit ' + str(rc) if rc is not None else 'timeout'}): "
                      f"{why[:300]}")


def stream_completion(url: str, prompt: list[int], max_tokens: int) -> ClientResult:
    """One streamed greedy completion; the usage chunk gives the token count."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    out = ClientResult()
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices") and not out.ttft_s:
                    out.ttft_s = time.perf_counter() - t0
                usage = chunk.get("usage")
                if usage:
                    out.completion_tokens = int(usage.get("completion_tokens", 0))
    except (urllib.error.URLError, OSError, ValueError) as e:
        out.error = str(e).splitlines()[0] if str(e) else type(e).__name__
    out.seconds = time.perf_counter() - t0
    return out


def run_rounds(server: Server, prompts: Sequence[list[int]], n_gen: int, clients: Sequence[int], reps: int,
               tick: Callable[[str], None]) -> list[Round]:
    rounds: list[Round] = []
    # one unmeasured request first, as llama-bench's warm-up run: the server's first pass pays
    # for lazy setup (page faults of the trunk, kernel dispatch) that no later request sees
    tick("warm-up")
    warm = stream_completion(server.url, prompts[0], min(n_gen, 4))
    if warm.error:
        raise K3Error(f"{server.url}: the warm-up request failed ({warm.error})")
    for n in clients:
        for r in range(reps):
            tick(f"{n} clients, round {r + 1}/{reps}")
            results: list[ClientResult] = [ClientResult() for _ in range(n)]

            def client(i: int, results: list[ClientResult] = results, r: int = r, n: int = n) -> None:
                results[i] = stream_completion(server.url, prompts[(r * n + i) % len(prompts)], n_gen)
            threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rnd = Round(n, time.perf_counter() - t0, results)
            bad = [x.error for x in results if x.error]
            if bad:
                raise K3Error(f"{server.url}: {len(bad)} of {n} requests failed ({bad[0]})")
            rounds.append(rnd)
    return rounds
