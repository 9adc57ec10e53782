"""What a kimi-k3 GGUF's keys and tensors mean for K3Model: the inverse of llama.cpp's
converter (conversion/kimi_k3.py), for loaders that already hold the values.

Nothing here opens a file: callers pass the KV values (plain Python / numpy) and a function
returning one tensor as float32 in numpy row-major order (ggml shape reversed), e.g. a
dequantized view from `k3kit.gguf`. Inverse transforms:
* ssm_conv1d_{q,k,v} [1, C, 1, K] or [C, 1, K] -> [C, K];
* ssm_a = -exp(A_log) -> A_log = log(-ssm_a) (computed in float64; exp of it gives ssm_a back
  to within an ulp);
* attn_k_b [H, L, nope] and attn_v_b [H, v, L] -> kv_b_proj [H*(nope+v), L] (or attn_kv_b as is);
* routed experts [E, rows, cols] per projection (skipped when the model has no expert params).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from k3kit.errors import ConvertError
from k3kit.gguf import format as fmt
from k3kit.gguf.format import ATT, LLM, ROPE, blk, tensor_name

from .config import KDA, MLA, K3ModelConfig
from .model import K3Model
from .moe import LatentMoE

ARCH = fmt.ARCH_KIMI_K3


def config_from_gguf_kv(kv: Mapping[str, Any], vocab_size: int, where: str = "gguf") -> K3ModelConfig:
    """K3ModelConfig from kimi-k3 GGUF KV values (key -> value). `vocab_size` comes from
    token_embd's shape when the file has no `kimi-k3.vocab_size`."""
    a = ARCH

    def get(template: str, default: Any = KeyError) -> Any:
        full = template.format(arch=a)
        if full in kv:
            v = kv[full]
            return v.tolist() if isinstance(v, np.ndarray) else v
        if default is KeyError:
            raise ConvertError(f"{where}: missing key {full!r}")
        return default

    arch = kv.get(fmt.Keys.General.ARCHITECTURE)
    if arch != a:
        raise ConvertError(f"{where}: general.architecture is {arch!r}, expected {a!r}")
    n_layer = int(get(LLM.BLOCK_COUNT))
    hkv = get(ATT.HEAD_COUNT_KV)
    hkv = list(hkv) if isinstance(hkv, (list, tuple)) else [hkv] * n_layer
    if len(hkv) != n_layer:
        raise ConvertError(f"{where}: head_count_kv has {len(hkv)} entries for {n_layer} layers")
    head_count = get(ATT.HEAD_COUNT)
    if isinstance(head_count, (list, tuple)):
        head_count = head_count[0]          # llama.cpp uses layer 0's
    ff_exp = get(LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(ff_exp, (list, tuple)):
        if len(set(ff_exp)) != 1:
            raise ConvertError(f"{where}: per-layer expert_feed_forward_length is not supported")
        ff_exp = ff_exp[0]
    if int(get(LLM.EXPERT_GATING_FUNC)) != fmt.EXPERT_GATING_SIGMOID:
        raise ConvertError(f"{where}: expert_gating_func must be 2 (sigmoid)")
    k_mla, rope = int(get(ATT.KEY_LENGTH_MLA)), int(get(ROPE.DIMENSION_COUNT))
    lb = get(fmt.KEY_KDA_GATE_LOWER_BOUND, None)
    q_lora = get(ATT.Q_LORA_RANK, 0)
    try:
        cfg = K3ModelConfig(
            vocab_size=int(get(LLM.VOCAB_SIZE, vocab_size)),
            hidden_size=int(get(LLM.EMBEDDING_LENGTH)),
            layer_kinds=[KDA if int(h) == 0 else MLA for h in hkv],
            num_heads=int(head_count),
            max_position_embeddings=int(get(LLM.CONTEXT_LENGTH)),
            rms_norm_eps=float(get(ATT.LAYERNORM_RMS_EPS)),
            kda_head_dim=int(get(fmt.KEY_KDA_HEAD_DIM)),
            conv_kernel=int(get(fmt.Keys.SSM.CONV_KERNEL)),
            gate_lower_bound=None if lb is None else float(lb),
            q_lora_rank=int(q_lora) or None,
            kv_lora_rank=int(get(ATT.KV_LORA_RANK)),
            qk_nope_head_dim=k_mla - rope,
            qk_rope_head_dim=rope,
            v_head_dim=int(get(ATT.VALUE_LENGTH_MLA)),
            intermediate_size=int(get(LLM.FEED_FORWARD_LENGTH)),
            first_k_dense=int(get(LLM.LEADING_DENSE_BLOCK_COUNT, 0)),
            num_experts=int(get(LLM.EXPERT_COUNT)),
            num_experts_per_tok=int(get(LLM.EXPERT_USED_COUNT)),
            moe_intermediate_size=int(ff_exp),
            expert_latent_size=int(get(fmt.KEY_EXPERT_LATENT_LENGTH, 0)),
            num_shared_experts=int(get(LLM.EXPERT_SHARED_COUNT)),
            routed_scaling_factor=float(get(LLM.EXPERT_WEIGHTS_SCALE, 0.0)),
            moe_renormalize=bool(get(LLM.EXPERT_WEIGHTS_NORM, False)),
            attn_res_block_size=int(get(fmt.KEY_ATTN_RES_BLOCK_SIZE)),
            situ_beta=float(get(fmt.KEY_SITU_BETA)),
            situ_linear_beta=float(get(fmt.KEY_SITU_LINEAR_BETA)),
        )
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{where}: bad value ({e})") from None
    return cfg.validate(where)


def infer_optional_parts(cfg: K3ModelConfig, names: set[str]) -> K3ModelConfig:
    """Set the flags llama.cpp infers from tensor presence (output gate, routed norm, MXFP4)."""
    mla = next(i for i in range(cfg.num_layers) if not cfg.is_kda(i))
    cfg.mla_output_gate = blk(mla, fmt.ATTN_GATE) in names
    routed_norm = "." + tensor_name(fmt.FFN_ROUTED_NORM)
    cfg.routed_expert_norm = any(n.endswith(routed_norm) for n in names)
    return cfg


Getter = Callable[[str], np.ndarray]

# (GGUF base, our parameter under layers.N.attn.) of the KDA weights that map one to one
_KDA_PARAMS = ((fmt.ATTN_Q, "q_proj.weight"), (fmt.ATTN_K, "k_proj.weight"), (fmt.ATTN_V, "v_proj.weight"),
               (fmt.SSM_F_A, "f_a_proj.weight"), (fmt.SSM_F_B, "f_b_proj.weight"),
               (fmt.SSM_BETA, "b_proj.weight"), (fmt.SSM_G, "g_proj.weight"),
               (fmt.SSM_NORM, "o_norm"), (fmt.ATTN_OUTPUT, "o_proj.weight"))
# our KDA conv kernel (layers.N.attn.{x}_conv) -> GGUF base
KDA_CONVS = {"q": fmt.SSM_CONV1D_Q, "k": fmt.SSM_CONV1D_K, "v": fmt.SSM_CONV1D_V}
# our expert / shared-expert / dense projection name -> GGUF base, in the order the map lists them
_EXPERTS = {"gate": fmt.FFN_GATE_EXPS, "up": fmt.FFN_UP_EXPS, "down": fmt.FFN_DOWN_EXPS}
_SHARED = {"gate": fmt.FFN_GATE_SHEXP, "up": fmt.FFN_UP_SHEXP, "down": fmt.FFN_DOWN_SHEXP}
_DENSE = {"gate": fmt.FFN_GATE, "up": fmt.FFN_UP, "down": fmt.FFN_DOWN}


def expert_tensor_name(il: int, proj: str) -> str:
    """The stacked routed-expert tensor of layer `il` for projection "gate", "up" or "down"."""
    return blk(il, _EXPERTS[proj])


def _param_map(model: K3Model) -> list[tuple[str, str]]:
    """(gguf name, our parameter name) for the tensors that map one to one."""
    cfg = model.cfg
    out = [(tensor_name(fmt.TOKEN_EMBD), "embed.weight"), (tensor_name(fmt.OUTPUT_NORM), "norm"),
           (tensor_name(fmt.OUTPUT), "lm_head.weight")]
    if cfg.attn_res_block_size > 0:
        out.append((tensor_name(fmt.OUTPUT_RES_SCORE), "output_res_score"))
    for il, layer in enumerate(model.layers):
        o = f"layers.{il}."
        out += [(blk(il, fmt.ATTN_NORM), o + "attn_norm"), (blk(il, fmt.FFN_NORM), o + "ffn_norm")]
        if cfg.attn_res_block_size > 0:
            out += [(blk(il, fmt.ATTN_RES_SCORE), o + "attn_res_score"),
                    (blk(il, fmt.FFN_RES_SCORE), o + "ffn_res_score")]
        if cfg.is_kda(il):
            for g, ours in _KDA_PARAMS:
                out.append((blk(il, g), o + "attn." + ours))
            out.append((blk(il, fmt.SSM_DT, fmt.BIAS), o + "attn.dt_bias"))
        else:
            pairs = [(fmt.ATTN_KV_A_MQA, "kv_a_proj.weight"), (fmt.ATTN_KV_A_NORM, "kv_a_norm"),
                     (fmt.ATTN_OUTPUT, "o_proj.weight")]
            if cfg.q_lora_rank is not None:
                pairs += [(fmt.ATTN_Q_A, "q_a_proj.weight"), (fmt.ATTN_Q_A_NORM, "q_a_norm"),
                          (fmt.ATTN_Q_B, "q_b_proj.weight")]
            else:
                pairs.append((fmt.ATTN_Q, "q_proj.weight"))
            if cfg.mla_output_gate:
                pairs.append((fmt.ATTN_GATE, "g_proj.weight"))
            out += [(blk(il, g), o + "attn." + ours) for g, ours in pairs]
        if isinstance(layer.ffn, LatentMoE):
            out += [(blk(il, fmt.FFN_GATE_INP), o + "ffn.router.weight"),
                    (blk(il, fmt.EXP_PROBS_B, fmt.BIAS), o + "ffn.router.bias")]
            if cfg.expert_latent_size > 0:
                out += [(blk(il, fmt.FFN_ROUTED_DOWN), o + "ffn.routed_down.weight"),
                        (blk(il, fmt.FFN_ROUTED_UP), o + "ffn.routed_up.weight")]
                if cfg.routed_expert_norm:
                    out.append((blk(il, fmt.FFN_ROUTED_NORM), o + "ffn.routed_norm"))
            if cfg.num_shared_experts > 0:
                out += [(blk(il, g), o + f"ffn.shared.{p}_proj.weight") for p, g in _SHARED.items()]
            if layer.ffn.has_experts:
                out += [(blk(il, g), o + f"ffn.{p}_exps") for p, g in _EXPERTS.items()]
        else:
            out += [(blk(il, g), o + f"ffn.{p}_proj.weight") for p, g in _DENSE.items()]
    return out


@torch.no_grad()
def load_gguf_tensors(model: K3Model, get: Getter, names: set[str], where: str = "gguf") -> None:
    """Fill `model` from GGUF tensors; `get(name)` returns float32 numpy in row-major order."""
    cfg = model.cfg
    params = dict(model.named_parameters())

    def fetch(name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in names:
            raise ConvertError(f"{where}: missing tensor {name!r}")
        a = np.asarray(get(name), dtype=np.float32)
        if shape is not None and a.size != int(np.prod(shape)):
            raise ConvertError(f"{where}: tensor {name!r} has {a.size} values, expected shape {list(shape)}")
        t = torch.from_numpy(np.array(a, dtype=np.float32, copy=True))
        return t.reshape(shape) if shape is not None else t

    for gname, ours in _param_map(model):
        p = params[ours]
        p.copy_(fetch(gname, tuple(p.shape)).to(p.dtype))
    for il in range(cfg.num_layers):
        o = f"layers.{il}.attn."
        if cfg.is_kda(il):
            for qkv, conv in KDA_CONVS.items():
                p = params[o + f"{qkv}_conv"]
                p.copy_(fetch(blk(il, conv), tuple(p.shape)).to(p.dtype))
            a_name = blk(il, fmt.SSM_A, None)
            ssm_a = fetch(a_name, (cfg.num_heads,)).double()
            if not (ssm_a < 0).all():
                raise ConvertError(f"{where}: {a_name} must be negative (it holds -exp(A_log))")
            params[o + "A_log"].copy_(torch.log(-ssm_a).to(params[o + "A_log"].dtype))
        else:
            H, nope, v, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
            p = params[o + "kv_b_proj.weight"]
            if blk(il, fmt.ATTN_KV_B) in names:
                p.copy_(fetch(blk(il, fmt.ATTN_KV_B), tuple(p.shape)).to(p.dtype))
            else:
                k_b = fetch(blk(il, fmt.ATTN_K_B), (H, L, nope)).transpose(1, 2)     # [H, nope, L]
                v_b = fetch(blk(il, fmt.ATTN_V_B), (H, v, L))
                p.copy_(torch.cat((k_b, v_b), dim=1).reshape(H * (nope + v), L).to(p.dtype))
