"""A serial SpeculativeDecoder (`k3kit generate --draft`, the one-request server) declines to draft
where drafting does not pay, with a clock of the test's own: every verify of n rows takes
target.cost(n) seconds and every draft step `draft_s`, so the decisions follow from the figures
given and nothing else."""

import pytest
import torch
from toy_target import (
    OracleDraft,
    ToyTarget,
    one_thread,  # noqa: F401  (autouse fixture)
)

from k3kit.runtime.speculative import Sampling, ScheduleConfig, SpeculativeDecoder, ar_generate
from k3kit.runtime.speculative.decoder import JUDGE_AFTER, PROBE_FIRST, PROBE_MAX, REALIZED_AFTER
from k3kit.runtime.speculative.sampling import pick

PROMPT = [3, 17, 5, 9, 1]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TimedTarget(ToyTarget):
    """A verify of n rows takes cost(n) seconds on `clock`; `on_verify` is called after each."""

    def __init__(self, clock, on_verify):
        super().__init__(cost=lambda rows: 1.0 + 0.1 * rows)
        self.clock, self.on_verify = clock, on_verify

    def verify(self, ids, capture=True, all_logits=True):
        self.clock.t += self.cost(len(ids))
        self.on_verify()
        return super().verify(ids, capture, all_logits)


class TimedDraft(OracleDraft):
    """A draft step takes `seconds` on `clock`."""

    def __init__(self, target, block, p_good, clock, seconds):
        super().__init__(target, block, p_good)
        self.clock, self.seconds = clock, seconds

    def draft_block(self, anchor, position):
        self.clock.t += self.seconds
        return super().draft_block(anchor, position)


def _run(p_good, draft_s, n, sampling=None, block=7, switch_at=None, schedule=None):
    """Decode n tokens serially; -> (tokens, stats, seconds on the clock, decoder).
    `switch_at`: after that many verifies the draft becomes always right."""
    sampling = sampling or Sampling()
    clock, verifies = Clock(), [0]

    def on_verify():
        verifies[0] += 1
        if switch_at is not None and verifies[0] >= switch_at:
            draft.p_good = 1.0

    target = TimedTarget(clock, on_verify)
    draft = TimedDraft(target, block, p_good, clock, draft_s)
    gen = sampling.generator()
    dec = SpeculativeDecoder(target, draft, sampling, gen, clock=clock,
                             schedule=schedule or ScheduleConfig(draft_cost=None))
    tokens = [pick(dec.prefill(PROMPT)[-1], sampling, gen)]
    t0 = clock.t
    while len(tokens) < n:
        tokens.extend(dec.step(tokens[-1], n - len(tokens)))
    return tokens, dec.finish(), clock.t - t0, dec


def _probes(plain_passes):
    """Probes among `plain_passes` declined passes: one after PROBE_FIRST, then doubling intervals."""
    k, every, left = 0, PROBE_FIRST, plain_passes
    while left >= every:
        left -= every
        k += 1
        every = min(2 * every, PROBE_MAX)
    return k


def test_a_never_right_draft_stops_drafting_and_probes_at_doubling_intervals():
    """A draft that is never right and costs two passes a step: after JUDGE_AFTER steps the decoder
    runs plain passes (same tokens as AR), drafting again only to probe, after PROBE_FIRST declined
    passes and then twice as many each time; the clock shows what that saves."""
    n = 120
    tokens, st, seconds, _ = _run(0.0, 2.0, n)
    assert tokens == ar_generate(ToyTarget(), PROMPT, n, Sampling()).tokens
    assert st.acceptance_histogram[0] == st.target_passes           # nothing was ever accepted
    assert st.plain_passes > 0
    assert st.draft_steps == JUDGE_AFTER + _probes(st.plain_passes)
    assert st.draft_steps + st.plain_passes == st.target_passes - 1   # the last pass has 1 token to go
    # what always drafting would have cost: every pass a draft step and a wider verify
    _, st_fixed, seconds_fixed, _ = _run(0.0, 2.0, n, schedule=ScheduleConfig(budget=2))
    assert st_fixed.draft_steps == st_fixed.target_passes - 1
    ar_seconds = (n - 1) * 1.1                   # n - 1 plain passes of one row
    assert seconds < 0.45 * seconds_fixed
    assert seconds < 1.15 * ar_seconds


def test_a_good_draft_is_never_declined():
    """A draft right 95% of the time whose step costs a fifth of a pass: every pass drafts but the
    two plain passes that time the rate drafting is judged against (after the first JUDGE_AFTER
    drafted ones, and before the realized rate first judges)."""
    n = 120
    tokens, st, _, dec = _run(0.95, 0.2, n)
    assert tokens == ar_generate(ToyTarget(), PROMPT, n, Sampling()).tokens
    assert st.plain_passes == 2 and 1 in dec.verify_seen
    plain = [i for i, w in enumerate(st.verify_rows[:-1]) if w == 1]
    assert plain == [JUDGE_AFTER, REALIZED_AFTER + 1]     # REALIZED_AFTER drafted passes, one plain before
    assert st.tau > 3


