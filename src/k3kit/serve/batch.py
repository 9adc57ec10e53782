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

Admission window: a worker woken from idle (no sequence active) starts its first pass once no
request has arrived for `admit_settle` (5 ms), or after `admit_max` (25 ms) at most, so that
clients starting together share that pass instead of the first prompt running alone while the
pass's threads hold back the others' arrival (`_settle`). A lone request pays `admit_settle` once;
a busy worker never waits (newcomers join the next pass anyway). Outputs do not depend on it.

Batch invariance: a request's output must not depend on who else is being served. Attention
runs per sequence on its own state; what is shared is the row-wise work, and a row's result
there is independent of the other rows only while the pass holds at most the model's
`batch_invariant_rows` (the native float kernels' row limit; no limit when every product runs in
the ggml arithmetic, whose int8 products never leave the native kernel, so there all the prompts
waiting when a pass starts go into it, up to `max_batch` rows: prefill is compute-bound, and one
pass of all of them costs the per-pass work once instead of once per 64 rows). So:
* a pass that mixes sequences holds at most `limit = min(max_batch, batch_invariant_rows)` rows;
* a prompt is always cut into chunks of `prefill_chunk` rows from its start, whatever else
  runs (KDA's and MLA's floats depend on where chunks start); a chunk larger than `limit` runs
  in a pass of its own, exactly as it would alone, and such passes alternate with decode passes;
* when decoders and chunks do not all fit, priority alternates between them pass by pass, and
  decoders take turns (round robin), so no sequence starves.
A model that guarantees nothing (`batch_invariant_rows` 0: a float trunk, float experts) is
still batched, up to `max_batch` rows, without the guarantee.

