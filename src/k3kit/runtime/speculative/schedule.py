"""How many rows to verify.

Verifying n rows (the anchor plus n-1 proposals) commits 1 + (accepted proposals) tokens.
Proposal k survives only if all before it do, so with per-proposal acceptance chances c_i the
prefix survival is a_k = prod_{i<=k} c_i and the expected commit is E(n) = 1 + sum_{k<n} a_k.
On a target whose verify rows are cheap (weights resident) the best n is the widest; when each
row drags in more streamed expert bytes, the extra rows cost more than their expected tokens,
so the scheduler maximises E(n) / (cost(n) + draft_cost) rather than E(n).

The c_k come from the draft's confidence head; without one, from the acceptance seen so far
at each depth (Laplace-smoothed conditional rates).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from k3kit.errors import K3Error


def parse_budget(text: str) -> int | None:
    """`--verify-budget auto|N` -> None (cost-aware) or N rows (>= 1)."""
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise K3Error(f"--verify-budget: expected 'auto' or a row count >= 1, got {text!r}")
    return n


@dataclass
class ScheduleConfig:
    budget: int | None = None       # fixed verify rows (capped by the block); None: cost-aware
    threshold: float = 0.0          # drop proposals from the first one with confidence < threshold
    draft_cost: float = 0.0         # cost of one draft step, same unit as target.cost


@dataclass
class DepthAcceptance:
    """Acceptance seen at each proposal depth: tried[k] / accepted[k], k = 0-based proposal."""

    tried: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def record(self, offered: int, m: int) -> None:
        while len(self.tried) < offered:
            self.tried.append(0)
            self.accepted.append(0)
        for k in range(min(offered, m + 1)):    # proposal k was judged iff all before passed
            self.tried[k] += 1
            if k < m:
                self.accepted[k] += 1

    def rates(self, n: int, prior_weight: float = 2.0) -> list[float]:
        """Conditional acceptance per depth, each shrunk towards the depth before it (depth 0
        towards 1/2). Depths never offered inherit the last estimate, so a narrow start does
        not lock the scheduler into staying narrow."""
        out, prior = [], 0.5
        for k in range(n):
            tried = self.tried[k] if k < len(self.tried) else 0
            acc = self.accepted[k] if k < len(self.accepted) else 0
            prior = (acc + prior_weight * prior) / (tried + prior_weight)
            out.append(prior)
        return out


def prefix_survival(conf: Sequence[float]) -> list[float]:
    out, a = [], 1.0
    for c in conf:
        a *= float(c)
        out.append(a)
    return out


def expected_tokens(survival: Sequence[float], n_rows: int) -> float:
    """E[tokens committed] when verifying n_rows = anchor + (n_rows - 1) proposals."""
    return 1.0 + sum(survival[: n_rows - 1])


def choose_width(conf: Sequence[float], cost: Callable[[int], float], max_rows: int,
                 cfg: ScheduleConfig) -> int:
    """Verify rows in 1..max_rows (max_rows <= proposals + 1)."""
    limit = max(1, max_rows)
    if cfg.threshold > 0:
        k = 0
        while k < len(conf) and conf[k] >= cfg.threshold:
            k += 1
        limit = min(limit, k + 1)
    if cfg.budget is not None:
        return min(cfg.budget, limit)
    surv = prefix_survival(conf)
    best, best_rate = 1, -1.0
    for n in range(1, limit + 1):
        c = cost(n) + cfg.draft_cost
        if not c > 0:
            raise ValueError(f"verify cost must be positive, got {c} for {n} rows")
        rate = expected_tokens(surv, n) / c
        if rate > best_rate * (1 + 1e-12):      # ties keep the narrower width
            best, best_rate = n, rate
    return best
