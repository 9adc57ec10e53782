import pytest

from k3kit.errors import K3Error
from k3kit.runtime.cost import expected_unique
from k3kit.runtime.speculative.schedule import (
    Claim,
    DepthAcceptance,
    ExpertLayer,
    PassRates,
    ScheduleConfig,
    allocate_widths,
    choose_width,
    expected_tokens,
    hit_fraction,
    parse_budget,
    prefix_survival,
    verify_seconds,
)

CONF = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]


def test_flat_cost_picks_full_width():
    assert choose_width(CONF, lambda n: 5.0, 8, ScheduleConfig()) == 8


def test_expensive_rows_pick_narrower_width():
    # cost linear in rows: extra rows are not worth their expected tokens
    assert choose_width(CONF, lambda n: float(n), 8, ScheduleConfig()) == 1
    # streamed experts: union of 16-of-896 experts over n rows, plus fixed compute
    def experts(n):
        return 896 * (1 - (1 - 16 / 896) ** n) + 40.0
    w = choose_width(CONF, experts, 8, ScheduleConfig())
    assert 1 < w < 8
    # brute force agrees with the choice
    surv = prefix_survival(CONF)
    best = max(range(1, 9), key=lambda n: expected_tokens(surv, n) / experts(n))
    assert w == best
    # a draft step that costs something favours longer verifies
    assert choose_width(CONF, experts, 8, ScheduleConfig(draft_cost=500.0)) > w


def test_threshold_and_budget():
    assert choose_width(CONF, lambda n: 1.0, 8, ScheduleConfig(threshold=0.65)) == 4
    assert choose_width(CONF, lambda n: 1.0, 8, ScheduleConfig(budget=3)) == 3
    assert choose_width(CONF, lambda n: 1.0, 8, ScheduleConfig(budget=20)) == 8
    assert choose_width(CONF, lambda n: 1.0, 5, ScheduleConfig(budget=20)) == 5
    assert choose_width(CONF, lambda n: 1.0, 8, ScheduleConfig(budget=6, threshold=0.75)) == 3
    assert choose_width([0.1, 0.9], lambda n: 1.0, 3, ScheduleConfig(threshold=0.5)) == 1


def test_survival_and_expectation_by_hand():
    assert prefix_survival([0.5, 0.5, 1.0]) == [0.5, 0.25, 0.25]
    assert expected_tokens([0.5, 0.25, 0.25], 1) == 1.0
    assert expected_tokens([0.5, 0.25, 0.25], 3) == 1.75


def test_parse_budget():
    assert parse_budget("auto") is None
    assert parse_budget("4") == 4
    for bad in ("0", "-1", "x", ""):
        with pytest.raises(K3Error):
            parse_budget(bad)


def test_depth_acceptance():
    d = DepthAcceptance()
    d.record(3, 1)      # proposal 0 accepted, 1 rejected, 2 never judged
    d.record(3, 3)
    assert d.tried == [2, 2, 1] and d.accepted == [2, 1, 1]
    r0 = (2 + 2 * 0.5) / 4
    r1 = (1 + 2 * r0) / 4
    r2 = (1 + 2 * r1) / 3
    assert d.rates(4) == pytest.approx([r0, r1, r2, r2])
    # a narrow start still learns that deep proposals are worth offering
    d = DepthAcceptance()
    for _ in range(20):
        d.record(1, 1)
    assert min(d.rates(7)) > 0.9


# -- the verify-time estimate a target's cost(n) builds on --------------------------------------
RATES = PassRates(layer_s=1e-3, row_layer_s=1e-4, flops=1e9, mem_bw=1e9, expert_s=1e-4,
                  dequant_elems_s=1e6, read_bw=1e8, cold_read_bw=1e7, cold_read_s=1e-3)
EXPERT = dict(n_experts=32, top_k=4, elements=1000, resident_bytes=4000, file_bytes=600)
GEO = dict(layers=3, trunk_params=10_000, trunk_bytes=40_000, rates=RATES)


def moe(cached: int, n_layers: int = 2) -> list[ExpertLayer]:
    return [ExpertLayer(cached=cached, **EXPERT) for _ in range(n_layers)]


