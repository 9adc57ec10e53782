"""Progress display for long work: bytes/s and ETA on a terminal, silent for --json or pipes.

One small wrapper so every long command (rewrite, requant, synth, convert, train) shows the
same kind of bar and can be switched off in one place.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


class ByteProgress:
    """A byte counter with an optional rich bar; `advance(n)` is cheap enough for 1 MiB chunks."""

    def __init__(self, progress: Progress | None, task: TaskID | None) -> None:
        self._progress = progress
        self._task = task
        self.done = 0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, advance=nbytes)


@contextmanager
def byte_progress(description: str, total: int, enabled: bool = True) -> Iterator[ByteProgress]:
    """Show a bar with bytes/s and ETA on stderr when `enabled` and stderr is a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield ByteProgress(None, None)
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=True,
    )
    with progress:
        task = progress.add_task(description, total=total)
        yield ByteProgress(progress, task)


@contextmanager
def count_progress(description: str, total: int, unit: str, enabled: bool = True) -> Iterator[ByteProgress]:
    """The same bar counting items (tokens, rows) instead of bytes: `advance(n)` adds n `unit`s."""
    if not enabled or not sys.stderr.isatty():
        yield ByteProgress(None, None)
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeRemainingColumn(),
        transient=True,
    )
    with progress:
        task = progress.add_task(description, total=total)
        yield ByteProgress(progress, task)
