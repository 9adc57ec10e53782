"""The contract between the HTTP side of `k3kit serve` and whatever runs the model.

The app turns a request body into a `GenerationRequest` (prompt ids, sampling, limits) and hands
it to a `Scheduler`. `submit` answers at once: either a `RequestStream` (an async iterator of
`TokenEvent`s ending with exactly one `FinishEvent`) or `QueueFull` (HTTP 429), so the client is
told before any response byte is sent. A client that goes away calls `cancel` (or closes the
stream); the scheduler stops that sequence at its next pass and frees its state. `stats()` is a
consistent snapshot for /metrics and the tests (active sequences, queue depth, token counters).

The events carry token ids and logits-derived figures only as far as the sequence layer
(k3kit.serve.sequence) made them; text is already cut at stop strings and held back while it
could still become one, so every scheduler streams exactly the same text.

Phase 1's scheduler is k3kit.serve.serial.SerialScheduler (one request at a time); phase 2's
batching scheduler implements the same protocol and nothing above this module changes.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Protocol

from k3kit.runtime.constraint import Grammar
from k3kit.runtime.sampling import Sampler, Sampling

_ids = itertools.count(1)


def next_request_id(prefix: str = "req") -> str:
    """Unique within this process; the OpenAI ids (chatcmpl-..., cmpl-...) are built from it."""
    return f"{prefix}-{next(_ids)}"


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate: what the model needs, already validated by the API layer."""

    prompt_ids: tuple[int, ...]
    max_tokens: int                       # >= 1; prompt + max_tokens fits the context (checked)
    sampling: Sampling                    # temperature 0 = greedy; the seed fixes every draw
    stop: tuple[str, ...] = ()            # stop strings (the file's eos / end-of-turn always stop)
    logprobs: int | None = None           # None: none; k >= 0: the chosen token's + the k best
    id: str = field(default_factory=next_request_id)
    draft: bool = True                    # False: never speculate, even where the server has a draft
    cache_prompt: bool = True             # False: neither reuse nor keep this prompt's state (prompt cache)
    shown: frozenset[int] = frozenset()   # control tokens decoded as their text (a chat format's markers)
    grammar: Grammar | None = None        # the output must follow it (k3kit.runtime.constraint)
    share_prompt: bool = False            # put the prompt's state in the prompt cache once prefilled (n > 1)
    ahead: bool = False                   # prefill only, into the prompt cache: no token (prefill_ahead)

    def sampler(self) -> Sampler:
        """A fresh Sampler for this request: its sampling, its prompt (penalties) and, with a
        grammar, a new Constraint on it."""
        return Sampler(self.sampling, self.prompt_ids,
                       self.grammar.constraint() if self.grammar is not None else None)

    @property
    def may_draft(self) -> bool:
        """Whether the server's draft may serve this request: not when the client turned it off, nor
        when it asks for logprobs (the speculative decoder does not expose the distributions it
        samples from)."""
        return self.draft and self.logprobs is None


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float                        # log-softmax of the model's raw logits (before temperature)
    top: tuple[tuple[int, float], ...]    # the k most likely tokens of that row, best first


@dataclass(frozen=True)
class TokenEvent:
    """Tokens accepted since the last event and the text that became final with them.

    `text` may be empty (a character still incomplete, or text held back because it could be the
    start of a stop string) and may carry text of earlier tokens (released late)."""

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class FinishEvent:
    """The last event of every stream."""

    reason: str                           # "stop", "length", "cancelled" or "error"
    prompt_tokens: int
    completion_tokens: int                # tokens generated, an end-of-text/turn token included
    error: str | None = None
    cached_tokens: int = 0                # prompt tokens restored from the prompt cache, not run


Event = TokenEvent | FinishEvent


class QueueFull(Exception):
    """The scheduler holds --max-queue waiting requests already (HTTP 429)."""


class SchedulerClosed(Exception):
    """The server is shutting down (HTTP 503)."""


