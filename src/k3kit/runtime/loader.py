"""GGUF -> a runnable model: trunk tensors dequantized once, routed experts left in the file.

The loader is model-neutral. It opens the (sharded) GGUF header-only, finds the adapter
registered for `general.architecture`, and hands it a `GGUFSource`: a way to get one trunk
tensor as a torch tensor in the compute dtype on a device, and a way to build an
`ExpertStore` over the expert tensors the adapter names. The adapter (in `k3kit.models.*`)
knows what the tensors mean; nothing here does.

Memory: every shard is mapped with plain mmap (no MAP_POPULATE, no WILLNEED on the file);
a trunk tensor's pages are faulted in while it is dequantized and dropped from this process
(MADV_DONTNEED) right after, so resident memory is the dequantized trunk, not the trunk
twice. The page cache keeps whatever the kernel wants to keep.

Adapters register themselves by architecture name: a module `k3kit.models.<pkg>.adapter`
with `ARCHITECTURES` (names) and `load(source, options)`. Discovery imports only those modules.
"""

from __future__ import annotations

import importlib
import mmap
import os
import pkgutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType

from k3kit.errors import FormatError, K3Error
from k3kit.gguf.reader import KV, TensorInfo
from k3kit.gguf.shards import Model
from k3kit.runtime.dequant import SUPPORTED, dequantize
from k3kit.runtime.experts import ExpertStore
from k3kit.runtime.qmatmul import native_available

PAGE = mmap.PAGESIZE
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


EXPERT_KERNELS = ("auto", "native", "torch")


def expert_keep(kernel: str, devices: Sequence[torch.device]) -> str:
    """`--expert-kernel` -> the ExpertStore's keep mode.

    native: experts stay quantized in the cache and multiply through the native kernel
            (k3kit.runtime.qmatmul); CPU only, needs the extension built at install.
    torch:  experts are dequantized to the compute dtype on a miss and cached that way.
    auto:   native when it is built and every device is the CPU, else torch.
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
    if kernel == "auto" and native_available() and on_cpu:
        return "quantized"
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


class _Shard:
    """One mapped shard file; remembers size and mtime to notice changes under the mapping."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        st = os.fstat(self.fd)
        self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
        self.mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ) if self.size else None

    def check(self) -> None:
        st = os.stat(self.path)
        if st.st_size != self.size or st.st_mtime_ns != self.mtime_ns:
            raise FormatError(f"{self.path}: file changed while the model was loaded "
                              f"(size {self.size} -> {st.st_size})")

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        os.close(self.fd)


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
        self._shards = [_Shard(p) for p in self.model.paths]
        self.trunk_bytes_read = 0

    @property
    def arch(self) -> str:
        return self.model.arch

    @property
    def where(self) -> str:
        return str(self.model.paths[0])

    def names(self) -> set[str]:
        return set(self.tensors)

    def check(self) -> None:
        """Raise FormatError if any shard changed since it was opened."""
        for s in self._shards:
            s.check()

    def tensor(self, name: str, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
        """One tensor dequantized to `dtype` on `device`, numpy row-major shape (ggml reversed)."""
        info = self.tensors.get(name)
        if info is None:
            raise FormatError(f"{self.where}: missing tensor {name!r}")
        qtype = GGMLQuantizationType(info.ggml_type)
        shard = self._shards[info.shard]
        if qtype not in SUPPORTED:
            raise FormatError(f"{shard.path}: tensor {name!r} has type {qtype.name}, which the engine "
                              "cannot dequantize")
        shard.check()
        if shard.mm is None or info.offset + info.nbytes > shard.size:
            raise FormatError(f"{shard.path}: tensor {name!r} data past end of file")
        raw = np.frombuffer(shard.mm, np.uint8, info.nbytes, info.offset)
        try:
            t = dequantize(raw, qtype, tuple(info.shape), dtype)
        finally:
            del raw
            lo = info.offset // PAGE * PAGE
            try:   # drop the mapped pages from this process; the page cache decides the rest
                shard.mm.madvise(mmap.MADV_DONTNEED, lo, info.offset + info.nbytes - lo)
            except (OSError, AttributeError, ValueError):
                pass
        self.trunk_bytes_read += info.nbytes
        dev = torch.device(device)
        return t if dev.type == "cpu" else t.to(dev)

    def expert_store(self, layers: Mapping[int, Sequence[str]], *, cache_mib: float,
                     dtype: torch.dtype, device: torch.device | str, cold: bool | str,
                     keep: str = "dequantized") -> ExpertStore:
        """ExpertStore over 3-D expert tensors, named per layer in the order `get` returns them."""
        try:
            return ExpertStore.from_gguf(self.model, layers, cache_mib=cache_mib, dtype=dtype,
                                         device=device, cold=cold, keep=keep)
        except ValueError as e:
            raise FormatError(f"{self.where}: {e}") from None

    def close(self) -> None:
        for s in self._shards:
            s.close()
        self._shards = []
        self.model.close()


def release_pages(store: ExpertStore, layer: int, expert: int) -> None:
    """Drop the mapped file pages of one expert from this process: `ExpertStore.release`.

    Kept for callers written before the store did this itself on every miss (its default).
    """
    store.release(layer, expert)


# -- adapter registry -------------------------------------------------------------------------

Loader = Callable[[GGUFSource, LoadOptions], Any]
_ADAPTERS: dict[str, Loader] = {}


def register_adapter(arch: str, load: Loader) -> None:
    _ADAPTERS[arch] = load


def _discover() -> None:
    import k3kit.models as models
    for info in pkgutil.iter_modules(models.__path__):
        if not info.ispkg:
            continue
        name = f"k3kit.models.{info.name}.adapter"
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        for arch in getattr(mod, "ARCHITECTURES", ()):
            _ADAPTERS.setdefault(arch, mod.load)


def adapter_for(arch: str, where: str = "gguf") -> Loader:
    if arch not in _ADAPTERS:
        _discover()
    if arch not in _ADAPTERS:
        known = ", ".join(sorted(_ADAPTERS)) or "none"
        raise FormatError(f"{where}: architecture {arch!r} has no engine adapter (known: {known})")
    return _ADAPTERS[arch]


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


def load_model(path: str | os.PathLike, options: LoadOptions | None = None) -> Any:
    """Open a GGUF and return its architecture's adapter (which owns the source from then on)."""
    options = options or LoadOptions()
    limit_heap_retention()
    source = GGUFSource(path)
    try:
        return adapter_for(source.arch, source.where)(source, options)
    except BaseException:
        source.close()
        raise
