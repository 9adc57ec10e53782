"""Phase 2 of `k3kit serve`: continuous batching over several sequence states of one model.

One worker thread owns the model (a k3kit.runtime.protocols.BatchedModel). Up to `max_batch`
requests hold a sequence state at once; more wait in a bounded FIFO (`max_queue`; one more is
QueueFull -> HTTP 429). Each target pass takes the next row of every decoding sequence plus
prefill chunks of new ones and runs them through `forward_batch`, so every routed expert the
rows of all users need is read and multiplied once per pass. Each sequence samples from its own
last row with its own Sampler (its own seeded generator), through its own SequenceOutput: the
same limits, stops, text and logprobs as the serial scheduler.

Batch invariance: a request's output must not depend on who else is being served. Attention
runs per sequence on its own state; what is shared is the row-wise work, and a row's result
there is independent of the other rows only while the pass holds at most the model's
`batch_invariant_rows` (the native kernels' row limit). So:
* a pass that mixes sequences holds at most `limit = min(max_batch, batch_invariant_rows)` rows;
* a prompt is always cut into chunks of `prefill_chunk` rows from its start, whatever else
  runs (KDA's and MLA's floats depend on where chunks start); a chunk larger than `limit` runs
  in a pass of its own, exactly as it would alone, and such passes alternate with decode passes;
* when decoders and chunks do not all fit, priority alternates between them pass by pass, and
  decoders take turns (round robin), so no sequence starves.
A model that guarantees nothing (`batch_invariant_rows` 0: a float trunk, float experts) is
still batched, up to `max_batch` rows, without the guarantee.

Speculative decoding (`step_factory`, the server's `--draft`): a request that arrives while
nothing else runs or waits decodes with the SpeculativeDecoder on the model's single-sequence
state (the draft proposes, the target verifies a width the cost model picks), as the serial
scheduler runs it. When another request arrives, that sequence's state is handed to the batch
(`adopt_sequence`) and it continues as a plain batched decoder: with company, passes are shared
instead of speculated (one draft context, and a verify block per user would crowd the pass).
Requests asking for logprobs never start speculatively. Greedy output is the same either way.

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
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from k3kit.runtime.protocols import BatchedModel, LoadedModel
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
from k3kit.serve.serial import StepFactory
from k3kit.tokenizer.codec import TextCodec

log = logging.getLogger("k3kit.serve")


class _Seq:
    """One admitted request: its stream, output, sampler, model handle and prompt progress."""

    def __init__(self, stream: RequestStream, codec: TextCodec, stop_ids: frozenset[int]) -> None:
        self.stream = stream
        self.request = stream.request
        self.cancelled = False
        self.handle: int | None = None
        self.spec: Any = None                     # the speculative decode step while alone
        self.prompt = list(self.request.prompt_ids)
        self.fed = 0                              # prompt rows already run
        self.sampler = Sampler(self.request.sampling)
        self.finish: list[Event] = []             # the FinishEvent, held until the state is freed
        self.out = SequenceOutput(self.request, codec, stop_ids, self._post)

    def _post(self, ev: Event) -> None:
        if isinstance(ev, FinishEvent):
            self.finish.append(ev)
        else:
            self.stream.post(ev)

    @property
    def decoding(self) -> bool:
        return self.fed >= len(self.prompt)

    def next_rows(self, chunk: int) -> list[int]:
        return [self.out.last] if self.decoding else self.prompt[self.fed:self.fed + chunk]


class BatchScheduler:
    """A k3kit.serve.scheduler.Scheduler running every admitted request in shared target passes."""

    def __init__(self, model: BatchedModel, codec: TextCodec, *, loaded: LoadedModel | None = None,
                 max_batch: int = 256, max_queue: int = 64, prefill_chunk: int | None = None,
                 invariant_rows: int | None = None, step_factory: StepFactory | None = None) -> None:
        """`max_batch`: rows per pass at most, and sequences holding state at once.
        `prefill_chunk`: prompt rows per chunk (default max_batch; never more).
        `invariant_rows`: the mixed-pass row bound (default: the model's batch_invariant_rows;
        0 = no invariance promised, passes fill up to max_batch).
        `step_factory`: (model, sampler) -> a speculative decode step for a request served alone
        (the model is then also driven through its single-sequence API)."""
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        self.model, self.codec, self.loaded = model, codec, loaded
        self.step_factory = step_factory
        self._spec: _Seq | None = None            # the one sequence decoding speculatively
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefill_chunk = min(prefill_chunk or max_batch, max_batch)
        inv = model.batch_invariant_rows if invariant_rows is None else invariant_rows
        self.limit = min(max_batch, inv) if inv > 0 else max_batch
        if inv <= 0:
            log.warning("this model promises no batch invariance: outputs may differ in the last bits "
                        "with the other requests served at the same time")
        self.stop_ids = frozenset(codec.stop_ids())
        self._cv = threading.Condition()
        self._queue: deque[_Seq] = deque()
        self._active: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}         # queued or active
        self._closed = False
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
            free = len(self._active) + len(self._queue) < self.max_batch     # admitted at the next pass
            if not free and len(self._queue) >= self.max_queue:
                self._stats.rejected += 1
                raise QueueFull(f"{len(self._queue)} requests are waiting already (--max-queue "
                                f"{self.max_queue}); retry later")
            seq = _Seq(stream, self.codec, self.stop_ids)
            self._queue.append(seq)
            self._by_id[request.id] = seq
            self._cv.notify()
        return stream

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
            active = self.model.sequences + (self._spec is not None)
            return replace(self._stats, active=active, queued=len(self._queue),
                           requests=dict(self._stats.requests))

    def close(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
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
                while not self._queue and not self._active and not self._closed:
                    self._cv.wait()
                if self._closed:
                    closing = list(self._active)
                else:
                    closing = []
                    while self._queue and len(self._active) < self.max_batch:
                        seq = self._queue.popleft()
                        if (self.step_factory is not None and not self._active and not self._queue
                                and seq.request.logprobs is None):
                            self._spec = seq           # alone: speculative on the single state
                        else:
                            seq.handle = self.model.open_sequence()
                        self._active.append(seq)
            if self._closed:
                for seq in closing:
                    seq.out.cancel("error", "the server is shutting down")
                self._retire(closing)
                return
            cancelled = [s for s in self._active if s.cancelled]
            for seq in cancelled:
                seq.out.cancel("cancelled")
            self._retire(cancelled)
            entries: list[tuple[_Seq, list[int]]] = []
            try:
                spec = self._spec
                if spec is not None and len(self._active) > 1:
                    self._demote(spec)
                    spec = None
                if spec is not None:
                    entries = [(spec, [])]
                    self._run_spec(spec)
                else:
                    entries = self._plan()
                    if entries:
                        self._run(entries)
            except Exception as e:           # the server stays up; this pass's requests fail
                log.exception("a batched pass failed")
                for seq in [s for s, _ in entries] or list(self._active):
                    seq.out.cancel("error", f"{type(e).__name__}: {e}")
            self._retire([s for s in self._active if s.out.done])
            if entries:
                self._expert_snapshot()

    def _plan(self) -> list[tuple[_Seq, list[int]]]:
        """This pass's (sequence, rows); see the module docstring for the rules."""
        decoders = [s for s in self._active if s.decoding]
        prefill = [s for s in self._active if not s.decoding]
        big = [s for s in prefill if len(s.next_rows(self.prefill_chunk)) > self.limit]
        if big and (not decoders or not self._last_exclusive):
            self._last_exclusive = True
            return [(big[0], big[0].next_rows(self.prefill_chunk))]
        self._last_exclusive = False
        self._turn ^= 1
        entries: list[tuple[_Seq, list[int]]] = []
        rows = 0

        def add_prefill() -> None:
            nonlocal rows
            for s in prefill:
                r = s.next_rows(self.prefill_chunk)
                if len(r) <= self.limit - rows:
                    entries.append((s, r))
                    rows += len(r)

        if prefill and self._turn:
            add_prefill()
        if decoders:
            start = self._rr % len(decoders)
            turn = decoders[start:] + decoders[:start]
            room = min(self.limit - rows, len(turn))
            entries += [(s, [s.out.last]) for s in turn[:room]]
            rows += room
            self._rr = start + room
        if prefill and not self._turn:
            add_prefill()
        return entries

    def _run(self, entries: list[tuple[_Seq, list[int]]]) -> None:
        rows = sum(len(r) for _, r in entries)
        prompt_rows = sum(len(r) for s, r in entries if not s.decoding)
        t0 = time.perf_counter()
        logits = self.model.forward_batch([(s.handle, r) for s, r in entries])     # type: ignore[misc]
        dt = time.perf_counter() - t0
        prompts_done = 0
        for i, (s, r) in enumerate(entries):
            if not s.decoding:
                s.fed += len(r)
                if not s.decoding:
                    continue                      # a middle chunk: no token yet
                prompts_done += len(s.prompt)
            row = logits[i]
            s.out.push(s.sampler(row), row)
        with self._cv:
            st = self._stats
            st.batch_rows, st.batch_sequences = rows, len(entries)
            st.prompt_tokens += prompts_done
            pre = dt * prompt_rows / rows
            st.prefill_seconds += pre
            st.decode_seconds += dt - pre
            if prompt_rows and pre > 0:
                st.last_prefill_tok_s = prompt_rows / pre
            if rows > prompt_rows and dt > pre:
                st.last_decode_tok_s = (rows - prompt_rows) / (dt - pre)

    def _run_spec(self, seq: _Seq) -> None:
        """One pass of the sequence served alone: a prompt chunk, or one speculative step."""
        model: Any = self.model
        t0 = time.perf_counter()
        if seq.spec is None:                      # first pass: a fresh single-sequence state
            model.reset()
            assert self.step_factory is not None
            seq.spec = self.step_factory(model, seq.sampler)
        if not seq.decoding:
            rows = seq.prompt[seq.fed:seq.fed + self.prefill_chunk]
            logits = seq.spec.prefill(rows)
            seq.fed += len(rows)
            dt = time.perf_counter() - t0
            with self._cv:
                st = self._stats
                st.batch_rows, st.batch_sequences = len(rows), 1
                st.prefill_seconds += dt
                st.last_prefill_tok_s = len(rows) / dt if dt > 0 else 0.0
                if seq.decoding:
                    st.prompt_tokens += len(seq.prompt)
            if seq.decoding:
                row = logits[-1]
                seq.out.push(seq.sampler(row), row)
            return
        tokens = seq.spec(seq.out.last, seq.out.remaining)
        for t in tokens:
            if seq.out.push(t):
                break
        dt = time.perf_counter() - t0
        with self._cv:
            st = self._stats
            st.batch_rows, st.batch_sequences = len(tokens), 1
            st.decode_seconds += dt
            st.last_decode_tok_s = len(tokens) / dt if dt > 0 else 0.0

    def _demote(self, seq: _Seq) -> None:
        """Others arrived: the speculative sequence's state joins the batch as it stands."""
        self._end_spec(seq)
        if seq.decoding or seq.fed:
            with self._cv:
                seq.handle = self.model.adopt_sequence()
                self._stats.spec_handoffs += 1
        else:
            with self._cv:
                seq.handle = self.model.open_sequence()

    def _end_spec(self, seq: _Seq) -> None:
        """Stop speculating for `seq`: its decoder's figures go into the stats."""
        if self._spec is seq:
            self._spec = None
        step, seq.spec = seq.spec, None
        finish = getattr(step, "finish", None)
        if finish is not None:
            s = finish().summary()
            passes = int(s.get("target_passes", 0))
            hist = list(s.get("acceptance_histogram", []))
            with self._cv:
                st = self._stats
                st.spec_passes += passes
                st.spec_committed += round(float(s.get("committed_per_pass", 0.0)) * passes)
                st.spec_proposed += max(int(s.get("verify_rows", 0)) - passes, 0)
                st.spec_accepted += sum(m * int(n) for m, n in enumerate(hist))

    def _retire(self, done: list[_Seq]) -> None:
        """Free finished sequences' states, count them, then post their FinishEvents."""
        if not done:
            return
        for seq in done:
            if self._spec is seq:
                self._end_spec(seq)
                try:
                    self.model.reset()            # type: ignore[attr-defined]  # the single state
                except Exception:
                    log.exception("model reset failed")
        with self._cv:
            for seq in done:
                if seq.handle is not None:
                    self.model.close_sequence(seq.handle)
                    seq.handle = None
                if seq in self._active:
                    self._active.remove(seq)
                self._by_id.pop(seq.request.id, None)
                self._count(seq.out.finish_reason or "error")
                self._stats.generated_tokens += len(seq.out.tokens)
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
