"""PassTiming: the batch server's fit of what a pass really costs (seconds ~ a * cost(rows) + d +
b * extra verify rows + c * verify blocks, ridge towards a = 1, d = b = c = 0, with forgetting)."""

from __future__ import annotations

import numpy as np

from k3kit.serve.batch import PassTiming


def _reference(samples, forget, prior):
    """The same ridge regression in numpy (the fit's definition, written the long way)."""
    xtx, xty = np.zeros((4, 4)), np.zeros(4)
    for cost, extra, blocks, seconds in samples:
        x = np.array([cost, 1e-3, extra * 1e-3, blocks * 1e-3])
        xtx = forget * xtx + np.outer(x, x)
        xty = forget * xty + x * seconds
    lam = np.diag([prior * max(samples[-1][0], 1e-3) ** 2] + [prior * 1e-6] * 3)
    a, d, b, c = np.linalg.solve(xtx + lam, xty + lam @ np.array([1.0, 0.0, 0.0, 0.0]))
    return max(a, 0.1), d * 1e-3, b * 1e-3, max(c, 0.0) * 1e-3


def test_pass_timing_recovers_the_costs_passes_show():
    rng = np.random.default_rng(0)
    fit = PassTiming()
    assert fit.coefficients() == (1.0, 0.0, 0.0, 0.0)       # nothing measured: cost() as it is
    samples = []
    for i in range(300):
        cost = rng.uniform(0.01, 0.03)
        extra, blocks = (int(rng.integers(4, 30)), int(rng.integers(1, 6))) if i % 3 == 0 else (0, 0)
        # cost() 1.3x too low, 1 ms a pass it does not see, its verify rows 0.4 ms too dear
        seconds = 1.3 * cost + 1e-3 - 4e-4 * extra + 2e-3 * blocks + rng.normal(0, 2e-4)
        samples.append((cost, extra, blocks, seconds))
        fit.record(cost, extra, blocks, seconds)
        if i % 50 == 49:
            ref = _reference(samples, fit.FORGET, fit.PRIOR)
            assert np.allclose(fit.coefficients(), ref, rtol=1e-9, atol=1e-15)
    a, d, b, c = fit.coefficients()
    assert abs(a - 1.3) < 0.15 and abs(d - 1e-3) < 2e-3 and abs(b + 4e-4) < 1e-4 and abs(c - 2e-3) < 5e-4


def test_pass_timing_keeps_the_scale_and_the_block_cost_positive():
    fit = PassTiming()
    for _ in range(50):
        fit.record(0.02, 10, 2, 0.001)                      # passes far cheaper than cost() says
    a, d, b, c = fit.coefficients()
    assert a >= 0.1 and c >= 0.0
