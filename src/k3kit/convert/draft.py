"""`k3kit draft convert`: a DFlash/DSpark safetensors draft -> a llama.cpp `dflash` GGUF.

Config-driven: every dimension, the taps, the block size, the mask token, RoPE/YaRN and the RMS
epsilon come from config.json (as llama.cpp's conversion/qwen.py reads them), never from
constants; k3kit.convert.draft_config parses it (the parser the torch network uses too) and
writes the `dflash` KVs. Names come from a family mapping file (convert/draft_mapping.py). Before anything is
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
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from k3kit._io import read_json, write_json
from k3kit.convert import draft_config
from k3kit.convert.checkpoint import Checkpoint, TensorEntry
from k3kit.convert.draft_config import DraftSpec
from k3kit.convert.draft_mapping import Mapping, detect_family, load_mapping
from k3kit.errors import ConvertError
from k3kit.gguf import quants
from k3kit.gguf.format import ARCH_DFLASH, KEY_MASK_TOKEN_ID, LLM, check_kv_types, converter_keeps_f32
from k3kit.gguf.reader import KV, GGUFFile
from k3kit.gguf.shards import Model
from k3kit.gguf.writer import TensorSpec, write_gguf
from k3kit.progress import byte_progress

T = GGMLQuantizationType
TYPES = {"Q8_0": T.Q8_0, "BF16": T.BF16, "F32": T.F32}
FILE_TYPES = {T.Q8_0: LlamaFileType.MOSTLY_Q8_0, T.BF16: LlamaFileType.MOSTLY_BF16,
              T.F32: LlamaFileType.ALL_F32}
CHUNK_BYTES = 32 << 20          # float32 bytes of source rows converted at a time
DEFAULT_SAMPLE_ROWS = 64


# ---------------------------------------------------------------- config


def parse_config(cfg: object, where: Path) -> DraftSpec:
    """DraftSpec from an HF DFlash/DSpark config.json (k3kit.convert.draft_config, the parser the
    network shares), plus what a llama.cpp dflash file needs beyond it: a context length, and
    taps of the draft's own width (llama.cpp's dflash sizes fc's input as n_taps x n_embd)."""
    spec = draft_config.parse_config(cfg, where)
    if spec.context_length is None:
        raise ConvertError(f"{where}: missing max_position_embeddings")
    t_hidden = spec.target_hidden_size
    if t_hidden is not None and t_hidden != spec.hidden_size:
        raise ConvertError(f"{where}: target_hidden_size={t_hidden} differs from hidden_size="
                           f"{spec.hidden_size}; llama.cpp's dflash needs taps of the draft's width")
    return spec


def _report_spec(s: DraftSpec) -> dict:
    """The config as the report has always stated it (the converter's own names)."""
    ys = s.rope_scaling
    scaling = None
    if ys is not None:
        scaling = {"factor": ys.factor, "original_context_length": ys.original_max_position_embeddings}
        for key, val in (("yarn_ext_factor", ys.ext_factor), ("yarn_attn_factor", ys.attention_factor),
                         ("yarn_beta_fast", ys.beta_fast), ("yarn_beta_slow", ys.beta_slow)):
            if val is not None:
                scaling[key] = val
    return {
        "hidden": s.hidden_size, "layers": s.num_layers, "heads": s.num_heads, "kv_heads": s.num_kv_heads,
        "head_dim": s.head_dim, "intermediate": s.intermediate_size, "vocab": s.vocab_size,
        "context_length": s.context_length, "rms_eps": s.rms_norm_eps, "rope_theta": s.rope_theta,
        "rope_dim": s.rope_dim, "rope_scaling": scaling, "block_size": s.block_size,
        "target_layer_ids": list(s.target_layer_ids), "mask_token_id": s.mask_token_id,
        "markov_rank": s.markov_rank, "confidence": s.has_confidence,
        "confidence_with_markov": s.confidence_with_markov, "sample_from_anchor": s.sample_from_anchor,
        "num_target_layers": s.num_target_layers, "target_hidden": s.target_hidden_size,
        "logit_scale": s.logit_scale, "softcap": s.final_logit_softcapping,
        "embedding_scale": s.embedding_scale, "causal": s.causal,
    }


def optional_shapes(s: DraftSpec) -> dict[str, tuple[int, ...]]:
    """Tensors a self-contained draft may carry (its own embedding / LM head); llama.cpp's loader
    takes them when present and borrows the target's otherwise."""
    h, v = s.hidden_size, s.vocab_size
    return {"token_embd.weight": (h, v), "output.weight": (h, v)}


