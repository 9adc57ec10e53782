"""`k3kit draft convert`: a DFlash/DSpark safetensors draft -> a llama.cpp `dflash` GGUF.

Config-driven: every dimension, the taps, the block size, the mask token, RoPE/YaRN and the RMS
epsilon come from config.json (as llama.cpp's conversion/qwen.py reads them), never from
constants. Names come from a family mapping file (convert/draft_mapping.py). Before anything is
written, every source tensor must map to exactly one GGUF tensor with the shape llama.cpp's
`dflash` loader creates (src/models/dflash.cpp), and every expected tensor must be present;
otherwise a ConvertError names the tensor and no output appears.

The draft owns no vocabulary: the tokenizer KVs are copied from the target GGUF, and
`tokenizer.ggml.mask_token_id` comes from the draft config (llama.cpp's speculative.cpp fills
the block with it). Tensors stream one row chunk at a time from the safetensors bytes (BF16
widened by bit shifts, no torch) into the atomic writer; the report then re-reads sampled rows
of the written file to measure what quantization cost.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType

from k3kit.convert.checkpoint import Checkpoint, TensorEntry, read_json
from k3kit.convert.draft_mapping import Mapping, detect_family, load_mapping
from k3kit.errors import ConvertError
from k3kit.gguf import quants
from k3kit.gguf.format import ARCH_DFLASH, KEY_MASK_TOKEN_ID, check_kv_types, converter_keeps_f32
from k3kit.gguf.reader import KV, GGUFFile
from k3kit.gguf.shards import Model
from k3kit.gguf.writer import TensorSpec, kv, write_gguf
from k3kit.progress import byte_progress

T = GGMLQuantizationType
U32, I32, F32, BOOL, STR, ARR = (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32,
                                 GGUFValueType.BOOL, GGUFValueType.STRING, GGUFValueType.ARRAY)
TYPES = {"Q8_0": T.Q8_0, "BF16": T.BF16, "F32": T.F32}
FILE_TYPES = {T.Q8_0: LlamaFileType.MOSTLY_Q8_0, T.BF16: LlamaFileType.MOSTLY_BF16,
              T.F32: LlamaFileType.ALL_F32}
CHUNK_BYTES = 32 << 20          # float32 bytes of source rows converted at a time
DEFAULT_SAMPLE_ROWS = 64
_MAX_DIM = 1 << 24


# ---------------------------------------------------------------- config


@dataclass(frozen=True)
class DraftSpec:
    """What config.json says about the draft, normalised the way llama.cpp's converter does."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context_length: int
    rms_eps: float
    rope_theta: float
    rope_dim: int | None
    rope_scaling: dict[str, float | int] | None   # GGUF key suffix -> value, yarn only
    block_size: int
    target_layer_ids: tuple[int, ...]                # HF ids: output of target layer i
    mask_token_id: int
    markov_rank: int
    confidence: bool
    confidence_with_markov: bool
    sample_from_anchor: bool
    num_target_layers: int | None
    target_hidden: int | None
    logit_scale: float | None
    softcap: float | None
    embedding_scale: float | None
    causal: bool | None


def _int(cfg: dict, key: str, where: Path, default: object = ..., lo: int = 1) -> int:
    v = cfg.get(key, default)
    if v is ...:
        raise ConvertError(f"{where}: missing {key}")
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= _MAX_DIM:
        raise ConvertError(f"{where}: {key}={v!r} must be an integer in [{lo}, {_MAX_DIM}]")
    return v


def _num(v: object, key: str, where: Path) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ConvertError(f"{where}: {key}={v!r} must be a finite number")
    return float(v)


