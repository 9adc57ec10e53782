"""Router (bias selects, never weighs), the latent MoE pipeline and the expert provider hook."""

from __future__ import annotations

import math

import torch
from k3_model_helpers import tiny_model

from k3kit.layers.moe import ExpertWeights, ModuleExperts
from k3kit.layers.norm import rms_norm
from k3kit.models.kimi_k3.activations import situ
from k3kit.models.kimi_k3.config import tiny_config
from k3kit.models.kimi_k3.moe import LatentMoE, Router, route, weight_sum
from k3kit.models.kimi_k3.mxfp4 import mxfp4_fake_quant
from k3kit.models.kimi_k3.row_ffn import host_weights


def test_router_bias_selects_but_does_not_weigh():
    cfg = tiny_config(num_experts=4, num_experts_per_tok=2, routed_scaling_factor=2.5, moe_renormalize=True)
    r = Router(cfg).double()
    with torch.no_grad():
        r.weight.zero_()
        r.weight[:, 0] = torch.tensor([2.0, 1.0, 0.5, -1.0], dtype=torch.float64)
        r.bias.copy_(torch.tensor([0.0, 0.0, 0.6, 0.0], dtype=torch.float64))
    x = torch.zeros(1, cfg.hidden_size, dtype=torch.float64)
    x[0, 0] = 1.0
    ids, w = r(x)
    p = [1 / (1 + math.exp(-v)) for v in (2.0, 1.0, 0.5, -1.0)]
    # biased scores: 0.881, 0.731, 0.622+0.6=1.222, 0.269 -> experts 2 then 0 (1 loses to the bias)
    assert ids.tolist() == [[2, 0]]
    want = [p[2] / (p[2] + p[0]) * 2.5, p[0] / (p[2] + p[0]) * 2.5]
    assert torch.allclose(w, torch.tensor([want], dtype=torch.float64), rtol=1e-12)


def test_router_without_renormalisation_or_scale():
    cfg = tiny_config(num_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.0, moe_renormalize=False)
    r = Router(cfg).double()
    with torch.no_grad():
        r.weight.zero_()
        r.weight[:, 1] = torch.tensor([-1.0, 3.0, 0.0, 1.0], dtype=torch.float64)
    x = torch.zeros(1, cfg.hidden_size, dtype=torch.float64)
    x[0, 1] = 1.0
    ids, w = r(x)
    assert ids.tolist() == [[1, 3]]
    assert torch.allclose(w, torch.sigmoid(torch.tensor([[3.0, 1.0]], dtype=torch.float64)), rtol=1e-14)


