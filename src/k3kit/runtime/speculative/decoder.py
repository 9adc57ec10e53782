"""The speculative decoder as a step object: prefill once, then one draft + verify per call.

`speculative_generate` (loop.py) drives it to completion; the engine (k3kit.runtime.engine)
drives it token-stream style, so `k3kit generate --draft` streams, stops and reports exactly
like plain decoding. Both paths run the same code, so what the exactness tests prove about
one holds for the other.

Invariant between calls: the target has committed every output token except the last one
(the anchor); the feature ring holds exactly the committed positions; the anchor sits at
position == target.position. One call = one draft step + one target verify of
[anchor, proposals[:n-1]], then commit(accepted + 1) and append those rows' tap features.
`step` is `propose` (the draft half), `width` (the cost model) and `accept` (the target half,
given the verify's output): a batching server (k3kit.serve.batch) calls the halves itself, so
that one target pass verifies the blocks of many sequences, each with its own decoder.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from k3kit.runtime.protocols import CommittingTarget, Draft, DraftBlock, Target, VerifyOutput
from k3kit.runtime.speculative.accept import accept_greedy, accept_sampled
from k3kit.runtime.speculative.feature_ring import FeatureRing
from k3kit.runtime.speculative.proposal import Proposal, chain, propose
from k3kit.runtime.speculative.sampling import Sampling, biased, probs
from k3kit.runtime.speculative.schedule import (
    DepthAcceptance,
    ScheduleConfig,
    choose_width,
    expected_tokens,
    prefix_survival,
)

if TYPE_CHECKING:
    from k3kit.runtime.constraint import Constraint
    from k3kit.runtime.sampling import History

REPLAY_COUNTERS = ("replay_fast_commits", "replay_full_replays", "replay_failed_fallbacks")
PROBE_FIRST, PROBE_MAX = 8, 256     # declined serial passes between two that draft anyway (doubling)
JUDGE_AFTER = 4                     # drafted steps before a serial decoder may decline to draft
REALIZED_AFTER = 8                  # drafted passes before what they realized may decline drafting
REALIZED_FORGET = 0.9               # weight of the older drafted passes in that rate, per pass
REALIZED_FLOOR = 0.9                # ... declining only below this share of the plain rate (noise)


def _taps(out: VerifyOutput) -> Tensor:
    """The tap features of a verify made with capture=True (the ring needs one row per committed position)."""
    if out.taps is None:
        raise ValueError("target.verify(capture=True) returned no tap features")
    return out.taps


@dataclass
class DecodeStats:
    prefill_rows: int = 0
    target_passes: int = 0                                     # verify calls after the prefill
    draft_steps: int = 0
    plain_passes: int = 0                                      # serial passes that declined to draft
    committed_per_pass: list[int] = field(default_factory=list)   # tokens emitted per pass
    acceptance_histogram: list[int] = field(default_factory=list)  # [m] = passes accepting m
    verify_rows: list[int] = field(default_factory=list)        # rows verified per pass
    target_counters: dict[str, int] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Tokens committed per target pass (1.0 for plain decoding)."""
        return sum(self.committed_per_pass) / max(1, len(self.committed_per_pass))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("target_counters"))
        d["tau"] = self.tau
        d["verify_rows_total"] = sum(self.verify_rows)
        return d

    def summary(self) -> dict[str, Any]:
        """The figures `k3kit generate --draft --json` reports: averages and totals, not lists
        (committed_per_pass is the mean tokens committed per target pass)."""
        out = {
            "target_passes": self.target_passes,
            "draft_steps": self.draft_steps,
            "plain_passes": self.plain_passes,
            "committed_per_pass": self.tau,
            "acceptance_histogram": list(self.acceptance_histogram),
            "verify_rows": sum(self.verify_rows),
        }
        for k in REPLAY_COUNTERS:
            out[k] = int(self.target_counters.get(k, 0))
        return out


def merge_counters(target: Target, stats: DecodeStats) -> None:
    """A target's own counters: from `counters()` if it has one, else the replay attributes."""
    counters = getattr(target, "counters", None)
    if callable(counters):
        stats.target_counters = {k: int(v) for k, v in counters().items()}
    else:
        stats.target_counters = {k: int(getattr(target, k)) for k in REPLAY_COUNTERS if hasattr(target, k)}