def test_verify_seconds_by_hand():
    everything = 1 << 30
    for n in (1, 3, 8):
        d = expected_unique(n, 4, 32)
        trunk = 3 * (1e-3 + n * 1e-4) + 40_000 / 1e9 + 2 * 10_000 * n / 1e9
        experts = 2 * (d * (1e-4 + 4000 / 1e9) + 2 * 1000 * 4 * n / 1e9)
        miss = 1000 / 1e6 + 600 / 1e8                  # dequantize + read one expert
        # all cached, cache big enough to keep them: no miss term
        assert verify_seconds(n, moe=moe(32), cache_bytes=everything, **GEO) == pytest.approx(trunk + experts)
        # nothing cached: every distinct expert is a miss
        none = verify_seconds(n, moe=moe(0), cache_bytes=0, **GEO)
        assert none == pytest.approx(trunk + experts + 2 * d * miss)
        cold = verify_seconds(n, moe=moe(0), cache_bytes=0, cold=True, **GEO)
        assert cold == pytest.approx(trunk + experts + 2 * d * (1000 / 1e6 + 600 / 1e7 + 1e-3))
        assert verify_seconds(n, moe=moe(32), cache_bytes=everything, cold=True, **GEO) == \
            pytest.approx(trunk + experts)             # nothing to read: cold costs nothing extra
    with pytest.raises(ValueError):
        verify_seconds(0, moe=moe(0), cache_bytes=0, **GEO)


def test_hit_fraction_models_an_lru_cache():
    layer = ExpertLayer(cached=32, **EXPERT)
    # the cache keeps h = 40/20 = 2 earlier passes: used by one of them with 1 - (1 - 4/32)^2
    assert hit_fraction(layer, 4.0, 20.0, 40.0) == pytest.approx(1 - (1 - 4 / 32) ** 2)
    # a pass touching more experts than the cache holds evicts each layer's before reuse
    assert hit_fraction(layer, 16.0, 80.0, 40.0) == 0.0
    # never more than what the cache holds of this layer now (a cache still filling)
    assert hit_fraction(ExpertLayer(cached=2, **EXPERT), 4.0, 20.0, 1000.0) == pytest.approx(2 / 32)
    assert hit_fraction(ExpertLayer(cached=0, **EXPERT), 4.0, 20.0, 1000.0) == 0.0
    # a cache far bigger than a pass: almost every routed expert hits
    assert hit_fraction(layer, 4.0, 20.0, 1e4) == pytest.approx(1.0)


def test_cache_size_changes_the_width_the_scheduler_picks():
    """Resident experts: rows are cheap next to the fixed pass cost, so confident proposals are
    all verified. A cache smaller than one pass's experts: each extra row drags in new misses,
    and the same proposals get a narrower verify; near-certain ones are still worth it all."""
    rates = PassRates()                                # the calibrated defaults
    mini = [ExpertLayer(32, 4, 24576, 98304, 13056, cached=32) for _ in range(5)]
    geo = dict(layers=6, trunk_params=4_235_816, trunk_bytes=16_943_264, rates=rates)
    resident = lambda n: verify_seconds(n, moe=mini, cache_bytes=256 << 20, **geo)   # noqa: E731
    streamed = [ExpertLayer(32, 4, 24576, 98304, 13056, cached=1) for _ in range(5)]
    tiny = lambda n: verify_seconds(n, moe=streamed, cache_bytes=5 * 98304, **geo)   # noqa: E731
    assert tiny(1) > resident(1) and tiny(8) - tiny(1) > 2 * (resident(8) - resident(1))
    for c in (0.7, 0.8, 0.85):
        assert 1 < choose_width([c] * 7, tiny, 8, ScheduleConfig()) < choose_width([c] * 7, resident, 8,
                                                                                 ScheduleConfig())
    assert choose_width([0.85] * 7, resident, 8, ScheduleConfig()) == 8
    assert choose_width([0.95] * 7, tiny, 8, ScheduleConfig()) == 8
    # paying for the draft step whatever the width favours wider verifies
    narrow = choose_width([0.8] * 7, tiny, 8, ScheduleConfig())
    assert choose_width([0.8] * 7, tiny, 8, ScheduleConfig(draft_cost=0.02)) > narrow


