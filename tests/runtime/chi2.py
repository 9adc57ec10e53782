"""Pearson's chi-square goodness of fit, small enough to need no scipy: the statistical tests
of sampled speculative decoding (toy targets and the mini K3) share it."""

from __future__ import annotations

import math


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.09 is p = 0.001."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: dict, expected: dict, n: int) -> tuple[float, int]:
    """Pearson statistic of observed `counts` against `expected` probabilities over n draws,
    pooling cells with expected count < 5 (and outcomes outside `expected`) into one."""
    stat, pool_o, pool_e, cells = 0.0, 0, 0.0, 0
    for key, p in expected.items():
        e, o = p * n, counts.get(key, 0)
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            stat += (o - e) ** 2 / e
            cells += 1
    extra = sum(o for k, o in counts.items() if k not in expected)
    pool_o += extra
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        cells += 1
    elif extra:
        stat = math.inf
    return stat, cells - 1