class SpeculativeDecoder:
    """Draft-and-verify decoding of one sequence, one pass per call.

    `prefill(chunk)` feeds prompt rows (taps captured into the ring) and returns the last row's
    logits; `step(anchor, remaining)` returns the tokens one pass commits (1..block+1, never
    more than `remaining`, cut after a stop token). Sampling draws come from `generator`, the
    same one that picked the anchor, so a seed fixes the whole output. `clock` times the draft
    steps and verifies (seconds; tests pass a clock of their own). `history`: the sequence's
    k3kit.runtime.sampling.History (its Sampler's), needed when the sampling has history
    penalties: verify row k is penalized with the history plus the block's proposals[:k], as
    plain decoding would penalize it, and the accepted tokens join the history. The logit bias
    and min-p are per row and need nothing. The draft's proposals see the bias but not the
    penalties: acceptance judges them against the target's penalized rows, so the output is
    still exactly plain decoding's (greedy) or distributed as it (sampled). `constraint`: the
    sequence's k3kit.runtime.constraint.Constraint (its Sampler's), when a grammar constrains it:
    verify row k is masked with the grammar's state after the block's proposals[:k] (after the
    bias and the penalties, as plain decoding masks it), so a proposal the grammar forbids is
    rejected by the target's masked distribution; the accepted tokens advance it, and a block is
    cut after the token that completes the grammar, where plain decoding ends. The draft proposes
    under the grammar too (k3kit.runtime.speculative.proposal), so its blocks follow it.
    """

    def __init__(self, target: Target, draft: Draft, sampling: Sampling, generator: torch.Generator, *,
                 schedule: ScheduleConfig | None = None, ring: FeatureRing | None = None,
                 ring_storage: str = "f16", ring_capacity: int = 4096, stop_ids: Iterable[int] = (),
                 clock: Callable[[], float] = time.perf_counter, history: History | None = None,
                 constraint: Constraint | None = None):
        if sampling.penalized and history is None:
            raise ValueError("sampling with history penalties needs the sequence's History (Sampler.history)")
        self.target, self.draft, self.sampling, self.gen = target, draft, sampling, generator
        self.history = history if sampling.penalized else None
        self.constraint = constraint
        self.clock = clock
        self.schedule = schedule or ScheduleConfig()
        self.stop = set(stop_ids)
        self.stats = DecodeStats(acceptance_histogram=[0] * (draft.n_proposals + 1))
        self.depth = DepthAcceptance()
        self.draft_seconds: float | None = None    # running mean of a draft step's wall time
        self.last_draft_seconds = 0.0              # the last step's (a batched step: its share)
        self.last_accepted = 0                     # proposals the last accept() kept
        self._synced = 0                           # ring length at the last draft step
        self.last_sync = (0, 0.0)                  # (ring rows, seconds) the last step's sync brought in
        self.verify_scale: dict[bool, float] = {}  # step()'s verify seconds / target.cost, by width > 1
        self.verify_seen: dict[int, float] = {}    # step()'s verify seconds by width (running means)
        self._declined, self._probe_every = 0, PROBE_FIRST
        self._unjudged = JUDGE_AFTER               # draft steps to take before draft_pays judges
        self._plain_asked = 0                      # plain passes draft_pays asked for, to time
        self._plain_timed = 0                      # one-row verifies timed
        self.probing = False                       # the last draft_pays drafted only to look again
        # drafted passes as realized: (tokens, seconds) sums with forgetting, and how many
        self._realized = (0.0, 0.0)
        self._realized_n = 0
        if ring is None:
            ring = FeatureRing(draft.feature_width, capacity=ring_capacity, storage=ring_storage)
        if ring.length != target.position:
            raise ValueError(f"feature ring holds {ring.length} positions, target is at {target.position}")
        self.ring = ring

    def prefill(self, ids: Sequence[int]) -> Tensor:
        """Commit prompt rows with their tap features; -> logits of the last row [1, V]."""
        part = [int(t) for t in ids]
        out = self.target.verify(part, capture=True, all_logits=False)
        self.target.commit(len(part))
        self.ring.append(_taps(out))
        self.stats.prefill_rows += len(part)
        return out.logits[-1:]

    def propose(self, anchor: int, remaining: int) -> Proposal | None:
        """The draft half of a step: sync the draft to the ring and propose a block after
        `anchor` (None when there is nothing to propose: a fixed budget of 1 row, or one token
        left). Times the draft step (`draft_seconds`, a running mean)."""
        if not self.drafts(remaining):
            return None
        dt = self._sync()
        t1 = self.clock()
        props = propose(self.draft, anchor, self.target.position, self.sampling, self.gen, self.constraint)
        self._stepped(dt + self.clock() - t1)
        return props

    def drafts(self, remaining: int) -> bool:
        """Whether `propose` would draft at all (a fixed budget of 1 row, or one token left: no)."""
        return self.schedule.budget != 1 and remaining > 1

    def _sync(self) -> float:
        """Sync the draft to the ring; -> the seconds that count as the step's (a step's own sync;
        a prompt's context is a one-off, not a step's cost)."""
        t0 = self.clock()
        self.draft.sync(self.ring)
        dt = self.clock() - t0
        rows = self.behind
        own = rows <= self.draft.n_proposals + 1
        self.last_sync = (rows, dt)
        self._synced = self.ring.length
        return dt if own else 0.0

    @property
    def behind(self) -> int:
        """Ring rows the draft's context has not seen (what the next step's sync brings in)."""
        return self.ring.length - self._synced

    def _stepped(self, dt: float) -> None:
        self.last_draft_seconds = dt
        self.draft_seconds = dt if self.draft_seconds is None else 0.8 * self.draft_seconds + 0.2 * dt
        self.stats.draft_steps += 1

    def propose_block(self, block: DraftBlock, anchor: int, seconds: float = 0.0) -> Proposal:
        """The rest of a draft step whose block `draft_blocks` made: the Markov chain with this
        sequence's sampling and generator (its draws, as `propose` makes them). `seconds`: this
        sequence's share of the block's making, counted with the chain as its step time."""
        t0 = self.clock()
        props = chain(self.draft, [block], [anchor], [self.sampling], [self.gen], [self.constraint])[0]
        self._stepped(seconds + self.clock() - t0)
        return props

    def confidence(self, props: Proposal) -> list[float]:
        """Per-proposal acceptance chances: the draft's confidence head, else the rates seen so far."""
        if props.confidence is not None:
            return [float(c) for c in props.confidence.tolist()]
        return self.depth.rates(len(props.tokens))

    def width(self, props: Proposal | None, remaining: int) -> int:
        """This sequence's own verify width (alone in its pass): the cost model's choice."""
        if props is None:
            return 1
        sched = self.schedule
        if sched.draft_cost is None:      # the draft's own measured time, when cost() is seconds;
            # none for a sampled sequence: its widths decide its draws, which must not depend on
            # timing (a seed must repeat), as in the batched server
            sched = replace(sched, draft_cost=self.draft_seconds if self.sampling.greedy else 0.0)
        # a greedy sequence prices widths with what its verifies took (its output cannot depend
        # on it); a sampled one with the model alone, for the reason above
        measured = self.sampling.greedy and self.schedule.draft_cost is None
        cost = self._seconds if measured else self.target.cost
        return choose_width(self.confidence(props), cost, min(len(props.tokens) + 1, remaining), sched)

    def accept(self, props: Proposal | None, width: int, v: VerifyOutput,
               committed: bool = False) -> list[int]:
        """The target half of a step: `v` verified [anchor, props.tokens[:width-1]] (capture on);
        accept (greedy or lossless sampled), commit the accepted rows and ring their taps.
        -> the committed tokens; `last_accepted` is how many proposals survived.
        `committed`: a one-row block that the pass committed already (a server's plain decode row,
        run as an ordinary batched row: no pending verify to keep); the token is chosen as for
        any one-row block."""
        target, st = self.target, self.stats
        cand = props.tokens[: width - 1] if props else []
        if committed and cand:
            raise ValueError(f"a committed row is a one-row block, not {len(cand) + 1} rows")
        if v.logits.shape[0] != len(cand) + 1:
            raise ValueError(f"verify returned {v.logits.shape[0]} rows for a block of {len(cand) + 1}")
        rows = biased(v.logits, self.sampling)
        if self.history is not None:            # row k sees the history and cand[:k], as plain decoding
            rows = self.history.penalize(rows, cand)
        if self.constraint is not None:         # row k with the grammar's state after cand[:k]
            rows = self.constraint.mask(rows, cand)
        if self.sampling.greedy:
            m, nxt = accept_greedy(cand, rows)
        else:
            if props is None:
                q = torch.zeros(0, v.logits.shape[1], dtype=torch.float64)
            elif props.q is None:       # propose() fills q whenever sampling is not greedy
                raise ValueError("sampled decoding needs the proposals' distributions (Proposal.q)")
            else:
                q = props.q[: len(cand)]
            m, nxt = accept_sampled(cand, q, probs(rows, self.sampling), self.gen)
        new = [*cand[:m], nxt]
        for j, t in enumerate(new):
            if t in self.stop:
                new = new[: j + 1]
                break
        if self.constraint is not None:         # cut after the token that completes the grammar
            new = new[: self.constraint.consume(new)]
        if self.history is not None:
            self.history.extend(new)
        n_commit = len(new)                 # anchor + accepted proposals up to the last new one
        if not committed:
            target.commit(n_commit)
        self.ring.append(_taps(v)[:n_commit])

        st.target_passes += 1
        st.verify_rows.append(len(cand) + 1)
        st.committed_per_pass.append(len(new))
        st.acceptance_histogram[m] += 1
        if cand:
            self.depth.record(len(cand), m)
        self.last_accepted = m
        return new

    def draft_pays(self, remaining: int) -> bool:
        """Whether `step` drafts: a draft step must be able to commit more tokens per second than a
        plain pass, judged from the highest acceptance per depth the counts allow (Wilson upper
        bounds: the counts, not a prior, must say no), the draft step's measured time and the
        verifies' (their seconds over target.cost, apart for one row and for more), and, after
        REALIZED_AFTER drafted passes, what those passes realized (tokens committed over their
        draft and verify seconds, recent passes weighing most) above REALIZED_FLOOR of the plain
        rate (a pass's rate is noisy: near the break-even this keeps drafting): the bounds stay optimistic
        over a short request, where a drafter often wrong (a JSON schema's free spacing on the
        mini) still seemed to pay. A
        drafter that is seldom right otherwise costs its step on every pass (a random drafter on a
        K3-geometry slice: 2.6 tok/s against 5.8 without it). After PROBE_FIRST declined passes one
        drafts anyway, to see whether it pays now (the interval doubles up to PROBE_MAX while the
        verdict stands). The first JUDGE_AFTER steps draft, and so do the JUDGE_AFTER after a probe
        that paid (committed more tokens per second than a plain pass would): a drafter is often
        wrong just after a prompt and right after that (the shipped mini's, on some prompts), and
        acceptance counted since the start would take many probes to say so. After the first ones,
        one pass is plain where none has been timed, and one more before the realized rate first
        judges (the faster of the two counts: the first may have read experts): the plain rate is
        measured, not extrapolated from wide verifies (which price a one-row pass far above a target
        whose one-row step is cheaper than a block's first row, the mini's row step). Only for greedy
        sequences whose draft cost is measured (`draft_cost` None: target.cost is seconds): their
        output does not depend on it, while a sampled sequence's draws must not depend on timing
        (a seed must repeat), so those always draft."""
        self.probing = False
        if not self.drafts(remaining):
            return False
        sched, d = self.schedule, self.draft_seconds
        if (not self.sampling.greedy or sched.budget is not None or sched.draft_cost is not None
                or d is None or not self.verify_scale or self._unjudged > 0):
            return True
        if (self._plain_asked == 0 and 1 not in self.verify_seen) or \
                (self._plain_asked == 1 and self._plain_timed < 2 and self._realized_n >= REALIZED_AFTER):
            # a plain pass, timed: the rate drafting is judged against (twice: the first may have
            # read experts a warm pass would not)
            self._plain_asked += 1
            return False
        seconds = self._seconds
        surv = prefix_survival(self.depth.upper(self.draft.n_proposals))
        rows = min(self.draft.n_proposals + 1, remaining)
        drafted = max(expected_tokens(surv, n) / (seconds(n) + d) for n in range(2, rows + 1))
        plain = self._plain_seconds()
        pays = drafted * plain > 1.0
        if pays and self._realized_n >= REALIZED_AFTER:   # and what drafted passes did commit per second
            tokens, secs = self._realized
            pays = tokens / secs * plain > REALIZED_FLOOR
        if pays:
            self._declined, self._probe_every = 0, PROBE_FIRST
            return True
        self._declined += 1
        if self._declined < self._probe_every:
            return False
        self._declined, self._probe_every = 0, min(2 * self._probe_every, PROBE_MAX)
        self.probing = True
        return True

    def _plain_seconds(self) -> float:
        """A one-row pass in seconds, the plain rate drafting is judged against: as measured
        where one ran, else the larger of the model's estimate and the blocks' line at one row
        (the model's can be far under: the mini's, scaled by wide verifies, says 1.8 ms for
        2.5; a line through wide verifies overprices a one-row pass, the cautious side: drafting
        is declined only where it does worse than that)."""
        if 1 in self.verify_seen:
            return self.verify_seen[1]
        seen = {w: t for w, t in self.verify_seen.items() if w > 1}
        line = self._line(seen, 1) if len(seen) >= 2 else 0.0
        return max(self._seconds(1), line)

    @staticmethod
    def _line(seen: dict[int, float], n: int) -> float:
        """The least-squares line through (width, seconds) points at n (slope >= 0)."""
        xs, ys = list(seen), list(seen.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var)
        return max(my + slope * (n - mx), 0.25 * min(ys))

    def _seconds(self, n: int) -> float:
        """A verify of n rows in seconds. For n > 1, once verifies of two widths > 1 or more are
        measured, the least-squares line through their running means (slope >= 0): a model's
        rows-to-seconds slope can be far off for a small model, where a pass is mostly fixed host
        work (the mini: 3.0 ms for two rows, +0.23 ms a row measured against +1.5 priced), and a
        priced slope too steep keeps verifies narrower than pays. Otherwise target.cost(n) scaled
        by what verifies measured (of one row, or of more; the other where one is not measured):
        one row is a plain decode step, not a point on the blocks' line."""
        seen = {w: t for w, t in self.verify_seen.items() if w > 1}
        if n > 1 and len(seen) >= 2:
            return self._line(seen, n)
        scale, wide = self.verify_scale, n > 1
        return scale.get(wide, scale.get(not wide, 1.0)) * self.target.cost(n)

    def step(self, anchor: int, remaining: int) -> list[int]:
        """One pass alone: propose (if drafting pays), pick the width, verify [anchor, proposals],
        accept."""
        props = self.propose(anchor, remaining) if self.draft_pays(remaining) else None
        if props is None and self.drafts(remaining):
            self.stats.plain_passes += 1
        width = self.width(props, remaining)
        if self.probing and props is not None:        # a probe verifies all it has: it is there to see
            width = min(len(props.tokens) + 1, remaining)
        cand = props.tokens[: width - 1] if props else []
        # a plain pass commits its one row whatever it samples (a grammar that has not ended keeps
        # any one token its mask allows): where the target can, it runs as a plain decode step
        # that returns the taps, with nothing pending
        committed = not cand and (self.constraint is None or not self.constraint.stopped) \
            and isinstance(self.target, CommittingTarget)
        t0 = self.clock()
        if committed:
            v = cast(CommittingTarget, self.target).forward_taps([anchor])
        else:
            v = self.target.verify([anchor, *cand], capture=True)
        dt, cost = self.clock() - t0, self.target.cost(width)
        if dt > 0 and cost > 0:
            key, ratio = width > 1, dt / cost
            old = self.verify_scale.get(key)
            self.verify_scale[key] = ratio if old is None else 0.8 * old + 0.2 * ratio
            seen = self.verify_seen.get(width)
            if width == 1:               # the first two one-row timings: the faster (a cold first one)
                self._plain_timed += 1
                self.verify_seen[1] = dt if seen is None else min(seen, dt) if self._plain_timed <= 2 \
                    else 0.8 * seen + 0.2 * dt
            else:
                self.verify_seen[width] = dt if seen is None else 0.8 * seen + 0.2 * dt
        tokens = self.accept(props, width, v, committed=committed)
        if props is not None:
            self._unjudged = max(0, self._unjudged - 1)
            f, (tok, sec) = REALIZED_FORGET, self._realized
            self._realized = (f * tok + len(tokens), f * sec + self.last_draft_seconds + dt)
            self._realized_n += 1
            if self.probing and len(tokens) * self._plain_seconds() > self.last_draft_seconds + dt:
                self._unjudged, self._probe_every = JUDGE_AFTER, PROBE_FIRST    # a probe that paid
                self._realized, self._realized_n = (0.0, 0.0), 0
        return tokens

    __call__ = step

    def finish(self) -> DecodeStats:
        """The statistics, with the target's counters (replay, experts) merged in."""
        merge_counters(self.target, self.stats)
        return self.stats


