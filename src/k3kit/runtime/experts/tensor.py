"""`ExpertTensor`: where one projection's experts lie (a file or a buffer) and how big they are.

A layer's experts for one projection are `n_experts` equal matrices stored back to back (a ggml
[n_in, n_out, n_expert] tensor), so expert e is one contiguous byte slice: this is everything the
store needs to know to read it. Kept apart from the store so the parts that read, map and read
ahead can name it without importing the store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from k3kit.kernels.dequant import nbytes_for

ByteBuffer = np.ndarray | bytes | bytearray | memoryview


@dataclass(frozen=True)
class ExpertTensor:
    """One projection of one layer: `n_experts` matrices of ggml `shape`, back to back.

    `source` is a file path (the store maps/reads it itself; `offset` is absolute in the
    file) or an in-memory byte buffer such as `Model.view(name)` (`offset` within it).
    File sources get madvise, cold reads and change detection; buffers get none of that.
    """

    source: str | os.PathLike | ByteBuffer
    offset: int
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # one expert, ggml order, e.g. (n_in, n_out)
    n_experts: int
    name: str = ""  # for messages only

    @cached_property  # read several times per miss; frozen dataclasses allow it (no __setattr__)
    def expert_nbytes(self) -> int:
        return nbytes_for(self.ggml_type, int(np.prod(self.shape, dtype=np.int64)))

    @property
    def nbytes(self) -> int:
        return self.expert_nbytes * self.n_experts

    @property
    def is_file(self) -> bool:
        return self.path is not None

    @cached_property
    def path(self) -> Path | None:
        """The file holding the tensor, or None for an in-memory buffer."""
        return Path(self.source) if isinstance(self.source, str | os.PathLike) else None

    def buffer(self) -> np.ndarray:
        """An in-memory source as an array (a byte buffer as uint8)."""
        src = self.source
        if isinstance(src, str | os.PathLike):
            raise TypeError(f"{src}: a file, not a buffer")
        return src if isinstance(src, np.ndarray) else np.frombuffer(src, np.uint8)