def test_quantized_cache_misses_cost_only_the_read():
    """A cache of quantized bytes pays no dequantization on a miss, so streamed verify rows get
    cheaper; with every expert resident the flag changes nothing."""
    geo = dict(layers=6, trunk_params=4_235_816, trunk_bytes=16_943_264, rates=PassRates())
    deq = [ExpertLayer(32, 4, 24576, 98304, 13056, cached=1) for _ in range(5)]
    quant = [ExpertLayer(32, 4, 24576, 13056, 13056, cached=1, dequant_on_miss=False) for _ in range(5)]
    budget = 5 * 13056
    t_deq = verify_seconds(4, moe=deq, cache_bytes=budget, **geo)
    t_quant = verify_seconds(4, moe=quant, cache_bytes=budget, **geo)
    misses = 5 * expected_unique(4, 4, 32)        # a 5-expert cache keeps nothing a pass reuses
    assert t_deq - t_quant > 0.9 * misses * 24576 / PassRates().dequant_elems_s
    full = [ExpertLayer(32, 4, 24576, 13056, 13056, cached=32, dequant_on_miss=f) for f in (True, False)]
    assert verify_seconds(4, moe=[full[0]] * 5, cache_bytes=1 << 30, **geo) == \
        verify_seconds(4, moe=[full[1]] * 5, cache_bytes=1 << 30, **geo)


# ---- allocate_widths: verify widths for sequences sharing one pass ---------------------------------

def _pass_cost(n: int) -> float:
    """A verify pass: 9 ms, +1.6 ms per row (the mini K3's calibration)."""
    return 9e-3 + 1.6e-3 * (n - 1)


def test_allocate_alone_takes_likely_rows_and_stops_at_unlikely_ones():
    sure = Claim(prefix_survival([0.95] * 7), 8)
    assert allocate_widths([sure], _pass_cost, 1, 1, 63) == [8]
    doubtful = Claim(prefix_survival([0.9, 0.1, 0.9, 0.9, 0.9, 0.9, 0.9]), 8)
    assert allocate_widths([doubtful], _pass_cost, 1, 1, 63) == [2]
    assert allocate_widths([Claim([0.0] * 7, 8)], _pass_cost, 1, 1, 63) == [1]
    assert allocate_widths([sure], _pass_cost, 1, 1, 3) == [4]          # the row limit
    assert allocate_widths([Claim(prefix_survival([0.95] * 7), 3)], _pass_cost, 1, 1, 63) == [3]


def test_allocate_a_draft_must_pay_for_itself():
    surv = prefix_survival([0.7] * 7)
    assert allocate_widths([Claim(surv, 8, draft_cost=2e-3)], _pass_cost, 1, 1, 63)[0] > 1
    assert allocate_widths([Claim(surv, 8, draft_cost=0.2)], _pass_cost, 1, 1, 63) == [1]


def test_allocate_more_users_less_speculation():
    """The same claims in a pass that already serves more users get fewer extra rows in total, and
    none once a row costs more than the pass's tokens per second can afford."""
    surv = prefix_survival([0.8, 0.7, 0.6, 0.5, 0.5, 0.5, 0.5])
    extra = []
    for users in (1, 2, 4, 8, 16):
        claims = [Claim(surv, 8, draft_cost=4e-3) for _ in range(users)]
        widths = allocate_widths(claims, _pass_cost, users, users, 64 - users)
        assert sum(widths) - users <= 64 - users
        extra.append((sum(widths) - users) / users)
    assert extra == sorted(extra, reverse=True) and extra[0] > 0 and extra[-1] == 0


