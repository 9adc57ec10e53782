"""Check that a requantized shard is exactly what its source shard should have become.

A requant deletes its input shard by shard, so the output must be proven before the input
goes. One sequential pass over the output file checks, per tensor:

* preserved tensors (same type in and out): the bytes are identical to the source's
  (compared directly, which is stronger than comparing hashes and cheaper);
* requantized tensors: every element of dequantize(out) lies within a per-block bound of
  dequantize(source) that follows from the target format (ERROR_BOUNDS), the tensor's
  relative RMSE is below a per-format ceiling, and a deterministic sample of rows (or every
  row) is byte-identical to quantizing the dequantized source again;
* when the writer recorded hashes of the bytes it produced, the file holds exactly those;
* names, order, shapes, types, KVs and the file size are what the plan says.

The same pass hashes the whole file (sha256), which is what the requant journal records.
`verify_model` (`k3kit verify OUT --against IN`) runs it for every shard of a model, and
checks the hashes a requant journal next to the output recorded.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from k3kit.errors import K3Error
from k3kit.gguf import quants
from k3kit.gguf.reader import KV, GGUFFile, TensorInfo, kv_int
from k3kit.gguf.requant.journal import Journal
from k3kit.gguf.requant.plan import FILE_TYPE_KEY, JOURNAL_NAME, with_file_type
from k3kit.gguf.shards import Model
from k3kit.gguf.writer import encode_kv
from k3kit.progress import byte_progress

T = GGMLQuantizationType
CHUNK_ELEMS = 4 << 20  # float32 elements per verification chunk (16 MiB per array)
HASH_CHUNK = 16 << 20
EXACT_STRIDE = 16  # "sample": rows 0, 16, 32, ... and the last row are requantized again
MAX_PROBLEMS = 20


@dataclass(frozen=True)
class Bound:
    """How far dequantize(requant(x)) may be from x for one target format.

    Per element: |err| <= frac * R + floor, with R = max(x, 0) - min(x, 0) over the
    target's block (the range its scale and min must cover, 0 included as ggml's
    quantizers include it). Per tensor: RMSE <= rel_rmse * RMS(x) + floor.

    Q4_K (256 weights, 8 sub-blocks of 32, 16 levels): ggml's search keeps the inverse
    scale between 14/r and 16/r for a sub-block range r <= R, so rounding and the one
    level of clamping the search may accept cost at most R/14; the 6-bit sub-block scale
    and min add at most 15 * d/2 + dmin/2 <= R/50 more: |err| < R/10, bounded by R/8.
    Measured maxima on Gaussian, uniform, Student-t, sparse and offset data: 0.048-0.061 R;
    relative RMSE 0.01-0.077, bounded by 0.15. `floor` covers fp16 scales that underflow
    (d < 2^-24 flushes a block to its min): (63*15 + 63) * 2^-24 rounded up to 2^-13.
    Q8_0: half a step (amax/254) plus fp16 rounding of d (127 * 2^-11 * d) < R/200: R/100.
    MXFP4: the shared exponent leaves values above 6 * 2^e clamped, up to R/4 measured:
    R/2. F16/BF16: one rounding (2^-11, 2^-8 relative), F32 exact.
    """

    block: int
    frac: float
    rel_rmse: float
    floor: float


ERROR_BOUNDS: dict[GGMLQuantizationType, Bound] = {
    T.Q4_K: Bound(256, 1 / 8, 0.15, 2.0**-13),
    T.Q8_0: Bound(32, 1 / 100, 0.02, 2.0**-16),
    T.MXFP4: Bound(32, 1 / 2, 0.25, 2.0**-120),
    T.F16: Bound(1, 2.0**-10, 2.0**-10, 2.0**-24),
    T.BF16: Bound(1, 2.0**-7, 2.0**-7, 2.0**-126),
    T.F32: Bound(1, 0.0, 0.0, 0.0),
}


@dataclass
class ShardCheck:
    """What verifying one output shard found; `ok` only when `problems` is empty."""

    output: str
    source: str
    tensors: int = 0
    preserved_ok: int = 0
    requantized_ok: int = 0
    exact_rows: int = 0
    max_rel_rmse: float = 0.0
    max_err_ratio: float = 0.0  # worst |err| / allowed over all requantized blocks
    bytes: int = 0
    sha256: str = ""
    problems: list[str] = field(default_factory=list)
    n_problems: int = 0

    @property
    def ok(self) -> bool:
        return self.n_problems == 0

    def fail(self, problem: str) -> None:
        self.n_problems += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def kv_bytes(kvs: Sequence[KV]) -> list[bytes]:
    return [encode_kv(k) for k in kvs]


def _row_bytes(qtype: GGMLQuantizationType, ne0: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return ne0 // block * size


class _FileHasher:
    """sha256 of a file fed in increasing offsets; gaps (header, padding) are read from the map."""

    def __init__(self, mm: np.ndarray) -> None:
        self.mm = mm
        self.h = hashlib.sha256()
        self.pos = 0

    def upto(self, offset: int) -> None:
        while self.pos < offset:
            end = min(offset, self.pos + HASH_CHUNK)
            self.h.update(self.mm[self.pos:end].data)
            self.pos = end

    def feed(self, offset: int, data: np.ndarray) -> None:
        self.upto(offset)
        self.h.update(data.data)
        self.pos = offset + data.nbytes


def _check_preserved(chk: ShardCheck, name: str, src: np.ndarray, out: np.ndarray, offset: int,
                     hasher: _FileHasher, report: Callable[[int], None] | None) -> bool:
    same = True
    for pos in range(0, out.nbytes, HASH_CHUNK):
        o = out[pos:pos + HASH_CHUNK]
        hasher.feed(offset + pos, o)
        if same and not np.array_equal(o, src[pos:pos + HASH_CHUNK]):
            bad = int(np.flatnonzero(o != src[pos:pos + HASH_CHUNK])[0]) + pos
            chk.fail(f"tensor '{name}': preserved bytes differ from the source at byte {bad}")
            same = False
        if report is not None:
            report(o.nbytes)
    return same


def _check_requantized(chk: ShardCheck, t_src: TensorInfo, t_out: TensorInfo, src: np.ndarray,
                       out: np.ndarray, hasher: _FileHasher, exact: str,
                       report: Callable[[int], None] | None) -> tuple[bool, str]:
    """Bounds, RMSE and exact requantization of one tensor; returns (ok, sha256 of its bytes)."""
    name, ne0 = t_out.name, t_out.shape[0]
    bound = ERROR_BOUNDS.get(t_out.ggml_type)
    if bound is None or t_src.ggml_type not in quants.DEQUANTIZE_TYPES:
        chk.fail(f"tensor '{name}': cannot verify {t_src.ggml_type.name} -> {t_out.ggml_type.name}")
        return False, ""
    rows = t_out.n_elements // ne0
    sr, orow = _row_bytes(t_src.ggml_type, ne0), _row_bytes(t_out.ggml_type, ne0)
    step = max(1, CHUNK_ELEMS // ne0)
    th = hashlib.sha256()
    sse = ssx = 0.0
    worst = 0.0
    ok = True
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        ob = out[r0 * orow:r1 * orow]
        hasher.feed(t_out.offset + r0 * orow, ob)
        th.update(ob.data)
        if report is not None:
            report(ob.nbytes)
        if not ok:
            continue  # keep hashing the file, one problem per tensor is enough
        n = (r1 - r0) * ne0
        x = quants.dequantize(np.asarray(src[r0 * sr:r1 * sr]), t_src.ggml_type, n)
        y = quants.dequantize(np.asarray(ob), t_out.ggml_type, n)
        if not np.isfinite(x).all():
            row = r0 + int(np.flatnonzero(~np.isfinite(x))[0]) // ne0
            chk.fail(f"tensor '{name}': source row {row} has non-finite values")
            ok = False
            continue
        if not np.isfinite(y).all():
            row = r0 + int(np.flatnonzero(~np.isfinite(y))[0]) // ne0
            chk.fail(f"tensor '{name}': output row {row} has non-finite values")
            ok = False
            continue
        xb, yb = x.reshape(-1, bound.block), y.reshape(-1, bound.block)
        rng = np.maximum(xb.max(axis=1), 0) - np.minimum(xb.min(axis=1), 0)
        allowed = rng * np.float32(bound.frac) + np.float32(bound.floor)
        err = np.abs(xb - yb).max(axis=1)
        ratio = err / np.where(allowed > 0, allowed, np.float32(1))
        ratio[(allowed == 0) & (err == 0)] = 0
        ratio[(allowed == 0) & (err > 0)] = np.inf
        worst = max(worst, float(ratio.max(initial=0.0)))
        if (ratio > 1).any():
            blk = int(np.flatnonzero(ratio > 1)[0])
            row = r0 + blk * bound.block // ne0
            chk.fail(f"tensor '{name}': row {row} off by {float(err[blk]):.3g} "
                     f"(bound {float(allowed[blk]):.3g} for {t_out.ggml_type.name})")
            ok = False
            continue
        d = (x - y).astype(np.float64)
        sse += float(d @ d)
        xd = x.astype(np.float64)
        ssx += float(xd @ xd)
        if exact != "none":
            idx = np.arange(r0, r1)
            if exact == "sample":
                idx = idx[(idx % EXACT_STRIDE == 0) | (idx == rows - 1)]
            if idx.size:
                local = idx - r0
                again = quants.quantize(x.reshape(-1, ne0)[local], t_out.ggml_type)
                have = np.asarray(ob).reshape(-1, orow)[local]
                if not np.array_equal(again, have):
                    bad = int(idx[np.flatnonzero((again != have).any(axis=1))[0]])
                    chk.fail(f"tensor '{name}': row {bad} is not the {t_out.ggml_type.name} "
                             f"quantization of the source row")
                    ok = False
                    continue
                chk.exact_rows += int(idx.size)
    if ok:
        n = t_out.n_elements
        rmse, rms = np.sqrt(sse / n), np.sqrt(ssx / n)
        rel = rmse / rms if rms > 0 else 0.0
        chk.max_rel_rmse = max(chk.max_rel_rmse, float(rel))
        chk.max_err_ratio = max(chk.max_err_ratio, worst)
        if rmse > bound.rel_rmse * rms + bound.floor:
            chk.fail(f"tensor '{name}': relative RMSE {rel:.4f} above the {t_out.ggml_type.name} "
                     f"bound {bound.rel_rmse}")
            ok = False
    return ok, th.hexdigest()


def verify_shard(output: str | os.PathLike[str], source: str | os.PathLike[str], *,
                 expect_kv: Sequence[KV] | None = None,
                 expect_types: dict[str, GGMLQuantizationType] | None = None,
                 expect_hashes: dict[str, str] | None = None,
                 expect_size: int | None = None,
                 exact: str = "sample",
                 report: Callable[[int], None] | None = None,
                 on_tensor: Callable[[int], None] | None = None) -> ShardCheck:
    """Verify one output shard against its source shard (see the module docstring).

    expect_kv: the output's KVs, in order (None: the source's, general.file_type excepted).
    expect_types: the planned output type per tensor (None: any type; a changed type is
    checked as a requantization). expect_hashes: sha256 of the bytes the writer produced
    for requantized tensors. exact: "all", "sample" or "none" rows requantized again.
    `on_tensor(i)` is called after each tensor (a hook for tests that kill mid-verify).
    """
    output, source = Path(output), Path(source)
    chk = ShardCheck(str(output), str(source))
    src = GGUFFile.open(source)
    out = GGUFFile.open(output)
    try:
        chk.bytes = out.size
        if expect_size is not None and out.size != expect_size:
            chk.fail(f"file is {out.size} bytes, planned {expect_size}")
        if expect_kv is not None:
            want = kv_bytes(expect_kv)
            have = kv_bytes(list(out.kv.values()))
            if want != have:
                keys_w = [k.key for k in expect_kv]
                keys_h = list(out.kv)
                diff = next((k for k, a, b in zip(keys_w, want, have, strict=False) if a != b), None)
                if keys_w != keys_h:
                    first = next((a for a, b in zip(keys_w, keys_h, strict=False) if a != b), "?")
                    chk.fail(f"KV keys differ: expected {len(keys_w)} keys, found {len(keys_h)} "
                             f"(first difference: {first})")
                else:
                    chk.fail(f"KV '{diff}' differs from the expected value")
        else:
            skip = {FILE_TYPE_KEY}
            want = kv_bytes([k for k in src.kv.values() if k.key not in skip])
            have = kv_bytes([k for k in out.kv.values() if k.key not in skip])
            if want != have:
                chk.fail("KVs differ from the source's (general.file_type aside)")
        src_names = [t.name for t in src.tensors]
        out_names = [t.name for t in out.tensors]
        if src_names != out_names:
            missing = sorted(set(src_names) - set(out_names))
            extra = sorted(set(out_names) - set(src_names))
            what = (f"missing {missing[:3]}" if missing else "") + (f" extra {extra[:3]}" if extra else "")
            chk.fail(f"tensor names differ from the source: {what.strip() or 'different order'}")
        by_src = {t.name: t for t in src.tensors}
        mm = np.memmap(output, dtype=np.uint8, mode="r")
        hasher = _FileHasher(mm)
        chk.tensors = len(out.tensors)
        for i, t in enumerate(sorted(out.tensors, key=lambda t: t.offset)):
            s = by_src.get(t.name)
            if s is None:
                hasher.upto(t.offset)
                continue
            if s.shape != t.shape:
                chk.fail(f"tensor '{t.name}': shape {list(t.shape)}, source {list(s.shape)}")
                continue
            want_type = (expect_types or {}).get(t.name, t.ggml_type)
            if t.ggml_type != want_type:
                chk.fail(f"tensor '{t.name}': type {t.ggml_type.name}, planned {want_type.name}")
                continue
            o = mm[t.offset:t.offset + t.nbytes]
            if t.ggml_type == s.ggml_type:
                if _check_preserved(chk, t.name, src.view(s), o, t.offset, hasher, report):
                    chk.preserved_ok += 1
            else:
                ok, digest = _check_requantized(chk, s, t, src.view(s), o, hasher, exact, report)
                if ok and expect_hashes is not None and expect_hashes.get(t.name) != digest:
                    chk.fail(f"tensor '{t.name}': bytes on disk differ from the bytes written")
                    ok = False
                chk.requantized_ok += ok
            if on_tensor is not None:
                on_tensor(i)
        hasher.upto(out.size)
        chk.sha256 = hasher.h.hexdigest()
        del mm
    finally:
        src.close()
        out.close()
    return chk


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- a whole model


@dataclass
class VerifyResult:
    output: str
    against: str
    ok: bool
    shards: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify_model(output: str | os.PathLike[str], against: str | os.PathLike[str], *, exact: str = "sample",
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
    journal: dict[str, dict[str, Any]] = {}  # a requant journal next to the output: its hashes must match too
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
                kvs = with_file_type(kvs, kv_int(ft))
            chk = verify_shard(o, s, expect_kv=kvs, exact=exact, report=bar.advance)
            rec = journal.get(o.name)
            if rec is not None and rec.get("output") and rec["output"]["sha256"] != chk.sha256:
                want = rec["output"]["sha256"]
                chk.fail(f"sha256 {chk.sha256[:16]}... differs from the journal's {want[:16]}...")
            checks.append(chk)
    return VerifyResult(str(output), str(against), all(c.ok for c in checks), [c.to_dict() for c in checks])
