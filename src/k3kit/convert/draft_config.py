"""The DFlash / DSpark draft config, torch-free: read from an HF config.json or from `dflash`
GGUF metadata, checked once, and written back as the KVs llama.cpp reads.

One parser, one set of bounds and one KV writer for every user: the converter
(k3kit.convert.draft), the legacy-draft fixer (draft_fix) and the torch network
(k3kit.models.dflash, whose DraftConfig is built from a DraftSpec). Config values are
untrusted: every width, count and id is bounded before anything is allocated from it.

config.json forms (as llama.cpp's conversion/qwen.py reads them): flat Qwen3-style keys with
`dflash_config {block_size, target_layer_ids, mask_token_id}`, the same keys at the top level,
or the speculators / EAGLE3 form (`transformer_layer_config`, taps counted from 1 in
`aux_hidden_state_layer_ids`, no sampling from the anchor by default). Tap ids are HF ids: the
output of target layer i; GGUF's `dflash.target_layers` holds i + 1 (llama.cpp reads the
INPUT of layer i + 1, which is the same hidden state).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from gguf import Keys

from k3kit.errors import ConvertError
from k3kit.gguf.format import (
    ARCH_DFLASH,
    ARR,
    ATT,
    BOOL,
    F32,
    I32,
    KEY_BLOCK_SIZE,
    KEY_HAS_CONFIDENCE_HEAD,
    KEY_MASK_TOKEN_ID,
    KEY_SAMPLE_FROM_ANCHOR,
    KEY_TARGET_LAYERS,
    LLM,
    ROPE,
    STR,
    U32,
)
from k3kit.gguf.reader import KV
from k3kit.gguf.writer import kv

# Bounds on what a (hostile) config may ask for.
MAX_DIM = 1 << 20           # any width or rank
MAX_LAYERS = 1024           # draft layers
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 24     # max_position_embeddings, YaRN's original context
MAX_TAPS = 64
MAX_BLOCK = 256
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh")     # what llama.cpp's dflash runs


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (the HF `rope_scaling` / `rope_parameters` block with type yarn).

    The optional values are None when the config does not give them: the converter writes only
    what was given (as llama.cpp's converter does), the network uses YaRN's defaults (beta_fast
    32, beta_slow 1) in their place. mscale, mscale_all_dim and truncate shape the torch
    network's frequencies and magnitude; GGUF has no keys for them.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float | None = None
    beta_slow: float | None = None
    ext_factor: float | None = None         # HF extrapolation_factor
    attention_factor: float | None = None   # explicit cos/sin magnitude (HF attention_factor / attn_factor)
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


@dataclass(frozen=True)
class DraftNet:
    """The fields that shape a DFlash/DSpark draft network (k3kit.models.dflash.DraftConfig
    is this plus its constructors; two equal DraftNets build the same network)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]   # HF convention: output of layer i (GGUF stores i + 1)
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_dim: int | None = None         # rotary dims per head (None: all of head_dim)
    target_hidden_size: int | None = None   # width of one tap (None: hidden_size)
    markov_rank: int = 0                # 0: plain DFlash, no Markov head
    has_confidence: bool = False
    confidence_with_markov: bool = True  # confidence input [h ; W1[x_prev]] (llama.cpp) or just h
    sample_from_anchor: bool = True     # DSpark: every block row (row 0 too) is a proposal
    embedding_scale: float | None = None        # multiplies the borrowed token embeddings
    logit_scale: float | None = None            # HF output_multiplier, on the base logits
    final_logit_softcapping: float | None = None

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def tap_width(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def n_proposals(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1


@dataclass(frozen=True)
class DraftSpec(DraftNet):
    """A draft as its config describes it: the network's fields, then what the file says beyond
    the network (None: not stated)."""

    context_length: int | None = None   # max_position_embeddings
    num_target_layers: int | None = None
    hidden_act: str = "silu"
    causal: bool | None = None


# ---------------------------------------------------------------- checks


def _bad(where: object, msg: str) -> ConvertError:
    return ConvertError(f"{where}: {msg}")


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v: object, key: str, where: object, lo: int, hi: int) -> int:
    if not _is_int(v) or not lo <= v <= hi:
        raise _bad(where, f"{key}={v!r} must be an integer in [{lo}, {hi}]")
    return v


def _num(v: object, key: str, where: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _bad(where, f"{key}={v!r} must be a finite number")
    return float(v)


def validate(s: DraftSpec, where: object = "draft config") -> DraftSpec:
    """Every bound on a draft, whichever way it was read; returns `s`."""
    for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
        _int(getattr(s, name), name, where, 1, MAX_DIM)
    if s.target_hidden_size is not None:
        _int(s.target_hidden_size, "target_hidden_size", where, 1, MAX_DIM)
    _int(s.num_layers, "num_layers", where, 1, MAX_LAYERS)
    _int(s.vocab_size, "vocab_size", where, 1, MAX_VOCAB)
    _int(s.block_size, "block_size", where, 1, MAX_BLOCK)
    _int(s.markov_rank, "markov_rank", where, 0, MAX_DIM)
    if s.num_heads % s.num_kv_heads:
        raise _bad(where, f"num_attention_heads={s.num_heads} is not a multiple of "
                          f"num_key_value_heads={s.num_kv_heads}")
    if not s.sample_from_anchor and s.block_size < 2:
        raise _bad(where, "block_size must be >= 2 when row 0 is not a proposal")
    ids = s.target_layer_ids
    # -1 is the embedding output (DeepSpec convention); GGUF stores i + 1 = 0
    if not 0 < len(ids) <= MAX_TAPS or not all(_is_int(i) and -1 <= i < MAX_DIM for i in ids):
        raise _bad(where, f"target_layer_ids={list(ids)!r} must be a non-empty list of at most "
                          f"{MAX_TAPS} layer ids >= -1")
    if not _is_int(s.mask_token_id) or not 0 <= s.mask_token_id < s.vocab_size:
        raise _bad(where, f"mask_token_id={s.mask_token_id!r} must be a token id below "
                          f"vocab_size={s.vocab_size}")
    if s.has_confidence and s.confidence_with_markov and not s.markov_rank:
        raise _bad(where, "a confidence head over [h ; W1[x_prev]] (confidence_head_with_markov) "
                          "needs markov_rank > 0")
    rd = s.head_dim if s.rope_dim is None else s.rope_dim
    if not _is_int(rd) or rd <= 0 or rd % 2 or rd > s.head_dim:
        raise _bad(where, f"{rd} rotary dims: must be even and in (0, head_dim={s.head_dim}]")
    for name in ("rms_norm_eps", "rope_theta"):
        if not _num(getattr(s, name), name, where) > 0:
            raise _bad(where, "rms_norm_eps and rope_theta must be positive")
    for name in ("embedding_scale", "logit_scale", "final_logit_softcapping"):
        v = getattr(s, name)
        if v is not None and not _num(v, name, where) >= 0:
            raise _bad(where, f"{name}={v!r} must be a finite non-negative number")
    ys = s.rope_scaling
    if ys is not None:
        if not _num(ys.factor, "rope factor", where) > 0:
            raise _bad(where, f"yarn rope factor={ys.factor!r} must be positive")
        _int(ys.original_max_position_embeddings, "original_max_position_embeddings", where, 1, MAX_POSITIONS)
    if s.context_length is not None:
        _int(s.context_length, "max_position_embeddings", where, 1, MAX_POSITIONS)
    if s.num_target_layers is not None:
        _int(s.num_target_layers, "num_target_layers", where, 1, MAX_DIM)
    if s.hidden_act not in HIDDEN_ACTS:
        raise _bad(where, f"hidden_act={s.hidden_act!r} is not one llama.cpp's dflash runs")
    return s


# ---------------------------------------------------------------- config.json


def parse_config(cfg: object, where: str | Path = "config.json") -> DraftSpec:
    """DraftSpec from an HF DFlash/DSpark config.json (flat, `dflash_config` or speculators form).

    Refuses what neither llama.cpp's dflash nor k3kit's network runs (biases, sliding windows,
    interleaved rope, reduced vocabularies, rope types other than default and yarn)."""
    if not isinstance(cfg, dict):
        raise _bad(where, "config.json must hold an object")
    # speculators/EAGLE3-style exports nest the transformer and count taps from 1 (qwen.py)
    anchor_default = "transformer_layer_config" not in cfg and "aux_hidden_state_layer_ids" not in cfg
    if isinstance(cfg.get("transformer_layer_config"), dict):
        cfg = {**cfg, **cfg["transformer_layer_config"]}
    dcfg = cfg.get("dflash_config", {})
    if not isinstance(dcfg, dict):
        raise _bad(where, "dflash_config must be an object")
    if "aux_hidden_state_layer_ids" in cfg and "target_layer_ids" not in dcfg:
        aux = cfg["aux_hidden_state_layer_ids"]
        if not isinstance(aux, list):
            raise _bad(where, "aux_hidden_state_layer_ids must be a list")
        dcfg = {**dcfg, "target_layer_ids": [i - 1 if isinstance(i, int) else i for i in aux]}

    def pick(key: str, default: Any = None) -> Any:
        return dcfg.get(key, cfg.get(key, default))

    def need(key: str, default: Any = ...) -> Any:
        v = cfg.get(key, default)
        if v is ...:
            raise _bad(where, f"missing {key}")
        return v

    if cfg.get("attention_bias"):
        raise _bad(where, "attention_bias=true has no place in llama.cpp's dflash tensors")
    if str(cfg.get("markov_head_type", "vanilla")) != "vanilla":
        raise _bad(where, f"markov_head_type={cfg['markov_head_type']!r} (only 'vanilla' is supported)")
    layer_types = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") or dcfg.get("use_swa") or (
            isinstance(layer_types, list) and "sliding_attention" in layer_types):
        raise _bad(where, "sliding-window draft layers are not supported")
    if cfg.get("rope_is_neox_style") is False:
        raise _bad(where, "interleaved (non-NeoX) rope checkpoints are not supported")
    draft_vocab = cfg.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != cfg.get("vocab_size"):
        raise _bad(where, f"draft_vocab_size={draft_vocab} (a reduced vocabulary with d2t) is not supported")

    hidden = _int(need("hidden_size"), "hidden_size", where, 1, MAX_DIM)
    heads = _int(need("num_attention_heads"), "num_attention_heads", where, 1, MAX_DIM)
    kv_heads = _int(need("num_key_value_heads", heads), "num_key_value_heads", where, 1, MAX_DIM)
    head_dim = _int(cfg.get("head_dim") or hidden // heads, "head_dim", where, 1, MAX_DIM)

    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise _bad(where, "rope_parameters must be an object")
    theta = _num(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta", where)
    rope_type = rope.get("rope_type", rope.get("type"))
    scaling = None
    if rope_type == "yarn":
        if "factor" not in rope or "original_max_position_embeddings" not in rope:
            raise _bad(where, "yarn rope needs factor and original_max_position_embeddings")

        def opt_rope(*keys: str) -> float | None:
            for k in keys:
                if rope.get(k) is not None:
                    return _num(rope[k], k, where)
            return None

        scaling = YarnScaling(
            factor=_num(rope["factor"], "rope factor", where),
            original_max_position_embeddings=_int(
                rope["original_max_position_embeddings"], "original_max_position_embeddings", where,
                1, MAX_POSITIONS),
            beta_fast=opt_rope("beta_fast"), beta_slow=opt_rope("beta_slow"),
            ext_factor=opt_rope("extrapolation_factor"),
            attention_factor=opt_rope("attention_factor", "attn_factor"),
            mscale=opt_rope("mscale") or 0.0, mscale_all_dim=opt_rope("mscale_all_dim") or 0.0,
            truncate=bool(rope.get("truncate", True)))
    elif rope_type not in (None, "default", "none"):
        raise _bad(where, f"rope_type={rope_type!r} is not supported (default or yarn)")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    rope_dim = None if partial is None else int(head_dim * _num(partial, "partial_rotary_factor", where))
    if rope_dim is not None and (rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim):
        raise _bad(where, f"partial_rotary_factor={partial} gives {rope_dim} rotary dims "
                          f"(must be even and in (0, head_dim={head_dim}])")

    ids = pick("target_layer_ids")
    if not isinstance(ids, list):
        raise _bad(where, f"target_layer_ids={ids!r} must be a non-empty list of layer ids")
    mask = pick("mask_token_id")
    if mask is None:
        raise _bad(where, "needs target_layer_ids and mask_token_id (mask_token_id is missing)")

    def opt(key: str) -> float | None:
        v = pick(key)
        return None if v is None else _num(v, key, where)

    def opt_int(key: str) -> int | None:
        v = cfg.get(key)
        return None if v is None else _int(v, key, where, 1, MAX_DIM)

    ctx = cfg.get("max_position_embeddings")
    causal = cfg.get("is_causal", dcfg.get("causal"))
    spec = DraftSpec(
        hidden_size=hidden,
        num_layers=_int(need("num_hidden_layers"), "num_hidden_layers", where, 1, MAX_LAYERS),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=_int(need("intermediate_size"), "intermediate_size", where, 1, MAX_DIM),
        vocab_size=_int(need("vocab_size"), "vocab_size", where, 1, MAX_VOCAB),
        block_size=_int(pick("block_size", 16), "block_size", where, 1, MAX_BLOCK),
        target_layer_ids=tuple(ids), mask_token_id=mask,
        rms_norm_eps=_num(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", where), rope_theta=theta,
        rope_scaling=scaling, rope_dim=rope_dim, target_hidden_size=opt_int("target_hidden_size"),
        markov_rank=_int(cfg.get("markov_rank", 0), "markov_rank", where, 0, MAX_DIM),
        has_confidence=bool(cfg.get("enable_confidence_head", cfg.get("has_confidence_head", False))),
        confidence_with_markov=bool(cfg.get("confidence_head_with_markov", True)),
        sample_from_anchor=bool(cfg.get("sample_from_anchor", anchor_default)),
        embedding_scale=opt("input_embedding_scale"), logit_scale=opt("output_multiplier"),
        final_logit_softcapping=opt("final_logit_softcapping"),
        context_length=None if ctx is None else _int(ctx, "max_position_embeddings", where, 1, MAX_POSITIONS),
        num_target_layers=opt_int("num_target_layers"),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        causal=None if causal is None else bool(causal),
    )
    return validate(spec, where)


# ---------------------------------------------------------------- GGUF metadata

A = ARCH_DFLASH


def _key(template: str) -> str:
    return template.format(arch=A)


def read_kvs(kvs: Mapping[str, Any], *, vocab_size: int, markov_rank: int = 0,
             target_hidden_size: int | None = None, confidence_with_markov: bool = True,
             where: object = "draft.gguf") -> DraftSpec:
    """DraftSpec from `dflash` GGUF metadata (plain values: arrays as lists). The vocabulary, the
    Markov rank and the confidence input width are not KVs: they come from tensor shapes
    (markov_w1 {r, V}; conf_proj {H + r, 1} or {H, 1})."""
    def get(template: str, default: Any = None, required: bool = False) -> Any:
        full = _key(template)
        if full not in kvs:
            if required:
                raise _bad(where, f"missing GGUF key {full!r}")
            return default
        return kvs[full]

    def opt(template: str) -> float | None:
        v = get(template)
        return None if v is None else float(v)

    def opt_int(template: str) -> int | None:
        v = get(template)
        return None if v is None else int(v)

    try:
        heads = int(get(ATT.HEAD_COUNT, required=True))
        hidden = int(get(LLM.EMBEDDING_LENGTH, required=True))
        scaling = None
        if get(ROPE.SCALING_TYPE) == "yarn":
            scaling = YarnScaling(
                factor=float(get(ROPE.SCALING_FACTOR, required=True)),
                original_max_position_embeddings=int(get(ROPE.SCALING_ORIG_CTX_LEN, required=True)),
                beta_fast=opt(ROPE.SCALING_YARN_BETA_FAST), beta_slow=opt(ROPE.SCALING_YARN_BETA_SLOW),
                ext_factor=opt(ROPE.SCALING_YARN_EXT_FACTOR),
                attention_factor=opt(ROPE.SCALING_YARN_ATTN_FACTOR))
        head_dim = int(get(ATT.KEY_LENGTH, hidden // heads))
        rope_dim = int(get(ROPE.DIMENSION_COUNT, head_dim))
        if KEY_MASK_TOKEN_ID not in kvs:
            raise _bad(where, f"missing GGUF key {KEY_MASK_TOKEN_ID!r}")
        spec = DraftSpec(
            hidden_size=hidden,
            num_layers=int(get(LLM.BLOCK_COUNT, required=True)),
            num_heads=heads,
            num_kv_heads=int(get(ATT.HEAD_COUNT_KV, heads)),
            head_dim=head_dim,
            intermediate_size=int(get(LLM.FEED_FORWARD_LENGTH, required=True)),
            vocab_size=int(vocab_size),
            block_size=int(get(KEY_BLOCK_SIZE, 16)),
            target_layer_ids=tuple(int(i) - 1 for i in get(KEY_TARGET_LAYERS, required=True)),
            mask_token_id=int(kvs[KEY_MASK_TOKEN_ID]),
            rms_norm_eps=float(get(ATT.LAYERNORM_RMS_EPS, required=True)),
            rope_theta=float(get(ROPE.FREQ_BASE, 10000.0)),
            rope_scaling=scaling,
            rope_dim=None if rope_dim == head_dim else rope_dim,
            target_hidden_size=target_hidden_size,
            markov_rank=int(markov_rank),
            has_confidence=bool(get(KEY_HAS_CONFIDENCE_HEAD, False)),
            confidence_with_markov=confidence_with_markov,
            sample_from_anchor=bool(get(KEY_SAMPLE_FROM_ANCHOR, True)),
            embedding_scale=opt(LLM.EMBEDDING_SCALE),
            logit_scale=opt(LLM.LOGIT_SCALE),
            final_logit_softcapping=opt(LLM.FINAL_LOGIT_SOFTCAPPING),
            context_length=opt_int(LLM.CONTEXT_LENGTH),
            causal=None if get(ATT.CAUSAL) is None else bool(get(ATT.CAUSAL)),
        )
    except ConvertError:
        raise
    except (TypeError, ValueError) as e:
        raise _bad(where, f"bad draft metadata ({type(e).__name__}: {e})") from None
    return validate(spec, where)


def write_kvs(s: DraftSpec, *, name: str | None = None, file_type: int | None = None,
              tokenizer: Sequence[KV] = ()) -> list[KV]:
    """The `dflash` KVs llama.cpp reads (llama-model.cpp generic hparams + dflash.cpp), in the
    order and with the value types llama.cpp's converter writes them.

    `name` adds general.architecture and general.name in front, `file_type` the file type and
    quantization version; `tokenizer` (the target's tokenizer.* KVs) goes before the mask id.
    Optional keys appear only when the config states them (context length, causal, the YaRN
    values, a partial rotary width, the scales) or, for the DSpark keys, when the draft has a
    Markov head or differs from llama.cpp's defaults (sample from the anchor, no confidence).
    """
    out: list[KV] = []
    if name is not None:
        out += [kv(Keys.General.ARCHITECTURE, STR, A), kv(Keys.General.NAME, STR, name)]
    out.append(kv(_key(LLM.BLOCK_COUNT), U32, s.num_layers))
    if s.context_length is not None:
        out.append(kv(_key(LLM.CONTEXT_LENGTH), U32, s.context_length))
    out += [kv(_key(LLM.EMBEDDING_LENGTH), U32, s.hidden_size),
            kv(_key(LLM.FEED_FORWARD_LENGTH), U32, s.intermediate_size),
            kv(_key(ATT.HEAD_COUNT), U32, s.num_heads),
            kv(_key(ATT.HEAD_COUNT_KV), U32, s.num_kv_heads)]
    if s.causal is not None:
        out.append(kv(_key(ATT.CAUSAL), BOOL, s.causal))
    ys = s.rope_scaling
    if ys is not None:
        out += [kv(_key(ROPE.SCALING_TYPE), STR, "yarn"),
                kv(_key(ROPE.SCALING_FACTOR), F32, ys.factor),
                kv(_key(ROPE.SCALING_ORIG_CTX_LEN), U32, ys.original_max_position_embeddings)]
        for template, val in ((ROPE.SCALING_YARN_EXT_FACTOR, ys.ext_factor),
                              (ROPE.SCALING_YARN_ATTN_FACTOR, ys.attention_factor),
                              (ROPE.SCALING_YARN_BETA_FAST, ys.beta_fast),
                              (ROPE.SCALING_YARN_BETA_SLOW, ys.beta_slow)):
            if val is not None:
                out.append(kv(_key(template), F32, val))
    out += [kv(_key(ROPE.FREQ_BASE), F32, s.rope_theta),
            kv(_key(ATT.LAYERNORM_RMS_EPS), F32, s.rms_norm_eps),
            kv(_key(ATT.KEY_LENGTH), U32, s.head_dim),
            kv(_key(ATT.VALUE_LENGTH), U32, s.head_dim)]
    if file_type is not None:
        out += [kv(Keys.General.FILE_TYPE, U32, int(file_type)),
                kv(Keys.General.QUANTIZATION_VERSION, U32, 2)]
    if s.rope_dim is not None:
        out.append(kv(_key(ROPE.DIMENSION_COUNT), U32, s.rope_dim))
    out.append(kv(_key(KEY_BLOCK_SIZE), U32, s.block_size))
    for template, val in ((LLM.LOGIT_SCALE, s.logit_scale),
                          (LLM.FINAL_LOGIT_SOFTCAPPING, s.final_logit_softcapping),
                          (LLM.EMBEDDING_SCALE, s.embedding_scale)):
        if val is not None and (template != LLM.FINAL_LOGIT_SOFTCAPPING or val > 0):
            out.append(kv(_key(template), F32, val))
    # llama.cpp reads the INPUT of layer i+1, which is the output of HF layer i
    out.append(kv(_key(KEY_TARGET_LAYERS), ARR, [i + 1 for i in s.target_layer_ids], I32))
    if s.markov_rank or s.has_confidence or not s.sample_from_anchor:   # DSpark keys (qwen.py DSparkModel)
        out.append(kv(_key(KEY_SAMPLE_FROM_ANCHOR), BOOL, s.sample_from_anchor))
        out.append(kv(_key(KEY_HAS_CONFIDENCE_HEAD), BOOL, s.has_confidence))
    out += tokenizer
    out.append(kv(KEY_MASK_TOKEN_ID, U32, s.mask_token_id))
    return out


def target_layers_kv(hf_ids: Sequence[int]) -> KV:
    """`dflash.target_layers` for HF tap ids (stored as id + 1)."""
    return kv(_key(KEY_TARGET_LAYERS), ARR, [i + 1 for i in hf_ids], I32)
