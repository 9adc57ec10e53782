"""OpenAI's response bodies for one generation request of `n` choices, from their schedulers' events.

A request with `n` > 1 is `n` sibling GenerationRequests (k3kit.serve.api.siblings: the same
prompt, choice i drawing with seed + i). Where the scheduler keeps a prompt cache, the first is
submitted alone with `share_prompt` (its state goes into the cache as soon as its prompt is
prefilled) and the others when its first token comes: they restore the whole prompt from the
cache, so the prompt runs once; without a cache they are submitted together. Either way the
batching scheduler runs them in the same passes; their events are merged here in arrival order
and each goes out under its choice's `index`. Usage counts the prompt once and the completion
tokens of every choice, as OpenAI bills `n`. A streamed response opens every choice with its role
delta, ends each with its own finish_reason, and sends `[DONE]` once all have ended; an error in
any choice ends the whole response (an error event, then `[DONE]`), as one failed generation
would.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from k3kit.serve.access import AccessRecord, TokenClock
from k3kit.serve.api import APIError
from k3kit.serve.scheduler import Event as SchedulerEvent
from k3kit.serve.scheduler import (
    FinishEvent,
    GenerationRequest,
    QueueFull,
    RequestStream,
    Scheduler,
    SchedulerClosed,
    TokenEvent,
    TokenLogprob,
)
from k3kit.serve.tool_parsers import ChatOutput
from k3kit.tokenizer.codec import TextCodec

SHUTTING_DOWN = "the server is shutting down"


class Choices:
    """The sibling requests of one response and the event streams of those submitted so far."""

    def __init__(self, scheduler: Scheduler, gens: list[GenerationRequest]) -> None:
        self.scheduler, self.gens = scheduler, gens
        self.streams: list[RequestStream] = []

    @property
    def waiting(self) -> bool:
        """Whether the later choices wait for the first's prompt (submitted by `submit_rest`)."""
        return len(self.streams) < len(self.gens)

    def submit(self, upto: int) -> None:
        """Submit choices up to `upto` (QueueFull / SchedulerClosed as the scheduler raises them)."""
        for gen in self.gens[len(self.streams):upto]:
            self.streams.append(self.scheduler.submit(gen))

    def submit_rest(self) -> None:
        try:
            self.submit(len(self.gens))
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except SchedulerClosed as e:
            raise APIError(503, str(e), type="unavailable_error", code="shutting_down") from None

    def cancel(self) -> None:
        for gen in self.gens:
            self.scheduler.cancel(gen.id)

    async def close(self) -> None:
        """Close every stream: a request not finished is dropped by the scheduler."""
        for s in self.streams:
            await s.aclose()


def timings(clock: TokenClock, finishes: list[FinishEvent]) -> dict[str, Any]:
    """llama-server's `timings` object from the server's clock: prompt tokens run and the time to
    the first token, tokens generated and the time from the first to the last, and their rates."""
    prompt = finishes[0].prompt_tokens - finishes[0].cached_tokens
    n = sum(f.completion_tokens for f in finishes)
    first, last = clock.first, clock.last
    prompt_ms = (first - clock.start) * 1e3 if first is not None else None
    predicted_ms = (last - first) * 1e3 if first is not None and last is not None else None
    return {"cache_n": finishes[0].cached_tokens, "prompt_n": prompt, "prompt_ms": prompt_ms,
            "prompt_per_second": prompt / prompt_ms * 1e3 if prompt_ms else None,
            "predicted_n": n, "predicted_ms": predicted_ms,
            "predicted_per_second": (n - 1) / predicted_ms * 1e3 if predicted_ms and n > 1 else None}


