"""The fused expert path (`RoutedMoE._run_fused`: every expert of a layer in two native
products) against the per-expert path, bit for bit, through an ExpertStore of quantized bytes
in ggml's arithmetic: one row, several, rows that leave experts empty, 1 and 2 threads."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from k3kit.kernels import qmatmul
from k3kit.layers import moe as moe_mod
from k3kit.layers.moe import ExpertWeights, RoutedMoE
from k3kit.runtime.experts import ExpertStore, ExpertTensor

H, FF, E, K = 256, 128, 12, 4

pytestmark = pytest.mark.skipif(not qmatmul.native_available()
                                or not hasattr(qmatmul._qmatmul, "experts_q8"),
                                reason="the native kernels are not built")


def _mxfp4_bytes(n: int, rng: np.random.Generator) -> np.ndarray:
    blocks = rng.integers(0, 256, (n // 32, 17)).astype(np.uint8)
    blocks[:, 0] = rng.integers(118, 124, blocks.shape[0])      # E8M0 scales near 2^-6
    return blocks.reshape(-1)


def _q4_k_bytes(n: int, rng: np.random.Generator) -> np.ndarray:
    blocks = rng.integers(0, 256, (n // 256, 144)).astype(np.uint8)
    blocks[:, :4] = np.frombuffer(np.array([0.01, 0.002], np.float16).tobytes(), np.uint8)
    return blocks.reshape(-1)


def make_store(gate_up: T, down: T, seed: int = 0) -> ExpertStore:
    """One layer of experts kept quantized (ggml arithmetic), cache large enough for all."""
    rng = np.random.default_rng(seed)
    make = {T.MXFP4: _mxfp4_bytes, T.Q4_K: _q4_k_bytes}
    layer = [ExpertTensor(make[gate_up](H * FF * E, rng), 0, gate_up, (H, FF), E, "gate"),
             ExpertTensor(make[gate_up](H * FF * E, rng), 0, gate_up, (H, FF), E, "up"),
             ExpertTensor(make[down](FF * H * E, rng), 0, down, (FF, H), E, "down")]
    return ExpertStore({0: layer}, cache_mib=64, keep="quantized", arith="ggml")


class Provider:
    """ExpertProvider over a store; `resident` (the fused path's permission) can be withheld."""

    def __init__(self, store: ExpertStore, resident: bool):
        self.store = store
        self.gets = 0
        if resident:
            self.resident = lambda layer, experts: store.missing_bytes(layer, experts) == 0

    def plan(self, layer: int, experts: Sequence[int]) -> None:
        self.store.plan(layer, experts)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        self.gets += 1
        return ExpertWeights(*self.store.get(layer, [expert])[expert])


class Spy(RoutedMoE):
    """SwiGLU experts; counts the fused runs that produced the output."""

    fused = 0

    def _run_fused(self, x, groups, fetched):
        y = super()._run_fused(x, groups, fetched)
        self.fused += y is not None
        return y


def routing(n: int, seed: int, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n rows routed to K of the first `experts` experts (the rest get no rows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g)
    w, ids = torch.topk(torch.rand(n, experts, generator=g), K, dim=1)
    return x, ids, w / w.sum(1, keepdim=True)


@pytest.mark.parametrize("types", [(T.MXFP4, T.MXFP4), (T.Q4_K, T.MXFP4)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 8, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_per_expert_bitwise(types, threads, n, dtype, monkeypatch):
    monkeypatch.setattr(moe_mod, "FUSED_MAX_ROWS", 64)        # every row count here runs fused
    store = make_store(*types)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, ids, w = routing(n, seed=n, experts=E - 3)           # 3 experts never routed to
        x, w = x.to(dtype), w.to(dtype)
        outs = []
        for resident in (True, False):
            moe = Spy(E, H, FF, 0, with_experts=False)
            provider = Provider(store, resident)
            store.get(0, range(E))                              # all cached: `resident` says so
            outs.append(moe.run_experts(x, ids, w, provider))
            assert moe.fused == int(resident)                   # the fused path ran, or did not
            assert provider.gets == len(torch.unique(ids))      # each routed expert fetched once
    finally:
        torch.set_num_threads(old)
    fused, each = outs
    assert fused.dtype == dtype and fused.shape == (n, H)
    assert torch.equal(fused.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       each.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert fused.abs().sum() > 0


def test_not_resident_and_float_weights_take_the_per_expert_path():
    """A miss in the cache (or float weights) never runs fused; the result is the same."""
    store = make_store(T.MXFP4, T.MXFP4)
    x, ids, w = routing(5, seed=1, experts=E)
    moe = Spy(E, H, FF, 0, with_experts=False)
    out = moe.run_experts(x, ids, w, Provider(store, resident=True))   # cold store: not resident
    assert moe.fused == 0
    again = moe.run_experts(x, ids, w, Provider(store, resident=True))  # now every expert is cached
    assert moe.fused == 1
    assert torch.equal(out, again)
    own = Spy(E, H, FF, 0)
    torch.nn.init.normal_(own.gate_exps)
    own.run_experts(x, ids, w)                                          # module experts: float
    assert own.fused == 0


def test_experts_matmul_q8_checks_its_inputs():
    store = make_store(T.Q4_K, T.MXFP4)
    ws = store.get(0, [0, 1])
    with pytest.raises(ValueError):
        qmatmul.experts_matmul_q8([[ws[0][0]], [ws[1][2]]], torch.zeros(2, H), [1, 1])   # two shapes
    with pytest.raises(ValueError):
        qmatmul.experts_matmul_q8([[ws[0][0]], [ws[1][0]]], torch.zeros(3, H), [1, 1])   # rows


def test_experts_with_many_rows_run_alone():
    """Beyond FUSED_MAX_ROWS rows for some expert (a prefill chunk) the per-expert path runs."""
    store = make_store(T.MXFP4, T.MXFP4)
    store.get(0, range(E))
    x, ids, w = routing(moe_mod.FUSED_MAX_ROWS * 3, seed=2, experts=K + 1)   # each expert: many rows
    moe = Spy(E, H, FF, 0, with_experts=False)
    moe.run_experts(x, ids, w, Provider(store, resident=True))
    assert moe.fused == 0
    moe.run_experts(x[:1], ids[:1], w[:1], Provider(store, resident=True))
    assert moe.fused == 1


def test_small_experts_run_fused_at_any_row_count(monkeypatch):
    """Experts of at most FUSED_SMALL_WEIGHTS weights per matrix (the mini's) run fused however
    many rows each has, with the per-expert path's bits; larger ones (above) do not."""
    monkeypatch.setattr(moe_mod, "FUSED_SMALL_WEIGHTS", H * FF)       # this module's experts are "small"
    store = make_store(T.MXFP4, T.MXFP4)
    store.get(0, range(E))
    x, ids, w = routing(moe_mod.FUSED_MAX_ROWS * 3, seed=2, experts=K + 1)
    outs = []
    for resident in (True, False):
        moe = Spy(E, H, FF, 0, with_experts=False)
        outs.append(moe.run_experts(x, ids, w, Provider(store, resident=resident)))
        assert moe.fused == int(resident)
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
    monkeypatch.setattr(moe_mod, "FUSED_SMALL_WEIGHTS", H * FF - 1)
    moe = Spy(E, H, FF, 0, with_experts=False)
    moe.run_experts(x, ids, w, Provider(store, resident=True))
    assert moe.fused == 0
