"""K3 checkpoints in Hugging Face form: config.json + model.safetensors.

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

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from k3kit.errors import ConvertError, FormatError

from .config import K3ModelConfig
from .kda import KDA
from .model import K3Model
from .moe import LatentMoE
from .mxfp4 import mxfp4_dequantize, mxfp4_quantize, pack_codes, unpack_codes

PREFIX = "language_model."
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_MAX_JSON_BYTES = 64 << 20
_EXPERT_PROJ = (("w1", "gate_exps"), ("w2", "down_exps"), ("w3", "up_exps"))

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


def _plain_names(model: K3Model) -> Iterator[tuple[str, str, Callable[[Tensor], Tensor]]]:
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


def _res_names(model: K3Model) -> Iterator[tuple[str, str]]:
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
        for ours, hf, fn in _plain_names(model):
            out[PREFIX + hf] = fn(params[ours].detach()).to(dtype).contiguous()
        for ours, stem in _res_names(model):
            score = params[ours].detach().float()
            out[PREFIX + stem + "_norm.weight"] = torch.ones_like(score).to(dtype)
            out[PREFIX + stem + "_proj.weight"] = score[None].to(dtype).contiguous()
        for il, layer in enumerate(model.layers):
            if not isinstance(layer.ffn, LatentMoE):
                continue
            for wid, attr in _EXPERT_PROJ:
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


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_hf(model: K3Model, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json and model.safetensors into `out_dir` (each via temp name + fsync + rename).

    Other files in the directory (a tokenizer, say) are left alone.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model, dtype)
    config = model.cfg.to_hf_config()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    _atomic_write(out / WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    _atomic_write(out / CONFIG_NAME, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    return out


def read_hf_config(path: str | Path) -> tuple[K3ModelConfig, dict]:
    """Parse `<dir>/config.json` (bounded, validated); returns (config, raw dict)."""
    p = Path(path)
    cfg_path = p / CONFIG_NAME if p.is_dir() else p
    try:
        size = cfg_path.stat().st_size
        if size > _MAX_JSON_BYTES:
            raise FormatError(f"{cfg_path}: {size} bytes is too large for a config")
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FormatError(f"{cfg_path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{cfg_path}: not valid JSON ({e})") from None
    return K3ModelConfig.from_hf_config(raw, str(cfg_path)), raw


class _Tensors:
    """Read access to the tensors of one or several safetensors files, by name."""

    def __init__(self, model_dir: Path):
        self.where: dict[str, Path] = {}
        index = model_dir / INDEX_NAME
        if index.is_file():
            if index.stat().st_size > _MAX_JSON_BYTES:
                raise FormatError(f"{index}: too large for an index")
            try:
                wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                assert isinstance(wm, dict)
            except Exception as e:
                raise FormatError(f"{index}: not a safetensors index ({e})") from None
            for name, fname in wm.items():
                f = (model_dir / str(fname)).resolve()
                if f.parent != model_dir.resolve():
                    raise FormatError(f"{index}: {fname!r} points outside the model directory")
                self.where[name] = f
            files = sorted(set(self.where.values()))
        else:
            files = [model_dir / WEIGHTS_NAME]
        self.handles = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except FileNotFoundError:
                raise FormatError(f"{f}: no such file") from None
            except Exception as e:
                raise FormatError(f"{f}: not a safetensors file ({e})") from None
            self.handles[f] = h
            for name in h.keys():
                if name in self.where and self.where[name] != f:
                    raise FormatError(f"{f}: tensor {name!r} is also in {self.where[name]}")
                self.where[name] = f
        for name, f in self.where.items():
            if name not in self.handles[f].keys():
                raise FormatError(f"{f}: index lists {name!r} but the file does not hold it")

    def names(self) -> set[str]:
        return set(self.where)

    def get(self, name: str, shape: tuple[int, ...] | None = None,
            dtype: torch.dtype | None = None) -> Tensor:
        f = self.where[name]
        sl = self.handles[f].get_slice(name)
        got = tuple(sl.get_shape())
        if shape is not None and got != shape:
            raise ConvertError(f"{f}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
        t = self.handles[f].get_tensor(name)
        if dtype is not None and t.dtype != dtype:
            raise ConvertError(f"{f}: tensor {name!r} is {t.dtype}, expected {dtype}")
        return t


def load_hf(path: str | Path, device: torch.device | str = "cpu") -> K3Model:
    """Build a K3Model from a checkpoint directory written by `save_hf` (or K3-compatible)."""
    model_dir = Path(path)
    cfg, raw = read_hf_config(model_dir)
    store = _Tensors(model_dir)
    present = store.names()
    text = raw.get("text_config", {})
    # optional parts llama.cpp treats as TENSOR_NOT_REQUIRED: trust the tensors if config is silent
    if "mla_output_gate" not in text and "mla_output_gate" not in raw:
        first_mla = next(i for i in range(cfg.num_layers) if not cfg.is_kda(i))
        cfg.mla_output_gate = f"{PREFIX}model.layers.{first_mla}.self_attn.g_proj.weight" in present
    if "routed_expert_norm" not in text and "routed_expert_norm" not in raw and cfg.expert_latent_size > 0:
        cfg.routed_expert_norm = any(n.endswith("routed_expert_norm.weight") for n in present)

    with torch.device("meta"):
        model = K3Model(cfg)
    # a hostile config must not make us allocate: the files must plausibly hold the model
    # (MXFP4 experts unpack 4.25 -> 32 bits, so float32 params <= 8x the bytes on disk)
    n_params = sum(p.numel() for p in model.parameters())
    on_disk = sum(f.stat().st_size for f in store.handles)
    if 4 * n_params > 8 * on_disk + (1 << 20):
        raise ConvertError(f"{next(iter(store.handles))}: config declares {n_params} parameters, "
                           f"far more than the {on_disk} bytes of tensors hold")
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    used: set[str] = set()
    where = next(iter(store.handles))

    def take(name: str) -> str:
        if name not in present:
            raise ConvertError(f"{where}: missing tensor {name!r}")
        used.add(name)
        return name

    with torch.no_grad():
        for ours, hf, fn in _plain_names(model):
            p = params[ours]
            want = tuple(fn(p.detach()).shape)
            p.copy_(store.get(take(PREFIX + hf), want).reshape(p.shape).to(p.dtype))
        for ours, stem in _res_names(model):
            p = params[ours]
            norm = store.get(take(PREFIX + stem + "_norm.weight"))
            proj = store.get(take(PREFIX + stem + "_proj.weight"))
            if norm.numel() != p.numel() or proj.numel() != p.numel():
                raise ConvertError(f"{where}: {stem}_norm/_proj must each hold {p.numel()} values")
            p.copy_((norm.float().flatten() * proj.float().flatten()).to(p.dtype))
        for il, layer in enumerate(model.layers):
            if not isinstance(layer.ffn, LatentMoE):
                continue
            for wid, attr in _EXPERT_PROJ:
                dst = getattr(layer.ffn, attr)
                rows, cols = dst.shape[1:]
                for e in range(cfg.num_experts):
                    base = f"{PREFIX}model.layers.{il}.block_sparse_moe.experts.{e}.{wid}."
                    if cfg.experts_mxfp4:
                        packed = store.get(take(base + "weight_packed"), (rows, cols // 2), torch.uint8)
                        scale = store.get(take(base + "weight_scale"), (rows, cols // 32), torch.uint8)
                        dst[e] = mxfp4_dequantize(unpack_codes(packed), scale).to(dst.dtype)
                    else:
                        dst[e] = store.get(take(base + "weight"), (rows, cols)).to(dst.dtype)
    extra = sorted(present - used)
    if extra:
        raise ConvertError(f"{where}: {len(extra)} unexpected tensor(s), e.g. {extra[0]!r}")
    return model

