"""`k3kit serve` one request at a time: one worker thread owns the model's single sequence.

Used for models without several sequence states (not a k3kit.runtime.protocols.BatchedModel);
the K3 adapter is served by k3kit.serve.batch, speculative decoding included. A
single-sequence model cannot interleave two requests without one overwriting the other's state,
so requests wait in a bounded FIFO (`max_queue` waiting, the running one not counted; one more
is QueueFull -> HTTP 429) and are served in arrival order; throughput is one stream's, shared.

Each request runs as `k3kit generate` runs it (k3kit.runtime.engine.generate): reset the model,
prefill the prompt in chunks of `prefill_chunk` rows, sample the first token from the last
prefill row, then decode one pass at a time, each request sampling with its own Sampler (its own
seeded generator). With a draft, the pass is the step `step_factory` builds (the same
SpeculativeDecoder `generate --draft` builds), except for requests that ask for logprobs (the
decoder does not expose the distributions it samples from) or send `draft: false`: those run plain
AR passes (greedy output is the same token for token; sampled output has the same distribution).

Cancellation (a client that went away, or shutdown) is checked before every pass; the sequence
then ends, the model is reset and the request's decoder, ring and sampler are dropped, so its
state is freed before the next request starts.
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
from torch import Tensor

from k3kit.runtime.protocols import CausalModel, LoadedModel
from k3kit.runtime.sampling import Sampler
from k3kit.serve.scheduler import (
    Event,
    FinishEvent,
    GenerationRequest,
    QueueFull,
    RequestStream,
    Scheduler,
    SchedulerClosed,
    SchedulerStats,
)
from k3kit.serve.sequence import SequenceOutput
from k3kit.tokenizer.codec import TextCodec

log = logging.getLogger("k3kit.serve")

# (model, sampler) -> a decode step: called as step(anchor, remaining) -> tokens, with optional
# .prefill(ids) -> logits and .finish() -> stats with .summary() (k3kit.runtime.engine.DecodeStep)
StepFactory = Callable[[Any, Sampler], Any]


class _Cancelled(Exception):
    pass


class _Job:
    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream
        self.request = stream.request
        self.cancelled = threading.Event()


class SerialScheduler:
    """A k3kit.serve.scheduler.Scheduler that serializes requests on one worker thread."""

    def __init__(self, model: CausalModel, codec: TextCodec, *, loaded: LoadedModel | None = None,
                 step_factory: StepFactory | None = None, max_queue: int = 64, prefill_chunk: int = 256
                 ) -> None:
        if max_queue < 0 or prefill_chunk < 1:
            raise ValueError("max_queue must be >= 0 and prefill_chunk >= 1")
        self.model, self.codec, self.loaded = model, codec, loaded
        self.step_factory = step_factory
        self.max_queue, self.prefill_chunk = max_queue, prefill_chunk
        self.stop_ids = frozenset(codec.stop_ids())
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._jobs: dict[str, _Job] = {}          # queued or running
        self._active: _Job | None = None
        self._closed = False
        self._stats = SchedulerStats(max_queue=max_queue, max_batch=prefill_chunk)
        self._thread = threading.Thread(target=self._loop, name="k3kit-serve-worker", daemon=True)
        self._thread.start()

    # -- the Scheduler protocol (event loop side) ---------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestStream:
        stream = RequestStream(request, self.cancel)
        with self._cv:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            idle = self._active is None and not self._queue      # runs at once: it never waits
            if len(self._queue) >= self.max_queue and not idle:
                self._stats.rejected += 1
                raise QueueFull(f"{len(self._queue)} requests are waiting already (--max-queue "
                                f"{self.max_queue}); retry later")
            job = _Job(stream)
            self._queue.append(job)
            self._jobs[request.id] = job
            self._cv.notify()
        return stream

    def cancel(self, request_id: str) -> None:
        with self._cv:
            job = self._jobs.get(request_id)
            if job is None:
                return
            job.cancelled.set()
            if job is not self._active:          # still queued: drop it now
                self._queue.remove(job)
                del self._jobs[request_id]
                self._count("cancelled")
                job.stream.post(FinishEvent("cancelled", len(job.request.prompt_ids), 0))

    def stats(self) -> SchedulerStats:
        with self._cv:
            return replace(self._stats, active=1 if self._active is not None else 0, queued=len(self._queue),
                           requests=dict(self._stats.requests))

    def prefill_ahead(self, prompt_ids: Sequence[int], like: GenerationRequest) -> bool:
        """Nothing: this scheduler keeps no prompt cache."""
        return False

    def close(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            if self._active is not None:
                self._active.cancelled.set()
            self._cv.notify_all()
        for job in pending:
            self._jobs.pop(job.request.id, None)
            job.stream.post(FinishEvent("error", len(job.request.prompt_ids), 0,
                                        "the server is shutting down"))
        self._thread.join(timeout)

    # -- the worker ---------------------------------------------------------------------------
    def _count(self, reason: str) -> None:
        self._stats.requests[reason] = self._stats.requests.get(reason, 0) + 1

    def _loop(self) -> None:
        torch.set_grad_enabled(False)      # thread-local: the model runs on this thread only
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                self._active = job
            # the FinishEvent goes out last, once the state is freed and counted: a client that has
            # its answer never sees its own sequence still active in stats()
            finish: list[Event] = []

            def post(ev: Event, stream: RequestStream = job.stream, finish: list[Event] = finish) -> None:
                if isinstance(ev, FinishEvent):
                    finish.append(ev)
                else:
                    stream.post(ev)

            seq = SequenceOutput(job.request, self.codec, self.stop_ids, post)
            try:
                self._run(job, seq)
            except _Cancelled:
                seq.cancel("cancelled")
            except Exception as e:           # the server stays up; this request fails
                log.exception("request %s failed", job.request.id)
                seq.cancel("error", f"{type(e).__name__}: {e}")
            finally:
                try:
                    self.model.reset()       # free the sequence's state before the next one
                except Exception:
                    log.exception("model reset failed")
                self._expert_snapshot()
                with self._cv:
                    self._active = None
                    self._jobs.pop(job.request.id, None)
                    self._count(seq.finish_reason or "error")
                    self._stats.generated_tokens += len(seq.tokens)
                for ev in finish or [FinishEvent("error", len(job.request.prompt_ids), len(seq.tokens),
                                                 "the sequence ended without a reason")]:
                    job.stream.post(ev)

    def _check(self, job: _Job) -> None:
        if job.cancelled.is_set():
            raise _Cancelled

    def _pass(self, rows: int) -> None:
        with self._cv:
            self._stats.batch_rows, self._stats.batch_sequences = rows, 1

    def _run(self, job: _Job, seq: SequenceOutput) -> None:
        req, model = job.request, self.model
        prompt = list(req.prompt_ids)
        sampler = req.sampler()
        seq.grammar_end = lambda: sampler.ended_at
        model.reset()
        use_step = self.step_factory is not None and req.may_draft
        step = self.step_factory(model, sampler) if use_step and self.step_factory is not None else None
        if step is not None and sampler.constraint is not None and getattr(step, "constraint", None) \
                is not sampler.constraint:
            step = None          # a step that does not mask with the request's grammar would not follow it
        prefill: Callable[[Sequence[int]], Tensor] = getattr(step, "prefill", None) or model.forward

        t0 = time.perf_counter()
        logits: Tensor | None = None
        for i in range(0, len(prompt), self.prefill_chunk):
            self._check(job)
            chunk = prompt[i:i + self.prefill_chunk]
            self._pass(len(chunk))
            logits = prefill(chunk)
        assert logits is not None
        t1 = time.perf_counter()
        with self._cv:
            self._stats.prompt_tokens += len(prompt)
            self._stats.prefill_seconds += t1 - t0
            self._stats.last_prefill_tok_s = len(prompt) / (t1 - t0) if t1 > t0 else 0.0

        row = logits[-1]
        done = seq.push(sampler(row), row)
        try:
            while not done:
                self._check(job)
                if step is not None:
                    tokens = step(seq.last, seq.remaining)
                    self._pass(len(tokens))
                    for t in tokens:
                        if seq.push(t):
                            break
                    done = seq.done
                else:
                    self._pass(1)
                    row = model.forward([seq.last])[-1]
                    done = seq.push(sampler(row), row)
        finally:
            t2 = time.perf_counter()
            decoded = max(len(seq.tokens) - 1, 0)
            with self._cv:
                self._stats.decode_seconds += t2 - t1
                if decoded:
                    self._stats.last_decode_tok_s = decoded / (t2 - t1) if t2 > t1 else 0.0
            finish = getattr(step, "finish", None)
            if finish is not None:
                self._speculative(finish().summary())

    def _speculative(self, s: dict[str, Any]) -> None:
        passes = int(s.get("target_passes", 0))
        hist = list(s.get("acceptance_histogram", []))
        with self._cv:
            st = self._stats
            st.spec_passes += passes
            st.spec_committed += round(float(s.get("committed_per_pass", 0.0)) * passes)
            st.spec_proposed += max(int(s.get("verify_rows", 0)) - passes, 0)
            st.spec_accepted += sum(m * int(n) for m, n in enumerate(hist))

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
    _contract: type[Scheduler] = SerialScheduler     # the type checker holds it to the protocol
