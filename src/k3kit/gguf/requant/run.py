"""`requantize`: the whole model, shard by shard, as the package docstring describes.

Fresh run: plan every shard, refuse a non-empty output directory, write the journal, order
the shards by the disk preflight and run the jobs. --resume: plans from the journal (resume.py).
--dry-run: the plan and the disk check only, nothing written.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from k3kit.errors import K3Error
from k3kit.gguf import format as fmt
from k3kit.gguf.requant.journal import Journal
from k3kit.gguf.requant.plan import (
    JOURNAL_NAME,
    Options,
    ShardPlan,
    existing_ancestor,
    output_file_type,
    plan_shard,
    plan_tensors,
    preflight,
    preflight_report,
)
from k3kit.gguf.requant.resume import resume_plans
from k3kit.gguf.requant.worker import ShardResult, run_jobs
from k3kit.gguf.shards import Model
from k3kit.progress import byte_progress


@dataclass
class RequantResult:
    """What `k3kit requant` did (or would do with --dry-run); printed for people or as --json."""

    output_dir: str
    target: str
    file_type: int | None
    dry_run: bool
    shards: list[dict[str, Any]]
    by_role: list[dict[str, Any]]
    kept: list[dict[str, Any]]
    bytes_in: int
    bytes_out: int
    requantized: int
    copied: int
    disk: dict[str, Any]
    seconds: float = 0.0
    gb_per_s: float = 0.0
    deleted_sources: list[str] = field(default_factory=list)
    resumed_skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _by_role(plans: Sequence[ShardPlan]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
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


def requantize(input_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], opts: Options, *,
               jobs: int = 1, delete_source: bool = False, resume: bool = False, dry_run: bool = False,
               exact: str = "sample", progress: bool = True) -> RequantResult:
    """Requantize a (sharded) model into out_dir; see the package docstring for the protocol."""
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
        all_plans, skipped, deleted = resume_plans(journal, input_path, out_dir, opts, delete_source)
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
        _, disk = preflight_report(todo, existing_ancestor(out_dir), delete_source)
        return _result(out_dir, target, ftype, True, all_plans, by_role, kept, disk, t0, {}, deleted, skipped)

    out_dir.mkdir(parents=True, exist_ok=True)
    order, disk = preflight(todo, out_dir, delete_source)
    journal.save()
    results: dict[str, ShardResult] = {}
    total = sum(sum(p.nbytes_in for p in sp.tensors) + sp.out_size for sp in order)
    with byte_progress(f"requant -> {target.name}", total, enabled=progress) as bar:
        run_jobs(order, journal, jobs, delete_source, exact, disk, bar.advance, results, deleted)
    return _result(out_dir, target, ftype, False, all_plans, by_role, kept, disk, t0, results, deleted,
                   skipped)


def _result(out_dir: Path, target: GGMLQuantizationType, ftype: int | None, dry_run: bool,
            plans: list[ShardPlan], by_role: list[dict[str, Any]], kept: list[dict[str, Any]],
            disk: dict[str, Any], t0: float, results: dict[str, ShardResult], deleted: list[str],
            skipped: list[str]) -> RequantResult:
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
