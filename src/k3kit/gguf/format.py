"""The k3kit table of `kimi-k3` and `dflash` GGUF keys and tensor names, and tensor roles.

gguf 0.19 (the PyPI package) predates both architectures, so the strings llama.cpp reads
live here, taken from the vendored llama.cpp (2026-10-01): key strings from
`src/llama-arch.cpp` (LLM_KV_NAMES), which keys are read and with which C type from
`src/llama-model.cpp` (generic hparams) plus `src/models/kimi-k3.cpp` / `dflash.cpp`
(`load_arch_hparams`), and tensor names from `load_arch_tensors` of the same files.
gguf's own constants are reused wherever they exist.

llama.cpp type-checks every key it reads (`uint32_t` needs UINT32, `float` FLOAT32,
`bool` BOOL; per-layer keys accept a scalar or an INT32/UINT32 array of length
`block_count`), so each key carries its expected GGUF value type: a file with a
right-named key of the wrong type fails to load.

Shard file names (`NAME-0000K-of-0000N.gguf`) are in `k3kit.gguf.shards`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gguf import MODEL_TENSOR, TENSOR_NAMES, GGUFValueType
from gguf import Keys as Keys  # re-exported: models read gguf's key names through this table

from k3kit.gguf.reader import KV, kv_array, kv_int

ARCH_KIMI_K3 = "kimi-k3"
ARCH_DFLASH = "dflash"

U32 = GGUFValueType.UINT32
I32 = GGUFValueType.INT32
F32 = GGUFValueType.FLOAT32
BOOL = GGUFValueType.BOOL
STR = GGUFValueType.STRING
ARR = GGUFValueType.ARRAY
INT_ITEMS = (I32, U32)  # what llama.cpp's get_arr accepts for integer arrays


@dataclass(frozen=True)
class KeySpec:
    """One metadata key: its template, the value type llama.cpp accepts, and whether it must exist.

    `per_layer` keys may also be an integer array of length block_count (get_key_or_arr);
    `array_items` set means the key is always an array of those item types.
    """

    template: str
    vtype: GGUFValueType
    required: bool = False
    per_layer: bool = False
    array_items: tuple[GGUFValueType, ...] = ()

    def name(self, arch: str) -> str:
        return self.template.format(arch=arch)


# --- keys gguf 0.19 does not have (strings from llama-arch.cpp) ---
KEY_ATTN_RES_BLOCK_SIZE = "{arch}.attn_res.block_size"
KEY_SITU_BETA = "{arch}.activation.situ_beta"
KEY_SITU_LINEAR_BETA = "{arch}.activation.situ_linear_beta"
KEY_EXPERT_LATENT_LENGTH = "{arch}.expert_latent_length"
KEY_KDA_HEAD_DIM = Keys.KDA.HEAD_DIM
KEY_KDA_GATE_LOWER_BOUND = "{arch}.kda.gate_lower_bound"
KEY_KDA_SAFE_GATE = "{arch}.kda.safe_gate"
KEY_HIDDEN_ACT = "{arch}.hidden_activation"
KEY_TARGET_LAYERS = "{arch}.target_layers"
KEY_TARGET_HIDDEN_SIZE = "{arch}.target_hidden_size"
KEY_BLOCK_SIZE = "{arch}.block_size"
KEY_CONV_KERNEL_SIZE = "{arch}.conv_kernel_size"
KEY_CONV_GROUP_SIZE = "{arch}.conv_group_size"
KEY_SELECTOR_RANK = "{arch}.selector_rank"
KEY_SELECTOR_TOP_K = "{arch}.selector_top_k"
KEY_SAMPLE_FROM_ANCHOR = "{arch}.sample_from_anchor"  # read as a string: "true" unless present and not
KEY_HAS_CONFIDENCE_HEAD = "{arch}.has_confidence_head"
KEY_ATTN_VALUE_SCALE = "{arch}.attention.value_scale"
KEY_HYPER_CONNECTION_COUNT = "{arch}.hyper_connection.count"  # DSV4 DSpark backbone only
KEY_MASK_TOKEN_ID = Keys.Tokenizer.MASK_ID  # the token a DFlash block is filled with after the anchor

LLM, ATT, ROPE = Keys.LLM, Keys.Attention, Keys.Rope

# Keys the generic loader (llama_model_base::load_hparams) reads for every non-vocab-only model.
_GENERIC_KEYS: tuple[KeySpec, ...] = (
    KeySpec(LLM.CONTEXT_LENGTH, U32, required=True),
    KeySpec(LLM.EMBEDDING_LENGTH, U32, required=True),
    KeySpec(LLM.BLOCK_COUNT, U32, required=True),
    KeySpec(LLM.VOCAB_SIZE, U32),
    KeySpec(LLM.EXPERT_COUNT, U32),
    KeySpec(LLM.EXPERT_USED_COUNT, U32, per_layer=True),
    KeySpec(LLM.FEED_FORWARD_LENGTH, U32, per_layer=True),
    KeySpec(ATT.HEAD_COUNT, U32, per_layer=True),
    KeySpec(ATT.HEAD_COUNT_KV, U32, per_layer=True),
    KeySpec(ATT.KEY_LENGTH, U32),
    KeySpec(ATT.VALUE_LENGTH, U32),
    KeySpec(ATT.CAUSAL, BOOL),
    KeySpec(ROPE.DIMENSION_COUNT, U32),
    KeySpec(ROPE.FREQ_BASE, F32),
    KeySpec(ROPE.SCALING_TYPE, STR),
    KeySpec(ROPE.SCALING_FACTOR, F32),
    KeySpec(ROPE.SCALING_ORIG_CTX_LEN, U32),
)

# kimi-k3: llama_model_kimi_k3::load_arch_hparams. head_count is ONE value for KDA and MLA;
# head_count_kv per layer marks the layer type (0 = KDA, else MLA); key_length must be
# kv_lora + rope and value_length kv_lora (MLA served as MQA over the latent).
KIMI_K3_KEYS: tuple[KeySpec, ...] = _GENERIC_KEYS + (
    KeySpec(ATT.LAYERNORM_RMS_EPS, F32, required=True),
    KeySpec(ATT.KEY_LENGTH_MLA, U32, required=True),
    KeySpec(ATT.VALUE_LENGTH_MLA, U32, required=True),
    KeySpec(ATT.Q_LORA_RANK, U32),
    KeySpec(ATT.KV_LORA_RANK, U32, required=True),
    KeySpec(Keys.SSM.CONV_KERNEL, U32, required=True),
    KeySpec(KEY_KDA_HEAD_DIM, U32, required=True),
    KeySpec(KEY_KDA_GATE_LOWER_BOUND, F32),  # absent: the graph silently uses Kimi-Linear's gate
    KeySpec(LLM.EXPERT_FEED_FORWARD_LENGTH, U32, required=True, per_layer=True),
    KeySpec(LLM.EXPERT_SHARED_COUNT, U32, required=True),
    KeySpec(LLM.LEADING_DENSE_BLOCK_COUNT, U32),
    KeySpec(LLM.EXPERT_WEIGHTS_SCALE, F32),
    KeySpec(LLM.EXPERT_WEIGHTS_NORM, BOOL),
    KeySpec(LLM.EXPERT_GATING_FUNC, U32, required=True),
    KeySpec(KEY_EXPERT_LATENT_LENGTH, U32),
    KeySpec(KEY_ATTN_RES_BLOCK_SIZE, U32, required=True),
    KeySpec(KEY_SITU_BETA, F32, required=True),
    KeySpec(KEY_SITU_LINEAR_BETA, F32, required=True),
)

# dflash (DFlash / DSpark drafts): llama_model_dflash::load_arch_hparams, classic backbone.
# The draft has no vocab of its own in practice; tokenizer keys come from the target.
DFLASH_KEYS: tuple[KeySpec, ...] = _GENERIC_KEYS + (
    KeySpec(ATT.LAYERNORM_RMS_EPS, F32, required=True),
    KeySpec(KEY_TARGET_LAYERS, ARR, required=True, array_items=INT_ITEMS),
    KeySpec(KEY_BLOCK_SIZE, U32),
    KeySpec(KEY_CONV_KERNEL_SIZE, U32),
    KeySpec(KEY_CONV_GROUP_SIZE, U32),
    KeySpec(KEY_SELECTOR_RANK, U32),
    KeySpec(KEY_SELECTOR_TOP_K, U32),
    KeySpec(KEY_SAMPLE_FROM_ANCHOR, BOOL),
    KeySpec(KEY_HAS_CONFIDENCE_HEAD, BOOL),
    KeySpec(KEY_HIDDEN_ACT, STR),
    KeySpec(LLM.EMBEDDING_SCALE, F32),
    KeySpec(LLM.LOGIT_SCALE, F32),
    KeySpec(LLM.FINAL_LOGIT_SOFTCAPPING, F32),
    KeySpec(ATT.SCALE, F32),
    KeySpec(KEY_ATTN_VALUE_SCALE, F32),
    KeySpec(ATT.SLIDING_WINDOW, U32),
    KeySpec(ATT.SLIDING_WINDOW_PATTERN, ARR, array_items=(BOOL,)),
    KeySpec(ROPE.DIMENSION_SECTIONS, ARR, array_items=INT_ITEMS),
    KeySpec(KEY_HYPER_CONNECTION_COUNT, U32),
)

# Tokenizer keys both archs use (gguf's strings). mask_token_id is what a DFlash draft's
# block is filled with after the anchor.
TOKENIZER_KEYS: tuple[KeySpec, ...] = (
    KeySpec(Keys.Tokenizer.MODEL, STR, required=True),
    KeySpec(Keys.Tokenizer.PRE, STR),
    KeySpec(Keys.Tokenizer.LIST, ARR, required=True, array_items=(STR,)),
    KeySpec(Keys.Tokenizer.TOKEN_TYPE, ARR, array_items=(I32,)),
    KeySpec(Keys.Tokenizer.SCORES, ARR, array_items=(F32, I32)),
    KeySpec(Keys.Tokenizer.MERGES, ARR, array_items=(STR,)),
    KeySpec(Keys.Tokenizer.BOS_ID, U32),
    KeySpec(Keys.Tokenizer.EOS_ID, U32),
    KeySpec(Keys.Tokenizer.EOT_ID, U32),
    KeySpec(Keys.Tokenizer.PAD_ID, U32),
    KeySpec(Keys.Tokenizer.MASK_ID, U32),
    KeySpec(Keys.Tokenizer.ADD_BOS, BOOL),
    KeySpec(Keys.Tokenizer.ADD_EOS, BOOL),
    KeySpec(Keys.Tokenizer.CHAT_TEMPLATE, STR),
)

GENERAL_KEYS: tuple[KeySpec, ...] = (
    KeySpec(Keys.General.ARCHITECTURE, STR, required=True),
    KeySpec(Keys.General.NAME, STR),
    KeySpec(Keys.General.FILE_TYPE, U32),
    KeySpec(Keys.General.QUANTIZATION_VERSION, U32),
    KeySpec(Keys.General.ALIGNMENT, U32),
)

ARCH_KEYS: dict[str, tuple[KeySpec, ...]] = {ARCH_KIMI_K3: KIMI_K3_KEYS, ARCH_DFLASH: DFLASH_KEYS}

EXPERT_GATING_SIGMOID = 2  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def key_specs(arch: str) -> dict[str, KeySpec]:
    """Every key llama.cpp reads for `arch`, by full key name (general and tokenizer keys included)."""
    if arch not in ARCH_KEYS:
        raise ValueError(f"no key table for architecture {arch!r}")
    specs = GENERAL_KEYS + TOKENIZER_KEYS + ARCH_KEYS[arch]
    return {s.name(arch): s for s in specs}


def check_kv_types(arch: str, kv: Mapping[str, KV]) -> list[str]:
    """Problems llama.cpp's loader would hit with these KVs: missing required keys, wrong types.

    `kv` maps key names to objects with `vtype` and `item_type` (k3kit.gguf.reader.KV).
    Keys the table does not know are ignored (llama.cpp ignores them too).
    """
    problems: list[str] = []
    specs = key_specs(arch)
    n_layer = None
    block = kv.get(LLM.BLOCK_COUNT.format(arch=arch))
    if block is not None and getattr(block, "vtype", None) == U32:
        n_layer = kv_int(block)
    for name, spec in specs.items():
        item = kv.get(name)
        if item is None:
            if spec.required:
                problems.append(f"missing required key {name}")
            continue
        vtype, item_type = item.vtype, item.item_type
        if spec.array_items:
            if vtype != ARR or item_type not in spec.array_items:
                want = "/".join(t.name for t in spec.array_items)
                problems.append(f"{name}: expected an array of {want}, got {_type_str(vtype, item_type)}")
        elif spec.per_layer and vtype == ARR:
            if item_type not in INT_ITEMS:
                got = _type_str(vtype, item_type)
                problems.append(f"{name}: per-layer array must hold INT32/UINT32, got {got}")
            elif n_layer is not None and len(kv_array(item)) != n_layer:
                n = len(kv_array(item))
                problems.append(f"{name}: array length {n} != block_count {n_layer}")
        elif vtype != spec.vtype:
            problems.append(f"{name}: expected {spec.vtype.name}, got {_type_str(vtype, item_type)}")
    return problems


def _type_str(vtype: GGUFValueType, item_type: GGUFValueType | None) -> str:
    return f"ARRAY[{item_type.name if item_type is not None else '?'}]" if vtype == ARR else vtype.name


# --- tensor names (LLM_TENSOR_NAMES templates; `{bid}` is the layer) ---
# A name is `BASE.SUFFIX` (global) or `blk.N.BASE.SUFFIX` (per layer, see blk()); the bases
# are gguf-py's TENSOR_NAMES where it has them, else the strings of llama-arch.cpp.
WEIGHT = "weight"
BIAS = "bias"


def _gguf(t: MODEL_TENSOR) -> str:
    """gguf-py's name of a tensor as a base: the `blk.{bid}.` of per-layer tensors dropped."""
    return TENSOR_NAMES[t].removeprefix("blk.{bid}.")


