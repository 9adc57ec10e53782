"""How a miss's bytes get from a model file into the buffer the cache keeps.

The store's reading part: one expert's slices read on the caller's thread (`_load`) or by a
background reader (`_read_expert`), through the mapping (mmap mode), pread (background readers,
"fadvise" cold reads) or O_DIRECT straight into the cache's buffer (`_fill`), scale-checked in
pieces while the bytes are still in the CPU's cache (`_check`), and either kept as their bytes
(`QuantizedMatrix`) or dequantized. A mixin of `ExpertStore`: the state it reads is set up by
the store's constructor and declared here for the type checker.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from k3kit.gguf.quants import CorruptBlockError, first_nonfinite_block
from k3kit.gguf.quants.scales import CHECKED
from k3kit.kernels import gpu
from k3kit.kernels.dequant import dequantize
from k3kit.kernels.qmatmul import NATIVE_TYPES, QuantizedMatrix

from .cache import ExpertCache, Weight
from .io import DIRECT_ALIGN, AlignedScratch, MappedFile
from .tensor import ExpertTensor

CPU = torch.device("cpu")
CHECK_CHUNK = 1 << 19   # bytes read, then scale-checked while still in cache (whole blocks)


class _Stopped(Exception):
    """A background read dropped before it finished: what it had read by then."""

    def __init__(self, io_bytes: int, payload: int) -> None:
        super().__init__(io_bytes, payload)
        self.io_bytes, self.payload = io_bytes, payload


class SliceReads:
    """Reading expert slices into buffers (mixin of `ExpertStore`, which sets these up)."""

    layers: dict[int, tuple[ExpertTensor, ...]]
    keep: str
    cpu_keep: str
    cpu_layers: frozenset[int]
    arith: str
    dtype: torch.dtype
    device: torch.device
    cold: bool | str
    slice_readahead: bool
    release_pages: bool
    check_scales: bool
    _cache: ExpertCache
    _files: dict[Path, MappedFile]
    _direct: AlignedScratch
    _raw: np.ndarray | None
    _scratch_local: threading.local
    _scratches: list[AlignedScratch]

    def n_experts(self, layer: int) -> int:
        return self.layers[layer][0].n_experts

    def expert_nbytes(self, layer: int) -> int:
        """Quantized storage bytes of one expert of `layer`, all projections."""
        return sum(t.expert_nbytes for t in self.layers[layer])

    def _load(self, layer: int, e: int) -> tuple[Weight, ...]:
        """Read (and dequantize, unless kept quantized) one expert on this thread."""
        tensors: list[Weight] = []
        ledger = self._cache.ledger
        for t in self.layers[layer]:
            n = t.expert_nbytes
            t0 = time.perf_counter()
            if self._kept_quantized(t, layer):     # read straight into the buffer the cache will hold
                q = self._quantized(t, self._buffer(t, e))
                io_bytes, check = self._read_slice(layer, e, t, q.raw.numpy())
                t1 = time.perf_counter()
                tensors.append(q)
            elif self._kept_triton(t, layer):     # the bytes, copied to the device the kernels read them on
                raw = self._scratch(n)
                io_bytes, check = self._read_slice(layer, e, t, raw)
                t1 = time.perf_counter()
                held = torch.from_numpy(raw[:n]).to(self.device_of(layer), copy=True)
                tensors.append(gpu.TritonMatrix(held, t.ggml_type, (t.shape[0], t.shape[1]), self.dtype))
            else:
                raw = self._scratch(n)
                io_bytes, check = self._read_slice(layer, e, t, raw)
                t1 = time.perf_counter()
                w = dequantize(raw, t.ggml_type, t.shape, self.dtype)
                dev = self.device_of(layer)
                tensors.append(w if dev.type == "cpu" else w.to(dev))
            ledger.io_bytes += io_bytes
            ledger.read_seconds += t1 - t0 - check
            ledger.check_seconds += check
            ledger.dequant_seconds += time.perf_counter() - t1
            self._cache.record_read(layer, n)
        return tuple(tensors)

    def _read_slice(self, layer: int, e: int, t: ExpertTensor, out: np.ndarray,
                    background: bool = False) -> tuple[int, float]:
        """Expert e's bytes of projection t into `out`, scale-checked (check_scales) in pieces
        of about CHECK_CHUNK right after each piece is read, while it is still in the CPU's
        cache (checked after the whole copy, the scan is a second pass over DRAM: measured
        here ~1.5 ms per 5.8 MB slice, a third of copying it from the page cache). Returns
        (bytes asked of the OS, seconds spent checking).

        The background readers never copy out of the mapping (madvise and the page-table work
        of the copy would contend with the caller's thread): they pread."""
        start, n = t.offset + e * t.expert_nbytes, t.expert_nbytes
        f = self._files[t.path] if t.path is not None else None
        if f is not None:
            f.check()
        mapped = f if f is not None and f.mm is not None and not background else None
        if mapped is not None and self.slice_readahead:
            mapped.advise_slice(start, n, populate=True)
        uncached = f if f is not None and self.cold and f.direct_fd is None else None
        if uncached is not None:
            uncached.drop(start, n)     # once around the whole slice
        if f is not None and mapped is None and f.direct_fd is None:
            f.willneed(start, n)        # the pieces below then wait for one large read of the slice
        checks = self.check_scales and t.ggml_type in CHECKED
        block = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)][1]
        # O_DIRECT reads whole aligned spans: pieces would read their shared edge blocks twice
        pieces = checks and (f is None or f.direct_fd is None)
        step = max(block, CHECK_CHUNK // block * block) if pieces else n
        io_bytes, check = 0, 0.0
        for lo in range(0, n, step):
            part = out[lo : lo + step]
            io_bytes += self._fill(t, f, start + lo, part, background)
            if checks:
                check += self._check(layer, e, t, part, lo // block)
        if mapped is not None and self.release_pages:
            mapped.release(start, n)
        if uncached is not None:
            uncached.drop(start, n)
        return io_bytes, check

    def _fill(self, t: ExpertTensor, f: MappedFile | None, offset: int, out: np.ndarray,
              background: bool) -> int:
        """Copy the bytes at `offset` of t's source into `out`; returns the bytes asked of the OS."""
        if f is None:
            out[:] = t.buffer().reshape(-1)[offset : offset + out.nbytes]
            return out.nbytes
        if f.direct_fd is not None:
            placed = self._cache.direct_span(out)
            if placed is not None and placed[1] == offset % DIRECT_ALIGN:
                span, head = placed
                return f.read_direct_span(span, offset - head, head + out.nbytes)
            return f.read_direct(out, offset, self._thread_scratch() if background else self._direct)
        if f.mm is not None and not background:
            out[:] = f.view(offset, out.nbytes)
        else:
            f.pread_into(out, offset)
        return out.nbytes

    def _buffer(self, t: ExpertTensor, e: int) -> torch.Tensor:
        """A cache buffer for expert e's slice of t; for an O_DIRECT file one laid out so that the
        read lands in it in place (`ExpertCache.buffer`): no scratch buffer, no second copy."""
        f = self._files.get(t.path) if t.path is not None else None
        if f is None or f.direct_fd is None:
            return self._cache.buffer(t.expert_nbytes)
        return self._cache.buffer(t.expert_nbytes, (t.offset + e * t.expert_nbytes) % DIRECT_ALIGN)

    def _check(self, layer: int, e: int, t: ExpertTensor, raw: np.ndarray, first_block: int = 0) -> float:
        """Raise CorruptBlockError if a block of `raw` (expert e's slice of t from block
        `first_block` on) has an inf/NaN scale; returns the seconds the check took. A random-
        weight model with one NaN scale still "runs" and prints plausible garbage: this is
        where that becomes a one-line error."""
        t0 = time.perf_counter()
        qtype = GGMLQuantizationType(t.ggml_type)
        elems, block = GGML_QUANT_SIZES[qtype]
        bad = first_nonfinite_block(raw, qtype, raw.nbytes // block * elems)
        if bad is not None:
            where = t.path or "<buffer>"
            raise CorruptBlockError(f"{where}: tensor {t.name or 'experts'} expert {e} (layer {layer}): "
                                    f"{qtype.name} block {first_block + bad} has a non-finite scale; "
                                    "the file is corrupt", qtype, first_block + bad)
        return time.perf_counter() - t0

    def keep_of(self, layer: int) -> str:
        """How `layer`'s experts are cached: the store's `keep`, or `cpu_keep` for a layer whose
        experts stay on the CPU while the rest go to a GPU (`cpu_layers`)."""
        return self.cpu_keep if layer in self.cpu_layers else self.keep

    def device_of(self, layer: int) -> torch.device:
        """Where `layer`'s experts are held and multiplied."""
        return CPU if layer in self.cpu_layers else self.device

    def _kept_triton(self, t: ExpertTensor, layer: int) -> bool:
        """Whether the cache holds this projection of `layer` as its bytes on the device, for the
        Triton kernels (keep="triton", a type they decode)."""
        return self.keep_of(layer) == "triton" and gpu.supports(t.ggml_type)

    def _kept_quantized(self, t: ExpertTensor, layer: int) -> bool:
        """Whether the cache holds this projection of `layer` as its bytes (kept quantized, native type)."""
        return self.keep_of(layer) == "quantized" and t.ggml_type in NATIVE_TYPES

    def _quantized(self, t: ExpertTensor, buf: torch.Tensor) -> QuantizedMatrix:
        return QuantizedMatrix(buf, GGMLQuantizationType(t.ggml_type), (t.shape[0], t.shape[1]), self.dtype,
                               arith=self.arith)

    def _scratch(self, n: int) -> np.ndarray:
        """A private, writable n-byte buffer, reused by every miss: the raw slice lives only
        until it is dequantized, and a fresh multi-MB array per read would be faulted in page
        by page each time (here ~5 ms per 6 MB slice, a tenth of the slice's dequant)."""
        if self._raw is None or self._raw.size < n:
            self._raw = np.empty(n, dtype=np.uint8)
        return self._raw[:n]

    def _read_expert(self, layer: int, e: int, buffers: list[torch.Tensor],
                     stop: threading.Event) -> tuple[tuple[Weight, ...], float, float, int]:
        """Background thread: read one expert's slices into `buffers` and check their scales.
        Touches no shared state (the ledger is updated by whoever collects it, and a changed,
        truncated or corrupt file raises there, on the caller's thread). Returns (weights,
        read seconds, check seconds, bytes asked of the OS). A read dropped while running
        (`stop` set) ends before its next projection: a wrong guess holds a reader (and the
        storage) for one slice, not for a whole expert, once the real plan's misses queue."""
        t0 = time.perf_counter()
        out: list[QuantizedMatrix] = []
        check = 0.0
        io_bytes = 0
        for t, buf in zip(self.layers[layer], buffers, strict=True):
            if stop.is_set():       # dropped (a guess the plan did not confirm): stop reading it
                raise _Stopped(io_bytes, sum(x.raw.nbytes for x in out))
            n, c = self._read_slice(layer, e, t, buf.numpy(), background=True)
            io_bytes += n
            check += c
            out.append(self._quantized(t, buf))
        return tuple(out), time.perf_counter() - t0 - check, check, io_bytes

    def _thread_scratch(self) -> AlignedScratch:
        scratch = getattr(self._scratch_local, "scratch", None)
        if scratch is None:
            scratch = self._scratch_local.scratch = AlignedScratch()
            self._scratches.append(scratch)     # list.append is atomic: closed with the store
        return scratch
