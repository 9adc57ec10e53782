"""Phase 2 of `k3kit serve`: continuous batching over several sequence states of one model.

One worker thread owns the model (a k3kit.runtime.protocols.BatchedModel). Up to
`max_sequences` requests hold a sequence state at once (K3's: MLA latents, KDA recurrent and
conv state, with a draft its feature ring and the draft's context K/V); more wait in a bounded
FIFO (`max_queue`; one more is QueueFull -> HTTP 429). Each target pass takes the next row of
every decoding sequence plus prefill chunks of new ones, at most `max_batch` rows, and runs them
through `forward_batch`, so every routed expert the rows of all users need is read and
multiplied once per pass. Each sequence samples from its own last row with its own Sampler (its
own seeded generator), through its own SequenceOutput: the same limits, stops, text and logprobs
as the serial scheduler.

The worker's parts, one concern each, are mixed into BatchScheduler here: admission
(k3kit.serve.batch_admission: the admission window, which requests get a SpeculativeDecoder),
pass building (k3kit.serve.batch_passes: batch invariance, the rows of each pass, running it)
and the speculative widths (k3kit.serve.batch_widths: who drafts and how wide each verifies,
priced by k3kit.serve.batch_timing's PassTiming); an admitted request is a
k3kit.serve.batch_sequence._Seq. This module holds the Scheduler protocol, the worker loop and
retirement, and re-exports the parts' tunables (PLAIN_FROM, RECENT_S, ...) and PassTiming:
`k3kit.serve.batch` is the one import callers need.

Prefill ahead (`prefill_ahead`): the start of a conversation's next request, as the chat route
expects the client to send it back (k3kit.serve.next_turn), waits in a queue of its own and is
admitted only when no request waits; it runs as a request that samples nothing, and its state
goes into the prompt cache. A request whose prompt extends one running waits for it (then
restores it whole) instead of prefilling the same rows beside it.

Cancellation (a client that went away, or shutdown) is seen at the next pass: the sequence ends
and its state is closed before its FinishEvent goes out, so a client that has its answer never
sees its sequence still counted in stats(). A pass that raises fails the requests in it (their
states are freed) and the server goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from k3kit.runtime.protocols import BatchedModel, LoadedModel, SpeculativeBatchedModel
from k3kit.runtime.speculative.decoder import batchable
from k3kit.runtime.speculative.schedule import DraftCost, DraftGuard
from k3kit.serve.batch_admission import ADMIT_MAX, ADMIT_SETTLE, Admission
from k3kit.serve.batch_admission import PLAIN_FROM as PLAIN_FROM
from k3kit.serve.batch_admission import RECENT_S as RECENT_S
from k3kit.serve.batch_passes import PassBuilder
from k3kit.serve.batch_sequence import Unheard, _Seq
from k3kit.serve.batch_timing import PassTiming
from k3kit.serve.batch_widths import COST_REFRESH as COST_REFRESH
from k3kit.serve.batch_widths import REDRAFT_AFTER as REDRAFT_AFTER
from k3kit.serve.prompt_cache import PromptCache
from k3kit.serve.scheduler import (
    FinishEvent,
    GenerationRequest,
    QueueFull,
    RequestStream,
    Scheduler,
    SchedulerClosed,
    SchedulerStats,
    batched_posts,
    next_request_id,
)
from k3kit.serve.serial import StepFactory
from k3kit.tokenizer.codec import TextCodec

log = logging.getLogger("k3kit.serve")


class BatchScheduler(Admission, PassBuilder):
    """A k3kit.serve.scheduler.Scheduler running every admitted request in shared target passes."""

    def __init__(self, model: BatchedModel, codec: TextCodec, *, loaded: LoadedModel | None = None,
                 max_batch: int = 256, max_queue: int = 64, prefill_chunk: int | None = None,
                 invariant_rows: int | None = None, step_factory: StepFactory | None = None,
                 max_sequences: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 guard: DraftGuard | None = None, admit_settle: float = ADMIT_SETTLE,
                 admit_max: float = ADMIT_MAX, prompt_cache: PromptCache | None = None) -> None:
        """`max_batch`: rows per pass at most. `max_sequences`: sequences holding state at once
        (default max_batch).
        `prefill_chunk`: prompt rows per chunk (default max_batch; never more).
        `invariant_rows`: the mixed-pass row bound (default: the model's batch_invariant_rows;
        0 = no invariance promised, passes fill up to max_batch).
        `step_factory`: (target, sampler) -> a SpeculativeDecoder for one sequence (its target:
        the model's `sequence_target(handle)`); needs a SpeculativeBatchedModel.
        `clock`: seconds, what passes are timed with (tests give their own).
        `guard`: what decides where greedy sequences may draft (default: a DraftGuard).
        `admit_settle`, `admit_max`: seconds; the admission window of a worker woken from idle
        (see k3kit.serve.batch_admission; 0 = start at once).
        `prompt_cache`: states kept between requests (k3kit.serve.prompt_cache; used when the
        model is a SnapshotModel; see k3kit.serve.batch_cache)."""
        if max_batch < 1 or max_queue < 0 or (max_sequences is not None and max_sequences < 1):
            raise ValueError("max_batch and max_sequences must be >= 1 and max_queue >= 0")
        self.model, self.codec, self.loaded = model, codec, loaded
        self.spec_model: SpeculativeBatchedModel | None = (
            model if isinstance(model, SpeculativeBatchedModel) else None)
        if step_factory is not None and self.spec_model is None:
            log.warning("this model cannot verify draft blocks in a shared pass: serving without the draft")
            step_factory = None
        self.step_factory = step_factory
        self.prompt_cache = prompt_cache
        self.max_batch, self.max_queue = max_batch, max_queue
        self.max_sequences = max_sequences or max_batch
        self.prefill_chunk = min(prefill_chunk or max_batch, max_batch)
        inv = model.batch_invariant_rows if invariant_rows is None else invariant_rows
        self.limit = min(max_batch, inv) if inv > 0 else max_batch
        if inv <= 0:
            log.warning("this model promises no batch invariance: outputs may differ in the last bits "
                        "with the other requests served at the same time")
        self._draft_s: float | None = None        # running mean of one draft step, any sequence
        self._timing = PassTiming()               # measured pass seconds vs the model's cost()
        self._cost_memo: dict[int, float] = {}    # the model's cost(n) while its inputs stand (_cost)
        self._cost_key: tuple[int, int] | None = None
        self._passes = 0
        self._guard = guard or DraftGuard()       # realized tokens/s with and without drafts
        self._draft_fit = DraftCost()             # a draft step's seconds for n sequences drafted together
        self._clock = clock
        self._drafted = False                     # whether this pass ran a draft step
        self._sync_row_s: float | None = None     # running mean of a draft context's catch-up, per ring row
        self._foretold = self._accepted = 0.0     # proposals expected to survive / that did (running)
        self._survival: list[float] | None = None  # running mean of drafts' prefix survival, any sequence
        self._proposals: int | None = None         # proposals per draft step (the drafter's)
        self._budgeted: bool | None = None         # whether the factory's decoders have a fixed budget
        self._would_memo: bool | None = None       # _would_draft of this admission round
        self._load = (0, float("-inf"))            # (sequences in a recent pass, when it ended): _recent_load
        self.stop_ids = frozenset(codec.stop_ids())
        self._cv = threading.Condition()
        self._queue: deque[_Seq] = deque()
        self._ahead: deque[_Seq] = deque(maxlen=self.max_sequences)   # prefills ahead, the oldest dropped
        self._active: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}         # queued or active
        self._closed = False
        self.admit_settle, self.admit_max = admit_settle, admit_max
        self._submitted = 0                       # requests ever submitted (the admission window's clock)
        self._rr = 0                              # round-robin start among decoders
        self._turn = 0                            # alternates decode-first / prefill-first passes
        self._last_exclusive = False
        self._stats = SchedulerStats(max_queue=max_queue, max_batch=max_batch)
        self._thread = threading.Thread(target=self._loop, name="k3kit-serve-batch", daemon=True)
        self._thread.start()

    # -- the Scheduler protocol (event loop side) ---------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestStream:
        stream = RequestStream(request, self.cancel)
        with self._cv:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            free = len(self._active) + len(self._queue) < self.max_sequences     # admitted at the next pass
            if not free and len(self._queue) >= self.max_queue:
                self._stats.rejected += 1
                raise QueueFull(f"{len(self._queue)} requests are waiting already (--max-queue "
                                f"{self.max_queue}); retry later")
            seq = _Seq(stream, self.codec, self.stop_ids)
            self._queue.append(seq)
            self._by_id[request.id] = seq
            self._submitted += 1
            self._cv.notify()
        return stream

    def prefill_ahead(self, prompt_ids: Sequence[int], like: GenerationRequest) -> bool:
        """The Scheduler protocol's: queue a prefill of `prompt_ids` that runs when no request waits
        (see the module). One queued earlier whose tokens these extend (the same conversation's
        earlier turn) is dropped."""
        pc = self.prompt_cache
        if self._snapshots is None or pc is None or not like.cache_prompt or not prompt_ids:
            return False
        if pc.holds(prompt_ids):
            return False
        request = GenerationRequest(tuple(int(t) for t in prompt_ids), 1, like.sampling, draft=like.draft,
                                    id=next_request_id("ahead"), ahead=True)
        seq = _Seq(Unheard(request), self.codec, self.stop_ids)
        with self._cv:
            if self._closed:
                return False
            for old in list(self._ahead):
                if seq.prompt[:len(old.prompt)] == old.prompt:
                    self._ahead.remove(old)
            self._ahead.append(seq)
            self._cv.notify()
        return True

    def cancel(self, request_id: str) -> None:
        with self._cv:
            seq = self._by_id.get(request_id)
            if seq is None:
                return
            seq.cancelled = True
            if seq in self._queue:               # still waiting: drop it now
                self._queue.remove(seq)
                del self._by_id[request_id]
                self._count("cancelled")
                seq.stream.post(FinishEvent("cancelled", len(seq.prompt), 0))
            self._cv.notify()

    def stats(self) -> SchedulerStats:
        with self._cv:
            return replace(self._stats, active=self.model.sequences, queued=len(self._queue),
                           requests=dict(self._stats.requests),
                           prompt_cache=self.prompt_cache.stats() if self.prompt_cache is not None else {})

    def close(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._ahead.clear()
            for seq in self._active:
                seq.cancelled = True
            self._cv.notify_all()
        for seq in pending:
            self._by_id.pop(seq.request.id, None)
            seq.stream.post(FinishEvent("error", len(seq.prompt), 0, "the server is shutting down"))
        self._thread.join(timeout)

    # -- the worker ---------------------------------------------------------------------------
    def _count(self, reason: str) -> None:
        self._stats.requests[reason] = self._stats.requests.get(reason, 0) + 1

    def _loop(self) -> None:
        torch.set_grad_enabled(False)      # thread-local: the model runs on this thread only
        while True:
            with self._cv:
                while not self._queue and not self._ahead and not self._active and not self._closed:
                    self._cv.wait()
                if not self._active:
                    self._settle()
                if self._closed:
                    closing = list(self._active)
                else:
                    closing = []
                    self._admit()
            if self._closed:
                for seq in closing:
                    seq.out.cancel("error", "the server is shutting down")
                self._retire(closing)
                return
            with batched_posts():            # the pass's events reach the event loop in one wake
                self._pass()

    def _pass(self) -> None:
        """One turn of the worker after admission: cancellations, a pass, retirements."""
        cancelled = [s for s in self._active if s.cancelled]
        for seq in cancelled:
            seq.out.cancel("cancelled")
        self._retire(cancelled)
        entries: list[tuple[_Seq, list[int]]] = []
        try:
            entries = self._plan()
            if entries:
                self._run(entries)
        except Exception as e:           # the server stays up; this pass's requests fail
            log.exception("a batched pass failed")
            for seq in [s for s, _ in entries] or list(self._active):
                seq.out.cancel("error", f"{type(e).__name__}: {e}")
        if entries:
            self._note_load(len(self._active))
        self._retire([s for s in self._active if s.out.done])
        if entries:
            self._expert_snapshot()

    def _batchable(self, decoders: list[Any]) -> bool:
        """k3kit.runtime.speculative.decoder.batchable, looked up in this module at each call, so that
        `k3kit.serve.batch.batchable` is the one name that decides whether sampled sequences draft
        their blocks in one forward (tests set it to force one draft step per sequence)."""
        return batchable(decoders)

    def _retire(self, done: list[_Seq]) -> None:
        """Free finished sequences' states, count them, then post their FinishEvents."""
        if not done:
            return
        for seq in done:
            try:
                self._store(seq)
            except Exception:                   # the cache is an optimisation: never fail a request
                log.exception("prompt cache: could not keep a finished sequence")
            dec, seq.dec = seq.dec, None
            release = getattr(getattr(dec, "draft", None), "release", None)
            if release is not None:
                release(dec.ring)                 # the draft's context K/V for this sequence
        with self._cv:
            for seq in done:
                if seq.handle is not None:
                    self.model.close_sequence(seq.handle)
                    seq.handle = None
                if seq in self._active:
                    self._active.remove(seq)
                self._by_id.pop(seq.request.id, None)
                if seq.request.ahead:
                    if seq.out.finish_reason == "length":
                        self._stats.ahead_prefills += 1
                        self._stats.ahead_tokens += seq.fed - seq.out.cached_tokens
                    continue
                self._count(seq.out.finish_reason or "error")
                self._stats.generated_tokens += len(seq.out.tokens)
                self._stats.prompt_cached_tokens += seq.out.cached_tokens
        for seq in done:
            for ev in seq.finish or [FinishEvent("error", len(seq.prompt), len(seq.out.tokens),
                                                 "the sequence ended without a reason")]:
                seq.stream.post(ev)

    def _expert_snapshot(self) -> None:
        if self.loaded is None:
            return
        try:
            e = self.loaded.stats()
        except Exception:
            return
        with self._cv:
            self._stats.expert_hits, self._stats.expert_misses = int(e.hits), int(e.misses)
            self._stats.expert_payload_bytes = int(e.bytes_read)


if TYPE_CHECKING:
    _contract: type[Scheduler] = BatchScheduler     # the type checker holds it to the protocol
