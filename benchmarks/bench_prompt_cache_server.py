"""The agent workload of bench_prompt_cache.py over HTTP, k3kit serve against llama-server on the
same GGUF: time to first token per turn, and after both servers restart.

    python benchmarks/bench_prompt_cache_server.py [--model GGUF] [--conversations 1] [--exchanges 8]
        [--system-tokens 4000] [--tool-tokens 300] [--reply-tokens 100] [--threads 1]
        [--llama-server PATH] [--repack on|off] [--slot-save] [--json]

Each server runs alone (one, then the other): `--conversations` clients each hold a conversation
of a ~`--system-tokens` system prompt and `--exchanges` exchanges (a ~`--tool-tokens` tool
result, then the model's greedy reply of up to `--reply-tokens`), every request the whole
conversation as token ids (streamed; k3kit's /v1/completions, llama-server's /completion; the
chat is rendered and tokenized here, and a file without a chat template keeps each reply's own
ids: see `complete`). Then the server is stopped (SIGTERM) and started again, and
one more exchange of each conversation measures TTFT after a restart.

k3kit serve: its defaults (prompt cache in RAM) plus `--prompt-cache-dir` (a fresh temporary
directory), which is how a user keeps the cache across restarts. llama-server: its defaults for
prompt caching (`cache_prompt` on, the default context checkpoints and `--cache-ram`) and weight
repacking (`--repack off` passes `--no-repack`), one slot
per conversation (`-np`, `-c` = slots x `--ctx`), the same threads; with `--slot-save` it is
also given `--slot-save-path` and each slot is saved before the restart and restored after it
(`/slots?action=save|restore`), the nearest llama-server comes to a cache that survives.
The cached prompt tokens per turn are k3kit's `usage.prompt_tokens_details.cached_tokens` and
llama-server's `timings.cache_n`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_serve as bs  # noqa: E402
from bench_prompt_cache import Conversation, cut, stdlib_text  # noqa: E402

from k3kit.bench.llama_cpp import server_repack_args  # noqa: E402
from k3kit.mini.paths import shipped_gguf  # noqa: E402
from k3kit.tokenizer.codec import TextCodec  # noqa: E402


@dataclass
class Turn:
    ttft: float
    prompt_tokens: int
    cached: int | None
    text: str
    ids: list[int]


def complete(port: int, model_id: str, ids: list[int], max_tokens: int, slot: int | None) -> Turn:
    """One streamed greedy completion of token ids; TTFT at the first chunk with a token. The reply's
    token ids come back with it (k3kit: vLLM's `return_token_ids` on /v1/completions; llama-server:
    its own `/completion` with `return_tokens`, which its /v1 routes do not carry), so the next turn
    sends the very ids the model produced, as an agent holding ids does, and no text round trip can
    change them (a synthetic file's random tokens would not survive one)."""
    req: dict[str, Any] = {"prompt": ids, "temperature": 0, "stream": True, "cache_prompt": True}
    if slot is None:
        path = "/v1/completions"
        req |= {"model": model_id, "max_tokens": max_tokens, "stream_options": {"include_usage": True},
                "return_token_ids": True}
    else:
        path = "/completion"
        req |= {"n_predict": max_tokens, "return_tokens": True, "id_slot": slot}   # the conversation's slot
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    t0 = time.perf_counter()
    ttft, cached, text, got = None, None, [], []
    try:
        conn.request("POST", path, json.dumps(req), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        for obj in bs.sse_events(r):
            details = (obj.get("usage") or {}).get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                cached = int(details["cached_tokens"])
            if (obj.get("timings") or {}).get("cache_n") is not None:
                cached = int(obj["timings"]["cache_n"])
            pieces = ([(c.get("text") or "", c.get("token_ids") or []) for c in obj.get("choices") or ()]
                      if slot is None else [(obj.get("content") or "", obj.get("tokens") or [])])
            for piece, toks in pieces:
                if (piece or toks) and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
                got += toks
    finally:
        conn.close()
    return Turn(ttft if ttft is not None else time.perf_counter() - t0, len(ids), cached, "".join(text), got)


def post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        out = r.read()
        if r.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {r.status}: {out[:300]!r}")
        return json.loads(out or b"{}")
    finally:
        conn.close()


class Workload:
    """The clients' conversations (bench_prompt_cache.Conversation: a model with a chat template has
    its messages rendered and tokenized every turn, as a chat client does; one without keeps the
    replies' own token ids)."""

    def __init__(self, codec: TextCodec, args: argparse.Namespace):
        self.codec, self.args = codec, args
        self.text = stdlib_text()
        system = cut(codec, self.text, args.system_tokens)
        self.convs = [Conversation(codec, system) for _ in range(args.conversations)]

    def next_prompts(self, t: int) -> list[list[int]]:
        n = len(self.convs)
        return [c.ask(cut(self.codec, self.text, self.args.tool_tokens, start=(1 + t * n + i) * 4000))
                for i, c in enumerate(self.convs)]

    def replies(self, turns: list[Turn]) -> None:
        for c, turn in zip(self.convs, turns, strict=True):
            c.answer(turn.text, turn.ids)


def run_turn(server: bs.Server, work: Workload, t: int, llama: bool) -> list[Turn]:
    prompts = work.next_prompts(t)
    out: list[Turn | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = complete(server.port, server.model_id, prompts[i], work.args.reply_tokens,
                              i if llama else None)
        except BaseException as e:      # noqa: BLE001 - reported below, in the main thread
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise SystemExit(f"{server.name}: {errors[0]}")
    turns = [x for x in out if x is not None]
    work.replies(turns)
    return turns


def commands(args: argparse.Namespace, which: str, port: int, cache_dir: Path) -> list[str]:
    n = args.conversations
    if which == "k3kit":
        return [sys.executable, "-m", "k3kit.cli", "serve", str(args.model), "--port", str(port),
                "--threads", str(args.threads), "--ctx", str(args.ctx), "--prompt-cache-dir", str(cache_dir),
                "--expert-cache-mib", str(args.expert_cache_mib)]
    binary = bs.llama_server_binary(args)
    if binary is None:
        raise SystemExit("no llama-server: build it with `python benchmarks/llama_server.py` "
                         "or pass --llama-server")
    cmd = [str(binary), "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(n), "-c", str(args.ctx * n), "--cont-batching", "-t", str(args.threads),
           "-tb", str(args.threads), *server_repack_args(args.repack == "on")]
    return cmd + (["--slot-save-path", str(cache_dir)] if args.slot_save else [])


def run_server(args: argparse.Namespace, which: str, codec: TextCodec, out: Path) -> dict[str, Any]:
    llama = which == "llama-server"
    cache_dir = Path(tempfile.mkdtemp(prefix=f"pc-{which}-", dir=out))
    work = Workload(codec, args)
    port = bs.free_port()
    server = bs.start(which, commands(args, which, port, cache_dir), port, out, has_metrics=not llama)
    rows = []
    try:
        for t in range(args.exchanges):
            turns = run_turn(server, work, t, llama)
            rows.append(summary(t + 1, turns))
            print(f"{which} turn {t + 1}: TTFT {rows[-1]['ttft_s']:.3f} s, cached {rows[-1]['cached']}",
                  flush=True)
        if llama and args.slot_save:
            for i in range(args.conversations):
                post(port, f"/slots/{i}?action=save", {"filename": f"slot{i}.bin"})
    finally:
        server.stop()
    port = bs.free_port()
    server = bs.start(which + " (restarted)", commands(args, which, port, cache_dir), port, out,
                      has_metrics=not llama)
    try:
        if llama and args.slot_save:
            for i in range(args.conversations):
                post(port, f"/slots/{i}?action=restore", {"filename": f"slot{i}.bin"})
        turns = run_turn(server, work, args.exchanges, llama)
        restart = summary(args.exchanges + 1, turns)
        print(f"{which} after a restart (turn {args.exchanges + 1}): TTFT {restart['ttft_s']:.3f} s, "
              f"cached {restart['cached']}", flush=True)
    finally:
        server.stop()
    return {"turns": rows, "restart": restart}


def summary(turn: int, turns: list[Turn]) -> dict[str, Any]:
    cached = [x.cached for x in turns if x.cached is not None]
    return {"turn": turn, "prompt_tokens": statistics.median(x.prompt_tokens for x in turns),
            "ttft_s": statistics.median(x.ttft for x in turns),
            "cached": statistics.median(cached) if cached else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the shipped mini)")
    ap.add_argument("--conversations", type=int, default=1)
    ap.add_argument("--exchanges", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=4000)
    ap.add_argument("--tool-tokens", type=int, default=300)
    ap.add_argument("--reply-tokens", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=12288, help="context per conversation (both servers)")
    ap.add_argument("--expert-cache-mib", type=int, default=4096)
    ap.add_argument("--llama-server", default=None,
                    help="llama-server binary (default: benchmarks/llama_server.py's)")
    ap.add_argument("--repack", choices=("on", "off"), default="on",
                    help="llama-server's weight repacking for its CPU kernels (on: its default)")
    ap.add_argument("--slot-save", action="store_true",
                    help="llama-server saves its slots before the restart and restores them after it")
    ap.add_argument("--servers", default="k3kit,llama-server")
    ap.add_argument("--out", default=None, help="directory for the servers' logs (default: a temporary one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.model = Path(args.model or shipped_gguf())
    if not args.model.is_file():
        raise SystemExit(f"--model {args.model}: no such file")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-pc-server-"))
    out.mkdir(parents=True, exist_ok=True)
    from k3kit.gguf.shards import Model
    with Model.open(args.model) as m:
        codec = TextCodec(m.kv, str(args.model))
    machine = f"{platform.processor() or platform.machine()}, {args.threads} threads"
    result: dict[str, Any] = {"machine": machine,
                              "model": args.model.name, "conversations": args.conversations, "servers": {}}
    names = [s for s in args.servers.split(",") if s]
    for which in names:
        if which not in ("k3kit", "llama-server"):
            raise SystemExit(f"--servers: unknown server {which!r}")
        result["servers"][which] = run_server(args, which, codec, out)
    print(f"\n{args.conversations} conversation(s), {args.model.name}, {args.threads} thread(s): "
          "median TTFT (s)")
    print("| turn | prompt tokens | " + " | ".join(f"{n} TTFT (cached)" for n in names)
          + (" | llama-server / k3kit |" if len(names) == 2 else " |"))
    print("|---|---|" + "---|" * len(names) + ("---|" if len(names) == 2 else ""))
    lines = [(r, [result["servers"][n]["turns"][i] for n in names]) for i, r in
             enumerate(result["servers"][names[0]]["turns"])]
    lines.append((result["servers"][names[0]]["restart"], [result["servers"][n]["restart"] for n in names]))
    for first, rs in lines:
        label = str(first["turn"]) + (" (restart)" if first["turn"] > args.exchanges else "")
        cells = " | ".join(f"{r['ttft_s']:.3f} ({'?' if r['cached'] is None else r['cached']})" for r in rs)
        ratio = f" | {rs[1]['ttft_s'] / max(rs[0]['ttft_s'], 1e-9):.1f}x" if len(rs) == 2 else ""
        print(f"| {label} | {first['prompt_tokens']:.0f} | {cells}{ratio} |")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
