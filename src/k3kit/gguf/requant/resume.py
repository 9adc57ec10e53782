"""--resume: plans for the shards a journal says are still to do, after checking what is on disk.

A verified shard is skipped when its output is still the one the journal recorded (size and
mtime); its source, if present, may then be deleted. Any other shard is redone from scratch
from its source, which must be unchanged (size, mtime, header sha256) and give the same
per-tensor plan. Options must be the journal's. Shards finished earlier are rebuilt as plans
from the journal and their outputs, so the summary still covers the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from k3kit.errors import K3Error
from k3kit.gguf import format as fmt
from k3kit.gguf.reader import GGUFFile
from k3kit.gguf.requant.journal import DONE_STATES, PENDING, SOURCE_DELETED, Journal
from k3kit.gguf.requant.plan import (
    FTYPE_FOR_TARGET,
    JOURNAL_NAME,
    Options,
    ShardPlan,
    TensorPlan,
    header_sha256,
    plan_shard,
    plan_tensors,
)
from k3kit.gguf.requant.worker import clean_partials

T = GGMLQuantizationType


def resume_plans(journal: Journal, input_path: Path, out_dir: Path, opts: Options,
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
    for tmp in out_dir.glob(f".{JOURNAL_NAME}.tmp-*"):  # a journal save the kill interrupted
        tmp.unlink(missing_ok=True)
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
                    journal.delete_source(rec["name"], src, deleted)
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
        done = next((p for p in plans if p.name == rec["name"]), None)
        all_plans.append(done if done is not None else _plan_from_journal(i, rec, src_dir, out_dir))
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


def _plan_from_journal(i: int, rec: dict[str, Any], src_dir: Path, out_dir: Path) -> ShardPlan:
    """A stand-in plan for a shard finished earlier: names and types from the journal, sizes from disk."""
    out = out_dir / rec["name"]
    f = GGUFFile.open(out)
    try:
        by = {t.name: t for t in f.tensors}
        tensors = []
        for name, src_t, dst_t in rec["plan"]:
            t = by[name]
            st, dt = GGMLQuantizationType[src_t], GGMLQuantizationType[dst_t]
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
