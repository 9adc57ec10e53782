"""The K3 engine adapter over a GGUF: config from KVs, trunk tensors, the speculative Target
contract (verify without committing, commit(n) by replay/truncation), taps, cost."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from engine_models import prompts, tiny_gguf  # noqa: E402
from target_contract import check_target_contract  # noqa: E402

from k3kit.models.kimi_k3.adapter import K3Adapter, _install_layer_split  # noqa: E402
from k3kit.runtime.loader import LoadOptions, adapter_for, load_model  # noqa: E402
from k3kit.runtime.speculative.interface import Target  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs torch on one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("adapter"), "F32")


def test_registry_finds_the_k3_adapter_and_rejects_others(tiny):
    path, model = tiny
    adapter = load_model(path, LoadOptions(expert_cache_mib=0))
    try:
        assert isinstance(adapter, K3Adapter) and isinstance(adapter, Target)
        got, want = adapter.cfg.to_dict(), model.cfg.to_dict()
        assert got.pop("rms_norm_eps") == pytest.approx(want.pop("rms_norm_eps"), rel=1e-6)  # stored as f32
        want["experts_mxfp4"] = True                  # the reference copy rounds experts up front
        assert {k: v for k, v in got.items() if k not in ("bos_token_id", "eos_token_id")} == \
            {k: v for k, v in want.items() if k not in ("bos_token_id", "eos_token_id")}
        ref = dict(model.named_parameters())
        for name, p in adapter.model.named_parameters():   # F32 trunk: bit for bit
            assert torch.equal(p, ref[name]), name
        assert not any("_exps" in n for n, _ in adapter.model.named_parameters())   # experts stay in the file
    finally:
        adapter.close()
    with pytest.raises(Exception, match="no engine adapter"):
        adapter_for("not-a-model", "x.gguf")


def test_target_contract(tiny):
    path, _ = tiny
    made = []

    def make():
        a = load_model(path, LoadOptions(expert_cache_mib=2))
        a.set_taps([0, 2, 4])
        made.append(a)
        return a

    p = prompts(1, 500, seed=4, lo=9, hi=9)[0]
    try:
        check_target_contract(make, p, [5, 77, 300, 12, 401], atol=1e-4)   # float32 batch vs row
    finally:
        for a in made:
            a.close()


def test_verify_leaves_state_and_commit_replays(tiny):
    path, model = tiny
    a = load_model(path, LoadOptions(expert_cache_mib=2))
    a.set_taps([1, 4])
    try:
        p = prompts(1, 500, seed=6, lo=7, hi=7)[0]
        a.forward(p)
        before = a.state.clone()
        rows = [3, 9, 27, 81]
        v = a.verify(rows)
        assert v.logits.shape == (4, a.vocab_size) and v.taps.shape == (4, 2 * model.cfg.hidden_size)
        for x, y in zip(a.state.layers, before.layers, strict=True):   # KDA untouched, MLA pending only
            if hasattr(x, "S"):
                assert torch.equal(x.S, y.S) and torch.equal(x.conv, y.conv)
        assert a.position == len(p)
        a.commit(2)
        assert a.position == len(p) + 2
        # committed state == having run the 2 rows for real
        b = load_model(path, LoadOptions(expert_cache_mib=2))
        try:
            b.forward(p + rows[:2])
            nxt_a, nxt_b = a.forward([rows[2]]), b.forward([rows[2]])
            assert torch.allclose(nxt_a, nxt_b, atol=2e-5, rtol=0)
        finally:
            b.close()
        with pytest.raises(ValueError):
            a.commit(1)                 # nothing pending after a committing forward
    finally:
        a.close()


def test_cost_follows_cache_contents(tiny):
    path, _ = tiny
    a = load_model(path, LoadOptions(expert_cache_mib=64))
    try:
        cold1, cold8 = a.cost(1), a.cost(8)
        assert cold8 > cold1 > 0
        a.forward(prompts(1, 500, seed=1, lo=40, hi=40)[0])    # warms the cache with many experts
        assert a.cost(8) < cold8
        assert a.counters()["expert_misses"] > 0
    finally:
        a.close()


def test_layer_split_hooks_leave_results_unchanged(tiny):
    """The multi-device split (hooks moving activations to each layer's device and back) on a
    CPU-only machine: every "device" is the CPU, so only the plumbing is exercised, not CUDA."""
    path, _ = tiny
    a = load_model(path, LoadOptions(expert_cache_mib=2))
    try:
        p = prompts(1, 500, seed=8, lo=12, hi=12)[0]
        want = a.forward(p, all_logits=True)
        a.reset()
        _install_layer_split(a.model, [torch.device("cpu")] * a.cfg.num_layers)
        assert torch.equal(a.forward(p, all_logits=True), want)
        assert all(len(layer.attn._forward_pre_hooks) == 1 for layer in a.model.layers)
    finally:
        a.close()
