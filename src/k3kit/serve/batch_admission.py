"""Admission in the batching scheduler: when a worker woken from idle starts its first pass, which
waiting requests take a sequence state, and which of them get a SpeculativeDecoder.

Admission window: a worker woken from idle (no sequence active) starts its first pass once no
request has arrived for `admit_settle` (5 ms), or after `admit_max` (25 ms) at most, so that
clients starting together share that pass instead of the first prompt running alone while the
pass's threads hold back the others' arrival (`_settle`). A lone request pays `admit_settle` once;
a busy worker never waits (newcomers join the next pass anyway). Outputs do not depend on it.

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
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from k3kit.runtime.protocols import BatchedModel
from k3kit.serve.batch_cache import PromptCaching
from k3kit.serve.batch_sequence import _Seq
from k3kit.serve.batch_widths import SpeculativeWidths
from k3kit.serve.serial import StepFactory

ADMIT_SETTLE = 0.005     # s without a new request that ends the admission window (_settle)
ADMIT_MAX = 0.025        # s the admission window lasts at most
PLAIN_FROM = 6           # sequences active from which a greedy request may be admitted plain
RECENT_S = 0.25          # s a pass's sequence count stays the load requests are admitted under


class Admission(SpeculativeWidths, PromptCaching):
    """The admitting half of a BatchScheduler's worker: the admission window (_settle), taking
    waiting requests in (_admit), the load they are admitted under (_recent_load, _note_load) and
    whether each speculates (_speculates)."""

    model: BatchedModel
    step_factory: StepFactory | None
    max_sequences: int
    admit_settle: float
    admit_max: float
    _cv: threading.Condition
    _queue: deque[_Seq]
    _ahead: deque[_Seq]
    _active: list[_Seq]
    _closed: bool
    _submitted: int
    _clock: Callable[[], float]
    _budgeted: bool | None
    _would_memo: bool | None
    _load: tuple[int, float]

    def _admit(self) -> None:
        """Waiting requests into the active set, up to max_sequences (the lock held): each opens its
        sequence state and, where it speculates, gets its SpeculativeDecoder. One whose prompt
        extends a running prefill ahead waits for it; prefills ahead come in only when no request
        waits (k3kit.serve.batch)."""
        coming = max(min(self.max_sequences, len(self._active) + len(self._queue)),
                     self._recent_load())
        self._would_memo = None
        ahead = [s for s in self._active if s.request.ahead and not s.out.done]
        held: list[_Seq] = []
        while self._queue and len(self._active) < self.max_sequences:
            seq = self._queue.popleft()
            if seq.request.cache_prompt and any(_extends(seq, a) for a in ahead):
                held.append(seq)
                continue
            for a in [a for a in self._ahead if _extends(seq, a)]:
                self._ahead.remove(a)             # its rows are this request's: no point in both
            self._open(seq, coming)
        self._queue.extendleft(reversed(held))
        while self._ahead and not self._queue and len(self._active) < self.max_sequences:
            self._open(self._ahead.popleft(), coming)

    def _open(self, seq: _Seq, coming: int) -> None:
        """Give `seq` its sequence state (and decoder), then restore what the prompt cache holds."""
        seq.handle = self.model.open_sequence()
        self._active.append(seq)
        if self.step_factory is not None and self.spec_model is not None \
                and seq.request.may_draft:
            if self._speculates(seq, coming):
                target = self.spec_model.sequence_target(seq.handle)
                dec = self.step_factory(target, seq.sampler)
                self._proposals = dec.draft.n_proposals
                self._budgeted = dec.schedule.budget is not None
                # a decoder that does not mask with the request's grammar would not follow it
                if getattr(dec, "constraint", None) is seq.sampler.constraint:
                    seq.dec = dec
            else:
                self._stats.plain_sequences += 1
        self._restore(seq)

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


def _extends(seq: _Seq, ahead: _Seq) -> bool:
    """Whether `seq`'s prompt starts with the prompt of the prefill ahead `ahead`."""
    return len(seq.prompt) >= len(ahead.prompt) and seq.prompt[:len(ahead.prompt)] == ahead.prompt
