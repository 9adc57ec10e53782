"""Reading a kimi-k3 GGUF's values back into K3Model (gguf_map), with the converter's
transforms applied here by hand from the HF tensors (llama.cpp's conversion/kimi_k3.py):
names mapped, convs reshaped, A_log -> -exp(A_log), kv_b split into k_b^T / v_b, residual
norm*proj fused, experts stacked. The result must reproduce the model exactly."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from k3_model_helpers import tiny_model, tokens

from k3kit.errors import ConvertError
from k3kit.layers.moe import ModuleExperts
from k3kit.models.kimi_k3 import K3Model
from k3kit.models.kimi_k3.gguf_map import config_from_gguf_kv, infer_optional_parts, load_gguf_tensors
from k3kit.models.kimi_k3.hf import PREFIX, hf_tensors
from k3kit.models.kimi_k3.mxfp4 import mxfp4_dequantize, unpack_codes

_SIMPLE = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.f_a_proj": "ssm_f_a", "self_attn.f_b_proj": "ssm_f_b",
    "self_attn.b_proj": "ssm_beta", "self_attn.o_norm": "ssm_norm", "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "block_sparse_moe.routed_expert_down_proj": "ffn_routed_down",
    "block_sparse_moe.routed_expert_up_proj": "ffn_routed_up",
    "block_sparse_moe.routed_expert_norm": "ffn_routed_norm",
    "block_sparse_moe.shared_experts.gate_proj": "ffn_gate_shexp",
    "block_sparse_moe.shared_experts.up_proj": "ffn_up_shexp",
    "block_sparse_moe.shared_experts.down_proj": "ffn_down_shexp",
}


def _to_gguf(model) -> dict[str, np.ndarray]:
    cfg = model.cfg
    hf = {k.removeprefix(PREFIX): v for k, v in hf_tensors(model).items()}
    out: dict[str, np.ndarray] = {}
    res: dict[str, dict[str, torch.Tensor]] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    full = {i for i in range(cfg.num_layers) if not cfg.is_kda(i)}
    for name, t in hf.items():
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = t.numpy()
            continue
        if name == "model.norm.weight":
            out["output_norm.weight"] = t.numpy()
            continue
        if name == "lm_head.weight":
            out["output.weight"] = t.numpy()
            continue
        if m := re.fullmatch(r"(.*)_res_(norm|proj)\.weight", name):
            res.setdefault(m.group(1), {})[m.group(2)] = t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        il, rest = int(m.group(1)), m.group(2)
        b = f"blk.{il}."
        if m := re.fullmatch(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight_(packed|scale)", rest):
            experts.setdefault((il, m.group(2)), {}).setdefault(int(m.group(1)), {})[m.group(3)] = t
        elif rest.endswith("_conv1d.weight"):
            C, _, K = t.shape
            out[b + f"ssm_conv1d_{rest[10]}.weight"] = t.reshape(1, C, 1, K).numpy()
        elif rest == "self_attn.A_log":
            out[b + "ssm_a"] = (-torch.exp(t.float())).numpy()
        elif rest == "self_attn.dt_bias":
            out[b + "ssm_dt.bias"] = t.numpy()
        elif rest == "self_attn.g_proj.weight":
            out[b + ("attn_gate.weight" if il in full else "ssm_g.weight")] = t.numpy()
        elif rest == "block_sparse_moe.gate.e_score_correction_bias":
            out[b + "exp_probs_b.bias"] = t.numpy()
        elif rest == "self_attn.kv_b_proj.weight":
            H, nope, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            k_b, v_b = torch.split(t.view(H, nope + v, -1), [nope, v], dim=1)
            out[b + "attn_k_b.weight"] = k_b.transpose(1, 2).contiguous().numpy()
            out[b + "attn_v_b.weight"] = v_b.contiguous().numpy()
        else:
            out[b + _SIMPLE[rest.removesuffix(".weight")] + ".weight"] = t.numpy()
    for stem, parts in res.items():
        fused = (parts["norm"].float().flatten() * parts["proj"].float().flatten()).numpy()
        if stem == "model.output_attn":
            out["output_res_score.weight"] = fused
        else:
            il, kind = re.fullmatch(r"model\.layers\.(\d+)\.(self_attention|mlp)", stem).groups()
            out[f"blk.{il}.{'attn' if kind == 'self_attention' else 'ffn'}_res_score.weight"] = fused
    for (il, wid), per in experts.items():
        stacked = [mxfp4_dequantize(unpack_codes(per[e]["packed"]), per[e]["scale"]) for e in sorted(per)]
        proj = {"w1": "gate", "w2": "down", "w3": "up"}[wid]
        out[f"blk.{il}.ffn_{proj}_exps.weight"] = torch.stack(stacked).numpy()
    return out


def _kv(cfg) -> dict:
    a = "kimi-k3"
    kv = {"general.architecture": a, f"{a}.context_length": cfg.max_position_embeddings,
          f"{a}.embedding_length": cfg.hidden_size, f"{a}.block_count": cfg.num_layers,
          f"{a}.feed_forward_length": cfg.intermediate_size, f"{a}.attention.head_count": cfg.num_heads,
          f"{a}.attention.head_count_kv": np.array([int(not cfg.is_kda(i)) for i in range(cfg.num_layers)]),
          f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
          f"{a}.attention.q_lora_rank": cfg.q_lora_rank, f"{a}.attention.kv_lora_rank": cfg.kv_lora_rank,
          f"{a}.attention.key_length_mla": cfg.qk_head_dim, f"{a}.attention.value_length_mla": cfg.v_head_dim,
          f"{a}.rope.dimension_count": cfg.qk_rope_head_dim, f"{a}.ssm.conv_kernel": cfg.conv_kernel,
          f"{a}.kda.head_dim": cfg.kda_head_dim, f"{a}.kda.gate_lower_bound": cfg.gate_lower_bound,
          f"{a}.expert_count": cfg.num_experts, f"{a}.expert_used_count": cfg.num_experts_per_tok,
          f"{a}.expert_feed_forward_length": cfg.moe_intermediate_size,
          f"{a}.expert_shared_count": cfg.num_shared_experts, f"{a}.expert_gating_func": 2,
          f"{a}.leading_dense_block_count": cfg.first_k_dense,
          f"{a}.expert_latent_length": cfg.expert_latent_size,
          f"{a}.expert_weights_scale": cfg.routed_scaling_factor,
          f"{a}.expert_weights_norm": cfg.moe_renormalize,
          f"{a}.attn_res.block_size": cfg.attn_res_block_size, f"{a}.activation.situ_beta": cfg.situ_beta,
          f"{a}.activation.situ_linear_beta": cfg.situ_linear_beta}
    return kv


def test_gguf_values_rebuild_the_model_exactly():
    ref = tiny_model(seed=3)
    tensors = _to_gguf(ref)
    cfg = infer_optional_parts(config_from_gguf_kv(_kv(ref.cfg), ref.cfg.vocab_size), set(tensors))
    assert cfg == ref.cfg
    model = K3Model(cfg)
    load_gguf_tensors(model, tensors.__getitem__, set(tensors))
    toks = tokens(ref, 12, seed=2)
    with torch.no_grad():
        diff = (model(toks).logits - ref(toks).logits).abs().max().item()
    assert diff < 1e-5      # A_log comes back through log(-(-exp(A_log))): within an ulp


def test_trunk_only_model_runs_on_a_provider():
    ref = tiny_model(seed=3)
    tensors = _to_gguf(ref)
    names = {n for n in tensors if "_exps." not in n}
    trunk = K3Model(ref.cfg, with_experts=False)
    load_gguf_tensors(trunk, tensors.__getitem__, names)
    assert not any(n.endswith("_exps") for n, _ in trunk.named_parameters())
    toks = tokens(ref, 6)

    class FromReference:
        def get(self, layer, expert):
            return ModuleExperts(ref.layers[layer].ffn).get(layer, expert)

    with torch.no_grad():
        with pytest.raises(ValueError, match="ExpertProvider"):
            trunk(toks)
        diff = (trunk(toks, experts=FromReference()).logits - ref(toks).logits).abs().max().item()
    assert diff < 1e-5


def test_bad_gguf_values_are_refused():
    ref = tiny_model(seed=3)
    kv = _kv(ref.cfg)
    with pytest.raises(ConvertError, match="expert_gating_func"):
        config_from_gguf_kv({**kv, "kimi-k3.expert_gating_func": 1}, 96)
    with pytest.raises(ConvertError, match="missing key"):
        config_from_gguf_kv({k: v for k, v in kv.items() if not k.endswith("kda.head_dim")}, 96)
    with pytest.raises(ConvertError, match="architecture"):
        config_from_gguf_kv({**kv, "general.architecture": "llama"}, 96)
    tensors = _to_gguf(ref)
    tensors["blk.0.ssm_a"] = -tensors["blk.0.ssm_a"]
    with pytest.raises(ConvertError, match="ssm_a"):
        load_gguf_tensors(K3Model(ref.cfg), tensors.__getitem__, set(tensors))
    tensors["blk.0.ssm_a"] = -tensors["blk.0.ssm_a"]
    del tensors["blk.2.attn_k_b.weight"]
    with pytest.raises(ConvertError, match="attn_k_b"):
        load_gguf_tensors(K3Model(ref.cfg), tensors.__getitem__, set(tensors))