@dataclass
class Reply:
    """What the body of one response needs besides its choices' events."""

    codec: TextCodec
    rid: str
    created: int
    model_id: str
    chat: bool
    include_usage: bool
    rec: AccessRecord | None
    outputs: list[ChatOutput | None]     # one per choice (a chat format's parser, or None: plain text)
    abort: asyncio.Event                  # set: the shutdown timeout ran out, end now
    token_ids: bool = False               # vLLM's return_token_ids: the prompt's and the output's ids
    done: Callable[[], None] | None = None   # called once every choice ended as the model ended it
    # the generated tokens' times: the access record's clock where there is one
    clock: TokenClock = field(default_factory=lambda: TokenClock(time.perf_counter()))

    def __post_init__(self) -> None:
        if self.rec is not None:
            self.clock = self.rec.clock

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


async def until(events: RequestStream, abort: asyncio.Event) -> AsyncGenerator[SchedulerEvent | None, None]:
    """The stream's events up to its FinishEvent; one None, then the end, if `abort` is set first."""
    stop = asyncio.ensure_future(abort.wait())
    nxt: asyncio.Future[SchedulerEvent] | None = None
    try:
        while not abort.is_set():
            nxt = asyncio.ensure_future(events.__anext__())
            await asyncio.wait((nxt, stop), return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                continue               # abort is set
            try:
                ev = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield ev
            if isinstance(ev, FinishEvent):
                return
        yield None
    finally:
        for task in (stop, nxt):
            if task is not None and not task.done():
                task.cancel()


class _Ended:
    """A pump's last item: its stream is over (`error`: it failed)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


async def merged(choices: Choices,
                 abort: asyncio.Event) -> AsyncGenerator[tuple[int, SchedulerEvent | None], None]:
    """(choice index, event) of every choice as they arrive; (i, None) where `abort` cut choice i.
    Submits the waiting choices once the first choice's first event is a token."""
    if len(choices.gens) == 1:          # one choice: no task, no queue
        async with aclosing(until(choices.streams[0], abort)) as one:
            async for ev in one:
                yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, SchedulerEvent | None | _Ended]] = asyncio.Queue()
    tasks: list[asyncio.Task[None]] = []

    async def pump(i: int, stream: RequestStream) -> None:
        ended = _Ended()
        try:
            async with aclosing(until(stream, abort)) as evs:
                async for ev in evs:
                    if i == 0 and choices.waiting and ev is not None and (
                            isinstance(ev, TokenEvent) or ev.reason not in ("error", "cancelled")):
                        start(len(tasks))
                    await queue.put((i, ev))
        except Exception as e:     # handed to the consumer, which raises it
            ended = _Ended(e)
        finally:
            queue.put_nowait((i, ended))

    def start(first: int) -> None:
        choices.submit_rest()
        for i in range(first, len(choices.streams)):
            tasks.append(asyncio.create_task(pump(i, choices.streams[i])))

    if choices.waiting:
        tasks.append(asyncio.create_task(pump(0, choices.streams[0])))
    else:
        start(0)
    ended = 0
    try:
        while ended < len(tasks):
            i, item = await queue.get()
            if isinstance(item, _Ended):
                ended += 1
                if item.error is not None:
                    raise item.error
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def token_text(codec: TextCodec, token: int) -> str:
    return codec.token_bytes[token].decode("utf-8", errors="replace")


def chat_logprobs(codec: TextCodec, lps: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
    def entry(t: int, lp: float) -> dict[str, Any]:
        return {"token": token_text(codec, t), "logprob": lp, "bytes": list(codec.token_bytes[t])}
    return [entry(x.token, x.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in x.top]} for x in lps]


def legacy_logprobs(codec: TextCodec, lps: tuple[TokenLogprob, ...], offset: int) -> dict[str, Any]:
    tokens = [token_text(codec, x.token) for x in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{token_text(codec, t): lp for t, lp in x.top} for x in lps],
            "text_offset": offsets}


