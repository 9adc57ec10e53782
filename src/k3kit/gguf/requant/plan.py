"""What a requant will do, decided before anything is written: per tensor, per shard, on disk.

* Per tensor: requantize to the target (dequantize the source to float32 in row chunks of
  CHUNK_ELEMS, quantize with the bit-exact codec) or copy byte for byte, with the reason.
* Per shard: the output keeps its source's name, tensors and KVs (general.file_type updated);
  its exact size is predicted from the writer's layout, and the source is fingerprinted
  (size, mtime, header sha256) so a changed source is refused later.
* On disk: the output directory holds NAME (verified), `.NAME.partial` (being written) and
  the journal JOURNAL_NAME; preflight orders the shards so the outputs fit, or refuses with
  the bytes needed against the bytes free.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, Keys, LlamaFileType

from k3kit.errors import K3Error
from k3kit.gguf import format as fmt
from k3kit.gguf import quants
from k3kit.gguf.reader import KV, GGUFFile, TensorInfo, align_up
from k3kit.gguf.writer import encode_kv

T = GGMLQuantizationType
JOURNAL_NAME = "k3kit-requant.json"
CHUNK_ELEMS = 4 << 20  # float32 elements per chunk per worker (16 MiB; the codecs' temporaries ~5x)
DISK_MARGIN = 4 << 20  # bytes kept free beyond the planned outputs
FILE_TYPE_KEY = Keys.General.FILE_TYPE

# general.file_type of the output, by target: the llama_ftype whose default type is the
# target. Q4_K has two (Q4_K_S, Q4_K_M): both quantize the bulk to Q4_K and differ only in
# which tensors they bump to Q5_K/Q6_K; a uniform Q4_K trunk is nearer the smaller mix, so
# Q4_K_S (14), which is what `llama-quantize --pure ... Q4_K_S` writes for the same tensors.
FTYPE_FOR_TARGET: dict[GGMLQuantizationType, int] = {
    T.Q4_K: int(LlamaFileType.MOSTLY_Q4_K_S),
    T.Q8_0: int(LlamaFileType.MOSTLY_Q8_0),
    T.F16: int(LlamaFileType.MOSTLY_F16),
    T.BF16: int(LlamaFileType.MOSTLY_BF16),
    T.F32: int(LlamaFileType.ALL_F32),
}
TARGETS = tuple(t for t in FTYPE_FOR_TARGET if t in quants.QUANTIZE_TYPES)

EXPERT_REFUSAL = ("routed experts are MXFP4 from quantization-aware training: the 4-bit "
                  "values ARE the model, and requantizing them destroys that calibration")


@dataclass(frozen=True)
class Options:
    """What the user asked for; recorded in the journal so --resume cannot change it."""

    to: str = "Q4_K"
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    allow_expert_requant: bool = False

    @property
    def target(self) -> GGMLQuantizationType:
        return parse_target(self.to)

    def to_dict(self) -> dict[str, Any]:
        return {"to": self.to, "include": list(self.include), "exclude": list(self.exclude),
                "allow_expert_requant": self.allow_expert_requant}


def parse_target(name: str) -> GGMLQuantizationType:
    by_name = {t.name: t for t in TARGETS}
    t = by_name.get(name.upper())
    if t is None:
        raise K3Error(f"--to {name}: expected one of {', '.join(by_name)}")
    return t


def _compile(patterns: Sequence[str], flag: str) -> list[re.Pattern[str]]:
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise K3Error(f"{flag} {p!r}: bad regular expression: {e}") from None
    return out


# ---------------------------------------------------------------- per tensor


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    src_type: GGMLQuantizationType
    dst_type: GGMLQuantizationType
    nbytes_in: int
    nbytes_out: int
    role: str
    reason: str  # "requant", or why it is kept

    @property
    def requant(self) -> bool:
        return self.src_type != self.dst_type


def default_selected(name: str, n_dims: int) -> bool:
    """The default requant set: trunk matrices, token_embd and output excepted.

    Trunk matrices are every 2+-D weight of the attention/KDA, dense-FFN and shared-expert
    roles (format.is_trunk_matrix; conv kernels are not). token_embd and output stay as
    they are unless --include names them: output is the most quantization-sensitive matrix
    (llama-quantize bumps it to Q6_K in every K-quant mix, a type k3kit cannot write) and a
    Q8_0 token_embd is a row lookup that costs no matmul bandwidth; keeping both at Q8_0 is
    also what gives K3's published 34.2 GB Q4_K trunk.
    """
    return fmt.is_trunk_matrix(name, n_dims) and fmt.role_of(name, n_dims) != fmt.ROLE_EMBEDDINGS_OUTPUT


def plan_tensors(path: Path, tensors: Sequence[TensorInfo], opts: Options) -> list[TensorPlan]:
    """Per tensor of one shard: requant to the target, or keep (with the reason)."""
    target = opts.target
    inc = _compile(opts.include, "--include")
    exc = _compile(opts.exclude, "--exclude")
    block, _ = GGML_QUANT_SIZES[target]
    out = []
    for t in tensors:
        n_dims = len(t.shape)
        role = fmt.role_of(t.name, n_dims)
        included = any(p.search(t.name) for p in inc)
        selected = included or default_selected(t.name, n_dims)
        reason = "requant"
        if any(p.search(t.name) for p in exc):
            reason = "excluded"
        elif not selected:
            reason = "not selected"
        elif fmt.is_routed_expert(t.name) and not opts.allow_expert_requant:
            if t.ggml_type == T.MXFP4:
                raise K3Error(f"{path}: refusing to requantize '{t.name}': {EXPERT_REFUSAL} "
                              f"(pass --allow-expert-requant to do it anyway)")
            reason = "routed expert"
        elif n_dims < 2 or fmt.converter_keeps_f32(t.name, n_dims):
            reason = "kept F32 (1-D, norm, router or conv)"
        elif t.ggml_type == target:
            reason = f"already {target.name}"
        elif t.shape[0] % block:
            reason = f"ne0 {t.shape[0]} not a multiple of {block}"
        elif t.ggml_type not in quants.DEQUANTIZE_TYPES:
            reason = f"cannot decode {t.ggml_type.name}"
        dst = target if reason == "requant" else t.ggml_type
        nbytes_out = t.n_elements // block * GGML_QUANT_SIZES[target][1] if dst == target else t.nbytes
        out.append(TensorPlan(t.name, t.shape, t.ggml_type, dst, t.nbytes, nbytes_out, role, reason))
    return out


def output_file_type(plans: Sequence[TensorPlan], target: GGMLQuantizationType) -> int | None:
    """general.file_type for the output, or None to keep the source's (nothing requantized).

    A Q8_0 trunk next to MXFP4 experts is what llama.cpp calls MOSTLY_MXFP4_MOE.
    """
    if not any(p.requant for p in plans):
        return None
    if target == T.Q8_0 and any(p.dst_type == T.MXFP4 and fmt.is_routed_expert(p.name) for p in plans):
        return int(LlamaFileType.MOSTLY_MXFP4_MOE)
    return FTYPE_FOR_TARGET[target]


def with_file_type(kvs: Sequence[KV], ftype: int | None) -> list[KV]:
    """`kvs` with general.file_type set to `ftype` where the source has the key (None: unchanged)."""
    if ftype is None:
        return list(kvs)
    return [KV(k.key, GGUFValueType.UINT32, int(ftype)) if k.key == FILE_TYPE_KEY else k for k in kvs]


def predict_size(kvs: Sequence[KV], plans: Sequence[TensorPlan], alignment: int) -> int:
    """Exact size of the file k3kit's writer makes for these KVs and tensors."""
    n = 24 + sum(len(encode_kv(k)) for k in kvs)
    for p in plans:
        n += 8 + len(p.name.encode()) + 4 + 8 * len(p.shape) + 4 + 8
    n = align_up(n, alignment)
    return n + sum(align_up(p.nbytes_out, alignment) for p in plans)


