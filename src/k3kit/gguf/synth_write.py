"""Writing a planned synthetic kimi-k3 model when write_model's one-call path does not fit: a
first shard of metadata only, or a sparse model (exact headers, the data region a hole).

The set of files appears complete or not at all: every file is written under a temporary name,
and all are renamed once every one is written.
"""

from __future__ import annotations

import os
from pathlib import Path

from k3kit._io import fsync_dir, fsync_file, temp_path
from k3kit.gguf.reader import KV, align_up
from k3kit.gguf.shards import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT
from k3kit.gguf.synth_geometry import I32, U16
from k3kit.gguf.synth_plan import ALIGNMENT, SynthPlan
from k3kit.gguf.writer import TensorSpec, header_bytes, kv, output_paths, write_gguf
from k3kit.progress import ByteProgress


def _shard_jobs(p: SynthPlan, out: Path) -> list[tuple[Path, list[KV], list[TensorSpec]]]:
    """(path, KVs, tensors) of every file: write_model's split convention, empty groups kept.

    Shard 1 has every KV, all shards have split.no / split.count / split.tensors.count; a
    metadata shard is simply a first group without tensors.
    """
    by_name = {t.name: t for t in p.tensors}
    groups = [[by_name[n] for n in names] for names in p.layout]
    paths = output_paths(out, len(groups))
    if len(groups) == 1:
        return [(paths[0], list(p.kv), groups[0])]
    jobs = []
    for i, (path, group) in enumerate(zip(paths, groups, strict=True)):
        split = [kv(SPLIT_NO, U16, i), kv(SPLIT_COUNT, U16, len(groups)),
                 kv(SPLIT_TENSORS_COUNT, I32, len(p.tensors))]
        jobs.append((path, (list(p.kv) if i == 0 else []) + split, group))
    return jobs


def _write_sparse(path: Path, kvs: list[KV], tensors: list[TensorSpec]) -> None:
    """The exact header, then the data region as a hole: ftruncate to the full size."""
    header = header_bytes(kvs, tensors, ALIGNMENT)
    size = len(header) + sum(align_up(t.nbytes, ALIGNMENT) for t in tensors)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(header)
        while view:
            view = view[os.write(fd, view):]
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _write_files(jobs: list[tuple[Path, list[KV], list[TensorSpec]]], *, sparse: bool,
                 progress: ByteProgress | None) -> None:
    """Every file under a temporary name, then all renamed: the set appears complete or not at all."""
    temps = [temp_path(path) for path, _, _ in jobs]
    try:
        for tmp, (_, kvs, tensors) in zip(temps, jobs, strict=True):
            if sparse:
                _write_sparse(tmp, kvs, tensors)
                fsync_file(tmp)
            else:
                write_gguf(tmp, kvs, tensors, alignment=ALIGNMENT, progress=progress)
        for tmp, (path, _, _) in zip(temps, jobs, strict=True):
            os.replace(tmp, path)
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(jobs[0][0].parent)
