"""The server's prompt cache: sequence states kept between requests, reused by longest prefix.

Agents and chats resend the whole conversation with every turn. A hybrid model cannot just keep
its attention cache: the recurrent state (K3's KDA S and conv windows) summarizes every position
and is valid at exactly one. So an entry holds, for the tokens a finished request ran:
  * the positional rows of every position (K3's MLA latents): row i depends only on tokens
    0..i, so the first p rows serve any prompt that shares those p tokens;
  * recurrent copies at a few positions (`Point`s): every `interval` tokens of the prompt, at the
    end of the prompt (with that row's logits, so a resent prompt runs no row at all) and at the
    end of the request (prompt + completion: where the next turn starts);
  * with a draft, the feature rows its ring held (`RingRows`), so a restored sequence drafts
    from the same context as one that ran the whole prompt.
A lookup finds, over every entry, the deepest point inside the common prefix (and, for a
drafting sequence, with its ring window covered); the scheduler restores it and prefills only
the rest. On a model whose rows do not depend on how a prompt is cut into passes (K3 on the
CPU in the ggml arithmetic), a hit changes no bit of the output.

Entries live in RAM under a byte budget (least recently used out first); with a directory
(k3kit.serve.prompt_cache_disk) evicted entries and, at shutdown, all of them are written there
and found again after a restart. An entry that extends another (the next turn of the same
conversation) absorbs it: a conversation is one entry with a point per turn.

Model-neutral: the model is a runtime.protocols.SnapshotModel; tokens are ints.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

log = logging.getLogger("k3kit.serve")

MIN_INTERVAL = 256        # tokens between recurrent copies at least (default from the state size)
MAX_INTERVAL = 16384
DEFAULT_BUDGET_CAP = 8 << 30    # the RAM default never exceeds llama-server's --cache-ram default


def default_interval(recurrent_bytes: int, positional_row_bytes: int) -> int:
    """Tokens between recurrent copies: the power of two at least twice the positions whose rows
    weigh one recurrent copy, so the copies cost at most about half what the rows they sit on do
    (the mini: 256; K3, ~0.4 GB of KDA state against 55 KB a position: 16384)."""
    ratio = recurrent_bytes / max(1, positional_row_bytes)
    n = MIN_INTERVAL
    while n < 2 * ratio and n < MAX_INTERVAL:
        n *= 2
    return n


def default_budget(available: int) -> int:
    """RAM for the cache when the user does not say: a quarter of what is free, at most 8 GiB."""
    return min(DEFAULT_BUDGET_CAP, max(0, available) // 4)


FORMAT = "k3kit-prompt-cache-2"   # 2: MLA latents saved as attention uses them (rounded)
HEAD_BYTES = 8 << 20      # of each model file hashed into its identity (GGUF metadata and tensor table)


def identity(model: str | Path, draft: str | Path | None = None, dtype: object = None,
             arith: object = None) -> str:
    """What a saved state is valid for: the model file (its size and first HEAD_BYTES: every KV
    and tensor offset), the draft's (its taps fill the ring), the compute dtype and arithmetic,
    and this format. A file written under another identity is never used."""
    parts = [FORMAT, str(dtype), str(arith)]
    for path in (model, draft):
        if path is None:
            parts.append("-")
            continue
        h = hashlib.sha256()
        p = Path(path)
        h.update(str(p.stat().st_size).encode())
        with open(p, "rb") as f:
            h.update(f.read(HEAD_BYTES))
        parts.append(h.hexdigest())
    return "/".join(parts)


def _nbytes(ts: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@dataclass(frozen=True)
class Point:
    """A position an entry can be restored at: the recurrent state there, and the logits of the
    row before it when known (then a prompt ending exactly here needs no row run)."""

    pos: int
    recurrent: tuple[Tensor, ...]
    logits: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.recurrent) + (0 if self.logits is None else _nbytes([self.logits]))


@dataclass(frozen=True)
class RingRows:
    """A draft's feature rows for positions [start, start + len(data)), as its ring stores them."""

    start: int
    data: Tensor
    scale: Tensor | None
    storage: str

    @property
    def end(self) -> int:
        return self.start + self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return _nbytes([self.data]) + (0 if self.scale is None else _nbytes([self.scale]))

    def covers(self, begin: int, end: int) -> bool:
        return self.start <= begin and end <= self.end

    def rows(self, begin: int, end: int) -> RingRows:
        a, b = begin - self.start, end - self.start
        return RingRows(begin, self.data[a:b], None if self.scale is None else self.scale[a:b], self.storage)