def batchable(decoders: Sequence[SpeculativeDecoder]) -> bool:
    """Whether these decoders can draft in one forward: one draft that makes blocks together
    (`draft_blocks`, `context`), and no decoder whose `propose` was replaced on the instance (an
    instrumented one keeps its own draft step)."""
    if len(decoders) < 2:
        return False
    draft = decoders[0].draft
    return (hasattr(draft, "draft_blocks") and hasattr(draft, "context")
            and all(d.draft is draft and "propose" not in vars(d) for d in decoders))


def draft_blocks(decoders: Sequence[SpeculativeDecoder],
                 anchors: Sequence[int]) -> tuple[list[DraftBlock], list[float]]:
    """The draft forward of several decoders' steps as one (`batchable` ones): each ring synced,
    then every block after its anchor in one forward. -> (the blocks, each decoder's seconds so
    far: its share of the forward and its own sync; `propose_block` adds its chain)."""
    draft: Any = decoders[0].draft
    ctxs, own = [], []
    for d in decoders:
        own.append(d._sync())
        ctxs.append(draft.context())
    t0 = time.perf_counter()
    blocks = draft.draft_blocks(ctxs, anchors, [d.target.position for d in decoders])
    share = (time.perf_counter() - t0) / len(decoders)
    return blocks, [share + dt for dt in own]


