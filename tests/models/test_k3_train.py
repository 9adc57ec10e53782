"""The model trains: every parameter gets a gradient (routed experts through the MXFP4
straight-through estimator), except the router's selection bias (not trained by SGD) and
layer 0's attention-side residual score (its bank is still empty: llama.cpp loads it and
never reads it either)."""

from __future__ import annotations

import torch
from k3_model_helpers import tiny_model, tokens


def test_every_trainable_parameter_gets_a_gradient():
    model = tiny_model(seed=8)
    toks = tokens(model, 40, batch=2)     # 39 rows: the chunked KDA path, backward included
    logits = model(toks[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), toks[:, 1:].reshape(-1))
    loss.backward()
    for name, p in model.named_parameters():
        if name.endswith("router.bias"):
            assert not p.requires_grad and p.grad is None
            continue
        if name == "layers.0.attn_res_score":
            assert p.grad is None
            continue
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        if name.endswith(("gate_exps", "up_exps", "down_exps")):
            continue       # unrouted experts legitimately get zero gradient
        assert p.grad.abs().sum() > 0, name
    moe = model.layers[1].ffn
    assert moe.gate_exps.grad.abs().sum() > 0


def test_ggml_q8_input_emulation_is_a_small_perturbation():
    model = tiny_model(seed=8)
    toks = tokens(model, 6)
    with torch.no_grad():
        plain = model(toks).logits
        model.set_ggml_q8_inputs(True)
        q8 = model(toks).logits
    diff = (plain - q8).abs().max().item()
    assert 0 < diff < 1.0