@dataclass
class Entry:
    """The tokens one request ran, their positional rows, its points and ring rows."""

    tokens: np.ndarray                    # int64 [n]
    positional: tuple[Tensor, ...]        # each [n, width]
    points: dict[int, Point]
    ring: RingRows | None = None
    used: float = field(default_factory=time.monotonic)
    disk: Path | None = None              # where it is written, if it is
    preloaded: bool = False               # read from the directory at start-up, not yet hit

    @property
    def key(self) -> str:
        return hashlib.sha256(self.tokens.astype("<i8").tobytes()).hexdigest()[:32]

    @property
    def nbytes(self) -> int:
        return (self.tokens.nbytes + _nbytes(self.positional) + sum(p.nbytes for p in self.points.values())
                + (0 if self.ring is None else self.ring.nbytes))


@dataclass(frozen=True)
class Hit:
    """What a lookup found: restore `recurrent` and the first `pos` positional rows, then run the
    prompt from `pos` (none of it when pos is the prompt's length: sample from `logits`)."""

    pos: int
    recurrent: tuple[Tensor, ...]
    positional: tuple[Tensor, ...]
    logits: Tensor | None
    ring: RingRows | None
    key: str


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0
    evictions: int = 0
    stored: int = 0
    disk_hits: int = 0
    disk_writes: int = 0
    disk_skipped: int = 0                 # corrupt, foreign or truncated files passed over


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


def _usable(points: dict[int, bool], ring: tuple[int, int] | None, c: int, n: int,
            window: int | None) -> int:
    """The deepest point <= c (the common prefix) a prompt of n tokens can restore: below n, or at
    n with its logits; with a draft window, its ring rows covered. 0: none."""
    best = 0
    for pos, has_logits in points.items():
        if pos <= best or pos > c or (pos == n and not has_logits) or pos > n:
            continue
        if window is not None:
            if ring is None or not (ring[0] <= max(0, pos - window) and pos <= ring[1]):
                continue
        best = pos
    return best


