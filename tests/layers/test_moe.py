"""RoutedMoE vs a plain per-token loop; each unique expert fetched once per batch.

The expert provider here is an ExpertStore (Q8_0 bytes in memory) behind the per-expert
`get(layer, expert)` of the ExpertProvider protocol; `route_batch` below runs RoutedMoE with
an arbitrary expert function, as the adapter's experts do with theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from k3kit.layers.moe import ExpertWeights, RoutedMoE
from k3kit.runtime.cost import expected_new_bytes, expected_unique, unique_experts
from k3kit.runtime.experts import ExpertStore, ExpertTensor

H, FF, E, K = 64, 96, 16, 4


def _q8_0_bytes(n_elements: int, rng: np.random.Generator) -> np.ndarray:
    blocks = rng.integers(-127, 128, (n_elements // 32, 34)).astype(np.int8).view(np.uint8)
    blocks[:, :2] = rng.uniform(0.001, 0.02, blocks.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def make_store(cache_mib: float = 0, seed: int = 0) -> ExpertStore:
    """Two layers of SwiGLU-shaped experts (gate/up [H->FF], down [FF->H]) in memory, Q8_0."""
    rng = np.random.default_rng(seed)
    layers = {}
    for layer in (0, 1):
        layers[layer] = [
            ExpertTensor(_q8_0_bytes(H * FF * E, rng), 0, T.Q8_0, (H, FF), E, "gate"),
            ExpertTensor(_q8_0_bytes(H * FF * E, rng), 0, T.Q8_0, (H, FF), E, "up"),
            ExpertTensor(_q8_0_bytes(FF * H * E, rng), 0, T.Q8_0, (FF, H), E, "down"),
        ]
    return ExpertStore(layers, cache_mib=cache_mib)


def swiglu(x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
    gate, up, down = w
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def rowwise(x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Treats every row alone, elementwise: a batch gives exactly the single-token rows."""
    gate, up, down = w
    return torch.tanh(x * gate[0, :H]) * up[1, :H] + down[:H, 0]


def naive(x, ids, weights, store, layer, fn):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += weights[t, j] * fn(x[t : t + 1], store.get(layer, [e])[e])[0]
    return out


def routing(n_tok: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tok, H, generator=g)
    logits = torch.randn(n_tok, E, generator=g)
    w, ids = torch.topk(torch.sigmoid(logits), K, dim=1)
    return x, ids, w / w.sum(1, keepdim=True)


class StoreProvider:
    """ExpertProvider over an ExpertStore: one expert per `get`, the plan passed on."""

    def __init__(self, store: ExpertStore):
        self.store = store

    def plan(self, layer: int, experts: Sequence[int]) -> None:
        self.store.plan(layer, experts)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return ExpertWeights(*self.store.get(layer, [expert])[expert])


