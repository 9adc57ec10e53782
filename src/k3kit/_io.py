"""The two file operations every part of k3kit shares: an atomic write and a bounded JSON read.

An output is never half-written: it goes to a hidden temporary name in the same directory,
is fsynced, renamed over the target and the directory fsynced, and the temporary is removed
on any failure. A JSON input is treated as hostile: its size is bounded before it is read,
and every problem becomes a one-line error naming the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3kit.errors import K3Error

MAX_JSON_BYTES = 64 << 20


def temp_path(path: Path) -> Path:
    """The hidden temporary name an output is written under before its atomic rename."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def fsync_dir(d: Path) -> None:
    """Make a rename in directory `d` durable."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes | str | Callable[[Path], None]) -> Path:
    """Write `path` all at once or not at all: temp name, fsync, rename, fsync the directory.

    `data` is the whole content (bytes, or str written as UTF-8), or a function that writes
    the content to the temporary path it is given (for writers that want a file name, such as
    safetensors or a GGUF writer).
    """
    path = Path(path)
    tmp = temp_path(path)
    try:
        if callable(data):
            data(tmp)
        else:
            tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2) -> Path:
    """`obj` as JSON (with a final newline), atomically."""
    return atomic_write(path, json.dumps(obj, indent=indent) + "\n")


def read_json(path: str | os.PathLike[str], what: str = "JSON", *, max_bytes: int = MAX_JSON_BYTES,
              error: type[K3Error] = K3Error) -> Any:
    """Parse a JSON file of bounded size; `error` (a K3Error) naming the file on any problem."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    if size > max_bytes:
        raise error(f"{path}: {size} bytes is too large for a {what} file (limit {max_bytes})")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise error(f"{path}: not valid {what} ({str(e).splitlines()[0]})") from None
