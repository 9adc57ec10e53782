"""situ, the norms and attn-res mixing against their formulas, written out by hand."""

from __future__ import annotations

import math

import torch

from k3kit.layers.norm import rms_norm
from k3kit.models.kimi_k3.activations import l2_norm, situ
from k3kit.models.kimi_k3.attn_res import res_mix


def test_situ_matches_formula():
    g = torch.linspace(-40, 40, 801, dtype=torch.float64)
    u = torch.linspace(90, -90, 801, dtype=torch.float64)
    got = situ(g, u, 4.0, 25.0)
    for i in range(0, 801, 37):
        gi, ui = g[i].item(), u[i].item()
        want = 4.0 * math.tanh(gi / 4.0) / (1 + math.exp(-gi)) * 25.0 * math.tanh(ui / 25.0)
        assert math.isclose(got[i].item(), want, rel_tol=1e-12, abs_tol=1e-12)
    # soft clamps: |gate part| < beta, |up part| < lb
    assert got.abs().max() < 4.0 * 25.0


def test_situ_linear_beta_off_leaves_up_unchanged():
    g = torch.tensor([0.3, -2.0, 7.5], dtype=torch.float64)
    u = torch.tensor([100.0, -3.0, 0.5], dtype=torch.float64)
    for lb in (0.0, -1.0):
        got = situ(g, u, 4.0, lb)
        want = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * u
        assert torch.allclose(got, want, rtol=1e-14, atol=0)
    assert not torch.allclose(situ(g, u, 4.0, 25.0), situ(g, u, 4.0, 0.0))


def test_norms():
    x = torch.tensor([[3.0, 4.0, 0.0, 0.0]], dtype=torch.float64)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    r = rms_norm(x, w, 1e-5)
    rms = math.sqrt(25 / 4 + 1e-5)
    assert torch.allclose(r, torch.tensor([[3 / rms, 8 / rms, 0, 0]], dtype=torch.float64))
    n = l2_norm(x, 1e-5)
    assert torch.allclose(n, x / math.sqrt(25 + 1e-5))
    # llama.cpp's form: rms_norm(x, eps/n) / sqrt(n)
    assert torch.allclose(n, rms_norm(x, None, 1e-5 / 4) / 2.0, rtol=1e-14)


def test_res_mix_by_hand():
    g = torch.Generator().manual_seed(0)
    H, eps = 8, 1e-5
    bank = [torch.randn(3, H, generator=g, dtype=torch.float64) * s for s in (1.0, 5.0)]
    cur = torch.randn(3, H, generator=g, dtype=torch.float64)
    w = torch.randn(H, generator=g, dtype=torch.float64)
    got = res_mix(bank, cur, w, eps)
    for t in range(3):
        xs = [b[t] for b in bank] + [cur[t]]
        scores = [sum((x / torch.sqrt((x * x).mean() + eps) * w).tolist()) for x in xs]
        m = max(scores)
        p = [math.exp(s - m) for s in scores]
        p = [v / sum(p) for v in p]
        want = sum(pi * x for pi, x in zip(p, xs, strict=True))     # raw values, normalised scores
        assert torch.allclose(got[t], want, rtol=1e-12, atol=1e-12)
    assert torch.equal(res_mix([], cur, w, eps), cur)
    # the scale of a banked entry does not change its score, only its contribution
    scaled = res_mix([bank[0] * 10, bank[1]], cur, w, eps)
    assert not torch.allclose(scaled, got)