TOKEN_EMBD = _gguf(MODEL_TENSOR.TOKEN_EMBD)
OUTPUT_NORM = _gguf(MODEL_TENSOR.OUTPUT_NORM)
OUTPUT = _gguf(MODEL_TENSOR.OUTPUT)
OUTPUT_RES_SCORE = "output_res_score"
ENC_OUTPUT_NORM = _gguf(MODEL_TENSOR.ENC_OUTPUT_NORM)  # dflash: hidden_norm applied after fc
DFLASH_HIDDEN_NORM = ENC_OUTPUT_NORM
FC = "fc"
D2T = "d2t"
MARKOV_W1 = "markov_w1"
MARKOV_W2 = "markov_w2"
CONF_PROJ = "conf_proj"
SELECTOR_PREV = "selector_predecessor"
SELECTOR_NEXT = "selector_successor"
SELECTOR_HIDDEN = "selector_hidden"


# per-layer bases kimi-k3 uses
ATTN_NORM = _gguf(MODEL_TENSOR.ATTN_NORM)
FFN_NORM = _gguf(MODEL_TENSOR.FFN_NORM)
ATTN_RES_SCORE = "attn_res_score"
FFN_RES_SCORE = "ffn_res_score"
ATTN_Q = _gguf(MODEL_TENSOR.ATTN_Q)
ATTN_K = _gguf(MODEL_TENSOR.ATTN_K)
ATTN_V = _gguf(MODEL_TENSOR.ATTN_V)
ATTN_QKV = _gguf(MODEL_TENSOR.ATTN_QKV)
ATTN_OUTPUT = _gguf(MODEL_TENSOR.ATTN_OUT)
ATTN_GATE = _gguf(MODEL_TENSOR.ATTN_GATE)
SSM_CONV1D_Q = _gguf(MODEL_TENSOR.SSM_CONV1D_Q)
SSM_CONV1D_K = _gguf(MODEL_TENSOR.SSM_CONV1D_K)
SSM_CONV1D_V = _gguf(MODEL_TENSOR.SSM_CONV1D_V)
SSM_F_A = _gguf(MODEL_TENSOR.SSM_F_A)
SSM_F_B = _gguf(MODEL_TENSOR.SSM_F_B)
SSM_BETA = _gguf(MODEL_TENSOR.SSM_BETA)
SSM_A = _gguf(MODEL_TENSOR.SSM_A)
SSM_DT = _gguf(MODEL_TENSOR.SSM_DT)
SSM_G = "ssm_g"
SSM_NORM = _gguf(MODEL_TENSOR.SSM_NORM)
ATTN_Q_A = _gguf(MODEL_TENSOR.ATTN_Q_A)
ATTN_Q_B = _gguf(MODEL_TENSOR.ATTN_Q_B)
ATTN_Q_A_NORM = _gguf(MODEL_TENSOR.ATTN_Q_A_NORM)
ATTN_KV_A_MQA = _gguf(MODEL_TENSOR.ATTN_KV_A_MQA)
ATTN_KV_A_NORM = _gguf(MODEL_TENSOR.ATTN_KV_A_NORM)
ATTN_KV_B = _gguf(MODEL_TENSOR.ATTN_KV_B)
ATTN_K_B = _gguf(MODEL_TENSOR.ATTN_K_B)
ATTN_V_B = _gguf(MODEL_TENSOR.ATTN_V_B)
FFN_GATE = _gguf(MODEL_TENSOR.FFN_GATE)
FFN_DOWN = _gguf(MODEL_TENSOR.FFN_DOWN)
FFN_UP = _gguf(MODEL_TENSOR.FFN_UP)
FFN_GATE_INP = _gguf(MODEL_TENSOR.FFN_GATE_INP)
EXP_PROBS_B = _gguf(MODEL_TENSOR.FFN_EXP_PROBS_B)
FFN_GATE_EXPS = _gguf(MODEL_TENSOR.FFN_GATE_EXP)
FFN_DOWN_EXPS = _gguf(MODEL_TENSOR.FFN_DOWN_EXP)
FFN_UP_EXPS = _gguf(MODEL_TENSOR.FFN_UP_EXP)
FFN_ROUTED_DOWN = "ffn_routed_down"
FFN_ROUTED_UP = "ffn_routed_up"
FFN_ROUTED_NORM = "ffn_routed_norm"
FFN_GATE_SHEXP = _gguf(MODEL_TENSOR.FFN_GATE_SHEXP)
FFN_DOWN_SHEXP = _gguf(MODEL_TENSOR.FFN_DOWN_SHEXP)
FFN_UP_SHEXP = _gguf(MODEL_TENSOR.FFN_UP_SHEXP)


