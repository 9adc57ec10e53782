import pytest

from k3kit.errors import K3Error
from k3kit.runtime.speculative.schedule import (
    DepthAcceptance,
    ScheduleConfig,
    choose_width,
    expected_tokens,
    parse_budget,
    prefix_survival,
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