class FnMoE(RoutedMoE):
    """A RoutedMoE whose experts are `fn(x_rows, (gate, up, down))`."""

    def __init__(self, layer: int, fn: Callable, exact_order: bool):
        super().__init__(E, H, FF, layer, with_experts=False)
        self.fn = fn
        self.exact_order = exact_order

    def expert(self, x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
        return self.fn(x, w)


def route_batch(x, ids, weights, store, layer, fn, *, exact_order=True):
    """Mixture output [T, H] for tokens x [T, H] routed to ids [T, k] with weights [T, k]."""
    return FnMoE(layer, fn, exact_order).run_experts(x, ids, weights, StoreProvider(store))


@pytest.mark.parametrize("n_tok", [1, 8, 37])
def test_matches_per_token_loop(n_tok):
    x, ids, w = routing(n_tok, n_tok)
    with make_store() as store:
        got = route_batch(x, ids, w, store, 1, swiglu)
        want = naive(x, ids, w, store, 1, swiglu)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
        loose = route_batch(x, ids, w, store, 1, swiglu, exact_order=False)
        torch.testing.assert_close(loose, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_slot_order_is_the_loops_order_bitwise():
    """With row-independent experts the only difference left would be summation order: none."""
    x, ids, w = routing(29, 1)
    with make_store() as store:
        assert torch.equal(route_batch(x, ids, w, store, 0, rowwise), naive(x, ids, w, store, 0, rowwise))


def test_each_unique_expert_is_loaded_once_and_run_once():
    x, ids, w = routing(40, 2)
    calls: list[int] = []

    def counting(xs, weights):
        calls.append(xs.shape[0])
        return swiglu(xs, weights)

    with make_store(cache_mib=0) as store:
        requested: list[int] = []
        get = store.get
        store.get = lambda layer, e_ids: requested.extend(e_ids) or get(layer, e_ids)
        route_batch(x, ids, w, store, 0, counting)
        uniq = unique_experts(ids)
        assert sorted(requested) == uniq and len(requested) == len(set(requested))
        s = store.stats()
        assert (s.misses, s.hits) == (len(uniq), 0)
        assert s.bytes_read == len(uniq) * store.expert_nbytes(0)
        assert len(calls) == len(uniq) and sum(calls) == ids.numel()  # tokens run together per expert


def test_unique_experts_and_empty_batch():
    assert unique_experts(torch.tensor([[3, 1], [1, 7]])) == [1, 3, 7]
    with make_store() as store:
        no_ids = torch.zeros(0, K, dtype=torch.long)
        out = route_batch(torch.zeros(0, H), no_ids, torch.zeros(0, K), store, 0, swiglu)
        assert out.shape == (0, H) and store.stats().misses == 0
        with pytest.raises(ValueError, match="disagree"):
            route_batch(torch.zeros(2, H), no_ids[:0].new_zeros(2, K), torch.zeros(3, K), store, 0, swiglu)


# runtime.cost's payload estimates use the same in-memory store
def test_expected_new_bytes():
    with make_store(cache_mib=1) as store:
        per = store.expert_nbytes(0)
        ids = torch.tensor([[0, 1, 2, 3], [2, 3, 4, 5]])
        assert expected_new_bytes(store, 0, ids) == 6 * per
        store.get(0, unique_experts(ids))        # what a routed batch fetches: its distinct experts
        assert expected_new_bytes(store, 0, ids) == 0
        assert expected_new_bytes(store, 0, torch.tensor([[5, 6, 7, 6]])) == 2 * per
        assert expected_new_bytes(store, 1, ids) == 6 * per  # layer 1 untouched
        # uniform estimate: the unique-expert formula, scaled by the uncached fraction (10/16 here)
        assert expected_unique(1, K, E) == pytest.approx(K)
        assert expected_unique(8, 16, 896) == pytest.approx(896 * (1 - (1 - 16 / 896) ** 8))
        assert expected_new_bytes(store, 1, 8, top_k=K) == pytest.approx(expected_unique(8, K, E) * per)
        want = expected_unique(8, K, E) * per * 10 / 16
        assert expected_new_bytes(store, 0, 8, top_k=K) == pytest.approx(want)
        with pytest.raises(ValueError, match="top_k"):
            expected_new_bytes(store, 0, 8)


def test_route_counts_add_the_rows_routed_to_each_expert():
    x, ids, w = routing(23, 3)
    moe = FnMoE(0, swiglu, exact_order=True)
    assert moe.route_counts is None
    with make_store() as store:
        route_batch(x, ids, w, store, 0, swiglu)       # a fresh module: nothing counted
        moe.count_routes()
        assert moe.route_counts is not None and moe.route_counts.dtype == torch.int64
        assert torch.equal(moe.route_counts, torch.zeros(E, dtype=torch.int64))
        moe.run_experts(x, ids, w, StoreProvider(store))
        moe.run_experts(x[:5], ids[:5], w[:5], StoreProvider(store))
        want = torch.zeros(E, dtype=torch.int64)
        for e in ids.reshape(-1).tolist() + ids[:5].reshape(-1).tolist():
            want[e] += 1
        assert torch.equal(moe.route_counts, want) and int(want.sum()) == (23 + 5) * K
        moe.count_routes()                              # restart: zeros again
        assert int(moe.route_counts.sum()) == 0
        moe.count_routes(False)
        moe.run_experts(x, ids, w, StoreProvider(store))
        assert moe.route_counts is None


def test_route_counts_on_the_batched_training_path():
    moe = RoutedMoE(E, H, FF, layer=0)
    moe.batched = True
    moe.count_routes()
    x, ids, w = routing(11, 4)
    moe.run_experts(x, ids, w)
    assert torch.equal(moe.route_counts, torch.bincount(ids.reshape(-1), minlength=E))
