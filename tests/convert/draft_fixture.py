"""A tiny DSpark draft checkpoint and a synthetic mini kimi-k3 target, for draft converter tests.

The draft is k3kit's own DSparkDraft (torch) with random weights, saved with safetensors under
the real checkpoint names (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...: the names of
z-lab / RadixArk checkpoints, no "model." prefix). config.json has the keys of
RadixArk/Kimi-K3-DSpark's as Lucebox's converter reads them (architectures DSparkDraftModel,
dflash_config {target_layer_ids, mask_token_id}, block_size, markov_rank, markov_head_type,
enable_confidence_head, confidence_head_with_markov, num_target_layers, rms_norm_eps,
rope_parameters {rope_type yarn, factor, original_max_position_embeddings, rope_theta}),
scaled to the mini target: hidden 256 (= the target's, llama.cpp's fc reads n_taps x n_embd),
vocab 1024 (= the target tokenizer's), 2 layers, 4 heads / 2 KV heads of 64, Markov rank 32.
`make_legacy` rewrites a converted draft into the legacy (Lucebox `dflash-draft`) form.
Also imported by tests/interop/test_draft_llama.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from gguf import GGUFValueType
from safetensors.torch import save_file

from k3kit.gguf.reader import GGUFFile
from k3kit.gguf.rewrite import Rules, rewrite
from k3kit.gguf.synth import synthesize
from k3kit.gguf.writer import kv
from k3kit.models.dflash.config import DraftConfig
from k3kit.models.dflash.network import DSparkDraft

TARGET_LAYERS = 4
VOCAB = 1024
HIDDEN = 256


def draft_config(**overrides) -> dict:
    cfg = {
        "architectures": ["DSparkDraftModel"],
        "attention_bias": False,
        "block_size": 7,
        "bos_token_id": 1,
        "confidence_head_with_markov": True,
        "dflash_config": {"mask_token_id": 1000, "target_layer_ids": [0, 2]},
        "enable_confidence_head": True,
        "eos_token_id": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": 512,
        "layer_types": ["full_attention", "full_attention"],
        "markov_head_type": "vanilla",
        "markov_rank": 32,
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_target_layers": TARGET_LAYERS,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"factor": 16.0, "original_max_position_embeddings": 256,
                            "rope_theta": 50000.0, "rope_type": "yarn"},
        "tie_word_embeddings": False,
        "vocab_size": VOCAB,
    }
    cfg.update(overrides)
    return cfg


def write_draft(out_dir: Path, *, seed: int = 3, dtype: torch.dtype = torch.bfloat16,
                extra: dict[str, torch.Tensor] | None = None, drop: tuple[str, ...] = (),
                replace: dict[str, torch.Tensor] | None = None, **cfg_overrides) -> dict[str, torch.Tensor]:
    """Save a random DSpark draft into out_dir; returns the tensors as saved."""
    cfg = draft_config(**cfg_overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    torch.manual_seed(seed)
    model = DSparkDraft(DraftConfig.from_hf(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 / p.shape[-1] ** 0.5))
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if k not in drop}
    tensors.update(replace or {})
    tensors.update(extra or {})
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def write_target(out_dir: Path) -> Path:
    """A synthetic mini kimi-k3 GGUF (4 layers, 8 experts, vocab 1024, with a gpt2 tokenizer)."""
    r = synthesize(out_dir, "mini", TARGET_LAYERS, 8, seed=5, progress=False)
    return Path(r.paths[0])


# ---------------------------------------------------------------- legacy drafts

LEGACY = "dflash-draft"
BACK = {"fc.weight": "dflash.fc.weight", "enc.output_norm.weight": "dflash.hidden_norm.weight",
        "markov_w1.weight": "dflash.dspark.markov.w1", "markov_w2.weight": "dflash.dspark.markov.w2",
        "conf_proj.weight": "dflash.dspark.confidence.weight",
        "conf_proj.bias": "dflash.dspark.confidence.bias"}


def make_legacy(converted: Path, out: Path, *, half_fixed: bool = False) -> Path:
    """Our draft as the Lucebox converter wrote it: arch dflash-draft, DFlash keys one level down,
    HF tap ids, mask id under the arch, DSpark flags under dflash.dspark.*, no tokenizer but
    bos/eos ids, legacy tensor names. `half_fixed`: what the seed's fix left (arch dflash,
    `dflash.mask_token_id`, no tokenizer)."""
    f = GGUFFile.open(converted)
    old = f.kv
    f.close()
    a = "dflash" if half_fixed else LEGACY
    ids = [int(i) - 1 for i in old["dflash.target_layers"].value]
    arr, u32, boolean = GGUFValueType.ARRAY, GGUFValueType.UINT32, GGUFValueType.BOOL
    sets = [kv(f"{a}.dflash.block_size", u32, int(old["dflash.block_size"].value)),
            kv(f"{a}.dflash.target_layer_ids", arr, ids, GGUFValueType.INT32),
            kv(f"{a}.dflash.n_target_layers", u32, len(ids)),
            kv(f"{a}.dflash.n_target_features", u32, len(ids) * int(old["dflash.embedding_length"].value)),
            kv(f"{a}.dflash.target.block_count", u32, 4),
            kv(f"{a}.dflash.dspark.enabled", u32, 1),
            kv(f"{a}.dflash.dspark.markov_rank", u32, 32),
            kv(f"{a}.dflash.dspark.markov_type", GGUFValueType.STRING, "vanilla"),
            kv(f"{a}.dflash.dspark.confidence.enabled", boolean,
               bool(old["dflash.has_confidence_head"].value)),
            kv(f"{a}.dflash.dspark.confidence.with_markov", boolean, True),
            kv(f"{a}.vocab_size", u32, 1024),
            kv(f"{a}.source.config_json", GGUFValueType.STRING, "{}"),
            kv("tokenizer.ggml.bos_token_id", u32, 1), kv("tokenizer.ggml.eos_token_id", u32, 2)]
    if half_fixed:
        sets = [kv("dflash.mask_token_id", u32, int(old["tokenizer.ggml.mask_token_id"].value))]
        delete = ["tokenizer.*", "dflash.sample_from_anchor"]
    else:
        sets.append(kv(f"{a}.dflash.mask_token_id", u32, int(old["tokenizer.ggml.mask_token_id"].value)))
        delete = ["tokenizer.*", f"{a}.block_size", f"{a}.target_layers", f"{a}.sample_from_anchor",
                  f"{a}.has_confidence_head"]
    rules = Rules(arch=a, rename_tensors=[(re.compile("^" + re.escape(k) + "$"), v) for k, v in BACK.items()])
    rewrite(converted, out, rules)
    # second pass so the deletes never touch the keys we add (rewrite deletes after it sets)
    rewrite(out, out.with_suffix(".tmp.gguf"), Rules(delete=delete))
    rewrite(out.with_suffix(".tmp.gguf"), out, Rules(set=sets), in_place=True)
    out.with_suffix(".tmp.gguf").unlink()
    return out
