"""The mini K3's training text: the standard library sources of the running interpreter.

Every machine that runs k3kit already has this text, so training the mini model needs no
download, and the model card can name exactly what it saw: the Python version, the selection
rules below, and a SHA-256 of each split.

Selection (all deterministic for a given stdlib):
* `*.py` files under `sysconfig.get_paths()["stdlib"]`, walked without following symlinks;
* skipped: `site-packages`/`dist-packages` (not the stdlib), test directories (`test`, `tests`,
  `idle_test`: huge, repetitive, full of deliberately odd text), `__pycache__`, the build-specific
  `config-*` directory and `_sysconfigdata*` (they hold paths of the machine that built Python),
  files over 200 KB (generated tables such as `pydoc_data/topics.py`), files that are not UTF-8;
* a file is held out when a SHA-256 of its relative path falls in the lowest `heldout_fraction`
  of the hash range, so the split never depends on which other files exist and train and
  held-out never share a file.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from k3kit.errors import K3Error

MAX_FILE_BYTES = 200 * 1024
HELDOUT_FRACTION = 0.05
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_HASH_SPAN = 1 << 64


@dataclass
class Corpus:
    """Documents (one per file, text as stored on disk) in sorted relative-path order."""

    train_docs: list[str]
    heldout_docs: list[str]
    manifest: dict
    train_paths: list[str] = field(default_factory=list)
    heldout_paths: list[str] = field(default_factory=list)


def _path_hash(salt: str, rel: str) -> int:
    """A 64-bit number from a relative path: the same on every machine and Python build."""
    digest = hashlib.sha256(f"{salt}:{rel}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def is_heldout(rel: str, fraction: float = HELDOUT_FRACTION) -> bool:
    return _path_hash("heldout", rel) < fraction * _HASH_SPAN


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path) -> list[str]:
    """Relative POSIX paths of the candidate `.py` files under `root`, sorted (size/UTF-8 unchecked)."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-")]
        for name in filenames:
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            path = Path(dirpath, name)
            if path.is_symlink() or not path.is_file():
                continue
            found.append(path.relative_to(root).as_posix())
    return sorted(found)


def _read_text(path: Path) -> str | None:
    """The file's text, or None if it is too big or not UTF-8 (those files are skipped, not errors)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def text_sha256(docs: list[str]) -> str:
    """SHA-256 of the documents' UTF-8 bytes concatenated in order, with nothing between them."""
    h = hashlib.sha256()
    for doc in docs:
        h.update(doc.encode("utf-8"))
    return h.hexdigest()


def build_corpus(max_bytes: int | None = None, *, root: Path | str | None = None,
                 heldout_fraction: float = HELDOUT_FRACTION) -> Corpus:
    """Read the stdlib and split it into train and held-out documents.

    `max_bytes` caps the total UTF-8 bytes of both splits. Files are admitted in an order given
    by a second path hash (not alphabetically, which would fill a small budget with `_aix_support`,
    `asyncio`, ...), skipping any file that would overflow the budget, so a small corpus still
    samples the whole library; the admitted files are then returned in sorted path order.
    """
    root = Path(root) if root is not None else stdlib_dir()
    if not root.is_dir():
        raise K3Error(f"{root}: standard library directory not found")
    if max_bytes is not None and max_bytes <= 0:
        raise K3Error(f"{root}: max_bytes must be positive, got {max_bytes}")
    if not 0.0 <= heldout_fraction < 1.0:
        raise K3Error(f"{root}: heldout_fraction must be in [0, 1), got {heldout_fraction}")

    candidates = list_sources(root)
    if max_bytes is not None:
        candidates.sort(key=lambda rel: (_path_hash("order", rel), rel))

    texts: dict[str, str] = {}
    total = 0
    skipped = 0
    for rel in candidates:
        text = _read_text(root / rel)
        if text is None:
            skipped += 1
            continue
        size = len(text.encode("utf-8"))
        if max_bytes is not None and total + size > max_bytes:
            continue
        texts[rel] = text
        total += size

    if not texts:
        raise K3Error(f"{root}: no usable .py files (after the directory, size, UTF-8 and max_bytes filters)")

    train_paths: list[str] = []
    heldout_paths: list[str] = []
    for rel in sorted(texts):
        (heldout_paths if is_heldout(rel, heldout_fraction) else train_paths).append(rel)
    train_docs = [texts[p] for p in train_paths]
    heldout_docs = [texts[p] for p in heldout_paths]

    manifest = {
        "source": "CPython standard library (*.py)",
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "rules": {
            "skip_dirs": sorted(SKIP_DIRS) + ["config-*"],
            "skip_files": ["_sysconfigdata*", f"> {MAX_FILE_BYTES} bytes", "not UTF-8"],
            "heldout": f"sha256('heldout:' + relpath)[:8] < {heldout_fraction} * 2**64",
            "max_bytes": max_bytes,
        },
        "skipped_files": skipped,
        "sha256_definition": "sha256 of the split's documents (UTF-8) concatenated in sorted path order",
        "train": _split_summary(train_paths, train_docs),
        "heldout": _split_summary(heldout_paths, heldout_docs),
    }
    return Corpus(train_docs, heldout_docs, manifest, train_paths, heldout_paths)


def _split_summary(paths: list[str], docs: list[str]) -> dict:
    return {
        "files": len(docs),
        "bytes": sum(len(d.encode("utf-8")) for d in docs),
        "sha256": text_sha256(docs),
        "paths_sha256": hashlib.sha256("\n".join(paths).encode()).hexdigest(),
    }