def expected_shapes(s: DraftSpec) -> dict[str, tuple[int, ...]]:
    """GGUF name -> ggml shape (ne0 first) of every tensor llama.cpp's dflash loader requires for
    this config (classic backbone; src/models/dflash.cpp load_arch_tensors)."""
    h, q, kvw, f = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
    out: dict[str, tuple[int, ...]] = {
        "fc.weight": (len(s.target_layer_ids) * (s.target_hidden_size or h), h),
        "enc.output_norm.weight": (h,),
        "output_norm.weight": (h,),
    }
    for i in range(s.num_layers):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (h,), b + "attn_q.weight": (h, q), b + "attn_k.weight": (h, kvw),
                b + "attn_v.weight": (h, kvw), b + "attn_output.weight": (q, h),
                b + "attn_q_norm.weight": (s.head_dim,), b + "attn_k_norm.weight": (s.head_dim,),
                b + "ffn_norm.weight": (h,), b + "ffn_gate.weight": (h, f), b + "ffn_up.weight": (h, f),
                b + "ffn_down.weight": (f, h)}
    if s.markov_rank:
        out["markov_w1.weight"] = (s.markov_rank, s.vocab_size)
        out["markov_w2.weight"] = (s.markov_rank, s.vocab_size)
    if s.has_confidence:
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
        if layer is not None and layer >= spec.num_layers:
            raise ConvertError(f"{entry.where}: layer {layer} but num_hidden_layers={spec.num_layers}")
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
    return TensorSpec(p.name, p.shape, p.ggml_type, nbytes, partial(_stream, p))


# ---------------------------------------------------------------- metadata


def target_tokenizer(target: Path, spec: DraftSpec) -> tuple[list[KV], dict]:
    """The target's tokenizer KVs (mask id excluded) and facts about the target, checked against the draft."""
    with Model.open(target) as m:
        arch = m.arch
        toks = [v for k, v in m.kv.items() if k.startswith("tokenizer.") and k != KEY_MASK_TOKEN_ID]
        tokens = m.kv.get("tokenizer.ggml.tokens")
        n_layer = m.kv.get(LLM.BLOCK_COUNT.format(arch=arch))
        n_embd = m.kv.get(LLM.EMBEDDING_LENGTH.format(arch=arch))
    if tokens is None or "tokenizer.ggml.model" not in {t.key for t in toks}:
        raise ConvertError(f"{target}: has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    n_vocab = len(cast(list, tokens.value))
    if n_vocab != spec.vocab_size:
        raise ConvertError(f"{target}: tokenizer has {n_vocab} tokens but the draft's "
                           f"vocab_size is {spec.vocab_size}")
    facts: dict[str, Any] = {"path": str(target), "arch": arch, "vocab": n_vocab,
                             "block_count": None if n_layer is None else int(cast(int, n_layer.value)),
                             "embedding_length": None if n_embd is None else int(cast(int, n_embd.value))}
    nl = facts["block_count"]
    if nl is not None:
        if spec.num_target_layers is not None and spec.num_target_layers != nl:
            raise ConvertError(f"{target}: {nl} layers, but the draft was trained for "
                               f"num_target_layers={spec.num_target_layers}")
        bad = [i for i in spec.target_layer_ids if not 0 <= i + 1 <= nl]
        if bad:
            raise ConvertError(f"{target}: {nl} layers, draft taps target_layer_ids {bad} out of range")
    width = spec.target_hidden_size or spec.hidden_size
    if facts["embedding_length"] is not None and facts["embedding_length"] != width:
        raise ConvertError(f"{target}: embedding_length {facts['embedding_length']} but the draft's fc "
                           f"expects taps of width {width}")
    return toks, facts


def draft_kvs(spec: DraftSpec, name: str, ftype: LlamaFileType, tokenizer: list[KV]) -> list[KV]:
    """The file's KVs: the shared dflash writer with the general keys and the target's tokenizer."""
    return draft_config.write_kvs(spec, name=name, file_type=int(ftype), tokenizer=tokenizer)


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
                  sample_rows: int = DEFAULT_SAMPLE_ROWS, progress: bool = True,
                  name: str | None = None) -> DraftReport:
    """Convert the draft in `src_dir` against the target GGUF `target` into `out` (atomic); `name` is
    general.name (default: the directory's name)."""
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
    raw_cfg = read_json(cfg_path, "config", error=ConvertError)
    spec = parse_config(raw_cfg, cfg_path)
    ckpt = Checkpoint(src_dir)
    fam = load_mapping(mapping) if mapping else detect_family(raw_cfg, set(ckpt.tensors), cfg_path)
    planned, dropped = plan_tensors(ckpt, fam, spec, want, ckpt.source)
    if any(out.exists() and out.samefile(p) for p in {e.path for e in ckpt.tensors.values()} | {target}):
        raise ConvertError(f"{out}: output would overwrite an input")
    tokenizer, tfacts = target_tokenizer(target, spec)
    kvs = draft_kvs(spec, name or src_dir.resolve().name, FILE_TYPES[want], tokenizer)
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
    worst = max(lossy, key=lambda n: lossy[n]) if lossy else None
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
                "spec": _report_spec(spec)},
    )


def write_report(report: DraftReport, path: str | os.PathLike) -> Path:
    """The report as JSON, atomically."""
    return write_json(path, report.to_dict())
