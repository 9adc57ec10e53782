"""Pass building in the batching scheduler: which rows of which sequences go into the next target
pass (_plan), and running it (_run): verifying the speculative blocks, sampling or accepting each
sequence's tokens, and the pass's statistics.

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
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from k3kit.runtime.protocols import BatchedModel, VerifyOutput
from k3kit.serve.batch_cache import PromptCaching
from k3kit.serve.batch_sequence import _Seq
from k3kit.serve.batch_widths import SpeculativeWidths
from k3kit.serve.serial import StepFactory


class PassBuilder(SpeculativeWidths, PromptCaching):
    """The pass half of a BatchScheduler's worker: one pass's plan and its run."""

    model: BatchedModel
    step_factory: StepFactory | None
    prefill_chunk: int
    _cv: threading.Condition
    _active: list[_Seq]
    _clock: Callable[[], float]
    _rr: int
    _turn: int
    _last_exclusive: bool

    def _plan(self) -> list[tuple[_Seq, list[int]]]:
        """This pass's (sequence, rows); see the module docstring for the rules."""
        decoders = [s for s in self._active if s.decoding and not s.out.done]
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
                self._prefill_point(s, out.logits[-1])
                if not s.decoding:
                    continue                      # a middle chunk: no token yet
                if s.request.ahead:               # a prefill ahead: its state is all it is for
                    s.out.cancel("length")
                    continue
                prompts_done += len(s.prompt) - s.out.cached_tokens
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
