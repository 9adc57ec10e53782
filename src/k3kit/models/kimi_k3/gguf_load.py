"""A kimi-k3 GGUF -> K3Model trunk (no routed experts) + the expert tensor names per layer.

Works on anything with the `k3kit.runtime.loader.GGUFSource` shape (`kv`, `tensors`,
`tensor(name, dtype, device)`, `where`): this module opens no file itself. The model is built
on the meta device and every parameter is replaced by the dequantized GGUF tensor, so a
K3-sized trunk is allocated once, in the compute dtype, never as a float32 init first.

The name mapping and the inverse transforms are gguf_map's (llama.cpp's converter, inverted):
ssm_conv1d_* -> [C, K]; ssm_a = -exp(A_log) -> A_log; attn_k_b + attn_v_b -> kv_b_proj.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from gguf import GGMLQuantizationType
from torch import nn

from k3kit.errors import FormatError

from .config import K3ModelConfig
from .gguf_map import _param_map, config_from_gguf_kv, infer_optional_parts
from .mla import MLA
from .model import K3Model
from .moe import LatentMoE
from .mxfp4 import input_kind

EXPERT_PROJECTIONS = ("gate", "up", "down")   # the order ExpertWeights wants


class Source(Protocol):
    kv: dict[str, Any]
    tensors: dict[str, Any]
    where: str

    def tensor(self, name: str, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor: ...


def config_from_source(src: Source) -> K3ModelConfig:
    """K3ModelConfig from the KVs (what the converter writes, read back) and tensor presence."""
    emb = src.tensors.get("token_embd.weight")
    if emb is None or len(emb.shape) != 2:
        raise FormatError(f"{src.where}: missing or malformed tensor 'token_embd.weight'")
    cfg = config_from_gguf_kv(src.kv, int(emb.shape[1]), src.where)
    cfg = infer_optional_parts(cfg, set(src.tensors))
    exps = [t for n, t in src.tensors.items() if n.endswith(".ffn_gate_exps.weight")]
    cfg.experts_mxfp4 = bool(exps) and all(GGMLQuantizationType(t.ggml_type) == GGMLQuantizationType.MXFP4
                                           for t in exps)
    for role in ("bos", "eos"):
        v = src.kv.get(f"tokenizer.ggml.{role}_token_id")
        if isinstance(v, int):
            setattr(cfg, f"{role}_token_id", v)
    out = src.tensors.get("output.weight")
    if out is None or tuple(out.shape) != (cfg.hidden_size, cfg.vocab_size):
        raise FormatError(f"{src.where}: tensor 'output.weight' missing or not "
                          f"[{cfg.hidden_size}, {cfg.vocab_size}]")
    return cfg.validate(src.where)


def expert_tensor_names(cfg: K3ModelConfig) -> dict[int, list[str]]:
    """Per MoE layer, the 3-D routed expert tensors in EXPERT_PROJECTIONS order."""
    return {il: [f"blk.{il}.ffn_{p}_exps.weight" for p in EXPERT_PROJECTIONS]
            for il in range(cfg.num_layers) if not cfg.is_dense(il)}


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    old = getattr(mod, leaf)
    if tuple(old.shape) != tuple(value.shape):
        raise ValueError(f"{name}: shape {tuple(value.shape)}, expected {tuple(old.shape)}")
    setattr(mod, leaf, nn.Parameter(value, requires_grad=False))


def param_device(name: str, n_layers: int, layer_dev: Sequence[torch.device]) -> torch.device:
    """Where a parameter lives in a layer split: its layer's device; embed on the first, head on the last."""
    if name.startswith("layers."):
        return layer_dev[int(name.split(".")[1])]
    if name.startswith("embed"):
        return layer_dev[0]
    return layer_dev[-1] if name.startswith(("lm_head", "norm")) else layer_dev[0]