def tensor_name(base: str, suffix: str | None = WEIGHT) -> str:
    """`{base}[.{suffix}]`, a global tensor name (token_embd.weight, output_norm.weight, ...)."""
    return base + (f".{suffix}" if suffix else "")


def blk(bid: int, base: str, suffix: str | None = WEIGHT) -> str:
    """`blk.{bid}.{base}[.{suffix}]`, the way LLM_TN builds per-layer names."""
    return f"blk.{bid}.{base}" + (f".{suffix}" if suffix else "")


# kimi-k3 per-layer tensors, grouped the way load_arch_tensors creates them.
# (base, suffix); suffix None = no suffix (ssm_a is created without ".weight").
K3_LAYER_NORMS = ((ATTN_NORM, WEIGHT), (FFN_NORM, WEIGHT))
K3_ATTN_RES = ((ATTN_RES_SCORE, WEIGHT), (FFN_RES_SCORE, WEIGHT))
K3_KDA = (
    (SSM_CONV1D_Q, WEIGHT), (SSM_CONV1D_K, WEIGHT), (SSM_CONV1D_V, WEIGHT),
    (ATTN_Q, WEIGHT), (ATTN_K, WEIGHT), (ATTN_V, WEIGHT),
    (SSM_F_A, WEIGHT), (SSM_F_B, WEIGHT), (SSM_BETA, WEIGHT),
    (SSM_A, None), (SSM_DT, BIAS),
    (SSM_G, WEIGHT), (SSM_NORM, WEIGHT), (ATTN_OUTPUT, WEIGHT),
)
# KDA alternatives llama.cpp also accepts: a fused qkv (+ optional biases) instead of q/k/v.
K3_KDA_OPTIONAL = ((ATTN_QKV, WEIGHT), (ATTN_QKV, BIAS), (ATTN_Q, BIAS), (ATTN_K, BIAS), (ATTN_V, BIAS))
K3_MLA = ((ATTN_KV_A_NORM, WEIGHT), (ATTN_KV_A_MQA, WEIGHT), (ATTN_OUTPUT, WEIGHT))
K3_MLA_Q_LORA = ((ATTN_Q_A_NORM, WEIGHT), (ATTN_Q_A, WEIGHT), (ATTN_Q_B, WEIGHT))
K3_MLA_Q_FULL = ((ATTN_Q, WEIGHT),)
K3_MLA_KV_SPLIT = ((ATTN_K_B, WEIGHT), (ATTN_V_B, WEIGHT))  # what works; fused attn_kv_b crashes
K3_MLA_KV_FUSED = ((ATTN_KV_B, WEIGHT),)
K3_MLA_GATE = ((ATTN_GATE, WEIGHT),)
K3_DENSE_FFN = ((FFN_GATE, WEIGHT), (FFN_DOWN, WEIGHT), (FFN_UP, WEIGHT))
K3_MOE = ((FFN_GATE_INP, WEIGHT), (EXP_PROBS_B, BIAS),
          (FFN_GATE_EXPS, WEIGHT), (FFN_DOWN_EXPS, WEIGHT), (FFN_UP_EXPS, WEIGHT))
