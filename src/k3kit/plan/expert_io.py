"""`--expert-io`: whether routed experts are read through the page cache or into k3kit's own cache.

Two ways to stream experts from storage, chosen per run:

* `page`: the file is mapped and read through the kernel's page cache, which then holds the hot
  experts (an LRU the kernel keeps). Right when the routed experts fit the RAM left: after the
  first touch everything is a page-cache hit, and a miss served as a view of the mapping copies
  nothing.
* `direct`: O_DIRECT reads straight into the buffers of k3kit's own expert cache (the device
  writes the bytes where the products read them: no page-cache pages allocated, copied out and
  dropped on the cores the products need). Right when they do not fit: measured on the 52.4 GB
  K3 file at 2.07x RAM, `page` delivered 0.25 of the disk's limit and `direct` 0.69, at a third
  of the peak RSS of llama.cpp's mmap (benchmarks/bench_out_of_core.py).

`auto` (the default) decides at load from the model's headers and this machine's MemAvailable
(or what this process's control group has left, where a container's limit allows less):
`direct` when the routed experts do not fit the RAM left after the trunk, a headroom for the
process (KV/state, activations, torch) and the expert cache; `page` when they do.

The expert cache budget, unless `--expert-cache-mib` names one, is sized from the same figure
(what `k3kit plan` calls the RAM left for experts): with `direct` all of that RAM, since the page
cache gets nothing of the experts; with `page` what the page cache does not need to hold every
expert, at least the old fixed 256 MiB. On a GPU the cache holds dequantized experts in VRAM, so
its default stays 256 MiB there.

The price of a large cache is its growth: until it is full every miss gets a fresh buffer, and
fresh pages cost the kernel ~1 s of system CPU per GB here (5.6 GB of planned O_DIRECT misses on
the 52.4 GB K3 file: 5.9-6.2 s of system time with a 15 GiB cache, 0.6-1.2 s with a 1 GiB one
whose evicted buffers are reused). On a 2-core machine that is taken from the products: an 8-token
run decoded at 0.21 tok/s with the sized cache against 0.40 with 1 GiB. A long run (a server) pays
it once, and then the cache serves what it holds (a third of that file's experts, so with uniform
routing a third of the picks) without a read; `--expert-cache-mib` picks the other side.

Header reads only (numpy, no torch): deciding costs milliseconds before the model loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3kit.errors import K3Error
from k3kit.plan.cgroup import group_memory
from k3kit.plan.units import fmt_bytes

MODES = ("auto", "page", "direct")
MIB, GIB = 1 << 20, 1 << 30
MIN_CACHE = 256 * MIB          # the fixed default before sizing from RAM; the floor of a sized cache
HEADROOM = 2 * GIB             # this process beside the trunk and the caches: torch, KV/state, activations
HEADROOM_SHARE = 0.1           # ... or this share of the RAM available, whichever is larger


@dataclass(frozen=True)
class ExpertIO:
    """The read path and the expert cache budget for one run, and why."""

    mode: str                  # "page" or "direct"
    asked: str                 # "auto", "page" or "direct"
    cache_bytes: int           # the expert cache budget
    cache_from: str            # "--expert-cache-mib", "RAM left" or "GPU default"
    routed_bytes: int          # the model's routed-expert bytes
    trunk_bytes: int
    available: int             # RAM available when decided (MemAvailable), 0 if unknown
    ram_left: int              # available - reserved - trunk - headroom: what experts and caches may use
    reserved: int = 0          # RAM the process's other caches take (the server's prompt cache)

    @property
    def cold(self) -> bool | str:
        """The `LoadOptions.cold` / `ExpertStore` read mode this stands for."""
        return "direct" if self.mode == "direct" else False

    @property
    def announce(self) -> bool:
        """Whether a command says the choice unasked: when `auto` left the page cache for direct reads
        (what a user asked for is not news, and a model that fits runs as it always did)."""
        return self.asked == "auto" and self.mode == "direct"

    @property
    def cache_mib(self) -> float:
        return self.cache_bytes / MIB

    def reason(self) -> str:
        if self.asked != "auto":
            return f"--expert-io {self.asked}"
        if not self.available:
            return "RAM unknown here: the page cache"
        fits = "fit" if self.mode == "page" else "do not fit"
        left = fmt_bytes(max(self.ram_left, 0))
        reserved = f" - prompt cache {fmt_bytes(self.reserved)}" if self.reserved else ""
        return (f"routed experts {fmt_bytes(self.routed_bytes)} {fits} the {left} of RAM left: "
                f"{fmt_bytes(self.available)} available{reserved} - trunk {fmt_bytes(self.trunk_bytes)} - "
                f"headroom {fmt_bytes(headroom(self.available))}")

    def line(self) -> str:
        """The one line a command prints (stderr) or logs when it loads a model."""
        path = ("O_DIRECT into k3kit's expert cache" if self.mode == "direct"
                else "the page cache (mapped)")
        return (f"expert I/O: {self.mode}, {path} ({self.reason()}); expert cache "
                f"{self.cache_bytes / MIB:.0f} MiB ({self.cache_from})")

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "asked": self.asked, "cache_bytes": self.cache_bytes,
                "cache_from": self.cache_from, "routed_expert_bytes": self.routed_bytes,
                "trunk_bytes": self.trunk_bytes, "available_bytes": self.available,
                "ram_left_bytes": self.ram_left, "reason": self.reason()}


def headroom(available: int) -> int:
    return max(HEADROOM, int(HEADROOM_SHARE * available))


def choose(*, asked: str, routed_bytes: int, trunk_bytes: int, available: int,
           cache_mib: float | None = None, on_gpu: bool = False, reserved: int = 0) -> ExpertIO:
    """The read path and the cache budget for a model of these sizes on a machine with `available`
    bytes of RAM (0: unknown). `cache_mib` is an explicit --expert-cache-mib (None: size it);
    `reserved`: bytes the process's other caches will take (a server's prompt cache), which the
    expert cache and the page cache must leave to them."""
    if asked not in MODES:
        raise K3Error(f"--expert-io {asked!r}: expected one of {', '.join(MODES)}")
    if cache_mib is not None and not cache_mib >= 0:
        raise K3Error(f"--expert-cache-mib {cache_mib}: must be >= 0")
    reserved = max(reserved, 0) if available else 0
    ram_left = available - reserved - trunk_bytes - headroom(available) if available else 0
    explicit = int(cache_mib * MIB) if cache_mib is not None else None
    if asked != "auto":
        mode = asked
    elif not available:
        mode = "page"
    else:
        cache = explicit if explicit is not None else MIN_CACHE
        mode = "page" if routed_bytes + cache <= ram_left else "direct"
    if explicit is not None:
        cache_bytes, cache_from = explicit, "--expert-cache-mib"
    elif on_gpu or not available:
        cache_bytes, cache_from = MIN_CACHE, "GPU default" if on_gpu else "fixed default"
    elif mode == "direct":
        cache_bytes, cache_from = max(MIN_CACHE, min(ram_left, routed_bytes)), "RAM left"
    else:
        cache_bytes = max(MIN_CACHE, min(ram_left - routed_bytes, routed_bytes))
        cache_from = "RAM left beside the page cache"
    return ExpertIO(mode, asked, int(cache_bytes), cache_from, routed_bytes, trunk_bytes, available, ram_left,
                    reserved)


def mem_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (RAM the kernel can give without swapping, reclaimable
    page cache included), or less where this process's control group allows less (a container's
    memory limit, which /proc/meminfo does not show: k3kit.plan.cgroup); 0 where neither is known."""
    avail = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    group = group_memory()
    if group is not None:
        avail = min(avail, group.available) if avail else group.available
    return avail


