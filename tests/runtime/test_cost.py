"""Expert-payload estimates: exact bytes for a routing, the uniform estimate for a row count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

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