K3_MOE_LATENT = ((FFN_ROUTED_DOWN, WEIGHT), (FFN_ROUTED_UP, WEIGHT))
K3_MOE_LATENT_NORM = ((FFN_ROUTED_NORM, WEIGHT),)
K3_SHEXP = ((FFN_GATE_SHEXP, WEIGHT), (FFN_DOWN_SHEXP, WEIGHT), (FFN_UP_SHEXP, WEIGHT))


def _names(bid: int, group: tuple[tuple[str, str | None], ...]) -> list[str]:
    return [blk(bid, base, suffix) for base, suffix in group]


def kimi_k3_expected_tensors(n_layer: int, mla_layers: set[int] | list[int], *, n_dense_lead: int,
                             attn_res: bool, latent: bool) -> tuple[set[str], set[str]]:
    """(required, optional) tensor names llama.cpp's kimi-k3 loader creates for this layout.

    Mirrors load_arch_tensors: the q path is either q-LoRA (attn_q_a_norm present) or a full
    attn_q, and the kv path either fused attn_kv_b or attn_k_b + attn_v_b; both alternatives
    are listed as optional, `kimi_k3_check_names` checks that exactly one of each is present.
    """
    mla = set(mla_layers)
    required = {f"{TOKEN_EMBD}.weight", f"{OUTPUT_NORM}.weight", f"{OUTPUT}.weight"}
    optional: set[str] = set()
    if attn_res:
        required.add(f"{OUTPUT_RES_SCORE}.weight")
    for i in range(n_layer):
        required.update(_names(i, K3_LAYER_NORMS))
        if attn_res:
            required.update(_names(i, K3_ATTN_RES))
        if i in mla:
            required.update(_names(i, K3_MLA))
            optional.update(_names(i, K3_MLA_Q_LORA + K3_MLA_Q_FULL + K3_MLA_KV_SPLIT
                                   + K3_MLA_KV_FUSED + K3_MLA_GATE))
        else:
            required.update(_names(i, K3_KDA))
            optional.update(_names(i, K3_KDA_OPTIONAL))
        if i < n_dense_lead:
            required.update(_names(i, K3_DENSE_FFN))
        else:
            required.update(_names(i, K3_MOE))
            if latent:
                required.update(_names(i, K3_MOE_LATENT))
                optional.update(_names(i, K3_MOE_LATENT_NORM))
            optional.update(_names(i, K3_SHEXP))
    optional -= required
    return required, optional


