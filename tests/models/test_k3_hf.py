"""HF checkpoint: exact round trip, the names/layouts llama.cpp's converter reads, and
hostile inputs rejected with one-line K3Errors."""

from __future__ import annotations

import json

import pytest
import torch
from k3_model_helpers import tiny_model
from safetensors import safe_open
from safetensors.torch import save_file

from k3kit.adapters.kimi_k3_hf import load_hf, save_hf
from k3kit.errors import ConvertError, FormatError, K3Error
from k3kit.models.kimi_k3.config import K3ModelConfig, tiny_config
from k3kit.models.kimi_k3.hf import PREFIX, hf_tensors
from k3kit.models.kimi_k3.moe import LatentMoE
from k3kit.models.kimi_k3.mxfp4 import mxfp4_fake_quant


def test_round_trip_is_exact(tmp_path):
    model = tiny_model(seed=3)
    save_hf(model, tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")       # another writer's file survives a re-save
    loaded = load_hf(tmp_path)
    a, b = dict(model.named_parameters()), dict(loaded.named_parameters())
    assert a.keys() == b.keys()
    for name, p in a.items():
        want = mxfp4_fake_quant(p) if name.endswith(("gate_exps", "up_exps", "down_exps")) else p
        assert torch.equal(b[name], want.detach()), name
    toks = torch.arange(11)[None]
    with torch.no_grad():
        assert torch.equal(model(toks).logits, loaded(toks).logits)
    # a second save of the loaded model is byte-identical tensor by tensor
    again = hf_tensors(loaded)
    first = hf_tensors(model)
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    save_hf(loaded, tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == "{}"
    assert not list(tmp_path.glob("*.tmp"))


def test_config_round_trip_and_converter_keys():
    cfg = tiny_config(bos_token_id=1, eos_token_id=2)
    hf = cfg.to_hf_config()
    assert hf["architectures"] == ["KimiK3ForConditionalGeneration"]
    t = hf["text_config"]
    lin = t["linear_attn_config"]
    assert lin["full_attn_layers"] == [3, 6]               # 1-indexed MLA layers
    assert lin["short_conv_kernel_size"] == 4 and lin["head_dim"] == 16 and lin["gate_lower_bound"] == -5.0
    assert t["mla_use_nope"] is True and t["hidden_act"] == "situ"
    assert t["num_key_value_heads"] == t["num_attention_heads"]
    for key in ("attn_res_block_size", "routed_expert_hidden_size", "moe_intermediate_size",
                "num_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "moe_renormalize",
                "activation_situ_beta",
                "activation_situ_linear_beta", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "intermediate_size", "num_experts", "num_experts_per_tok"):
        assert key in t, key
    assert "head_dim" not in t       # would make the converter write a wrong attention.key_length
    q = hf["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mxfp4-pack-quantized"
    back = K3ModelConfig.from_hf_config(json.loads(json.dumps(hf)))
    assert back == cfg


def test_tensor_names_and_layouts_the_converter_expects(tmp_path):
    model = tiny_model(seed=3)
    cfg = model.cfg
    save_hf(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
    L = PREFIX + "model.layers."
    C, D, H = cfg.kda_dim, cfg.kda_head_dim, cfg.num_heads
    assert shapes[L + "0.self_attn.q_conv1d.weight"] == (C, 1, cfg.conv_kernel)
    assert shapes[L + "0.self_attn.A_log"] == (H,)
    assert shapes[L + "0.self_attn.dt_bias"] == (C,)
    assert shapes[L + "0.self_attn.g_proj.weight"] == (C, cfg.hidden_size)       # KDA full-rank gate
    assert shapes[L + "0.self_attn.o_norm.weight"] == (D,)
    assert shapes[L + "2.self_attn.g_proj.weight"] == (H * cfg.v_head_dim, cfg.hidden_size)   # MLA gate
    assert shapes[L + "2.self_attn.kv_b_proj.weight"] == (H * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                                          cfg.kv_lora_rank)
    assert shapes[L + "2.self_attn.kv_a_proj_with_mqa.weight"] == (cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                                                  cfg.hidden_size)
    assert L + "0.mlp.gate_proj.weight" in shapes and L + "0.block_sparse_moe.gate.weight" not in shapes
    moe = L + "1.block_sparse_moe."
    assert shapes[moe + "gate.e_score_correction_bias"] == (cfg.num_experts,)
    assert shapes[moe + "routed_expert_down_proj.weight"] == (cfg.expert_latent_size, cfg.hidden_size)
    assert shapes[moe + "routed_expert_norm.weight"] == (cfg.expert_latent_size,)
    ff, lat = cfg.moe_intermediate_size, cfg.expert_latent_size
    for e in range(cfg.num_experts):
        for wid, (rows, cols) in {"w1": (ff, lat), "w3": (ff, lat), "w2": (lat, ff)}.items():
            assert shapes[f"{moe}experts.{e}.{wid}.weight_packed"] == (rows, cols // 2)
            assert shapes[f"{moe}experts.{e}.{wid}.weight_scale"] == (rows, cols // 32)
            assert dtypes[f"{moe}experts.{e}.{wid}.weight_packed"] == torch.uint8
    assert not any(k.endswith(".weight_shape") for k in shapes)
    # residual scores arrive as norm/proj pairs whose product is the score vector
    for stem in (L + "4.self_attention_res", L + "4.mlp_res", PREFIX + "model.output_attn_res"):
        assert shapes[stem + "_norm.weight"] == (cfg.hidden_size,)
        assert shapes[stem + "_proj.weight"] == (1, cfg.hidden_size)
    n_moe = sum(isinstance(layer.ffn, LatentMoE) for layer in model.layers)
    assert sum(k.endswith("weight_packed") for k in shapes) == n_moe * cfg.num_experts * 3


def test_float_experts_save_as_plain_weights(tmp_path):
    model = tiny_model(seed=3, experts_mxfp4=False)
    save_hf(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in cfg
    loaded = load_hf(tmp_path)
    for (n, a), b in zip(model.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_hostile_inputs(tmp_path):
    model = tiny_model(seed=3)
    save_hf(model, tmp_path)
    cfg_path = tmp_path / "config.json"
    good = json.loads(cfg_path.read_text())

    cfg_path.write_text("{not json")
    with pytest.raises(FormatError, match="config.json"):
        load_hf(tmp_path)

    for mutate in (lambda c: c.update(architectures=["LlamaForCausalLM"]),
                   lambda c: c["text_config"].update(hidden_act="silu"),
                   lambda c: c["text_config"].update(num_hidden_layers=10 ** 9),
                   lambda c: c["text_config"]["linear_attn_config"].update(full_attn_layers=[0]),
                   lambda c: c["text_config"].update(num_experts_per_tok=99),
                   lambda c: c["text_config"].update(hidden_size="64")):
        bad = json.loads(json.dumps(good))
        mutate(bad)
        cfg_path.write_text(json.dumps(bad))
        with pytest.raises(K3Error, match="config.json"):
            load_hf(tmp_path)
    # a valid but enormous config is refused before anything is allocated (~4 GB here)
    big = json.loads(json.dumps(good))
    big["text_config"]["num_experts"] = 60000
    cfg_path.write_text(json.dumps(big))
    with pytest.raises(ConvertError, match="declares"):
        load_hf(tmp_path)
    cfg_path.write_text(json.dumps(good))

    weights = tmp_path / "model.safetensors"
    tensors = hf_tensors(model)
    victim = PREFIX + "model.layers.2.self_attn.kv_b_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != victim}, str(weights))
    with pytest.raises(ConvertError, match="kv_b_proj"):
        load_hf(tmp_path)
    save_file({**tensors, victim: tensors[victim][:-1]}, str(weights))
    with pytest.raises(ConvertError, match="shape"):
        load_hf(tmp_path)
    save_file({**tensors, PREFIX + "model.extra.weight": torch.zeros(2)}, str(weights))
    with pytest.raises(ConvertError, match="unexpected"):
        load_hf(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    weights.write_bytes(data[: len(data) // 3])
    with pytest.raises(FormatError, match="model.safetensors"):
        load_hf(tmp_path)