def header_sha256(f: GGUFFile) -> str:
    with open(f.path, "rb") as fh:
        return hashlib.sha256(fh.read(f.data_offset)).hexdigest()


# ---------------------------------------------------------------- per shard


@dataclass
class ShardPlan:
    index: int
    name: str
    source: Path
    output: Path
    tensors: list[TensorPlan]
    kv: list[KV]  # the output's KVs in order (the source shard's, file_type updated)
    alignment: int
    src_size: int
    out_size: int
    src_mtime_ns: int
    src_header_sha256: str

    @property
    def partial(self) -> Path:
        return self.output.with_name(f".{self.output.name}.partial")

    @property
    def saving(self) -> int:
        return self.src_size - self.out_size

    @property
    def requant_bytes(self) -> int:
        """Source bytes to dequantize and quantize again: the shard's share of the work."""
        return sum(p.nbytes_in for p in self.tensors if p.requant)

    def summary(self) -> list[list[str]]:
        return [[p.name, p.src_type.name, p.dst_type.name] for p in self.tensors]


def plan_shard(index: int, f: GGUFFile, out_dir: Path, opts: Options, ftype: int | None) -> ShardPlan:
    plans = plan_tensors(f.path, f.tensors, opts)
    kvs = with_file_type(list(f.kv.values()), ftype)
    st = f.path.stat()
    return ShardPlan(index, f.path.name, f.path, out_dir / f.path.name, plans, kvs, f.alignment,
                     f.size, predict_size(kvs, plans, f.alignment), st.st_mtime_ns, header_sha256(f))


