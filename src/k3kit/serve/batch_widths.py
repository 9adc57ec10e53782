"""The speculative widths of the batching scheduler: in each pass, which decoding sequences draft
and how wide each verifies, so that drafting pays for itself in tokens per second of the whole pass.

Speculative decoding (`step_factory`, the server's `--draft`; a SpeculativeBatchedModel):
every decoding sequence that does not ask for logprobs has its own SpeculativeDecoder over its
own sequence (`sequence_target`), with its own feature ring and draft context. Per pass:
  1. the plan (k3kit.serve.batch_passes: one row per decoder, prompt chunks) fixes R rows; the
     room left under the row limit is what speculation may use;
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

The state it reads and updates is the scheduler's (k3kit.serve.batch.BatchScheduler, which
inherits this class); the attributes below say which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from k3kit.runtime.protocols import SpeculativeBatchedModel
from k3kit.runtime.speculative import DraftBlock
from k3kit.runtime.speculative.decoder import draft_blocks, propose_many
from k3kit.runtime.speculative.proposal import Proposal
from k3kit.runtime.speculative.schedule import Claim, DraftCost, DraftGuard, allocate_widths, prefix_survival
from k3kit.serve.batch_sequence import _Seq
from k3kit.serve.batch_timing import PassTiming
from k3kit.serve.scheduler import SchedulerStats

REDRAFT_AFTER = 8        # passes without a draft after which a sequence is judged by everyone's drafts
COST_REFRESH = 32        # passes between fresh asks of the model's cost(), the expert cache unchanged


def _mean(old: list[float] | None, new: list[float], weight: float) -> list[float]:
    """A running mean of survival vectors: `weight` on the new one."""
    if old is None:
        return list(new)
    return [(1 - weight) * a + weight * b for a, b in zip(old, new, strict=True)]


class SpeculativeWidths:
    """The speculative half of a BatchScheduler: steps 2-3 of the module docstring (_speculate,
    _sampled_blocks), the pass costs they weigh (_cost, _pass_cost, _calibration), and whether
    a greedy request admitted under load could draft at all (_would_draft)."""

    spec_model: SpeculativeBatchedModel | None
    limit: int
    _stats: SchedulerStats
    _passes: int
    _cost_memo: dict[int, float]
    _cost_key: tuple[int, int] | None
    _timing: PassTiming
    _guard: DraftGuard
    _draft_fit: DraftCost
    _draft_s: float | None
    _sync_row_s: float | None
    _drafted: bool
    _foretold: float
    _accepted: float
    _survival: list[float] | None
    _proposals: int | None
    # Whether these decoders' draft steps can run as one forward
    # (k3kit.runtime.speculative.decoder.batchable): BatchScheduler's method, which looks the
    # function up in serve.batch, where tests patch it.
    _batchable: Callable[[list[Any]], bool]

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
        if self._batchable([s.dec for s in decs]):      # their blocks in one forward (no draws in it)
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
