"""The FastAPI application of `k3kit serve`: OpenAI's routes and shapes over a Scheduler.

Routes: POST /v1/chat/completions, POST /v1/completions (both streamed as server-sent events
ending with `data: [DONE]`, or one JSON object), GET /v1/models, GET /health (503 until the
model is loaded), GET /metrics (Prometheus text), POST /tokenize and POST /detokenize
(llama-server's shapes: {"content"} -> {"tokens"}, {"tokens"} -> {"content"}), GET / (the chat
page, k3kit.serve.page), GET /v1/k3kit/stats (the figures /metrics exports, as JSON for the
page: k3kit.serve.stats) and GET /openapi.json. FastAPI's /docs and /redoc are off: they load
their scripts from a CDN, and the server fetches nothing from elsewhere.

Every error is OpenAI's shape {"error": {"message", "type", "param", "code"}} and never takes the
server down: malformed JSON, wrong types and bad values are 400 (FastAPI's 422 is remapped), an
unknown model 404, a missing or wrong API key 401, a prompt that does not fit 400
context_length_exceeded, a schema or grammar llguidance cannot compile 400 naming its field
(k3kit.serve.grammar: structured output), a full queue 429, a body over the limit 413, not loaded
yet 503.

Two pure ASGI layers sit in front of the routes, so they run before any body is parsed: the API
key check (every route but /health and the page's files) and the body size limit (the body is
read up to the limit and replayed to the app); the access log (k3kit.serve.access) wraps both.
The route handlers are `async` and run on the event loop thread, which is the only thread that
tokenizes and renders chat templates (the tokenizer is not thread-safe); the model runs on the
scheduler's thread(s).

A client that disconnects cancels its request: streamed responses are cancelled by Starlette
when the disconnect arrives, non-streamed ones watch for it while they wait.

Shutting down (`drain`, started by k3kit.serve.server on SIGTERM/SIGINT): the generation routes
answer 503 `shutting_down` (and /health 503 {"status": "shutting_down"}) while the requests
already running go on, up to a timeout; those still running then end at once: a stream with an
error event and `data: [DONE]`, a non-streamed request with a 503 error, each cancelled in the
scheduler. The listening socket stays open meanwhile, so a new client is told rather than refused.

A chat response of one choice, once ended, queues its conversation's next start for prefill while
the client is away (k3kit.serve.next_turn).

`usage.prompt_tokens_details.cached_tokens` is the FinishEvent's `cached_tokens` (prompt tokens
the scheduler's prompt cache restored); llama-server's `cache_prompt: false` turns it off for a
request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import suppress
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from k3kit.errors import K3Error
from k3kit.serve.access import AccessLog, record_of
from k3kit.serve.api import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad,
    check_body,
    completion_prompt,
    generation_request,
    output_spec,
    siblings,
)
from k3kit.serve.grammar import request_grammar
from k3kit.serve.next_turn import prefill_next_turn
from k3kit.serve.page import STATIC_PREFIX, Page, is_public
from k3kit.serve.responses import SHUTTING_DOWN, Choices, Reply, collect, token_text
from k3kit.serve.responses import stream as stream_events
from k3kit.serve.scheduler import (
    GenerationRequest,
    QueueFull,
    Scheduler,
    SchedulerClosed,
    SchedulerStats,
)
from k3kit.serve.stats import History, stats_body
from k3kit.serve.tool_parsers import ChatOutput, output_parser
from k3kit.serve.tools import chat_inputs
from k3kit.tokenizer.codec import TextCodec

PUBLIC_PATHS = frozenset({"/health"})
DEFAULT_MAX_BODY = 8 << 20
DRAIN_POLL = 0.05            # s between two looks at the running requests while draining
ABORT_GRACE = 5.0            # s the ended responses get to go out (a client that stopped reading)


@dataclass
class ServerState:
    """What the routes read. `scheduler`/`codec` are None while the model loads (503)."""

    model_id: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    context_length: int = 0
    scheduler: Scheduler | None = None
    codec: TextCodec | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Callable[[], tuple[bytes, str]] | None = None     # -> (body, content type)
    # the snapshot /metrics renders (None: the scheduler's own stats()); GET /v1/k3kit/stats reads it too
    stats: Callable[[], SchedulerStats | None] | None = None
    draft: bool = False                   # the scheduler may speculate (the page offers DSpark on/off)
    access_log: Callable[[str], None] | None = None           # one line per request (None: no log)
    history: History = field(default_factory=History)
    draining: bool = False                # shutting down: the generation routes answer 503
    running: set[str] = field(default_factory=set)            # ids of generation responses not ended yet
    abort: asyncio.Event = field(default_factory=asyncio.Event)   # set: end every running response now
    tasks: set[asyncio.Task[None]] = field(default_factory=set)   # work queued after responses (spawn)

    def ready(self, scheduler: Scheduler, codec: TextCodec, context_length: int, draft: bool = False) -> None:
        """Called once the model is loaded (from any thread): the routes start serving."""
        self.codec, self.context_length, self.draft = codec, context_length, draft
        self.scheduler = scheduler

    def spawn(self, work: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        """Run `work(*args)` on the event loop, after the response in hand (its task kept until done)."""
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(work(*args))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def snapshot(self) -> SchedulerStats | None:
        if self.stats is not None:
            return self.stats()
        return self.scheduler.stats() if self.scheduler is not None else None

    @property
    def loaded(self) -> bool:
        return self.scheduler is not None


async def drain(state: ServerState, timeout: float, hurry: Callable[[], bool] = lambda: False) -> int:
    """Stop taking generation requests, let the running ones finish for up to `timeout` seconds (or
    until `hurry()` says not to wait any longer), then end those left (an error event and [DONE],
    or a 503) and wait until their responses are over. Returns how many had to be ended. Runs on
    the server's event loop."""
    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, timeout)
    while state.running and loop.time() < deadline and not hurry():
        await asyncio.sleep(min(DRAIN_POLL, max(0.0, deadline - loop.time())))
    ended = len(state.running)
    if ended:
        state.abort.set()
        deadline = loop.time() + ABORT_GRACE
        while state.running and loop.time() < deadline:   # each ends at its next await
            await asyncio.sleep(0.01)
    return ended


