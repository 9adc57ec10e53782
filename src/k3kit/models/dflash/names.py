"""DSparkDraft parameter names <-> llama.cpp `dflash` GGUF tensor names and HF checkpoint names.

Parameter names are the HF checkpoint names without the leading "model."; each maps 1:1 onto a
dflash tensor. The GGUF names are data: gguf-py's TENSOR_NAMES for the names every
architecture shares, k3kit.gguf.format for the dflash-only ones (gguf 0.19 predates them).
"""

from __future__ import annotations

import re

from gguf import MODEL_TENSOR, TENSOR_NAMES

from k3kit.gguf.format import (
    CONF_PROJ,
    DFLASH_HIDDEN_NORM,
    FC,
    MARKOV_W1,
    MARKOV_W2,
    OUTPUT,
    OUTPUT_NORM,
    TOKEN_EMBD,
)

_LAYER_TENSORS = {      # parameter suffix under layers.N -> (gguf tensor, suffix)
    "input_layernorm.weight": (MODEL_TENSOR.ATTN_NORM, "weight"),
    "self_attn.q_proj.weight": (MODEL_TENSOR.ATTN_Q, "weight"),
    "self_attn.k_proj.weight": (MODEL_TENSOR.ATTN_K, "weight"),
    "self_attn.v_proj.weight": (MODEL_TENSOR.ATTN_V, "weight"),
    "self_attn.o_proj.weight": (MODEL_TENSOR.ATTN_OUT, "weight"),
    "self_attn.q_norm.weight": (MODEL_TENSOR.ATTN_Q_NORM, "weight"),
    "self_attn.k_norm.weight": (MODEL_TENSOR.ATTN_K_NORM, "weight"),
    "post_attention_layernorm.weight": (MODEL_TENSOR.FFN_NORM, "weight"),
    "mlp.gate_proj.weight": (MODEL_TENSOR.FFN_GATE, "weight"),
    "mlp.up_proj.weight": (MODEL_TENSOR.FFN_UP, "weight"),
    "mlp.down_proj.weight": (MODEL_TENSOR.FFN_DOWN, "weight"),
}
_GLOBAL_NAMES = {
    "fc.weight": f"{FC}.weight",
    "hidden_norm.weight": f"{DFLASH_HIDDEN_NORM}.weight",
    "norm.weight": f"{OUTPUT_NORM}.weight",
    "markov_head.markov_w1.weight": f"{MARKOV_W1}.weight",
    "markov_head.markov_w2.weight": f"{MARKOV_W2}.weight",
    "confidence_head.proj.weight": f"{CONF_PROJ}.weight",
    "confidence_head.proj.bias": f"{CONF_PROJ}.bias",
}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")

# The target's tensors a self-contained draft may carry; the network borrows the target's instead.
BORROWED = frozenset({f"{TOKEN_EMBD}.weight", f"{OUTPUT}.weight"})


def gguf_tensor_name(param: str) -> str:
    """DSparkDraft parameter name (= HF name without "model.") -> llama.cpp dflash tensor name."""
    if param.startswith("model."):
        param = param[len("model."):]
    if param in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[param]
    m = _LAYER_RE.fullmatch(param)
    if m and m.group(2) in _LAYER_TENSORS:
        tensor, suffix = _LAYER_TENSORS[m.group(2)]
        return f"{TENSOR_NAMES[tensor].format(bid=m.group(1))}.{suffix}"
    raise KeyError(f"no dflash GGUF name for draft parameter {param!r}")


def hf_tensor_name(param: str) -> str:
    """DSparkDraft parameter name -> the HF checkpoint's tensor name."""
    return "model." + param
