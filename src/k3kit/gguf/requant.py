"""Surgical requantization: the trunk to a new type, the QAT experts untouched, shard by shard.

K3's trunk ships as Q8_0 (59.6 GB) and fits a 2x24 GB box as Q4_K; its routed experts are
MXFP4 from quantization-aware training and must keep their exact bytes. The operation has to
run on a 1.4 TB, 32-shard model on a box that cannot hold two copies, so it is built as:

    plan -> disk preflight -> per-shard jobs -> verify -> rename -> journal -> delete source

* The plan decides per tensor: requantize (dequantize the source to float32 in row chunks,
  quantize with the bit-exact codec) or copy byte for byte (FileRange, in-kernel).
* Each output shard keeps its source's name, tensors and KVs (general.file_type updated).
  It is written under a hidden `.NAME.partial` name, fsynced, verified (k3kit.gguf.verify)
  and only then renamed to NAME; the journal records it as verified after the rename, and
  only a shard the journal (fsynced) calls verified may have its source deleted.
* The journal (OUT_DIR/k3kit-requant.json, atomically rewritten) lets --resume skip verified
  shards and redo the rest, also after their sources were deleted: every shard's job needs
  only its own source file, and shard 1's KVs live on in its verified output.
* SIGKILL at any point leaves: sources present or replaced by a verified output, no
  unverified file under a final name (partials are hidden and removed on resume).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType

from k3kit.errors import K3Error, VerifyError
from k3kit.gguf import format as fmt
from k3kit.gguf import quants
from k3kit.gguf.reader import KV, GGUFFile, TensorInfo, align_up
from k3kit.gguf.shards import Model
from k3kit.gguf.verify import FILE_TYPE_KEY, ShardCheck, verify_shard, with_file_type
from k3kit.gguf.writer import FileRange, TensorSpec, encode_kv, fsync_dir, temp_path, write_gguf
from k3kit.progress import byte_progress

T = GGMLQuantizationType
JOURNAL_NAME = "k3kit-requant.json"
JOURNAL_FORMAT = "k3kit-requant-journal"
JOURNAL_VERSION = 1
MAX_JOURNAL_BYTES = 64 << 20
CHUNK_ELEMS = 4 << 20  # float32 elements per chunk per worker (16 MiB; the codecs' temporaries ~5x)
DISK_MARGIN = 4 << 20  # bytes kept free beyond the planned outputs
KILL_ENV = "K3KIT_TEST_KILL_AT"  # test hook: "phase:shard" -> SIGKILL at that point
_PGID_ENV = "K3KIT_REQUANT_PGID"
KILL_PHASES = ("write", "written", "verify", "renamed", "journaled", "deleted")

PENDING, WRITTEN, VERIFIED, SOURCE_DELETED = "pending", "written", "verified", "source-deleted"
DONE_STATES = (VERIFIED, SOURCE_DELETED)

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


# ---------------------------------------------------------------- plan


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

    def to_dict(self) -> dict:
        return {"to": self.to, "include": list(self.include), "exclude": list(self.exclude),
                "allow_expert_requant": self.allow_expert_requant}


def parse_target(name: str) -> GGMLQuantizationType:
    by_name = {t.name: t for t in TARGETS}
    t = by_name.get(name.upper())
    if t is None:
        raise K3Error(f"--to {name}: expected one of {', '.join(by_name)}")
    return t


def _compile(patterns: Sequence[str], flag: str) -> list[re.Pattern]:
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise K3Error(f"{flag} {p!r}: bad regular expression: {e}") from None
    return out


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

    def summary(self) -> list[list]:
        return [[p.name, p.src_type.name, p.dst_type.name] for p in self.tensors]


def plan_shard(index: int, f: GGUFFile, out_dir: Path, opts: Options, ftype: int | None) -> ShardPlan:
    plans = plan_tensors(f.path, f.tensors, opts)
    kvs = with_file_type(list(f.kv.values()), ftype)
    st = f.path.stat()
    return ShardPlan(index, f.path.name, f.path, out_dir / f.path.name, plans, kvs, f.alignment,
                     f.size, predict_size(kvs, plans, f.alignment), st.st_mtime_ns, header_sha256(f))


# ---------------------------------------------------------------- journal


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = temp_path(path)
    data = json.dumps(obj, indent=1).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _valid_record(s: object) -> bool:
    """One shard record as Journal.new writes it (a hostile or damaged journal fails here, not later)."""
    if not isinstance(s, dict) or not isinstance(s.get("name"), str) or "/" in s["name"]:
        return False
    if s.get("state") not in (PENDING, WRITTEN, VERIFIED, SOURCE_DELETED):
        return False
    src, out, plan = s.get("source"), s.get("output"), s.get("plan")
    if not (isinstance(src, dict) and all(isinstance(src.get(k), int) for k in ("size", "mtime_ns"))
            and isinstance(src.get("header_sha256"), str)):
        return False
    if out is not None and not (isinstance(out, dict) and isinstance(out.get("size"), int)
                                and isinstance(out.get("mtime_ns"), int)
                                and isinstance(out.get("sha256"), str)):
        return False
    if s["state"] in DONE_STATES and out is None:
        return False
    names = {t.name for t in T}
    return isinstance(plan, list) and all(
        isinstance(e, list) and len(e) == 3 and all(isinstance(x, str) for x in e)
        and e[1] in names and e[2] in names for e in plan)


class Journal:
    """The per-shard state of one requant, rewritten atomically (temp, fsync, rename, fsync dir)."""

    def __init__(self, path: Path, data: dict) -> None:
        self.path = path
        self.data = data
        self.lock = threading.RLock()  # the progress thread records "written" states

    @classmethod
    def new(cls, out_dir: Path, source_dir: Path, opts: Options, arch: str,
            plans: list[ShardPlan]) -> Journal:
        data = {
            "format": JOURNAL_FORMAT, "version": JOURNAL_VERSION,
            "source_dir": str(source_dir.resolve()), "options": opts.to_dict(), "arch": arch,
            "kv_header": {"shard": plans[0].name, "sha256": plans[0].src_header_sha256,
                          "kept_in": "the verified output of this shard (all KVs, file_type updated)"},
            "shards": [{
                "name": p.name, "state": PENDING,
                "source": {"size": p.src_size, "mtime_ns": p.src_mtime_ns,
                           "header_sha256": p.src_header_sha256},
                "planned_bytes": p.out_size, "plan": p.summary(), "output": None, "check": None,
            } for p in plans],
        }
        return cls(out_dir / JOURNAL_NAME, data)

    @classmethod
    def load(cls, path: Path) -> Journal:
        try:
            if path.stat().st_size > MAX_JOURNAL_BYTES:
                raise K3Error(f"{path}: journal larger than {MAX_JOURNAL_BYTES} bytes")
            data = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise K3Error(f"{path}: journal is not valid JSON ({e})") from None
        ok = (isinstance(data, dict) and data.get("format") == JOURNAL_FORMAT
              and data.get("version") == JOURNAL_VERSION and isinstance(data.get("shards"), list)
              and len(data["shards"]) > 0 and isinstance(data.get("options"), dict)
              and all(_valid_record(s) for s in data["shards"]))
        if not ok:
            raise K3Error(f"{path}: not a k3kit requant journal (version {JOURNAL_VERSION})")
        return cls(path, data)

    @property
    def shards(self) -> list[dict]:
        return self.data["shards"]

    def shard(self, name: str) -> dict:
        return next(s for s in self.shards if s["name"] == name)

    def save(self) -> None:
        with self.lock:
            write_json_atomic(self.path, self.data)

    def mark_written(self, name: str) -> None:
        with self.lock:
            rec = self.shard(name)
            if rec["state"] == PENDING:
                rec["state"] = WRITTEN
                self.save()


# ---------------------------------------------------------------- test hook


def _kill_point(phase: str, shard_no: int) -> None:
    """SIGKILL ourselves (and our worker group) at a named point; K3KIT_TEST_KILL_AT=phase:shard."""
    want = os.environ.get(KILL_ENV)
    if not want or want != f"{phase}:{shard_no}":
        return
    pgid = os.environ.get(_PGID_ENV)
    if pgid:
        os.killpg(int(pgid), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- one shard (runs in a worker)


@dataclass
class ShardResult:
    name: str
    output: str
    size: int
    mtime_ns: int
    sha256: str
    requantized: int
    kept: int
    seconds: float
    write_seconds: float
    check: dict = field(default_factory=dict)


def _requant_source(f: GGUFFile, t: TensorInfo, p: TensorPlan, hashes: dict[str, str],
                    report: Callable[[int], None] | None,
                    on_call: Callable[[], None]) -> Callable[[], Iterator[np.ndarray]]:
    """A streaming writer source: `t` dequantized and quantized to the target in row chunks.

    Memory per worker is one chunk (CHUNK_ELEMS floats and the codec's temporaries), whatever
    the tensor's size; the sha256 of the bytes produced is left in `hashes` for the verifier.
    """

    def make() -> Iterator[np.ndarray]:
        on_call()
        ne0 = p.shape[0]
        rows = t.n_elements // ne0
        src_row = quants.row_bytes(p.src_type, ne0)
        raw = f.view(t)
        h = hashlib.sha256()
        step = max(1, CHUNK_ELEMS // ne0)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            x = quants.dequantize(np.asarray(raw[r0 * src_row:r1 * src_row]), p.src_type, (r1 - r0) * ne0)
            if not np.isfinite(x).all():
                row = r0 + int(np.flatnonzero(~np.isfinite(x))[0]) // ne0
                raise K3Error(f"{f.path}: tensor '{t.name}' row {row} decodes to non-finite values "
                              f"(corrupt {p.src_type.name} data?)")
            q = quants.quantize(x.reshape(r1 - r0, ne0), p.dst_type)
            h.update(q)
            if report is not None:
                report((r1 - r0) * src_row)
            yield q
        hashes[t.name] = h.hexdigest()

    return make


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def clean_partials(out_dir: Path, name: str) -> None:
    """Remove what a killed run may have left for shard `name`: its partial and writer temps."""
    partial = f".{name}.partial"
    for p in out_dir.glob(f".{partial}.tmp-*"):
        _remove(p)
    _remove(out_dir / partial)


def run_shard(sp: ShardPlan, exact: str = "sample", report: Callable[[int], None] | None = None,
              on_written: Callable[[str], None] | None = None) -> ShardResult:
    """Write, verify and commit one output shard. Never touches the source.

    `on_written(name)` runs once the partial file is complete and fsynced (the journal's
    "written" state, informational: a killed run redoes written shards from scratch).
    """
    t0 = time.perf_counter()
    no = sp.index + 1
    clean_partials(sp.output.parent, sp.name)
    f = GGUFFile.open(sp.source)
    st = sp.source.stat()
    if (f.size, st.st_mtime_ns, header_sha256(f)) != (sp.src_size, sp.src_mtime_ns, sp.src_header_sha256):
        raise K3Error(f"{sp.source}: source shard changed since it was planned")
    by_name = {t.name: t for t in f.tensors}
    hashes: dict[str, str] = {}
    calls = [0]

    def on_call() -> None:
        calls[0] += 1
        if calls[0] == 2 or (calls[0] == 1 and n_requant == 1):
            _kill_point("write", no)  # mid-write: earlier tensors are already in the temp file

    n_requant = sum(p.requant for p in sp.tensors)
    specs = []
    for p in sp.tensors:
        t = by_name[p.name]
        if p.requant:
            src = _requant_source(f, t, p, hashes, report, on_call)
        else:
            src = FileRange(sp.source, t.offset, t.nbytes)
        specs.append(TensorSpec(p.name, p.shape, p.dst_type, p.nbytes_out, src))
    try:
        try:
            write_gguf(sp.partial, sp.kv, specs, alignment=sp.alignment)
        except OSError as e:
            if e.errno == 28:  # ENOSPC
                raise K3Error(f"{sp.output.parent}: no space left on device while writing "
                              f"{sp.name} ({sp.out_size} bytes planned)") from None
            raise
        finally:
            f.close()
        for p in sp.tensors:  # copied tensors were read in-kernel: report them now
            if not p.requant and report is not None:
                report(p.nbytes_in)
        t_write = time.perf_counter() - t0
        fd = os.open(sp.partial, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # verify what is on disk
        finally:
            os.close(fd)
        if on_written is not None:
            on_written(sp.name)
        _kill_point("written", no)
        types = {p.name: p.dst_type for p in sp.tensors}
        chk = verify_shard(sp.partial, sp.source, expect_kv=sp.kv, expect_types=types,
                           expect_hashes=hashes, expect_size=sp.out_size, exact=exact, report=report,
                           on_tensor=lambda i: _kill_point("verify", no) if i == 1 else None)
        if not chk.ok:
            raise VerifyError(f"{sp.output}: verification failed: {chk.problems[0]}"
                              + (f" (+{chk.n_problems - 1} more)" if chk.n_problems > 1 else ""))
        os.replace(sp.partial, sp.output)
        fsync_dir(sp.output.parent)
    except BaseException:
        clean_partials(sp.output.parent, sp.name)
        raise
    _kill_point("renamed", no)
    st = sp.output.stat()
    n_req = sum(p.requant for p in sp.tensors)
    return ShardResult(sp.name, str(sp.output), st.st_size, st.st_mtime_ns, chk.sha256, n_req,
                       len(sp.tensors) - n_req, round(time.perf_counter() - t0, 3), round(t_write, 3),
                       chk.to_dict())


_QUEUE = None


def _worker_init(queue) -> None:
    global _QUEUE
    _QUEUE = queue
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles ^C


def _worker_report(msg: int | str) -> None:
    if _QUEUE is not None:
        _QUEUE.put(msg)


def _worker_run(sp: ShardPlan, exact: str) -> ShardResult:
    return run_shard(sp, exact, _worker_report, _worker_report)


# ---------------------------------------------------------------- preflight


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def same_filesystem(a: Path, b: Path) -> bool:
    return a.stat().st_dev == b.stat().st_dev


def preflight(todo: list[ShardPlan], out_dir: Path, delete_source: bool) -> tuple[list[ShardPlan], dict]:
    """Order the shards so that the outputs fit, or refuse with bytes needed vs free.

    Without --delete-source every output must fit at once. With it (and sources on the same
    filesystem), shard i needs out_i free when it starts and gives back src_i when its source
    is deleted: largest saving first, serially, is the order that needs the least headroom
    (later shards can always run once their predecessors' savings are in).
    """
    free = free_bytes(out_dir)
    need_all = sum(p.out_size for p in todo) + DISK_MARGIN
    info = {"free": free, "needed_all_at_once": need_all, "delete_source": delete_source}
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


# ---------------------------------------------------------------- the whole model


@dataclass
class RequantResult:
    """What `k3kit requant` did (or would do with --dry-run); printed for people or as --json."""

    output_dir: str
    target: str
    file_type: int | None
    dry_run: bool
    shards: list[dict]
    by_role: list[dict]
    kept: list[dict]
    bytes_in: int
    bytes_out: int
    requantized: int
    copied: int
    disk: dict
    seconds: float = 0.0
    gb_per_s: float = 0.0
    deleted_sources: list[str] = field(default_factory=list)
    resumed_skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _by_role(plans: Sequence[ShardPlan]) -> tuple[list[dict], list[dict]]:
    groups: dict[tuple[str, str, str], dict] = {}
    kept = []
    for sp in plans:
        for p in sp.tensors:
            key = (p.role, p.src_type.name, p.dst_type.name)
            g = groups.setdefault(key, {"role": p.role, "from": p.src_type.name, "to": p.dst_type.name,
                                        "tensors": 0, "bytes_before": 0, "bytes_after": 0})
            g["tensors"] += 1
            g["bytes_before"] += p.nbytes_in
            g["bytes_after"] += p.nbytes_out
            if p.reason.startswith(("ne0", "cannot decode")):
                kept.append({"name": p.name, "shape": list(p.shape), "type": p.src_type.name,
                             "reason": p.reason})
    order = {r: i for i, r in enumerate(fmt.ROLES)}
    rows = sorted(groups.values(), key=lambda g: (order.get(g["role"], 99), g["from"], g["to"]))
    return rows, kept


def _check_out_dir(source_dir: Path, out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise K3Error(f"{out_dir}: exists and is not a directory")
    if out_dir.exists() and out_dir.resolve() == source_dir.resolve():
        raise K3Error(f"{out_dir}: is the input's directory; outputs keep the input's file names, "
                      f"choose another directory")


def requantize(input_path: str | os.PathLike, out_dir: str | os.PathLike, opts: Options, *,
               jobs: int = 1, delete_source: bool = False, resume: bool = False, dry_run: bool = False,
               exact: str = "sample", progress: bool = True) -> RequantResult:
    """Requantize a (sharded) model into out_dir; see the module docstring for the protocol."""
    t0 = time.perf_counter()
    input_path, out_dir = Path(input_path), Path(out_dir)
    target = opts.target
    _check_out_dir(input_path.parent, out_dir)
    journal_path = out_dir / JOURNAL_NAME
    if jobs < 1:
        raise K3Error(f"--jobs {jobs}: must be >= 1")

    if journal_path.exists() and not resume and not dry_run:
        raise K3Error(f"{journal_path}: output directory holds an unfinished or finished requant; "
                      f"pass --resume to continue it or choose an empty directory")
    if resume and dry_run:
        raise K3Error("--dry-run cannot be combined with --resume")
    if resume and journal_path.exists():
        journal = Journal.load(journal_path)
        all_plans, skipped, deleted = _resume_plans(journal, input_path, out_dir, opts, delete_source)
    else:
        model = Model.open(input_path)
        try:
            arch = model.arch
            files = model.files
            plans0 = [plan_tensors(f.path, f.tensors, opts) for f in files]
            ftype = output_file_type([p for ps in plans0 for p in ps], target)
            all_plans = [plan_shard(i, f, out_dir, opts, ftype) for i, f in enumerate(files)]
        finally:
            model.close()
        skipped, deleted = [], []
        if not dry_run:
            existing = [p.output for p in all_plans if p.output.exists()]
            if existing:
                raise K3Error(f"{existing[0]}: output directory already holds this file; "
                              f"choose an empty directory")
            journal = Journal.new(out_dir, input_path.parent, opts, arch, all_plans)

    by_role, kept = _by_role(all_plans)
    ftype = output_file_type([p for sp in all_plans for p in sp.tensors], target)
    todo = [sp for sp in all_plans if sp.name not in skipped]
    if dry_run:
        _, disk = _preflight_report(todo, _existing_ancestor(out_dir), delete_source)
        return _result(out_dir, target, ftype, True, all_plans, by_role, kept, disk, t0, {}, deleted, skipped)

    out_dir.mkdir(parents=True, exist_ok=True)
    order, disk = preflight(todo, out_dir, delete_source)
    journal.save()
    results: dict[str, ShardResult] = {}
    total = sum(sum(p.nbytes_in for p in sp.tensors) + sp.out_size for sp in order)
    with byte_progress(f"requant -> {target.name}", total, enabled=progress) as bar:
        _run_jobs(order, journal, jobs, delete_source, exact, disk, bar.advance, results, deleted)
    return _result(out_dir, target, ftype, False, all_plans, by_role, kept, disk, t0, results, deleted,
                   skipped)


def _existing_ancestor(path: Path) -> Path:
    """The directory whose filesystem `path` will be created on (for --dry-run's disk check)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _preflight_report(todo, out_dir, delete_source):
    try:
        return preflight(todo, out_dir, delete_source)
    except K3Error as e:
        need = sum(p.out_size for p in todo) + DISK_MARGIN
        return todo, {"free": free_bytes(out_dir), "needed_all_at_once": need, "fits": False,
                      "problem": str(e)}


def _result(out_dir, target, ftype, dry_run, plans, by_role, kept, disk, t0, results, deleted, skipped):
    bytes_in = sum(sp.src_size for sp in plans)
    bytes_out = sum(sp.out_size for sp in plans)
    shards = []
    for sp in plans:
        r = results.get(sp.name)
        shards.append({"name": sp.name, "bytes_in": sp.src_size, "bytes_out": sp.out_size,
                       "requantized": sum(p.requant for p in sp.tensors),
                       "kept": sum(not p.requant for p in sp.tensors),
                       "status": "resumed (verified earlier)" if sp.name in skipped
                       else ("planned" if dry_run else ("verified" if r else "not done")),
                       "sha256": r.sha256 if r else None,
                       "seconds": r.seconds if r else None,
                       "write_seconds": r.write_seconds if r else None,
                       "check": r.check if r else None})
    dt = time.perf_counter() - t0
    done_in = sum(sp.src_size for sp in plans if sp.name in results)
    return RequantResult(
        output_dir=str(out_dir), target=target.name, file_type=ftype, dry_run=dry_run, shards=shards,
        by_role=by_role, kept=kept, bytes_in=bytes_in, bytes_out=bytes_out,
        requantized=sum(p.requant for sp in plans for p in sp.tensors),
        copied=sum(not p.requant for sp in plans for p in sp.tensors), disk=disk,
        seconds=round(dt, 3), gb_per_s=round(done_in / dt / 1e9, 4) if dt and results else 0.0,
        deleted_sources=deleted, resumed_skipped=skipped)


def _commit_shard(journal: Journal, sp: ShardPlan, r: ShardResult, delete_source: bool,
                  deleted: list[str]) -> None:
    with journal.lock:
        rec = journal.shard(sp.name)
        rec["state"] = VERIFIED
        rec["output"] = {"size": r.size, "mtime_ns": r.mtime_ns, "sha256": r.sha256}
        keys = ("preserved_ok", "requantized_ok", "exact_rows", "max_rel_rmse")
        rec["check"] = {k: r.check[k] for k in keys}
        journal.save()
    _kill_point("journaled", sp.index + 1)
    if delete_source:
        _delete_source(journal, sp.name, sp.source, deleted)


def _delete_source(journal: Journal, name: str, source: Path, deleted: list[str]) -> None:
    with journal.lock:
        rec = journal.shard(name)
        if rec["state"] not in DONE_STATES:
            raise AssertionError(f"refusing to delete {source}: shard not verified")
        _remove(source)
        fsync_dir(source.parent)
        _kill_point("deleted", journal.shards.index(rec) + 1)
        rec["state"] = SOURCE_DELETED
        journal.save()
    deleted.append(str(source))


def _run_jobs(order: list[ShardPlan], journal: Journal, jobs: int, delete_source: bool, exact: str,
              disk: dict, advance: Callable[[int], None], results: dict[str, ShardResult],
              deleted: list[str]) -> None:
    """Run shard jobs, at most `jobs` at once and only while the disk ledger says they fit."""
    if jobs == 1 or len(order) == 1:
        for sp in order:
            r = run_shard(sp, exact, advance, journal.mark_written)
            results[sp.name] = r
            _commit_shard(journal, sp, r, delete_source, deleted)
        return

    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            try:
                msg = queue.get(timeout=0.2)
            except Exception:  # noqa: BLE001 - queue.Empty, or the queue closed at exit
                continue
            if isinstance(msg, str):
                journal.mark_written(msg)
            else:
                advance(msg)

    if os.getpgid(0) == os.getpid():
        os.environ[_PGID_ENV] = str(os.getpid())  # test kill hook: take the workers along
    reclaim = delete_source and all(same_filesystem(p.source, p.output.parent) for p in order)
    avail = disk["free"]
    pending = list(order)
    running: dict[Future, ShardPlan] = {}
    error: BaseException | None = None
    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    try:
        with ProcessPoolExecutor(max_workers=min(jobs, len(order)), mp_context=ctx,
                                 initializer=_worker_init, initargs=(queue,)) as pool:
            while pending or running:
                while pending and error is None and len(running) < jobs and (
                        not running or pending[0].out_size + DISK_MARGIN <= avail):
                    sp = pending.pop(0)
                    avail -= sp.out_size
                    running[pool.submit(_worker_run, sp, exact)] = sp
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    sp = running.pop(fut)
                    try:
                        r = fut.result()
                    except BaseException as e:  # noqa: BLE001 - re-raised after the others finish
                        error = error or e
                        continue
                    results[sp.name] = r
                    _commit_shard(journal, sp, r, delete_source, deleted)
                    if reclaim:
                        avail += sp.src_size
    finally:
        stop.set()
        drainer.join()
        os.environ.pop(_PGID_ENV, None)
    if error is not None:
        raise error


# ---------------------------------------------------------------- resume


def _resume_plans(journal: Journal, input_path: Path, out_dir: Path, opts: Options,
                  delete_source: bool) -> tuple[list[ShardPlan], list[str], list[str]]:
    """Plans for the shards still to do; verified ones are checked and skipped."""
    jp = journal.path
    if journal.data["options"] != opts.to_dict():
        raise K3Error(f"{jp}: journal was made with options {json.dumps(journal.data['options'])}, "
                      f"not {json.dumps(opts.to_dict())}; resume with the same options")
    names = [s["name"] for s in journal.shards]
    if input_path.name not in names:
        raise K3Error(f"{jp}: journal is for {names[0]} (and its shards), not {input_path.name}")
    src_dir = input_path.parent
    arch = journal.data.get("arch", "")
    target = opts.target
    plans: list[ShardPlan] = []
    skipped: list[str] = []
    deleted: list[str] = []
    ftype_known = None
    for i, rec in enumerate(journal.shards):
        src = src_dir / rec["name"]
        out = out_dir / rec["name"]
        clean_partials(out_dir, rec["name"])
        if rec["state"] in DONE_STATES:
            o = rec.get("output") or {}
            st = out.stat() if out.exists() else None
            if st is not None and (st.st_size, st.st_mtime_ns) == (o.get("size"), o.get("mtime_ns")):
                skipped.append(rec["name"])
                if not src.exists() and rec["state"] != SOURCE_DELETED:
                    rec["state"] = SOURCE_DELETED
                    journal.save()
                elif src.exists() and delete_source:
                    _delete_source(journal, rec["name"], src, deleted)
                continue
            if not src.exists():
                raise K3Error(f"{out}: verified output is missing or changed and its source {src} "
                              f"was deleted: this shard cannot be recovered")
            rec["state"], rec["output"] = PENDING, None
        if not src.exists():
            raise K3Error(f"{src}: source shard is missing but the journal has no verified output for it")
        s = rec["source"]
        f = GGUFFile.open(src)
        try:
            st = src.stat()
            if (f.size, st.st_mtime_ns, header_sha256(f)) != (s["size"], s["mtime_ns"], s["header_sha256"]):
                raise K3Error(f"{src}: source shard changed since the journal was written")
            tensors = plan_tensors(f.path, f.tensors, opts)
            if [[p.name, p.src_type.name, p.dst_type.name] for p in tensors] != rec["plan"]:
                raise K3Error(f"{src}: plan differs from the journal's")
            ftype_known = ftype_known or _journal_ftype(journal, target, arch)
            sp = plan_shard(i, f, out_dir, opts, ftype_known)
        finally:
            f.close()
        plans.append(sp)
    journal.save()
    # Skipped shards still count in the summary: rebuild their plan rows from the journal.
    all_plans = []
    for i, rec in enumerate(journal.shards):
        sp = next((p for p in plans if p.name == rec["name"]), None)
        if sp is None:
            sp = _plan_from_journal(i, rec, src_dir, out_dir)
        all_plans.append(sp)
    return all_plans, skipped, deleted


def _journal_ftype(journal: Journal, target: GGMLQuantizationType, arch: str) -> int | None:
    """The file_type the first run chose, from what its per-shard plans requantize."""
    any_req = any(src != dst for rec in journal.shards for _, src, dst in rec["plan"])
    if not any_req:
        return None
    moe = any(dst == "MXFP4" and fmt.is_routed_expert(n)
              for rec in journal.shards for n, _, dst in rec["plan"])
    if target == T.Q8_0 and moe:
        return int(LlamaFileType.MOSTLY_MXFP4_MOE)
    return FTYPE_FOR_TARGET[target]


def _plan_from_journal(i: int, rec: dict, src_dir: Path, out_dir: Path) -> ShardPlan:
    """A stand-in plan for a shard finished earlier: names and types from the journal, sizes from disk."""
    out = out_dir / rec["name"]
    f = GGUFFile.open(out)
    try:
        by = {t.name: t for t in f.tensors}
        tensors = []
        for name, src_t, dst_t in rec["plan"]:
            t = by[name]
            st, dt = T[src_t], T[dst_t]
            blk, size = GGML_QUANT_SIZES[st]
            n_in = t.n_elements // blk * size
            tensors.append(TensorPlan(name, t.shape, st, dt, n_in, t.nbytes, fmt.role_of(name, len(t.shape)),
                                      "requant" if st != dt else "kept"))
        kvs = list(f.kv.values())
        alignment = f.alignment
    finally:
        f.close()
    s = rec["source"]
    return ShardPlan(i, rec["name"], src_dir / rec["name"], out, tensors, kvs, alignment, s["size"],
                     rec.get("planned_bytes") or out.stat().st_size, s["mtime_ns"], s["header_sha256"])


# ---------------------------------------------------------------- verify on demand


@dataclass
class VerifyResult:
    output: str
    against: str
    ok: bool
    shards: list[dict]

    def to_dict(self) -> dict:
        return asdict(self)


def verify_model(output: str | os.PathLike, against: str | os.PathLike, *, exact: str = "sample",
                 progress: bool = True) -> VerifyResult:
    """`k3kit verify OUT --against IN`: every output shard against the source shard of the same name."""
    output, against = Path(output), Path(against)
    out_model = Model.open(output)
    try:
        out_paths = list(out_model.paths)
        out_kv = dict(out_model.kv)
    finally:
        out_model.close()
    if against.is_dir():
        src_paths = [against / p.name for p in out_paths]
    else:
        src_paths = [against.with_name(p.name) for p in out_paths]
    missing = [p for p in src_paths if not p.exists()]
    if missing:
        name = out_paths[src_paths.index(missing[0])].name
        raise K3Error(f"{missing[0]}: source shard for {name} not found")
    Model.open(src_paths[0]).close()  # validates the source set
    ft = out_kv.get(FILE_TYPE_KEY)
    if ft is not None and ft.vtype != GGUFValueType.UINT32:
        raise K3Error(f"{out_paths[0]}: general.file_type is {ft.vtype.name}, not UINT32")
    total = sum(p.stat().st_size for p in out_paths)
    journal: dict[str, dict] = {}  # a requant journal next to the output: its hashes must match too
    jp = out_paths[0].parent / JOURNAL_NAME
    if jp.exists():
        journal = {s["name"]: s for s in Journal.load(jp).shards}
    checks: list[ShardCheck] = []
    with byte_progress("verify", total, enabled=progress) as bar:
        for o, s in zip(out_paths, src_paths, strict=True):
            sf = GGUFFile.open(s)
            try:
                kvs = list(sf.kv.values())
            finally:
                sf.close()
            if ft is not None:
                kvs = with_file_type(kvs, int(ft.value))
            chk = verify_shard(o, s, expect_kv=kvs, exact=exact, report=bar.advance)
            rec = journal.get(o.name)
            if rec is not None and rec.get("output") and rec["output"]["sha256"] != chk.sha256:
                want = rec["output"]["sha256"]
                chk.fail(f"sha256 {chk.sha256[:16]}... differs from the journal's {want[:16]}...")
            checks.append(chk)
    return VerifyResult(str(output), str(against), all(c.ok for c in checks), [c.to_dict() for c in checks])