def model_bytes(path: str | Path) -> tuple[int, int]:
    """(routed-expert bytes, all other tensor bytes) of a GGUF model, from its headers."""
    from k3kit.gguf import format as fmt
    from k3kit.plan.facts import open_model

    with open_model(path) as model:
        routed = trunk = 0
        for t in model.tensors.values():
            if fmt.is_routed_expert(t.name):
                routed += t.nbytes
            else:
                trunk += t.nbytes
    return routed, trunk


def for_model(path: str | Path, asked: str, cache_mib: float | None, device: str = "cpu",
              available: int | None = None, cpu_moe: int = 0, reserved: int = 0) -> ExpertIO:
    """`choose` for a model file on this machine now: `available`, else K3KIT_MEM_AVAILABLE, else
    MemAvailable. With a GPU and `cpu_moe` -1 (--cpu-moe: every routed expert in RAM, the trunk
    in VRAM) the experts and their cache are sized against RAM as on the CPU, the trunk apart."""
    if asked not in MODES:
        raise K3Error(f"--expert-io {asked!r}: expected one of {', '.join(MODES)}")
    routed, trunk = model_bytes(path)
    avail = ram_available() if available is None else available
    on_gpu = any(d.strip() and not d.strip().startswith("cpu") for d in device.split(","))
    if on_gpu and cpu_moe < 0:
        on_gpu, trunk = False, 0
    return choose(asked=asked, routed_bytes=routed, trunk_bytes=trunk, available=avail,
                  cache_mib=cache_mib, on_gpu=on_gpu, reserved=reserved)


def for_plan(routed_bytes: int, trunk_bytes: int, ram_free: int, ram_total: int) -> ExpertIO:
    """The choice `auto` would make on a planned box: `ram_free` is the placement's RAM left after
    the trunk, KV/state and the reserve (the experts' budget)."""
    left = max(ram_free, 0)
    mode = "page" if routed_bytes + MIN_CACHE <= left else "direct"
    cache = (max(MIN_CACHE, min(left, routed_bytes)) if mode == "direct"
             else max(MIN_CACHE, min(left - routed_bytes, routed_bytes)))
    return ExpertIO(mode, "auto", cache, "RAM left", routed_bytes, trunk_bytes, ram_total, left)


def ram_available() -> int:
    """The RAM a run sizes its caches from: K3KIT_MEM_AVAILABLE where set, else `mem_available()`."""
    available = env_available()
    return mem_available() if available is None else available


def env_available() -> int | None:
    """K3KIT_MEM_AVAILABLE (bytes), the RAM `auto` decides with instead of MemAvailable: lets a test or
    a shared machine's owner say how much of the RAM this run may count on."""
    v = os.environ.get("K3KIT_MEM_AVAILABLE")
    if v is None or not v.strip():
        return None
    try:
        n = int(v)
    except ValueError:
        raise K3Error(f"K3KIT_MEM_AVAILABLE={v!r}: expected a number of bytes") from None
    if n < 0:
        raise K3Error(f"K3KIT_MEM_AVAILABLE={v!r}: must be >= 0")
    return n