def test_draft_guard_stops_drafting_where_drafted_passes_realized_less():
    from k3kit.runtime.speculative.schedule import DraftGuard

    g = DraftGuard(samples=2, probe_every=5, max_interval=20)
    assert g.allow(8) and g.verdict(8) is None              # nothing known: the allocator decides
    for _ in range(2):
        g.record(8, True, 8, 2.0)                           # drafted: 4 tokens/s
    assert not g.allow(8)                                   # now measure the undrafted side
    for _ in range(2):
        g.record(8, False, 8, 1.0)                          # undrafted: 8 tokens/s
    assert g.verdict(8) is False and g.verdict(12) is False  # larger counts inherit it
    seen = [g.allow(8) for _ in range(60)]                  # its questions 3..62 at 8
    # probes only, ever rarer while the verdict stands: after 5, 10, 20, then every 20 questions
    assert [i + 3 for i, a in enumerate(seen) if a] == [8, 18, 38, 58]
    assert g.allow(12) is False                             # starts undrafted where fewer users lost
    assert g.verdict(4) is None and g.allow(4)              # fewer users: still the allocator's call
    g.record(8, True, 6, 1.0)                               # a probe that loses again: the verdict stands
    assert g.verdict(8) is False and g.verdict(12) is False
    g.record(8, True, 8, 0.5)                               # a probe that pays: the old drafted passes go,
    assert g.verdict(8) is None and g.verdict(12) is None   # drafting is measured again, larger counts too
    assert g.allow(8) and g.allow(12)                       # the allocator decides
    g.record(8, True, 8, 0.5)
    assert g.verdict(8) is True
    seen = [g.allow(8) for _ in range(10)]
    assert seen.count(False) == 1 and not seen[5]          # an undrafted recheck, 5 questions on


def test_draft_guard_overturns_a_cold_start_verdict_at_the_first_paying_probe():
    """Slow first drafted passes (a cold start) condemn drafting at 1 decoder and, inherited, at
    every larger count; once a probe realizes more than the undrafted passes, drafting is measured
    again at once, not after thousands of passes of rare probes."""
    from k3kit.runtime.speculative.schedule import DraftGuard

    g = DraftGuard(samples=3, probe_every=4, max_interval=64)
    for _ in range(3):
        g.record(1, True, 4, 2.0)                           # cold draft steps: 2 tokens/s
    for _ in range(3):
        g.record(1, False, 1, 0.2)                          # warm AR: 5 tokens/s
    assert g.verdict(1) is False and g.verdict(4) is False and not g.allow(4)
    asked = 0
    while not g.allow(1):                                   # the first probe at 1
        asked += 1
        assert asked < 10
    g.record(1, True, 4, 0.4)                               # warm draft steps: 10 tokens/s
    assert g.verdict(1) is None and g.verdict(4) is None
    assert g.allow(1) and g.allow(4)
    for _ in range(3):
        g.record(1, True, 4, 0.4)
    assert g.verdict(1) is True


def test_draft_guard_keeps_drafting_where_it_pays():
    from k3kit.runtime.speculative.schedule import DraftGuard

    g = DraftGuard(samples=3, probe_every=10)
    for drafted, seconds in [(True, 1.0)] * 3 + [(False, 2.0)] * 3:
        g.record(2, drafted, 6, seconds)
    assert g.verdict(2) is True and g.verdict(3) is True
    assert [g.allow(2) for _ in range(31)].count(False) == 2       # rechecks at questions 11 and 31
    with pytest.raises(ValueError):
        DraftGuard(samples=0)


def _noisy_passes(g, n, drafted, rate, passes, seed):
    """`passes` passes at n whose tokens are 1..8 at random (a drafted pass's spread), each taking
    tokens / rate seconds times a +-30% load factor."""
    import random
    rnd = random.Random(seed)
    for _ in range(passes):
        tokens = rnd.randint(1, 8) if drafted else 1
        g.record(n, drafted, tokens, tokens / rate * rnd.uniform(0.7, 1.3))


def test_draft_guard_does_not_condemn_drafting_on_few_or_noisy_passes():
    """Fewer than `samples` passes each way give no verdict however bad they look (an unlucky
    start must not switch drafting off); many noisy passes at the same real rate give none either
    (the allocator keeps deciding), where a clear loss in the same noise is found."""
    from k3kit.runtime.speculative.schedule import DraftGuard

    g = DraftGuard(samples=6)
    for _ in range(5):
        assert g.allow(1)                                   # the allocator's call while learning
        g.record(1, True, 1, 1.0)                           # 5 drafted passes that each kept 1 token, slowly
        g.record(1, False, 1, 0.2)
    assert g.verdict(1) is None and g.allow(1)
    for seed in range(5):
        even = DraftGuard()                                 # drafted: just the margin above undrafted
        _noisy_passes(even, 4, True, 50.0 * (1 + even.margin), 60, seed)
        _noisy_passes(even, 4, False, 50.0, 60, seed + 100)
        assert even.verdict(4) is None, seed
        assert sum(even.allow(4) for _ in range(50)) == 50
        losing = DraftGuard()
        _noisy_passes(losing, 4, True, 25.0, 60, seed)
        _noisy_passes(losing, 4, False, 50.0, 60, seed + 100)
        assert losing.verdict(4) is False, seed
        assert sum(losing.allow(4) for _ in range(50)) <= 2


