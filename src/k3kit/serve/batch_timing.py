"""What a pass of the batching scheduler really costs on this machine (PassTiming), learnt from
the passes run.

The speculative widths (k3kit.serve.batch_widths) weigh a draft's expected tokens against the
seconds it adds to a pass; the model's cost() knows the calibrated rates and the experts a pass
reads, and this fit scales it to the load of the moment. Plain floats and its own small solver:
numpy's per-call overhead on arrays this small cost the draft server ~0.2 ms a pass.
"""

from __future__ import annotations


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
