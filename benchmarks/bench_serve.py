"""Serving throughput: `k3kit serve` (AR and with a draft) vs llama.cpp's server, N concurrent clients.

    python benchmarks/bench_serve.py [--model PATH] [--concurrency 1,2,4,8,16] [--requests 2]
                                     [--max-tokens 32] [--threads 2] [--max-batch 256]
                                     [--expert-cache-mib 256] [--draft default|PATH|none] [--ctx 1024]
                                     [--peer auto|llama-server|llama_cpp.server|shim|none]
                                     [--llama-server PATH] [--slots N] [--repeat 1] [--ab TREE]
                                     [--out DIR]

Every server is a subprocess on a free loopback port, started once and kept for the whole run:
  * k3kit AR:     `k3kit serve MODEL --max-batch B --threads T --expert-cache-mib M --ctx C`
  * k3kit draft:  the same with `--draft D` (skipped with --draft none);
  * --ab TREE:    k3kit AR once more from another checkout (PYTHONPATH=TREE/src), for a same-run A/B;
  * llama-server: llama.cpp's C++ server built from the tree vendored in the llama-cpp-python sdist
                  (`python benchmarks/llama_server.py`, ~30 min once; or --llama-server PATH /
                  $K3KIT_LLAMA_SERVER): `-np SLOTS -c C*SLOTS --cont-batching -t T -tb T`, SLOTS =
                  the highest concurrency, so every client has a slot of the same C as k3kit's
                  sequences and all decoding slots share one batch per pass, as k3kit's do. Prompt
                  caching is off (`--no-cache-prompt`: k3kit has none, and the prompts repeat) and so
                  is weight repacking (`--no-repack`: on a CPU with AMX-INT8 llama.cpp aborts on
                  kimi-k3 files with it; off on every peer, as in bench_decode.py). This is the peer
                  `--peer auto` picks when the binary exists.
  * llama_cpp.server / shim (older, serial peers): `python -m llama_cpp.server` when its
                  dependencies import, else llama-cpp-python's `Llama.create_completion` behind a small
                  OpenAI-shaped HTTP server in this file (`--serve-llama`), one request at a time.
Each client is a thread that sends `--requests` streamed greedy /v1/completions requests one
after the other (fixed prompts, `max_tokens`, temperature 0) over http.client (stdlib); the same
client code drives every server. At each concurrency the servers take turns, one at a time (the
others idle), and the order flips on every other sweep of `--repeat`; every step starts after
`--settle` idle seconds (a step measures its own concurrency, not the tail of the one before).

Reported per server and concurrency: aggregate generated tok/s (completion tokens of all requests
/ wall time from the first request sent to the last one finished), time to first token (p50, the
first streamed chunk of a token), and for k3kit the expert payload per generated token (the difference of
/metrics' k3kit_expert_payload_bytes_total and k3kit_generated_tokens_total over the step), plus
the ratio k3kit / llama.cpp at the same concurrency and the issue's goal figures at 8 clients
(k3kit AR vs 4x its own single stream, and vs llama.cpp). Writes DIR/bench_serve.json and
DIR/bench_serve.png. A repeated sweep reports the median and the min..max spread, and the ratio
of medians and of bests (the machine's other load only ever slows a step down).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from k3kit.bench.concurrency import llama_server_cmd
from k3kit.bench.llama_cpp import model_params

PROMPTS = [
    "import os\nimport sys\n\ndef main(",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n",
    "# read a CSV file and print the sum of the second column\nimport csv\n",
    "def quicksort(items):\n",
    "import json\n\n\ndef load_config(path):\n",
    "for i in range(10):\n",
    "def is_prime(n: int) -> bool:\n",
]


# ----------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen
    log: Path
    has_metrics: bool
    model_id: str = ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def wait_healthy(server: Server, timeout: float = 600.0) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if server.proc.poll() is not None:
            raise SystemExit(f"{server.name} exited ({server.proc.returncode}); log: {server.log}\n"
                             + server.log.read_text(errors="replace")[-2000:])
        try:
            status, body = get(server.port, "/health", 2.0)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{server.name}: not healthy after {timeout:.0f} s; log: {server.log}")


def start(name: str, cmd: list[str], port: int, out: Path, has_metrics: bool,
          env_extra: dict[str, str] | None = None) -> Server:
    log = out / f"{re.sub(r'[^a-z0-9]+', '_', name.lower())}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    f.close()
    s = Server(name, port, proc, log, has_metrics)
    print(f"starting {name}: {' '.join(cmd)}", flush=True)
    wait_healthy(s)
    status, body = get(port, "/v1/models")
    s.model_id = json.loads(body)["data"][0]["id"] if status == 200 else "model"
    return s


def k3kit_cmd(args: argparse.Namespace, port: int, draft: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "k3kit.cli", "serve", str(args.model), "--port", str(port),
           "--threads", str(args.threads), "--max-batch", str(args.max_batch),
           "--expert-cache-mib", str(args.expert_cache_mib), "--ctx", str(args.ctx)]
    return cmd + (["--draft", draft] if draft else [])


def llama_server_importable() -> bool:
    r = subprocess.run([sys.executable, "-c", "import llama_cpp.server.app"], capture_output=True)
    return r.returncode == 0


def llama_server_binary(args: argparse.Namespace) -> Path | None:
    """--llama-server, else what benchmarks/llama_server.py finds ($K3KIT_LLAMA_SERVER, its build, PATH)."""
    if args.llama_server:
        p = Path(args.llama_server)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise SystemExit(f"--llama-server {p}: not an executable file")
        return p
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import llama_server
    try:
        return llama_server.find_binary()
    except llama_server.BuildError as e:
        raise SystemExit(f"bench_serve.py: {e}") from None


def choose_peer(args: argparse.Namespace) -> str:
    """--peer auto: llama-server when a binary is there, else llama_cpp.server, else the shim."""
    if args.peer == "llama-server" and llama_server_binary(args) is None:
        raise SystemExit("--peer llama-server: no binary; build it with `python benchmarks/llama_server.py` "
                         "or pass --llama-server PATH")
    if args.peer != "auto":
        return str(args.peer)
    if llama_server_binary(args) is not None:
        return "llama-server"
    peer = "llama_cpp.server" if llama_server_importable() else "shim"
    print(f"no llama-server binary (build one with `python benchmarks/llama_server.py`): using {peer}, "
          "llama-cpp-python serving ONE request at a time, not llama.cpp's batching server", flush=True)
    return peer


LLAMA_CPP_SERVER_NO_REPACK = (
    "import runpy, llama_cpp\n"
    "from k3kit.bench.llama_cpp import model_params\n"
    "with model_params(llama_cpp, repack=False):\n"
    "    runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)\n")


def llama_cmd(args: argparse.Namespace, port: int, peer: str) -> list[str]:
    if peer == "llama-server":
        binary = llama_server_binary(args)
        assert binary is not None
        return llama_server_cmd(binary, Path(args.model), port, args.slots, args.ctx, args.threads)
    if peer == "llama_cpp.server":
        # `python -m llama_cpp.server` has no setting for extra buffer types: run its __main__ with
        # repacking off, as the other peers run
        return [sys.executable, "-c", LLAMA_CPP_SERVER_NO_REPACK, "--model", str(args.model),
                "--port", str(port), "--host", "127.0.0.1", "--n_threads", str(args.threads),
                "--n_threads_batch", str(args.threads), "--n_ctx", str(args.ctx), "--n_batch", "512"]
    return [sys.executable, str(Path(__file__).resolve()), "--serve-llama", "--model", str(args.model),
            "--port", str(port), "--threads", str(args.threads), "--ctx", str(args.ctx)]


# ----------------------------------------------------------------------------- the shim peer

def serve_llama(args: argparse.Namespace) -> None:
    """llama-cpp-python's Llama behind POST /v1/completions (streamed SSE or one JSON) and GET /health;
    one request at a time, as llama_cpp.server runs one model."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import llama_cpp

    with model_params(llama_cpp, repack=False):     # as every peer here (the module docstring)
        llm = llama_cpp.Llama(model_path=str(args.model), n_ctx=args.ctx, n_batch=512,
                              n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def _json(self, code: int, obj: Any) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"data": [{"id": Path(args.model).stem, "object": "model"}]})
            else:
                self._json(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._json(404, {"error": {"message": "not found"}})
                return
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            kw = dict(prompt=req["prompt"], max_tokens=int(req.get("max_tokens", 16)),
                      temperature=float(req.get("temperature", 0.0)), top_k=0, top_p=1.0, repeat_penalty=1.0)
            with lock:
                if not req.get("stream"):
                    self._json(200, llm.create_completion(**kw))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                n = 0
                chunk: Any
                for chunk in llm.create_completion(stream=True, **kw):
                    n += chunk["choices"][0]["finish_reason"] is None    # one chunk per token, then the end
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                usage = {"prompt_tokens": len(llm.tokenize(req["prompt"].encode())), "completion_tokens": n}
                self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")

    httpd = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"llama.cpp shim on http://127.0.0.1:{args.port}", flush=True)
    try:
        httpd.serve_forever()
    finally:
        llm.close()


