"""Expert-payload estimates for schedulers: how many distinct experts, how many bytes to read.

Model-neutral: a batch is a routing tensor (or only a row count, before routing is known) and
a store that knows what it caches. The MoE itself runs in k3kit.layers.moe.RoutedMoE.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class CachingStore(Protocol):
    """What the estimates read from an expert store (k3kit.runtime's ExpertStore has it)."""

    def n_experts(self, layer: int) -> int: ...

    def cached_count(self, layer: int) -> int: ...

    def expert_nbytes(self, layer: int) -> int: ...

    def missing_bytes(self, layer: int, expert_ids: Sequence[int]) -> int: ...


def unique_experts(ids: torch.Tensor | Sequence[int]) -> list[int]:
    """Distinct expert ids of a routing tensor, ascending."""
    return torch.unique(torch.as_tensor(ids)).tolist()


def expected_unique(n_tokens: int, top_k: int, n_experts: int) -> float:
    """Expected distinct experts hit by n tokens under uniform top-k routing: E(1-(1-k/E)^n)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** n_tokens)


def expected_new_bytes(
    store: CachingStore,
    layer: int,
    ids_or_count: torch.Tensor | Sequence[int] | int,
    *,
    top_k: int | None = None,
) -> float:
    """Storage bytes a batch would fetch for `layer` (experts not in the store's cache).

    Given routing ids this is exact (what `get` would read now). Given a token count it is
    the uniform-routing estimate, scaled by the fraction of the layer's experts not cached,
    which is what a scheduler can use before routing is known.
    """
    if isinstance(ids_or_count, int):
        if top_k is None:
            raise ValueError("a token count needs top_k")
        n = store.n_experts(layer)
        uncached = 1.0 - store.cached_count(layer) / n
        return expected_unique(ids_or_count, top_k, n) * uncached * store.expert_nbytes(layer)
    return float(store.missing_bytes(layer, unique_experts(ids_or_count)))
