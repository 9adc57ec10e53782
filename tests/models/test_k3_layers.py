"""KDA and MLA layers against independent, written-out readings of their math (float64)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from k3_model_helpers import tiny_model

from k3kit.layers.norm import rms_norm
from k3kit.models.kimi_k3.kda import KDA
from k3kit.models.kimi_k3.mla import MLA


def _x(model, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, model.cfg.hidden_size, generator=g, dtype=torch.float64)


def test_kda_gate_is_k3_lower_bound_sigmoid():
    model = tiny_model(dtype=torch.float64)
    kda = model.layers[0].attn
    x = _x(model, 3)
    cfg = model.cfg
    u = (kda.f_b_proj.weight @ (kda.f_a_proj.weight @ x[0].T)).T + kda.dt_bias
    u = u.view(3, cfg.num_heads, cfg.kda_head_dim)
    want = -5.0 * torch.sigmoid(torch.exp(kda.A_log)[None, :, None] * u)
    with torch.no_grad():
        assert torch.allclose(kda.decay(x)[0], want, rtol=1e-13)
        assert (kda.decay(x) < 0).all() and (kda.decay(x) > -5).all()
    # without a lower bound: kimi-linear's -exp(A_log) * softplus(...)
    soft = tiny_model(dtype=torch.float64, gate_lower_bound=None).layers[0].attn
    soft.load_state_dict(kda.state_dict())
    with torch.no_grad():
        want_soft = -torch.exp(kda.A_log)[None, :, None] * F.softplus(u)
        assert torch.allclose(soft.decay(x)[0], want_soft, rtol=1e-13)


def test_kda_layer_matches_matrix_form():
    model = tiny_model(dtype=torch.float64)
    kda = model.layers[3].attn
    assert isinstance(kda, KDA)
    cfg, T = model.cfg, 9
    H, D, eps = cfg.num_heads, cfg.kda_head_dim, cfg.rms_norm_eps
    x = _x(model, T, 1)
    with torch.no_grad():
        got, _ = kda(x)
        xs = x[0]
        def conv(w_proj, w_conv):
            p = xs @ w_proj.T                                     # [T, C]
            pad = torch.cat((torch.zeros(cfg.conv_kernel - 1, p.shape[1], dtype=p.dtype), p))
            return F.silu(torch.stack([(pad[t:t + cfg.conv_kernel].T * w_conv).sum(1) for t in range(T)]))
        q = conv(kda.q_proj.weight, kda.q_conv).view(T, H, D)
        k = conv(kda.k_proj.weight, kda.k_conv).view(T, H, D)
        v = conv(kda.v_proj.weight, kda.v_conv).view(T, H, D)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + eps)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + eps)
        alpha = torch.exp(kda.decay(x)[0])
        beta = torch.sigmoid(xs @ kda.b_proj.weight.T)
        o = torch.zeros(T, H, D, dtype=torch.float64)
        for h in range(H):
            S = torch.zeros(D, D, dtype=torch.float64)
            for t in range(T):
                kk = k[t, h][:, None]
                eye = torch.eye(D, dtype=torch.float64)
                S = (eye - beta[t, h] * kk @ kk.T) @ torch.diag(alpha[t, h]) @ S
                S = S + beta[t, h] * kk @ v[t, h][None, :]
                o[t, h] = S.T @ q[t, h] / math.sqrt(D)
        gate = torch.sigmoid(xs @ kda.g_proj.weight.T).view(T, H, D)
        want = (rms_norm(o, kda.o_norm, eps) * gate).reshape(T, H * D) @ kda.o_proj.weight.T
    assert torch.allclose(got[0], want, rtol=1e-10, atol=1e-12)


def test_mla_absorbed_matches_plain_attention():
    model = tiny_model(dtype=torch.float64)
    mla = model.layers[2].attn
    assert isinstance(mla, MLA)
    cfg, T = model.cfg, 6
    H, nope, pe = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    L, vd = cfg.kv_lora_rank, cfg.v_head_dim
    x = _x(model, T, 2)
    with torch.no_grad():
        got = mla(x)[0]
        xs = x[0]
        q = (rms_norm(xs @ mla.q_a_proj.weight.T, mla.q_a_norm, cfg.rms_norm_eps) @ mla.q_b_proj.weight.T)
        q = q.view(T, H, nope + pe)
        kvpe = xs @ mla.kv_a_proj.weight.T
        c = rms_norm(kvpe[:, :L], mla.kv_a_norm, cfg.rms_norm_eps)
        kv = (c @ mla.kv_b_proj.weight.T).view(T, H, nope + vd)           # un-absorbed keys/values
        k = torch.cat((kv[..., :nope], kvpe[:, None, L:].expand(T, H, pe)), dim=-1)
        v = kv[..., nope:]
        out = torch.zeros(T, H, vd, dtype=torch.float64)
        for h in range(H):
            s = q[:, h] @ k[:, h].T / math.sqrt(nope + pe)
            s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
            out[:, h] = torch.softmax(s, -1) @ v[:, h]
        out = out.reshape(T, H * vd) * torch.sigmoid(xs @ mla.g_proj.weight.T)
        want = out @ mla.o_proj.weight.T
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_variants_without_optional_parts_run_and_differ():
    toks = torch.arange(9)[None]
    base = tiny_model(seed=2)
    outs = {}
    for name, over in {"no_q_lora": dict(q_lora_rank=None), "no_gate": dict(mla_output_gate=False),
                       "no_latent": dict(expert_latent_size=0, routed_expert_norm=False),
                       "no_res": dict(attn_res_block_size=0), "no_shared": dict(num_shared_experts=0),
                       "float_experts": dict(experts_mxfp4=False)}.items():
        m = tiny_model(seed=2, **over)
        with torch.no_grad():
            outs[name] = m(toks).logits
        assert torch.isfinite(outs[name]).all()
    with torch.no_grad():
        ref = base(toks).logits
    # float experts vs MXFP4 experts: same parameters, different (rounded) weights in use
    assert not torch.allclose(outs["float_experts"], ref, atol=1e-4)


def test_chunked_delta_rule_equals_step_loop():
    from k3kit.models.kimi_k3.activations import l2_norm
    from k3kit.models.kimi_k3.kda import delta_rule, delta_rule_chunked

    g = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 45, 3, 16              # not a multiple of the chunk; non-zero start state

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k = l2_norm(r(B, T, H, D), 1e-5), l2_norm(r(B, T, H, D), 1e-5)
    v, decay = r(B, T, H, D), -5 * torch.sigmoid(3 * r(B, T, H, D))
    beta, S0 = torch.sigmoid(r(B, T, H)), 0.3 * r(B, H, D, D)
    o1, S1 = delta_rule(S0, q, k, v, decay, beta)
    for chunk in (1, 7, 16, 64):
        o2, S2 = delta_rule_chunked(S0, q, k, v, decay, beta, chunk=chunk)
        assert (o1 - o2).abs().max() < 1e-12 and (S1 - S2).abs().max() < 1e-12
