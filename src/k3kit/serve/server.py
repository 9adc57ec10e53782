"""Run `k3kit serve`: bind, start uvicorn, load the model meanwhile, announce, shut down cleanly.

The socket is bound first, so a busy port is an immediate one-line error. Uvicorn then serves
at once (GET /health answers 503 while the model loads) and the model is loaded on a thread;
when both are ready, exactly one line goes to stdout: `k3kit: serving MODEL_ID on http://HOST:PORT`
(the real port when --port 0 asked the OS for one). Each request then writes one access-log line
to stderr (k3kit.serve.access). A model that fails to load stops the server
and the error reaches the CLI (exit 2).

SIGTERM or SIGINT shuts down in this order, each step after the last:
1. new generation requests are answered 503 `shutting_down` (/health 503 too); the socket stays
   open, so a client is told rather than refused;
2. the running requests finish, for up to --shutdown-timeout seconds (a second signal: no wait);
3. those still running end: a stream with an SSE error event and `data: [DONE]`, a non-streamed
   request with a 503 (k3kit.serve.app.drain);
4. uvicorn stops: the socket closes, idle keep-alive connections are closed;
5. the scheduler is closed (its worker stopped), then its prompt cache, if it has one, is flushed
   (written to disk where it keeps one), said in one line on stderr;
6. the model is closed and the process exits 0 (1 if the prompt cache could not be flushed).
Uvicorn's own signal handling would re-raise the signal once it has stopped (exit code -15 for
SIGTERM); the server here handles the signals itself and does not.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3kit.adapters.session import Session
from k3kit.errors import K3Error
from k3kit.gguf.shards import Model
from k3kit.runtime.protocols import BatchedModel, SnapshotModel
from k3kit.serve.app import DEFAULT_MAX_BODY, ServerState, build_app, drain
from k3kit.serve.batch import BatchScheduler
from k3kit.serve.metrics import metrics_page
from k3kit.serve.prompt_cache import PromptCache, default_interval, identity
from k3kit.serve.scheduler import Scheduler, SchedulerStats
from k3kit.serve.serial import SerialScheduler, StepFactory

log = logging.getLogger("k3kit.serve")

# -> the opened session and, with a draft, the decode step to build per request
Loader = Callable[[], tuple[Session, StepFactory | None]]


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_batch: int = 256            # rows per target pass (serial: the prefill chunk)
    max_sequences: int = 64         # sequences holding state at once (batching only)
    max_queue: int = 64
    ctx: int | None = None          # None: the model's context length
    max_body_bytes: int = DEFAULT_MAX_BODY
    prompt_cache_mib: float = 1024.0         # 0: off (the CLI's default: prompt_cache.default_budget)
    prompt_cache_dir: str | None = None      # spill evicted entries there and keep them across restarts
    prompt_cache_disk_mib: float = 16384.0   # bytes the directory may hold (0: no limit)
    prompt_cache_interval: int | None = None  # tokens between recurrent copies (None: from the state size)
    shutdown_timeout: float = 30.0      # s the running requests get after SIGTERM/SIGINT
    warmup: bool = True                 # one short pass before ready (warm_up)


UVICORN_GRACE = 5     # s uvicorn gives connections after the drain (only responses already ending remain)


def serve_context(model_context: int, requested: int | None) -> int:
    """The context per sequence: `--ctx` when given, else the model's own (the file's declared
    context_length); a `--ctx` beyond the model's is refused."""
    if requested is None:
        return model_context
    if not 1 <= requested <= model_context:
        raise K3Error(f"--ctx {requested}: must be in [1, {model_context}] (the model's context)")
    return requested


WARMUP_ROWS = 16       # rows of the warm-up pass: past the kernels' many-row threshold (AMX from 12)


def warm_up(model: object) -> None:
    """Every routed expert read into the cache if all fit it (a model smaller than its cache: the
    first turns would otherwise read them one miss at a time, +230 ms on the mini's first long
    pass), then one pass of WARMUP_ROWS copies of one token and one decode row on a throwaway
    sequence, before the server says ready: a fresh process's first passes pay one-time costs (kernel and
    allocator first use: +60 ms on the mini's first 311-row pass after a restart) that belong to
    start-up, as llama-server's own warm-up run keeps them off its first request. Copies of one
    token route alike, so a model whose experts stream from disk reads a few experts per layer,
    not a layer's worth."""
    preload = getattr(model, "preload_experts", None)
    if callable(preload):
        preload()              # all experts, when they fit the expert cache: no misses later
    if not isinstance(model, BatchedModel):
        return
    seq = model.open_sequence()
    try:
        model.forward_batch([(seq, [0] * WARMUP_ROWS)])
        model.forward_batch([(seq, [0])])
    finally:
        model.close_sequence(seq)