Speculative decoding (`step_factory`, the server's `--draft`; a SpeculativeBatchedModel):
every decoding sequence that does not ask for logprobs has its own SpeculativeDecoder over its
own sequence (`sequence_target`), with its own feature ring and draft context. Per pass:
  1. the plan above (one row per decoder, prompt chunks) fixes R rows; the room left under the
     row limit is what speculation may use;
  2. which sequences draft: `allocate_widths` with each sequence's expected acceptance (the
     running mean of its drafts' confidences; before its first draft, the prior) and the
     measured draft time, against the cost of the whole pass (PassTiming, below: both in
     this machine's seconds of the moment): a draft step
     must pay for itself in expected tokens per second of the pass, so with many users (a
     long pass, many tokens already) fewer sequences draft, and none when it cannot pay (a
     sequence that has not drafted for REDRAFT_AFTER passes is judged by the recent drafts of
     all sequences instead of its own last ones); before that, DraftGuard (runtime.speculative.
     schedule) may rule drafting out for the greedy sequences of this pass: it keeps the tokens
     per second passes with and without drafts really realized (their draft steps included) at
     this number of decoders, with their standard errors, and where drafting has realized less
     beyond the noise, over enough passes each way, it is only tried again rarely; greedy output
     does not depend on it (the tokens are AR's either way);
  3. those propose, all in ONE draft forward (`propose_many`: each block is its own serial draft
     step's; a draft step's cost per sequence is DraftCost's fit of the batched steps run, so the
     more draft together the cheaper each), and `allocate_widths` again, now with the draft's
     confidences (scaled by how many of the proposals they foretold were really accepted) and
     the draft cost spent, picks each block's width;
  4. ONE `verify_batch` runs every block [anchor, proposals] (not committed: ReplaySSM) with
     the other sequences' plain rows and prompt chunks (committed);
  5. each decoder accepts (greedy, or lossless sampled with its own generator) and commits
     its accepted rows (`commit_sequence`), its taps going to its ring.
A sequence that does not draft in a pass costs the pass no draft work: its row is an ordinary
committed row of the pass (as in the AR server: not a pending one-row block committed afterwards),
its tap features (rows the target computes anyway) go to its ring, and nothing else; its draft context K/V is
brought up to date from the ring only in the next pass where it drafts (tests/serve/
test_spec_declined.py).
Plain sequences: a greedy request admitted with PLAIN_FROM or more sequences active (counting the
waiting ones, or as many as a pass held within the last RECENT_S seconds if more: the clients of a
busy server come back one by one) gets no SpeculativeDecoder unless passes have shown drafting to
pay at that count (`_would_draft`: the guard's verdict there, or a smaller count's scaled to it, and
the allocator given fresh sequences and the measured costs), and runs as the AR server runs it, for
its whole life (no tap capture, no feature ring, no allocation): where drafting does not pay, the
draft server then costs what the AR server costs (its bookkeeping was 3-5% of a pass at 16 clients
on the mini). Its tokens are AR's either way; sampled requests and fixed verify budgets keep their
decoders. A sequence admitted with one keeps it (it drafts again when the others have left). A
verdict is revisited through the sequences admitted with fewer than PLAIN_FROM active (they always
keep their decoder: the guard's probes and the allocator's survival need drafting sequences) and the
sampled ones; a server never below PLAIN_FROM users keeps the verdict it has (a decoder admitted in
8 to probe cost 5-10% at 8 clients on the mini, 2 cores).
A verify block is a segment that starts at the anchor, and its rows are the floats a committed
segment of those rows gets, alone or batched, within the same row limit; a one-row block is the
plain decode row, and the plain rows of other sequences keep their bits. Greedy output is the
tokens `k3kit generate --temperature 0` picks, alone or in company (tests/serve). Sampled output
has the target's distribution; its draws depend on whether it drafts and how wide it verifies,
so a sampled sequence decides both from its own draft alone (`_sampled_blocks`: drafts whenever
two rows fit, verifies what its confidence passes), never from timing, the expert cache or
other requests' history, and a seeded request repeats when served the same way.
"The pass's cost" is PassTiming's: the model's cost(rows) scaled, plus per verify row and per
block terms, all fitted to the passes measured; prompt rows in a pass count like tokens, so
speculation does not stretch a pass at the expense of others' prefill.

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
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from k3kit.runtime.protocols import BatchedModel, LoadedModel, SpeculativeBatchedModel, VerifyOutput
from k3kit.runtime.sampling import Sampler
from k3kit.runtime.speculative import DraftBlock
from k3kit.runtime.speculative.decoder import batchable, draft_blocks, propose_many
from k3kit.runtime.speculative.proposal import Proposal
from k3kit.runtime.speculative.schedule import Claim, DraftCost, DraftGuard, allocate_widths, prefix_survival
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

ADMIT_SETTLE = 0.005     # s without a new request that ends the admission window (_settle)
ADMIT_MAX = 0.025        # s the admission window lasts at most
REDRAFT_AFTER = 8        # passes without a draft after which a sequence is judged by everyone's drafts
PLAIN_FROM = 6           # sequences active from which a greedy request may be admitted plain
RECENT_S = 0.25          # s a pass's sequence count stays the load requests are admitted under
COST_REFRESH = 32        # passes between fresh asks of the model's cost(), the expert cache unchanged


class PassTiming:
    """What a pass really costs here, learnt from the passes run: seconds ~ a * cost(rows) + d +
    b * (verify rows beyond the anchors) + c * (verify blocks), a ridge regression with
    forgetting (recent passes count most) towards a = 1, d = b = c = 0. The model's cost() knows
    the machine's calibrated rates and the experts a pass reads; a and d set it to the load of the
    moment, b corrects its slope for verify rows (it may be negative: cost()'s rows are the
    calibration's, measured on another machine; on the mini here a verify row costs ~0.5 ms where
    cost() says 1.5) and c adds what it does not see at all: a verify block's recurrence runs per
    sequence and row by row, where single rows of many sequences step together. Each column's
    prior weighs like PRIOR passes in its own units (this cost(), 1 ms, one extra row, one block):
    one ridge for all shrank the block column, a block x 1e-3, to nothing."""

    FORGET = 0.97
    PRIOR = 4.0             # the prior weighs as much as this many passes
    K = 4

    def __init__(self) -> None:
        # the weighted sums X'X and X'y, as plain floats: numpy's per-call overhead on arrays this
        # small cost the draft server ~0.2 ms a pass
        self.xx = [[0.0] * self.K for _ in range(self.K)]
        self.xy = [0.0] * self.K
        self.theta = (1.0, 0.0, 0.0, 0.0)
        self._last_cost: float | None = None      # the last pass's cost(), when theta is not solved for it

    def record(self, cost: float, extra_rows: int, blocks: int, seconds: float) -> None:
        x = (cost, 1e-3, extra_rows * 1e-3, blocks * 1e-3)       # d, b, c in ms: like-sized columns
        f = self.FORGET
        for i in range(self.K):
            row = self.xx[i]
            for j in range(self.K):
                row[j] = f * row[j] + x[i] * x[j]
            self.xy[i] = f * self.xy[i] + x[i] * seconds
        self._last_cost = cost                    # solved when asked: most passes never ask

    def coefficients(self) -> tuple[float, float, float, float]:
        """(a, d, b, c) with d, b and c in seconds."""
        if self._last_cost is not None:
            lam = [self.PRIOR * max(self._last_cost, 1e-3) ** 2] + [self.PRIOR * 1e-6] * 3
            m = [[self.xx[i][j] + (lam[i] if i == j else 0.0) for j in range(self.K)] for i in range(self.K)]
            y = [self.xy[0] + lam[0], *self.xy[1:]]      # the prior pulls towards (1, 0, 0, 0)
            a, d, b, c = _solve(m, y)
            self.theta = (max(a, 0.1), d, b, max(c, 0.0))
            self._last_cost = None
        a, d, b, c = self.theta
        return a, d * 1e-3, b * 1e-3, c * 1e-3


def _solve(m: list[list[float]], y: list[float]) -> list[float]:
    """x with m x = y, m symmetric positive definite (Gaussian elimination; the ridge prior keeps m
    well conditioned). m and y are overwritten."""
    k = len(y)
    for i in range(k):
        p = m[i][i]
        for r in range(i + 1, k):
            f = m[r][i] / p
            if f:
                for j in range(i, k):
                    m[r][j] -= f * m[i][j]
                y[r] -= f * y[i]
    x = [0.0] * k
    for i in reversed(range(k)):
        x[i] = (y[i] - sum(m[i][j] * x[j] for j in range(i + 1, k))) / m[i][i]
    return x


def _mean(old: list[float] | None, new: list[float], weight: float) -> list[float]:
    """A running mean of survival vectors: `weight` on the new one."""
    if old is None:
        return list(new)
    return [(1 - weight) * a + weight * b for a, b in zip(old, new, strict=True)]


class _Seq:
    """One admitted request: its stream, output, sampler, model handle and prompt progress."""

    def __init__(self, stream: RequestStream, codec: TextCodec, stop_ids: frozenset[int]) -> None:
        self.stream = stream
        self.request = stream.request
        self.cancelled = False
        self.handle: int | None = None
        self.dec: Any = None                      # its SpeculativeDecoder (with --draft)
        self.survival: list[float] | None = None  # its drafts' prefix survival so far (running mean)
        self.undrafted = 0                        # passes since it last drafted
        self.block_survival: list[float] | None = None   # what the last block was expected to keep
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
    def opened(self) -> int:
        """Its sequence handle (it holds one from admission to retirement)."""
        if self.handle is None:
            raise ValueError(f"request {self.request.id} holds no sequence state")
        return self.handle

    @property
    def decoding(self) -> bool:
        return self.fed >= len(self.prompt)

    def next_rows(self, chunk: int) -> list[int]:
        return [self.out.last] if self.decoding else self.prompt[self.fed:self.fed + chunk]


class BatchScheduler:
    """A k3kit.serve.scheduler.Scheduler running every admitted request in shared target passes."""

    def __init__(self, model: BatchedModel, codec: TextCodec, *, loaded: LoadedModel | None = None,
                 max_batch: int = 256, max_queue: int = 64, prefill_chunk: int | None = None,
                 invariant_rows: int | None = None, step_factory: StepFactory | None = None,
                 max_sequences: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 guard: DraftGuard | None = None, admit_settle: float = ADMIT_SETTLE,
                 admit_max: float = ADMIT_MAX) -> None:
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
        (see the module docstring; 0 = start at once)."""
        if max_batch < 1 or max_queue < 0 or (max_sequences is not None and max_sequences < 1):
            raise ValueError("max_batch and max_sequences must be >= 1 and max_queue >= 0")
        self.model, self.codec, self.loaded = model, codec, loaded
        self.spec_model: SpeculativeBatchedModel | None = (
            model if isinstance(model, SpeculativeBatchedModel) else None)
        if step_factory is not None and self.spec_model is None:
            log.warning("this model cannot verify draft blocks in a shared pass: serving without the draft")
            step_factory = None
        self.step_factory = step_factory
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
                if not self._active:
                    self._settle()
                if self._closed:
                    closing = list(self._active)
                else:
                    closing = []
                    coming = max(min(self.max_sequences, len(self._active) + len(self._queue)),
                                 self._recent_load())
                    self._would_memo = None
                    while self._queue and len(self._active) < self.max_sequences:
                        seq = self._queue.popleft()
                        seq.handle = self.model.open_sequence()
                        self._active.append(seq)
                        if self.step_factory is not None and self.spec_model is not None \
                                and seq.request.may_draft:
                            if self._speculates(seq, coming):
                                target = self.spec_model.sequence_target(seq.handle)
                                seq.dec = self.step_factory(target, seq.sampler)
                                self._proposals = seq.dec.draft.n_proposals
                                self._budgeted = seq.dec.schedule.budget is not None
                            else:
                                self._stats.plain_sequences += 1
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

    def _recent_load(self) -> int:
        """The most sequences a pass held within the last RECENT_S seconds (0: none ran): the load a
        request is admitted under, whoever happens to be active at that moment. Clients of a busy
        server come back over a few ms after their answers, so those admitted first see the server
        almost empty; over HTTP on the mini, 8 clients' requests admitted in twos and threes that way
        got decoders and the draft server ran 0.74-0.91x AR."""
        n, t = self._load
        return n if self._clock() - t <= RECENT_S else 0

    def _note_load(self, n: int) -> None:
        """A pass ran with `n` sequences active (its finished ones included)."""
        if n >= self._recent_load():
            self._load = (n, self._clock())

    def _speculates(self, seq: _Seq, n: int) -> bool:
        """Whether a newly admitted request gets a SpeculativeDecoder, `n` sequences active once the
        waiting ones are in (or as many as a pass held within RECENT_S, if more); if not, it runs as
        a plain sequence for its whole life, as the AR server runs it (no decoder is built: its ring
        and draft context cost the admission ~10 ms at 8 clients). A sampled one does: whether it
        drafts must not depend on timing (its seed repeats); so does every one while the factory's
        verify budget is not known to be `auto` (the first decoder tells), and one with a fixed
        budget. A greedy one does with fewer than PLAIN_FROM sequences (there its bookkeeping is ~1%
        of a pass, and the guard's probes and the allocator's survival need drafting sequences: one
        prompt the drafter cannot follow can condemn drafting at 1 for prompts it follows well, and
        a probe that pays lifts that), or where it could draft (`_would_draft(n)`)."""
        if not seq.sampler.sampling.greedy or self._budgeted is not False:
            return True
        if n < PLAIN_FROM:
            return True
        if self._would_memo is None:              # once per admission round
            self._would_memo = self._would_draft(n)
        return self._would_memo

    def _would_draft(self, n: int) -> bool:
        """Could greedy sequences draft in a pass of `n` (>= PLAIN_FROM) decoders, as things stand? Only
        where passes have shown it: the guard's verdict at n, or a smaller count's scaled to n
        (DraftGuard.verdict), is True, or n was measured both ways and found within the noise; and
        then only where the allocator, given fresh sequences (judged, as it judges them, by the
        recent drafts of all sequences) and the measured draft and pass costs, would draft one. A
        count no pass has shown drafting to pay at starts plain: on the mini a 4-client verdict
        within the noise let the first 8-client round draft, and that round alone made the run
        0.85-0.93x AR over HTTP."""
        verdict = self._guard.verdict(n)
        if verdict is False or (verdict is None and not self._guard.measured(n)):
            return False
        p, surv = self._proposals, self._survival
        share = self._draft_fit.per_sequence(n)
        d = share if share is not None else self._draft_s
        room = self.limit - n
        if p is None or surv is None or len(surv) != p or d is None or room <= 0 or self.spec_model is None:
            return p is None or surv is None or d is None
        cost, row_cost, block_cost = self._pass_cost(n)
        # one fresh claim among n decoding rows: the allocator's first pick among n like ones is this
        # one's first widening, and if that does not pay, none does (n claims cost O(n^2) to allocate)
        widths = allocate_widths([Claim(surv, p + 1, d)], cost, n, n, room, 0.0, row_cost, block_cost)
        return widths[0] > 1

    def _settle(self) -> None:
        """The admission window (the lock held): a worker woken from idle waits while requests keep
        arriving, until none has come for `admit_settle` s or `admit_max` s have passed since it
        woke, or no more could be admitted. Clients that start together reach the server over a few
        ms, and a pass begun on the first prompt alone runs it at the others' expense: its threads
        take the cores the server's event loop needs to take the others in (measured on the K3
        slice: 8 clients, the first pass held 1-3 prompts, the rest queued 40 ms later)."""
        if self.admit_settle <= 0 or self.admit_max <= 0:
            return
        end = time.monotonic() + self.admit_max
        while not self._closed and len(self._queue) < self.max_sequences:
            seen = self._submitted
            left = end - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(min(self.admit_settle, left))
            if self._submitted == seen:           # nothing new for admit_settle (or a cancel): go
                return

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
        """One target pass: the plan's rows, widened into verify blocks where speculation pays."""
        self._drafted = False
        self._passes += 1
        t_start = self._clock()
        blocks = self._speculate(entries)
        rows = [(s, [*r, *blocks[s][1]] if s in blocks else r) for s, r in entries]
        n_rows = sum(len(r) for _, r in rows)
        prompt_rows = sum(len(r) for s, r in entries if not s.decoding)
        t0 = self._clock()
        batch = [(s.opened, r) for s, r in rows]
        outs: list[VerifyOutput]
        if self.spec_model is not None:
            # only blocks with proposals are verified (kept pending): a decoder's single row is the plain
            # row, the same floats either way, committed by the pass as the AR server's are
            outs = self.spec_model.verify_batch(
                batch, verify={s.opened for s in blocks if blocks[s][1]},
                capture={s.opened for s, _ in entries if s.dec is not None})
        else:
            logits = self.model.forward_batch(batch)
            outs = [VerifyOutput(logits[i:i + 1], None) for i in range(len(entries))]
        dt = self._clock() - t0
        if self.spec_model is not None and self.step_factory is not None:
            cand = [len(c) for _, c in blocks.values()]
            self._timing.record(self._cost(n_rows), sum(cand), sum(1 for n in cand if n), dt)
        prompts_done = 0
        spec = [0, 0, 0, 0]                       # verifies, committed, proposed, accepted
        decoded = [0, 0]                          # decoding sequences, the tokens they committed
        for (s, r), out in zip(entries, outs, strict=True):
            if not s.decoding:
                s.fed += len(r)
                if s.dec is not None:
                    if out.taps is None:
                        raise ValueError("verify_batch returned no tap features for a captured chunk")
                    s.dec.ring.append(out.taps)
                    s.dec.stats.prefill_rows += len(r)
                if not s.decoding:
                    continue                      # a middle chunk: no token yet
                prompts_done += len(s.prompt)
                row = out.logits[-1]
                s.out.push(s.sampler(row), row)
            elif s.dec is not None:
                props, cand = blocks.get(s, (None, []))
                tokens = s.dec.accept(props, len(cand) + 1, out, committed=not cand)
                if cand and s.block_survival is not None:     # how well the confidences foretold it
                    self._foretold = 0.98 * self._foretold + sum(s.block_survival[:len(cand)])
                    self._accepted = 0.98 * self._accepted + s.dec.last_accepted
                spec[0] += 1
                spec[1] += len(tokens)
                spec[2] += len(cand)
                spec[3] += s.dec.last_accepted
                decoded[0] += 1
                decoded[1] += len(tokens)
                for t in tokens:
                    if s.out.push(t):
                        break
            else:
                row = out.logits[-1]
                s.out.push(s.sampler(row), row)
                decoded[0] += 1
                decoded[1] += 1
        if self.step_factory is not None and spec[0] and not prompt_rows:     # pure decode passes
            # the whole pass as it ran, its choices and draft steps included: a first draft's context (the
            # prompt's) or a catch-up after undrafted passes is a one-off, but paid by the requests served;
            # every decoding sequence's tokens count (plain ones too: they share the pass and its time)
            self._guard.record(decoded[0], self._drafted, decoded[1], self._clock() - t_start)
        with self._cv:
            st = self._stats
            st.batch_rows, st.batch_sequences = n_rows, len(entries)
            st.prompt_tokens += prompts_done
            pre = dt * prompt_rows / n_rows
            st.prefill_seconds += pre
            st.decode_seconds += dt - pre
            if prompt_rows and pre > 0:
                st.last_prefill_tok_s = prompt_rows / pre
            if n_rows > prompt_rows and dt > pre:
                st.last_decode_tok_s = (n_rows - prompt_rows) / (dt - pre)
            st.spec_passes += spec[0]
            st.decode_passes += n_rows > prompt_rows
            st.drafted_passes += self._drafted
            st.spec_committed += spec[1]
            st.spec_proposed += spec[2]
            st.spec_accepted += spec[3]

    def _cost(self, n: int) -> float:
        """The model's cost(n rows), remembered while what it depends on stands: it changes with the
        expert cache's contents (a miss brings an expert in, and an eviction comes with a miss), and
        is asked again every COST_REFRESH passes in any case (a model loaded without stats). The
        allocator asks for a dozen widths in every pass; working them out anew each time cost the
        draft server ~0.3 ms a pass where nobody drafts."""
        assert self.spec_model is not None
        key = (self._stats.expert_misses, self._passes // COST_REFRESH)
        if key != self._cost_key:
            self._cost_key, self._cost_memo = key, {}
        c = self._cost_memo.get(n)
        if c is None:
            c = self._cost_memo[n] = self.spec_model.cost(n)
        return c

    def _pass_cost(self, rows: int) -> tuple[Callable[[int], float], float, float]:
        """PassTiming's view of a pass that holds `rows` rows before speculation: (seconds of a pass
        of n rows, a verify row's correction, a block's cost). The correction may be negative (it
        fixes cost()'s slope) but never takes a verify row below a fifth of what cost() says a row
        costs here."""
        scale, level, row_cost, block_cost = self._timing.coefficients()

        def cost(n: int) -> float:
            return scale * self._cost(n) + level
        slope = cost(rows + 1) - cost(rows)
        return cost, max(row_cost, -0.8 * slope), block_cost

    def _calibration(self) -> float:
        """Accepted / expected proposals so far (1 to start): a draft's confidence head may promise
        more than the target grants (the mini drafter's by about 1.6x), and the widths should be
        paid for with what is really accepted."""
        return min(1.0, (self._accepted + 4.0) / (self._foretold + 4.0))

    def _speculate(self, entries: list[tuple[_Seq, list[int]]]) -> dict[_Seq, tuple[Proposal, list[int]]]:
        """Steps 2-3 of the module docstring: -> the sequences that verify proposals this pass,
        with their proposal and the proposals to verify after the anchor."""
        spec_model = self.spec_model
        decs = [s for s, _ in entries if s.decoding and s.dec is not None]
        base_rows = sum(len(r) for _, r in entries)
        room = self.limit - base_rows
        if spec_model is None or not decs or room <= 0:
            return {}
        fixed = self._sampled_blocks([s for s in decs if not s.dec.sampling.greedy], room)
        room -= sum(len(c) for _, c in fixed.values())
        base_rows += sum(len(c) for _, c in fixed.values())
        n_decoders = sum(1 for s, _ in entries if s.decoding)     # the guard's count: plain ones too
        decs = [s for s in decs if s.dec.sampling.greedy]
        if not decs or room <= 0 or not self._guard.allow(n_decoders):
            return fixed
        # a prompt row is work the pass must do as much as a token: count it, so that speculation
        # does not slow down the prefill of others because their rows made the pass long
        base_tokens = sum(1 if s.decoding else len(r) for s, r in entries)
        cost, row_cost, block_cost = self._pass_cost(base_rows)

        def max_rows(s: _Seq, proposals: int) -> int:
            return max(1, min(proposals + 1, s.out.remaining))

        # 2. who drafts: the acceptance each has shown so far, its draft time
        claims = []
        share = self._draft_fit.per_sequence(len(decs))      # all of them drafting in one forward
        for s in decs:
            p = s.dec.draft.n_proposals
            d = s.dec.draft_seconds if s.dec.draft_seconds is not None else self._draft_s
            if share is not None:
                d = share
            if not s.dec.sampling.greedy:     # no timing in a sampled sequence's choices: its seed repeats
                d = 0.0
            elif self._sync_row_s is not None and d is not None:
                # a context behind its ring (never drafted, or not for a while) catches up first. That
                # one-off buys the drafted passes after it, not this one alone: spread over the passes
                # it may serve (up to REDRAFT_AFTER). Charged whole to one pass it grows with every
                # pass declined, and a sequence once behind would never draft again.
                passes = max(1, min(REDRAFT_AFTER, s.out.remaining // (p + 1)))
                d += max(0, s.dec.behind - p - 1) * self._sync_row_s / passes
            budget = s.dec.schedule.budget
            if budget is not None:        # a fixed verify budget: draft whenever it is > 1
                claims.append(Claim([1.0] * p, min(max_rows(s, p), budget), 0.0))
            else:
                surv = s.survival
                if surv is None or s.undrafted >= REDRAFT_AFTER:
                    surv = self._survival      # new, or not drafted for a while: what drafts get lately
                if surv is None or len(surv) != p:     # nothing seen yet: find out
                    surv, d = prefix_survival(s.dec.depth.rates(p)), 0.0
                claims.append(Claim(surv, max_rows(s, p), d or 0.0))
        widths = allocate_widths(claims, cost, base_rows, base_tokens, room, 0.0, row_cost, block_cost)
        drafted = [s for s, w in zip(decs, widths, strict=True) if w > 1]
        for s in decs:
            s.undrafted = 0 if s in drafted else s.undrafted + 1
        props: dict[_Seq, Proposal] = {}
        made = propose_many([s.dec for s in drafted], [s.out.last for s in drafted],
                            [s.out.remaining for s in drafted])     # one draft forward for all
        stepped = [s for s, pr in zip(drafted, made, strict=True) if pr is not None]
        if stepped:
            self._draft_fit.record(len(stepped), sum(s.dec.last_draft_seconds for s in stepped))
            late = [s.dec.last_sync for s in stepped if s.dec.last_sync[0] > s.dec.draft.n_proposals + 1]
            rows = sum(r for r, _ in late)
            if rows > 0:                          # catch-ups only: a step's own few rows are in its time
                rate = sum(t for _, t in late) / rows
                self._sync_row_s = rate if self._sync_row_s is None else 0.8 * self._sync_row_s + 0.2 * rate
        for s, pr in zip(drafted, made, strict=True):
            self._drafted = True
            if pr is not None and pr.tokens:
                props[s] = pr
                ds = s.dec.draft_seconds
                if ds is not None:
                    self._draft_s = ds if self._draft_s is None else 0.8 * self._draft_s + 0.2 * ds
        if not props:
            return fixed
        # 3. widths from the draft's own confidences; its cost is spent
        order = list(props)
        claims = []
        for s in order:
            conf = s.dec.confidence(props[s])
            limit = max_rows(s, len(props[s].tokens))
            sched = s.dec.schedule
            if sched.threshold > 0:
                k = 0
                while k < len(conf) and conf[k] >= sched.threshold:
                    k += 1
                limit = min(limit, k + 1)
            rho = self._calibration()
            surv = [rho * a for a in prefix_survival(conf)]
            s.block_survival = surv
            p = s.dec.draft.n_proposals
            if len(surv) == p:
                s.survival = _mean(s.survival, surv, 0.5)
                self._survival = _mean(self._survival, surv, 0.1)
            if sched.budget is not None:
                claims.append(Claim([1.0] * len(conf), min(limit, sched.budget), 0.0))
            else:
                claims.append(Claim(surv, limit, 0.0))
        spent = sum(s.dec.draft_seconds or 0.0 for s in order if s.dec.sampling.greedy)
        widths = allocate_widths(claims, cost, base_rows, base_tokens, room, spent, row_cost, block_cost)
        fixed.update({s: (props[s], props[s].tokens[:w - 1]) for s, w in zip(order, widths, strict=True)})
        return fixed

    def _sampled_blocks(self, decs: list[_Seq], room: int) -> dict[_Seq, tuple[Proposal, list[int]]]:
        """Sampled sequences' blocks, picked from nothing but their own draft: proposing draws from
        the sequence's generator, so whether it drafts and how wide it verifies must not depend on
        timing, on the expert cache or on what other requests taught the allocator, or a seeded
        request would not repeat. Each drafts whenever two rows fit and verifies the leading
        proposals its confidence passes (`schedule.threshold`; all of them without one)."""
        out: dict[_Seq, tuple[Proposal, list[int]]] = {}
        decs = [s for s in decs if s.dec.drafts(s.out.remaining)] if room >= 2 else []
        made: tuple[list[DraftBlock], list[float]] | None = None
        if batchable([s.dec for s in decs]):      # their blocks in one forward (no draws in it)
            made = draft_blocks([s.dec for s in decs], [s.out.last for s in decs])
        for j, s in enumerate(decs):
            if room < 2:
                continue
            if made is not None:
                pr = s.dec.propose_block(made[0][j], s.out.last, made[1][j])
            else:
                pr = s.dec.propose(s.out.last, s.out.remaining)
            self._drafted = True
            if pr is None or not pr.tokens:
                continue
            conf = s.dec.confidence(pr)
            k = len(pr.tokens)
            if s.dec.schedule.threshold > 0:
                k = 0
                while k < len(conf) and conf[k] >= s.dec.schedule.threshold:
                    k += 1
            if s.dec.schedule.budget is not None:
                k = min(k, s.dec.schedule.budget - 1)
            k = min(k, room - 1, s.out.remaining - 1)
            out[s] = (pr, pr.tokens[:k])
            room -= k
            s.block_survival = None
        return out

    def _retire(self, done: list[_Seq]) -> None:
        """Free finished sequences' states, count them, then post their FinishEvents."""
        if not done:
            return
        for seq in done:
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
