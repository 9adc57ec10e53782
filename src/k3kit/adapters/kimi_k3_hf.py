"""K3 checkpoints in Hugging Face form on disk: config.json + model.safetensors, in and out.

The names and layouts are k3kit.models.kimi_k3.hf's (what llama.cpp's converter reads); this
module is the file side, kept out of models/ (which never opens files).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from k3kit._io import atomic_write, read_json, write_json
from k3kit.errors import ConvertError, FormatError
from k3kit.models.kimi_k3.config import K3ModelConfig
from k3kit.models.kimi_k3.hf import EXPERT_PROJ, PREFIX, hf_tensors, plain_names, res_names
from k3kit.models.kimi_k3.model import K3Model
from k3kit.models.kimi_k3.moe import LatentMoE
from k3kit.models.kimi_k3.mxfp4 import mxfp4_dequantize, unpack_codes

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def save_hf(model: K3Model, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json and model.safetensors into `out_dir` (each via temp name + fsync + rename).

    Other files in the directory (a tokenizer, say) are left alone.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model, dtype)
    config = model.cfg.to_hf_config()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    atomic_write(out / WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    write_json(out / CONFIG_NAME, config)
    return out


def read_hf_config(path: str | Path) -> tuple[K3ModelConfig, dict]:
    """Parse `<dir>/config.json` (bounded, validated); returns (config, raw dict)."""
    p = Path(path)
    cfg_path = p / CONFIG_NAME if p.is_dir() else p
    raw = read_json(cfg_path, error=FormatError)
    return K3ModelConfig.from_hf_config(raw, str(cfg_path)), raw


class _Tensors:
    """Read access to the tensors of one or several safetensors files, by name."""

    def __init__(self, model_dir: Path):
        self.where: dict[str, Path] = {}
        index = model_dir / INDEX_NAME
        if index.is_file():
            raw = read_json(index, "safetensors index", error=FormatError)
            wm = raw.get("weight_map") if isinstance(raw, dict) else None
            if not isinstance(wm, dict):
                raise FormatError(f"{index}: not a safetensors index (no weight_map object)")
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
        for ours, hf, fn in plain_names(model):
            p = params[ours]
            want = tuple(fn(p.detach()).shape)
            p.copy_(store.get(take(PREFIX + hf), want).reshape(p.shape).to(p.dtype))
        for ours, stem in res_names(model):
            p = params[ours]
            norm = store.get(take(PREFIX + stem + "_norm.weight"))
            proj = store.get(take(PREFIX + stem + "_proj.weight"))
            if norm.numel() != p.numel() or proj.numel() != p.numel():
                raise ConvertError(f"{where}: {stem}_norm/_proj must each hold {p.numel()} values")
            p.copy_((norm.float().flatten() * proj.float().flatten()).to(p.dtype))
        for il, layer in enumerate(model.layers):
            if not isinstance(layer.ffn, LatentMoE):
                continue
            for wid, attr in EXPERT_PROJ:
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

