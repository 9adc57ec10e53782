"""k3kit's kimi-k3 / dflash key and tensor-name table, the KV type check, and tensor roles."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFValueType as T

from k3kit.gguf import format as fmt
from k3kit.gguf.reader import KV


def test_key_strings_match_llama_cpp():
    # spot checks against src/llama-arch.cpp (LLM_KV_NAMES) for keys gguf 0.19 lacks
    specs = fmt.key_specs(fmt.ARCH_KIMI_K3)
    for name in ("kimi-k3.attn_res.block_size", "kimi-k3.activation.situ_beta",
                 "kimi-k3.activation.situ_linear_beta", "kimi-k3.expert_latent_length",
                 "kimi-k3.kda.head_dim", "kimi-k3.kda.gate_lower_bound", "kimi-k3.ssm.conv_kernel",
                 "kimi-k3.attention.key_length_mla", "kimi-k3.attention.value_length_mla"):
        assert name in specs, name
    dspecs = fmt.key_specs(fmt.ARCH_DFLASH)
    for name in ("dflash.target_layers", "dflash.block_size", "dflash.sample_from_anchor",
                 "dflash.has_confidence_head", "tokenizer.ggml.mask_token_id"):
        assert name in dspecs, name
    assert dspecs["dflash.target_layers"].required
    with pytest.raises(ValueError):
        fmt.key_specs("llama")


def test_required_kimi_k3_keys_and_types():
    specs = fmt.key_specs(fmt.ARCH_KIMI_K3)
    required = {n for n, s in specs.items() if s.required}
    assert {"kimi-k3.attention.layer_norm_rms_epsilon", "kimi-k3.attention.kv_lora_rank",
            "kimi-k3.expert_gating_func", "kimi-k3.attn_res.block_size", "kimi-k3.kda.head_dim",
            "kimi-k3.expert_shared_count", "general.architecture", "tokenizer.ggml.model"} <= required
    assert "kimi-k3.attention.q_lora_rank" not in required  # get_key(..., false)
    assert specs["kimi-k3.kda.gate_lower_bound"].vtype == T.FLOAT32
    assert specs["kimi-k3.expert_weights_norm"].vtype == T.BOOL
    assert specs["kimi-k3.attention.head_count_kv"].per_layer


def _kvs(items):
    return {k.key: k for k in items}


def _valid_k3_kvs(n_layer=4):
    a = "kimi-k3"
    u = T.UINT32
    items = [KV("general.architecture", T.STRING, a), KV("tokenizer.ggml.model", T.STRING, "gpt2"),
             KV("tokenizer.ggml.tokens", T.ARRAY, ["a", "b"], T.STRING),
             KV(f"{a}.attention.head_count_kv", T.ARRAY, np.array([0, 0, 0, 1], np.int32), T.INT32),
             KV(f"{a}.attention.layer_norm_rms_epsilon", T.FLOAT32, 1e-5),
             KV(f"{a}.kda.gate_lower_bound", T.FLOAT32, -5.0)]
    for key, val in (("context_length", 64), ("embedding_length", 256), ("block_count", n_layer),
                     ("attention.key_length_mla", 48), ("attention.value_length_mla", 32),
                     ("attention.kv_lora_rank", 64), ("ssm.conv_kernel", 4), ("kda.head_dim", 64),
                     ("expert_feed_forward_length", 96), ("expert_shared_count", 1),
                     ("expert_gating_func", 2), ("attn_res.block_size", 2)):
        items.append(KV(f"{a}.{key}", u, val))
    items += [KV(f"{a}.activation.situ_beta", T.FLOAT32, 4.0),
              KV(f"{a}.activation.situ_linear_beta", T.FLOAT32, 25.0)]
    return items


def test_check_kv_types_accepts_a_valid_set():
    assert fmt.check_kv_types("kimi-k3", _kvs(_valid_k3_kvs())) == []


def test_check_kv_types_finds_wrong_types_missing_keys_and_bad_arrays():
    items = [k for k in _valid_k3_kvs() if k.key != "kimi-k3.kda.head_dim"]
    items = [KV(k.key, T.INT32, 2) if k.key == "kimi-k3.attn_res.block_size" else k for k in items]
    items = [KV(k.key, T.UINT32, 0) if k.key == "kimi-k3.kda.gate_lower_bound" else k for k in items]
    items = [KV(k.key, T.ARRAY, np.array([0, 1], np.int32), T.INT32)
             if k.key == "kimi-k3.attention.head_count_kv" else k for k in items]
    problems = fmt.check_kv_types("kimi-k3", _kvs(items))
    text = "\n".join(problems)
    assert "missing required key kimi-k3.kda.head_dim" in text
    assert "kimi-k3.attn_res.block_size: expected UINT32, got INT32" in text
    assert "kimi-k3.kda.gate_lower_bound: expected FLOAT32, got UINT32" in text
    assert "kimi-k3.attention.head_count_kv: array length 2 != block_count 4" in text
    assert len(problems) == 4


def test_check_kv_types_per_layer_array_of_floats_is_wrong():
    items = [KV(k.key, T.ARRAY, np.zeros(4, np.float32), T.FLOAT32)
             if k.key == "kimi-k3.attention.head_count_kv" else k for k in _valid_k3_kvs()]
    problems = fmt.check_kv_types("kimi-k3", _kvs(items))
    assert problems == ["kimi-k3.attention.head_count_kv: per-layer array must hold INT32/UINT32, "
                        "got ARRAY[FLOAT32]"]


def test_dflash_target_layers_must_be_an_int_array():
    bad = {"dflash.target_layers": KV("dflash.target_layers", T.UINT32, 3)}
    problems = fmt.check_kv_types("dflash", bad)
    assert any(p.startswith("dflash.target_layers: expected an array of INT32/UINT32") for p in problems)
    assert "missing required key dflash.attention.layer_norm_rms_epsilon" in problems


def _layout_kvs(head_kv, dense=1, attn_res=2, latent=128):
    a = "kimi-k3"
    return _kvs([KV(f"{a}.block_count", T.UINT32, len(head_kv)),
                 KV(f"{a}.attention.head_count_kv", T.ARRAY, np.array(head_kv, np.int32), T.INT32),
                 KV(f"{a}.leading_dense_block_count", T.UINT32, dense),
                 KV(f"{a}.attn_res.block_size", T.UINT32, attn_res),
                 KV(f"{a}.expert_latent_length", T.UINT32, latent)])


def test_kimi_k3_expected_tensors_follow_layer_types():
    required, optional = fmt.kimi_k3_expected_tensors(3, [2], n_dense_lead=1, attn_res=True, latent=True)
    assert {"token_embd.weight", "output.weight", "output_norm.weight", "output_res_score.weight"} <= required
    assert "blk.0.ssm_a" in required and "blk.0.ssm_dt.bias" in required     # KDA, no .weight on ssm_a
    assert "blk.0.ffn_gate.weight" in required and "blk.0.ffn_gate_inp.weight" not in required | optional
    assert "blk.1.exp_probs_b.bias" in required and "blk.1.ffn_routed_up.weight" in required
    assert "blk.2.attn_kv_a_mqa.weight" in required and "blk.2.ssm_g.weight" not in required
    assert {"blk.2.attn_k_b.weight", "blk.2.attn_kv_b.weight", "blk.2.attn_q_a.weight",
            "blk.2.attn_gate.weight", "blk.1.ffn_up_shexp.weight"} <= optional
    assert not required & optional
    required, _ = fmt.kimi_k3_expected_tensors(3, [2], n_dense_lead=0, attn_res=False, latent=False)
    assert "output_res_score.weight" not in required and "blk.0.ffn_routed_down.weight" not in required
    assert "blk.0.ffn_gate_exps.weight" in required


def test_kimi_k3_check_names_reports_problems():
    kv = _layout_kvs([0, 1], dense=1)
    required, _ = fmt.kimi_k3_expected_tensors(2, [1], n_dense_lead=1, attn_res=True, latent=True)
    good = set(required) | {"blk.1.attn_q_a_norm.weight", "blk.1.attn_q_a.weight", "blk.1.attn_q_b.weight",
                            "blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"}
    assert fmt.kimi_k3_check_names(good, kv) == []
    bad = good - {"blk.0.ssm_a", "blk.1.attn_v_b.weight", "blk.1.attn_q_b.weight"}
    bad |= {"blk.0.ffn_up_exps.weight"}
    problems = fmt.kimi_k3_check_names(bad, kv)
    assert "missing tensor blk.0.ssm_a" in problems
    assert "tensor blk.0.ffn_up_exps.weight is not one kimi-k3 loads" in problems
    assert "layer 1: q-LoRA path needs attn_q_a and attn_q_b" in problems
    assert "layer 1: MLA layer needs attn_kv_b or attn_k_b + attn_v_b" in problems


def test_dflash_expected_tensors():
    required, optional = fmt.dflash_expected_tensors(2)
    assert {"fc.weight", "enc.output_norm.weight", "output_norm.weight",
            "blk.1.attn_q_norm.weight"} <= required
    assert {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight", "conf_proj.bias", "d2t",
            "token_embd.weight", "blk.0.attn_v.weight", "rope_freqs.weight"} <= optional
    assert "blk.2.attn_q.weight" not in required | optional


@pytest.mark.parametrize("name,n_dims,role", [
    ("blk.3.ffn_up_exps.weight", 3, "routed_experts"),
    ("blk.3.ffn_gate_up_exps.weight", 3, "routed_experts"),
    ("blk.3.ffn_down_shexp.weight", 2, "shared_experts"),
    ("blk.3.ffn_gate_inp.weight", 2, "router"),
    ("blk.3.ffn_gate_inp_shexp.weight", 2, "router"),
    ("blk.3.exp_probs_b.bias", 1, "router"),
    ("token_embd.weight", 2, "embeddings_output"),
    ("output.weight", 2, "embeddings_output"),
    ("output_norm.weight", 1, "norms_biases"),
    ("output_res_score.weight", 1, "norms_biases"),
    ("blk.0.attn_res_score.weight", 1, "norms_biases"),
    ("blk.0.ssm_a", 1, "norms_biases"),
    ("blk.0.ssm_dt.bias", 1, "norms_biases"),
    ("blk.0.attn_kv_a_norm.weight", 1, "norms_biases"),
    ("blk.0.ssm_conv1d_q.weight", 4, "attention"),
    ("blk.0.ssm_f_b.weight", 2, "attention"),
    ("blk.0.attn_q.weight", 2, "attention"),
    ("blk.3.attn_k_b.weight", 3, "attention"),
    ("blk.3.attn_gate.weight", 2, "attention"),
    ("blk.0.ffn_gate.weight", 2, "dense_ffn"),
    ("blk.3.ffn_routed_down.weight", 2, "dense_ffn"),
    ("blk.3.ffn_routed_norm.weight", 1, "norms_biases"),
    ("fc.weight", 2, "other"),
    ("markov_w1.weight", 2, "other"),
    ("d2t", 1, "norms_biases"),
])
def test_role_of(name, n_dims, role):
    assert fmt.role_of(name, n_dims) == role
    assert role in fmt.ROLES


def test_is_routed_expert_and_layer_of():
    assert fmt.is_routed_expert("blk.12.ffn_down_exps.weight")
    assert not fmt.is_routed_expert("blk.12.ffn_down_shexp.weight")
    assert not fmt.is_routed_expert("blk.12.ffn_down.weight")
    assert fmt.layer_of("blk.12.ffn_down.weight") == 12
    assert fmt.layer_of("output.weight") is None


class _T:
    def __init__(self, name, shape):
        self.name, self.shape = name, shape


def test_trunk_matrices():
    tensors = [_T("token_embd.weight", (256, 1024)), _T("blk.0.attn_norm.weight", (256,)),
               _T("blk.0.ssm_conv1d_q.weight", (4, 1, 256, 1)), _T("blk.0.attn_q.weight", (256, 256)),
               _T("blk.1.attn_k_b.weight", (32, 64, 4)), _T("blk.1.ffn_gate_inp.weight", (256, 8)),
               _T("blk.1.ffn_up_exps.weight", (128, 96, 8)), _T("blk.1.ffn_up_shexp.weight", (256, 96)),
               _T("blk.1.ffn_routed_up.weight", (128, 256)), _T("output.weight", (256, 1024))]
    assert fmt.trunk_matrices(tensors) == [
        "token_embd.weight", "blk.0.attn_q.weight", "blk.1.attn_k_b.weight",
        "blk.1.ffn_up_shexp.weight", "blk.1.ffn_routed_up.weight", "output.weight"]


@pytest.mark.parametrize("name,n_dims,f32", [
    ("blk.0.ssm_a", 1, True), ("blk.0.ssm_dt.bias", 1, True), ("blk.1.exp_probs_b.bias", 1, True),
    ("blk.1.ffn_gate_inp.weight", 2, True), ("blk.0.ssm_conv1d_k.weight", 4, True),
    ("blk.0.ssm_conv1d_k.weight", 3, True), ("blk.3.attn_kv_a_norm.weight", 1, True), ("d2t", 1, True),
    ("blk.0.attn_q.weight", 2, False), ("blk.1.ffn_up_exps.weight", 3, False),
    ("token_embd.weight", 2, False), ("blk.3.attn_k_b.weight", 3, False), ("conf_proj.bias", 1, True),
])
def test_converter_keeps_f32(name, n_dims, f32):
    assert fmt.converter_keeps_f32(name, n_dims) is f32
