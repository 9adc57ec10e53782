"""The glue between model files and the runtime: which adapter opens which architecture.

`ADAPTERS` is the registry table, `general.architecture` -> the module that implements it.
Such a module has `load(source: GGUFSource, options: LoadOptions)`, which builds the model
object (a CausalModel + Target, or a Draft: k3kit.runtime.protocols) from the open file and
owns the source from then on (the object's close() closes it). A module is imported only
when a file of its architecture is opened, so `k3kit inspect` never pays for torch models
it does not run. Adding an architecture = a module here + one line in the table.

`load_model(path, options)` opens a file, runs its adapter and hands back a `LoadedModel`:
the model object plus what the CLI, the benchmarks and the server need around it (text
codec, expert ledger, memory figures, expert kernel, check, close).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3kit.errors import FormatError
from k3kit.gguf.format import ARCH_DFLASH, ARCH_KIMI_K3
from k3kit.runtime.experts import ExpertStats
from k3kit.runtime.loader import GGUFSource, LoadOptions, limit_heap_retention
from k3kit.runtime.protocols import CausalModel, Draft, ExpertBacked, ExpertLedger, LoadedModel, MemoryFigures
from k3kit.tokenizer.codec import TextCodec

ADAPTERS: dict[str, str] = {
    ARCH_KIMI_K3: "k3kit.adapters.kimi_k3",
    ARCH_DFLASH: "k3kit.adapters.dflash",
    # legacy drafts (Lucebox's converter), read as dflash like the seed's llama.cpp alias does
    "dflash-draft": "k3kit.adapters.dflash",
    "qwen35-dflash-draft": "k3kit.adapters.dflash",
}

Loader = Callable[[GGUFSource, LoadOptions], Any]


def adapter_for(arch: str, where: str = "gguf") -> Loader:
    """The `load` function of `arch`'s adapter module (imported now, on first use)."""
    module = ADAPTERS.get(arch)
    if module is None:
        known = ", ".join(sorted(ADAPTERS))
        raise FormatError(f"{where}: architecture {arch!r} has no engine adapter (known: {known})")
    return importlib.import_module(module).load


class Loaded:
    """A model file opened by its architecture's adapter (a k3kit.runtime.protocols.LoadedModel).

    The figures come from the model object where it has them (an ExpertBacked model streams
    its experts through a store); a model without experts reports zeros and kernel 'none'.
    The codec is built on first use: a draft usually has no tokenizer of its own.
    """

    def __init__(self, path: Path, source: GGUFSource, model: Any) -> None:
        self.path = path
        self.architecture: str = source.arch
        self.model: CausalModel | Draft = model
        self._close: Callable[[], None] = model.close
        self._source = source
        self._codec: TextCodec | None = None
        # asked once: a runtime protocol's isinstance walks its members (~10 us), and a server
        # reads the ledger after every pass
        self._ledger = model if isinstance(model, ExpertLedger) else None

    @property
    def codec(self) -> TextCodec:
        if self._codec is None:
            self._codec = TextCodec(self._source.raw_kv, str(self.path))
        return self._codec

    @property
    def expert_kernel(self) -> str:
        return self.model.expert_kernel if isinstance(self.model, ExpertBacked) else "none"

    @property
    def kernels(self) -> dict[str, dict[str, str]]:
        """{"trunk": {ggml type: kernel}, "experts": {...}} where the adapter says (else empty)."""
        fn = getattr(self.model, "kernels", None)
        return fn() if callable(fn) else {}

    def stats(self) -> ExpertStats:
        return self._ledger.expert_stats() if self._ledger is not None else ExpertStats()

    def memory(self) -> MemoryFigures:
        return self.model.memory() if isinstance(self.model, ExpertBacked) else MemoryFigures()

    def reset_expert_cache(self, cache_mib: float | None = None) -> None:
        """Empty the expert cache (optionally with a new budget in MiB) and zero its counters."""
        if isinstance(self.model, ExpertBacked):
            self.model.reset_expert_cache(cache_mib)

    def check(self) -> None:
        """Raise FormatError if any file of the model changed since it was opened."""
        self._source.check()

    def close(self) -> None:
        self._close()

    def __enter__(self) -> Loaded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_model(path: str | os.PathLike, options: LoadOptions | None = None) -> Loaded:
    """Open a GGUF (any shard of it) and build its architecture's model object."""
    options = options or LoadOptions()
    limit_heap_retention()
    source = GGUFSource(path)
    try:
        model = adapter_for(source.arch, source.where)(source, options)
    except BaseException:
        source.close()
        raise
    return Loaded(Path(path), source, model)


if TYPE_CHECKING:
    _contract: type[LoadedModel] = Loaded     # the type checker holds Loaded to the protocol


__all__ = ["ADAPTERS", "Loaded", "adapter_for", "load_model"]