def kimi_k3_layout_from_kv(kv: Mapping[str, KV]) -> dict[str, Any]:
    """The layer layout a kimi-k3 file's KVs describe: n_layer, MLA layers, dense lead, flags."""
    a = ARCH_KIMI_K3

    def get(template: str, default: object = None) -> Any:  # the KV's value (a number or an array)
        item = kv.get(template.format(arch=a))
        return default if item is None else item.value

    n_layer = int(get(LLM.BLOCK_COUNT))
    head_kv = get(ATT.HEAD_COUNT_KV, 0)
    if isinstance(head_kv, (int, float)):
        kv_per_layer = [int(head_kv)] * n_layer
    else:
        kv_per_layer = [int(x) for x in head_kv]
    return {
        "n_layer": n_layer,
        "mla_layers": {i for i, h in enumerate(kv_per_layer) if h != 0},
        "n_dense_lead": int(get(LLM.LEADING_DENSE_BLOCK_COUNT, 0)),
        "attn_res": int(get(KEY_ATTN_RES_BLOCK_SIZE, 0)) > 0,
        "latent": int(get(KEY_EXPERT_LATENT_LENGTH, 0)) > 0,
    }


def kimi_k3_check_names(names: set[str] | list[str], kv: Mapping[str, KV]) -> list[str]:
    """Problems with a kimi-k3 tensor-name set: missing required, unknown, q/kv alternatives."""
    layout = kimi_k3_layout_from_kv(kv)
    names = set(names)
    required, optional = kimi_k3_expected_tensors(**layout)
    problems = [f"missing tensor {n}" for n in sorted(required - names)]
    problems += [f"tensor {n} is not one kimi-k3 loads" for n in sorted(names - required - optional)]
    for i in sorted(layout["mla_layers"]):
        q_lora = blk(i, ATTN_Q_A_NORM) in names
        if q_lora and not {blk(i, ATTN_Q_A), blk(i, ATTN_Q_B)} <= names:
            problems.append(f"layer {i}: q-LoRA path needs attn_q_a and attn_q_b")
        if not q_lora and blk(i, ATTN_Q) not in names:
            problems.append(f"layer {i}: MLA layer has neither attn_q_a_norm nor attn_q")
        split = {blk(i, ATTN_K_B), blk(i, ATTN_V_B)} <= names
        if blk(i, ATTN_KV_B) not in names and not split:
            problems.append(f"layer {i}: MLA layer needs attn_kv_b or attn_k_b + attn_v_b")
    return problems