# ---------------------------------------------------------------- on disk


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def same_filesystem(a: Path, b: Path) -> bool:
    return a.stat().st_dev == b.stat().st_dev


def preflight(todo: list[ShardPlan], out_dir: Path,
              delete_source: bool) -> tuple[list[ShardPlan], dict[str, Any]]:
    """Order the shards so that the outputs fit, or refuse with bytes needed vs free.

    Without --delete-source every output must fit at once. With it (and sources on the same
    filesystem), shard i needs out_i free when it starts and gives back src_i when its source
    is deleted: largest saving first, serially, is the order that needs the least headroom
    (later shards can always run once their predecessors' savings are in).
    """
    free = free_bytes(out_dir)
    need_all = sum(p.out_size for p in todo) + DISK_MARGIN
    info: dict[str, Any] = {"free": free, "needed_all_at_once": need_all, "delete_source": delete_source}
    if need_all <= free or not todo:
        info["needed"] = need_all
        # longest job first: parallel workers then finish close together
        order = sorted(todo, key=lambda p: (-p.requant_bytes, p.index))
        info["order"] = [p.name for p in order]
        return order, info
    reclaim = delete_source and all(same_filesystem(p.source, out_dir) for p in todo)
    if not reclaim:
        extra = "" if delete_source else (" (--delete-source could free each source shard once its output "
                                          "is verified)")
        raise K3Error(f"{out_dir}: not enough free space: the outputs need {need_all} bytes, "
                      f"{free} are free{extra}")
    order = sorted(todo, key=lambda p: (-p.saving, p.index))
    avail = free
    for p in order:
        if p.out_size + DISK_MARGIN > avail:
            raise K3Error(f"{out_dir}: not enough free space even deleting sources shard by shard: "
                          f"shard {p.name} needs {p.out_size + DISK_MARGIN} bytes with {avail} free "
                          f"(the outputs need {need_all} bytes, {free} are free now)")
        avail += p.src_size - p.out_size
    info["needed"] = max(p.out_size for p in order) + DISK_MARGIN
    info["order"] = [p.name for p in order]
    return order, info


def existing_ancestor(path: Path) -> Path:
    """The directory whose filesystem `path` will be created on (for --dry-run's disk check)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def preflight_report(todo: list[ShardPlan], out_dir: Path,
                     delete_source: bool) -> tuple[list[ShardPlan], dict[str, Any]]:
    """preflight for --dry-run: a plan that does not fit is reported, not refused."""
    try:
        return preflight(todo, out_dir, delete_source)
    except K3Error as e:
        need = sum(p.out_size for p in todo) + DISK_MARGIN
        return todo, {"free": free_bytes(out_dir), "needed_all_at_once": need, "fits": False,
                      "problem": str(e)}