def propose_many(decoders: Sequence[SpeculativeDecoder], anchors: Sequence[int],
                 remainings: Sequence[int]) -> list[Proposal | None]:
    """`propose` for several decoders, drafted in one forward when they are `batchable`, else one
    by one. Each block is its own draft_block's; a sampled decoder's proposal is then exactly its
    `propose`'s, greedy ones chain together (`chain`: the same tokens unless a Markov row's last
    bit breaks a tie; tests/runtime/test_spec_batch.py). Each decoder's step time
    (`draft_seconds`) is its share of the batch's."""
    out: list[Proposal | None] = [None] * len(decoders)
    idx = [i for i, d in enumerate(decoders) if d.drafts(remainings[i])]
    group = [decoders[i] for i in idx]
    if not batchable(group):
        for i in idx:
            out[i] = decoders[i].propose(anchors[i], remainings[i])
        return out
    blocks, seconds = draft_blocks(group, [anchors[i] for i in idx])
    greedy = [j for j, d in enumerate(group) if d.sampling.greedy]
    for j, d in enumerate(group):
        if not d.sampling.greedy:            # chains alone: its draws are exactly propose's
            out[idx[j]] = d.propose_block(blocks[j], anchors[idx[j]], seconds[j])
    if greedy:
        t0 = time.perf_counter()
        props = chain(group[0].draft, [blocks[j] for j in greedy], [anchors[idx[j]] for j in greedy],
                      [group[j].sampling for j in greedy], [group[j].gen for j in greedy],
                      [group[j].constraint for j in greedy])
        dt = (time.perf_counter() - t0) / len(greedy)
        for j, p in zip(greedy, props, strict=True):
            group[j]._stepped(seconds[j] + dt)
            out[idx[j]] = p
    return out