# dflash: classic backbone (the DSV4 hyper-connection backbone is not covered here).
DFLASH_GLOBAL_REQUIRED = (f"{FC}.weight", f"{ENC_OUTPUT_NORM}.weight", f"{OUTPUT_NORM}.weight")
DFLASH_GLOBAL_OPTIONAL = (
    f"{TOKEN_EMBD}.weight", f"{OUTPUT}.weight", f"{FC}.scale", D2T, "rope_freqs.weight",
    f"{MARKOV_W1}.weight", f"{MARKOV_W2}.weight", f"{MARKOV_W2}.scale",
    f"{CONF_PROJ}.weight", f"{CONF_PROJ}.bias",
    f"{SELECTOR_PREV}.weight", f"{SELECTOR_NEXT}.weight", f"{SELECTOR_HIDDEN}.weight",
)
DFLASH_LAYER_REQUIRED = (
    ("attn_norm", "weight"), ("attn_q", "weight"), ("attn_k", "weight"), ("attn_output", "weight"),
    ("attn_q_norm", "weight"), ("attn_k_norm", "weight"),
    ("ffn_norm", "weight"), ("ffn_gate", "weight"), ("ffn_down", "weight"), ("ffn_up", "weight"),
)
DFLASH_LAYER_OPTIONAL = (
    ("attn_v", "weight"), ("post_attention_norm", "weight"), ("post_ffw_norm", "weight"),
    ("layer_output_scale", "weight"), ("attn_sinks", "weight"),
    ("attn_conv_base", None), ("attn_conv_proj", "weight"),
    ("ffn_conv_base", None), ("ffn_conv_proj", "weight"),
)


