"""Run `k3kit serve`: bind, start uvicorn, load the model meanwhile, announce, shut down cleanly.

The socket is bound first, so a busy port is an immediate one-line error. Uvicorn then serves
at once (GET /health answers 503 while the model loads) and the model is loaded on a thread;
when both are ready, exactly one line goes to stdout: `k3kit: serving MODEL_ID on http://HOST:PORT`
(the real port when --port 0 asked the OS for one). Each request then writes one access-log line
to stderr (k3kit.serve.access). A model that fails to load stops the server
and the error reaches the CLI (exit 2). On SIGINT/SIGTERM uvicorn stops accepting, open streams
get a few seconds, then the scheduler cancels what is left and the model is closed.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3kit.adapters.session import Session
from k3kit.errors import K3Error
from k3kit.gguf.shards import Model
from k3kit.runtime.protocols import BatchedModel
from k3kit.serve.app import DEFAULT_MAX_BODY, ServerState, build_app
from k3kit.serve.batch import BatchScheduler
from k3kit.serve.metrics import metrics_page
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
    graceful_seconds: float = 5.0


def serve_context(model_context: int, requested: int | None) -> int:
    """The context per sequence: `--ctx` when given, else the model's own (the file's declared
    context_length); a `--ctx` beyond the model's is refused."""
    if requested is None:
        return model_context
    if not 1 <= requested <= model_context:
        raise K3Error(f"--ctx {requested}: must be in [1, {model_context}] (the model's context)")
    return requested


def scheduler_for(session: Session, step: StepFactory | None, config: ServeConfig) -> Scheduler:
    """Continuous batching when the model holds several sequences (with a draft: batched speculative
    verification, see k3kit.serve.batch); the serial worker for a model without that."""
    model = session.model
    if isinstance(model, BatchedModel):
        return BatchScheduler(model, session.codec, loaded=session.target, max_batch=config.max_batch,
                              max_queue=config.max_queue, step_factory=step,
                              max_sequences=config.max_sequences)
    return SerialScheduler(model, session.codec, loaded=session.target, step_factory=step,
                           max_queue=config.max_queue, prefill_chunk=config.max_batch)


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


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(path: str | os.PathLike[str], load: Loader, config: ServeConfig,
          announce: Callable[[str], None] | None = None) -> int:
    """Serve until interrupted. `load` runs on a background thread; returns the exit code."""
    import uvicorn

    if config.max_queue < 0 or config.max_batch < 1 or config.max_sequences < 1:
        raise K3Error("--max-queue must be >= 0, --max-batch and --max-sequences >= 1")
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
    uv = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", access_log=False,
                                       timeout_graceful_shutdown=max(1, int(config.graceful_seconds)),
                                       lifespan="off"))

    def loader() -> None:
        try:
            session, step = load()
            holder["session"] = session
            ctx = serve_context(session.model.context_length, config.ctx)
            sched = scheduler_for(session, step, config)
            holder["scheduler"] = sched
            state.ready(sched, session.codec, ctx, draft=getattr(sched, "step_factory", None) is not None)
        except BaseException as e:     # reported by the main thread once uvicorn has stopped
            holder["error"] = e
            uv.should_exit = True
            return
        for _ in range(6000):          # uvicorn is normally up long before the model
            if uv.started or uv.should_exit:
                break
            threading.Event().wait(0.01)
        if uv.started:
            line = f"k3kit: serving {mid} on {url(config.host, port)}"
            if announce is not None:
                announce(line)
            else:
                print(line, flush=True)

    thread = threading.Thread(target=loader, name="k3kit-serve-load", daemon=True)
    thread.start()
    try:
        uv.run(sockets=[sock])
    finally:
        sock.close()
        thread.join(timeout=600)
        sched = holder.get("scheduler")
        if sched is not None:
            sched.close()
        session = holder.get("session")
        if session is not None:
            session.close()
    err = holder.get("error")
    if err is not None:
        if isinstance(err, (K3Error, OSError)):
            raise err
        raise K3Error(f"{path}: loading failed: {type(err).__name__}: {err}") from err
    sys.stdout.flush()
    return 0
