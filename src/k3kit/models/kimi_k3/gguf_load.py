"""A kimi-k3 GGUF -> K3Model trunk (no routed experts) + the expert tensor names per layer.

Works on anything with the `k3kit.runtime.loader.GGUFSource` shape (`kv`, `tensors`,
`tensor(name, dtype, device)`, `where`): this module opens no file itself. The model is built
on the meta device and every parameter is replaced by the dequantized GGUF tensor, so a
K3-sized trunk is allocated once, in the compute dtype, never as a float32 init first.

Quantized trunk (`build_trunk(..., raw=source.raw)`): every Linear that is one 2-D GGUF tensor
(attention and KDA projections, dense FFN, shared experts, latent projections, lm_head)
becomes a QuantizedLinear and token_embd a QuantizedEmbedding (rows dequantized per lookup),
both over the tensor's bytes. What stays float, dequantized to the compute dtype: norms,
attn-res scores, KDA convs / A_log / dt_bias, the router and its bias. MLA's split kv_b
(attn_k_b + attn_v_b, 3-D per-head stacks) becomes a LatentHeads over their bytes (the
attention multiplies each head's matrix where it lies); a fused attn_kv_b stays a float
kv_b_proj. Any other matrix whose tensor is not a plain 2-D [n_in, n_out] stays float too.

The name mapping and the inverse transforms are gguf_map's (llama.cpp's converter, inverted):
ssm_conv1d_* -> [C, K]; ssm_a = -exp(A_log) -> A_log; attn_k_b + attn_v_b -> kv_b_proj.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from gguf import GGMLQuantizationType
from torch import nn

from k3kit.errors import FormatError
from k3kit.gguf import format as fmt
from k3kit.gguf.format import blk, tensor_name
from k3kit.layers.quantized_linear import GGMLWeight, use_quantized_weights

from .config import K3ModelConfig
from .gguf_map import KDA_CONVS, _param_map, config_from_gguf_kv, expert_tensor_name, infer_optional_parts
from .mla import MLA, LatentHeads
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
    embd = tensor_name(fmt.TOKEN_EMBD)
    emb = src.tensors.get(embd)
    if emb is None or len(emb.shape) != 2:
        raise FormatError(f"{src.where}: missing or malformed tensor '{embd}'")
    cfg = config_from_gguf_kv(src.kv, int(emb.shape[1]), src.where)
    cfg = infer_optional_parts(cfg, set(src.tensors))
    gate_exps = "." + tensor_name(fmt.FFN_GATE_EXPS)
    exps = [t for n, t in src.tensors.items() if n.endswith(gate_exps)]
    cfg.experts_mxfp4 = bool(exps) and all(GGMLQuantizationType(t.ggml_type) == GGMLQuantizationType.MXFP4
                                           for t in exps)
    tok = fmt.Keys.Tokenizer
    for attr, key in (("bos_token_id", tok.BOS_ID), ("eos_token_id", tok.EOS_ID)):
        v = src.kv.get(key)
        if isinstance(v, int):
            setattr(cfg, attr, v)
    head = tensor_name(fmt.OUTPUT)
    out = src.tensors.get(head)
    if out is None or tuple(out.shape) != (cfg.hidden_size, cfg.vocab_size):
        raise FormatError(f"{src.where}: tensor '{head}' missing or not "
                          f"[{cfg.hidden_size}, {cfg.vocab_size}]")
    return cfg.validate(src.where)


def expert_tensor_names(cfg: K3ModelConfig) -> dict[int, list[str]]:
    """Per MoE layer, the 3-D routed expert tensors in EXPERT_PROJECTIONS order."""
    return {il: [expert_tensor_name(il, p) for p in EXPERT_PROJECTIONS]
            for il in range(cfg.num_layers) if not cfg.is_dense(il)}


def p_kv_b(layer_prefix: str) -> str:
    return layer_prefix + "kv_b_proj.weight"


def _quantize_kv_b(src: Source, model: K3Model, dtype: torch.dtype, raw: Callable[[str], torch.Tensor],
                   arith: str = "") -> None:
    """Give every MLA layer whose file splits kv_b into attn_k_b + attn_v_b a LatentHeads over
    those tensors' bytes in place of the float kv_b_proj (a fused attn_kv_b stays float)."""
    cfg = model.cfg
    H, nope, v, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    for il, layer in enumerate(model.layers):
        mla = layer.attn
        k_name, v_name = blk(il, fmt.ATTN_K_B), blk(il, fmt.ATTN_V_B)
        if not isinstance(mla, MLA) or k_name not in src.tensors or v_name not in src.tensors:
            continue
        w = []
        for gname, want in ((k_name, (nope, L, H)), (v_name, (L, v, H))):
            info = src.tensors[gname]
            shape = tuple(int(d) for d in info.shape)
            if shape != want:
                raise FormatError(f"{src.where}: tensor {gname!r} has shape {list(shape)}, "
                                  f"expected {list(want)}")
            w.append(GGMLWeight(raw(gname), GGMLQuantizationType(info.ggml_type), shape))
        try:
            heads = LatentHeads(w[0], w[1], dtype, arith)
        except ValueError as e:
            raise FormatError(f"{src.where}: layer {il} attn_k_b / attn_v_b: {e}") from None
        mla.kv_b_proj = None
        mla.kv_b_heads = heads


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