def usage(finishes: list[FinishEvent]) -> dict[str, Any]:
    """OpenAI's usage object: the prompt once, every choice's completion tokens;
    `prompt_tokens_details.cached_tokens` (the first choice's) as OpenAI and vLLM report it."""
    prompt, completion = finishes[0].prompt_tokens, sum(f.completion_tokens for f in finishes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": finishes[0].cached_tokens}}


def cut_short() -> APIError:
    """What a request still running when the shutdown timeout ran out is answered."""
    return APIError(503, f"{SHUTTING_DOWN}: the request was still running when the shutdown timeout "
                    "ran out", type="unavailable_error", code="shutting_down")


def finish_reason(f: FinishEvent) -> str:
    return "length" if f.reason == "length" else "stop"


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def _failed(f: FinishEvent) -> APIError | None:
    if f.reason == "error":
        return APIError(500, f"generation failed: {f.error}", type="server_error")
    if f.reason == "cancelled":     # nobody is listening any more (or the server is closing)
        return APIError(503, "the request was cancelled", type="unavailable_error", code="cancelled")
    return None


def _logged(rec: AccessRecord | None, finishes: list[FinishEvent]) -> None:
    if rec is not None:
        worst = next((f for f in finishes if f.reason in ("error", "cancelled")), finishes[0])
        rec.finished(worst.reason, finishes[0].prompt_tokens, sum(f.completion_tokens for f in finishes),
                     finishes[0].cached_tokens)


async def collect(choices: Choices, reply: Reply) -> dict[str, Any]:
    """The non-streamed body: every choice's text (or message), finish reason and logprobs."""
    n = len(choices.gens)
    prompt_tokens = len(choices.gens[0].prompt_ids)
    texts: list[list[str]] = [[] for _ in range(n)]
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    finishes: list[FinishEvent | None] = [None] * n
    generated = 0
    async with aclosing(merged(choices, reply.abort)) as events:
        async for i, ev in events:
            if ev is None:           # the shutdown timeout ran out first
                if reply.rec is not None:
                    reply.rec.finished("shutdown", prompt_tokens, generated)
                raise cut_short()
            if isinstance(ev, TokenEvent):
                texts[i].append(ev.text)
                ids[i].extend(ev.tokens)
                lps[i].extend(ev.logprobs or ())
                generated += len(ev.tokens)
                if ev.tokens:
                    reply.clock.token()
            else:
                finishes[i] = ev
    done = [f for f in finishes if f is not None]
    _logged(reply.rec, done)
    for f in done:
        err = _failed(f)
        if err is not None:
            raise err
    assert len(done) == n
    bodies = []
    for i, f in enumerate(done):
        content = "".join(texts[i])
        logprobs: Any = None
        if choices.gens[i].logprobs is not None:
            logprobs = ({"content": chat_logprobs(reply.codec, tuple(lps[i]))} if reply.chat
                        else legacy_logprobs(reply.codec, tuple(lps[i]), 0))
        reason = finish_reason(f)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        output = reply.outputs[i]
        if output is not None:
            output.feed(content)
            output.finish()
            message, reason = output.message(), output.finish_reason(reason)
        choice: dict[str, Any] = {"index": i, "logprobs": logprobs, "finish_reason": reason}
        if reply.chat:
            choice["message"] = message
        else:
            choice["text"] = content
        if reply.token_ids:
            choice["token_ids"] = ids[i]
            if not reply.chat:
                choice["prompt_token_ids"] = list(choices.gens[i].prompt_ids)
        bodies.append(choice)
    body = {"id": reply.rid, "object": reply.object, "created": reply.created, "model": reply.model_id,
            "choices": bodies, "usage": usage(done), "timings": timings(reply.clock, done)}
    if reply.done is not None:
        reply.done()
    if reply.token_ids and reply.chat:
        body["prompt_token_ids"] = list(choices.gens[0].prompt_ids)
    return body


async def stream(choices: Choices, reply: Reply) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed response, `data: [DONE]` last."""
    obj = reply.object + (".chunk" if reply.chat else "")
    n = len(choices.gens)
    offsets = [0] * n
    finishes: list[FinishEvent | None] = [None] * n
    seen = 0             # tokens streamed, for the access log of a stream the client left
    prompt_tokens = len(choices.gens[0].prompt_ids)
    pending: list[list[int]] = [[] for _ in range(n)]     # ids not yet sent (return_token_ids)
    opened = [False] * n                                   # the choice's first chunk went out

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        c: dict[str, Any] = {"id": reply.rid, "object": obj, "created": reply.created,
                             "model": reply.model_id, "choices": [choice]}
        if reply.token_ids:        # vLLM's shape: the prompt's ids in the first chunk, then each chunk's own
            i = choice["index"]
            choice["token_ids"], pending[i] = pending[i], []
            if not opened[i]:
                prompt = list(choices.gens[i].prompt_ids)
                if reply.chat:
                    c["prompt_token_ids"] = prompt
                else:
                    choice["prompt_token_ids"] = prompt
        opened[choice["index"]] = True
        if reply.include_usage:
            c["usage"] = None
        return c

    try:
        if reply.chat:
            for i in range(n):
                yield sse(chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}))
        async with aclosing(merged(choices, reply.abort)) as events:
            async for i, ev in events:
                if ev is None:           # the shutdown timeout ran out first: say so, then [DONE]
                    if reply.rec is not None:
                        reply.rec.finished("shutdown", prompt_tokens, seen)
                    yield sse(cut_short().body())
                    break
                if isinstance(ev, TokenEvent):
                    if ev.tokens:
                        reply.clock.token()
                    seen += len(ev.tokens)
                    pending[i].extend(ev.tokens)
                    ids_due = reply.token_ids and bool(ev.tokens)    # asked-for ids go out with their token
                    if not ev.text and not ev.logprobs and not ids_due:
                        continue
                    logprobs: Any = None
                    if ev.logprobs:
                        logprobs = ({"content": chat_logprobs(reply.codec, ev.logprobs)} if reply.chat
                                    else legacy_logprobs(reply.codec, ev.logprobs, offsets[i]))
                    offsets[i] += len(ev.text)
                    body: dict[str, Any] = ({"delta": {"content": ev.text}} if reply.chat
                                            else {"text": ev.text})
                    output = reply.outputs[i]
                    if output is not None:
                        delta = output.feed(ev.text)
                        if delta is None and logprobs is None and not ids_due:
                            continue
                        body = {"delta": delta or {"content": ""}}
                    yield sse(chunk({"index": i, **body, "logprobs": logprobs, "finish_reason": None}))
                    continue
                finishes[i] = ev
                err = _failed(ev)
                if err is not None:
                    _logged(reply.rec, [ev])
                    yield sse(err.body())
                    break
                end: dict[str, Any] = {"delta": {}} if reply.chat else {"text": ""}
                reason = finish_reason(ev)
                output = reply.outputs[i]
                if output is not None:
                    last = output.finish()
                    if last is not None:
                        yield sse(chunk({"index": i, "delta": last, "logprobs": None, "finish_reason": None}))
                    reason = output.finish_reason(reason)
                yield sse(chunk({"index": i, **end, "logprobs": None, "finish_reason": reason}))
                done = [f for f in finishes if f is not None]
                if len(done) < n:
                    continue
                _logged(reply.rec, done)
                if reply.done is not None:
                    reply.done()
                if reply.include_usage:
                    yield sse({"id": reply.rid, "object": obj, "created": reply.created,
                               "model": reply.model_id, "choices": [], "usage": usage(done),
                               "timings": timings(reply.clock, done)})
        yield sse("[DONE]")
    except APIError as e:          # a later choice refused (queue full, shutting down)
        yield sse(e.body())
        yield sse("[DONE]")
    finally:
        if reply.rec is not None and reply.rec.finish_reason is None:     # the client went away first
            reply.rec.finished("cancelled", prompt_tokens, seen)
        await choices.close()      # a client that went away: the scheduler drops the sequence
