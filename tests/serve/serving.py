"""Helpers for the server tests: a `k3kit serve` subprocess on a free loopback port, raw HTTP calls,
/metrics parsing, and `k3kit generate --json` references run as subprocesses.

Every wait is bounded; a server is stopped with SIGTERM (graceful) and killed if it lingers.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

READY = re.compile(r"^k3kit: serving (\S+) on (http://127\.0\.0\.1:\d+)$")
REPO = Path(__file__).resolve().parents[2]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("K3KIT_API_KEY", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


class Server:
    """`python -m k3kit serve --port 0 ARGS`; `url` once its one ready line is read."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        # one torch thread: on 2 shared cores two threads are several times slower, not faster
        self._err = tempfile.TemporaryFile(mode="w+")      # a file, not a pipe: it never fills up
        self.proc = subprocess.Popen([sys.executable, "-m", "k3kit", "serve", "--port", "0", "--threads", "1",
                                      *args],
                                     stdout=subprocess.PIPE, stderr=self._err, env=_env(env), text=True)
        self.url = ""
        self.model_id = ""
        self.lines: list[str] = []
        self.stderr_text = ""

    def wait_ready(self, timeout: float = 180.0) -> Server:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    break
                self.lines.append(line.rstrip("\n"))
                m = READY.match(self.lines[-1])
                if m:
                    self.model_id, self.url = m.group(1), m.group(2)
                    return self
            elif self.proc.poll() is not None:
                break
        self.stop()
        raise AssertionError(f"server did not come up: stdout {self.lines}, "
                             f"stderr {self.stderr_text[-2000:]}")

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM: the server drains (see k3kit.serve.server) and exits 0; killed if it lingers."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.seek(0)
        self.stderr_text = self._err.read()
        self._err.close()
        return self.proc.returncode


def raw(url: str, method: str, path: str, body: bytes | str | dict | None = None,
        headers: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    """One HTTP request with full control over the bytes; -> (status, parsed JSON or {"text": ...})."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        if isinstance(data, str):
            data = data.encode()
        h = {"Content-Type": "application/json"} | (headers or {})
        conn.request(method, path, body=data, headers=h)
        resp = conn.getresponse()
        text = resp.read().decode("utf-8", errors="replace")
    finally:
        conn.close()
    try:
        return resp.status, json.loads(text)
    except json.JSONDecodeError:
        return resp.status, {"text": text}


def metrics(url: str, key: str | None) -> dict[str, float]:
    """GET /metrics as {series (with labels): value}."""
    status, body = raw(url, "GET", "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    assert status == 200, body
    out = {}
    for line in body["text"].splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(url: str, key: str | None, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until no sequence is active and nothing waits; the last page."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url, key)
        if m["k3kit_sequences_active"] == 0 and m["k3kit_queue_depth"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server still busy after {timeout}s: active {m['k3kit_sequences_active']}, "
                                 f"queued {m['k3kit_queue_depth']}")
        time.sleep(0.05)


def wait_active(url: str, key: str | None, timeout: float = 30.0, want: int = 1) -> None:
    deadline = time.monotonic() + timeout
    while metrics(url, key)["k3kit_sequences_active"] < want:
        if time.monotonic() > deadline:
            raise AssertionError("no sequence became active")
        time.sleep(0.02)


def start_generate(runs: list[tuple[str, int, bool]]) -> subprocess.Popen:
    """`k3kit generate --prompt P --max-tokens N [--chat] --temperature 0 --json` on the shipped mini model
    for each (P, N, chat), in the background: one process running the CLI's main once per run, so torch
    is imported once."""
    argv = [["generate", "--prompt", p, "--max-tokens", str(n), "--temperature", "0", "--threads", "1",
             "--json"] + (["--chat"] if chat else []) for p, n, chat in runs]
    code = ("import sys, json\nfrom k3kit.cli import main\n"
            "for a in json.loads(sys.argv[1]):\n    assert main(a) == 0\n")
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(), text=True)


def finish_generate(proc: subprocess.Popen, timeout: float = 180.0) -> list[dict]:
    """The runs' JSON objects, in order."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]
