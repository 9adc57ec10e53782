"""Random kimi-k3 GGUFs with real K3 geometry, written at disk speed.

Everything that reads, rewrites or serves a 1.4 TB model needs test inputs with the real
shapes, names, types and shard layout, and nobody can download the real one in CI. A
synthetic model has the exact tensor set llama.cpp's kimi-k3 loader creates (fewer layers
and experts, optionally a smaller vocab), so llama.cpp loads it and runs a finite forward.

Random bytes are generated directly in the quantized block layout (Q8_0: fp16 scale +
int8; MXFP4: E8M0 exponent + e2m1 nibbles) into one pool per type, created once; each
tensor is its pool read from a seed- and name-dependent offset, repeated, in chunks. Writing is a
memory-to-disk copy: no float generation, no quantization, no per-tensor Python work.
Scales are small so activations stay finite through the forward pass.

The types of the published low-bit K3 files can be asked for: routed experts in any of
EXPERT_TYPES (gate/up and down separately, e.g. IQ2_XXS + IQ3_XXS like UD-IQ1_S), trunk
matrices in any of TRUNK_TYPES; their blocks come from synth_blocks (random codes, scales
chosen for the same weight size). Like the published files, the first shard can hold only
metadata (`metadata_shard`). A `sparse` model has exact headers and a data region that is a
hole: full size, (almost) no disk blocks, so the full 1.4 TB K3 geometry can be inspected or
planned on any machine. Holes read as zeros, which every block type decodes to 0.0.

The modules behind it, one concern each: synth_geometry (dimensions, tensor list, KVs),
synth_vocab (the BPE vocab), synth_types (expert and trunk type mixes), synth_pools (random
bytes), synth_blocks (random blocks of the low-bit types), synth_plan (what will be written)
and synth_write (metadata-shard and sparse files). This module runs them (synthesize,
SynthResult) and re-exports their public names: `k3kit.gguf.synth` is the one import callers need.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, LlamaFileType

from k3kit.errors import K3Error
from k3kit.gguf.synth_geometry import (
    ARR,
    F32V,
    GEOMETRIES,
    I32,
    K3,
    MAX_EXPERTS,
    MAX_LAYERS,
    MINI,
    MINI256,
    STR,
    U16,
    U32,
    Geometry,
    build_kv,
    mla_layers,
    tensor_shapes,
)
from k3kit.gguf.synth_plan import ALIGNMENT, SynthPlan, balanced_layout, default_name, plan
from k3kit.gguf.synth_pools import F32_POOL_BYTES, POOL_BYTES, Pools
from k3kit.gguf.synth_types import (
    BF16,
    EXPERT_TYPES,
    F16,
    F32,
    LFT,
    MXFP4,
    Q8_0,
    TRUNK_TYPES,
    Shape,
    TensorList,
    Types,
    apply_types,
    types_for,
)
from k3kit.gguf.synth_vocab import MAX_VOCAB, MIN_VOCAB, Vocab, bytes_to_unicode, make_vocab
from k3kit.gguf.synth_write import _shard_jobs, _write_files
from k3kit.gguf.writer import write_model
from k3kit.progress import byte_progress


@dataclass
class SynthResult:
    """What `k3kit synth` made; printed for people or as --json."""

    paths: list[str]
    geometry: str
    layers: int
    experts: int
    mla_layers: list[int]
    vocab: int
    tensors: int
    tensor_bytes: int
    file_bytes: int
    seconds: float
    gb_per_s: float
    expert_type: str = "MXFP4"
    expert_type_down: str = "MXFP4"
    trunk_type: str = "Q8_0"
    file_type: int = int(LlamaFileType.MOSTLY_MXFP4_MOE)
    trunk_kept_q8_0: int = 0  # trunk matrices whose rows do not fit trunk_type's block
    metadata_shard: bool = False
    sparse: bool = False
    disk_bytes: int = 0  # blocks the files occupy (st_blocks); ~header bytes when sparse

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def synthesize(out_dir: str | Path, geometry: Geometry | str, n_layers: int, n_experts: int, *,
               vocab: int | None = None, shards: int = 1, seed: int = 0, name: str | None = None,
               progress: bool = True, expert_type: str | GGMLQuantizationType | None = None,
               expert_type_down: str | GGMLQuantizationType | None = None,
               trunk_type: str | GGMLQuantizationType | None = None, metadata_shard: bool = False,
               sparse: bool = False) -> SynthResult:
    """Write a synthetic kimi-k3 model into out_dir (as NAME.gguf or NAME-0000K-of-0000N.gguf).

    expert_type / expert_type_down / trunk_type: see apply_types (defaults: MXFP4 experts,
    Q8_0 trunk). metadata_shard: shard 1 holds only the KVs (needs shards >= 2). sparse: exact
    headers, data left as a hole (no tensor bytes are generated or written).
    """
    if name is not None and (not name or "/" in name or "\0" in name or name.startswith(".")):
        raise K3Error(f"--name {name!r}: must be a plain file name")
    types = types_for(expert_type, expert_type_down, trunk_type)
    p = plan(geometry, n_layers, n_experts, vocab=vocab, shards=shards, seed=seed, name=name, types=types,
             metadata_shard=metadata_shard)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise K3Error(f"{out_dir}: exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name or default_name(p.geometry, n_layers, n_experts, types)}.gguf"
    t0 = time.perf_counter()
    if sparse or metadata_shard:
        jobs = _shard_jobs(p, out)
        with byte_progress("synth", p.nbytes, enabled=progress and not sparse) as bar:
            _write_files(jobs, sparse=sparse, progress=bar)
        paths = [path for path, _, _ in jobs]
    else:
        with byte_progress("synth", p.nbytes, enabled=progress) as bar:
            paths = write_model(out, p.kv, p.tensors, layout=p.layout, alignment=ALIGNMENT, progress=bar)
    dt = time.perf_counter() - t0
    stats = [q.stat() for q in paths]
    file_bytes = sum(st.st_size for st in stats)
    return SynthResult(
        paths=[str(q) for q in paths], geometry=p.geometry.name, layers=n_layers, experts=n_experts,
        mla_layers=p.mla_layers, vocab=p.geometry.vocab, tensors=len(p.tensors), tensor_bytes=p.nbytes,
        file_bytes=file_bytes, seconds=round(dt, 3), gb_per_s=round(file_bytes / dt / 1e9, 3) if dt else 0.0,
        expert_type=types.expert.name, expert_type_down=types.expert_down.name, trunk_type=types.trunk.name,
        file_type=types.file_type, trunk_kept_q8_0=len(p.trunk_kept_q8_0), metadata_shard=metadata_shard,
        sparse=sparse, disk_bytes=sum(st.st_blocks * 512 for st in stats),
    )


__all__ = ["Geometry", "K3", "MINI", "MINI256", "GEOMETRIES", "SynthPlan", "SynthResult", "Pools", "Vocab",
           "Types", "EXPERT_TYPES", "TRUNK_TYPES", "types_for", "apply_types", "make_vocab", "mla_layers",
           "tensor_shapes", "build_kv", "balanced_layout", "plan", "synthesize"]
# the parts' constants and helpers, importable from here as well
__all__ += ["ALIGNMENT", "MAX_LAYERS", "MAX_EXPERTS", "MIN_VOCAB", "MAX_VOCAB", "POOL_BYTES",
            "F32_POOL_BYTES", "Q8_0", "MXFP4", "F32", "F16", "BF16", "U16", "U32", "I32", "F32V", "STR",
            "ARR", "LFT", "Shape", "TensorList", "bytes_to_unicode", "default_name"]