def test_a_draft_that_becomes_right_is_taken_up_again():
    """Wrong for the first 40 passes, always right after: the first probe after that pays, and from
    it on every pass drafts (the acceptance seen since the start would still condemn the draft for
    several probes: the steps after a paid probe are not judged)."""
    n = 400
    tokens, st, _, dec = _run(0.0, 2.0, n, switch_at=40)
    assert tokens == ar_generate(ToyTarget(), PROMPT, n, Sampling()).tokens
    assert st.plain_passes > 20
    widths = st.verify_rows
    first = next(i for i, w in enumerate(widths) if i >= 40 and w > 1)
    assert first < 40 + 2 * PROBE_FIRST * 2 ** 3
    assert all(w > 1 for w in widths[first:-1]), widths
    assert dec.draft_pays(10)


@pytest.mark.parametrize("seed", [1, 2])
def test_sampled_sequences_always_draft_and_their_seed_repeats(seed):
    """A seeded sampled sequence drafts whatever the timing (its draws must not depend on it): the
    same tokens with a draft step that costs nothing and one that costs ten passes."""
    sampling = Sampling(temperature=0.9, seed=seed)
    runs = [_run(0.3, draft_s, 60, sampling=sampling) for draft_s in (0.0, 10.0)]
    for _, st, _, _ in runs:
        assert st.plain_passes == 0
        assert st.draft_steps == st.target_passes - (st.verify_rows[-1] == 1)
    assert runs[0][0] == runs[1][0]
    assert torch.equal(torch.tensor(runs[0][0]), torch.tensor(runs[1][0]))


def test_upper_bounds_need_counts_to_say_no():
    """DepthAcceptance.upper: 1 before anything is tried; a depth never offered inherits the bound
    before it (rejections at depth 0 say nothing good of depth 1); the bound falls as rejections
    mount and stays above the observed rate."""
    from k3kit.runtime.speculative.schedule import DepthAcceptance

    d = DepthAcceptance()
    assert d.upper(3) == [1.0, 1.0, 1.0]
    bounds = []
    for _ in range(16):
        d.record(7, 0)
        bounds.append(d.upper(7))
    assert all(len(set(b)) == 1 for b in bounds)                      # depth 0's bound, inherited
    assert all(a[0] > b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert 0.35 < bounds[3][0] < 0.45 and bounds[-1][0] < 0.15
    d = DepthAcceptance()
    for m in (0, 0, 1, 1, 7, 7):
        d.record(7, m)
    up = d.upper(7)
    rates = [a / t for a, t in zip(d.accepted, d.tried, strict=True)]
    assert all(u > r or u == r == 1.0 for u, r in zip(up, rates, strict=False))
    assert all(0 < u <= 1 for u in up)


def test_drafted_passes_that_realize_less_than_plain_ones_stop_drafting(monkeypatch):
    """Right half the time with a step costing 1.5 passes: the acceptance bounds stay optimistic
    over a short request, but what the drafted passes committed per second (fewer than plain
    passes do) declines drafting after REALIZED_AFTER of them; without that judgement the same
    request drafts on and takes longer."""
    import k3kit.runtime.speculative.decoder as decoder

    n = 80
    tokens, st, seconds, _ = _run(0.5, 1.5, n)
    assert tokens == ar_generate(ToyTarget(), PROMPT, n, Sampling()).tokens
    assert st.plain_passes > 0
    monkeypatch.setattr(decoder, "REALIZED_AFTER", 10 ** 9)
    tokens_b, st_b, seconds_b, _ = _run(0.5, 1.5, n)
    assert tokens_b == tokens
    assert st_b.plain_passes < st.plain_passes and seconds < seconds_b


def test_verify_widths_are_priced_by_what_verifies_took():
    """Two block widths measured: the line through them prices the others (a model's slope can be
    far off); one row is priced apart, as measured or, before, no lower than the line says."""
    _, _, _, dec = _run(0.95, 0.2, 8)
    dec.verify_seen = {4: 4.0, 8: 4.8}
    assert dec._seconds(6) == pytest.approx(4.4) and dec._seconds(2) == pytest.approx(3.6)
    assert dec._plain_seconds() >= 3.2 - 1e-9                    # the line at one row
    dec.verify_seen[1] = 2.5
    assert dec._plain_seconds() == 2.5
    dec.verify_seen = {4: 5.0, 8: 4.0}                            # a falling line is held flat
    assert dec._seconds(2) == dec._seconds(7) == pytest.approx(4.5)
