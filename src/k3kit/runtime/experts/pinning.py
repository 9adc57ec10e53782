"""Frequency placement: keep the experts a routing profile picks most often resident.

An LRU keeps what was used last; a recorded profile (`k3kit bench --profile-experts`) says what
is used most. Pinning the hottest experts (as CPU/GPU MoE runners place their most frequent
experts in fast memory) turns their misses into hits for good, and the rest of the budget, if
any, stays an LRU. The choice is one greedy pass over every (layer, expert) by probability of
being picked by a token, hottest first, while their cached bytes fit the budget: with equal
expert sizes that maximizes the expected hits per token. Experts a profile never saw are never
pinned.

Model-neutral: it is given per-layer probabilities (the plan layer reads and checks the
profile file) and an `ExpertStore`, and uses the store's public `pin`/`unpin` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from k3kit.errors import K3Error
from k3kit.runtime.experts.store import ExpertStore


@dataclass
class PinPlan:
    """Which experts of which layer to pin, and what they cost the cache budget."""

    experts: dict[int, list[int]] = field(default_factory=dict)
    nbytes: int = 0
    expected_hit_rate: float = 0.0    # share of routed (token, expert) picks the pinned set serves

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.experts.values())

    def to_dict(self) -> dict[str, object]:
        return {"pinned_experts": self.count, "pinned_bytes": self.nbytes,
                "expected_hit_rate": self.expected_hit_rate,
                "layers": {str(k): v for k, v in sorted(self.experts.items())}}


def check_layers(store: ExpertStore, probs: Mapping[int, np.ndarray], where: str) -> None:
    """Every profiled layer must be one of the store's, with as many experts."""
    for layer, p in probs.items():
        if layer not in store.layers:
            raise K3Error(f"{where}: layer {layer} has no routed experts in this model "
                          "(profile is for another model)")
        if len(p) != store.n_experts(layer):
            raise K3Error(f"{where}: layer {layer} has {len(p)} experts in the profile, "
                          f"{store.n_experts(layer)} in the model (profile is for another model)")


def plan_pins(store: ExpertStore, probs: Mapping[int, np.ndarray], budget_bytes: int, where: str = "profile"
              ) -> PinPlan:
    """The hottest experts whose cached bytes fit `budget_bytes`, hottest first across layers."""
    check_layers(store, probs, where)
    items = [(-float(p[e]), layer, e) for layer, p in probs.items() for e in range(len(p)) if p[e] > 0]
    items.sort()
    plan = PinPlan()
    total = sum(float(np.sum(p)) for p in probs.values())
    served = 0.0
    for neg_p, layer, e in items:
        cost = store.cached_expert_nbytes(layer)
        if plan.nbytes + cost > budget_bytes:
            continue        # a smaller expert of another layer may still fit
        plan.experts.setdefault(layer, []).append(e)
        plan.nbytes += cost
        served -= neg_p
    for v in plan.experts.values():
        v.sort()
    plan.expected_hit_rate = served / total if total else 0.0
    return plan


def pin(store: ExpertStore, probs: Mapping[int, np.ndarray], where: str = "profile",
        budget_bytes: int | None = None) -> PinPlan:
    """Pin the hottest experts within the store's cache budget (or `budget_bytes`).

    Earlier pins of the profiled layers are dropped first, so pinning twice does not pile up.
    The reads this costs go through the store's ledger like any miss.
    """
    plan = plan_pins(store, probs, store.cache_bytes if budget_bytes is None else budget_bytes, where)
    for layer in probs:
        store.unpin(layer)
    for layer, experts in sorted(plan.experts.items()):
        store.pin(layer, experts)
    return plan
