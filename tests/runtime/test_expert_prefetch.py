"""Next-layer expert prefetch on the shipped mini K3 (trained routers): same tokens, useful guesses.

Each K3 MoE layer applies the next MoE layer's router to its own input and hands the guess to
the provider's `prefetch` after planning its own experts (models/kimi_k3/moe.py). The guess may
only start reads: greedy tokens must be identical with prefetch on and off, and on a trained
model most guessed experts are then really fetched.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from k3kit.adapters import load_model
from k3kit.layers.moe import ExpertWeights
from k3kit.mini import paths
from k3kit.models.kimi_k3.moe import LatentMoE, set_expert_prefetch
from k3kit.runtime.engine import generate
from k3kit.runtime.experts import ExpertStore
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.sampling import make_sampling


class Provider:
    """An ExpertProvider with plan and prefetch over a store, recording the guesses."""

    def __init__(self, store: ExpertStore):
        self.store = store
        self.guesses: list[tuple[int, list[int]]] = []

    def plan(self, layer: int, experts: Sequence[int]) -> None:
        self.store.plan(layer, experts)

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        self.guesses.append((layer, list(experts)))
        self.store.prefetch(layer, experts)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return ExpertWeights(*self.store.get(layer, [expert])[expert])


def test_set_expert_prefetch_links_each_moe_to_the_next():
    lm = load_model(paths.shipped_gguf(), LoadOptions(expert_cache_mib=0))
    try:
        moes = [m for m in lm.model.model.modules() if isinstance(m, LatentMoE)]
        assert set_expert_prefetch(lm.model.model.modules()) == len(moes) - 1 >= 1
        assert [m.next_router[0] for m in moes[:-1]] == [m.layer for m in moes[1:]]
        assert moes[-1].next_router is None
        assert set_expert_prefetch(lm.model.model.modules(), on=False) == 0
        assert all(m.next_router is None for m in moes)
        # the router is not registered twice: the state dict does not change
        assert not any(k.count("router") > 1 for k in lm.model.model.state_dict())
    finally:
        lm.close()


@pytest.mark.usefixtures("one_thread")
def test_prefetch_changes_no_token_and_guesses_mostly_right():
    runs = {}
    for on in (False, True):
        lm = load_model(paths.shipped_gguf(), LoadOptions(expert_cache_mib=0.05, expert_kernel="native"))
        try:
            adapter = lm.model
            if adapter.store.keep != "quantized":
                pytest.skip("read-ahead needs the native kernel (quantized expert cache)")
            adapter.store.map_misses = False     # read ahead even though the file is in the page cache
            provider = Provider(adapter.store)
            adapter.experts = provider
            set_expert_prefetch(adapter.model.modules(), on)
            prompt = lm.codec.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
            r = generate(adapter, prompt, max_tokens=16, sampling=make_sampling(0.0, seed=0))
            runs[on] = (r.token_ids, adapter.store.stats(), provider.guesses)
        finally:
            lm.close()
    (off_ids, off_stats, off_guesses), (on_ids, on_stats, guesses) = runs[False], runs[True]
    assert on_ids == off_ids
    assert not off_guesses and off_stats.prefetched == 0
    assert guesses and on_stats.prefetched > 0
    assert on_stats.misses == off_stats.misses and on_stats.bytes_read == off_stats.bytes_read
    # measured 146 of 185 (79%) on this prompt; a guess from the wrong layer or input would be ~k/E
    assert on_stats.prefetch_used >= 0.5 * on_stats.prefetched
    assert on_stats.io_bytes == on_stats.bytes_read + on_stats.wasted_bytes