def preload_prompt_cache(sched: Scheduler) -> None:
    """The newest entries of --prompt-cache-dir into RAM before ready (PromptCache.preload): the
    first turns after a restart then restore as fast as any other."""
    pc = getattr(sched, "prompt_cache", None)
    if not isinstance(pc, PromptCache) or pc.disk is None or not pc.disk.index:
        return
    t0 = time.perf_counter()
    n = pc.preload()
    log.info("prompt cache: %d of %d saved entries read into RAM (%.2fs)", n, len(pc.disk.index),
             time.perf_counter() - t0)


def scheduler_for(session: Session, step: StepFactory | None, config: ServeConfig) -> Scheduler:
    """Continuous batching when the model holds several sequences (with a draft: batched speculative
    verification, see k3kit.serve.batch); the serial worker for a model without that."""
    model = session.model
    if isinstance(model, BatchedModel):
        return BatchScheduler(model, session.codec, loaded=session.target, max_batch=config.max_batch,
                              max_queue=config.max_queue, step_factory=step,
                              max_sequences=config.max_sequences,
                              prompt_cache=prompt_cache_for(session, config))
    return SerialScheduler(model, session.codec, loaded=session.target, step_factory=step,
                           max_queue=config.max_queue, prefill_chunk=config.max_batch)


def prompt_cache_for(session: Session, config: ServeConfig) -> PromptCache | None:
    """The prompt cache `config` asks for (None: off, or a model whose states cannot be copied)."""
    model = session.model
    if config.prompt_cache_mib == 0:
        return None
    if not isinstance(model, SnapshotModel):
        log.info("prompt cache: this model's sequence states cannot be saved; serving without it")
        return None
    budget = int(config.prompt_cache_mib * (1 << 20))
    interval = (config.prompt_cache_interval
                or default_interval(model.recurrent_bytes, model.positional_row_bytes))
    ident = identity(session.target.path, session.draft.path if session.draft is not None else None,
                     getattr(model, "dtype", None), getattr(getattr(model, "options", None), "arith", None))
    cache = PromptCache(budget, interval, directory=config.prompt_cache_dir,
                        disk_budget=int(config.prompt_cache_disk_mib * (1 << 20)), identity=ident)
    where = f", spilling to {config.prompt_cache_dir}" if config.prompt_cache_dir else ""
    disk = f" ({len(cache.disk.index)} entries found there)" if cache.disk is not None else ""
    log.info("prompt cache: %.0f MiB of RAM, a recurrent copy every %d tokens%s%s",
             budget / (1 << 20), interval, where, disk)
    return cache


def model_id(path: str | os.PathLike[str]) -> str:
    """The id clients name the model by: `general.name`, else the file stem (shard suffix dropped)."""
    p = Path(path)
    model = Model.open(p)
    try:
        kv = model.kv.get("general.name")
        name = kv.value if kv is not None else None
    finally:
        model.close()
    if isinstance(name, str) and name.strip():
        return name.strip()
    stem = p.stem
    parts = stem.rsplit("-", 3)
    if len(parts) == 4 and parts[2] == "of" and parts[1].isdigit() and parts[3].isdigit():
        stem = parts[0]
    return stem


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a K3Error naming the address."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise K3Error(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise K3Error(f"{host}:{port}: cannot listen: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def access_line(line: str) -> None:
    """The access log goes to stderr: stdout carries only the ready line, for scripts to read."""
    print(line, file=sys.stderr, flush=True)


def notice(line: str) -> None:
    """The shutdown's lines go to stderr as well."""
    print(line, file=sys.stderr, flush=True)


