"""The requant journal: per-shard state, rewritten atomically, and the only licence to delete a source.

OUT_DIR/k3kit-requant.json records, per shard, the source's fingerprint, the plan and the
state: pending -> written -> verified -> source-deleted. A shard becomes "verified" only after
its output was verified and renamed to its final name, and a source is deleted only while the
journal (fsynced) says its shard is verified, so a SIGKILL anywhere loses nothing.

K3KIT_TEST_KILL_AT=phase:shard makes the process (and its worker group) SIGKILL itself at
one of KILL_PHASES, so tests hit every crash window without timing.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import GGMLQuantizationType

from k3kit._io import atomic_write, fsync_dir, read_json
from k3kit.errors import K3Error
from k3kit.gguf.requant.plan import JOURNAL_NAME

if TYPE_CHECKING:
    from k3kit.gguf.requant.plan import Options, ShardPlan

JOURNAL_FORMAT = "k3kit-requant-journal"
JOURNAL_VERSION = 1
MAX_JOURNAL_BYTES = 64 << 20
KILL_ENV = "K3KIT_TEST_KILL_AT"  # test hook: "phase:shard" -> SIGKILL at that point
PGID_ENV = "K3KIT_REQUANT_PGID"
KILL_PHASES = ("write", "written", "verify", "renamed", "journaled", "deleted")

PENDING, WRITTEN, VERIFIED, SOURCE_DELETED = "pending", "written", "verified", "source-deleted"
DONE_STATES = (VERIFIED, SOURCE_DELETED)


def kill_point(phase: str, shard_no: int) -> None:
    """SIGKILL ourselves (and our worker group) at a named point; K3KIT_TEST_KILL_AT=phase:shard."""
    want = os.environ.get(KILL_ENV)
    if not want or want != f"{phase}:{shard_no}":
        return
    pgid = os.environ.get(PGID_ENV)
    if pgid:
        os.killpg(int(pgid), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


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
    names = {t.name for t in GGMLQuantizationType}
    return isinstance(plan, list) and all(
        isinstance(e, list) and len(e) == 3 and all(isinstance(x, str) for x in e)
        and e[1] in names and e[2] in names for e in plan)


class Journal:
    """The per-shard state of one requant, rewritten atomically (temp, fsync, rename, fsync dir)."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
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
            data = read_json(path, max_bytes=MAX_JOURNAL_BYTES)
        except K3Error as e:  # say which JSON file is bad: "journal is not valid JSON (...)"
            raise K3Error(str(e).replace(": not valid JSON", ": journal is not valid JSON", 1)) from None
        ok = (isinstance(data, dict) and data.get("format") == JOURNAL_FORMAT
              and data.get("version") == JOURNAL_VERSION and isinstance(data.get("shards"), list)
              and len(data["shards"]) > 0 and isinstance(data.get("options"), dict)
              and all(_valid_record(s) for s in data["shards"]))
        if not ok:
            raise K3Error(f"{path}: not a k3kit requant journal (version {JOURNAL_VERSION})")
        return cls(path, data)

    @property
    def shards(self) -> list[dict[str, Any]]:
        shards: list[dict[str, Any]] = self.data["shards"]
        return shards

    def shard(self, name: str) -> dict[str, Any]:
        return next(s for s in self.shards if s["name"] == name)

    def save(self) -> None:
        with self.lock:
            atomic_write(self.path, json.dumps(self.data, indent=1))

    def mark_written(self, name: str) -> None:
        with self.lock:
            rec = self.shard(name)
            if rec["state"] == PENDING:
                rec["state"] = WRITTEN
                self.save()

    def commit(self, sp: ShardPlan, size: int, mtime_ns: int, sha256: str, check: dict[str, Any]) -> None:
        """Record shard `sp` as verified: its output is under its final name with these facts."""
        with self.lock:
            rec = self.shard(sp.name)
            rec["state"] = VERIFIED
            rec["output"] = {"size": size, "mtime_ns": mtime_ns, "sha256": sha256}
            keys = ("preserved_ok", "requantized_ok", "exact_rows", "max_rel_rmse")
            rec["check"] = {k: check[k] for k in keys}
            self.save()
        kill_point("journaled", sp.index + 1)

    def delete_source(self, name: str, source: Path, deleted: list[str]) -> None:
        """Delete a verified shard's source (and say so in the journal); never an unverified one."""
        with self.lock:
            rec = self.shard(name)
            if rec["state"] not in DONE_STATES:
                raise AssertionError(f"refusing to delete {source}: shard not verified")
            source.unlink(missing_ok=True)
            fsync_dir(source.parent)
            kill_point("deleted", self.shards.index(rec) + 1)
            rec["state"] = SOURCE_DELETED
            self.save()
        deleted.append(str(source))