def _quantize_trunk(src: Source, model: K3Model, mapped: list[tuple[str, str]], dtype: torch.dtype,
                    raw: Callable[[str], torch.Tensor], arith: str = "") -> list[str]:
    """Swap the Linear / Embedding modules that are one 2-D GGUF tensor for layers over its bytes."""
    modules = dict(model.named_modules())
    by_module: dict[str, str] = {}
    for gname, pname in mapped:
        mod_name, _, leaf = pname.rpartition(".")
        mod = modules.get(mod_name)
        info = src.tensors.get(gname)
        if (leaf == "weight" and isinstance(mod, (nn.Linear, nn.Embedding)) and info is not None
                and len(info.shape) == 2):
            by_module[mod_name] = gname

    def weight(mod_name: str) -> GGMLWeight | None:
        gname = by_module.get(mod_name)
        if gname is None:
            return None
        info = src.tensors[gname]
        return GGMLWeight(raw(gname), GGMLQuantizationType(info.ggml_type), tuple(int(d) for d in info.shape))

    try:
        return use_quantized_weights(model, weight, dtype, arith)
    except ValueError as e:
        raise FormatError(f"{src.where}: {e}") from None


@torch.no_grad()
def build_trunk(src: Source, cfg: K3ModelConfig, dtype: torch.dtype,
                layer_dev: Sequence[torch.device],
                raw: Callable[[str], torch.Tensor] | None = None, arith: str = "") -> K3Model:
    """K3Model without routed experts, every trunk parameter read from the GGUF.

    `raw` (a tensor name -> its bytes as a CPU uint8 tensor, e.g. GGUFSource.raw): build a
    quantized trunk (module doc), its products in `arith` (k3kit.kernels.qmatmul.ARITHS; "" = the
    default). Without it every weight is dequantized to `dtype`.
    """
    with torch.device("meta"):
        model = K3Model(cfg, with_experts=False)
    nl = cfg.num_layers
    mapped = _param_map(model)
    names = set(src.tensors)
    if raw is not None:
        _quantize_trunk(src, model, mapped, dtype, raw, arith)
        _quantize_kv_b(src, model, dtype, raw, arith)

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
        if pname in params:       # not held as bytes by a quantized layer
            _set_param(model, pname, load(gname, tuple(params[pname].shape), pname))
    for il in range(nl):
        o = f"layers.{il}.attn."
        if cfg.is_kda(il):
            for x, conv in KDA_CONVS.items():
                p = o + f"{x}_conv"
                _set_param(model, p, load(blk(il, conv), tuple(params[p].shape), p))
            a_name = blk(il, fmt.SSM_A, None)
            ssm_a = load(a_name, (cfg.num_heads,), o + "A_log", torch.float32).double()
            if not bool((ssm_a < 0).all()):
                raise FormatError(f"{src.where}: {a_name} must be negative (it holds -exp(A_log))")
            _set_param(model, o + "A_log", torch.log(-ssm_a).to(dtype))
        elif p_kv_b(o) in params:      # else held as the file's bytes (_quantize_kv_b)
            H, nope, v, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
            p = p_kv_b(o)
            if blk(il, fmt.ATTN_KV_B) in names:
                kv_b = load(blk(il, fmt.ATTN_KV_B), (H * (nope + v), L), p)
            else:
                k_b = load(blk(il, fmt.ATTN_K_B), (H, L, nope), p).transpose(1, 2)   # [H, nope, L]
                v_b = load(blk(il, fmt.ATTN_V_B), (H, v, L), p)
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
        o = f"layers.{il}."
        if isinstance(layer.attn, MLA):
            if blk(il, fmt.ATTN_KV_B) in src.tensors:
                kinds[o + "attn.kv_b"] = kind(blk(il, fmt.ATTN_KV_B))
            else:
                kinds[o + "attn.k_b"] = kind(blk(il, fmt.ATTN_K_B))
                kinds[o + "attn.v_b"] = kind(blk(il, fmt.ATTN_V_B))
        if isinstance(layer.ffn, LatentMoE):
            exp = {kind(expert_tensor_name(il, p)) for p in EXPERT_PROJECTIONS}
            kinds[o + "ffn.experts"] = exp.pop() if len(exp) == 1 else None
    return kinds


def moe_layers(model: K3Model) -> list[int]:
    return [il for il, layer in enumerate(model.layers) if isinstance(layer.ffn, LatentMoE)]
