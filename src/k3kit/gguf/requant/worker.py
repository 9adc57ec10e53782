"""One shard's job (write, verify, rename; never touching its source) and the pool that runs them.

A job writes its output under the hidden `.NAME.partial` name (the writer's own temp, fsync
and rename), drops it from the page cache so the check reads what is on disk, verifies it
against the source (k3kit.gguf.requant.verify) and only then renames it to NAME. Requantized
tensors stream: one row chunk (plan.CHUNK_ELEMS floats) in memory per worker, whatever the
tensor's size. Jobs run in spawned processes, at most `jobs` at once and only while the disk
ledger says their outputs fit; each finished job is journaled (and its source deleted, with
--delete-source) by the parent, one at a time.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from k3kit._io import fsync_dir
from k3kit.errors import K3Error, VerifyError
from k3kit.gguf import quants
from k3kit.gguf.reader import GGUFFile, TensorInfo
from k3kit.gguf.requant import plan
from k3kit.gguf.requant.journal import PGID_ENV, Journal, kill_point
from k3kit.gguf.requant.plan import DISK_MARGIN, ShardPlan, TensorPlan, header_sha256
from k3kit.gguf.requant.verify import verify_shard
from k3kit.gguf.writer import FileRange, Source, TensorSpec, write_gguf

if TYPE_CHECKING:
    from multiprocessing.queues import Queue


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
    check: dict[str, Any] = field(default_factory=dict)


def _requant_source(f: GGUFFile, t: TensorInfo, p: TensorPlan, hashes: dict[str, str],
                    report: Callable[[int], None] | None,
                    on_call: Callable[[], None]) -> Callable[[], Iterator[np.ndarray]]:
    """A streaming writer source: `t` dequantized and quantized to the target in row chunks.

    Memory per worker is one chunk (plan.CHUNK_ELEMS floats and the codec's temporaries),
    whatever the tensor's size; the sha256 of the bytes produced is left in `hashes` for the
    verifier.
    """

    def make() -> Iterator[np.ndarray]:
        on_call()
        ne0 = p.shape[0]
        rows = t.n_elements // ne0
        src_row = quants.row_bytes(p.src_type, ne0)
        raw = f.view(t)
        h = hashlib.sha256()
        step = max(1, plan.CHUNK_ELEMS // ne0)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            x = quants.dequantize(np.asarray(raw[r0 * src_row:r1 * src_row]), p.src_type, (r1 - r0) * ne0)
            if not np.isfinite(x).all():
                row = r0 + int(np.flatnonzero(~np.isfinite(x))[0]) // ne0
                raise K3Error(f"{f.path}: tensor '{t.name}' row {row} decodes to non-finite values "
                              f"(corrupt {p.src_type.name} data?)")
            q = quants.quantize(x.reshape(r1 - r0, ne0), p.dst_type)
            h.update(q.data)
            if report is not None:
                report((r1 - r0) * src_row)
            yield q
        hashes[t.name] = h.hexdigest()

    return make


def clean_partials(out_dir: Path, name: str) -> None:
    """Remove what a killed run may have left for shard `name`: its partial and writer temps."""
    partial = f".{name}.partial"
    for p in out_dir.glob(f".{partial}.tmp-*"):
        p.unlink(missing_ok=True)
    (out_dir / partial).unlink(missing_ok=True)


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
            kill_point("write", no)  # mid-write: earlier tensors are already in the temp file

    n_requant = sum(p.requant for p in sp.tensors)
    specs = []
    for p in sp.tensors:
        t = by_name[p.name]
        src: Source = (_requant_source(f, t, p, hashes, report, on_call) if p.requant
                       else FileRange(sp.source, t.offset, t.nbytes))
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
        kill_point("written", no)
        types = {p.name: p.dst_type for p in sp.tensors}
        chk = verify_shard(sp.partial, sp.source, expect_kv=sp.kv, expect_types=types,
                           expect_hashes=hashes, expect_size=sp.out_size, exact=exact, report=report,
                           on_tensor=lambda i: kill_point("verify", no) if i == 1 else None)
        if not chk.ok:
            raise VerifyError(f"{sp.output}: verification failed: {chk.problems[0]}"
                              + (f" (+{chk.n_problems - 1} more)" if chk.n_problems > 1 else ""))
        os.replace(sp.partial, sp.output)
        fsync_dir(sp.output.parent)
    except BaseException:
        clean_partials(sp.output.parent, sp.name)
        raise
    kill_point("renamed", no)
    st = sp.output.stat()
    n_req = sum(p.requant for p in sp.tensors)
    return ShardResult(sp.name, str(sp.output), st.st_size, st.st_mtime_ns, chk.sha256, n_req,
                       len(sp.tensors) - n_req, round(time.perf_counter() - t0, 3), round(t_write, 3),
                       chk.to_dict())


def commit_shard(journal: Journal, sp: ShardPlan, r: ShardResult, delete_source: bool,
                 deleted: list[str]) -> None:
    """Journal a finished job as verified, then (with --delete-source) delete its source."""
    journal.commit(sp, r.size, r.mtime_ns, r.sha256, r.check)
    if delete_source:
        journal.delete_source(sp.name, sp.source, deleted)


# ---------------------------------------------------------------- the pool


_QUEUE = None


def _worker_init(queue: Queue[int | str]) -> None:
    global _QUEUE
    _QUEUE = queue
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles ^C


def _worker_report(msg: int | str) -> None:
    if _QUEUE is not None:
        _QUEUE.put(msg)


def _worker_run(sp: ShardPlan, exact: str) -> ShardResult:
    return run_shard(sp, exact, _worker_report, _worker_report)


def run_jobs(order: list[ShardPlan], journal: Journal, jobs: int, delete_source: bool, exact: str,
             disk: dict[str, Any], advance: Callable[[int], None], results: dict[str, ShardResult],
             deleted: list[str]) -> None:
    """Run shard jobs, at most `jobs` at once and only while the disk ledger says they fit."""
    if jobs == 1 or len(order) == 1:
        for sp in order:
            r = run_shard(sp, exact, advance, journal.mark_written)
            results[sp.name] = r
            commit_shard(journal, sp, r, delete_source, deleted)
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
        os.environ[PGID_ENV] = str(os.getpid())  # test kill hook: take the workers along
    reclaim = delete_source and all(plan.same_filesystem(p.source, p.output.parent) for p in order)
    avail = disk["free"]
    pending = list(order)
    running: dict[Future[ShardResult], ShardPlan] = {}
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
                    commit_shard(journal, sp, r, delete_source, deleted)
                    if reclaim:
                        avail += sp.src_size
    finally:
        stop.set()
        drainer.join()
        os.environ.pop(PGID_ENV, None)
    if error is not None:
        raise error