@dataclass
class SchedulerStats:
    """Counters since start and gauges now; read by GET /metrics."""

    active: int = 0                       # sequences holding model state now
    queued: int = 0                       # requests waiting for a slot
    max_queue: int = 0
    max_batch: int = 0                    # rows per target pass at most
    requests: dict[str, int] = field(default_factory=dict)   # finished requests by reason
    rejected: int = 0                     # refused at submit (queue full)
    prompt_tokens: int = 0
    prompt_cached_tokens: int = 0         # prompt tokens the prompt cache restored (sum of cached_tokens)
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    last_prefill_tok_s: float = 0.0
    last_decode_tok_s: float = 0.0
    batch_rows: int = 0                   # rows in the last target pass
    batch_sequences: int = 0              # sequences in the last target pass
    expert_hits: int = 0
    expert_misses: int = 0
    expert_payload_bytes: int = 0         # expert bytes read from the model file (the store's ledger)
    spec_passes: int = 0                  # speculative target passes (verify of a draft block)
    spec_committed: int = 0               # tokens those passes committed
    spec_proposed: int = 0                # draft proposals verified
    spec_accepted: int = 0                # of which accepted
    decode_passes: int = 0                # target passes with at least one decoding sequence
    drafted_passes: int = 0               # of which ran a draft step first
    plain_sequences: int = 0              # greedy requests served without their draft (where it cannot pay)
    ahead_prefills: int = 0               # conversations' next turns prefilled while their clients were away
    ahead_tokens: int = 0                 # the prompt rows those ran
    prompt_cache: dict[str, int] = field(default_factory=dict)   # PromptCache.stats(); empty: no cache


class Scheduler(Protocol):
    """What the HTTP app needs from the thing that runs the model."""

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue `request` (QueueFull / SchedulerClosed at once) and return its event stream.
        Called from the event loop thread; events arrive on that loop."""
        ...

    def cancel(self, request_id: str) -> None:
        """Stop a request wherever it is (queued: dropped; running: at its next pass). Idempotent."""
        ...

    def stats(self) -> SchedulerStats: ...

    def prefill_ahead(self, prompt_ids: Sequence[int], like: GenerationRequest) -> bool:
        """Prefill `prompt_ids` (the start of a conversation's next request) into the prompt cache
        when no request is waiting, as `like` (the request that just ended) would run it; False
        where nothing is queued (no prompt cache, or the cache already holds it)."""
        ...

    def close(self) -> None:
        """Cancel everything, finish every open stream and release the worker(s)."""
        ...


_held = threading.local()


@contextmanager
def batched_posts() -> Iterator[None]:
    """`RequestStream.post` calls on this thread hold their events until the block ends, then go
    to each event loop in one callback: a serving pass of N sequences wakes the loop once, not N
    times (a wake is a write to the loop's self-pipe and a turn of its select, each a syscall).
    Each stream's events keep their order; a FinishEvent still marks the stream at once."""
    if getattr(_held, "events", None) is not None:       # nested: the outer block delivers
        yield
        return
    events: list[tuple[RequestStream, Event]] = []
    _held.events = events
    try:
        yield
    finally:
        _held.events = None
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Event]]] = {}
        for stream, event in events:
            by_loop.setdefault(stream._loop, []).append((stream, event))
        for loop, items in by_loop.items():
            with suppress(RuntimeError):     # the loop is closed: nobody is listening any more
                loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[RequestStream, Event]]) -> None:
    for stream, event in items:
        stream._queue.put_nowait(event)


class RequestStream:
    """The events of one request, delivered on the event loop that submitted it.

    The producer (a worker thread) calls `post`; the consumer iterates with `async for`, which
    ends after the FinishEvent. `aclose()` (or leaving an `async with`) cancels the request if it
    has not finished: that is how a client disconnect reaches the scheduler.
    """

    def __init__(self, request: GenerationRequest, cancel: Callable[[str], None],
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.request = request
        self.id = request.id
        self._cancel = cancel
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._finished = threading.Event()     # the FinishEvent was posted
        self._done = False                     # ... and consumed

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def post(self, event: Event) -> None:
        """Thread-safe; events after the FinishEvent are dropped."""
        if self._finished.is_set():
            return
        if isinstance(event, FinishEvent):
            self._finished.set()
        held = getattr(_held, "events", None)
        if held is not None:     # inside batched_posts: delivered when its block ends
            held.append((self, event))
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:     # the loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        if self._done:
            raise StopAsyncIteration
        event = await self._queue.get()
        if isinstance(event, FinishEvent):
            self._done = True
        return event

    async def aclose(self) -> None:
        if not self._finished.is_set():
            self._cancel(self.id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
