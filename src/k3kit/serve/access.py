"""One access-log line per HTTP request of `k3kit serve`, written when its response has ended.

`AccessLog` is the outermost ASGI layer, so requests refused before any route (a wrong API key,
a body over the limit) are logged as well. It puts an `AccessRecord` into the request's scope;
the generation routes fill in what only they know (the completion id, token counts, the time of
the first token, the finish reason), and the line is written once the last body byte went out
(a stream's `[DONE]`) or the client left. Example:

    k3kit: 127.0.0.1 "POST /v1/chat/completions" 200 chatcmpl-req-7 prompt=23 cached=16 completion=64
           ttft=0.081s 35.2tok/s finish=stop 1.930s

(one line): the request id, prompt tokens, of which `cached` came from the prompt cache, tokens
generated, the time to the first token, the decode speed the client saw and the finish reason
(stop, length, cancelled, error, or shutdown: ended by the server's shutdown timeout). Fields
that do not apply are left out; the request id is "-" outside generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SCOPE_KEY = "k3kit.access"


@dataclass
class TokenClock:
    """When a request began and its first and last generated tokens reached the route: the
    server's own decode timing (a client's clock sees the stream through its network and
    buffers, and a fast local reply arrives in bursts too short to time)."""

    start: float
    first: float | None = None
    last: float | None = None

    def token(self) -> None:
        """A generated token (or several) reached the route."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now


@dataclass
class AccessRecord:
    """What one request's log line says; the routes fill the generation fields."""

    method: str
    path: str
    client: str = "-"
    start: float = field(default_factory=time.perf_counter)
    status: int = 0
    request_id: str = "-"
    prompt_tokens: int | None = None
    cached_tokens: int = 0               # of the prompt tokens, restored from the prompt cache
    completion_tokens: int | None = None
    finish_reason: str | None = None
    clock: TokenClock = field(init=False)     # the generated tokens' times (the routes tick it)

    def __post_init__(self) -> None:
        self.clock = TokenClock(self.start)

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int,
                 cached_tokens: int = 0) -> None:
        self.finish_reason = reason
        self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens
        self.cached_tokens = cached_tokens

    @property
    def ttft(self) -> float | None:
        return None if self.clock.first is None else self.clock.first - self.start

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first over the time they took (what the client saw streaming)."""
        n = self.completion_tokens
        first, last = self.clock.first, self.clock.last
        if n is None or n < 2 or first is None or last is None:
            return None
        dt = last - first
        return (n - 1) / dt if dt > 0 else None

    def line(self, now: float | None = None) -> str:
        elapsed = (time.perf_counter() if now is None else now) - self.start
        parts = [f'k3kit: {self.client} "{self.method} {self.path}" {self.status or "-"} {self.request_id}']
        if self.prompt_tokens is not None:
            parts.append(f"prompt={self.prompt_tokens} cached={self.cached_tokens} "
                         f"completion={self.completion_tokens}")
        if self.ttft is not None:
            parts.append(f"ttft={self.ttft:.3f}s")
        if self.decode_tok_s is not None:
            parts.append(f"{self.decode_tok_s:.1f}tok/s")
        if self.finish_reason is not None:
            parts.append(f"finish={self.finish_reason}")
        parts.append(f"{elapsed:.3f}s")
        return " ".join(parts)


def record_of(scope: Scope) -> AccessRecord | None:
    """The request's record (None when the app runs without AccessLog, as in-process tests do)."""
    rec = scope.get(SCOPE_KEY)
    return rec if isinstance(rec, AccessRecord) else None


class AccessLog:
    """ASGI middleware: `emit(line)` once per HTTP request, after its response ended."""

    def __init__(self, app: ASGIApp, emit: Callable[[str], None]) -> None:
        self.app, self.emit = app, emit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client: Any = scope.get("client")
        rec = AccessRecord(method=str(scope.get("method", "-")), path=str(scope.get("path", "-")),
                           client=str(client[0]) if client else "-")
        scope[SCOPE_KEY] = rec
        done = False

        async def logged_send(message: Message) -> None:
            nonlocal done
            if message["type"] == "http.response.start":
                rec.status = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not done:
                done = True
                self.emit(rec.line())

        try:
            await self.app(scope, receive, logged_send)
        finally:
            if not done:          # the client left mid-response, or the app raised
                done = True
                self.emit(rec.line() + " (incomplete)")