def draining_server(config: Any, state: ServerState, timeout: float,
                    say: Callable[[str], None] = notice) -> Any:
    """A uvicorn.Server whose SIGTERM/SIGINT drain the app first (k3kit.serve.app.drain), then let
    uvicorn stop. A second signal ends the running requests without waiting out the timeout, a
    third stops uvicorn at once. The signal is not raised again once uvicorn has stopped."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            self.signals = 0
            self.draining: asyncio.Task[None] | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            # a signal handler, on the main thread between two bytecodes: count it, nothing else
            # (uvicorn's own records it to raise again after its shutdown; the exit code is ours)
            self.signals += 1
            if self.signals >= 3:
                self.should_exit = self.force_exit = True

        async def on_tick(self, counter: int) -> bool:
            if self.signals and self.draining is None:
                self.draining = asyncio.get_running_loop().create_task(self._drain())
            return await super().on_tick(counter)

        async def _drain(self) -> None:
            running = len(state.running)
            say(f"k3kit: shutting down: {running} request(s) running, up to {timeout:g}s to finish")
            try:
                ended = await drain(state, timeout, hurry=lambda: self.signals > 1)
                if ended:
                    say(f"k3kit: shutting down: {ended} request(s) still running were ended")
            finally:
                self.should_exit = True

    return DrainingServer(config)


def flush_prompt_cache(scheduler: Scheduler, say: Callable[[str], None] = notice) -> bool:
    """After the scheduler is closed: flush its `prompt_cache` where it has one. False if that failed."""
    cache = getattr(scheduler, "prompt_cache", None)
    if cache is None or getattr(cache, "disk", True) is None:     # none, or RAM only: nothing to keep
        return True
    t0 = time.perf_counter()
    try:
        n = cache.flush()
    except Exception as e:
        say(f"k3kit: prompt cache not flushed: {type(e).__name__}: {e}")
        return False
    written = f", {n} entries written" if isinstance(n, int) else ""
    say(f"k3kit: prompt cache flushed ({time.perf_counter() - t0:.2f}s{written})")
    return True


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(path: str | os.PathLike[str], load: Loader, config: ServeConfig,
          announce: Callable[[str], None] | None = None) -> int:
    """Serve until interrupted. `load` runs on a background thread; returns the exit code."""
    import uvicorn

    if config.max_queue < 0 or config.max_batch < 1 or config.max_sequences < 1:
        raise K3Error("--max-queue must be >= 0, --max-batch and --max-sequences >= 1")
    if not config.shutdown_timeout >= 0:
        raise K3Error(f"--shutdown-timeout {config.shutdown_timeout}: must be >= 0")
    mid = model_id(path)
    sock = bind(config.host, config.port)
    port = sock.getsockname()[1]
    state = ServerState(model_id=mid, api_key=config.api_key, max_body_bytes=config.max_body_bytes)
    holder: dict[str, Any] = {}

    def stats() -> SchedulerStats | None:
        sched = holder.get("scheduler")
        return sched.stats() if sched is not None else None

    state.metrics = metrics_page(stats)
    state.stats = stats            # GET /v1/k3kit/stats reads the same snapshot /metrics renders
    state.access_log = access_line
    uv = draining_server(uvicorn.Config(build_app(state), log_level="warning", access_log=False,
                                        timeout_graceful_shutdown=UVICORN_GRACE, lifespan="off"),
                         state, config.shutdown_timeout)

    def loader() -> None:
        try:
            session, step = load()
            holder["session"] = session
            ctx = serve_context(session.model.context_length, config.ctx)
            if config.warmup:
                warm_up(session.model)
            sched = scheduler_for(session, step, config)
            holder["scheduler"] = sched
            if config.warmup:
                preload_prompt_cache(sched)
            state.ready(sched, session.codec, ctx, draft=getattr(sched, "step_factory", None) is not None)
        except BaseException as e:     # reported by the main thread once uvicorn has stopped
            holder["error"] = e
            uv.should_exit = True
            return
        for _ in range(6000):          # uvicorn is normally up long before the model
            if uv.started or uv.should_exit:
                break
            threading.Event().wait(0.01)
        if uv.started and not (uv.should_exit or state.draining):    # not once a signal came
            line = f"k3kit: serving {mid} on {url(config.host, port)}"
            if announce is not None:
                announce(line)
            else:
                print(line, flush=True)

    thread = threading.Thread(target=loader, name="k3kit-serve-load", daemon=True)
    thread.start()
    flushed = True
    try:
        uv.run(sockets=[sock])
    finally:
        sock.close()
        thread.join(timeout=600)
        sched = holder.get("scheduler")
        if sched is not None:
            sched.close()
            flushed = flush_prompt_cache(sched)
        session = holder.get("session")
        if session is not None:
            session.close()
    err = holder.get("error")
    if err is not None:
        if isinstance(err, (K3Error, OSError)):
            raise err
        raise K3Error(f"{path}: loading failed: {type(err).__name__}: {err}") from err
    sys.stdout.flush()
    return 0 if flushed else 1