# ----------------------------------------------------------------------------- clients

@dataclass
class Result:
    ttft: float
    seconds: float
    tokens: int
    text: str


def sse_events(response: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a streamed completion's `data:` lines, up to `data: [DONE]`."""
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def complete(server: Server, prompt: str, max_tokens: int) -> Result:
    """One streamed greedy completion; tokens from the final usage chunk, else one per chunk.

    TTFT is the first chunk of a token. llama-cpp-python streams one per token, with empty text
    while it holds back an incomplete UTF-8 character; k3kit streams only chunks with text. On
    real text the two are the same; on a random model's tokens, k3kit's TTFT is the later one."""
    body = json.dumps({"model": server.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=900)
    t0 = time.perf_counter()
    ttft, chunks, usage, text = None, 0, None, []
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        for obj in sse_events(r):
            if obj.get("usage"):
                usage = obj["usage"]
            for c in obj.get("choices") or ():
                if c.get("finish_reason") is None:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    chunks += 1
                    text.append(c.get("text") or "")
    finally:
        conn.close()
    t = time.perf_counter() - t0
    tokens = int(usage["completion_tokens"]) if usage else chunks
    return Result(ttft if ttft is not None else t, t, tokens, "".join(text))


def metrics(port: int) -> dict[str, float]:
    status, body = get(port, "/metrics")
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@dataclass
class Step:
    server: str
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    tok_s: float
    ttft_p50: float
    ttft_max: float
    payload_per_token: float | None = None
    max_batch_sequences: float | None = None      # the most sequences in one target pass, sampled
    # where the wall time went (k3kit's /metrics): seconds in the model's passes with prompt rows and
    # with decoding rows (a mixed pass split by rows), and the decode passes run
    prefill_s: float | None = None
    decode_s: float | None = None
    decode_passes: float | None = None
    texts: list[str] = field(default_factory=list)


def run_step(server: Server, n: int, per_client: int, max_tokens: int) -> Step:
    before = metrics(server.port) if server.has_metrics else None
    results: list[Result] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        try:
            for r in range(per_client):
                res = complete(server, PROMPTS[(i * per_client + r) % len(PROMPTS)], max_tokens)
                with lock:
                    results.append(res)
        except BaseException as e:     # reported after the join
            errors.append(e)

    seen: list[float] = []
    done = threading.Event()

    def sample() -> None:           # /metrics every 0.1 s: how many sequences shared a pass
        start = (before or {}).get("k3kit_generated_tokens_total", 0.0)
        while not done.wait(0.1):
            try:
                m = metrics(server.port)
            except OSError:
                continue
            if m.get("k3kit_generated_tokens_total", 0.0) > start:     # a pass of this step has run
                seen.append(m.get("k3kit_batch_sequences", 0.0))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    sampler = threading.Thread(target=sample) if server.has_metrics else None
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    if sampler:
        sampler.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    if sampler:
        sampler.join()
    if errors:
        raise SystemExit(f"{server.name} at concurrency {n}: {errors[0]!r}")
    tokens = sum(r.tokens for r in results)
    ttfts = [r.ttft for r in results]
    step = Step(server.name, n, len(results), tokens, wall, tokens / wall, statistics.median(ttfts),
                max(ttfts))
    if before is not None:
        after = metrics(server.port)
        def delta(key: str) -> float:
            return after.get(key, 0.0) - before.get(key, 0.0)
        gen, pay = delta("k3kit_generated_tokens_total"), delta("k3kit_expert_payload_bytes_total")
        step.payload_per_token = pay / gen if gen else None
        step.max_batch_sequences = max(seen, default=after.get("k3kit_batch_sequences"))
        step.prefill_s = delta("k3kit_prefill_seconds_total")
        step.decode_s = delta("k3kit_decode_seconds_total")
        step.decode_passes = delta("k3kit_decode_passes_total")
    if n == 1:
        step.texts = [r.text for r in results]
    return step


# ----------------------------------------------------------------------------- report

def wall_split(st: Step) -> str:
    """Where a step's wall time went (k3kit's /metrics): the model's passes with prompt rows, with
    decoding rows (and per decode pass), and the rest (scheduling, sampling, HTTP, waiting for
    requests): what a faster forward pass can win and what it cannot."""
    if st.prefill_s is None or st.decode_s is None:
        return ""
    per_pass = f" = {st.decode_s / st.decode_passes * 1e3:.0f} ms/pass" if st.decode_passes else ""
    return (f"; wall: prefill {st.prefill_s:.2f} s, decode {st.decode_s:.2f} s{per_pass}, "
            f"outside the model {st.seconds - st.prefill_s - st.decode_s:.2f} s")


def summarize(steps: list[Step]) -> list[dict[str, Any]]:
    """Median (and min..max) over repeats per server and concurrency."""
    rows = []
    keys = sorted({(s.server, s.concurrency) for s in steps}, key=lambda k: (k[1], k[0]))
    for name, n in keys:
        group = [s for s in steps if s.server == name and s.concurrency == n]
        tok = [s.tok_s for s in group]
        pay = [s.payload_per_token for s in group if s.payload_per_token is not None]
        seqs = [s.max_batch_sequences for s in group if s.max_batch_sequences is not None]
        rows.append({"server": name, "concurrency": n, "repeats": len(group),
                     "tok_s": statistics.median(tok), "tok_s_min": min(tok), "tok_s_max": max(tok),
                     "ttft_p50": statistics.median(s.ttft_p50 for s in group),
                     "payload_per_token": statistics.median(pay) if pay else None,
                     "max_batch_sequences": max(seqs) if seqs else None,
                     "tokens": group[0].tokens, "requests": group[0].requests})
    return rows


def print_table(rows: list[dict[str, Any]], peer: str | None) -> None:
    peer_tok = {r["concurrency"]: r["tok_s"] for r in rows if r["server"] == peer}
    peer_best = {r["concurrency"]: r["tok_s_max"] for r in rows if r["server"] == peer}
    print(f"\n{'server':22s} {'conc':>4s} {'tok/s':>8s} {'(min..max)':>16s} {'TTFT p50':>9s} "
          f"{'payload/tok':>12s} {'seq/pass':>8s} {'vs llama.cpp: median (best)':>28s}")
    for r in rows:
        pay = "" if r["payload_per_token"] is None else f"{r['payload_per_token'] / 2**20:9.2f} MiB"
        base = peer_tok.get(r["concurrency"])
        best = peer_best.get(r["concurrency"])
        mine = base and best and r["server"] != peer
        # the ratio of medians, and of bests (other load on the machine only ever slows a step down)
        r["ratio_vs_llama"] = r["tok_s"] / base if mine else None
        r["ratio_vs_llama_best"] = r["tok_s_max"] / best if mine else None
        ratio = f"x{r['ratio_vs_llama']:.2f} (x{r['ratio_vs_llama_best']:.2f})" if mine else ""
        seqs = "" if r["max_batch_sequences"] is None else f"{r['max_batch_sequences']:.0f}"
        print(f"{r['server']:22s} {r['concurrency']:4d} {r['tok_s']:8.2f} "
              f"{r['tok_s_min']:7.2f}..{r['tok_s_max']:<7.2f} {r['ttft_p50']:8.3f}s {pay:>12s} {seqs:>8s} "
              f"{ratio:>28s}")


def goal_figures(rows: list[dict[str, Any]], server: str, peer: str | None,
                 n: int = 8) -> dict[str, Any] | None:
    """Issue 13's goal at n clients: aggregate tok/s >= 4x the server's own single stream, >= the peer's."""
    by = {(r["server"], r["concurrency"]): r for r in rows}
    if (server, n) not in by or (server, 1) not in by:
        return None
    mine, single = by[(server, n)]["tok_s"], by[(server, 1)]["tok_s"]
    g: dict[str, Any] = {"clients": n, "tok_s": mine, "single_stream_tok_s": single,
                         "vs_single_stream": mine / single, "goal_vs_single_stream": 4.0}
    text = (f"goal at {n} clients: {server} {mine:.2f} tok/s = {mine / single:.2f}x its single stream "
            f"({single:.2f} tok/s; goal >= 4x: {'met' if mine >= 4 * single else 'NOT met'})")
    if peer and (peer, n) in by:
        theirs = by[(peer, n)]["tok_s"]
        g.update(peer=peer, peer_tok_s=theirs, vs_peer=mine / theirs)
        text += (f", {mine / theirs:.2f}x {peer} ({theirs:.2f} tok/s; goal >= 1x: "
                 f"{'met' if mine >= theirs else 'NOT met'})")
    g["text"] = text
    return g


def plot(rows: list[dict[str, Any]], out: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["server"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for name in names:
        rs = [r for r in rows if r["server"] == name]
        xs = [r["concurrency"] for r in rs]
        spread = [[r["tok_s"] - r["tok_s_min"] for r in rs], [r["tok_s_max"] - r["tok_s"] for r in rs]]
        axes[0].errorbar(xs, [r["tok_s"] for r in rs], yerr=spread, marker="o", label=name, capsize=3)
        axes[1].plot(xs, [r["ttft_p50"] for r in rs], marker="o", label=name)
        if any(r["payload_per_token"] is not None for r in rs):
            axes[2].plot(xs, [(r["payload_per_token"] or 0) / 2**20 for r in rs], marker="o", label=name)
    for ax, ylabel in zip(axes, ("aggregate generated tok/s", "time to first token, p50 (s)",
                                 "expert payload per generated token (MiB)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out / "bench_serve.png"
    fig.savefig(path, dpi=110)
    return path


# ----------------------------------------------------------------------------- main

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the shipped mini K3)")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after the other")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--expert-cache-mib", type=float, default=256.0)
    ap.add_argument("--draft", default="default", help="k3kit --draft (default, a path, or none)")
    ap.add_argument("--peer", default="auto",
                    choices=("auto", "llama-server", "llama_cpp.server", "shim", "none"))
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="llama-server binary (default: "
                    "$K3KIT_LLAMA_SERVER, else the one benchmarks/llama_server.py built, else PATH)")
    ap.add_argument("--slots", type=int, default=None,
                    help="llama-server parallel slots (-np; default: the highest --concurrency)")
    ap.add_argument("--ctx", type=int, default=1024, help="context per sequence (k3kit --ctx; llama.cpp "
                    "-c CTX*SLOTS for llama-server, n_ctx for the serial peers)")
    ap.add_argument("--repeat", type=int, default=1, help="sweeps (servers alternate within each)")
    ap.add_argument("--settle", type=float, default=1.0, metavar="S",
                    help="idle seconds before each step, so that a step starts on a server its previous "
                         "step has left (a draft server admits requests under the load of the last "
                         "RECENT_S = 0.25 s: right after a 16-client step a 1-client step's first "
                         "requests would run plain, as AR)")
    ap.add_argument("--time-budget", type=float, default=0.0, metavar="S",
                    help="start no further sweep that would end after S seconds of sweeping (0: no limit), "
                    "to keep a run under a shared machine lock short")
    ap.add_argument("--ab", default=None, metavar="TREE",
                    help="also serve AR from another k3kit checkout (PYTHONPATH=TREE/src, its C extensions "
                         "built in place), taking turns with this tree's: a same-run A/B")
    ap.add_argument("--out", default="bench_serve_out")
    ap.add_argument("--serve-llama", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return ap


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[int]]:
    """The options and the concurrency levels; a bad value exits with one line."""
    args = parser().parse_args(argv)
    if args.model is None:
        from k3kit.mini.paths import shipped_gguf
        args.model = str(shipped_gguf())
    if not Path(args.model).is_file():
        raise SystemExit(f"{args.model}: no such model file")
    if args.serve_llama:
        return args, []
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
    except ValueError:
        raise SystemExit(f"--concurrency {args.concurrency}: expected comma-separated integers") from None
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency {args.concurrency}: every level must be >= 1")
    if args.slots is None:
        args.slots = max(levels)
    if args.slots < 1 or args.ctx < 1 or args.requests < 1 or args.max_tokens < 1:
        raise SystemExit("--slots, --ctx, --requests and --max-tokens must be >= 1")
    if not args.settle >= 0:
        raise SystemExit(f"--settle {args.settle:g}: must be >= 0 seconds")
    return args, levels


def main() -> None:
    args, levels = parse_args()
    if args.serve_llama:
        serve_llama(args)
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peer = choose_peer(args)
    servers: list[Server] = []
    try:
        p = free_port()
        servers.append(start("k3kit AR", k3kit_cmd(args, p, None), p, out, True))
        if args.ab:
            tree = Path(args.ab).resolve()
            p = free_port()
            servers.append(start(f"k3kit AR @{tree.name}", k3kit_cmd(args, p, None), p, out, True,
                                 {"PYTHONPATH": str(tree / "src")}))
        if args.draft != "none":
            p = free_port()
            servers.append(start(f"k3kit draft={Path(args.draft).name}", k3kit_cmd(args, p, args.draft), p,
                                 out, True))
        peer_name = None
        if peer != "none":
            p = free_port()
            peer_name = "llama-server" if peer == "llama-server" else f"llama.cpp ({peer})"
            servers.append(start(peer_name, llama_cmd(args, p, peer), p, out, False))
        for s in servers:                          # one warm-up request each (first-touch costs)
            complete(s, PROMPTS[0], 4)
        steps: list[Step] = []
        t_run = time.monotonic()
        sweeps = 0
        for rep in range(args.repeat):
            t_sweep = time.monotonic()
            if rep and args.time_budget and (t_sweep - t_run) / rep + (t_sweep - t_run) > args.time_budget:
                print(f"--time-budget {args.time_budget:g} s: stopping after {rep} sweep(s)", flush=True)
                break
            for n in levels:
                # one server at a time, the order flipped every other sweep (no server always goes first)
                for s in (servers if rep % 2 == 0 else servers[::-1]):
                    time.sleep(args.settle)
                    st = run_step(s, n, args.requests, args.max_tokens)
                    steps.append(st)
                    pay = ("" if st.payload_per_token is None
                           else f", payload {st.payload_per_token / 2**20:.2f} MiB/tok")
                    seqs = ("" if st.max_batch_sequences is None
                            else f", <= {st.max_batch_sequences:.0f} seq/pass")
                    print(f"[{rep}] {s.name:22s} c={n:2d}: {st.tokens} tokens in {st.seconds:.2f} s = "
                          f"{st.tok_s:.2f} tok/s, TTFT p50 {st.ttft_p50:.3f} s{pay}{seqs}{wall_split(st)}",
                          flush=True)
            sweeps = rep + 1
    finally:
        for s in servers:
            s.stop()

    rows = summarize(steps)
    print_table(rows, peer_name)
    goal = goal_figures(rows, "k3kit AR", peer_name)
    if goal:
        print(goal["text"])
    if args.ab:
        other = goal_figures(rows, f"k3kit AR @{Path(args.ab).resolve().name}", peer_name)
        if other:
            print(other["text"])
    # greedy agreement at concurrency 1 (same prompts, same order): informative, not a check
    texts = {s.server: s.texts for s in steps if s.concurrency == 1}
    agree = {}
    if peer_name and peer_name in texts:
        for name, t in texts.items():
            if name != peer_name:
                agree[name] = sum(a == b for a, b in zip(t, texts[peer_name], strict=False)) / max(1, len(t))
        print("greedy texts equal to llama.cpp's at concurrency 1: "
              + ", ".join(f"{k}: {100 * v:.0f}%" for k, v in agree.items()))
    from k3kit.bench.run import cpu_info
    cpu = cpu_info()
    meta = {"model": str(args.model), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu,
            "threads": args.threads, "max_tokens": args.max_tokens, "requests_per_client": args.requests,
            "max_batch": args.max_batch, "expert_cache_mib": args.expert_cache_mib, "draft": args.draft,
            "peer": peer, "peer_command": llama_cmd(args, 0, peer) if peer != "none" else None,
            "slots": args.slots, "ctx": args.ctx, "repeat": sweeps, "ab_tree": args.ab,
            "command": " ".join(sys.argv)}
    from k3kit._io import write_json
    write_json(out / "bench_serve.json", {"meta": meta, "rows": rows, "goal_at_8": goal,
                                          "greedy_agreement_c1": agree, "steps": [asdict(s) for s in steps]})
    png = plot(rows, out, f"{Path(args.model).name}: {args.threads} threads, {args.max_tokens} tokens x "
               f"{args.requests} requests per client, k3kit expert cache {args.expert_cache_mib:g} MiB, "
               f"{sweeps} sweep(s), {time.strftime('%Y-%m-%d')}")
    print(f"wrote {out / 'bench_serve.json'} and {png}")


if __name__ == "__main__":
    main()
