"""GGUF -> what an adapter builds a model from: trunk tensors on demand, an expert store.

The loader is model-neutral. `GGUFSource` opens a (sharded) GGUF header-only and gives an
adapter its KVs, its tensor infos, one trunk tensor at a time as a torch tensor in the
compute dtype on a device, and an `ExpertStore` over the expert tensors the adapter names.
The adapter (k3kit.adapters.<arch>) knows what the tensors mean; nothing here does, and
nothing here chooses the adapter: `k3kit.adapters.load_model` maps `general.architecture`
to one through its registry table.

Memory: every shard is mapped with plain mmap (no MAP_POPULATE, no WILLNEED on the file)
through the same `MappedFile` the expert store reads with; a tensor dequantized at load (the
float pieces of any trunk, every matrix of `--trunk float`) has its pages faulted in while it
is dequantized and dropped from this process (MADV_DONTNEED) right after, so resident memory
is the dequantized tensor, not the tensor twice. The page cache keeps whatever the kernel wants.

The quantized trunk (`LoadOptions.trunk = "quantized"`, the default) takes matrices as their bytes
instead (`GGUFSource.raw`): a uint8 tensor over a second, private (copy-on-write, never written)
mapping of the tensor's range of its shard, which nothing ever MADV_DONTNEEDs. Its pages become
resident as the first forward touches them, are the page cache's own pages (one copy in RAM, shared
with any other process mapping the file, and clean: the kernel can drop and re-read them under
memory pressure, as llama.cpp's mmap does), so resident trunk = the file's trunk bytes. Reading into
an owned buffer instead (`copy=True`) makes the same RSS but a second copy of the bytes in the page
cache until the kernel evicts it, and loads slower; the CUDA path does that, one tensor at a time,
before copying the bytes to the device.

Corrupt data: `check_finite(name)` scans a tensor's block scales (k3kit.gguf.quants) and raises
a one-line CorruptBlockError naming file, tensor and block. A tensor dequantized here is checked
as it is read; a mapped quantized one when its first product runs (the adapter hooks it to the
layer), since the scales are spread over every page and reading them at load would read the
whole trunk (60 GB for K3) before the first token.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType

from k3kit.errors import FormatError, K3Error
from k3kit.gguf import quants
from k3kit.gguf.reader import KV, TensorInfo
from k3kit.gguf.shards import Model
from k3kit.kernels import gpu
from k3kit.kernels.dequant import SUPPORTED, dequantize
from k3kit.kernels.qmatmul import ARITHS, native_available
from k3kit.runtime.experts import ExpertStore
from k3kit.runtime.experts.io import MappedFile

DTYPES = {"f32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "f16": torch.float16, "float16": torch.float16}


@dataclass
class LoadOptions:
    """How to place a model. `devices` > 1 splits the layers across them in contiguous runs."""

    device: str = "cpu"                  # "cpu", "cuda", "cuda:N", or comma list for a layer split
    dtype: torch.dtype = torch.float32
    expert_cache_mib: float = 256.0
    cold: bool | str = False             # ExpertStore cold mode (storage reads measured honestly)
    ggml_parity: bool = False            # emulate ggml-cpu's Q8_0 rounding of expert inputs
    expert_kernel: str = "auto"          # "native", "torch" or "auto": see expert_keep()
    trunk: str = "quantized"             # "quantized": the file's bytes; "float": dequantized to `dtype`
    expert_prefetch: str = "auto"        # "auto", "on" or "off": see expert_prefetch()
    arith: str = "auto"                  # quantized products: "auto", "float" or "ggml" (check_arith)
    cpu_moe: int = 0                     # experts kept on the CPU under a GPU trunk (cpu_moe_layers)
    expert_arith: str = ""               # the experts' products; "" = `arith` (see __post_init__)

    def __post_init__(self) -> None:
        # Resolved here, once, so that the model, the expert store and `--stats/--json` all see the
        # arithmetic that runs ("float" or "ggml"), never "auto". The device string is not parsed
        # (a bad one is reported by `devices` at load, as before). Experts kept on the CPU under a
        # GPU trunk (cpu_moe) multiply in the CPU's arithmetic, as a CPU run's do.
        asked = self.arith
        if self.arith == "auto":
            self.arith = resolve_arith(self.device)
        if not self.expert_arith:
            self.expert_arith = resolve_arith("cpu") if asked == "auto" and self.cpu_moe else self.arith

    @property
    def devices(self) -> list[torch.device]:
        return [parse_device(d) for d in self.device.split(",")]


def parse_device(spec: str) -> torch.device:
    spec = spec.strip()
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise K3Error(f"--device {spec!r}: expected cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise K3Error(f"--device {spec!r}: expected cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise K3Error(f"--device {spec!r}: CUDA is not available in this torch build or machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise K3Error(f"--device {spec!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return dev


EXPERT_KERNELS = ("auto", "native", "triton", "torch")
TRUNKS = ("float", "quantized")


def check_trunk(trunk: str, devices: Sequence[torch.device]) -> str:
    """`--trunk` checked: quantized (the default) or float, on any device.

    quantized: trunk matrices kept as the file's bytes and multiplied from them
               (k3kit.layers.quantized_linear): native kernels on the CPU; on CUDA the bytes
               live in device memory and each product dequantizes them there in bounded
               chunks. `--dtype` then sets the activations (and that scratch's dtype) only.
    float:     every trunk matrix dequantized once to the compute dtype (what `--dtype` says).
    """
    if trunk not in TRUNKS:
        raise K3Error(f"--trunk {trunk!r}: expected one of {', '.join(TRUNKS)}")
    return trunk


ARITH_CHOICES = ("auto", *ARITHS)


def resolve_arith(device: str = "cpu") -> str:
    """What `--arith auto` means for a `--device` string: "ggml" when every device is the CPU
    and the native extension is built, else "float".

    llama.cpp is the compatibility reference, and ggml's arithmetic is its rounding (lower KL and
    higher top-1 agreement against it, measured) and the faster one on the CPU. It cannot run on
    CUDA (the quantized layer dequantizes per product there) or without the extension; a load
    that touches a CUDA device takes "float" for all of it, so one arithmetic names the run.
    A type with no native int8 kernel keeps its dequantize-on-use path in either arithmetic.
    """
    cuda = any(d.strip().startswith("cuda") for d in device.split(","))
    return "ggml" if native_available() and not cuda else "float"


def check_arith(arith: str, device: str = "cpu") -> str:
    """`--arith` checked and resolved: the arithmetic of every product on quantized bytes (trunk
    and experts), "float" or "ggml" (never "auto": the caller hands it on as is).

    auto:  ggml on the CPU with the native extension, float elsewhere (resolve_arith); the default.
    float: float32 activations times the exact weight values (the float32 rounding bound of the
           float64 product; decode rows through the native kernel, many rows by dequantize + GEMM).
    ggml:  llama.cpp's own: activations rounded to Q8_0 / Q8_K blocks, integer dot products
           (each row bitwise independent of the others at any row count; closest to llama.cpp).
           Where it cannot run (no extension, a tensor on CUDA, a type without an int8 kernel)
           those products are float's.
    """
    if arith == "auto":
        return resolve_arith(device)
    if arith not in ARITHS:
        raise K3Error(f"--arith {arith!r}: expected one of {', '.join(ARITH_CHOICES)}")
    return arith


def cpu_moe_layers(cpu_moe: int, layers: Collection[int], devices: Sequence[torch.device]) -> frozenset[int]:
    """The MoE layers whose routed experts stay in RAM, multiplied on the CPU by the native
    kernels, while their layers run on a GPU: llama.cpp's `--cpu-moe` (cpu_moe -1: every layer)
    and `--n-cpu-moe N` (N: the layers numbered below N; the rest keep their experts in VRAM).
    Empty when every device is the CPU (the experts are there already) or cpu_moe is 0."""
    if cpu_moe < -1:
        raise K3Error(f"--n-cpu-moe {cpu_moe}: must be >= 0")
    if cpu_moe == 0 or all(d.type == "cpu" for d in devices):
        return frozenset()
    return frozenset(il for il in layers if cpu_moe < 0 or il < cpu_moe)


EXPERT_PREFETCH = ("auto", "on", "off")


def expert_prefetch(mode: str, store: ExpertStore) -> bool:
    """`--expert-prefetch` -> whether each MoE layer guesses the next one's experts and starts
    reading them early (ExpertStore.prefetch).

    on:   always. Guessing costs one extra router product per MoE layer and token, and a wrong
          guess reads an expert nobody uses (bounded by the store's read-ahead budget).
    off:  never.
    auto: on when the expert cache cannot hold every routed expert, i.e. when misses can happen
          (measured out of core: 1.3-1.8x decode); off when everything fits, where a guess can
          only cost.
    """
    if mode not in EXPERT_PREFETCH:
        raise K3Error(f"--expert-prefetch {mode!r}: expected one of {', '.join(EXPERT_PREFETCH)}")
    if mode != "auto":
        return mode == "on"
    total = sum(store.n_experts(layer) * store.cached_expert_nbytes(layer) for layer in store.layers)
    return store.cache_bytes < total


def expert_keep(kernel: str, devices: Sequence[torch.device]) -> str:
    """`--expert-kernel` -> the ExpertStore's keep mode.

    native: experts stay quantized in the cache and multiply through the native kernel
            (k3kit.kernels.qmatmul); CPU only, needs the extension built at install.
    triton: experts stay as their bytes on the device (VRAM: the file's size, not a 16-bit
            copy) and multiply through the Triton kernels (k3kit.kernels.gpu), a MoE layer's
            routed rows in one grouped launch per projection; CUDA, or the CPU under
            TRITON_INTERPRET=1 (the kernels' tests).
    torch:  experts are dequantized to the compute dtype on a miss and cached that way.
    auto:   native when it is built and every device is the CPU; triton on CUDA when triton is
            installed; else torch.
    """
    if kernel not in EXPERT_KERNELS:
        raise K3Error(f"--expert-kernel {kernel!r}: expected one of {', '.join(EXPERT_KERNELS)}")
    on_cpu = all(d.type == "cpu" for d in devices)
    if kernel == "native":
        if not native_available():
            raise K3Error("--expert-kernel native: the native MXFP4 kernel was not built at install "
                          "(no C compiler?); use --expert-kernel torch")
        if not on_cpu:
            raise K3Error("--expert-kernel native runs on the CPU only; use --expert-kernel torch with CUDA")
        return "quantized"
    if kernel == "triton":
        if not gpu.available(devices[0]):
            raise K3Error(f"--expert-kernel triton: the Triton kernels cannot run on {devices[0]} (they need "
                          "triton and CUDA, or TRITON_INTERPRET=1 on the CPU)")
        return "triton"
    if kernel == "auto" and native_available() and on_cpu:
        return "quantized"
    if kernel == "auto" and not on_cpu and gpu.available(devices[0]):
        return "triton"
    return "dequantized"


def layer_devices(n_layers: int, devices: Sequence[torch.device]) -> list[torch.device]:
    """Contiguous split of layers over devices (as even as possible, earlier devices first)."""
    n = len(devices)
    return [devices[min(n - 1, il * n // max(n_layers, 1))] for il in range(n_layers)]


def kv_value(kv: KV) -> Any:
    """Plain Python value of a KV: arrays of numbers as lists, strings as str."""
    v = kv.value
    if kv.vtype == GGUFValueType.ARRAY and isinstance(v, np.ndarray):
        return v.tolist()
    return v


class GGUFSource:
    """An open (sharded) GGUF as the adapters see it: KVs, tensor infos, tensors on demand."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise K3Error(f"{self.path}: no such file")
        if self.path.is_dir():
            raise K3Error(f"{self.path}: is a directory, expected a .gguf file (or any shard)")
        self.model = Model.open(self.path)
        self.kv: dict[str, Any] = {k: kv_value(v) for k, v in self.model.kv.items()}
        self.raw_kv: dict[str, KV] = self.model.kv
        self.tensors: dict[str, TensorInfo] = self.model.tensors
        self._shards = [MappedFile(p) for p in self.model.paths]
        self._raw_maps: dict[str, mmap.mmap] = {}   # tensor -> the mapping `raw` views (made on demand)
        self.where = str(self.model.paths[0])    # the first shard: what messages name
        self.trunk_bytes_read = 0

    @property
    def arch(self) -> str:
        return self.model.arch

    def names(self) -> set[str]:
        return set(self.tensors)

    def check(self) -> None:
        """Raise FormatError if any shard changed since it was opened."""
        for s in self._shards:
            s.check(by_path=True)

    def _checked(self, name: str) -> tuple[TensorInfo, MappedFile]:
        info = self.tensors.get(name)
        if info is None:
            raise FormatError(f"{self.where}: missing tensor {name!r}")
        qtype = GGMLQuantizationType(info.ggml_type)
        shard = self._shards[info.shard]
        if qtype not in SUPPORTED:
            raise FormatError(f"{shard.path}: tensor {name!r} has type {qtype.name}, which the engine "
                              "cannot dequantize")
        shard.check(by_path=True)
        if shard.mm is None or info.offset + info.nbytes > shard.size:
            raise FormatError(f"{shard.path}: tensor {name!r} data past end of file")
        return info, shard

    def tensor(self, name: str, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
        """One tensor dequantized to `dtype` on `device`, numpy row-major shape (ggml reversed)."""
        info, shard = self._checked(name)
        qtype = GGMLQuantizationType(info.ggml_type)
        raw = shard.view(info.offset, info.nbytes)
        try:
            bad = self._nonfinite(name, raw)    # read here anyway: checked before it is used
            t = dequantize(raw, qtype, tuple(info.shape), dtype) if bad is None else None
        finally:
            del raw
            shard.release(info.offset, info.nbytes)   # unmapped here; the page cache decides the rest
        if bad is not None:
            raise bad                  # raised with no frame holding the mapped view (close() needs that)
        assert t is not None
        self.trunk_bytes_read += info.nbytes
        dev = torch.device(device)
        return t if dev.type == "cpu" else t.to(dev)

    def raw(self, name: str, copy: bool = False) -> torch.Tensor:
        """One tensor's bytes, exactly as stored, as a contiguous CPU uint8 tensor (ggml type and
        shape: `self.tensors[name]`), without dequantizing.

        Default: a zero-copy view of a private mapping of its shard (see the module doc); the
        view keeps the mapping alive, so it stays valid after `close()`. `copy=True`: read once
        into an owned buffer (pread: nothing mapped). Counted in `trunk_bytes_read` either way.
        """
        info, shard = self._checked(name)
        if copy:
            out = np.empty(info.nbytes, np.uint8)
            shard.pread_into(out, info.offset)
        else:
            out = self._mapped(name, info, shard)
        self.trunk_bytes_read += info.nbytes
        return torch.from_numpy(out)

    def _mapped(self, name: str, info: TensorInfo, shard: MappedFile) -> np.ndarray:
        """A tensor's bytes as a view of a private mapping of just its range (made on demand).

        One mapping per tensor, not per shard: a private (MAP_PRIVATE) mapping is charged to
        the commit limit at its full size, so under the kernel's default overcommit heuristic
        mapping a whole 45 GB shard on a 24 GB machine fails with ENOMEM, while a tensor's range
        (at most a few GB) maps fine. ACCESS_COPY: torch gets a writable buffer without a
        warning, and a stray write would copy one page instead of faulting; pages only read stay
        the page cache's. A numpy view holds a buffer export, so the mapping cannot be unmapped
        under a live tensor (mmap.close() refuses; see close()).
        """
        mm = self._raw_maps.get(name)
        start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
        if mm is None:
            try:
                mm = mmap.mmap(shard.fd, info.offset + info.nbytes - start, access=mmap.ACCESS_COPY,
                               offset=start)
            except OSError as e:
                raise K3Error(f"{shard.path}: cannot map tensor {name!r} ({info.nbytes} bytes): "
                              f"{e.strerror or e}") from None
            self._raw_maps[name] = mm
        return np.frombuffer(mm, np.uint8, info.nbytes, info.offset - start)

    def check_finite(self, name: str, raw: np.ndarray | torch.Tensor | None = None) -> None:
        """Raise CorruptBlockError ("FILE: tensor 'NAME': Q8_0 block N ... has a non-finite
        scale") if any block of the tensor would dequantize to inf/NaN.

        Reads only the scale bytes (k3kit.gguf.quants.first_nonfinite_block), but those are
        spread over every page of a quantized tensor: callers run it when the bytes are read
        anyway (dequantization at load, the first product of a quantized layer). `raw`: the
        tensor's bytes if the caller holds them (CPU), else they are viewed in the mapping.
        """
        info, shard = self._checked(name)
        bad = self._nonfinite(name, self._mapped(name, info, shard) if raw is None else raw)
        if bad is not None:
            raise bad

    def check_row_finite(self, name: str, row: int) -> None:
        """check_finite for one ggml row (`shape[0]` values) of a 2-D tensor, the block index
        counted over the whole tensor (an embedding checks only the rows it looked up)."""
        info, shard = self._checked(name)
        qtype = GGMLQuantizationType(info.ggml_type)
        row_bytes = info.nbytes // int(info.shape[1])
        first = row * (int(info.shape[0]) // quants.type_size(qtype)[0])
        rows = self._mapped(name, info, shard)[row * row_bytes:(row + 1) * row_bytes]
        bad = self._nonfinite(name, rows, first)
        del rows
        if bad is not None:
            raise bad

    def _nonfinite(self, name: str, raw: np.ndarray | torch.Tensor,
                   first_block: int = 0) -> quants.CorruptBlockError | None:
        """The error to raise if a block of `raw` (tensor `name`'s bytes, or a run of its blocks
        starting at block `first_block`) would dequantize to inf/NaN, else None. Returned, not
        raised, so that no frame of the traceback holds a view of the mapping."""
        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        if qtype not in quants.scales.CHECKED:
            return None
        data = raw.numpy() if isinstance(raw, torch.Tensor) else raw
        elems, nbytes = quants.type_size(qtype)
        i = quants.first_nonfinite_block(data, qtype, data.size // nbytes * elems)
        del data, raw
        if i is None:
            return None
        kind = "value" if qtype in quants.scales.FLOATS else "block"
        what = "is not finite" if kind == "value" else "has a non-finite scale"
        return quants.CorruptBlockError(
            f"{self._shards[info.shard].path}: tensor {name!r}: {qtype.name} {kind} {first_block + i} "
            f"{what} (inf/NaN); the file is corrupt", qtype, first_block + i)

    def expert_store(self, layers: Mapping[int, Sequence[str]], *, cache_mib: float,
                     dtype: torch.dtype, device: torch.device | str, cold: bool | str,
                     keep: str = "dequantized", arith: str = "", cpu_layers: Collection[int] = (),
                     cpu_keep: str = "quantized") -> ExpertStore:
        """ExpertStore over 3-D expert tensors, named per layer in the order `get` returns them."""
        try:
            return ExpertStore.from_gguf(self.model, layers, cache_mib=cache_mib, dtype=dtype,
                                         device=device, cold=cold, keep=keep, arith=arith,
                                         cpu_layers=cpu_layers, cpu_keep=cpu_keep)
        except ValueError as e:
            raise FormatError(f"{self.where}: {e}") from None

    def close(self) -> None:
        for mm in self._raw_maps.values():
            with contextlib.suppress(BufferError):   # views still held (a quantized trunk): the
                mm.close()                           # mapping goes when the last one does
        self._raw_maps = {}
        for s in self._shards:
            s.close()
        self._shards = []
        self.model.close()


def release_pages(store: ExpertStore, layer: int, expert: int) -> None:
    """Drop the mapped file pages of one expert from this process: `ExpertStore.release`.

    Kept for callers written before the store did this itself on every miss (its default).
    """
    store.release(layer, expert)


def limit_heap_retention(threshold: int = 1 << 20) -> bool:
    """Serve allocations >= `threshold` with their own mmap, so freeing them returns the memory.

    glibc raises its mmap threshold after each large free (up to 32 MiB), after which the
    multi-MiB transients of expert reads and dequantization come from the heap and stay in
    the resident set when freed (fragmented arenas): measured at +300-500 MiB of RSS over a
    few tokens of a K3-geometry slice. Fixing the threshold keeps RSS at trunk + cache + a
    small margin. No-op (False) off glibc.
    """
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    if not name or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(-3, int(threshold)))   # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