class _Streamed(StreamingResponse):
    """A streamed response that runs `ended` however it ends: sent, client gone, or never started
    (the body generator's own `finally` does not run when it was never iterated)."""

    def __init__(self, body: AsyncIterator[bytes], ended: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(body, **kw)
        self._ended = ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._ended()


def error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _send_error(send: Send, e: APIError) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if e.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Gate:
    """ASGI middleware: the API key, then the body size limit, before anything parses the body."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key = self.state.api_key
        path = str(scope.get("path", ""))
        if key is not None and path not in PUBLIC_PATHS and not is_public(path):
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                what = "no API key given" if not given else "the API key is not valid"
                await _send_error(send, APIError(401, f"{what} (send Authorization: Bearer KEY)",
                                                 code="invalid_api_key"))
                return
        limit = self.state.max_body_bytes
        too_large = APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
        declared = headers.get("content-length")
        if declared is not None:
            try:
                if int(declared) > limit:
                    await _send_error(send, too_large)
                    return
            except ValueError:
                await _send_error(send, bad("invalid Content-Length header"))
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":     # the client left before sending its body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_error(send, too_large)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()        # after the body: waits for http.disconnect

        await self.app(scope, replay, send)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})   # pydantic's union branch names


def _param(loc: tuple[Any, ...]) -> str | None:
    """A pydantic error location as OpenAI names a parameter: messages[0].content."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and p.isidentifier() and p not in _TYPE_TAGS:
            out += f".{p}" if out else p
        else:
            break
    return out or None


def validation_error(e: RequestValidationError) -> APIError:
    errors = list(e.errors())
    if not errors:
        return bad("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return bad(f"the body is not valid JSON: {ctx.get('error', first.get('msg'))}", code="invalid_json")
    param = _param(tuple(first.get("loc", ())))
    if first.get("type") == "missing":
        return bad(f"{param or 'a field'} is required", param, "missing_required_parameter")
    if param is None:
        return bad(f"the body must be a JSON object: {first.get('msg')}", code="invalid_type")
    return bad(f"{param}: {first.get('msg')}", param, "invalid_type")


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Wait for the client to go away (after its body was read, receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


def build_app(state: ServerState) -> ASGIApp:
    """The routes behind the Gate (API key, body limit); serve it with uvicorn."""
    app = FastAPI(title="k3kit", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    page = Page(auth_required=state.api_key is not None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        path = request.url.path
        msg = {404: f"no route {path}",
               405: f"{request.method} is not allowed on {path}"}.get(e.status_code, str(e.detail))
        return error_response(APIError(e.status_code, msg, type=kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    def loaded() -> tuple[Scheduler, TextCodec]:
        if state.scheduler is None or state.codec is None:
            raise APIError(503, "the model is still loading", type="unavailable_error", code="model_loading")
        return state.scheduler, state.codec

    def accepting() -> tuple[Scheduler, TextCodec]:
        """The scheduler and codec for a new generation request (503 while loading or shutting down)."""
        if state.draining:
            raise APIError(503, SHUTTING_DOWN, type="unavailable_error", code="shutting_down")
        return loaded()

    def check_model(model: str | None) -> None:
        if model is not None and model != state.model_id:
            raise APIError(404, f"the model {model!r} does not exist (this server serves {state.model_id!r})",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if not state.loaded:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                            "owned_by": "k3kit"}]}

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return page.response("index.html")

    @app.get(STATIC_PREFIX + "{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        return page.response(name)

    @app.get("/v1/k3kit/stats")
    async def live_stats() -> JSONResponse:
        snapshot = state.snapshot() if state.loaded else None
        return JSONResponse(stats_body(snapshot, state.history, model_id=state.model_id, draft=state.draft))

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            return Response(b"", media_type="text/plain")
        body, ctype = state.metrics()
        return Response(body, headers={"Content-Type": ctype})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        _, codec = loaded()
        ids = codec.encode(body.content, add_bos=body.add_special)
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": token_text(codec, t)} for t in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        _, codec = loaded()
        if any(not 0 <= t < codec.n_vocab for t in body.tokens):
            raise bad(f"token ids must be in [0, {codec.n_vocab})", "tokens")
        return {"content": codec.decode_bytes(body.tokens).decode("utf-8", errors="replace")}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        scheduler, codec = accepting()
        check_model(body.model)
        check_body(body)
        inputs = chat_inputs(body, codec.chat.source)
        try:
            text = codec.chat.render(inputs.messages, add_generation_prompt=True, tools=inputs.tools,
                                     **inputs.variables)
        except K3Error as e:
            raise bad(str(e), "messages") from None
        gen = generation_request(body, codec.encode(text), state.context_length, codec.n_vocab,
                                 codec.stop_ids())
        parser = output_parser(inputs.format, text, tools=inputs.tools, call_offset=inputs.call_offset)
        outputs: list[ChatOutput | None] | None = None
        if parser is not None:
            gen = replace(gen, shown=codec.control_ids(parser.markers))
            more = (output_parser(inputs.format, text, tools=inputs.tools, call_offset=inputs.call_offset)
                    for _ in range(1, body.n or 1))
            outputs = [ChatOutput(parser), *(ChatOutput(p) for p in more if p is not None)]
        grammar = await request_grammar(codec, output_spec(body), chat=inputs, prompt=text,
                                        parallel_tool_calls=body.parallel_tool_calls)
        if grammar is not None:
            gen = replace(gen, grammar=grammar)
        after = None
        if outputs is not None and len(outputs) == 1 and outputs[0] is not None and gen.cache_prompt:
            after = partial(state.spawn, prefill_next_turn, scheduler, codec, body, gen, outputs[0])
        return await respond(scheduler, codec, siblings(gen, body.n or 1), request, chat=True,
                             stream=bool(body.stream),
                             include_usage=bool(body.stream_options and body.stream_options.include_usage),
                             outputs=outputs, token_ids=bool(body.return_token_ids), after=after)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        scheduler, codec = accepting()
        check_model(body.model)
        check_body(body)
        prompt = completion_prompt(body)
        if isinstance(prompt, str):
            ids = codec.encode(prompt)
        else:
            if any(not 0 <= t < codec.n_vocab for t in prompt):
                raise bad(f"prompt token ids must be in [0, {codec.n_vocab})", "prompt")
            ids = prompt
        gen = generation_request(body, ids, state.context_length, codec.n_vocab, codec.stop_ids())
        grammar = await request_grammar(codec, output_spec(body))
        if grammar is not None:
            gen = replace(gen, grammar=grammar)
        return await respond(scheduler, codec, siblings(gen, body.n or 1), request, chat=False,
                             stream=bool(body.stream),
                             include_usage=bool(body.stream_options and body.stream_options.include_usage),
                             token_ids=bool(body.return_token_ids))

    async def respond(scheduler: Scheduler, codec: TextCodec, gens: list[GenerationRequest],
                      request: Request, *,
                      chat: bool, stream: bool, include_usage: bool,
                      outputs: list[ChatOutput | None] | None = None, token_ids: bool = False,
                      after: Callable[[], None] | None = None) -> Response:
        """Submit the request's choices together (all or none: a full queue is a 429 for all) and
        answer with their merged events (k3kit.serve.responses); `after` is called when every choice
        ended as the model ended it (k3kit.serve.next_turn)."""
        if len(gens) > 1 and gens[0].cache_prompt and scheduler.stats().prompt_cache:
            gens = [replace(gens[0], share_prompt=True), *gens[1:]]      # the others wait for its prompt
        choices = Choices(scheduler, gens)
        try:
            choices.submit(1 if gens[0].share_prompt else len(gens))
        except (QueueFull, SchedulerClosed) as e:
            await choices.close()
            if isinstance(e, QueueFull):
                raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
            raise APIError(503, str(e), type="unavailable_error", code="shutting_down") from None
        ids = [g.id for g in gens]
        state.running.update(ids)

        async def ended() -> None:
            state.running.difference_update(ids)
            await choices.close()        # not finished: the scheduler drops the sequence

        rid = ("chatcmpl-" if chat else "cmpl-") + gens[0].id
        rec = record_of(request.scope)
        if rec is not None:
            rec.request_id = rid
        reply = Reply(codec, rid, int(time.time()), state.model_id, chat, include_usage, rec,
                      outputs or [None] * len(gens), state.abort, token_ids, after)
        if stream:
            return _Streamed(stream_events(choices, reply), ended, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(_watch_disconnect(request, choices.cancel))
        try:
            body = await collect(choices, reply)
        finally:
            watcher.cancel()
            with suppress(asyncio.CancelledError):
                await watcher
            await ended()
        return JSONResponse(body)

    gate = Gate(app, state)
    return AccessLog(gate, state.access_log) if state.access_log is not None else gate
