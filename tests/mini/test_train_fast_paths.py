"""The training-speed paths compute what the reference model computes.

The chunked KDA (`KDA.chunked`: the chunkwise WY delta rule) and the batched MoE
(`RoutedMoE.batched`: one-shot MXFP4 rounding, all experts in three bmm) are only allowed to
change the order of float operations: in float64 the whole model agrees with the reference to
~1e-12, and the MXFP4 rounding is bit-identical, ties included.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from k3kit.models.kimi_k3 import K3Model, init_random, tiny_config
from k3kit.models.kimi_k3.kda import KDA, chunk_size, delta_rule, unit_lower_inverse, use_fast_kda
from k3kit.models.kimi_k3.kda import delta_rule_wy as chunk_delta_rule
from k3kit.models.kimi_k3.kda import forward_wy as kda_forward
from k3kit.models.kimi_k3.moe import LatentMoE, use_fast_moe
from k3kit.models.kimi_k3.mxfp4 import mxfp4_fake_quant, mxfp4_fake_quant_fast, mxfp4_quantize, mxfp4_round


def _delta_inputs(B=2, T=45, H=3, D=16, seed=0, lb=-5.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g, dtype=dtype), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, D, generator=g, dtype=dtype)
    gate = torch.sigmoid(torch.randn(B, T, H, D, generator=g, dtype=dtype) * 3) * lb
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=dtype))
    S = torch.randn(B, H, D, D, generator=g, dtype=dtype)
    return S, q, k, v, gate, beta


@pytest.mark.parametrize("T,chunk", [(45, 16), (32, 16), (7, 8), (1, 4)])
def test_chunk_delta_rule_equals_the_recurrence(T, chunk):
    S, q, k, v, g, beta = _delta_inputs(T=T)
    o_ref, S_ref = delta_rule(S, q, k, v, g, beta)
    o, S_out = chunk_delta_rule(S, q, k, v, g, beta, chunk)
    assert o.shape == o_ref.shape
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(S_out, S_ref, rtol=0, atol=1e-10)


def test_chunk_delta_rule_float32_at_the_strongest_decay():
    # decays pinned near the gate's lower bound: exp(-G) reaches ~e^80 inside a chunk of 16
    S, q, k, v, g, beta = _delta_inputs(T=64, dtype=torch.float32)
    g = torch.full_like(g, -4.999)
    o_ref, S_ref = delta_rule(S, q, k, v, g, beta)
    o, S_out = chunk_delta_rule(S, q, k, v, g, beta, chunk_size(-5.0))
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S_out, S_ref, rtol=1e-4, atol=1e-5)


def test_chunk_size_keeps_the_decay_in_range():
    assert chunk_size(-5.0) == 16
    assert chunk_size(-10.0) == 8
    assert chunk_size(None) is None          # unbounded softplus gate: the reference loop runs
    for lb in (-0.5, -5.0, -7.0, -40.0, -200.0):
        c = chunk_size(lb)
        assert c >= 1 and (c & (c - 1)) == 0 and (c * abs(lb) <= 80 or c == 1)


def test_unit_lower_inverse():
    g = torch.Generator().manual_seed(3)
    for C in (2, 4, 16):
        N = torch.randn(5, C, C, generator=g, dtype=torch.float64).tril(-1)
        eye = torch.eye(C, dtype=torch.float64)
        torch.testing.assert_close(unit_lower_inverse(N) @ (eye + N), eye.expand(5, C, C), rtol=0, atol=1e-9)


def test_kda_module_fast_forward_and_gradients_match_the_reference():
    cfg = tiny_config()
    torch.manual_seed(0)
    ref = init_random(K3Model(cfg), 2).double().layers[1].attn
    assert isinstance(ref, KDA)
    x = torch.randn(2, 37, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    y_ref, _ = ref(x)
    (y_ref ** 2).sum().backward()
    g_ref = {n: p.grad.clone() for n, p in ref.named_parameters()}
    gx_ref = x.grad.clone()
    x.grad = None
    ref.zero_grad()
    y, rows = kda_forward(ref, x)
    assert rows is None
    (y ** 2).sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(x.grad, gx_ref, rtol=0, atol=1e-9)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(p.grad, g_ref[n], rtol=0, atol=1e-9, msg=n)


def test_kda_fast_path_defers_to_the_reference_with_a_state():
    cfg = tiny_config()
    model = init_random(K3Model(cfg), 2)
    fast = copy.deepcopy(model)
    assert use_fast_kda(fast) == cfg.layer_kinds.count("kda")
    toks = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    s1, s2 = model.new_state(), fast.new_state()
    a = model(toks, s1).logits
    b = fast(toks, s2).logits
    assert torch.equal(a, b)
    for l1, l2 in zip(s1.layers, s2.layers, strict=True):
        if hasattr(l1, "S"):
            assert torch.equal(l1.S, l2.S) and torch.equal(l1.conv, l2.conv)


def test_fast_mxfp4_rounding_is_ggmls():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 256, generator=g) * torch.exp(torch.randn(96, 1, generator=g) * 4)
    w[3, :32] = 0.0                                      # an all-zero block
    w[4, 5] = float(2 ** -140)                          # denormal-ish neighbours of a normal block
    assert torch.equal(mxfp4_round(w), mxfp4_fake_quant(w))
    # every midpoint between e2m1 magnitudes, both signs, in one block whose scale is 1
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.5]
    row = torch.tensor([6.0] + mids + [-m for m in mids] + [0.0] * (32 - 1 - 2 * len(mids)))
    assert torch.equal(mxfp4_round(row[None]), mxfp4_fake_quant(row[None]))
    assert mxfp4_round(row[None])[0, 1:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    # on the grid: rounding again changes nothing, and the codes reproduce it
    r = mxfp4_round(w)
    assert torch.equal(mxfp4_round(r), r)
    from k3kit.models.kimi_k3.mxfp4 import mxfp4_dequantize
    assert torch.equal(mxfp4_dequantize(*mxfp4_quantize(r)), r)


def test_fast_fake_quant_is_straight_through():
    w = torch.randn(4, 64, requires_grad=True)
    (mxfp4_fake_quant_fast(w) * torch.arange(64.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(64.0).expand(4, 64))


def test_whole_model_fast_paths_equal_the_reference_in_float64():
    cfg = tiny_config()
    model = init_random(K3Model(cfg), 4).double()
    fast = copy.deepcopy(model)
    use_fast_kda(fast)
    assert use_fast_moe(fast) == sum(isinstance(m, LatentMoE) for m in model.modules())
    toks = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(2))
    ref = model(toks, return_routes=True)
    out = fast(toks, return_routes=True)
    for il in ref.routes:
        assert torch.equal(ref.routes[il], out.routes[il])
    err = (ref.logits - out.logits).abs().max().item()
    assert err < 1e-9 * max(1.0, ref.logits.abs().max().item()), err
    assert math.isfinite(err)
