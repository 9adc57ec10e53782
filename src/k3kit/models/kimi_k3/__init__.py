"""Kimi-K3 text model in PyTorch, as llama.cpp's `kimi-k3` architecture defines it.

    config.py       K3ModelConfig, HF config.json mapping, tiny_config()
    activations.py  situ and the delta-rule L2 norm (RMSNorm is k3kit.layers.norm)
    mxfp4.py        ggml-exact MXFP4 rounding, fake quant (STE), compressed-tensors packing
    kda.py          KDA layer, captured rows and commit_rows (speculative replay)
    mla.py          NoPE MLA with the sigmoid output gate
    moe.py          router, latent MoE (a k3kit.layers.moe.RoutedMoE), dense FFN
    attn_res.py     cross-layer residual mixing
    state.py        K3State (MLA latent caches, KDA recurrent state)
    model.py        K3Model, K3Output, Captured, commit_rows, init_random
    hf.py           HF checkpoint names and layouts as llama.cpp's converter reads them
                    (files: k3kit.adapters.kimi_k3_hf save_hf / load_hf)
    gguf_map.py     config and weights from a kimi-k3 GGUF's values (no file access)
"""

from k3kit.layers.moe import ExpertProvider, ExpertWeights

from .config import K3ModelConfig, tiny_config
from .model import Captured, K3Model, K3Output, commit_rows, init_random
from .mxfp4 import mxfp4_fake_quant
from .state import K3State

__all__ = ["K3ModelConfig", "tiny_config", "K3Model", "K3Output", "Captured", "commit_rows", "init_random",
           "ExpertProvider", "ExpertWeights", "mxfp4_fake_quant", "K3State"]
