"""Tiny random Kimi-K3 checkpoints in Hugging Face form, for converter tests.

Geometry: hidden 64, layers KDA, MLA, KDA, MLA (layer 0 dense), 2 heads, KDA head_dim 32,
MLA q_lora 32 / kv_lora 32 / nope 32 / rope 32 / v 32 with the output gate, 8 experts top-2,
expert width 32 in a latent of 32 with the routed norm, one shared expert, attn-res block 2.
Every matrix input width is a multiple of 32, so Q8_0 and MXFP4 apply everywhere as in the
real model. The tokenizer is k3kit's mini BPE (vocab 512) trained on a slice of the corpus.
Also imported by tests/interop/test_convert_vs_llama.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from k3kit.adapters.kimi_k3_hf import save_hf
from k3kit.mini.corpus import build_corpus
from k3kit.mini.tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, train_tokenizer
from k3kit.models.kimi_k3 import K3Model, init_random
from k3kit.models.kimi_k3.config import KDA, MLA, K3ModelConfig, tiny_config

VOCAB = 512
GEOMETRY = dict(
    vocab_size=VOCAB, hidden_size=64, layer_kinds=[KDA, MLA, KDA, MLA], num_heads=2, kda_head_dim=32,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
    intermediate_size=96, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    expert_latent_size=32, first_k_dense=1, num_shared_experts=1, attn_res_block_size=2,
)


def tiny_k3_config(**overrides) -> K3ModelConfig:
    return tiny_config(**{**GEOMETRY, **overrides})


@functools.cache
def _tokenizer_json() -> str:
    corpus = build_corpus(100_000)
    return train_tokenizer(corpus.train_docs, VOCAB).to_str()


def mini_tokenizer() -> Tokenizer:
    return Tokenizer.from_str(_tokenizer_json())


def write_checkpoint(out_dir: Path, *, seed: int = 1, dtype: torch.dtype = torch.float32,
                     tokenizer_config: bool = True, **overrides) -> K3Model:
    """Save a random tiny K3 (config.json, model.safetensors, tokenizer files) into out_dir."""
    model = K3Model(tiny_k3_config(**overrides))
    init_random(model, seed=seed)
    save_hf(model, out_dir, dtype=dtype)
    Path(out_dir, "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    if tokenizer_config:
        Path(out_dir, "tokenizer_config.json").write_text(json.dumps({
            "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "chat_template": CHAT_TEMPLATE,
        }), encoding="utf-8")
    return model.eval()
