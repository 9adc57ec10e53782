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

from .config import KDA, MLA, K3ModelConfig
from .model import K3Model
from .moe import LatentMoE

ARCH = "kimi-k3"
_SIGMOID = 2


def config_from_gguf_kv(kv: Mapping[str, Any], vocab_size: int, where: str = "gguf") -> K3ModelConfig:
    """K3ModelConfig from kimi-k3 GGUF KV values (key -> value). `vocab_size` comes from
    token_embd's shape when the file has no `kimi-k3.vocab_size`."""
    a = ARCH

    def get(key: str, default: Any = KeyError) -> Any:
        full = f"{a}.{key}"
        if full in kv:
            v = kv[full]
            return v.tolist() if isinstance(v, np.ndarray) else v
        if default is KeyError:
            raise ConvertError(f"{where}: missing key {full!r}")
        return default

    arch = kv.get("general.architecture")
    if arch != a:
        raise ConvertError(f"{where}: general.architecture is {arch!r}, expected {a!r}")
    n_layer = int(get("block_count"))
    hkv = get("attention.head_count_kv")
    hkv = list(hkv) if isinstance(hkv, (list, tuple)) else [hkv] * n_layer
    if len(hkv) != n_layer:
        raise ConvertError(f"{where}: head_count_kv has {len(hkv)} entries for {n_layer} layers")
    head_count = get("attention.head_count")
    if isinstance(head_count, (list, tuple)):
        head_count = head_count[0]          # llama.cpp uses layer 0's
    ff_exp = get("expert_feed_forward_length")
    if isinstance(ff_exp, (list, tuple)):
        if len(set(ff_exp)) != 1:
            raise ConvertError(f"{where}: per-layer expert_feed_forward_length is not supported")
        ff_exp = ff_exp[0]
    if int(get("expert_gating_func")) != _SIGMOID:
        raise ConvertError(f"{where}: expert_gating_func must be 2 (sigmoid)")
    k_mla, rope = int(get("attention.key_length_mla")), int(get("rope.dimension_count"))
    lb = get("kda.gate_lower_bound", None)
    q_lora = get("attention.q_lora_rank", 0)
    try:
        cfg = K3ModelConfig(
            vocab_size=int(get("vocab_size", vocab_size)),
            hidden_size=int(get("embedding_length")),
            layer_kinds=[KDA if int(h) == 0 else MLA for h in hkv],
            num_heads=int(head_count),
            max_position_embeddings=int(get("context_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            kda_head_dim=int(get("kda.head_dim")),
            conv_kernel=int(get("ssm.conv_kernel")),
            gate_lower_bound=None if lb is None else float(lb),
            q_lora_rank=int(q_lora) or None,
            kv_lora_rank=int(get("attention.kv_lora_rank")),
            qk_nope_head_dim=k_mla - rope,
            qk_rope_head_dim=rope,
            v_head_dim=int(get("attention.value_length_mla")),
            intermediate_size=int(get("feed_forward_length")),
            first_k_dense=int(get("leading_dense_block_count", 0)),
            num_experts=int(get("expert_count")),
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(ff_exp),
            expert_latent_size=int(get("expert_latent_length", 0)),
            num_shared_experts=int(get("expert_shared_count")),
            routed_scaling_factor=float(get("expert_weights_scale", 0.0)),
            moe_renormalize=bool(get("expert_weights_norm", False)),
            attn_res_block_size=int(get("attn_res.block_size")),
            situ_beta=float(get("activation.situ_beta")),
            situ_linear_beta=float(get("activation.situ_linear_beta")),
        )
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{where}: bad value ({e})") from None
    return cfg.validate(where)


def infer_optional_parts(cfg: K3ModelConfig, names: set[str]) -> K3ModelConfig:
    """Set the flags llama.cpp infers from tensor presence (output gate, routed norm, MXFP4)."""
    mla = next(i for i in range(cfg.num_layers) if not cfg.is_kda(i))
    cfg.mla_output_gate = f"blk.{mla}.attn_gate.weight" in names
    cfg.routed_expert_norm = any(n.endswith(".ffn_routed_norm.weight") for n in names)
    return cfg


Getter = Callable[[str], np.ndarray]


def _param_map(model: K3Model) -> list[tuple[str, str]]:
    """(gguf name, our parameter name) for the tensors that map one to one."""
    cfg = model.cfg
    out = [("token_embd.weight", "embed.weight"), ("output_norm.weight", "norm"),
           ("output.weight", "lm_head.weight")]
    if cfg.attn_res_block_size > 0:
        out.append(("output_res_score.weight", "output_res_score"))
    for il, layer in enumerate(model.layers):
        b, o = f"blk.{il}.", f"layers.{il}."
        out += [(b + "attn_norm.weight", o + "attn_norm"), (b + "ffn_norm.weight", o + "ffn_norm")]
        if cfg.attn_res_block_size > 0:
            out += [(b + "attn_res_score.weight", o + "attn_res_score"),
                    (b + "ffn_res_score.weight", o + "ffn_res_score")]
        if cfg.is_kda(il):
            for g, ours in (("attn_q", "q_proj.weight"), ("attn_k", "k_proj.weight"),
                            ("attn_v", "v_proj.weight"), ("ssm_f_a", "f_a_proj.weight"),
                            ("ssm_f_b", "f_b_proj.weight"),
                            ("ssm_beta", "b_proj.weight"), ("ssm_g", "g_proj.weight"),
                            ("ssm_norm", "o_norm"), ("attn_output", "o_proj.weight")):
                out.append((b + g + ".weight", o + "attn." + ours))
            out.append((b + "ssm_dt.bias", o + "attn.dt_bias"))
        else:
            pairs = [("attn_kv_a_mqa", "kv_a_proj.weight"), ("attn_kv_a_norm", "kv_a_norm"),
                     ("attn_output", "o_proj.weight")]
            if cfg.q_lora_rank is not None:
                pairs += [("attn_q_a", "q_a_proj.weight"), ("attn_q_a_norm", "q_a_norm"),
                          ("attn_q_b", "q_b_proj.weight")]
            else:
                pairs.append(("attn_q", "q_proj.weight"))
            if cfg.mla_output_gate:
                pairs.append(("attn_gate", "g_proj.weight"))
            out += [(b + g + ".weight", o + "attn." + ours) for g, ours in pairs]
        if isinstance(layer.ffn, LatentMoE):
            out += [(b + "ffn_gate_inp.weight", o + "ffn.router.weight"),
                    (b + "exp_probs_b.bias", o + "ffn.router.bias")]
            if cfg.expert_latent_size > 0:
                out += [(b + "ffn_routed_down.weight", o + "ffn.routed_down.weight"),
                        (b + "ffn_routed_up.weight", o + "ffn.routed_up.weight")]
                if cfg.routed_expert_norm:
                    out.append((b + "ffn_routed_norm.weight", o + "ffn.routed_norm"))
            if cfg.num_shared_experts > 0:
                out += [(b + f"ffn_{p}_shexp.weight", o + f"ffn.shared.{p}_proj.weight")
                        for p in ("gate", "up", "down")]
            if layer.ffn.has_experts:
                out += [(b + f"ffn_{p}_exps.weight", o + f"ffn.{p}_exps") for p in ("gate", "up", "down")]
        else:
            out += [(b + f"ffn_{p}.weight", o + f"ffn.{p}_proj.weight") for p in ("gate", "up", "down")]
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
        b, o = f"blk.{il}.", f"layers.{il}.attn."
        if cfg.is_kda(il):
            for qkv in "qkv":
                p = params[o + f"{qkv}_conv"]
                p.copy_(fetch(b + f"ssm_conv1d_{qkv}.weight", tuple(p.shape)).to(p.dtype))
            ssm_a = fetch(b + "ssm_a", (cfg.num_heads,)).double()
            if not (ssm_a < 0).all():
                raise ConvertError(f"{where}: {b}ssm_a must be negative (it holds -exp(A_log))")
            params[o + "A_log"].copy_(torch.log(-ssm_a).to(params[o + "A_log"].dtype))
        else:
            H, nope, v, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
            p = params[o + "kv_b_proj.weight"]
            if b + "attn_kv_b.weight" in names:
                p.copy_(fetch(b + "attn_kv_b.weight", tuple(p.shape)).to(p.dtype))
            else:
                k_b = fetch(b + "attn_k_b.weight", (H, L, nope)).transpose(1, 2)     # [H, nope, L]
                v_b = fetch(b + "attn_v_b.weight", (H, v, L))
                p.copy_(torch.cat((k_b, v_b), dim=1).reshape(H * (nope + v), L).to(p.dtype))
