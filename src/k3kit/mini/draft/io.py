"""The drafter on disk: an HF DSpark checkpoint (config.json + model.safetensors).

Written in the form `k3kit draft convert` reads (k3kit.convert.draft_config, the parser
DraftConfig.from_hf uses too, and the `dspark` mapping): flat Qwen3-style keys,
`dflash_config {block_size, target_layer_ids, mask_token_id}`, `markov_rank`,
`enable_confidence_head`, `architectures: [DSparkDraftModel]`, tensors named "model." + the
DSparkDraft parameter name. target_layer_ids are HF ids (output of target layer i = input of
layer i + 1); the converter writes i + 1 into `dflash.target_layers`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3kit._io import atomic_write, read_json, write_json
from k3kit.errors import ConvertError
from k3kit.models.dflash.config import DraftConfig
from k3kit.models.dflash.names import hf_tensor_name
from k3kit.models.dflash.network import DSparkDraft

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_MAX_CONFIG_BYTES = 1 << 20


def hf_config(cfg: DraftConfig, *, num_target_layers: int, max_position_embeddings: int) -> dict:
    out = {
        "architectures": ["DSparkDraftModel"],
        "model_type": "dspark",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_target_layers": num_target_layers,
        "target_hidden_size": cfg.tap_width,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": cfg.has_confidence,
        "confidence_head_with_markov": cfg.confidence_with_markov,
        "sample_from_anchor": cfg.sample_from_anchor,
        "dflash_config": {"block_size": cfg.block_size, "target_layer_ids": list(cfg.target_layer_ids),
                          "mask_token_id": cfg.mask_token_id},
        "torch_dtype": "float32",
    }
    return out


def save_draft(draft: DSparkDraft, out_dir: str | Path, *, num_target_layers: int,
               max_position_embeddings: int, extra_metadata: dict[str, str] | None = None,
               dtype: torch.dtype = torch.float32) -> Path:
    """config.json + model.safetensors (float32, or bfloat16 for a smaller shipped copy) into
    out_dir; each file written atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {hf_tensor_name(n): p.detach().to(dtype).contiguous().clone()
               for n, p in draft.named_parameters()}
    meta = {"format": "pt", **(extra_metadata or {})}
    atomic_write(out / WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata=meta))
    cfg = hf_config(draft.cfg, num_target_layers=num_target_layers,
                    max_position_embeddings=max_position_embeddings)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    write_json(out / CONFIG_NAME, cfg)
    return out


def load_draft(src_dir: str | Path) -> DSparkDraft:
    """A DSparkDraft from a directory `save_draft` wrote (no embedding / LM head attached)."""
    d = Path(src_dir)
    cfg_path = d / CONFIG_NAME
    raw = read_json(cfg_path, "config", max_bytes=_MAX_CONFIG_BYTES, error=ConvertError)
    if not isinstance(raw, dict):
        raise ConvertError(f"{cfg_path}: config.json must hold an object")
    draft = DSparkDraft(DraftConfig.from_hf(raw, str(cfg_path)))
    params = dict(draft.named_parameters())
    wpath = d / WEIGHTS_NAME
    try:
        f = safe_open(str(wpath), framework="pt")
    except FileNotFoundError:
        raise ConvertError(f"{wpath}: no such file") from None
    except Exception as e:
        raise ConvertError(f"{wpath}: not a safetensors file ({e})") from None
    names = set(f.keys())
    want = {hf_tensor_name(n): n for n in params}
    if names != set(want):
        extra, missing = sorted(names - set(want)), sorted(set(want) - names)
        raise ConvertError(f"{wpath}: tensors do not match config.json "
                           f"(missing {missing[:3]}, unexpected {extra[:3]})")
    with torch.no_grad():
        for hf_name, name in want.items():
            t = f.get_tensor(hf_name)
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ConvertError(f"{wpath}: {hf_name} has shape {list(t.shape)}, expected {list(p.shape)}")
            p.copy_(t.to(p.dtype))
    return draft


def load_gguf_draft(path: str | Path, trunk: str = "quantized") -> DSparkDraft:
    """A DSparkDraft from a llama.cpp `dflash` GGUF: the shipped artifact itself, loaded by the
    dflash adapter's registry entry (what `k3kit generate --draft` runs), so its acceptance is
    measured rather than assumed. `trunk="float"`: its matrices dequantized to float32 Parameters."""
    from k3kit.adapters.dflash import load
    from k3kit.gguf.format import ARCH_DFLASH
    from k3kit.runtime.loader import GGUFSource, LoadOptions

    source = GGUFSource(path)
    try:
        if source.arch != ARCH_DFLASH:
            raise ConvertError(f"{path}: architecture {source.arch!r} is not a dflash draft")
        return load(source, LoadOptions(trunk=trunk)).draft
    finally:
        source.close()