@torch.no_grad()
def build_trunk(src: Source, cfg: K3ModelConfig, dtype: torch.dtype,
                layer_dev: Sequence[torch.device]) -> K3Model:
    """K3Model without routed experts, every trunk parameter read from the GGUF."""
    with torch.device("meta"):
        model = K3Model(cfg, with_experts=False)
    nl = cfg.num_layers
    mapped = _param_map(model)
    names = set(src.tensors)

    def load(gname: str, shape: tuple[int, ...], pname: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        if gname not in names:
            raise FormatError(f"{src.where}: missing tensor {gname!r}")
        t = src.tensor(gname, as_dtype, param_device(pname, nl, layer_dev))
        if t.numel() != int(torch.Size(shape).numel()):
            raise FormatError(f"{src.where}: tensor {gname!r} has {t.numel()} values, "
                              f"expected shape {list(shape)}")
        return t.reshape(shape)

    params = dict(model.named_parameters())
    for gname, pname in mapped:
        _set_param(model, pname, load(gname, tuple(params[pname].shape), pname))
    for il in range(nl):
        b, o = f"blk.{il}.", f"layers.{il}.attn."
        if cfg.is_kda(il):
            for x in "qkv":
                p = o + f"{x}_conv"
                _set_param(model, p, load(b + f"ssm_conv1d_{x}.weight", tuple(params[p].shape), p))
            ssm_a = load(b + "ssm_a", (cfg.num_heads,), o + "A_log", torch.float32).double()
            if not bool((ssm_a < 0).all()):
                raise FormatError(f"{src.where}: {b}ssm_a must be negative (it holds -exp(A_log))")
            _set_param(model, o + "A_log", torch.log(-ssm_a).to(dtype))
        else:
            H, nope, v, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
            p = o + "kv_b_proj.weight"
            if b + "attn_kv_b.weight" in names:
                kv_b = load(b + "attn_kv_b.weight", (H * (nope + v), L), p)
            else:
                k_b = load(b + "attn_k_b.weight", (H, L, nope), p).transpose(1, 2)   # [H, nope, L]
                v_b = load(b + "attn_v_b.weight", (H, v, L), p)
                kv_b = torch.cat((k_b, v_b), dim=1).reshape(H * (nope + v), L)
            _set_param(model, p, kv_b.contiguous())
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise FormatError(f"{src.where}: no GGUF tensor for {left[0]} ({len(left)} parameters unset)")
    return model.eval()


def ggml_input_kinds(src: Source, model: K3Model) -> dict[str, str | None]:
    """Per weight, how ggml-cpu rounds that matmul's input, from the file's tensor types.

    The keys `K3Model.set_ggml_q8_inputs` reads: Linear / router parameter names, and per
    layer "attn.k_b" / "attn.v_b" (or "attn.kv_b") and "ffn.experts". The model opens no
    file, so the loader, which knows the types, hands them over.
    """
    def kind(gname: str) -> str | None:
        return input_kind(GGMLQuantizationType(src.tensors[gname].ggml_type).name)

    kinds = {pname: kind(gname) for gname, pname in _param_map(model) if gname in src.tensors}
    for il, layer in enumerate(model.layers):
        b, o = f"blk.{il}.", f"layers.{il}."
        if isinstance(layer.attn, MLA):
            if b + "attn_kv_b.weight" in src.tensors:
                kinds[o + "attn.kv_b"] = kind(b + "attn_kv_b.weight")
            else:
                kinds[o + "attn.k_b"] = kind(b + "attn_k_b.weight")
                kinds[o + "attn.v_b"] = kind(b + "attn_v_b.weight")
        if isinstance(layer.ffn, LatentMoE):
            exp = {kind(f"{b}ffn_{p}_exps.weight") for p in EXPERT_PROJECTIONS}
            kinds[o + "ffn.experts"] = exp.pop() if len(exp) == 1 else None
    return kinds


def moe_layers(model: K3Model) -> list[int]:
    return [il for il, layer in enumerate(model.layers) if isinstance(layer.ffn, LatentMoE)]