def parse_config(cfg: object, where: Path) -> DraftSpec:
    """DraftSpec from an HF DFlash/DSpark config.json (flat, `dflash_config` or speculators form)."""
    if not isinstance(cfg, dict):
        raise ConvertError(f"{where}: config.json must hold an object")
    # speculators/EAGLE3-style exports nest the transformer and count taps from 1 (qwen.py)
    anchor_default = "transformer_layer_config" not in cfg and "aux_hidden_state_layer_ids" not in cfg
    if isinstance(cfg.get("transformer_layer_config"), dict):
        cfg = {**cfg, **cfg["transformer_layer_config"]}
    dcfg = cfg.get("dflash_config", {})
    if not isinstance(dcfg, dict):
        raise ConvertError(f"{where}: dflash_config must be an object")
    if "aux_hidden_state_layer_ids" in cfg and "target_layer_ids" not in dcfg:
        aux = cfg["aux_hidden_state_layer_ids"]
        if not isinstance(aux, list):
            raise ConvertError(f"{where}: aux_hidden_state_layer_ids must be a list")
        dcfg = {**dcfg, "target_layer_ids": [i - 1 if isinstance(i, int) else i for i in aux]}

    def pick(key: str, default: object = None) -> object:
        return dcfg.get(key, cfg.get(key, default))

    if cfg.get("hidden_act", "silu") not in ("silu", "gelu", "gelu_pytorch_tanh"):
        raise ConvertError(f"{where}: hidden_act={cfg.get('hidden_act')!r} is not one llama.cpp's "
                           "dflash runs")
    if cfg.get("attention_bias"):
        raise ConvertError(f"{where}: attention_bias=true has no place in llama.cpp's dflash tensors")
    if str(cfg.get("markov_head_type", "vanilla")) != "vanilla":
        raise ConvertError(f"{where}: markov_head_type={cfg['markov_head_type']!r} "
                           "(only 'vanilla' is supported)")
    layer_types = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") or dcfg.get("use_swa") or (
            isinstance(layer_types, list) and "sliding_attention" in layer_types):
        raise ConvertError(f"{where}: sliding-window draft layers are not supported")
    if cfg.get("rope_is_neox_style") is False:
        raise ConvertError(f"{where}: interleaved (non-NeoX) rope checkpoints are not supported")
    draft_vocab = cfg.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != cfg.get("vocab_size"):
        raise ConvertError(f"{where}: draft_vocab_size={draft_vocab} (a reduced vocabulary with d2t) "
                           "is not supported")

    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv_heads = _int(cfg, "num_key_value_heads", where, heads)
    if heads % kv_heads:
        raise ConvertError(f"{where}: num_attention_heads={heads} is not a multiple of "
                           f"num_key_value_heads={kv_heads}")
    head_dim = cfg.get("head_dim") or hidden // heads
    head_dim = _int({"head_dim": head_dim}, "head_dim", where)
    vocab = _int(cfg, "vocab_size", where)

    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConvertError(f"{where}: rope_parameters must be an object")
    theta = _num(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta", where)
    rope_type = rope.get("rope_type", rope.get("type"))
    scaling = None
    if rope_type == "yarn":
        if "factor" not in rope or "original_max_position_embeddings" not in rope:
            raise ConvertError(f"{where}: yarn rope needs factor and original_max_position_embeddings")
        scaling = {"factor": _num(rope["factor"], "rope factor", where),
                   "original_context_length": _int(rope, "original_max_position_embeddings", where)}
        for src, dst in (("extrapolation_factor", "yarn_ext_factor"),
                         ("attention_factor", "yarn_attn_factor"), ("attn_factor", "yarn_attn_factor"),
                         ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if rope.get(src) is not None and dst not in scaling:
                scaling[dst] = _num(rope[src], src, where)
    elif rope_type not in (None, "default", "none"):
        raise ConvertError(f"{where}: rope_type={rope_type!r} is not supported (default or yarn)")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    rope_dim = None if partial is None else int(head_dim * _num(partial, "partial_rotary_factor", where))
    if rope_dim is not None and (rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim):
        raise ConvertError(f"{where}: partial_rotary_factor={partial} gives {rope_dim} rotary dims "
                           f"(must be even and in (0, head_dim={head_dim}])")

    eps = _num(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", where)
    if eps <= 0 or theta <= 0:
        raise ConvertError(f"{where}: rms_norm_eps and rope_theta must be positive")

    ids = pick("target_layer_ids")
    if (not isinstance(ids, list) or not 0 < len(ids) <= 256
            or not all(isinstance(i, int) and not isinstance(i, bool) and -1 <= i < _MAX_DIM for i in ids)):
        raise ConvertError(f"{where}: target_layer_ids={ids!r} must be a non-empty list of layer ids")
    mask = pick("mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab:
        raise ConvertError(f"{where}: mask_token_id={mask!r} must be a token id below vocab_size={vocab}")
    block = _int({"block_size": pick("block_size", 16)}, "block_size", where)
    if block > 256:
        raise ConvertError(f"{where}: block_size={block} out of range")
    markov = _int(cfg, "markov_rank", where, 0, lo=0)
    conf = bool(cfg.get("enable_confidence_head", cfg.get("has_confidence_head", False)))
    conf_markov = bool(cfg.get("confidence_head_with_markov", True))
    if conf and conf_markov and not markov:
        raise ConvertError(f"{where}: confidence_head_with_markov needs markov_rank > 0")
    n_target = cfg.get("num_target_layers")
    if n_target is not None:
        n_target = _int(cfg, "num_target_layers", where)
    t_hidden = cfg.get("target_hidden_size")
    if t_hidden is not None and t_hidden != hidden:
        # llama.cpp's dflash sizes fc's input as n_taps x the draft's own n_embd
        raise ConvertError(f"{where}: target_hidden_size={t_hidden} differs from hidden_size={hidden}; "
                           "llama.cpp's dflash needs taps of the draft's width")

    def opt(key: str) -> float | None:
        v = pick(key)
        return None if v is None else _num(v, key, where)

    causal = cfg.get("is_causal", dcfg.get("causal"))
    return DraftSpec(
        hidden=hidden, layers=_int(cfg, "num_hidden_layers", where), heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, intermediate=_int(cfg, "intermediate_size", where), vocab=vocab,
        context_length=_int(cfg, "max_position_embeddings", where), rms_eps=eps, rope_theta=theta,
        rope_dim=rope_dim, rope_scaling=scaling, block_size=block, target_layer_ids=tuple(ids),
        mask_token_id=mask, markov_rank=markov, confidence=conf, confidence_with_markov=conf_markov,
        sample_from_anchor=bool(cfg.get("sample_from_anchor", anchor_default)),
        num_target_layers=n_target, target_hidden=t_hidden, logit_scale=opt("output_multiplier"),
        softcap=opt("final_logit_softcapping"), embedding_scale=opt("input_embedding_scale"),
        causal=None if causal is None else bool(causal),
    )


def optional_shapes(s: DraftSpec) -> dict[str, tuple[int, ...]]:
    """Tensors a self-contained draft may carry (its own embedding / LM head); llama.cpp's loader
    takes them when present and borrows the target's otherwise."""
    return {"token_embd.weight": (s.hidden, s.vocab), "output.weight": (s.hidden, s.vocab)}


def expected_shapes(s: DraftSpec) -> dict[str, tuple[int, ...]]:
    """GGUF name -> ggml shape (ne0 first) of every tensor llama.cpp's dflash loader requires for
    this config (classic backbone; src/models/dflash.cpp load_arch_tensors)."""
    h, q, kvw, f = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate
    out: dict[str, tuple[int, ...]] = {
        "fc.weight": (len(s.target_layer_ids) * (s.target_hidden or h), h),
        "enc.output_norm.weight": (h,),
        "output_norm.weight": (h,),
    }
    for i in range(s.layers):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (h,), b + "attn_q.weight": (h, q), b + "attn_k.weight": (h, kvw),
                b + "attn_v.weight": (h, kvw), b + "attn_output.weight": (q, h),
                b + "attn_q_norm.weight": (s.head_dim,), b + "attn_k_norm.weight": (s.head_dim,),
                b + "ffn_norm.weight": (h,), b + "ffn_gate.weight": (h, f), b + "ffn_up.weight": (h, f),
                b + "ffn_down.weight": (f, h)}
    if s.markov_rank:
        out["markov_w1.weight"] = (s.markov_rank, s.vocab)
        out["markov_w2.weight"] = (s.markov_rank, s.vocab)
    if s.confidence:
        out["conf_proj.weight"] = (h + (s.markov_rank if s.confidence_with_markov else 0), 1)
        out["conf_proj.bias"] = (1,)
    return out


# ---------------------------------------------------------------- plan


@dataclass
class Planned:
    name: str                       # GGUF name
    entry: TensorEntry              # source
    shape: tuple[int, ...]          # ggml order
    ggml_type: GGMLQuantizationType
    note: str | None = None         # why it is not the requested type, when that is a fallback

    @property
    def row_len(self) -> int:
        return self.shape[0]

    @property
    def n_rows(self) -> int:
        return math.prod(self.shape[1:])


def plan_tensors(ckpt: Checkpoint, mapping: Mapping, spec: DraftSpec, want: GGMLQuantizationType,
                 source: Path) -> tuple[list[Planned], list[str]]:
    """Map, shape-check and type every source tensor; (planned tensors, dropped source names)."""
    required = expected_shapes(spec)
    expected = required | optional_shapes(spec)
    by_gguf: dict[str, str] = {}
    planned: list[Planned] = []
    dropped: list[str] = []
    for name, entry in ckpt.tensors.items():
        if mapping.is_dropped(name):
            dropped.append(name)
            continue
        hits = mapping.map_name(name)
        if len(hits) > 1:
            raise ConvertError(f"{entry.where}: matches {len(hits)} patterns of {mapping.path.name} "
                               f"({', '.join(h for h, _ in hits)})")
        if not hits:
            raise ConvertError(f"{entry.where}: unmapped (no pattern of {mapping.path.name} matches it)")
        gname, layer = hits[0]
        if layer is not None and layer >= spec.layers:
            raise ConvertError(f"{entry.where}: layer {layer} but num_hidden_layers={spec.layers}")
        if gname in by_gguf:
            raise ConvertError(f"{entry.where}: maps to {gname}, which {by_gguf[gname]!r} already maps to")
        by_gguf[gname] = name
        if gname not in expected:
            raise ConvertError(f"{entry.where}: maps to {gname}, which config.json does not call for "
                               "(check markov_rank / enable_confidence_head)")
        shape = tuple(reversed(entry.shape))
        if shape != expected[gname]:
            raise ConvertError(f"{entry.where}: shape {list(entry.shape)} does not match config.json "
                               f"(expected {list(reversed(expected[gname]))} for {gname})")
        if entry.dtype not in ("F32", "F16", "BF16"):
            raise ConvertError(f"{entry.where}: dtype {entry.dtype} is not a float type")
        planned.append(_typed(gname, entry, shape, want, mapping))
    missing = sorted(set(required) - set(by_gguf))
    if missing:
        raise ConvertError(f"{source}: missing {len(missing)} tensor(s) config.json calls for, first "
                           f"{missing[0]} (from {_source_name(mapping, missing[0])})")

    def order(p: Planned) -> tuple[int, int]:
        layer = int(p.name.split(".")[1]) if p.name.startswith("blk.") else -1
        return (layer, list(expected).index(p.name))

    planned.sort(key=order)
    return planned, dropped


def _source_name(mapping: Mapping, gname: str) -> str:
    for src, dst in mapping.tensors.items():
        if "{L}" in dst and gname.startswith("blk."):
            layer = gname.split(".")[1]
            if dst.replace("{L}", layer) == gname:
                return src.replace("{L}", layer)
        elif dst == gname:
            return src
    return "?"


def _typed(gname: str, entry: TensorEntry, shape: tuple[int, ...], want: GGMLQuantizationType,
           mapping: Mapping) -> Planned:
    """The output type: F32 for what llama.cpp's converter keeps F32 and the mapping's keep_f32,
    else --type; Q8_0 rows must be whole 32-blocks, else the tensor stays float (BF16 if the
    source is BF16, which is exact, else F32) and the report says why."""
    if converter_keeps_f32(gname, len(shape)) or gname in mapping.keep_f32:
        return Planned(gname, entry, shape, T.F32)
    if want == T.Q8_0 and shape[0] % 32:
        fb = T.BF16 if entry.dtype == "BF16" else T.F32
        return Planned(gname, entry, shape, fb, f"row length {shape[0]} is not a multiple of 32 (Q8_0 block)")
    return Planned(gname, entry, shape, want)


# ---------------------------------------------------------------- tensor bytes


def _read_rows(e: TensorEntry, row_len: int, r0: int, r1: int) -> np.ndarray:
    """Source rows [r0, r1) as float32 (r1-r0, row_len); BF16/F16 widen exactly."""
    size = {"F32": 4, "F16": 2, "BF16": 2}[e.dtype]
    n = (r1 - r0) * row_len * size
    try:
        with open(e.path, "rb") as f:
            data = os.pread(f.fileno(), n, e.offset + r0 * row_len * size)
    except OSError as err:
        raise ConvertError(f"{e.where}: cannot read ({err.strerror or err})") from None
    if len(data) != n:
        raise ConvertError(f"{e.where}: file shrank while reading")
    raw = np.frombuffer(data, dtype=np.uint8)
    if e.dtype == "F32":
        out = raw.view("<f4").astype(np.float32)
    elif e.dtype == "F16":
        out = raw.view("<f2").astype(np.float32)
    else:
        out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    return out.reshape(r1 - r0, row_len)


def _encode_rows(p: Planned, rows: np.ndarray) -> np.ndarray:
    return quants.quantize(rows, p.ggml_type).reshape(-1)


def _stream(p: Planned) -> Iterator[np.ndarray]:
    """The tensor's output bytes, a bounded chunk of rows at a time."""
    step = max(1, CHUNK_BYTES // (4 * p.row_len))
    for r0 in range(0, p.n_rows, step):
        r1 = min(p.n_rows, r0 + step)
        if p.ggml_type == T.BF16 and p.entry.dtype == "BF16":       # exact: copy the raw bytes
            n = (r1 - r0) * p.row_len * 2
            with open(p.entry.path, "rb") as f:
                data = os.pread(f.fileno(), n, p.entry.offset + r0 * p.row_len * 2)
            if len(data) != n:
                raise ConvertError(f"{p.entry.where}: file shrank while reading")
            yield np.frombuffer(data, dtype=np.uint8)
        else:
            yield _encode_rows(p, _read_rows(p.entry, p.row_len, r0, r1))


def _spec(p: Planned) -> TensorSpec:
    nbytes = quants.row_bytes(p.ggml_type, p.row_len) * p.n_rows
    return TensorSpec(p.name, p.shape, p.ggml_type, nbytes, lambda p=p: _stream(p))


# ---------------------------------------------------------------- metadata


def target_tokenizer(target: Path, spec: DraftSpec) -> tuple[list[KV], dict]:
    """The target's tokenizer KVs (mask id excluded) and facts about the target, checked against the draft."""
    with Model.open(target) as m:
        arch = m.arch
        toks = [v for k, v in m.kv.items() if k.startswith("tokenizer.") and k != KEY_MASK_TOKEN_ID]
        tokens = m.kv.get("tokenizer.ggml.tokens")
        n_layer = m.kv.get(f"{arch}.block_count")
        n_embd = m.kv.get(f"{arch}.embedding_length")
    if tokens is None or "tokenizer.ggml.model" not in {t.key for t in toks}:
        raise ConvertError(f"{target}: has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    if len(tokens.value) != spec.vocab:
        raise ConvertError(f"{target}: tokenizer has {len(tokens.value)} tokens but the draft's "
                           f"vocab_size is {spec.vocab}")
    facts = {"path": str(target), "arch": arch, "vocab": len(tokens.value),
             "block_count": None if n_layer is None else int(n_layer.value),
             "embedding_length": None if n_embd is None else int(n_embd.value)}
    nl = facts["block_count"]
    if nl is not None:
        if spec.num_target_layers is not None and spec.num_target_layers != nl:
            raise ConvertError(f"{target}: {nl} layers, but the draft was trained for "
                               f"num_target_layers={spec.num_target_layers}")
        bad = [i for i in spec.target_layer_ids if not 0 <= i + 1 <= nl]
        if bad:
            raise ConvertError(f"{target}: {nl} layers, draft taps target_layer_ids {bad} out of range")
    width = spec.target_hidden or spec.hidden
    if facts["embedding_length"] is not None and facts["embedding_length"] != width:
        raise ConvertError(f"{target}: embedding_length {facts['embedding_length']} but the draft's fc "
                           f"expects taps of width {width}")
    return toks, facts


def draft_kvs(spec: DraftSpec, name: str, ftype: LlamaFileType, tokenizer: list[KV]) -> list[KV]:
    """The `dflash` KVs llama.cpp reads (llama-model.cpp generic hparams + dflash.cpp), in the
    order and with the value types llama.cpp's converter writes them."""
    a = ARCH_DFLASH
    out = [kv("general.architecture", STR, a), kv("general.name", STR, name),
           kv(f"{a}.block_count", U32, spec.layers), kv(f"{a}.context_length", U32, spec.context_length),
           kv(f"{a}.embedding_length", U32, spec.hidden),
           kv(f"{a}.feed_forward_length", U32, spec.intermediate),
           kv(f"{a}.attention.head_count", U32, spec.heads),
           kv(f"{a}.attention.head_count_kv", U32, spec.kv_heads)]
    if spec.causal is not None:
        out.append(kv(f"{a}.attention.causal", BOOL, spec.causal))
    if spec.rope_scaling is not None:
        out.append(kv(f"{a}.rope.scaling.type", STR, "yarn"))
        for key, val in spec.rope_scaling.items():
            vtype = U32 if key == "original_context_length" else F32
            out.append(kv(f"{a}.rope.scaling.{key}", vtype, val))
    out += [kv(f"{a}.rope.freq_base", F32, spec.rope_theta),
            kv(f"{a}.attention.layer_norm_rms_epsilon", F32, spec.rms_eps),
            kv(f"{a}.attention.key_length", U32, spec.head_dim),
            kv(f"{a}.attention.value_length", U32, spec.head_dim),
            kv("general.file_type", U32, int(ftype)),
            kv("general.quantization_version", U32, 2)]
    if spec.rope_dim is not None:
        out.append(kv(f"{a}.rope.dimension_count", U32, spec.rope_dim))
    out.append(kv(f"{a}.block_size", U32, spec.block_size))
    for key, val in (("logit_scale", spec.logit_scale), ("final_logit_softcapping", spec.softcap),
                     ("embedding_scale", spec.embedding_scale)):
        if val is not None and (key != "final_logit_softcapping" or val > 0):
            out.append(kv(f"{a}.{key}", F32, val))
    # llama.cpp reads the INPUT of layer i+1, which is the output of HF layer i
    out.append(kv(f"{a}.target_layers", ARR, [i + 1 for i in spec.target_layer_ids], I32))
    if spec.markov_rank:                                   # DSpark keys (qwen.py DSparkModel)
        out.append(kv(f"{a}.sample_from_anchor", BOOL, spec.sample_from_anchor))
        out.append(kv(f"{a}.has_confidence_head", BOOL, spec.confidence))
    out += tokenizer
    out.append(kv(KEY_MASK_TOKEN_ID, U32, spec.mask_token_id))
    return out


# ---------------------------------------------------------------- report


@dataclass
class DraftReport:
    source: str
    family: str
    mapping: str
    target: dict
    output: str
    source_files: list[str]
    source_file_bytes: int
    source_tensor_bytes: int
    source_tensors: int
    source_dtypes: dict[str, int]
    mapped_tensors: int
    dropped_tensors: list[str]
    parameters: int                     # elements of all source tensors
    mapped_parameters: int              # elements written (what llama.cpp counts as n_params)
    output_bytes: int
    ratio: float
    requested_type: str
    type_counts: dict[str, int]
    fallbacks: list[dict]
    sample_rows: int
    rmse: dict[str, float]              # gguf name -> sampled relative RMSE
    rmse_rms: float                     # over the tensors whose conversion is lossy
    rmse_max: float
    rmse_max_tensor: str | None
    lossy_tensors: int
    output_sha256: str
    kvs: int
    seconds: float
    config: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        """The human form: the figures first, then one line per tensor."""
        gb = 1e9
        types = ", ".join(f"{n} {t}" for t, n in self.type_counts.items())
        dtypes = ", ".join(f"{n} {d}" for d, n in self.source_dtypes.items())
        mp = self.mapped_parameters
        written = "" if mp == self.parameters else f" ({mp:,} written)"
        lines = [
            f"draft {self.source} ({self.family}) -> {self.output}",
            f"  source tensors     {self.source_tensors} ({dtypes})",
            f"  mapped tensors     {self.mapped_tensors}" + (f" (dropped: {', '.join(self.dropped_tensors)})"
                                                             if self.dropped_tensors else ""),
            f"  parameters         {self.parameters:,}" + written,
            f"  bytes              {self.source_file_bytes:,} -> {self.output_bytes:,} "
            f"({self.ratio * 100:.2f}%, {self.source_file_bytes / gb:.3f} -> "
            f"{self.output_bytes / gb:.3f} GB)",
            f"  types              {types} (requested {self.requested_type})",
            f"  sampled rel. RMSE  RMS {self.rmse_rms:.8f}, max {self.rmse_max:.8f}"
            + (f" ({self.rmse_max_tensor})" if self.rmse_max_tensor else "")
            + f" over {self.lossy_tensors} lossy tensors, {self.sample_rows} rows each",
            f"  output SHA256      {self.output_sha256}",
        ]
        for fb in self.fallbacks:
            lines.append(f"  kept {fb['type']}: {fb['tensor']}: {fb['reason']}")
        lines.append(f"  {'tensor':<36} {'type':<6} {'shape':<18} rel. RMSE")
        for name, err in self.rmse.items():
            lines.append(f"  {name:<36} {self.config['types'][name]:<6} "
                         f"{str(self.config['shapes'][name]):<18} {err:.8f}")
        return "\n".join(lines)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _sampled_rmse(out: GGUFFile, planned: list[Planned], n_rows: int) -> dict[str, float]:
    """Relative RMSE of sampled rows: the WRITTEN bytes dequantized vs the source floats."""
    infos = {t.name: t for t in out.tensors}
    result = {}
    for p in planned:
        t = infos[p.name]
        rb = quants.row_bytes(t.ggml_type, p.row_len)
        raw = out.view(t)
        rows = np.unique(np.linspace(0, p.n_rows - 1, min(p.n_rows, n_rows)).round().astype(np.int64))
        err2 = ref2 = 0.0
        for r in rows:
            got = quants.dequantize(raw[r * rb:(r + 1) * rb], t.ggml_type, p.row_len).astype(np.float64)
            ref = _read_rows(p.entry, p.row_len, int(r), int(r) + 1)[0].astype(np.float64)
            diff = got - ref
            err2 += float((diff * diff).sum())     # not np.dot: BLAS threads on a busy box cost 60 ms a row
            ref2 += float((ref * ref).sum())
        result[p.name] = math.sqrt(err2 / ref2) if ref2 > 0 else (0.0 if err2 == 0 else math.inf)
    return result


def _lossless(p: Planned) -> bool:
    return p.ggml_type == T.F32 or (p.ggml_type == T.BF16 and p.entry.dtype == "BF16")


# ---------------------------------------------------------------- entry point


def convert_draft(src_dir: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike, *,
                  out_type: str = "Q8_0", mapping: str | None = None,
                  sample_rows: int = DEFAULT_SAMPLE_ROWS, progress: bool = True) -> DraftReport:
    """Convert the draft in `src_dir` against the target GGUF `target` into `out` (atomic)."""
    t0 = time.perf_counter()
    src_dir, target, out = Path(src_dir), Path(target), Path(out)
    want = TYPES.get(out_type.upper())
    if want is None:
        raise ConvertError(f"--type {out_type}: choose one of {', '.join(TYPES)}")
    if not 1 <= sample_rows <= 1 << 20:
        raise ConvertError(f"--sample-rows {sample_rows}: out of range")
    if not src_dir.is_dir():
        raise ConvertError(f"{src_dir}: not a directory")
    cfg_path = src_dir / "config.json"
    raw_cfg = read_json(cfg_path, "config")
    spec = parse_config(raw_cfg, cfg_path)
    ckpt = Checkpoint(src_dir)
    fam = load_mapping(mapping) if mapping else detect_family(raw_cfg, set(ckpt.tensors), cfg_path)
    planned, dropped = plan_tensors(ckpt, fam, spec, want, ckpt.source)
    if any(out.exists() and out.samefile(p) for p in {e.path for e in ckpt.tensors.values()} | {target}):
        raise ConvertError(f"{out}: output would overwrite an input")
    tokenizer, tfacts = target_tokenizer(target, spec)
    kvs = draft_kvs(spec, src_dir.resolve().name, FILE_TYPES[want], tokenizer)
    problems = check_kv_types(ARCH_DFLASH, {k.key: k for k in kvs})
    if problems:        # a bug here, not user input: llama.cpp would refuse the file
        raise AssertionError(f"draft KVs llama.cpp would reject: {problems}")
    specs = [_spec(p) for p in planned]
    with byte_progress("draft convert", sum(s.nbytes for s in specs), enabled=progress) as bar:
        write_gguf(out, kvs, specs, progress=bar)

    f = GGUFFile.open(out)
    try:
        rmse = _sampled_rmse(f, planned, sample_rows)
    finally:
        f.close()
    lossy = {p.name: rmse[p.name] for p in planned if not _lossless(p)}
    worst = max(lossy, key=lossy.get) if lossy else None
    counts: dict[str, int] = {}
    for p in planned:
        counts[p.ggml_type.name] = counts.get(p.ggml_type.name, 0) + 1
    dtypes: dict[str, int] = {}
    for e in ckpt.tensors.values():
        dtypes[e.dtype] = dtypes.get(e.dtype, 0) + 1
    files = sorted({e.path for e in ckpt.tensors.values()})
    file_bytes = sum(p.stat().st_size for p in files)
    out_bytes = out.stat().st_size
    return DraftReport(
        source=str(src_dir), family=fam.family, mapping=str(fam.path), target=tfacts, output=str(out),
        source_files=[str(p) for p in files], source_file_bytes=file_bytes,
        source_tensor_bytes=sum(e.nbytes for e in ckpt.tensors.values()), source_tensors=len(ckpt.tensors),
        source_dtypes=dtypes, mapped_tensors=len(planned), dropped_tensors=dropped,
        parameters=sum(math.prod(e.shape) for e in ckpt.tensors.values()),
        mapped_parameters=sum(math.prod(p.shape) for p in planned), output_bytes=out_bytes,
        ratio=out_bytes / file_bytes if file_bytes else 0.0, requested_type=want.name, type_counts=counts,
        fallbacks=[{"tensor": p.name, "type": p.ggml_type.name, "reason": p.note} for p in planned if p.note],
        sample_rows=sample_rows, rmse=rmse,
        rmse_rms=math.sqrt(sum(v * v for v in lossy.values()) / len(lossy)) if lossy else 0.0,
        rmse_max=lossy[worst] if worst else 0.0, rmse_max_tensor=worst, lossy_tensors=len(lossy),
        output_sha256=_sha256(out), kvs=len(kvs), seconds=round(time.perf_counter() - t0, 3),
        config={"types": {p.name: p.ggml_type.name for p in planned},
                "shapes": {p.name: list(p.shape) for p in planned},
                "spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(spec).items()}},
    )


def write_report(report: DraftReport, path: str | os.PathLike) -> Path:
    """The report as JSON, atomically (temp, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(report.to_dict(), fh, indent=2)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