class PromptCache:
    """Entries in RAM under `budget` bytes, optionally spilled to a directory (see the module)."""

    def __init__(self, budget: int, interval: int, *, directory: str | Path | None = None,
                 disk_budget: int = 0, identity: str = "") -> None:
        if budget < 0 or interval < 1:
            raise ValueError("prompt cache budget must be >= 0 and interval >= 1")
        self.budget, self.interval, self.identity = budget, interval, identity
        self.entries: dict[str, Entry] = {}
        self.counters = CacheCounters()
        self._lock = threading.Lock()
        self.disk = None
        if directory is not None:
            from k3kit.serve.prompt_cache_disk import DiskTier
            self.disk = DiskTier(Path(directory), identity, disk_budget, self.counters)

    # -- what the scheduler asks -----------------------------------------------------------------
    def lookup(self, prompt: Sequence[int], window: int | None = None,
               ring_storage: str | None = None, count: bool = True) -> Hit | None:
        """The deepest restorable point for `prompt` (see the module), or None (counted as a miss).
        `window`: the draft's ring capacity when the sequence drafts (its rows must be covered, in
        `ring_storage`), None when it does not. `count` False: a prefill ahead of a request, not
        one (the hit and miss counters are the requests')."""
        p = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            e: Entry | None = None
            while True:
                pos, key, on_disk = self._best(p, window, ring_storage)
                if not pos:
                    break
                if not on_disk:
                    e = self.entries[key]
                    break
                assert self.disk is not None
                e = self.disk.load(key)            # None: corrupt, skipped and dropped; look again
                if e is not None:
                    self.counters.disk_hits += 1
                    if e.nbytes <= self.budget:    # else served from the file each time
                        self.entries[key] = e
                        self._trim()
                    break
            if e is None:
                self.counters.misses += count
                return None
            e.used = time.monotonic()
            if e.preloaded:                    # its first restore: the directory's, read ahead
                e.preloaded = False
                self.counters.disk_hits += 1
            pt = e.points[pos]
            ring_rows = None
            if window is not None and e.ring is not None:
                ring_rows = e.ring.rows(max(e.ring.start, pos - window), pos)
            self.counters.hits += count
            self.counters.cached_tokens += pos * count
            return Hit(pos, pt.recurrent, tuple(t[:pos] for t in e.positional), pt.logits, ring_rows, key)

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether an entry (in RAM or on disk) has a recurrent copy at the end of `tokens`."""
        p = np.asarray(tokens, dtype=np.int64)
        n = len(p)
        with self._lock:
            pairs = [(e.tokens, set(e.points)) for e in self.entries.values()]
            if self.disk is not None:
                pairs += [(d.tokens, set(d.points)) for d in self.disk.index.values()]
            return any(n in pts and common_prefix(t, p) == n for t, pts in pairs)

    def _best(self, p: np.ndarray, window: int | None, ring_storage: str | None) -> tuple[int, str, bool]:
        """(position, entry key, whether only the disk holds it) of the deepest usable point."""
        n = len(p)
        best: tuple[int, str, bool] = (0, "", False)
        for key, e in self.entries.items():
            ring = self._ring_span(e.ring, ring_storage)
            pos = _usable({q: pt.logits is not None for q, pt in e.points.items()}, ring,
                          common_prefix(e.tokens, p), n, window)
            if pos > best[0]:
                best = (pos, key, False)
        if self.disk is not None:
            for key, d in self.disk.index.items():
                if key in self.entries:
                    continue
                ring = d.ring if (d.ring is not None and d.ring_storage == ring_storage) else None
                pos = _usable(d.points, ring, common_prefix(d.tokens, p), n, window)
                if pos > best[0]:
                    best = (pos, key, True)
        return best

    @staticmethod
    def _ring_span(ring: RingRows | None, storage: str | None) -> tuple[int, int] | None:
        return None if ring is None or ring.storage != storage else (ring.start, ring.end)

    def insert(self, tokens: Sequence[int], positional: Sequence[Tensor], points: Sequence[Point],
               ring: RingRows | None = None, base: str | None = None) -> None:
        """Keep what a finished request ran: `tokens` (its positional rows cover them all), the
        recurrent `points` it took, its ring rows; `base`, the key of the entry it was restored
        from, lends the points inside the shared prefix."""
        toks = np.asarray(tokens, dtype=np.int64)
        n = len(toks)
        if n == 0 or any(t.shape[0] < n for t in positional):
            return
        pts = {pt.pos: pt for pt in points if 0 < pt.pos <= n}
        if not pts:
            return
        with self._lock:
            src = self.entries.get(base) if base is not None else None
            if src is not None:
                c = common_prefix(src.tokens, toks)
                for q, pt in src.points.items():
                    if q <= c:
                        pts.setdefault(q, pt)
                ring = _merge_ring(src.ring, ring)
            for key, e in list(self.entries.items()):
                c = common_prefix(e.tokens, toks)
                if c == n and len(e.tokens) >= n:      # already held by a longer (or equal) entry
                    if not pts.keys() <= e.points.keys():
                        e.disk = None                  # its file lacks the new points: write it again
                    for q, pt in pts.items():
                        e.points.setdefault(q, pt)
                    e.ring = e.ring if e.ring is not None else ring
                    e.used = time.monotonic()
                    self._trim()
                    return
                if c == len(e.tokens):                 # the new one extends it: absorb
                    for q, pt in e.points.items():
                        pts.setdefault(q, pt)
                    ring = _merge_ring(e.ring, ring)
                    del self.entries[key]
                    if self.disk is not None and e.disk is not None:
                        self.disk.remove(e.key)
            entry = Entry(toks, tuple(t[:n] for t in positional), pts, ring)
            self.counters.stored += 1
            self._keep(entry)

    def _keep(self, entry: Entry) -> None:
        """Hold `entry` in RAM (the lock held), then trim to the budget; one bigger than the whole
        budget goes straight to the disk tier, if there is one."""
        if entry.nbytes > self.budget:
            if self.disk is not None:
                self.disk.write(entry)
            return
        self.entries[entry.key] = entry
        self._trim()

    def _trim(self) -> None:
        total = sum(e.nbytes for e in self.entries.values())
        while total > self.budget and self.entries:
            key = min(self.entries, key=lambda k: self.entries[k].used)
            e = self.entries.pop(key)
            total -= e.nbytes
            self.counters.evictions += 1
            if self.disk is not None and e.disk is None:
                self.disk.write(e)

    def preload(self) -> int:
        """Read the directory's newest entries into RAM while they fit half the budget (the rest
        stays for this run's own), so the first turns after a restart find their states in RAM,
        as llama-server's restored slots are, instead of reading and checking a file while the
        request waits. One entry at a time under the lock; an entry a lookup already took, or a
        corrupt one (skipped with its warning), is passed over. -> entries read."""
        if self.disk is None:
            return 0
        with self._lock:
            keys = sorted(self.disk.index, key=lambda k: -self.disk.index[k].mtime)   # type: ignore[union-attr]
        room, n = self.budget // 2, 0
        for key in keys:
            with self._lock:
                d = self.disk.index.get(key)
                if key in self.entries or d is None:
                    continue
                if d.nbytes > room:
                    break
                e = self.disk.load(key)
                if e is None:
                    continue
                e.preloaded = True
                e.used = 0.0                   # the first to go if this run's own need the room
                self.entries[key] = e
                room -= e.nbytes
                n += 1
                self._trim()
        return n

    def flush(self) -> int:
        """Write every RAM entry not yet on disk (shutdown); -> entries written."""
        if self.disk is None:
            return 0
        with self._lock:
            todo = [e for e in self.entries.values() if e.disk is None]
            for e in todo:
                self.disk.write(e)
        return len(todo)

    def stats(self) -> dict[str, int]:
        with self._lock:
            c = self.counters
            return {"hits": c.hits, "misses": c.misses, "cached_tokens": c.cached_tokens,
                    "evictions": c.evictions, "stored": c.stored, "entries": len(self.entries),
                    "ram_bytes": sum(e.nbytes for e in self.entries.values()),
                    "snapshot_bytes": sum(p.nbytes for e in self.entries.values() for p in e.points.values()),
                    "disk_entries": 0 if self.disk is None else len(self.disk.index),
                    "disk_bytes": 0 if self.disk is None else self.disk.bytes,
                    "disk_hits": c.disk_hits, "disk_writes": c.disk_writes, "disk_skipped": c.disk_skipped}


def _merge_ring(old: RingRows | None, new: RingRows | None) -> RingRows | None:
    """`new` extended backwards by `old`'s earlier rows where they meet (rows of one position are
    the same in every entry that holds them)."""
    if old is None or new is None:
        return new if new is not None else old
    if old.storage != new.storage or not old.start < new.start <= old.end:
        return new
    head = old.rows(old.start, new.start)
    data = torch.cat((head.data, new.data))
    scale = None if new.scale is None or head.scale is None else torch.cat((head.scale, new.scale))
    return RingRows(old.start, data, scale, new.storage)
