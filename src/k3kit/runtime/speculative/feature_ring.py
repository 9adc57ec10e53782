"""Committed tap features of the target, kept for the draft's context.

The draft needs, for every committed position, the concatenated hidden states of the tapped
target layers. At giant-model widths that is tens of KB per token, so the ring stores them in a
compact dtype and keeps only the last `capacity` rows (the draft's attention window):
  * "f32"  exact;
  * "f16"  relative error <= 2^-11 for 6.1e-5 <= |x| < 65504 (larger overflows: use bf16 or q8),
           |err| <= 2^-25 below that;
  * "bf16" relative error <= 2^-8;
  * "q8"   int8 with one float32 absmax scale per row: |err| <= max|row| / 254.
Rows are addressed by absolute position; `length` is the number of committed positions and
always equals the target's committed position count in the decode loop.
"""

from __future__ import annotations

import torch
from torch import Tensor

_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8": torch.int8}


def q8_encode(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row absmax int8: q = round(x / d), d = max|x| / 127 (d = 0 rows store zeros)."""
    rows = rows.to(torch.float32)
    amax = rows.abs().amax(dim=-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(rows * inv).clamp(-127, 127).to(torch.int8)
    return q, d.squeeze(-1)


def q8_decode(q: Tensor, d: Tensor) -> Tensor:
    return q.to(torch.float32) * d[:, None]


class FeatureRing:
    """A window of committed feature rows, addressed by absolute position."""

    def __init__(self, width: int, capacity: int = 4096, storage: str = "f16"):
        if storage not in _DTYPES:
            raise ValueError(f"feature ring storage must be one of {sorted(_DTYPES)}, not {storage!r}")
        if width <= 0 or capacity <= 0:
            raise ValueError("feature ring width and capacity must be positive")
        self.width, self.capacity, self.storage = width, capacity, storage
        # empty, not zeros: only rows in the window are ever read, and a server opens a ring per
        # request (zeroing 8 MiB took 2-7 ms of the batch worker's time each)
        self._buf = torch.empty(capacity, width, dtype=_DTYPES[storage])
        self._scale = torch.empty(capacity, dtype=torch.float32) if storage == "q8" else None
        self.length = 0      # committed positions so far (absolute)
        self.start = 0       # first position still held
        self.version = 0     # bumped by truncate: rows at positions >= the cut may now differ

    @property
    def nbytes(self) -> int:
        n = self._buf.numel() * self._buf.element_size()
        return n + (self._scale.numel() * 4 if self._scale is not None else 0)

    def append(self, rows: Tensor) -> None:
        rows = rows.detach()
        if rows.dim() != 2 or rows.shape[1] != self.width:
            raise ValueError(f"feature rows must be [n, {self.width}], got {tuple(rows.shape)}")
        n = rows.shape[0]
        if n > self.capacity:          # only the last `capacity` rows can survive anyway
            self.length += n - self.capacity
            self.start = max(self.start, self.length)
            rows, n = rows[-self.capacity:], self.capacity
        at = self.length % self.capacity
        # a slice where the rows do not wrap round (a decode pass's few rows: the common case)
        idx: slice | Tensor = (slice(at, at + n) if at + n <= self.capacity
                               else torch.arange(self.length, self.length + n) % self.capacity)
        if self._scale is not None:
            data, scale = q8_encode(rows)
            self._scale[idx] = scale
        else:
            data = rows.to(self._buf.dtype)
        self._buf[idx] = data
        self.length += n
        self.start = max(self.start, self.length - self.capacity)

    def get(self, begin: int, end: int | None = None) -> Tensor:
        """Rows for positions [begin, end) as float32; they must still be in the window."""
        end = self.length if end is None else end
        if not self.start <= begin <= end <= self.length:
            raise IndexError(f"feature rows [{begin}, {end}) not held (window [{self.start}, {self.length}))")
        at = begin % self.capacity
        idx: slice | Tensor = (slice(at, at + end - begin) if at + end - begin <= self.capacity
                               else torch.arange(begin, end) % self.capacity)
        if self._scale is not None:
            return q8_decode(self._buf[idx], self._scale[idx])
        return self._buf[idx].to(torch.float32, copy=True)     # never a view the ring overwrites

    def export(self, begin: int, end: int) -> tuple[Tensor, Tensor | None]:
        """Rows [begin, end) as stored (a copy; with "q8" also their scales): what `restore` takes
        back bit for bit."""
        if not self.start <= begin <= end <= self.length:
            raise IndexError(f"feature rows [{begin}, {end}) not held (window [{self.start}, {self.length}))")
        idx = torch.arange(begin, end) % self.capacity
        return self._buf[idx].clone(), None if self._scale is None else self._scale[idx].clone()

    def restore(self, begin: int, data: Tensor, scale: Tensor | None) -> None:
        """Make the ring hold exactly `export`'s rows for positions [begin, begin + len(data)) and
        nothing else (a sequence restored from a saved state at that end)."""
        n = data.shape[0]
        if data.dim() != 2 or data.shape[1] != self.width or data.dtype != self._buf.dtype \
                or (scale is None) != (self._scale is None) or (scale is not None and scale.shape != (n,)):
            raise ValueError(f"saved feature rows {tuple(data.shape)} {data.dtype} do not fit this ring "
                             f"({self.width} wide, {self.storage})")
        if n > self.capacity or begin < 0:
            raise ValueError(f"{n} saved feature rows do not fit a ring of {self.capacity}")
        idx = torch.arange(begin, begin + n) % self.capacity
        self._buf[idx] = data
        if self._scale is not None and scale is not None:
            self._scale[idx] = scale
        self.start, self.length = begin, begin + n
        self.version += 1

    def truncate(self, length: int) -> None:
        """Forget positions >= length (a rollback of committed state)."""
        if not 0 <= length <= self.length:
            raise IndexError(f"cannot truncate feature ring of length {self.length} to {length}")
        if length < self.length:
            self.length = length
            self.start = min(self.start, length)
            self.version += 1