def dflash_expected_tensors(n_layer: int) -> tuple[set[str], set[str]]:
    """(required, optional) tensor names of a classic-backbone dflash draft with n_layer layers.

    markov_w1 present makes markov_w2 required, selector_hidden present makes the selector
    and conv tensors required; those couplings are llama.cpp's, listed here as optional.
    """
    required = set(DFLASH_GLOBAL_REQUIRED)
    optional = set(DFLASH_GLOBAL_OPTIONAL)
    for i in range(n_layer):
        required.update(_names(i, DFLASH_LAYER_REQUIRED))
        optional.update(_names(i, DFLASH_LAYER_OPTIONAL))
    return required, optional


# --- roles ---
ROLE_ROUTED_EXPERTS = "routed_experts"
ROLE_SHARED_EXPERTS = "shared_experts"
ROLE_ATTENTION = "attention"
ROLE_DENSE_FFN = "dense_ffn"
ROLE_ROUTER = "router"
ROLE_EMBEDDINGS_OUTPUT = "embeddings_output"
ROLE_NORMS_BIASES = "norms_biases"
ROLE_OTHER = "other"
ROLES = (ROLE_ROUTED_EXPERTS, ROLE_SHARED_EXPERTS, ROLE_ATTENTION, ROLE_DENSE_FFN, ROLE_ROUTER,
         ROLE_EMBEDDINGS_OUTPUT, ROLE_NORMS_BIASES, ROLE_OTHER)

# Roles whose matrices form the "trunk": everything a token always touches. Requantizing
# these (not the QAT-calibrated routed experts) is what shrinks a K3 trunk to fit on GPU.
TRUNK_ROLES = frozenset({ROLE_ATTENTION, ROLE_DENSE_FFN, ROLE_SHARED_EXPERTS, ROLE_EMBEDDINGS_OUTPUT})