def _moe_by_hand(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    cfg = moe.cfg
    out = []
    for row in x:
        probs = torch.sigmoid(moe.router.weight @ row)
        order = sorted(range(cfg.num_experts), key=lambda e: -(probs[e] + moe.router.bias[e]).item())
        top = order[:cfg.num_experts_per_tok]
        w = probs[top] / probs[top].sum() * cfg.routed_scaling_factor
        z = moe.routed_down.weight @ row
        y = torch.zeros_like(z)
        for wi, e in zip(w, top, strict=True):
            g = mxfp4_fake_quant(moe.gate_exps[e]) @ z
            u = mxfp4_fake_quant(moe.up_exps[e]) @ z
            h = situ(g, u, cfg.situ_beta, cfg.situ_linear_beta)
            y = y + wi * (mxfp4_fake_quant(moe.down_exps[e]) @ h)
        y = moe.routed_up.weight @ rms_norm(y, moe.routed_norm, cfg.rms_norm_eps)
        sh = moe.shared
        y = y + sh.down_proj.weight @ situ(sh.gate_proj.weight @ row, sh.up_proj.weight @ row,
                                           cfg.situ_beta, cfg.situ_linear_beta)
        out.append(y)
    return torch.stack(out)


def test_latent_moe_matches_hand_computation():
    model = tiny_model(seed=4, dtype=torch.float64)
    moe = model.layers[1].ffn
    assert isinstance(moe, LatentMoE)
    x = torch.randn(5, model.cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, ids = moe(x)
        want = _moe_by_hand(moe, x)
    assert ids.shape == (5, model.cfg.num_experts_per_tok)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


class _Recording:
    def __init__(self, inner: ModuleExperts, scale: float = 1.0):
        self.inner, self.scale, self.calls = inner, scale, []

    def get(self, layer: int, expert: int) -> ExpertWeights:
        self.calls.append((layer, expert))
        w = self.inner.get(layer, expert)
        return ExpertWeights(w.gate * self.scale, w.up, w.down)


def test_expert_provider_each_expert_once_and_routes_exposed():
    model = tiny_model(seed=5)
    toks = torch.arange(12)[None] % model.cfg.vocab_size
    base = model(toks, return_routes=True)
    moe_layers = [il for il, l in enumerate(model.layers) if isinstance(l.ffn, LatentMoE)]
    assert sorted(base.routes) == moe_layers

    class Multi:
        def __init__(self, scale):
            self.per = {il: _Recording(ModuleExperts(model.layers[il].ffn), scale) for il in moe_layers}

        def get(self, layer, expert):
            return self.per[layer].get(layer, expert)

    same = Multi(1.0)
    out = model(toks, experts=same, return_routes=True)
    assert torch.equal(out.logits, base.logits)
    for il in moe_layers:
        calls = same.per[il].calls
        assert len(calls) == len(set(calls))                           # each distinct expert once
        assert {e for _, e in calls} == set(out.routes[il].flatten().tolist())
    # the provider's weights are the ones used (a scaled gate: the routed norm hides a scaled down)
    other = model(toks, experts=Multi(0.5))
    assert not torch.allclose(other.logits, base.logits, atol=1e-3)


def test_weight_sum_is_ggmls_double_sum_in_slot_order():
    """The routing weights' sum: accumulated in double in slot order and rounded once (ggml's
    sum_rows), whatever the CPU's vector width; 8 weights whose float sums differ by order."""
    g = torch.Generator().manual_seed(0)
    w = torch.rand(4000, 8, generator=g) ** 6
    sums = []
    for row in w.tolist():
        acc = 0.0                  # a plain loop: Python 3.12's sum() of floats compensates
        for v in row:
            acc += v
        sums.append(acc)
    want = torch.tensor(sums, dtype=torch.float64).float()
    got = weight_sum(w)
    assert got.shape == (4000, 1)
    assert torch.equal(got[:, 0].view(torch.int32), want.view(torch.int32))


def test_host_weights_are_routes_floats():
    """A decode row's weights made on the host from its ids equal route's, bit for bit: with and
    without renormalisation and a scaling factor, sums below the clamp, and NaN scores."""
    g = torch.Generator().manual_seed(1)
    for renorm, scale in ((True, 1.0), (True, 2.5), (False, 2.5), (False, 1.0), (True, 0.1)):
        cfg = tiny_config(moe_renormalize=renorm, routed_scaling_factor=scale)
        E = cfg.num_experts
        for trial in range(200):
            probs = torch.sigmoid(torch.randn(1, E, generator=g) * 6)
            if trial % 7 == 0:
                probs = probs * 1e-6                       # a sum under the clamp
            if trial % 23 == 0:
                probs[0, int(torch.randint(E, (1,), generator=g))] = float("nan")
            bias = torch.randn(E, generator=g) * 0.1
            ids, w = route(probs, bias, cfg)
            host = torch.tensor(host_weights(probs, ids.tolist()[0], cfg).tolist(), dtype=torch.float32)
            assert torch.equal(host.view(torch.int32), w[0].view(torch.int32)), (renorm, scale, trial)


def test_routes_native_weights_are_torchs_ops():
    """route's one native call for CPU float32 scores gives the torch ops' weights bit for bit
    (gather, the double slot-order sum, clamp_min, divide, the scaling factor): 1 to 8 rows, with
    and without renormalisation, sums under the clamp, NaN scores; a score tensor with a gradient
    takes the torch ops (autograd)."""
    from k3kit.kernels import fused
    if getattr(fused._fused, "route_weights", None) is None:
        import pytest
        pytest.skip("the _fused extension is not built")
    g = torch.Generator().manual_seed(2)
    for renorm, scale in ((True, 1.0), (True, 2.5), (False, 2.5), (False, 1.0), (True, 0.1)):
        cfg = tiny_config(moe_renormalize=renorm, routed_scaling_factor=scale)
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        for trial in range(120):
            n = 1 + trial % 8
            probs = torch.sigmoid(torch.randn(n, E, generator=g) * 6)
            if trial % 7 == 0:
                probs[0] = probs[0] * 1e-6                  # a sum under the clamp
            if trial % 11 == 0:
                probs[n - 1, int(torch.randint(E, (1,), generator=g))] = float("nan")
            bias = torch.randn(E, generator=g) * 0.1
            ids, w = route(probs, bias, cfg)
            want = torch.gather(probs, -1, ids)
            if renorm:
                want = want / weight_sum(want).clamp_min(6.103515625e-5)
            if scale not in (0.0, 1.0):
                want = want * scale
            assert w.shape == (n, k)
            assert torch.equal(w.view(torch.int32), want.view(torch.int32)), (renorm, scale, trial)
    probs = torch.rand(2, E, requires_grad=True)
    _, w = route(probs, torch.zeros(E), cfg)
    assert w.grad_fn is not None
