"""K3 checkpoints in Hugging Face form: the tensor names and layouts (no file access here;
k3kit.adapters.kimi_k3_hf reads and writes config.json + model.safetensors).

Tensor names and layouts are the ones llama.cpp's converter (conversion/kimi_k3.py and the
base classes it calls) reads for `KimiK3ForConditionalGeneration`:
* everything under `language_model.` (the converter strips it);
* KDA convs as [d_inner, 1, d_conv], A_log as a plain [n_head] vector, `dt_bias`;
  `self_attn.g_proj` is the full-rank KDA gate on KDA layers and the output gate on MLA layers;
* MLA as DeepSeek's q_a/q_b, kv_a_proj_with_mqa and one `kv_b_proj` [H*(nope+v), kv_lora]
  (the converter splits it into attn_k_b / attn_v_b);
* residual scores as `<x>_res_norm.weight` [H] and `<x>_res_proj.weight` [1, H], which the
  converter multiplies into one vector; we store the fused vector as proj and ones as norm;
* routed experts `block_sparse_moe.experts.<e>.w1|w2|w3` (gate, down, up) as compressed-tensors
  MXFP4: `weight_packed` uint8 [rows, cols/2] and `weight_scale` uint8 E8M0 [rows, cols/32].
  The forward pass already rounds experts to MXFP4, so this storage is lossless.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from .kda import KDA
from .model import K3Model
from .moe import LatentMoE
from .mxfp4 import mxfp4_quantize, pack_codes

PREFIX = "language_model."
EXPERT_PROJ = (("w1", "gate_exps"), ("w2", "down_exps"), ("w3", "up_exps"))

# (our module path relative to a layer, HF name relative to `model.layers.<i>.`)
_KDA_NAMES = [
    ("attn.q_proj.weight", "self_attn.q_proj.weight"),
    ("attn.k_proj.weight", "self_attn.k_proj.weight"),
    ("attn.v_proj.weight", "self_attn.v_proj.weight"),
    ("attn.f_a_proj.weight", "self_attn.f_a_proj.weight"),
    ("attn.f_b_proj.weight", "self_attn.f_b_proj.weight"),
    ("attn.b_proj.weight", "self_attn.b_proj.weight"),
    ("attn.A_log", "self_attn.A_log"),
    ("attn.dt_bias", "self_attn.dt_bias"),
    ("attn.g_proj.weight", "self_attn.g_proj.weight"),
    ("attn.o_norm", "self_attn.o_norm.weight"),
    ("attn.o_proj.weight", "self_attn.o_proj.weight"),
]
_KDA_CONVS = [("attn.q_conv", "self_attn.q_conv1d.weight"), ("attn.k_conv", "self_attn.k_conv1d.weight"),
              ("attn.v_conv", "self_attn.v_conv1d.weight")]
_MLA_NAMES = [
    ("attn.q_a_proj.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_a_norm", "self_attn.q_a_layernorm.weight"),
    ("attn.q_b_proj.weight", "self_attn.q_b_proj.weight"),
    ("attn.q_proj.weight", "self_attn.q_proj.weight"),
    ("attn.kv_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("attn.kv_a_norm", "self_attn.kv_a_layernorm.weight"),
    ("attn.kv_b_proj.weight", "self_attn.kv_b_proj.weight"),
    ("attn.g_proj.weight", "self_attn.g_proj.weight"),
    ("attn.o_proj.weight", "self_attn.o_proj.weight"),
]
_DENSE_NAMES = [("ffn.gate_proj.weight", "mlp.gate_proj.weight"),
                ("ffn.up_proj.weight", "mlp.up_proj.weight"),
                ("ffn.down_proj.weight", "mlp.down_proj.weight")]
_MOE_NAMES = [
    ("ffn.router.weight", "block_sparse_moe.gate.weight"),
    ("ffn.router.bias", "block_sparse_moe.gate.e_score_correction_bias"),
    ("ffn.routed_down.weight", "block_sparse_moe.routed_expert_down_proj.weight"),
    ("ffn.routed_up.weight", "block_sparse_moe.routed_expert_up_proj.weight"),
    ("ffn.routed_norm", "block_sparse_moe.routed_expert_norm.weight"),
    ("ffn.shared.gate_proj.weight", "block_sparse_moe.shared_experts.gate_proj.weight"),
    ("ffn.shared.up_proj.weight", "block_sparse_moe.shared_experts.up_proj.weight"),
    ("ffn.shared.down_proj.weight", "block_sparse_moe.shared_experts.down_proj.weight"),
]
_RES = [("attn_res_score", "self_attention_res"), ("ffn_res_score", "mlp_res")]


def plain_names(model: K3Model) -> Iterator[tuple[str, str, Callable[[Tensor], Tensor]]]:
    """(our parameter name, HF name, our->HF layout transform) for every non-expert tensor."""
    ident: Callable[[Tensor], Tensor] = lambda t: t   # noqa: E731
    params = dict(model.named_parameters())
    yield "embed.weight", "model.embed_tokens.weight", ident
    yield "norm", "model.norm.weight", ident
    yield "lm_head.weight", "lm_head.weight", ident
    for il, layer in enumerate(model.layers):
        ours, hf = f"layers.{il}.", f"model.layers.{il}."
        yield ours + "attn_norm", hf + "input_layernorm.weight", ident
        yield ours + "ffn_norm", hf + "post_attention_layernorm.weight", ident
        table = []
        if isinstance(layer.attn, KDA):
            table += _KDA_NAMES
            for a, b in _KDA_CONVS:
                yield ours + a, hf + b, lambda t: t.unsqueeze(1)
        else:
            table += _MLA_NAMES
        table += _MOE_NAMES if isinstance(layer.ffn, LatentMoE) else _DENSE_NAMES
        for a, b in table:
            if ours + a in params:
                yield ours + a, hf + b, ident


def res_names(model: K3Model) -> Iterator[tuple[str, str]]:
    """(our fused score name, HF stem without _norm/_proj)."""
    if model.cfg.attn_res_block_size <= 0:
        return
    for il in range(model.cfg.num_layers):
        for ours, hf in _RES:
            yield f"layers.{il}.{ours}", f"model.layers.{il}.{hf}"
    yield "output_res_score", "model.output_attn_res"


def hf_tensors(model: K3Model, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """The checkpoint's tensors by HF name (trunk in `dtype`; experts MXFP4 or float)."""
    cfg = model.cfg
    params = dict(model.named_parameters())
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for ours, hf, fn in plain_names(model):
            out[PREFIX + hf] = fn(params[ours].detach()).to(dtype).contiguous()
        for ours, stem in res_names(model):
            score = params[ours].detach().float()
            out[PREFIX + stem + "_norm.weight"] = torch.ones_like(score).to(dtype)
            out[PREFIX + stem + "_proj.weight"] = score[None].to(dtype).contiguous()
        for il, layer in enumerate(model.layers):
            if not isinstance(layer.ffn, LatentMoE):
                continue
            for wid, attr in EXPERT_PROJ:
                w = getattr(layer.ffn, attr).detach()
                for e in range(cfg.num_experts):
                    base = f"{PREFIX}model.layers.{il}.block_sparse_moe.experts.{e}.{wid}."
                    if cfg.experts_mxfp4:
                        codes, scales = mxfp4_quantize(w[e])
                        out[base + "weight_packed"] = pack_codes(codes).contiguous()
                        out[base + "weight_scale"] = scales.contiguous()
                    else:
                        out[base + "weight"] = w[e].to(dtype).contiguous()
    return out