_LAYER_RE = re.compile(r"^blk\.(\d+)\.([^.]+)(?:\.|$)")
_ROUTER_BASES = frozenset({"ffn_gate_inp", "ffn_gate_inp_shexp", "exp_probs_b"})
_DENSE_FFN_BASES = frozenset({"ffn_gate", "ffn_up", "ffn_down", "ffn_gate_up",
                              "ffn_routed_down", "ffn_routed_up", "ffn_latent_down", "ffn_latent_up"})
_ATTENTION_PREFIXES = ("attn_", "ssm_", "indexer", "time_mix_", "shortconv")


def layer_of(name: str) -> int | None:
    """The layer index of a `blk.N.*` tensor name, else None."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def _base(name: str) -> str:
    """`blk.3.ffn_up_exps.weight` -> `ffn_up_exps`; `token_embd.weight` -> `token_embd`."""
    m = _LAYER_RE.match(name)
    if m:
        return m.group(2)
    return name.split(".", 1)[0]


def is_routed_expert(name: str) -> bool:
    """True for stacked routed-expert tensors (`blk.N.ffn_{gate,up,down,gate_up}_exps.*`)."""
    return _base(name).endswith("_exps")


def role_of(name: str, n_dims: int) -> str:
    """The role of a tensor, from its name and rank (number of dimensions); one of ROLES.

    Order matters: expert and router names win over rank (exp_probs_b is 1-D but is router
    state; ffn_gate_inp_shexp is a router although it names the shared expert), then every
    other 1-D tensor (norms, biases, res scores, ssm_a) is norms_biases. KDA and MLA weights
    (`attn_*`, `ssm_*`) are attention; the leading dense FFN and the latent-MoE projections
    (`ffn_routed_down/up`, used by every token) are dense_ffn, i.e. trunk, not experts.
    """
    base = _base(name)
    if base.endswith("_exps"):
        return ROLE_ROUTED_EXPERTS
    if base in _ROUTER_BASES:
        return ROLE_ROUTER
    if base.endswith("_shexp"):
        return ROLE_SHARED_EXPERTS
    if n_dims <= 1:
        return ROLE_NORMS_BIASES
    if layer_of(name) is None:
        return ROLE_EMBEDDINGS_OUTPUT if base in (TOKEN_EMBD, OUTPUT) else ROLE_OTHER
    if base.startswith(_ATTENTION_PREFIXES):
        return ROLE_ATTENTION
    if base in _DENSE_FFN_BASES:
        return ROLE_DENSE_FFN
    return ROLE_OTHER


_F32_BASES = frozenset({"ffn_gate_inp", "ffn_gate_inp_shexp",
                        "ssm_conv1d", "ssm_conv1d_q", "ssm_conv1d_k", "ssm_conv1d_v"})


def converter_keeps_f32(name: str, n_dims: int) -> bool:
    """True for tensors llama.cpp's converter always writes as F32, whatever the file type.

    Its rules (conversion/base.py) for the tensors K3 and its drafts have: every 1-D tensor,
    every `*_norm.weight`, the router (ffn_gate_inp), the KDA conv kernels, and every tensor
    whose name does not end in `.weight` (ssm_a, ssm_dt.bias, exp_probs_b.bias, d2t, ...).
    A converter or requantizer that writes these as anything else makes a different file.
    """
    if n_dims <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return True
    return _base(name) in _F32_BASES


def is_trunk_matrix(name: str, n_dims: int) -> bool:
    """True for trunk weight matrices: the tensors a trunk requant (Q8_0 -> Q4_K) may rewrite.

    Trunk roles with 2-D (or 3-D per-head stacks: MLA's attn_k_b / attn_v_b) weights;
    KDA's causal conv kernels are excluded (llama.cpp keeps them F32, they feed a MUL).
    """
    if n_dims < 2 or "conv1d" in _base(name):
        return False
    return role_of(name, n_dims) in TRUNK_ROLES


class _NamedTensor(Protocol):
    """What trunk_matrices needs of a tensor (TensorInfo, TensorSpec, ...)."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def trunk_matrices(tensors: Iterable[_NamedTensor]) -> list[str]:
    """Names of the trunk matrices among `tensors` (objects with .name and .shape), in order."""
    return [t.name for t in tensors if is_trunk_matrix(t.name, len(t.shape))]