def test_draft_guard_that_does_not_judge_leaves_every_pass_to_the_allocator():
    from k3kit.runtime.speculative.schedule import DraftGuard

    judging, trusting = DraftGuard(samples=2), DraftGuard(samples=2, judge=False)
    for g in (judging, trusting):
        for drafted, seconds in [(True, 4.0)] * 2 + [(False, 1.0)] * 2:   # drafting lost 4x
            g.record(3, drafted, 4, seconds)
    assert judging.verdict(3) is False and not judging.allow(3)
    assert all(trusting.allow(n) for n in (1, 3, 3, 8))


def test_draft_guard_confirms_a_clear_gain_on_few_undrafted_passes_but_condemns_only_on_samples():
    """A verdict for drafting needs `samples` drafted passes and two undrafted ones (it only leaves the
    choice to the allocator); one against it needs `samples` undrafted passes as well."""
    from k3kit.runtime.speculative.schedule import DraftGuard

    wins = DraftGuard(samples=6)
    for t in (5, 6, 4, 5, 6, 5):
        wins.record(2, True, t, 0.1)                        # ~50 tokens/s drafted
    assert not wins.allow(2)                                # measure the undrafted side first
    for _ in range(2):
        wins.record(2, False, 2, 0.1)                       # 20 tokens/s
    assert wins.verdict(2) is True and wins.allow(2)
    loses = DraftGuard(samples=6)
    for t in (1, 2, 1, 1, 2, 1):
        loses.record(2, True, t, 0.1)                       # ~13 tokens/s drafted
    for i in range(5):
        loses.record(2, False, 2, 0.1)                      # 20 tokens/s
        assert loses.verdict(2) is None and not loses.allow(2), i     # still measuring, not condemned
    loses.record(2, False, 2, 0.1)
    assert loses.verdict(2) is False


def test_draft_guard_holds_drafting_to_a_margin_over_the_undrafted_passes():
    """Drafted passes that realize only a little more than undrafted ones do not pay for what a
    pass's rate does not show (staggered prefills, restacked states): they are condemned with the
    default margin, and judged by the bare rates with margin 0."""
    from k3kit.runtime.speculative.schedule import DraftGuard

    for seed in range(3):
        strict, bare = DraftGuard(), DraftGuard(margin=0.0)
        for g in (strict, bare):
            _noisy_passes(g, 8, True, 55.0, 200, seed)          # 1.1x the undrafted rate
            _noisy_passes(g, 8, False, 50.0, 200, seed + 100)
        assert strict.verdict(8) is False and strict.verdict(16) is False, seed
        assert bare.verdict(8) is not False, seed
        clear = DraftGuard()
        _noisy_passes(clear, 2, True, 100.0, 200, seed)         # 2x: pays beyond the margin
        _noisy_passes(clear, 2, False, 50.0, 200, seed + 100)
        assert clear.verdict(2) is True, seed
    with pytest.raises(ValueError):
        DraftGuard(margin=-0.1)


def test_draft_guard_scales_a_smaller_counts_gain_down_to_a_larger_one():
    """A count not measured yet takes the nearest smaller measured one's verdict with its gain scaled
    by m / n: 1.4x realized at 4 decoders foresees 1.2x at 8 (not enough for the default margin:
    condemned there, probed only) and 1.27x at 6 (the allocator decides); once 8 is measured its
    own passes decide."""
    from k3kit.runtime.speculative.schedule import DraftGuard

    g = DraftGuard(samples=3)
    for _ in range(3):
        g.record(4, True, 5.6, 0.1)                         # 56 tokens/s
        g.record(4, False, 4, 0.1)                          # 40 tokens/s: 1.4x
    assert g.verdict(4) is True
    assert g.verdict(6) is True and g.allow(6)
    assert g.verdict(8) is False and g.verdict(16) is False and not g.allow(8)
    for _ in range(3):
        g.record(8, True, 16, 0.1)                          # 8 measured itself: 2x there
        g.record(8, False, 8, 0.1)
    assert g.verdict(8) is True and g.verdict(9) is True
